"""Mapping entries and mapping pages: how a vblock points at a dblock.

A page maps PAGE_ENTRIES consecutive vblocks. Each entry is one uint64:
    dblock << 3 | PINNED(4) | state(0..2)
so the entry 0 is UNMAPPED, and a page of zeros maps nothing. Pages are
reference counted (a snapshot shares them); a dblock's refcount is the number
of distinct pages that point at it.

A page is stored as the smallest of three encodings (`encode_entries`), so the
metadata pays per mapping, not per page (a page mapping one block is 11 bytes,
a page mapped by one sequential run 13):

    dense   exactly 4096 bytes: the 512 entries as uint64 in the machine's byte
            order (the only form before; old pools hold it)
    sparse  b"S", then n uint16 slots (strictly increasing), then their n
            uint64 entries: 1 + 10n bytes
    runs    b"R", then r uint16 first slots, r uint16 counts, r uint64 first
            entries: 1 + 12r bytes; entry k of a run is first + 8k (the next
            dblock, the same state and pin); the slots between runs are UNMAPPED

The forms cannot be taken for one another: a blob of 4096 bytes is dense, and
a tagged blob is never 4096 bytes long, since 4095 is neither a multiple of
10 nor of 12 (asserted below); the encoder writes a tagged form only when it is
smaller than the dense one. Arrays of the same type are laid out one after the
other, so decoding is a few `frombytes`, with no Python object per entry.

Decoding is strict (`CorruptionError`, one sentence): a wrong length, an
unknown tag, slots unsorted, repeated or beyond the page, runs empty,
overlapping, past the page's end or past the largest dblock, and in a tagged
form an entry thinblock never stores (0, or state 3). A dense page's entries
are not judged here, as before: check and repair judge them slot by slot, so
one bad entry costs one block, not the page. Several valid blobs may mean one
page (two runs that could have been one); the encoder writes the smallest.
"""

from __future__ import annotations

import enum
import operator
import struct
import sys
from array import array
from itertools import compress

from thinblock.errors import CorruptionError

PAGE_ENTRIES = 512

STATE_MASK = 0b11
PINNED = 0b100
DBLOCK_SHIFT = 3


class BlockState(enum.IntEnum):
    """The three states of the block contract (docs/architecture.md)."""

    UNMAPPED = 0
    ZEROED = 1
    DATA = 2


def make_entry(dblock: int, state: int, pinned: bool | int = False) -> int:
    """The entry for a block in `state` on `dblock` (UNMAPPED is always 0)."""
    if state == BlockState.UNMAPPED:
        return 0
    return (dblock << DBLOCK_SHIFT) | (PINNED if pinned else 0) | state


def entry_state(entry: int) -> int:
    """The entry's BlockState, as an int (compare with BlockState members)."""
    return entry & STATE_MASK


def entry_dblock(entry: int) -> int:
    return entry >> DBLOCK_SHIFT


def entry_pinned(entry: int) -> bool:
    return bool(entry & PINNED)


def with_state(entry: int, state: int) -> int:
    """The same dblock and pin in another mapped state."""
    return (entry & ~STATE_MASK) | state


def entry_valid(entry: int) -> bool:
    """Whether an entry is one thinblock ever writes."""
    if entry == 0:
        return True
    return (entry & STATE_MASK) in (BlockState.ZEROED, BlockState.DATA)


PAGE_BYTES = 8 * PAGE_ENTRIES  # the dense form's length
SPARSE_TAG = b"S"
RUNS_TAG = b"R"
_MAX_ENTRY = (1 << 64) - 1
_STEP = 1 << DBLOCK_SHIFT  # from one entry of a run to the next
_ORDER = sys.byteorder  # array("Q") is in the machine's order; so are the big ints below
_LOW = 0 if _ORDER == "little" else 7  # where an entry's low byte (its state) lies
# A low byte whose state is neither ZEROED nor DATA: never stored in a tagged form.
_BAD_STATE = bytes(0 if b & STATE_MASK in (BlockState.ZEROED, BlockState.DATA) else 1 for b in range(256))
# A whole page as one big int (word i = entry i) lets slot-wise tests run in C, with
# no Python object per entry. These have one value in every 64-bit word:
_WORDS = (1 << (64 * PAGE_ENTRIES)) - 1
_ONES = sum(1 << (64 * i) for i in range(PAGE_ENTRIES))  # 1
_LOW63 = _ONES * ((1 << 63) - 1)  # all but the top bit
_RAMP = sum(_STEP * i << (64 * i) for i in range(PAGE_ENTRIES))  # 8i in word i
_NEXT = _STEP * (_ONES - 1)  # 8 in every word but the first
_SLOT_AT = tuple(range(PAGE_ENTRIES))
_SLOT_AFTER = tuple(range(1, PAGE_ENTRIES + 1))
_MAX_DBLOCK_BYTES = b"\xff" * 7  # in an entry on the largest dblock, which a run step would overflow

