"""Which pool a data store belongs to, and how far its metadata has come (issue 21).

The data store itself carries a small *owner header*: the pool's uuid (made at
create, also in the superblock as `pool_uuid`), who owns it (a RADOS pool's
name; empty for a directory, whose data file lives inside it), and a
*generation*: the metadata's transaction_id as of the last commit. Beside it
lies the *birth table*: one uint64 per dblock, the generation in which the
dblock last got a new owner (allocated, or made exclusive again). Where:

- a file or raw device: the tail, past the pool's last block, so a dblock's
  offset stays dblock * block_size and `cp -r` copies the tail with the data:
  [dblocks][birth table][header, 4 KiB, ending the file or device]. A file's
  tail moves when the pool grows (`grow`); a device's sits at its end and is
  sized for the whole device.
- RADOS: objects far above any pool's data (RADOS_TAIL_OFFSET), under the same
  data prefix: `rados cp` of the metadata object copies no header, and the
  copy's header names its own pool as owner, so the copy is refused.

The header has two 512-byte slots, written alternately (gen % 2), each with a
CRC: a torn write leaves the other slot, one generation behind.

Why the generation check never refuses falsely. The commit writes the
metadata (durable when commit returns), and only then the header's generation,
made durable by the next data sync (no sync of its own). So after any crash or
power cut the data store's generation is <= the metadata's: a lost header
write only leaves it behind, never ahead. data_gen > meta_gen therefore means
the metadata went back in time (a deleted WAL, an older copy put back, a copy
taken while served), and that is refused.

Why a lag of one commit is harmless. Because of the lag, metadata rolled back
by exactly one commit may pass the check. It exposes nothing: the pool never
reuses a dblock freed in the open transaction (spacemap rule 1), so every
dblock the older metadata maps still holds that volume's bytes (or its own
later ones), and every dblock allocated in the lost commit is free in the
older metadata and is punched by the unclean open. What is lost is only what
that one commit recorded, as after a crash.

Why births make `repair --accept-rollback` safe. A dblock that older metadata
(generation G) maps to volume A can hold another volume's bytes only if, after
G, it was freed by a commit F > G and handed out again, or became exclusive to
one of its sharers and was written in place. Both are recorded in the birth
table with a generation > G, before the metadata commit that maps it (the
table is written with the data, ahead of the data sync). So dropping every
mapping whose dblock was born after G, and punching every free block, leaves
no volume reading another's bytes. A file pool's table restarts when the pool
grows with too little room to copy it (`births_since`); accepting metadata
older than that drops every mapping.

What it does not catch: data older than its metadata (a data file copied
before the metadata, or put back from an older copy). A data store's
generation legitimately trails the metadata's after a power cut, and a copy
of a live file is not one point in time (its header, at the end, is read
last), so no rule on the two numbers can tell that case apart safely.
"""

from __future__ import annotations

import dataclasses
import struct
import threading
import uuid as uuid_module
import zlib
from array import array
from collections.abc import Sequence

from thinblock.errors import NotSupportedError, ThinblockError
from thinblock.sizes import format_size
from thinblock.store.base import DataStore, FilterStore
from thinblock.zeros import ZERO_CHUNK_BYTES, zero_bytes

HEADER_BYTES = 4096
SLOT_BYTES = 512
RADOS_TAIL_OFFSET = 1 << 52  # 4 PiB: a RADOS pool's data stays below it
_MAGIC = b"thinblock-owner\n"
_VERSION = 1
_FIXED = struct.Struct("<16sIQ16sQQQH")  # magic, version, generation, uuid, births at, births blocks, since, owner len
_PAGE = 4096
_PAGE_ENTRIES = _PAGE // 8
_CACHED_PAGES = 4096  # 16 MiB of birth table pages at most
_COPY_BYTES = 1 << 20


