"""The metadata store's contract: what a pool keeps besides its blocks' bytes.

A metadata store holds the superblock (a small dict of JSON values), the
volumes, each volume's root table, the mapping pages and the refcount pages,
and changes them only by `commit()` of one `Transaction`, atomically. It knows
tables and rows, nothing of the block contract. Check, dump, restore and repair
reach it only through this interface: the walk (`volumes`, `all_roots`,
`all_pages`, `refcount_pages`), `integrity_problems` and `replace`.

Implementations: meta/sqlite.py (the embedded default) and meta/memory.py (for
tests). tests/test_meta_contract.py runs the same suite against each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from thinblock.errors import ThinblockError

# Format 3 added the kept exclusive-block counters (VolumeRow.exclusive_blocks and
# exclusive_epoch, the superblock's sharing_epoch) and allows compact mapping pages;
# older formats are upgraded when opened for writing, newer ones are refused.
FORMAT_VERSION = 3


def check_format(version: object, where: str) -> int:
    """The metadata format, or one sentence refusing one this thinblock does not know."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ThinblockError(f"{where} has metadata format {version!r}, which is not a thinblock format")
    if version > FORMAT_VERSION:
        raise ThinblockError(
            f"{where} has metadata format {version}, newer than this thinblock's {FORMAT_VERSION}:"
            " open it with the thinblock that made it, or a newer one"
        )
    return version


def initial_superblock(superblock: dict[str, Any]) -> dict[str, Any]:
    """A new pool's superblock: the format and transaction 0, then the given keys."""
    return {"format_version": FORMAT_VERSION, "transaction_id": 0, **superblock}


@dataclass
class VolumeRow:
    id: int
    name: str
    size_bytes: int
    detect_zeroes: str
    created: float
    data_blocks: int = 0
    zeroed_blocks: int = 0
    pinned_blocks: int = 0
    kind: str = "volume"  # or "snapshot" (read-only)
    origin_id: int | None = None  # the volume a snapshot was taken of, the snapshot a clone came from
    reserve_bytes: int = 0  # RESERVE_FULL follows the size
    low_water: float | None = None  # percent of the size left unmapped
    on_low_water: str | None = None
    # Mapped blocks this volume holds alone (page and dblock refcount 1): always a lower
    # bound, exact when exclusive_epoch is the pool's sharing_epoch or the count equals
    # the mapped blocks (core/volume.py says how it is kept). -1: never known exactly.
    exclusive_blocks: int = 0
    exclusive_epoch: int = -1


RESERVE_FULL = -1


@dataclass
class Transaction:
    """Everything one commit writes; filled by the pool, applied atomically."""

    superblock: dict[str, object] = field(default_factory=dict)
    volumes: list[VolumeRow] = field(default_factory=list)
    deleted_volumes: list[int] = field(default_factory=list)
    roots: dict[tuple[int, int], int | None] = field(default_factory=dict)  # None deletes
    pages: dict[int, tuple[int, bytes] | None] = field(default_factory=dict)  # None deletes
    refcount_pages: dict[int, bytes] = field(default_factory=dict)
    page_refcounts: dict[int, int] = field(default_factory=dict)  # refcount-only changes (snapshots)


class MetadataStore(ABC):
    """One pool's metadata. Reads may run from several threads at once; commits
    are one at a time (the pool serialises them)."""

    @abstractmethod
    def superblock(self) -> dict[str, Any]:
        """The superblock as of the last commit (format_version, block_size,
        size_bytes, transaction_id and the pool's settings)."""

    @abstractmethod
    def volumes(self) -> list[VolumeRow]:
        """Every volume and snapshot, sorted by name."""

    @abstractmethod
    def roots(self, volume_id: int) -> dict[int, int]:
        """One volume's root table: page index -> page id."""

    @abstractmethod
    def all_roots(self) -> Iterator[tuple[int, int, int]]:
        """(volume id, page index, page id) of every root table entry."""

    @abstractmethod
    def page(self, page_id: int) -> tuple[int, bytes] | None:
        """(refcount, entries blob) of a mapping page, or None if it does not exist."""

    @abstractmethod
    def page_refcounts(self, page_ids: Iterable[int]) -> dict[int, int]:
        """Page id -> refcount of those of page_ids that exist, read in batches without
        their entries (a snapshot shares every page of a volume by their counts alone)."""

    @abstractmethod
    def pages(self, page_ids: Iterable[int]) -> dict[int, tuple[int, bytes]]:
        """Page id -> (refcount, entries blob) of those of page_ids that exist: page() in
        batches (a snapshot's removal needs the entries of every page it leaves alone)."""

    @abstractmethod
    def all_pages(self) -> Iterator[tuple[int, int, bytes]]:
        """(page id, refcount, entries blob) of every mapping page."""

    @abstractmethod
    def max_page_id(self) -> int:
        """The largest page id ever committed (0 for none): new ids go above it."""

    @abstractmethod
    def max_volume_id(self) -> int:
        """The largest volume id committed (0 for none)."""

    @abstractmethod
    def refcount_pages(self) -> dict[int, bytes]:
        """Refcount page index -> blob of uint32 counts."""

    @abstractmethod
    def commit(self, txn: Transaction) -> None:
        """Apply the whole transaction atomically, or nothing of it. A failure is an
        OSError (ENOSPC when the layer below is full, else EIO) and leaves the store
        exactly as before; the same transaction may be committed again."""

    @abstractmethod
    def integrity_problems(self) -> list[str]:
        """What the store's own consistency check finds (empty when sound)."""

    @abstractmethod
    def close(self) -> None:
        """Release the store; it is unusable afterwards."""
