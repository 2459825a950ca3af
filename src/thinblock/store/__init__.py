"""Data stores: the byte space a pool's blocks live in (contract in store/base.py).

`STORES` is the registry the contract suite runs over; a new store is one module
and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thinblock.store.base import DataStore
from thinblock.store.file import FileStore
from thinblock.store.memory import MemoryStore


def _rados(*args: Any, **kwargs: Any) -> DataStore:
    from thinblock.store.rados import RadosStore  # librados is loaded only when used

    return RadosStore(*args, **kwargs)


STORES: dict[str, Callable[..., DataStore]] = {
    "file": FileStore,
    "memory": MemoryStore,
    "rados": _rados,
}