assert (PAGE_BYTES - 1) % 10 and (PAGE_BYTES - 1) % 12, "a tagged form could be taken for a dense page"


def empty_entries() -> array[int]:
    """The entries of a page that maps nothing."""
    return array("Q", bytes(PAGE_BYTES))


def _nonzero(x: int) -> int:
    """Bit 0 of word i is set exactly when word i of x is not 0 (the other bits are 0)."""
    # The low 63 bits plus 2**63 - 1 set the top bit when any of them is set, never carry.
    return (((x & _LOW63) + _LOW63) | x) >> 63 & _ONES


def _flags(bits: int) -> bytes:
    """The bit-0 flags of _nonzero as 512 bytes of 0 or 1."""
    return bits.to_bytes(PAGE_BYTES, _ORDER)[_LOW::8]


def _pairs(entries: array[int], raw: bytes) -> tuple[array[int], array[int]]:
    """(slots, entries) of the mapped slots of a dense page, raw its bytes."""
    slots = array("H", compress(_SLOT_AT, _flags(_nonzero(int.from_bytes(raw, _ORDER)))))
    return slots, array("Q", filter(None, entries))


def _invalid(values: array[int]) -> bool:
    """Whether any of these entries is one thinblock never stores (0, or state 3)."""
    return b"\x01" in values.tobytes()[_LOW::8].translate(_BAD_STATE)


def _runs_by_slot(entries: array[int], slots: list[int]) -> tuple[list[int], list[int]]:
    """(first slots, counts) of the runs among these mapped slots, one slot at a time."""
    firsts: list[int] = []
    counts: list[int] = []
    for slot in slots:
        if firsts and slot == firsts[-1] + counts[-1] and entries[slot] == entries[slot - 1] + _STEP:
            counts[-1] += 1
        else:
            firsts.append(slot)
            counts.append(1)
    return firsts, counts


def _runs_blob(entries: array[int], firsts: list[int], counts: list[int]) -> bytes:
    r = len(firsts)
    return RUNS_TAG + struct.pack(f"={r}H{r}H{r}Q", *firsts, *counts, *map(entries.__getitem__, firsts))


def encode_entries(entries: array[int]) -> bytes:
    """The smallest encoding of a page's PAGE_ENTRIES entries (the module's docstring);
    on a tie, sparse before runs before dense. A page holding an entry thinblock never
    writes (read from a damaged dense page) stays dense, for check to judge slot by slot."""
    raw = entries.tobytes()
    x = int.from_bytes(raw, _ORDER)
    if not x:
        return SPARSE_TAG
    mapped = _nonzero(x)
    valid_state = (x ^ (x >> 1)) & _ONES  # the state's two bits differ: ZEROED or DATA
    if mapped & ~valid_state:
        return raw
    mapped_flags = _flags(mapped)
    n = mapped_flags.count(1)
    smaller = min(1 + 10 * n, PAGE_BYTES)  # what runs must beat
    if n > 1 and _MAX_DBLOCK_BYTES not in raw:
        # Word i of x ^ (x moved up a word, plus 8) is 0 exactly when entry i is entry
        # i-1 + 8: the next dblock, the same state and pin, so slot i continues a run
        # (entry i-1 is not 0: that would make entry i 8, an invalid entry, refused
        # above). No step carries: no entry is on the largest dblock.
        begins = _nonzero((((x << 64) + _NEXT) & _WORDS) ^ x) & mapped
        begin_flags = _flags(begins)
        runs = begin_flags.count(1)
        if 1 + 12 * runs < smaller:
            ends = mapped & ~((mapped ^ begins) >> 64)  # mapped slots the next slot does not continue
            firsts = list(compress(_SLOT_AT, begin_flags))
            counts = list(map(operator.sub, compress(_SLOT_AFTER, _flags(ends)), firsts))
            return _runs_blob(entries, firsts, counts)
    elif n > 1:  # rare: near the largest dblock, found slot by slot
        firsts, counts = _runs_by_slot(entries, list(compress(_SLOT_AT, mapped_flags)))
        if 1 + 12 * len(firsts) < smaller:
            return _runs_blob(entries, firsts, counts)
    if 1 + 10 * n < PAGE_BYTES:
        slots = list(compress(_SLOT_AT, mapped_flags))
        return SPARSE_TAG + struct.pack(f"={n}H{n}Q", *slots, *map(entries.__getitem__, slots))
    return raw


def _corrupt(page_id: int | None, what: str) -> CorruptionError:
    where = "a mapping page" if page_id is None else f"mapping page {page_id}"
    return CorruptionError(f"{where} {what}")


def _check_indexes(page_id: int | None, indexes: array[int]) -> None:
    if any(map(operator.ge, indexes[:-1], indexes[1:])):
        raise _corrupt(page_id, "lists its slots out of order or twice")
    if indexes and indexes[-1] >= PAGE_ENTRIES:  # sorted: the last is the largest
        raise _corrupt(page_id, f"maps slot {indexes[-1]}, beyond its {PAGE_ENTRIES} entries")


