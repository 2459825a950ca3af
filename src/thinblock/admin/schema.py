"""The control protocol's argument schema: one validator for every verb's arguments.

A control-socket client is not trusted to send sane JSON: a float size, a string
where a number belongs, 100 PiB or a nested object must each get one clear
sentence and change nothing, never reach the pool as a value it cannot handle.
`validate(verb, args)` checks names, types and ranges before run_verb calls the
verb; the verbs' own rules (a size a multiple of 512, an existing volume) still
apply after it.

A dump given to `pool restore` is untrusted in the same way (people edit and
pass them around): DUMP_POOL and DUMP_VOLUME are its fields' schemas, built of
the same checks, and `check_fields` applies a schema to a verb's arguments and
to a dump's records alike. What only the pool can judge (its block size, its
data store's size, origins, block ranges, shared blocks) is tools/dump.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from thinblock.core.pool import (
    MAX_BLOCK_SIZE,
    MAX_VOLUME_BYTES,
    MAX_VOLUME_SHOWN,
    MIN_BLOCK_SIZE,
    validate_volume_size,
)
from thinblock.core.space_policy import parse_percent, parse_when_full
from thinblock.errors import ThinblockError
from thinblock.meta.base import RESERVE_FULL
from thinblock.sizes import format_size

MAX_TEXT = 4096  # a shell command, a policy string, a name: never longer

Check = Callable[[str, object], None]


def _fail(name: str, want: str, value: object) -> None:
    shown = repr(value)
    raise ThinblockError(f"{name} must be {want}, not {shown[:60]}{'...' if len(shown) > 60 else ''}")


def text(name: str, value: object) -> None:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        _fail(name, f"a string of at most {MAX_TEXT} characters", value)


def name_text(name: str, value: object) -> None:
    if not isinstance(value, str):
        _fail(name, "a name of 1 to 128 characters", value)
    assert isinstance(value, str)
    if not value:
        raise ThinblockError(f"{name} is empty: a name has 1 to 128 characters")
    if len(value) > 128:
        raise ThinblockError(f"{name} is {len(value)} characters long: a name has 1 to 128")


def byte_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, f"a whole number of bytes from 1 to {MAX_VOLUME_SHOWN}", value)
    assert isinstance(value, int)
    if value > MAX_VOLUME_BYTES:
        raise ThinblockError(
            f"{name} {format_size(value)} is beyond the largest thinblock supports ({MAX_VOLUME_SHOWN})"
        )
    if value <= 0:
        raise ThinblockError(f"{name} must be at least 1 byte, not {value}")


def flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        _fail(name, "true or false", value)


def one_of(*choices: object) -> Check:
    def check(name: str, value: object) -> None:
        if not any(type(value) is type(c) and value == c for c in choices):
            _fail(name, " or ".join(repr(c) for c in choices), value)

    return check


def optional(inner: Check) -> Check:
    def check(name: str, value: object) -> None:
        if value is not None:
            inner(name, value)

    return check


def list_of(inner: Check) -> Check:
    def check(name: str, value: object) -> None:
        if not isinstance(value, list) or len(value) > 64:
            _fail(name, "a list of at most 64 items", value)
            return
        for item in value:
            inner(name, item)

    return check


def one_layer(name: str, value: object) -> None:
    """A backing file of a qcow2 import: FORMAT:PATH, FORMAT qcow2 or raw."""
    if not isinstance(value, str) or value.split(":", 1)[0] not in ("qcow2", "raw") or ":" not in value:
        _fail(name, "FORMAT:PATH items, FORMAT qcow2 or raw", value)
    text(name, value)


def reserve(name: str, value: object) -> None:
    if value in ("full", "none"):
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_VOLUME_BYTES:
        _fail(name, "a size in bytes, 'full' or 'none'", value)


def scalar(name: str, value: object) -> None:
    """A setting given as text or a number (the verb parses it)."""
    if isinstance(value, str):
        text(name, value)
    elif isinstance(value, bool) or not isinstance(value, int | float):
        _fail(name, "a string or a number", value)


def whole(low: int, high: int) -> Check:
    def check(name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            _fail(name, f"a whole number from {low} to {high}", value)

    return check


def block_size(name: str, value: object) -> None:
    whole(MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)(name, value)
    assert isinstance(value, int)
    if value & (value - 1):
        _fail(name, "a power of two", value)


def volume_size(name: str, value: object) -> None:
    byte_size(name, value)
    assert isinstance(value, int)
    validate_volume_size(value)


def timestamp(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        _fail(name, "a time in seconds since 1970", value)


def percent(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(name, "a percentage between 0 and 100", value)
    parse_percent(str(value))


def when_full(name: str, value: object) -> None:
    text(name, value)
    assert isinstance(value, str)
    parse_when_full(value)


def autogrow_pair(name: str, value: object) -> None:
    """The superblock's autogrow: [STEP_BYTES, MAX_BYTES] (the pool checks STEP against its block size)."""
    if not isinstance(value, list) or len(value) != 2:
        _fail(name, "a list [STEP_BYTES, MAX_BYTES]", value)
    assert isinstance(value, list)
    for item in value:
        byte_size(name, item)


