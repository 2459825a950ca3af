"""`volume info` and `volume map`: one volume's figures and lineage, and a picture of it.

Both go through the administration verbs (volume_info, volume_map), so they
answer alike on a pool at rest and on one a server holds; this module only
formats and draws (pictures.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

from thinblock.core.allocation_map import MAX_CELLS, cell_runs
from thinblock.errors import ThinblockError
from thinblock.frontends.cli import pictures
from thinblock.frontends.cli.common import UsageError, admin_call, emit
from thinblock.sizes import format_size

Add = Callable[..., argparse.ArgumentParser]

PICTURE_COLUMNS, PICTURE_ROWS = 256, 256
TERMINAL_ROWS = 8  # "a few lines"
PIPED_COLUMNS = 64


# ----- volume info ------------------------------------------------------------------------


def _human_info(info: dict[str, Any]) -> str:
    def size(key: str) -> str:
        return format_size(info[key])

    reserve = info["reserve"]
    low = info["low_water_percent"]
    rows = [
        ("name", info["name"]),
        ("kind", info["kind"]),
        ("origin", info["origin"] or "-"),
        ("size", size("size_bytes")),
        ("block size", size("block_size")),
        ("mapped", size("mapped_bytes")),
        ("data", size("data_bytes")),
        ("zeroed", size("zeroed_bytes")),
        ("provisioned", size("provisioned_bytes")),
        ("exclusive", size("exclusive_bytes")),
        ("shared", size("shared_bytes")),
        ("reserve", reserve if isinstance(reserve, str) else format_size(reserve) if reserve else "none"),
        ("reserved now", size("reserved_bytes")),
        ("detect zeroes", info["detect_zeroes"]),
        ("low-water mark", "none" if low is None else f"{low:g}%"),
        ("created", datetime.datetime.fromtimestamp(info["created"]).isoformat(sep=" ", timespec="seconds")),
        ("snapshots", ", ".join(info["snapshots"]) or "-"),
        ("clones", ", ".join(info["clones"]) or "-"),
        ("open clients", "unknown" if info["open_clients"] is None else str(info["open_clients"])),
    ]
    width = max(len(k) for k, _ in rows) + 1
    return "\n".join(f"{(k + ':').ljust(width)} {v}" for k, v in rows)


def cmd_volume_info(args: argparse.Namespace) -> None:
    emit(args, admin_call(args.pool, "volume_info", name=args.name), _human_info)


# ----- volume map -------------------------------------------------------------------------


def cmd_volume_map(args: argparse.Namespace) -> None:
    out = args.output
    kind = None
    if out is not None:
        kind = os.path.splitext(out)[1].lower().lstrip(".")
        if kind not in ("png", "svg"):
            raise UsageError(f"cannot tell the picture's format from {out!r}: name it FILE.png or FILE.svg")
    colour = out is None and pictures.colour_wanted(sys.stdout)
    if out is not None:
        columns, rows = PICTURE_COLUMNS, PICTURE_ROWS
    elif sys.stdout.isatty():
        columns, rows = max(16, shutil.get_terminal_size().columns), TERMINAL_ROWS
    else:
        columns, rows = PIPED_COLUMNS, TERMINAL_ROWS
    columns, rows = args.width or columns, args.height or rows
    if columns * rows > MAX_CELLS:
        raise UsageError(f"--width {columns} x --height {rows} is more than the {MAX_CELLS} cells a map may hold")
    m = admin_call(args.pool, "volume_map", name=args.name, columns=columns, max_rows=rows)
    result: dict[str, Any] = {**{k: v for k, v in m.items() if k != "cells"}, "runs": cell_runs(m["cells"])}
    if kind is not None:
        result["picture"] = {"file": out, **_write_picture(out, kind, args.pool, m)}
    if args.json:
        print(json.dumps({**result, "cells": m["cells"]}, indent=1))
    elif kind is not None:
        print(f"wrote {out}: {pictures.headline(args.pool, m)}")
        print(pictures.figures_line(m))
    else:
        print(pictures.text_map(args.pool, m, colour))


def _write_picture(path: str, kind: str, pool: str, m: dict[str, Any]) -> dict[str, int]:
    """Write the picture beside path, then rename it there: a failure leaves no half picture."""
    write = pictures.write_png if kind == "png" else pictures.write_svg
    directory, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{base}.{os.getpid()}.tmp")
    try:
        layout = write(tmp, pool, m)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ThinblockError(f"cannot write the map to {path}: {exc.strerror or exc}") from None
    return layout


def _cells_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 4096:
        raise argparse.ArgumentTypeError(f"invalid number of cells {text!r}: a whole number from 1 to 4096")
    return value


def register(vol_sub: Any, add: Add) -> None:
    p = add(vol_sub, "info", cmd_volume_info, "show one volume or snapshot: space, settings, lineage, clients")
    p.add_argument("name", metavar="NAME", help="a volume or a snapshot")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = add(
        vol_sub,
        "map",
        cmd_volume_map,
        "draw a volume's allocation (data, zeroed, unmapped, shared) as a PNG, an SVG or on the terminal",
    )
    p.add_argument("name", metavar="VOLUME", help="a volume or a snapshot")
    p.add_argument(
        "-o", "--output", metavar="FILE.png|FILE.svg", help="write a picture (default: a map on standard output)"
    )
    p.add_argument(
        "--width",
        type=_cells_arg,
        metavar="N",
        help=f"cells per row (default {PICTURE_COLUMNS} in a picture, the terminal's width on one, {PIPED_COLUMNS} piped)",
    )
    p.add_argument(
        "--height",
        type=_cells_arg,
        metavar="N",
        help=f"rows at most (default {PICTURE_ROWS} in a picture, {TERMINAL_ROWS} as text); blocks per cell follow",
    )
    p.add_argument("--json", action="store_true", help="the cells and figures as JSON (with -o: and the layout)")
