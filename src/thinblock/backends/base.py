"""Where a pool lives: one metadata store, one data store, one owner at a time.

A *locator* string names a pool; `thinblock.backends.locate` turns it into a
`Location` of the backend its scheme names (a plain path is a directory). A
Location makes and opens the pool's two stores and hands out exclusive
ownership, and the core uses nothing else of it: adding a backend is one new
module under backends/ and one line in backends/__init__.py's registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from thinblock.errors import ThinblockError
from thinblock.meta.base import MetadataStore, Transaction
from thinblock.store.base import DataStore
from thinblock.store.hostspace import HostSpace
from thinblock.store.owned import OwnedStore

# What restore keeps the replaced metadata as (metadata.sqlite.before-restore, ...).
KEEP_BEFORE_RESTORE = "before-restore"


class Ownership(ABC):
    """The right to change a pool, held by one process (or pool object) at a time."""

    @abstractmethod
    def release(self) -> None:
        """Give the pool up; another may take it at once."""

    def watch_lost(self, lost: Callable[[str], None]) -> None:
        """Have lost(why) called (from another thread) if the ownership is lost while
        held: a Ceph pool's lease taken over, or this client fenced. A lock that lasts
        as long as its process is never lost."""
        return


class Location(ABC):
    """One pool's place. `name` is what messages call it (the locator as given)."""

    name: str
    takes_object_size = False  # whether the data store is made of objects of a chosen size
    # Whether fencing an owner off (a Ceph blocklist entry covers a client instance)
    # reaches its whole process: then each volume served per volume gets a process of
    # its own (serve runs a worker per volume), so fencing one fences nothing else.
    fences_per_process = False
    can_fence = False  # whether a live owner that does not answer can be fenced off (meta fence_volume)
    # Whether owners per volume may be on other hosts: requests reach them by RADOS
    # watch/notify (admin/notify.py) where no control socket of theirs is on this host.
    remote_owners = False

    def key(self) -> str:
        """The pool's identity on this host (runtime state is filed under it)."""
        return self.name

    @abstractmethod
    def runtime_dir(self) -> str:
        """The local directory for the sockets of the process that serves the pool."""

    def runtime_path(self) -> str | None:
        """Where runtime_dir() is, without making it (None: a place chosen per
        process, always short); create checks its sockets will fit there."""
        return None

    # How to get a shorter runtime_path, when its sockets would not fit.
    shorter_runtime_path = "choose a shorter path"

    @abstractmethod
    def exists(self) -> bool:
        """Whether a pool's metadata is there."""

    @abstractmethod
    def create(self, superblock: dict[str, Any], size_bytes: int, device: str | None) -> None:
        """Make an empty pool: a data store of size_bytes (or over `device`, cleared)
        and metadata holding superblock. All or nothing; refuses if one exists."""

    @abstractmethod
    def remove_created(self) -> None:
        """Undo create() (the new pool could not be opened): remove what it made."""

    @abstractmethod
    def open_meta(self, *, readonly: bool) -> MetadataStore:
        """The metadata store, or ThinblockError in one sentence ("no pool at ...")."""

    @abstractmethod
    def open_data(self, superblock: dict[str, Any], *, readonly: bool = False) -> DataStore:
        """The raw data store the superblock names (the pool adds the fallback layer)."""

    def owned_store(self, superblock: dict[str, Any], store: DataStore) -> OwnedStore:
        """The raw data store with its owner header and birth table (store/owned.py):
        by default in the tail of a file or device."""
        return OwnedStore(store, int(superblock["block_size"]), fixed_header_offset=None)

    def data_owner(self) -> str:
        """Who the data store's header names as owner: a pool whose name is its identity
        (RADOS) names itself, so a copy of its metadata under another name is refused;
        a directory's data lives inside it (empty: the uuid and generation decide)."""
        return ""

    @abstractmethod
    def data_name(self, superblock: dict[str, Any]) -> str:
        """How messages name the data store (a file or device path)."""

    @abstractmethod
    def own(self, purpose: str, *, takeover: bool = False) -> Ownership:
        """Take exclusive ownership, or PoolBusyError naming the holder and its purpose.
        takeover: fence a live holder off and take the pool anyway (where the backend can)."""

    def own_shared(self, purpose: str) -> Ownership:
        """Share the pool with other owners per volume (serve --volume): refused while a
        process owns it whole, and keeps any from owning it whole meanwhile."""
        raise ThinblockError(
            f"pool {self.name} cannot be served per volume: its backend keeps one owner per pool"
            " (serve it without --volume)"
        )

    def served_per_volume(self) -> bool:
        """Whether owners per volume share the pool right now (a probe that takes nothing)."""
        return False

    @abstractmethod
    def is_owned(self) -> bool:
        """Whether some process owns the pool right now (a probe that takes nothing)."""

    @abstractmethod
    def host(self, superblock: dict[str, Any]) -> HostSpace:
        """The layer under the data and metadata: free space and the metadata slack."""

    @abstractmethod
    def replace_meta(self, superblock: dict[str, Any], txn: Transaction, *, keep: str | None = None) -> str | None:
        """Restore and repair: metadata holding exactly superblock and txn replaces the
        current one atomically (the caller owns the pool): written beside it, then
        switched in; a failure before the switch leaves the old one as it was and no
        leftovers. keep (KEEP_BEFORE_RESTORE): the old one is kept under that label,
        replacing an earlier copy so labelled; returns where, or None."""

    @abstractmethod
    def keep_copy(self) -> str:
        """Repair: keep a copy of the current metadata; returns where it went."""

    def removal(self, superblock: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        """What `pool remove` deletes: items {"kind": "file"|"object"|..., "name", "bytes"
        (space it holds, or None when unknown)}, and sentences on what it leaves alone."""
        raise ThinblockError(f"pool {self.name} cannot be removed with 'pool remove'")

    def remove_pool(self, superblock: dict[str, Any], ownership: Ownership) -> None:
        """Delete what removal() lists; the caller owns the pool and has released
        nothing. The metadata goes last, so an interrupted removal can be run again."""
        raise ThinblockError(f"pool {self.name} cannot be removed with 'pool remove'")

    def local_paths(self, superblock: dict[str, Any]) -> list[str]:
        """Local files and directories holding the pool's bytes, which only its owner
        should be able to read (pool check warns otherwise); none for remote pools."""
        return []