def reserve_bytes(name: str, value: object) -> None:
    """A reservation as stored: bytes, or RESERVE_FULL (the whole size)."""
    if value != RESERVE_FULL:
        whole(0, MAX_VOLUME_BYTES)(name, value)


def list_of_lists(name: str, value: object) -> None:
    if not isinstance(value, list) or not all(isinstance(item, list) for item in value):
        _fail(name, "a list of lists", value)


KIND = optional(one_of("volume", "snapshot"))
DETECT = one_of("off", "on", "unmap")

# verb -> {argument: (check, required)}
SCHEMAS: dict[str, dict[str, tuple[Check, bool]]] = {
    "status": {},
    "pool_grow": {"size_bytes": (byte_size, True)},
    "pool_set": {
        "when_full": (when_full, False),
        "low_water": (optional(scalar), False),
        "on_low_water": (optional(text), False),
        "autogrow": (optional(text), False),
    },
    "pool_dump": {},
    "volume_list": {"kind": (KIND, False)},
    "volume_info": {"name": (name_text, True)},
    "volume_map": {
        "name": (name_text, True),
        "columns": (whole(1, 4096), True),
        "max_rows": (whole(1, 4096), True),  # and columns * max_rows <= MAX_CELLS (allocation_map)
    },
    "volume_create": {"name": (name_text, True), "size_bytes": (byte_size, True), "detect_zeroes": (DETECT, False)},
    "volume_remove": {"name": (name_text, True), "kind": (KIND, False)},
    "volume_resize": {"name": (name_text, True), "size_bytes": (byte_size, True), "allow_shrink": (flag, False)},
    "volume_rename": {
        "name": (name_text, True),
        "new_name": (name_text, True),
        "kind": (one_of("volume", "snapshot"), True),
    },
    "volume_set": {
        "name": (name_text, True),
        "detect_zeroes": (optional(DETECT), False),
        "reserve": (optional(reserve), False),
        "low_water": (optional(scalar), False),
        "on_low_water": (optional(text), False),
    },
    "volume_clone": {"snapshot": (name_text, True), "name": (name_text, True)},
    "volume_rollback": {"name": (name_text, True), "snapshot": (name_text, True)},
    "snapshot_create": {"volume": (name_text, True), "name": (name_text, True)},
    "delta": {"source": (name_text, True), "target": (name_text, True)},
    "fuse_mount": {"mountpoint": (text, True)},
    "volume_release": {"name": (name_text, True)},
    "pool_follow": {},
    "grants_idle_back": {},
    "open_clients": {},
    # jobs (admin/jobs.py): they also take open files and report progress
    "import": {
        "name": (name_text, True),
        "source_kind": (one_of("file", "stream", "nbd", "qcow2", "rbd"), True),
        "source": (text, True),
        "size_bytes": (optional(byte_size), False),
        "force": (flag, False),
        "max_size_bytes": (optional(byte_size), False),
        "backing": (list_of(one_layer), False),
    },
    "export": {
        "name": (name_text, True),
        "dest_kind": (one_of("file", "stream", "nbd"), True),
        "dest": (text, True),
        "format": (one_of("raw", "rbd"), False),
        "fresh": (flag, False),
        "snapshots": (flag, False),
    },
    "export_diff": {
        "name": (name_text, True),
        "dest": (text, True),
        "from_snap": (optional(name_text), False),
        "version": (one_of(1, 2), False),
    },
    "import_diff": {
        "name": (name_text, True),
        "source": (text, True),
        "force": (flag, False),
        "allow_resize": (flag, False),
        "max_size_bytes": (optional(byte_size), False),
    },
    "volume_sparsify": {"name": (name_text, True)},
}


