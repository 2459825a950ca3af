"""A thin volume: the block contract of docs/architecture.md, in one place.

Every frontend (NBD, FUSE, CLI) calls these verbs and nothing else:
read, write, trim, write_zeroes, provision, block_status, flush.
Ranges are bytes and partial blocks are handled exactly.

Each mutating verb runs through one skeleton, `_mutate`:
  1. take the request's blocks in the volume's range lock (rangelock);
  2. under the pool lock, plan: a planner yields one `_Step` per block that
     changes, saying how many fresh dblocks it needs; they are taken at once
     (ENOSPC before any change), and each step fills in the `Change`;
  3. with no pool lock held, run the data I/O;
  4. under the pool lock, publish the new entries, only if all the I/O succeeded.
A failed request changes nothing: its fresh dblocks go back through the freed
path. Reads plan under the pool lock and read outside it, sharing their range.
One write skips the planner: within one DATA block the volume holds alone, it
changes no entry, so steps 2 and 4 reduce to looking the block up
(`_overwrite_in_place`); anything else about it goes the general way.

Two rules keep stale bytes out of reads:
  * UNMAPPED and ZEROED blocks are never read from the data store;
  * every dblock that can be handed out, and every ZEROED block's dblock, reads
    zero in the layer below (punched durably before reuse, see spacemap; zeroed
    when DATA becomes ZEROED), so a block entering DATA needs only its payload.
"""

from __future__ import annotations

import contextlib
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple, ParamSpec, TypeGuard

from thinblock.core.change import Change
from thinblock.core.exclusive import count_exclusive
from thinblock.core.mapping import (
    DBLOCK_SHIFT,
    PAGE_ENTRIES,
    STATE_MASK,
    BlockState,
    Page,
    entry_dblock,
    entry_pinned,
    entry_state,
    make_entry,
)
from thinblock.core.rangelock import RangeLock
from thinblock.core.runs import Runs
from thinblock.errors import (
    FreedSpacePending,
    GrantNeeded,
    NoSpaceError,
    NotSupportedError,
    OpError,
    RangeError,
    ReadOnlyError,
    is_no_space,
)
from thinblock.meta.base import VolumeRow
from thinblock.zeros import is_zero, zero_bytes

if TYPE_CHECKING:
    from thinblock.core.pool import Pool

_UNMAPPED, _ZEROED, _DATA = int(BlockState.UNMAPPED), int(BlockState.ZEROED), int(BlockState.DATA)
_P = ParamSpec("_P")
# Where an entry's state bits sit in its native bytes, and each low byte's state (_uniform_run).
_LOW_BYTE = 0 if sys.byteorder == "little" else 7
_STATE_OF_BYTE = bytes(b & STATE_MASK for b in range(256))


def _add_piece(pieces: list[list[int]], offset: int, length: int, store_off: int) -> None:
    """Append to a _sparse_plan, merging zeros with zeros and contiguous data."""
    if pieces:
        last = pieces[-1]
        if (last[2] < 0 and store_off < 0) or (last[2] >= 0 and last[2] + last[1] == store_off):
            last[1] += length
            return
    pieces.append([offset, length, store_off])


def _below_is_full(exc: BaseException) -> TypeGuard[OSError]:
    """A write's data I/O failed because the layer below is full (not an error of the
    pool's own, which is an OpError): the pool answers as if it were full itself."""
    return is_no_space(exc) and not isinstance(exc, OpError)


class _Step(NamedTuple):
    """One block's part of a planned request; `fill` turns it into I/O and entries.

    For a run of UNMAPPED blocks in an empty page (bulk provision), vblock..end
    are the first and last vblock and `fresh` is their number."""

    fill: Callable[[Volume, Change, _Step, Iterator[int]], None]
    vblock: int
    start: int
    end: int
    entry: int
    fresh: int  # fresh dblocks this step takes (0 or 1; a run's length for runs)
    piece: memoryview | None = None
    pin: bool = False


class Sparsified(NamedTuple):
    """What Volume.sparsify did, in bytes."""

    data_bytes: int  # whole DATA blocks examined
    unmapped_bytes: int  # became UNMAPPED: their space is free
    zeroed_bytes: int  # provisioned, so they became ZEROED (space stays reserved)
    shared_zero_bytes: int  # read zero but are shared with a snapshot or clone: left as they are


