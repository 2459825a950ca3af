"""Pools in memory (`memory:NAME`), for tests: the memory metadata and data
stores, held in this process's registry so that a pool can be closed and
reopened by name. Nothing survives the process."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

from thinblock.backends.base import Location, Ownership
from thinblock.errors import PoolBusyError, ThinblockError
from thinblock.meta.base import Transaction
from thinblock.meta.memory import MemoryMetadata, MemoryMetaState
from thinblock.runtime import private_runtime_dir
from thinblock.store.base import DataStore
from thinblock.store.hostspace import HostSpace, NoHostSpace
from thinblock.store.memory import MemoryStore
from thinblock.store.owned import OwnedStore


@dataclasses.dataclass
class _Held:
    meta: MemoryMetaState
    data: MemoryStore
    tail: MemoryStore = dataclasses.field(default_factory=lambda: MemoryStore(1 << 40))  # header, births
    owner: str | None = None
    sharers: int = 0  # owners per volume (own_shared)


_POOLS: dict[str, _Held] = {}
_LOCK = threading.Lock()


class _Claim(Ownership):
    def __init__(self, held: _Held) -> None:
        self._held: _Held | None = held

    def release(self) -> None:
        with _LOCK:
            if self._held is not None:
                self._held.owner = None
                self._held = None


class _SharedClaim(Ownership):
    def __init__(self, held: _Held) -> None:
        self._held: _Held | None = held

    def release(self) -> None:
        with _LOCK:
            if self._held is not None:
                self._held.sharers -= 1
                self._held = None


class MemoryLocation(Location):
    """`memory:NAME`; `memory:NAME?native=punch,zero` picks the store's native verbs."""

    def __init__(self, rest: str) -> None:
        self.name = f"memory:{rest}"
        key, _, options = rest.partition("?")
        self.slot = key
        self.native: tuple[str, ...] | None = None
        if options.startswith("native="):
            self.native = tuple(v for v in options[len("native=") :].split(",") if v)

    def _held(self) -> _Held:
        held = _POOLS.get(self.slot)
        if held is None:
            raise ThinblockError(f"no pool at {self.name}")
        return held

    def runtime_dir(self) -> str:
        return private_runtime_dir("memory", f"{os.getpid()}-{self.slot}")  # its sockets are the owner's alone

    def exists(self) -> bool:
        return self.slot in _POOLS

    def create(self, superblock: dict[str, Any], size_bytes: int, device: str | None) -> None:
        if device is not None:
            raise ThinblockError("a memory pool has no data device")
        with _LOCK:
            if self.slot in _POOLS:
                raise ThinblockError(f"a pool already exists at {self.name}")
            data = MemoryStore(size_bytes) if self.native is None else MemoryStore(size_bytes, native=self.native)
            _POOLS[self.slot] = _Held(MemoryMetadata.create(superblock).state, data)

    def remove_created(self) -> None:
        with _LOCK:
            _POOLS.pop(self.slot, None)

    def open_meta(self, *, readonly: bool) -> MemoryMetadata:
        return MemoryMetadata(self._held().meta, readonly=readonly)

    def open_data(self, superblock: dict[str, Any], *, readonly: bool = False) -> DataStore:
        return self._held().data.reopen()

    def owned_store(self, superblock: dict[str, Any], store: DataStore) -> OwnedStore:
        tail = self._held().tail.reopen()
        return OwnedStore(store, int(superblock["block_size"]), tail=tail, fixed_header_offset=0)

    def data_name(self, superblock: dict[str, Any]) -> str:
        return f"{self.name} (data)"

    def own(self, purpose: str, *, takeover: bool = False) -> Ownership:
        with _LOCK:
            held = self._held()
            if held.owner is not None:
                raise PoolBusyError(f"pool {self.name} is already held ({held.owner})")
            if held.sharers:
                raise PoolBusyError(f"pool {self.name} is served per volume by {held.sharers} owner(s)")
            held.owner = purpose or "a thinblock pool object"
            return _Claim(held)

    def own_shared(self, purpose: str) -> Ownership:
        with _LOCK:
            held = self._held()
            if held.owner is not None:
                raise PoolBusyError(f"pool {self.name} is already held whole ({held.owner})")
            held.sharers += 1
            return _SharedClaim(held)

    def served_per_volume(self) -> bool:
        held = _POOLS.get(self.slot)
        return held is not None and held.sharers > 0

    def is_owned(self) -> bool:
        held = _POOLS.get(self.slot)
        return held is not None and held.owner is not None

    def host(self, superblock: dict[str, Any]) -> HostSpace:
        return NoHostSpace()

    def replace_meta(self, superblock: dict[str, Any], txn: Transaction, *, keep: str | None = None) -> str | None:
        meta = MemoryMetadata.create(superblock)
        meta.commit(txn)
        self._held().meta = meta.state
        return None

    def removal(self, superblock: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        return [{"kind": "memory pool", "name": self.name, "bytes": None}], []

    def remove_pool(self, superblock: dict[str, Any], ownership: Ownership) -> None:
        ownership.release()
        self.remove_created()

    def keep_copy(self) -> str:
        return f"{self.name} (no copy kept in memory)"