# A dump's records (tools/dump.py). data_path and the identity of the pool are taken
# as text here and never used: the pool's own location decides them.
DUMP_POOL: dict[str, tuple[Check, bool]] = {
    "block_size": (block_size, True),
    "size_bytes": (byte_size, True),
    "data_path": (optional(text), False),
    "created": (optional(timestamp), False),
    "when_full": (optional(when_full), False),
    "low_water": (optional(percent), False),
    "on_low_water": (optional(text), False),
    "autogrow": (optional(autogrow_pair), False),
    "transaction_id": (optional(whole(0, 1 << 62)), False),
    "pool_uuid": (optional(text), False),
}
DUMP_VOLUME: dict[str, tuple[Check, bool]] = {
    "id": (whole(1, 1 << 62), True),
    "name": (name_text, True),  # and the names rule of its kind (tools/dump.py)
    "kind": (one_of("volume", "snapshot"), True),
    "origin_id": (optional(whole(1, 1 << 62)), True),
    "size_bytes": (volume_size, True),
    "detect_zeroes": (DETECT, True),
    "created": (timestamp, True),
    "reserve_bytes": (reserve_bytes, True),
    "low_water": (optional(percent), True),
    "on_low_water": (optional(text), True),
    "mappings": (list_of_lists, True),
}


# How validate's sentences call an argument: what the user typed or would say
# (--max-size, "the name"), never the protocol's key (max_size_bytes). A dump's
# fields keep their keys: those are what its file holds.
TERMS = {
    "name": "the name",
    "volume": "the volume name",
    "snapshot": "the snapshot name",
    "from_snap": "--from-snap",
    "size_bytes": "the size",
    "max_size_bytes": "--max-size",
    "detect_zeroes": "--detect-zeroes",
    "reserve": "--reserve",
    "low_water": "--low-water",
    "on_low_water": "--on-low-water",
    "autogrow": "--autogrow",
    "when_full": "--when-full",
    "allow_shrink": "--allow-shrink",
    "allow_resize": "--allow-resize",
    "force": "--force",
    "dest": "the destination",
    "mountpoint": "the mount point",
}
VERB_TERMS = {("volume_create", "size_bytes"): "volume size", ("volume_resize", "size_bytes"): "volume size"}
VERB_TERMS |= {("pool_grow", "size_bytes"): "pool size", ("import", "size_bytes"): "--size"}


def check_fields(
    what: str, schema: dict[str, tuple[Check, bool]], fields: object, terms: dict[str, str] | None = None
) -> None:
    """ThinblockError starting with what (a verb's arguments, a dump's record), or
    nothing; terms: what to call each argument in the sentence (default its key)."""
    if not isinstance(fields, dict):
        raise ThinblockError(f"{what}: an object of named fields was expected, not {type(fields).__name__}")
    unknown = sorted(str(k) for k in set(fields) - set(schema))
    if unknown:
        raise ThinblockError(f"{what}: unknown argument(s) {', '.join(unknown)[:200]}")
    for arg, (check, required) in schema.items():
        if arg not in fields:
            if required:
                raise ThinblockError(f"{what}: {(terms or {}).get(arg, arg)} is required")
            continue
        try:
            check((terms or {}).get(arg, arg), fields[arg])
        except ThinblockError as exc:
            raise ThinblockError(f"{what}: {exc}") from None


def validate(verb: str, args: dict[str, Any]) -> None:
    """ThinblockError naming the command (`volume create`) and the argument in the
    user's terms, or nothing."""
    schema = SCHEMAS.get(verb)
    if schema is None:
        raise ThinblockError(f"unknown administration verb {verb[:60]!r}")
    terms = {arg: VERB_TERMS.get((verb, arg), TERMS.get(arg, arg.replace("_", " "))) for arg in schema}
    check_fields(verb.replace("_", " "), schema, args, terms)
