"""The control protocol's argument schema: one validator for every verb's arguments.

A control-socket client is not trusted to send sane JSON: a float size, a string
where a number belongs, 100 PiB or a nested object must each get one clear
sentence and change nothing, never reach the pool as a value it cannot handle.
`validate(verb, args)` checks names, types and ranges before run_verb calls the
verb; the verbs' own rules (a size a multiple of 512, an existing volume) still
apply after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thinblock.core.pool import MAX_VOLUME_BYTES
from thinblock.errors import ThinblockError

MAX_TEXT = 4096  # a shell command, a policy string, a name: never longer

Check = Callable[[str, object], None]


def _fail(name: str, want: str, value: object) -> None:
    shown = repr(value)
    raise ThinblockError(f"{name} must be {want}, not {shown[:60]}{'...' if len(shown) > 60 else ''}")


def text(name: str, value: object) -> None:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        _fail(name, f"a string of at most {MAX_TEXT} characters", value)


def name_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not 1 <= len(value) <= 128:
        _fail(name, "a name of 1-128 characters", value)


def byte_size(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_VOLUME_BYTES:
        _fail(name, f"a whole number of bytes from 1 to {MAX_VOLUME_BYTES}", value)


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


KIND = optional(one_of("volume", "snapshot"))
DETECT = one_of("off", "on", "unmap")

# verb -> {argument: (check, required)}
SCHEMAS: dict[str, dict[str, tuple[Check, bool]]] = {
    "status": {},
    "pool_grow": {"size_bytes": (byte_size, True)},
    "pool_set": {
        "when_full": (optional(text), False),
        "low_water": (optional(scalar), False),
        "on_low_water": (optional(text), False),
        "autogrow": (optional(text), False),
    },
    "pool_dump": {},
    "volume_list": {"kind": (KIND, False)},
    "volume_create": {"name": (name_text, True), "size_bytes": (byte_size, True), "detect_zeroes": (DETECT, False)},
    "volume_remove": {"name": (name_text, True), "kind": (KIND, False)},
    "volume_resize": {"name": (name_text, True), "size_bytes": (byte_size, True), "allow_shrink": (flag, False)},
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


def validate(verb: str, args: dict[str, Any]) -> None:
    """ThinblockError naming the verb and the argument, or nothing."""
    schema = SCHEMAS.get(verb)
    if schema is None:
        raise ThinblockError(f"unknown administration verb {verb[:60]!r}")
    unknown = sorted(set(args) - set(schema))
    if unknown:
        raise ThinblockError(f"bad arguments for {verb}: unknown argument(s) {', '.join(unknown)[:200]}")
    for arg, (check, required) in schema.items():
        if arg not in args:
            if required:
                raise ThinblockError(f"bad arguments for {verb}: {arg} is required")
            continue
        try:
            check(arg, args[arg])
        except ThinblockError as exc:
            raise ThinblockError(f"bad arguments for {verb}: {exc}") from None