def _check_values(page_id: int | None, values: array[int]) -> None:
    if _invalid(values):
        bad = next(v for v in values if not (v and entry_valid(v)))
        raise _corrupt(page_id, f"holds an invalid entry {bad:#x}")


def _decode(blob: bytes, page_id: int | None) -> tuple[str, array[int], array[int], array[int] | None]:
    """(form, indexes, entries, counts) of a stored page; counts only for runs."""
    size = len(blob)
    if size == PAGE_BYTES:
        entries = array("Q")
        entries.frombytes(blob)
        return "dense", array("H"), entries, None
    tag = blob[:1]
    if tag == SPARSE_TAG and (size - 1) % 10 == 0:
        n = (size - 1) // 10
        indexes, values = array("H"), array("Q")
        indexes.frombytes(blob[1 : 1 + 2 * n])
        values.frombytes(blob[1 + 2 * n :])
        _check_indexes(page_id, indexes)
        _check_values(page_id, values)
        return "sparse", indexes, values, None
    if tag == RUNS_TAG and (size - 1) % 12 == 0:
        r = (size - 1) // 12
        firsts, counts, values = array("H"), array("H"), array("Q")
        firsts.frombytes(blob[1 : 1 + 2 * r])
        counts.frombytes(blob[1 + 2 * r : 1 + 4 * r])
        values.frombytes(blob[1 + 4 * r :])
        if 0 in counts:
            raise _corrupt(page_id, "holds a run of no entries")
        ends = array("I", map(operator.add, firsts, counts))
        if ends and max(ends) > PAGE_ENTRIES:
            raise _corrupt(page_id, f"holds a run beyond its {PAGE_ENTRIES} entries")
        if any(map(operator.gt, ends[:-1], firsts[1:])):
            raise _corrupt(page_id, "lists its runs out of order or overlapping")
        _check_values(page_id, values)
        if values and max(map(operator.add, values, map((8).__mul__, counts))) > _MAX_ENTRY + 8:
            raise _corrupt(page_id, "holds a run beyond the largest dblock")
        return "runs", firsts, values, counts
    if size == 0:
        raise _corrupt(page_id, "is empty (0 bytes)")
    if tag not in (SPARSE_TAG, RUNS_TAG):
        raise _corrupt(page_id, f"has an unknown encoding (tag byte {blob[0]:#04x}, {size} bytes)")
    raise _corrupt(page_id, f"is {size} bytes, a length its encoding {tag.decode()!r} cannot have")


def decode_entries(blob: bytes, page_id: int | None = None) -> array[int]:
    """A stored page's PAGE_ENTRIES entries (a fresh array), whatever its encoding;
    CorruptionError (naming page_id when given) if the blob is not a valid page."""
    form, indexes, values, counts = _decode(blob, page_id)
    if form == "dense":
        return values
    entries = empty_entries()
    if counts is None:
        for i, v in zip(indexes, values, strict=True):
            entries[i] = v
    else:
        # A run as one big int: v in every word plus 8k in word k (no carry: checked).
        raw = bytearray(PAGE_BYTES)
        for i, c, v in zip(indexes, counts, values, strict=True):
            words = (1 << (64 * c)) - 1
            raw[8 * i : 8 * (i + c)] = (v * (_ONES & words) + (_RAMP & words)).to_bytes(8 * c, _ORDER)
        entries = array("Q")
        entries.frombytes(raw)
    return entries


def mapped_pairs(blob: bytes, page_id: int | None = None) -> tuple[array[int], array[int]]:
    """(slots, entries) of a stored page's mapped slots, in slot order: array('H')
    and array('Q') of the same length (both buffers, for numpy.frombuffer).
    CorruptionError as decode_entries."""
    form, indexes, values, counts = _decode(blob, page_id)
    if form == "sparse":
        return indexes, values
    if form == "dense":
        return _pairs(values, blob)
    assert counts is not None
    slots, entries = array("H"), array("Q")
    for i, c, v in zip(indexes, counts, values, strict=True):
        slots.extend(range(i, i + c))
        entries.extend(range(v, v + 8 * c, 8))
    return slots, entries


class Page:
    """One mapping page: an id, a refcount (how many root tables hold it) and entries."""

    __slots__ = ("entries", "page_id", "refcount")

    def __init__(self, page_id: int, refcount: int, entries: array[int] | None = None) -> None:
        self.page_id = page_id
        self.refcount = refcount
        self.entries = entries if entries is not None else empty_entries()

    def is_empty(self) -> bool:
        return not any(self.entries)

    def to_blob(self) -> bytes:
        """The page as stored: its smallest encoding (the module's docstring)."""
        return encode_entries(self.entries)

    @classmethod
    def from_blob(cls, page_id: int, refcount: int, blob: bytes) -> Page:
        """A stored page, whatever its encoding; CorruptionError if the blob is not one."""
        return cls(page_id, refcount, decode_entries(blob, page_id))