def _round_up(n: int, to: int = _PAGE) -> int:
    return -(-n // to) * to


def births_bytes(n_blocks: int) -> int:
    return _round_up(8 * n_blocks)


def tail_bytes(n_blocks: int) -> int:
    """What a file or device holds past the pool's blocks for a pool of n_blocks."""
    return births_bytes(n_blocks) + HEADER_BYTES


def device_pool_limit(device_bytes: int, block_size: int) -> int:
    """The largest pool a device of device_bytes can hold beside its tail."""
    # The tail is sized for the whole device (fresh_layout), whatever the pool's size.
    tail = tail_bytes(-(-device_bytes // block_size))
    return max(0, (device_bytes - tail) // block_size) * block_size


@dataclasses.dataclass(frozen=True)
class Header:
    uuid: str  # hex
    owner: str
    generation: int
    births_offset: int
    births_blocks: int
    births_since: int  # births are recorded for every generation from this one on

    def encode(self) -> bytes:
        owner = self.owner.encode()
        body = _FIXED.pack(
            _MAGIC,
            _VERSION,
            self.generation,
            bytes.fromhex(self.uuid),
            self.births_offset,
            self.births_blocks,
            self.births_since,
            len(owner),
        )
        body += owner
        body += struct.pack("<I", zlib.crc32(body))
        if len(body) > SLOT_BYTES:
            raise ThinblockError(f"pool owner name {self.owner!r} is too long for the data store header")
        return body + bytes(SLOT_BYTES - len(body))

    @classmethod
    def decode(cls, slot: bytes) -> Header | None:
        """The header in one slot, or None when the slot holds none (or a torn one)."""
        if len(slot) < _FIXED.size or not slot.startswith(_MAGIC):
            return None
        _magic, version, gen, raw_uuid, at, blocks, since, owner_len = _FIXED.unpack_from(slot)
        end = _FIXED.size + owner_len
        if version != _VERSION or end + 4 > len(slot):
            return None
        (crc,) = struct.unpack_from("<I", slot, end)
        if crc != zlib.crc32(slot[:end]):
            return None
        try:
            owner = slot[_FIXED.size : end].decode()
        except UnicodeDecodeError:
            return None
        return cls(raw_uuid.hex(), owner, gen, at, blocks, since)


def _both_slots(header: Header) -> bytes:
    """The whole header region (it ends a file, so it is written whole)."""
    return (header.encode() * 2).ljust(HEADER_BYTES, b"\0")


class OwnedStore(FilterStore):
    """The data store with its owner header and birth table. `tail` reaches the same
    bytes as `inner` without its size limit (for RADOS, a store over the objects above
    RADOS_TAIL_OFFSET); `fixed_header_offset` is where a RADOS header lives (None: a
    file or device, whose header ends it)."""

    def __init__(
        self, inner: DataStore, block_size: int, *, tail: DataStore | None = None, fixed_header_offset: int | None
    ) -> None:
        super().__init__(inner)
        self.tail = tail or inner
        self.block_size = block_size
        self.fixed = fixed_header_offset
        self.header: Header | None = None
        self._at = 0  # where the header is
        self._pages: dict[int, bytearray] = {}  # birth table pages as written (write_births)
        self._lock = threading.Lock()  # births, header and a moving tail: one at a time

    def flush(self) -> None:
        self.inner.flush()
        if self.tail is not self.inner:  # its writes behind, and their failures
            self.tail.flush()

    # ----- where -------------------------------------------------------------------

    def _header_offset(self) -> int:
        if self.fixed is not None:
            return self.fixed
        return self.inner.size_bytes - HEADER_BYTES

    @property
    def size_bytes(self) -> int:
        if self.fixed is None and self.header is not None:
            return self.header.births_offset  # the blocks end where the tail begins
        return self.inner.size_bytes

    def fresh_layout(self, size_bytes: int, uuid: str, owner: str, generation: int, since: int) -> Header:
        """A new header for a pool of size_bytes: births past the blocks (a file), at the
        device's end (a device: sized for all of it), or at the fixed place (RADOS)."""
        if self.fixed is not None:
            return Header(uuid, owner, generation, self.fixed + max(HEADER_BYTES, 4 << 20), 0, since)
        end = self.inner.size_bytes
        if getattr(self.inner, "is_block_device", False):
            blocks = -(-end // self.block_size)
            at = end - HEADER_BYTES - births_bytes(blocks)
            if at < size_bytes:
                raise ThinblockError(
                    f"data device holds {end} bytes: no room for the pool's {tail_bytes(blocks)}-byte header"
                    f" and birth table past its {size_bytes} bytes"
                )
            return Header(uuid, owner, generation, at, blocks, since)
        at = _round_up(max(size_bytes, end))
        return Header(uuid, owner, generation, at, at // self.block_size, since)

    # ----- the header --------------------------------------------------------------

    def load(self, expected: int | None = None) -> Header | None:
        """Read the header (the newer valid slot); None if the store has none. expected:
        where the metadata says a file's header is, tried when the end has none (a grow
        cut short before its new tail was durable)."""
        for offset in (self._header_offset(), expected):
            if offset is None or offset < 0:
                continue
            raw = self.tail.pread(offset, 2 * SLOT_BYTES)
            found = [h for h in (Header.decode(raw[:SLOT_BYTES]), Header.decode(raw[SLOT_BYTES:])) if h is not None]
            if found:
                self.header = max(found, key=lambda h: h.generation)
                self._at = offset
                return self.header
        return None

    def format(self, header: Header) -> None:
        """Write a new header (both slots) and clear the birth table; the caller flushes."""
        with self._lock:
            self._clear(header.births_offset, births_bytes(header.births_blocks) if self.fixed is None else 0)
            at = self.fixed if self.fixed is not None else header.births_offset + births_bytes(header.births_blocks)
            self.tail.pwritev(at, [_both_slots(header)])
            self._pages.clear()
            self.header = header
            self._at = at

    def write_header(self, generation: int) -> None:
        """Record the metadata's generation after its commit: one slot, written behind
        (made durable by the next data sync, with no sync of its own)."""
        with self._lock:
            if self.header is None or generation <= self.header.generation:
                return
            self.header = dataclasses.replace(self.header, generation=generation)
            self.tail.write_behind(self._at + (generation % 2) * SLOT_BYTES, self.header.encode())

    # ----- births ------------------------------------------------------------------

    def write_births(self, runs: Sequence[tuple[int, int]], generation: int) -> None:
        """Record that the dblocks of runs got a new owner in generation; written behind,
        before the data sync that precedes the metadata commit mapping them. Writes go
        by table page (4 KiB, 512 dblocks), one write per page a commit touched, from a
        cache of the pages (read once, in one batch): random allocations cost a few
        writes per commit, not one per block."""
        if self.header is None or not runs:
            return
        word = struct.pack("<Q", generation)
        with self._lock:
            at = self.header.births_offset
            touched: dict[int, list[tuple[int, int]]] = {}
            for start, count in runs:
                end = start + count
                while start < end:
                    page = start // _PAGE_ENTRIES
                    n = min(end, (page + 1) * _PAGE_ENTRIES) - start
                    touched.setdefault(page, []).append((start - page * _PAGE_ENTRIES, n))
                    start += n
            if len(self._pages) + len(touched) > _CACHED_PAGES:
                self._pages.clear()
            missing = [page for page in touched if page not in self._pages]
            reads = self.tail.read_many([(at + page * _PAGE, _PAGE) for page in missing])
            for page, raw in zip(missing, reads, strict=True):
                self._pages[page] = bytearray(raw)
            for page, slots in touched.items():
                buf = self._pages[page]
                for slot, n in slots:
                    buf[8 * slot : 8 * (slot + n)] = word * n
                self.tail.write_behind(at + page * _PAGE, bytes(buf))

    def read_births(self, n_blocks: int) -> array[int]:
        """Each dblock's birth generation (0: born before the table's start)."""
        out = array("Q")
        if self.header is None:
            return array("Q", bytes(8 * n_blocks))
        at = self.header.births_offset
        done = 0
        while done < n_blocks:
            n = min(n_blocks - done, _COPY_BYTES // 8)
            out.frombytes(self.tail.pread(at + 8 * done, 8 * n))
            done += n
        return out

    def _clear(self, offset: int, length: int) -> None:
        """Make the range read zero with its space allocated (zero-range, else written
        zeros): births are written at every commit, and must never need new space from
        a host that filled up (the commit that frees space could not be written)."""
        if length <= 0:
            return
        try:
            self.tail.zero(offset, length)
        except NotSupportedError:
            end = offset + length
            while offset < end:
                n = min(ZERO_CHUNK_BYTES, end - offset)
                self.tail.pwritev(offset, [zero_bytes(n)])
                offset += n

    # ----- growing a file's tail ---------------------------------------------------

    def clear_interrupted_grow(self, pool_size_bytes: int) -> None:
        """At open: a file whose tail starts past the pool's last block was being grown
        when the process died (the new tail durable, the metadata's new size not yet
        committed). The old tail lies in what the next grow adds as blocks, which must
        read zero: clear it now, since that grow will find the tail already in place."""
        with self._lock:
            header = self.header
            if self.fixed is not None or header is None or getattr(self.inner, "is_block_device", False):
                return
            if header.births_offset > pool_size_bytes:
                self._clear(pool_size_bytes, header.births_offset - pool_size_bytes)
                self.inner.flush()

    def grow(self, new_size_bytes: int) -> None:
        with self._lock:
            old = self.header
            if self.fixed and new_size_bytes > self.fixed:  # RADOS: blocks stay below the tail's objects
                raise ThinblockError(
                    f"cannot grow the pool to {format_size(new_size_bytes)}: its data store keeps its owner"
                    f" header and birth table from {format_size(self.fixed)} on"
                )
            if self.fixed is not None or old is None or new_size_bytes <= old.births_offset:
                if old is None or self.fixed is not None:
                    self.inner.grow(new_size_bytes)
                return
            if getattr(self.inner, "is_block_device", False):
                # A device's tail is sized for the whole device and stays at its end:
                # the pool's blocks can never reach into it.
                raise ThinblockError(
                    f"cannot grow the pool to {format_size(new_size_bytes)}: its data device keeps its owner"
                    f" header and birth table past {format_size(old.births_offset)}"
                )
            blocks = new_size_bytes // self.block_size
            old_end = self._at + HEADER_BYTES
            since = old.births_since
            # The new header lands past the old tail's end (the table grows at least as
            # much as the blocks' end moves), so the old tail stays whole until it is durable.
            if new_size_bytes >= old_end:  # the new table does not overlap the old tail: copy it
                done = 0
                length = births_bytes(old.births_blocks)
                while done < length:
                    n = min(_COPY_BYTES, length - done)
                    self.tail.pwritev(new_size_bytes + done, [self.tail.pread(old.births_offset + done, n)])
                    done += n
            else:
                since = old.generation + 1  # too little room to copy: the table restarts here
            new = dataclasses.replace(old, births_offset=new_size_bytes, births_blocks=blocks, births_since=since)
            at = new_size_bytes + births_bytes(blocks)
            self.tail.pwritev(at, [_both_slots(new)])
            self.inner.flush()  # the new tail is durable before the old one goes
            self.header, self._at = new, at
            self._pages.clear()
            # The old tail lies in the new blocks (which must read zero) and, when it
            # overlaps, in the new table (which restarts at zero); the new table's
            # space is allocated (see _clear).
            self._clear(old.births_offset, old_end - old.births_offset)
            if new_size_bytes >= old_end:
                copied = births_bytes(old.births_blocks)
                self._clear(new_size_bytes + copied, births_bytes(blocks) - copied)
            else:
                self._clear(old_end, at - old_end)
            self.inner.flush()


def _expected_header(store: OwnedStore, superblock: dict[str, object]) -> int | None:
    """Where a file's header is by the metadata's size (tried when the end holds none)."""
    if superblock.get("pool_uuid") is None or store.fixed is not None:
        return None
    size = int(str(superblock["size_bytes"]))
    return size + births_bytes(size // store.block_size)


def refusal(header: Header | None, superblock: dict[str, object], owner: str, pool: str, data: str) -> str | None:
    """Why this metadata and this data store must not be served together (one
    sentence), or None. A superblock without pool_uuid (the format before owner
    headers) is refused only when its data store carries another pool's header."""
    uuid = superblock.get("pool_uuid")
    tid = int(str(superblock.get("transaction_id") or 0))
    if uuid is None:
        if header is not None and (header.owner != owner or header.generation > tid):
            return (
                f"pool {pool} cannot be opened: its data store {data} belongs to another pool"
                f" ({header.owner or 'uuid ' + header.uuid}), and its metadata names none"
            )
        return None
    if header is None:
        return (
            f"pool {pool} cannot be opened: its data store {data} carries no thinblock owner header, so it is"
            " not this pool's data (another pool's, or overwritten); put the pool's own data store back"
        )
    if header.uuid != uuid or header.owner != owner:
        return (
            f"pool {pool} cannot be opened: its data store {data} belongs to another pool"
            f" ({header.owner or 'uuid ' + header.uuid}); its metadata was copied from that pool, and serving"
            " both would let each overwrite the other's blocks"
        )
    if header.generation > tid:
        return (
            f"pool {pool} cannot be opened: its metadata (generation {tid}) is older than its data store"
            f" (generation {header.generation}): it was rolled back or copied back, and would serve freed or"
            f" other volumes' blocks; put the newest metadata back, or run 'thinblock pool repair"
            f" --accept-rollback {pool}' to accept it (blocks given out after generation {tid} then read as zeros)"
        )
    return None


def inspect(store: OwnedStore, superblock: dict[str, object], owner: str, pool: str, data: str) -> str | None:
    """Load the header and judge it (pool check: nothing is written)."""
    return refusal(store.load(_expected_header(store, superblock)), superblock, owner, pool, data)


def claim(store: OwnedStore, superblock: dict[str, object], owner: str, pool: str, data: str) -> str | None:
    """Check that the metadata (superblock) and the data store belong together and that
    the metadata is not older than the data; ThinblockError in one sentence if not.
    Returns a uuid to record in the superblock when a pool of the format before owner
    headers is adopted (its header is then written here; the caller flushes it)."""
    why = inspect(store, superblock, owner, pool, data)
    if why is not None:
        raise ThinblockError(why)
    if superblock.get("pool_uuid") is not None:
        return None
    if store.header is not None:  # an adoption cut short: finish it
        return store.header.uuid
    tid = int(str(superblock.get("transaction_id") or 0))
    fresh = uuid_module.uuid4().hex
    try:
        layout = store.fresh_layout(int(str(superblock["size_bytes"])), fresh, owner, tid, since=tid + 1)
    except ThinblockError as exc:
        raise ThinblockError(
            f"pool {pool} was made by an older thinblock and cannot take its owner header: {exc};"
            " move its data to a larger device (pool dump, create, restore) to use it"
        ) from None
    store.format(layout)
    return fresh