class Volume:
    """One thin volume of a pool. Obtain it from `Pool.volume(name)`."""

    def __init__(self, pool: Pool, row: VolumeRow, root: dict[int, int] | None = None) -> None:
        """root: the volume's root table; None loads the committed one on first use."""
        self.pool = pool
        self.row = row
        self._root = root  # page_index -> page_id; see the root property
        self.removed = False
        self.readonly = row.kind == "snapshot"
        # Kept by the pool (Pool.tallied): whether this volume's row is in the pool's
        # Totals, and what its reservation adds to the pool's reserved total.
        self.tallied = False
        self.set_aside_counted = 0
        # A staging volume that will replace another (import, import-diff) and the staging
        # volumes replacing this one: their blocks count toward this one's reservation
        # (core/reservation.py; linked by SpaceAccounts.stand_in).
        self.replaces: Volume | None = None
        self.replacements: list[Volume] = []
        # Who has it open (NBD connections, FUSE handles), by a description a refusal
        # names them with: removal, rollback and shrink wait for none (Export keeps it).
        self.holders: Counter[str] = Counter()
        self.ranges = RangeLock()  # requests in flight hold their blocks here (see _mutate)

    @property
    def users(self) -> int:
        """How many clients have it open."""
        return sum(self.holders.values())

    @property
    def root(self) -> dict[int, int]:
        """page_index -> page_id, read and changed under the pool lock like every mapping.

        Loaded from the metadata on first use, not when the pool opens: a command over
        a pool of 100,000 volumes touches a few root tables, not all of them. Until
        then the committed table is the volume's own (a commit writes only the root
        entries of volumes that changed, and those were loaded to change them). Loaded
        under the pool lock, so a load racing a change can never put an older table
        back over a newer one."""
        root = self._root
        if root is None:
            with self.pool.lock:
                root = self._root
                if root is None:
                    root = self._root = self.pool.txn.meta.roots(self.row.id)
        return root

    @property
    def loaded_root(self) -> dict[int, int] | None:
        """The root table if it is loaded (None: the committed one, not read yet)."""
        return self._root

    def reset_root(self, root: dict[int, int]) -> None:
        """The root table as just read from the store (a runtime claim, core/claim.py:
        the one loaded before may be older). Call under the pool lock."""
        self._root = root

    @property
    def name(self) -> str:
        return self.row.name

    @property
    def size_bytes(self) -> int:
        return self.row.size_bytes

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def __repr__(self) -> str:
        return f"<Volume {self.row.name} {self.row.size_bytes} bytes>"

    # ----- validation -------------------------------------------------------------

    def _check(self, offset: int, length: int, *, write: bool) -> None:
        if self.removed:
            raise RangeError(f"volume {self.row.name} was removed")
        if offset < 0 or length < 0 or offset + length > self.row.size_bytes:
            raise RangeError(f"range {offset}+{length} is outside volume {self.row.name} ({self.row.size_bytes} bytes)")
        if write and self.readonly:
            raise ReadOnlyError(f"volume {self.row.name} is read-only")

    # ----- entries ----------------------------------------------------------------

    def _entry(self, vblock: int) -> int:
        page_id = self.root.get(vblock // PAGE_ENTRIES)
        if page_id is None:
            return 0
        return self.pool.txn.page(page_id).entries[vblock % PAGE_ENTRIES]

    def _writable_page(self, page_index: int) -> Page:
        """The page for page_index, created or copied so this volume alone owns it."""
        pool = self.pool
        page_id = self.root.get(page_index)
        if page_id is None:
            page = pool.txn.new_page()
        else:
            page = pool.txn.pages.get(page_id) or pool.txn.page(page_id)
            if page.refcount == 1:
                return page
            pool.txn.ensure_page_id()  # the copy's id, before anything changes
            # Copy-on-write of a shared page: the copy references every dblock too.
            for entry in page.entries:
                if entry:
                    pool.accounts.space.incref(entry_dblock(entry))
            pool.txn.release_page(page_id)
            page = pool.txn.new_page(page.entries[:])
        self.root[page_index] = page.page_id
        pool.txn.mark_root_dirty(self, page_index)
        return page

    def _set_entry(self, vblock: int, new: int) -> None:
        """Point vblock at a new entry; the old dblock loses this reference if it changes.

        A new dblock must come from SpaceMap.allocate (which counted this reference).
        This runs once per changed block, so it is written for speed.
        """
        page_index, slot = divmod(vblock, PAGE_ENTRIES)
        page = self._writable_page(page_index)
        entries = page.entries
        old = entries[slot]
        if old == new:
            return
        entries[slot] = new
        if (old ^ new) & 0b111:  # the state or the pin changes
            self._count_states(old, new)
        if (
            not old or not new or entry_dblock(old) != entry_dblock(new)
        ):  # the dblock changes (dblock 0 is a dblock too)
            space = self.pool.accounts.space
            exclusive = 0
            if old:
                # This page is the volume's alone now (_writable_page), so the old entry
                # was exclusive exactly when its dblock had no other holder. Its count
                # reaching 1 gains someone unknown: decref bumps the sharing epoch.
                if space.refcounts[entry_dblock(old)] == 1:
                    exclusive -= 1
                space.decref(entry_dblock(old))
            if new:
                exclusive += 1  # a fresh dblock, in a page this volume alone holds
            if exclusive:
                self.row.exclusive_blocks += exclusive
                if self.row.reserve_bytes or self.replaces is not None:
                    self.pool.accounts.retally_set_aside(self)
        self.pool.txn.page_changed(self, page_index, page)

    def _count_states(self, old: int, new: int) -> None:
        """The row's block counters (and the pool's totals) follow one entry's change."""
        row = self.row
        data = (entry_state(new) == _DATA) - (entry_state(old) == _DATA)
        zeroed = (entry_state(new) == _ZEROED) - (entry_state(old) == _ZEROED)
        pinned = entry_pinned(new) - entry_pinned(old)
        row.data_blocks += data
        row.zeroed_blocks += zeroed
        row.pinned_blocks += pinned
        if self.tallied:
            totals = self.pool.volumes.totals
            totals.data_blocks += data
            totals.zeroed_blocks += zeroed
            totals.pinned_blocks += pinned

    def _shares_page(self, vblock: int) -> bool:
        page_id = self.root.get(vblock // PAGE_ENTRIES)
        return page_id is not None and self.pool.txn.page(page_id).refcount > 1

    def _needs_new_dblock(self, vblock: int, entry: int) -> bool:
        """A block that keeps a dblock needs a fresh one when it has none or shares it."""
        if not entry:
            return True
        if self._shares_page(vblock):
            return True
        return self.pool.accounts.space.is_shared(entry_dblock(entry))

    # ----- iteration --------------------------------------------------------------

    def _segments(self, offset: int, length: int, *, skip_holes: bool) -> Iterator[tuple[int, int, int, int, bool]]:
        """(vblock, start_in_block, end_in_block, entry, whole) for each block touched.

        `whole` means the range covers the block entirely; a volume's last, partial
        block is whole when covered up to the volume's end (nothing lies beyond).

        With skip_holes, pages absent from the root table are skipped whole: the
        caller treats absent blocks as UNMAPPED no-ops (so a 1 PiB trim is cheap).
        """
        bs = self.pool.block_size
        size = self.row.size_bytes
        end = offset + length
        if length == 0:
            return
        first, last = offset // bs, (end - 1) // bs
        page_lo, page_hi = first // PAGE_ENTRIES, last // PAGE_ENTRIES
        if skip_holes and page_hi - page_lo > 2:
            page_indexes = sorted(i for i in self.root if page_lo <= i <= page_hi)
        else:
            page_indexes = list(range(page_lo, page_hi + 1))
        for page_index in page_indexes:
            page_id = self.root.get(page_index)
            if page_id is None and skip_holes:
                continue
            entries = self.pool.txn.page(page_id).entries if page_id is not None else None
            lo = max(first, page_index * PAGE_ENTRIES)
            hi = min(last, page_index * PAGE_ENTRIES + PAGE_ENTRIES - 1)
            for vblock in range(lo, hi + 1):
                base = vblock * bs
                entry = entries[vblock - page_index * PAGE_ENTRIES] if entries is not None else 0
                start, stop = max(offset, base), min(end, base + bs)
                yield vblock, start - base, stop - base, entry, start == base and (stop == base + bs or stop == size)

    # ----- reading ------------------------------------------------------------------

    def _blocks(self, offset: int, length: int) -> tuple[int, int]:
        bs = self.pool.block_size
        return offset // bs, (offset + length - 1) // bs

    def read(self, offset: int, length: int) -> bytes:
        """The bytes of [offset, offset+length); UNMAPPED and ZEROED read zeros with no I/O."""
        self._check(offset, length, write=False)
        if not length:
            return b""
        store = self.pool.store
        with self.ranges.hold(*self._blocks(offset, length), exclusive=False):
            with self.pool.lock:
                self._check(offset, length, write=False)
                pieces = self._sparse_plan(offset, length)
            if len(pieces) == 1 and pieces[0][2] >= 0:
                return store.pread(pieces[0][2], length)  # all data, one extent: no copies
            out = bytearray(length)
            view = memoryview(out)
            data = [piece for piece in pieces if piece[2] >= 0]
            for (off, n, _), got in zip(data, store.read_many([(src, n) for _, n, src in data]), strict=True):
                view[off - offset : off - offset + n] = got
        return bytes(out)

    def read_sparse(self, offset: int, length: int) -> list[tuple[int, int, bytes | None]]:
        """The range as (offset, length, data) pieces, data None where it reads zeros.

        Frontends use this to keep zeros off the wire (NBD holes, SEEK_HOLE); the
        pieces and their bytes come from one consistent moment.
        """
        self._check(offset, length, write=False)
        if not length:
            return []
        store = self.pool.store
        with self.ranges.hold(*self._blocks(offset, length), exclusive=False):
            with self.pool.lock:
                self._check(offset, length, write=False)
                pieces = self._sparse_plan(offset, length)
            if len(pieces) == 1:  # the common small request: one read, or none
                off, n, src = pieces[0]
                return [(off, n, store.pread(src, n) if src >= 0 else None)]
            got = iter(store.read_many([(src, n) for _, n, src in pieces if src >= 0]))
            return [(off, n, None if src < 0 else next(got)) for off, n, src in pieces]

    def _sparse_plan(self, offset: int, length: int) -> list[list[int]]:
        """[offset, length, store offset or -1 for zeros] pieces of the range: runs of
        zeros merged, DATA merged where it is contiguous in the data store too."""
        bs = self.pool.block_size
        vblock, within = divmod(offset, bs)
        if within + length <= bs:  # one block: the common small request, without the walk
            entry = self._entry(vblock)
            return [[offset, length, entry_dblock(entry) * bs + within if entry_state(entry) == _DATA else -1]]
        pieces: list[list[int]] = []
        pos, stop = offset, offset + length
        first, last = offset // bs, (stop - 1) // bs
        for page_index in range(first // PAGE_ENTRIES, last // PAGE_ENTRIES + 1):
            lo = max(first, page_index * PAGE_ENTRIES)
            hi = min(last, page_index * PAGE_ENTRIES + PAGE_ENTRIES - 1)
            span_off, span_end = max(offset, lo * bs), min(stop, (hi + 1) * bs)
            run = self._uniform_run(page_index, lo, hi)
            if run is not None:  # the page's part is one piece: no walk block by block
                _add_piece(pieces, span_off, span_end - span_off, run * bs + span_off - lo * bs if run >= 0 else -1)
                pos = span_end
                continue
            for vblock, start, end, entry, _whole in self._segments(span_off, span_end - span_off, skip_holes=True):
                seg_off = vblock * bs + start
                if seg_off > pos:
                    _add_piece(pieces, pos, seg_off - pos, -1)
                store_off = entry_dblock(entry) * bs + start if entry_state(entry) == _DATA else -1
                _add_piece(pieces, seg_off, end - start, store_off)
                pos = seg_off + end - start
        if pos < stop:
            _add_piece(pieces, pos, stop - pos, -1)
        return pieces

    def _uniform_run(self, page_index: int, lo: int, hi: int) -> int | None:
        """For vblocks lo..hi of one page: -1 when all read zeros with no I/O (no page, or
        all UNMAPPED), the first dblock when all are DATA on consecutive dblocks (one
        extent below), None otherwise. Compared as whole arrays in C: a sequential read
        of small blocks is otherwise a Python loop over every block (docs/benchmarks.md,
        scale)."""
        page_id = self.root.get(page_index)
        if page_id is None:
            return -1
        base = page_index * PAGE_ENTRIES
        part = self.pool.txn.page(page_id).entries[lo - base : hi - base + 1]
        head = part[0]
        if entry_state(head) == _DATA:
            # DATA on consecutive dblocks with the same pin: head, head + 8, head + 16, ...
            step = 1 << DBLOCK_SHIFT
            return entry_dblock(head) if part == array("Q", range(head, head + len(part) * step, step)) else None
        # The state bits are in each entry's lowest byte: no DATA among them reads zeros.
        states = part.tobytes()[_LOW_BYTE::8].translate(_STATE_OF_BYTE)
        return -1 if _DATA not in states else None

    # ----- the mutating verbs: planners ------------------------------------------------

    def write(self, offset: int, data: bytes | bytearray | memoryview, *, fua: bool = False) -> None:
        """Write data. With detect_zeroes on/unmap, all-zero payloads are not written:
        over UNMAPPED/ZEROED nothing changes; a whole DATA block becomes ZEROED (on)
        or, unless provisioned, UNMAPPED (unmap)."""
        buf = memoryview(data).cast("B")
        if not self._overwrite_in_place(offset, buf):
            self._waiting_for_space(fua, self._mutate, offset, len(buf), lambda: self._plan_write(offset, buf))
        elif fua:
            self.pool.commit()

    def _overwrite_in_place(self, offset: int, buf: memoryview) -> bool:
        """The commonest write, without the planner: data within one DATA block that
        this volume alone holds lands in that block and no entry changes (what
        _plan_write and _fill_data would do, at a fraction of the cost per request).
        False when any other rule may apply, having changed no entry: the block is
        not DATA or is shared, the payload is zeros under detect_zeroes, or the
        layer below is full (the general path then writes it again whole, and waits
        for space or says ENOSPC as it does for any write)."""
        bs = self.pool.block_size
        vblock, start = divmod(offset, bs)
        if not len(buf) or start + len(buf) > bs or (self.row.detect_zeroes != "off" and is_zero(buf)):
            return False
        self._check(offset, len(buf), write=True)
        with self.ranges.hold(vblock, vblock, exclusive=True):
            with self.pool.lock:
                self._check(offset, len(buf), write=True)  # again: a resize or removal may have run meanwhile
                entry = self._entry(vblock)
                if entry_state(entry) != _DATA or self._needs_new_dblock(vblock, entry):
                    return False
            try:
                self.pool.store.pwritev(entry_dblock(entry) * bs + start, [buf])
            except OSError as exc:
                if _below_is_full(exc):
                    return False
                raise
        return True

    def _plan_write(self, offset: int, buf: memoryview) -> Iterator[_Step]:
        bs = self.pool.block_size
        detect = self.row.detect_zeroes
        for vblock, start, end, entry, whole in self._segments(offset, len(buf), skip_holes=False):
            pos = vblock * bs + start - offset
            piece = buf[pos : pos + end - start]
            state = entry_state(entry)
            zero = detect != "off" and is_zero(piece)
            if zero and state != _DATA:
                continue  # zero-write elision: no change, no I/O
            if zero and whole:
                if detect == "unmap" and not entry_pinned(entry):
                    yield _Step(Volume._fill_unmap, vblock, start, end, entry, 0)
                else:
                    new = self._needs_new_dblock(vblock, entry)
                    yield _Step(Volume._fill_zeroed, vblock, start, end, entry, new, pin=entry_pinned(entry))
                continue
            yield _Step(Volume._fill_data, vblock, start, end, entry, self._needs_new_dblock(vblock, entry), piece)

    def trim(self, offset: int, length: int, *, fua: bool = False) -> None:
        """Discard: whole blocks become UNMAPPED (space back to the pool and the layer
        below, after the next commit); partial DATA blocks are zeroed in place."""
        self._waiting_for_space(
            fua, self._mutate, offset, length, lambda: self._plan_zero(offset, length, False, False)
        )

    def write_zeroes(
        self, offset: int, length: int, *, no_hole: bool = False, fast: bool = False, fua: bool = False
    ) -> None:
        """Make the range read zeros, as metadata wherever blocks are whole.

        no_hole: every touched block ends reserved (ZEROED, or DATA holding zeros).
        fast: if any zero bytes would have to be written, fail with ENOTSUP and
        change nothing.
        """
        self._waiting_for_space(
            fua, self._mutate, offset, length, lambda: self._plan_zero(offset, length, no_hole, fast)
        )

    def _plan_zero(self, offset: int, length: int, no_hole: bool, fast: bool) -> Iterator[_Step]:
        if no_hole:
            self._precheck_space(offset, length)
        for vblock, start, end, entry, full in self._segments_or_empty_pages(offset, length, no_hole):
            if entry < 0:  # an empty page's run of vblocks [vblock, end]: all reserved at once
                yield _Step(Volume._fill_run, vblock, start, end, 0, end - vblock + 1)
                continue
            state = entry_state(entry)
            if state == _DATA and not full:
                if fast:
                    raise NotSupportedError("fast zero not possible: part of a data block must be written")
                yield _Step(Volume._fill_zero_part, vblock, start, end, entry, self._needs_new_dblock(vblock, entry))
            elif not no_hole:
                if full and state != _UNMAPPED:
                    yield _Step(Volume._fill_unmap, vblock, start, end, entry, 0)
            else:
                new = self._needs_new_dblock(vblock, entry)
                yield _Step(Volume._fill_zeroed, vblock, start, end, entry, new, pin=True)

    def provision(self, offset: int, length: int, *, fua: bool = False) -> None:
        """Reserve real space for every block touched, in the pool and the layer below.

        All or nothing: ENOSPC and no change when the pool cannot hold it all.
        """
        self._waiting_for_space(fua, self._mutate, offset, length, lambda: self._plan_provision(offset, length))

    def _plan_provision(self, offset: int, length: int) -> Iterator[_Step]:
        self._precheck_space(offset, length)
        for vblock, start, end, entry, _whole in self._segments_or_empty_pages(offset, length, True):
            if entry < 0:  # an empty page's run of vblocks [vblock, end]
                yield _Step(Volume._fill_run, vblock, start, end, 0, end - vblock + 1)
                continue
            new = self._needs_new_dblock(vblock, entry)
            if not new:
                if not entry_pinned(entry):
                    yield _Step(Volume._fill_pin, vblock, start, end, entry, 0)
            elif entry_state(entry) == _DATA:
                yield _Step(Volume._fill_copy, vblock, start, end, entry, 1)
            else:
                yield _Step(Volume._fill_zeroed, vblock, start, end, entry, 1, pin=True)

    def sparsify(self, offset: int, length: int) -> Sparsified:
        """Whole DATA blocks of the range that read all zero stop holding data: UNMAPPED,
        or ZEROED where provisioned, so the space goes back to the pool (and, once
        committed, to the layer below). The bytes read are unchanged.

        A block shared with a snapshot or clone is left as it is: the other holder keeps
        the dblock, so unmapping it here would free nothing now and cost a page copy.
        The range is held exclusively while its blocks are read and changed, so no
        write can land between the zero test and the unmap."""
        self._check(offset, length, write=True)
        if not length:
            return Sparsified(0, 0, 0, 0)
        bs = self.pool.block_size
        with self.ranges.hold(*self._blocks(offset, length), exclusive=True):
            with self.pool.lock:
                self._check(offset, length, write=True)
                found = [
                    (vblock, entry, self._needs_new_dblock(vblock, entry))
                    for vblock, _start, _end, entry, whole in self._segments(offset, length, skip_holes=True)
                    if whole and entry_state(entry) == _DATA
                ]
            contents = self.pool.store.read_many([(entry_dblock(entry) * bs, bs) for _, entry, _ in found])
            zero = {
                vblock: (entry, shared)
                for (vblock, entry, shared), got in zip(found, contents, strict=True)
                if is_zero(got)
            }
            shared_zero = sum(1 for _, is_shared in zero.values() if is_shared)

            counts = [0, 0]  # unmapped, zeroed

            def plan() -> Iterator[_Step]:
                counts[:] = [0, 0]  # the planner may run again (after a wait for space)
                for vblock, start, end, entry, _whole in self._segments(offset, length, skip_holes=True):
                    seen = zero.get(vblock)
                    if seen is None or seen[1] or seen[0] != entry:
                        continue
                    if entry_pinned(entry):
                        counts[1] += 1
                        yield _Step(Volume._fill_zeroed, vblock, start, end, entry, 0, pin=True)
                    else:
                        counts[0] += 1
                        yield _Step(Volume._fill_unmap, vblock, start, end, entry, 0)

            self._mutate(offset, length, plan, held=True)
        return Sparsified(len(found) * bs, counts[0] * bs, counts[1] * bs, shared_zero * bs)

    # ----- the mutating verbs: what each kind of step does -------------------------------

    def _fill_unmap(self, change: Change, step: _Step, fresh: Iterator[int]) -> None:
        change.set(step.vblock, 0)

    def _fill_pin(self, change: Change, step: _Step, fresh: Iterator[int]) -> None:
        change.set(step.vblock, make_entry(entry_dblock(step.entry), entry_state(step.entry), True))

    def _fill_run(self, change: Change, step: _Step, fresh: Iterator[int]) -> None:
        """UNMAPPED vblocks [vblock, end] of one page become ZEROED|PINNED on fresh dblocks."""
        bs = self.pool.block_size
        dblocks = [next(fresh) for _ in range(step.fresh)]
        change.runs_of_fresh.append((step.vblock, dblocks))
        for dblock in dblocks:
            change.io.preallocate(dblock * bs, bs)

    def _fill_zeroed(self, change: Change, step: _Step, fresh: Iterator[int]) -> None:
        """The whole block becomes ZEROED; its dblock reads zero in the layer below too."""
        bs = self.pool.block_size
        if step.fresh:
            dblock = next(fresh)
            change.io.preallocate(dblock * bs, bs)
        else:
            dblock = entry_dblock(step.entry)
            if entry_state(step.entry) == _DATA:
                change.io.zero(dblock * bs, bs)
        change.set(step.vblock, make_entry(dblock, _ZEROED, step.pin))

    def _fill_copy(self, change: Change, step: _Step, fresh: Iterator[int]) -> None:
        """A shared DATA block is copied now (provision: later writes need no space)."""
        bs = self.pool.block_size
        dblock = next(fresh)
        change.io.copy(entry_dblock(step.entry) * bs, dblock * bs, bs)
        change.set(step.vblock, make_entry(dblock, _DATA, True))

    def _fill_zero_part(self, change: Change, step: _Step, fresh: Iterator[int]) -> None:
        """Zero part of a DATA block: in place, or on a copy of its other bytes."""
        bs = self.pool.block_size
        old, start, end = entry_dblock(step.entry), step.start, step.end
        if not step.fresh:
            change.io.write(old * bs + start, zero_bytes(end - start))
            return
        dblock = next(fresh)  # reads zero: only the bytes outside [start, end) are copied
        change.io.copy(old * bs, dblock * bs, start)
        change.io.copy(old * bs + end, dblock * bs + end, bs - end)
        change.set(step.vblock, make_entry(dblock, _DATA, entry_pinned(step.entry)))

    def _fill_data(self, change: Change, step: _Step, fresh: Iterator[int]) -> None:
        """The payload lands in the block, which is DATA afterwards."""
        bs = self.pool.block_size
        entry, start, end = step.entry, step.start, step.end
        assert step.piece is not None
        state, old = entry_state(entry), entry_dblock(entry)
        dblock = next(fresh) if step.fresh else old
        io = change.io
        if state == _DATA and not step.fresh:
            io.write(dblock * bs + start, step.piece)  # in place
            return
        # The block enters DATA or moves to a fresh dblock. A fresh dblock and a ZEROED
        # block's dblock read zero (spacemap's rule), so only the payload is written; a
        # copy-on-write copy takes the old block's other bytes.
        if state == _DATA:
            io.copy(old * bs, dblock * bs, start)
            io.write(dblock * bs + start, step.piece)
            io.copy(old * bs + end, dblock * bs + end, bs - end)
        elif not step.fresh and dblock in self.pool.unclean_zeroed:
            # A failed write reached this ZEROED block's dblock: write it whole.
            io.write(dblock * bs, zero_bytes(start))
            io.write(dblock * bs + start, step.piece)
            io.write(dblock * bs + end, zero_bytes(bs - end))
        else:
            io.write(dblock * bs + start, step.piece)
        if not step.fresh:  # here that is a ZEROED block, written in place
            change.in_place_zeroed.append(dblock)
        change.set(step.vblock, make_entry(dblock, _DATA, entry_pinned(entry)))

    # ----- the mutating verbs: the one skeleton -------------------------------------------

    def _mutate(self, offset: int, length: int, planner: Callable[[], Iterator[_Step]], *, held: bool = False) -> None:
        """Plan, allocate, do the I/O, publish (see the module's docstring). `held`:
        the caller already holds the whole volume in the range lock (resize)."""
        self._check(offset, length, write=True)
        if not length:
            return
        pool = self.pool
        ranges = contextlib.nullcontext() if held else self.ranges.hold(*self._blocks(offset, length), exclusive=True)
        with ranges:
            change = Change()
            with pool.lock:
                self._check(offset, length, write=True)  # again: a resize or removal may have run meanwhile
                steps = list(planner())
                change.fresh = self._allocate(sum(step.fresh for step in steps))
                try:
                    fresh = iter(change.fresh)
                    for step in steps:
                        step.fill(self, change, step, fresh)
                except BaseException:
                    pool.accounts.return_fresh(change.fresh)
                    raise
            if not change:
                return
            try:
                change.io.run(pool.store)
            except BaseException as exc:
                with pool.lock:
                    pool.accounts.return_fresh(change.fresh)
                    # A ZEROED block's dblock must read zero (the rule writes into it rely on);
                    # the failed write may have reached it, so the next write there is whole.
                    pool.unclean_zeroed.update(change.in_place_zeroed)
                if _below_is_full(exc):  # like a full pool
                    raise NoSpaceError(f"the data store below pool {pool.path} is full: {exc.strerror}") from exc
                raise
            with pool.lock:
                self._publish(change)
                pool.accounts.space.published(change.fresh)  # the next commit records them, with the entries

    def _publish(self, change: Change) -> None:
        pool = self.pool
        pool.unclean_zeroed.difference_update(change.in_place_zeroed)
        for vblock, entry in change.entries:
            self._set_entry(vblock, entry)
        for first, dblocks in change.runs_of_fresh:
            self._set_unmapped_run(first, [make_entry(d, _ZEROED, True) for d in dblocks])
        if pool.host.slack_released and pool.accounts.space.pending_free:
            pool.kick_commit()  # the host is full: give freed space back now, not within a second

    def _segments_or_empty_pages(
        self, offset: int, length: int, bulk: bool
    ) -> Iterator[tuple[int, int, int, int, bool]]:
        """_segments, except that with `bulk` a page absent from the root table comes as
        one item (first vblock, 0, last vblock, -1, False): every block in it is UNMAPPED,
        so rules that reserve space can treat it at once (an 8 GiB provision is fast)."""
        if not bulk:
            yield from self._segments(offset, length, skip_holes=True)
            return
        bs = self.pool.block_size
        page_bytes = bs * PAGE_ENTRIES
        pos, end = offset, offset + length
        while pos < end:
            page_index = pos // page_bytes
            stop = min(end, (page_index + 1) * page_bytes)
            if page_index in self.root:
                yield from self._segments(pos, stop - pos, skip_holes=False)
            else:
                yield pos // bs, 0, (stop - 1) // bs, -1, False
            pos = stop

    def _set_unmapped_run(self, first: int, new_entries: list[int]) -> None:
        """_set_entry in bulk for a run of UNMAPPED vblocks in one page becoming
        ZEROED|PINNED on fresh dblocks (the provision rule, for whole empty pages)."""
        page_index, slot = divmod(first, PAGE_ENTRIES)
        page = self._writable_page(page_index)
        if any(page.entries[slot : slot + len(new_entries)]):
            raise AssertionError("bulk provision over mapped blocks")
        page.entries[slot : slot + len(new_entries)] = array("Q", new_entries)
        n, row = len(new_entries), self.row
        row.zeroed_blocks += n
        row.pinned_blocks += n
        if self.tallied:
            self.pool.volumes.totals.zeroed_blocks += n
            self.pool.volumes.totals.pinned_blocks += n
        row.exclusive_blocks += n  # fresh dblocks in a page this volume alone holds
        if row.reserve_bytes or self.replaces is not None:
            self.pool.accounts.retally_set_aside(self)
        self.pool.txn.page_changed(self, page_index, page)

    def _precheck_space(self, offset: int, length: int) -> None:
        """Refuse at once a range that cannot fit, before walking its blocks one by one."""
        if not length:
            return
        bs = self.pool.block_size
        touched = (offset + length - 1) // bs - offset // bs + 1
        mapped = self.row.data_blocks + self.row.zeroed_blocks
        if touched - mapped > self.pool.accounts.space.free_blocks:
            self.pool.accounts.check_space(touched - mapped, self)

    def _allocate(self, count: int) -> list[int]:
        """Reserve and take `count` fresh dblocks, or raise NoSpaceError having changed nothing."""
        if not count:
            return []
        self.pool.accounts.check_space(count, self)
        blocks = self.pool.accounts.space.allocate(count)
        self.pool.policy.check(self)
        return blocks

    def _waiting_for_space(self, fua: bool, verb: Callable[_P, None], *args: _P.args, **kwargs: _P.kwargs) -> None:
        """Run a mutating verb; under the pool's wait policy, ENOSPC holds it (no lock
        held) until space appears or the time runs out, then it plans again from
        scratch (ENOSPC changed nothing, so re-running it is safe). Space freed in the
        open transaction is made usable first, by two commits outside the pool lock.
        With fua, what the verb did is then committed, outside the pool lock too."""
        deadline: float | None = None
        settled = False
        while True:
            try:
                verb(*args, **kwargs)
                if (owner := self.pool.owner) is not None:
                    owner.maybe_prefetch(self)
                break
            except NoSpaceError as exc:
                # A grant may be asked for again after a wait (others may have freed space).
                if isinstance(exc, FreedSpacePending) and (not settled or isinstance(exc, GrantNeeded)):
                    self.pool.accounts.settle_frees()  # outside the pool lock; then the request plans again
                    settled = True
                    continue
                if deadline is None:
                    deadline = self.pool.policy.full_deadline()
                if deadline is None or not self.pool.accounts.wait_for_space(deadline):
                    self.pool.stats.no_space()
                    raise
        if fua:
            self.pool.commit()

    def block_status(self, offset: int, length: int) -> list[tuple[int, BlockState]]:
        """(length, state) runs covering [offset, offset+length), equal neighbours merged."""
        self._check(offset, length, write=False)
        bs = self.pool.block_size
        runs: Runs[int] = Runs()
        add = runs.add
        pos = offset
        with self.pool.lock:
            for vblock, start, end, entry, _whole in self._segments(offset, length, skip_holes=True):
                seg_off = vblock * bs + start
                if seg_off > pos:
                    add(seg_off - pos, _UNMAPPED)
                add(end - start, entry_state(entry))
                pos = seg_off + end - start
        if pos < offset + length:
            add(offset + length - pos, _UNMAPPED)
        return [(n, BlockState(key)) for n, key in runs.pairs()]

    def guaranteed_status(self, offset: int, length: int) -> list[tuple[int, bool]]:
        """(length, guaranteed) runs: whether a write there can never fail for lack of
        pool space, now or after any snapshot taken later (the one place that rule lives).

        Only a reservation that covers the whole volume gives that: the pool then keeps
        set aside enough to write every block of the volume once more, and a snapshot
        it cannot cover is refused (create_snapshot). A block the volume holds alone
        today is no guarantee without it, because a snapshot may share it at any
        moment, after which its next write needs a fresh block. Mapped blocks only;
        read-only volumes take no writes, so nothing is reported guaranteed there. Nor
        while an import into the volume runs: its staging volume draws on the same
        reservation (core/reservation.py).
        """
        self._check(offset, length, write=False)
        with self.pool.lock:
            covered = self.fully_reserved() and not self.replacements
        if not covered:
            return [(length, False)] if length else []
        return Runs((n, state is not BlockState.UNMAPPED) for n, state in self.block_status(offset, length)).pairs()

    def fully_reserved(self) -> bool:
        """The reservation covers every block of the volume (call under the pool lock)."""
        if self.readonly or not self.row.reserve_bytes:
            return False
        n_blocks = -(-self.row.size_bytes // self.pool.block_size)
        return self.pool.accounts.reserve_target(self) >= n_blocks

    def usage(self) -> tuple[int, int]:
        """(exclusive, shared) mapped blocks, like thin_ls: shared ones are also held by
        another volume or snapshot (through a shared page or dblock). From the kept
        count, recounted first if it is stale (core/exclusive.py)."""
        with self.pool.lock:
            exclusive = self.fresh_exclusive()
            return exclusive, self.mapped_blocks - exclusive

    @property
    def mapped_blocks(self) -> int:
        return self.row.data_blocks + self.row.zeroed_blocks

    def exclusive_fresh(self) -> bool:
        """Whether the kept exclusive count is exact (call under the pool lock)."""
        row = self.row
        return (
            row.exclusive_epoch == self.pool.accounts.space.sharing_epoch or row.exclusive_blocks == self.mapped_blocks
        )

    def fresh_exclusive(self) -> int:
        """The exclusive count, recounted if stale (call under the pool lock): exact
        where this process's view of the shared counts is the store's (Pool.counts_current).

        An owner per volume stores a recount only in a row it may write, one of the
        volumes it serves, and as exact only inside a caught-up pool-level step:
        elsewhere its view may be behind what other owners committed (a clone another
        owner writes unshares its snapshot's blocks), so the count is a lower bound.
        Another owner's row here is an old view: a recount stored in it would be
        committed over what its owner wrote, so it is returned, never stored."""
        if self.exclusive_fresh():
            return self.row.exclusive_blocks
        pool = self.pool
        count = self.recount_exclusive()
        if pool.owner is not None and not pool.serves(self):
            return count
        pool.accounts.set_exclusive(self, count, exact=pool.counts_current())
        return count

    def recount_exclusive(self) -> int:
        """Exclusive blocks counted from the pages (call under the pool lock)."""
        pool = self.pool
        ids = list(self.root.values())
        pool.txn.load_refcounts(ids)
        # A shared page holds nothing exclusive: only the pages held alone are read, in
        # one batch (after one overwrite anywhere, every volume sharing blocks recounts).
        alone = [page_id for page_id in ids if pool.txn.page_refcount(page_id) == 1]
        pool.txn.load_pages(alone)
        pages = [pool.txn.page(page_id) for page_id in alone]
        return count_exclusive(((page.refcount, page.entries) for page in pages), pool.accounts.space.refcounts)

    def flush(self) -> None:
        """Make every completed request durable (a pool-wide commit)."""
        self.pool.commit()

    def resize(self, size_bytes: int) -> None:
        """Grow, or shrink unmapping everything past the new end (a partial block is zeroed)."""
        with self.ranges.hold_all(exclusive=True):
            self.resize_held(size_bytes)

    def resize_held(self, size_bytes: int) -> None:
        """resize, for a caller that holds the whole volume in the range lock."""
        old = self.row.size_bytes
        if size_bytes < old:
            cut, n = size_bytes, old - size_bytes
            self._waiting_for_space(
                False, self._mutate, cut, n, lambda: self._plan_zero(cut, n, False, False), held=True
            )
        with self.pool.lock, self.pool.volumes.tallied(self):
            self.row.size_bytes = size_bytes
            self.pool.txn.mark_volume_dirty(self)
