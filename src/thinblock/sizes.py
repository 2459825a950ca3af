"""Human sizes in and out: `64K`, `10G`, `1T` (powers of 1024), plain bytes; and
durations read from the environment (THINBLOCK_*_S), in one place with their bounds."""

from __future__ import annotations

import math
import os
import re

from thinblock.errors import ThinblockError

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50, "E": 1 << 60}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGTPE]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse `64K`, `10G`, `1TiB`, `4096` into bytes; raise ThinblockError otherwise."""
    match = _SIZE_RE.match(text)
    if not match:
        raise ThinblockError(f"invalid size {text!r}: use a whole number with an optional unit K, M, G, T, P or E")
    number, unit = match.groups()
    return int(number) * _UNITS[unit.upper()]


_BEYOND_E = 1024 * 1024**6  # 1024E: far past any device; a figure above it is shown as "over 1024E"


def format_size(n_bytes: int) -> str:
    """The shortest exact form when there is one (`64K`), else one decimal (`1.5G`);
    a negative figure (a difference) keeps its sign and its unit (`-936M`)."""
    if n_bytes < 0:
        return "-" + format_size(-n_bytes)
    if n_bytes > _BEYOND_E:
        # A typed size can have hundreds of digits: shown whole it is unreadable, and
        # divided as a float it overflows (a traceback instead of the sentence).
        return f"over {_BEYOND_E // _UNITS['E']}E"
    for unit in ("E", "P", "T", "G", "M", "K"):
        scale = _UNITS[unit]
        if n_bytes >= scale:
            if n_bytes % scale == 0:
                return f"{n_bytes // scale}{unit}"
            return f"{n_bytes / scale:.1f}{unit}"
    return f"{n_bytes}B"


def format_exact(n_bytes: int) -> str:
    """format_size when it is exact (`32M`), else the bytes (`3000 bytes`): for a
    figure that is refused, where a rounded one would hide what was wrong with it."""
    shown = format_size(n_bytes)
    return shown if "." not in shown else f"{n_bytes} bytes"


MAX_DURATION_S = 86400.0  # a day: more is a mistake, and infinity overflows every timeout below


def env_seconds(name: str, default: float, minimum: float, maximum: float = MAX_DURATION_S) -> float:
    """The duration in environment variable `name` (seconds), default when unset or
    empty. A value that is not a number, not finite or outside [minimum, maximum] is
    refused with one sentence, never clamped: it is a mistake worth hearing about."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and minimum <= value <= maximum):
        raise ThinblockError(
            f"{name}={raw!r} is not a duration thinblock accepts: seconds from {minimum:g} to {maximum:g}"
        )
    return value
