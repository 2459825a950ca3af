"""Names that become host paths: one rule, checked where the path is built.

A volume's name reaches the host's filesystem (its FUSE file under the pool's
runtime directory, which `attach` binds a loop device to and `mkfs` writes).
The names rule (core/pool.py validate_name) already keeps such names tame, but
a name can come from metadata that was edited or restored, so the path is
checked again where it is made: `pathlib`'s `mnt / "/srv/x.img"` is
"/srv/x.img", and `os.path.join(mnt, "../x")` leaves mnt. `child_path` joins a
name to its directory so that the result is always a direct child of it.
"""

from __future__ import annotations

import os
from pathlib import Path

from thinblock.errors import ThinblockError


def safe_name_problem(name: str) -> str | None:
    """Why name cannot be a file name inside a directory, or None when it can."""
    if not name:
        return "it is empty"
    if "/" in name or "\0" in name:
        return "it contains '/' or NUL"
    if name.startswith("."):
        return "it starts with '.'"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "it contains a control character"
    if len(name.encode(errors="surrogateescape")) > 255:
        return "it is longer than 255 bytes"
    return None


def child_path(directory: str | Path, name: str) -> Path:
    """directory/name, refusing (one sentence) a name that could leave directory."""
    problem = safe_name_problem(name)
    if problem is None:
        path = Path(os.path.join(directory, name))
        if path.parent == Path(directory) and path.name == name:
            return path
        problem = "it does not stay inside the directory"
    raise ThinblockError(f"refusing the name {name[:80]!r} as a file in {directory}: {problem}")
