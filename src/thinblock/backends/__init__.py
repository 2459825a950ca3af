"""Backends: where pools live. `locate(locator)` picks one by the locator's scheme.

    /any/path, ./pool    a directory: sparse file or raw device + SQLite (backends/directory.py)
    memory:NAME          in this process's memory, for tests (backends/memory.py)
    rados:CEPHPOOL/NAME  in a Ceph cluster (backends/rados.py)

A new backend is one module and one line in BACKENDS.
"""

from __future__ import annotations

from collections.abc import Callable

from thinblock.backends.base import Location, Ownership
from thinblock.backends.directory import DirLocation
from thinblock.backends.memory import MemoryLocation


def _rados(rest: str) -> Location:
    from thinblock.backends.rados import RadosLocation  # librados is loaded only for rados: pools

    return RadosLocation(rest)


BACKENDS: dict[str, Callable[[str], Location]] = {
    "memory": MemoryLocation,
    "rados": _rados,
}

__all__ = ["BACKENDS", "Location", "Ownership", "locate"]


def locate(locator: str | Location) -> Location:
    """The Location a locator names: `SCHEME:REST` for a registered scheme, else a path."""
    if isinstance(locator, Location):
        return locator
    scheme, sep, rest = locator.partition(":")
    if sep and scheme in BACKENDS:
        return BACKENDS[scheme](rest)
    return DirLocation(locator)
