"""Mapping pages in their stored encodings (core/mapping.py): dense, sparse, runs.

The codec round-trips every valid page (a derandomized property), picks the
smallest form, reads old dense pages, and refuses every malformed blob with one
sentence; a real pool written sparsely stores small pages, checks clean and
reads its data back, also after its pages were rewritten dense as an old pool's.
"""

from __future__ import annotations

import sqlite3
import struct
from array import array
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.cli import thinblock
from tests.profiles import examples
from thinblock import Pool
from thinblock.core.mapping import (
    DBLOCK_SHIFT,
    PAGE_BYTES,
    PAGE_ENTRIES,
    BlockState,
    Page,
    decode_entries,
    empty_entries,
    encode_entries,
    make_entry,
    mapped_pairs,
)
from thinblock.core.snapshot import create_snapshot
from thinblock.errors import CorruptionError
from thinblock.meta.sqlite import DB_NAME

MAX_DBLOCK = (1 << (64 - DBLOCK_SHIFT)) - 1
BLOCK = 4096


def _page(pairs: dict[int, int]) -> array[int]:
    entries = empty_entries()
    for slot, entry in pairs.items():
        entries[slot] = entry
    return entries


def _sparse(slots: list[int], entries: list[int]) -> bytes:
    return b"S" + struct.pack(f"={len(slots)}H{len(entries)}Q", *slots, *entries)


def _runs(runs: list[tuple[int, int, int]]) -> bytes:
    firsts, counts, entries = zip(*runs, strict=True) if runs else ((), (), ())
    n = len(runs)
    return b"R" + struct.pack(f"={n}H{n}H{n}Q", *firsts, *counts, *entries)


def _forms(entries: array[int]) -> dict[str, int]:
    """Each form's size for this page (runs of the next dblock, same state and pin)."""
    mapped = [(s, e) for s, e in enumerate(entries) if e]
    runs = sum(1 for i, (s, e) in enumerate(mapped) if i == 0 or mapped[i - 1] != (s - 1, e - 8))
    return {"S": 1 + 10 * len(mapped), "R": 1 + 12 * runs, "dense": PAGE_BYTES}


DATA = BlockState.DATA
ZEROED = BlockState.ZEROED


def test_sizes_are_per_mapping_not_per_page() -> None:
    assert encode_entries(empty_entries()) == b"S"
    assert len(encode_entries(_page({0: make_entry(9, DATA)}))) == 11
    sequential = _page({s: make_entry(100 + s, DATA) for s in range(PAGE_ENTRIES)})
    assert encode_entries(sequential) == _runs([(0, PAGE_ENTRIES, make_entry(100, DATA))])
    scattered = _page({s: make_entry(3 * s + 1, DATA) for s in range(PAGE_ENTRIES)})
    assert encode_entries(scattered) == scattered.tobytes()  # dense: no worse than before
    # A run breaks where the state, the pin or the next dblock changes.
    mixed = _page({0: make_entry(5, DATA), 1: make_entry(6, ZEROED), 2: make_entry(7, ZEROED, pinned=True)})
    assert encode_entries(mixed)[:1] == b"S" and decode_entries(encode_entries(mixed)) == mixed
    two_runs = _page({s: make_entry(50 + s, DATA) for s in range(10)} | {s: make_entry(s, DATA) for s in range(20, 40)})
    assert encode_entries(two_runs) == _runs([(0, 10, make_entry(50, DATA)), (20, 20, make_entry(20, DATA))])


def test_old_dense_pages_still_read() -> None:
    entries = _page({3: make_entry(8, DATA), 4: make_entry(9, DATA), 500: make_entry(1, ZEROED, pinned=True)})
    blob = entries.tobytes()  # how every page was stored before
    assert len(blob) == PAGE_BYTES
    assert decode_entries(blob) == entries
    assert [list(a) for a in mapped_pairs(blob)] == [[3, 4, 500], [entries[3], entries[4], entries[500]]]
    assert Page.from_blob(1, 2, blob).entries == entries


def test_a_page_with_an_entry_never_stored_stays_dense() -> None:
    """Read from a damaged dense page, it is written back dense: check and repair then
    judge the bad slot alone, instead of the whole page becoming unreadable."""
    for bad in (make_entry(4, DATA) | 3, 4 << DBLOCK_SHIFT):
        entries = _page({0: make_entry(1, DATA), 1: make_entry(2, DATA), 9: bad})
        assert encode_entries(entries) == entries.tobytes()
        assert decode_entries(entries.tobytes()) == entries


def test_the_largest_dblock_round_trips() -> None:
    top = _page({510: make_entry(MAX_DBLOCK - 1, DATA, pinned=True), 511: make_entry(MAX_DBLOCK, DATA, pinned=True)})
    assert decode_entries(encode_entries(top)) == top
    # A runs blob written by hand up to the largest dblock decodes; one step beyond is refused.
    assert decode_entries(_runs([(510, 2, top[510])])) == top
    with pytest.raises(CorruptionError, match="beyond the largest dblock"):
        decode_entries(_runs([(509, 3, top[510])]))


_states = st.sampled_from([(ZEROED, False), (ZEROED, True), (DATA, False), (DATA, True)])
_dblocks = st.one_of(st.integers(0, 2000), st.integers(MAX_DBLOCK - 600, MAX_DBLOCK))


@st.composite
def valid_pages(draw: st.DrawFn) -> array[int]:
    """Arbitrary pages: runs of consecutive dblocks, single entries, gaps, both ends."""
    entries = empty_entries()
    # Each draw's simplest value (0, False) is the simplest page part: none, then one run.
    slot = PAGE_ENTRIES - draw(st.integers(0, PAGE_ENTRIES))
    while slot < PAGE_ENTRIES:
        count = PAGE_ENTRIES - slot - draw(st.integers(0, PAGE_ENTRIES - slot - 1))
        state, pinned = draw(_states)
        first = draw(_dblocks)
        if not draw(st.booleans()):  # a run of the next dblocks
            for i in range(min(count, MAX_DBLOCK - first + 1)):
                entries[slot + i] = make_entry(first + i, state, pinned)
        else:  # unrelated dblocks
            for i in range(count):
                entries[slot + i] = make_entry(draw(_dblocks), state, pinned)
        slot += count + draw(st.integers(0, 80))
    return entries


@settings(max_examples=examples(400), deadline=None)
@given(entries=valid_pages())
def test_encoding_round_trips_every_valid_page(entries: array[int]) -> None:
    blob = encode_entries(entries)
    assert decode_entries(blob) == entries
    slots, mapped = mapped_pairs(blob)
    assert list(slots) == [s for s in range(PAGE_ENTRIES) if entries[s]]
    assert list(mapped) == [e for e in entries if e]
    forms = _forms(entries)
    assert len(blob) == min(forms.values())  # the smallest form
    assert blob[:1] in (b"S", b"R") or len(blob) == PAGE_BYTES
    assert mapped_pairs(entries.tobytes())[1] == mapped  # the dense form of the same page agrees


HOSTILE: dict[str, tuple[bytes, str]] = {
    "empty blob": (b"", "is empty"),
    "torn page": (b"\x01\x02", "unknown encoding"),
    "unknown tag": (b"X" + bytes(10), "unknown encoding"),
    "dense length minus one": (bytes(PAGE_BYTES - 1), "unknown encoding"),
    "dense length plus one": (bytes(PAGE_BYTES + 1), "unknown encoding"),
    "sparse, a pair cut short": (_sparse([1], [make_entry(3, DATA)])[:-1], "cannot have"),
    "runs, a run cut short": (_runs([(1, 2, make_entry(3, DATA))])[:-1], "cannot have"),
    "sparse, unsorted": (_sparse([5, 4], [make_entry(1, DATA), make_entry(2, DATA)]), "out of order or twice"),
    "sparse, twice": (_sparse([5, 5], [make_entry(1, DATA), make_entry(2, DATA)]), "out of order or twice"),
    "sparse, beyond the page": (_sparse([3, 512], [make_entry(1, DATA), make_entry(2, DATA)]), "beyond its 512"),
    "sparse, a zero entry": (_sparse([3], [0]), "invalid entry 0x0"),
    "sparse, state 3": (_sparse([3], [make_entry(4, DATA) | 3]), "invalid entry 0x23"),
    "sparse, state 0 on a dblock": (_sparse([3], [4 << DBLOCK_SHIFT]), "invalid entry 0x20"),
    "runs, no entries": (_runs([(3, 0, make_entry(1, DATA))]), "a run of no entries"),
    "runs, past the end": (_runs([(500, 13, make_entry(1, DATA))]), "beyond its 512"),
    "runs, overlapping": (_runs([(0, 10, make_entry(1, DATA)), (9, 2, make_entry(50, DATA))]), "overlapping"),
    "runs, unsorted": (_runs([(20, 1, make_entry(1, DATA)), (0, 2, make_entry(50, DATA))]), "out of order"),
    "runs, state 3": (_runs([(0, 2, make_entry(1, DATA) | 3)]), "invalid entry"),
    "runs, a zero entry": (_runs([(0, 2, 0)]), "invalid entry"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_malformed_blobs_are_refused_with_one_sentence(case: str) -> None:
    blob, words = HOSTILE[case]
    for decode in (decode_entries, mapped_pairs):
        with pytest.raises(CorruptionError, match=words) as info:
            decode(blob, 42)
        message = str(info.value)
        assert message.startswith("mapping page 42 ") and "\n" not in message
    with pytest.raises(CorruptionError, match=words):
        Page.from_blob(7, 1, blob)


# ----- a real pool ---------------------------------------------------------------------


def _spread_pool(path: Path, stretches: int) -> dict[int, bytes]:
    """A pool of 4 KiB blocks with one block written per 512-block stretch (and one
    stretch written densely); returns what each written vblock holds."""
    written: dict[int, bytes] = {}
    pool = Pool.create(str(path), 64 << 20, block_size=BLOCK)
    try:
        vol = pool.create_volume("v", stretches * PAGE_ENTRIES * BLOCK)
        for i in range(stretches):
            vblock = i * PAGE_ENTRIES + (i * 37) % PAGE_ENTRIES
            written[vblock] = bytes([i % 251 + 1]) * BLOCK
        for vblock in range(PAGE_ENTRIES, 2 * PAGE_ENTRIES, 3):  # one stretch with many mappings
            written[vblock] = vblock.to_bytes(4, "little") * (BLOCK // 4)
        for vblock, data in written.items():
            vol.write(vblock * BLOCK, data)
        pool.commit()
        create_snapshot(pool, "v", "s")  # then copies of shared pages
        for vblock in list(written)[::5]:
            written[vblock] = b"\xee" * BLOCK
            vol.write(vblock * BLOCK, written[vblock])
    finally:
        pool.close()
    return written


def _read_back(path: Path, written: dict[int, bytes]) -> None:
    pool = Pool.open(str(path))
    try:
        vol = pool.volume("v")
        for vblock, data in written.items():
            assert vol.read(vblock * BLOCK, BLOCK) == data
        assert vol.read(2 * BLOCK, BLOCK) == bytes(BLOCK)  # never written
    finally:
        pool.close()


def test_a_sparsely_written_pool_stores_small_pages_and_checks_clean(tmp_path: Path) -> None:
    path = tmp_path / "pool"
    written = _spread_pool(path, 60)
    with sqlite3.connect(path / DB_NAME) as db:
        sizes = [n for (n,) in db.execute("SELECT length(entries) FROM pages")]
    assert len(sizes) > 60 and sorted(sizes)[len(sizes) // 2] == 11  # most pages map one block
    assert max(sizes) < PAGE_BYTES
    thinblock("pool", "check", str(path))
    _read_back(path, written)


def test_an_old_pools_dense_pages_read_check_and_are_rewritten_small(tmp_path: Path) -> None:
    path = tmp_path / "pool"
    written = _spread_pool(path, 20)
    with sqlite3.connect(path / DB_NAME) as db:  # every page as an old pool stored it
        rows = list(db.execute("SELECT id, entries FROM pages"))
        db.executemany("UPDATE pages SET entries = ? WHERE id = ?", [(decode_entries(b).tobytes(), i) for i, b in rows])
    thinblock("pool", "check", str(path))
    _read_back(path, written)
    pool = Pool.open(str(path))
    try:
        pool.volume("v").write(BLOCK, b"\x11" * BLOCK)  # a new mapping: the first page is stored anew
        written[1] = b"\x11" * BLOCK
    finally:
        pool.close()
    with sqlite3.connect(path / DB_NAME) as db:
        sizes = {pid: n for pid, n in db.execute("SELECT id, length(entries) FROM pages")}
    assert sorted(sizes.values())[0] < PAGE_BYTES  # the rewritten page is compact
    thinblock("pool", "check", str(path))
    _read_back(path, written)


def test_check_names_a_malformed_page_and_repair_drops_only_it(tmp_path: Path) -> None:
    path = tmp_path / "pool"
    written = _spread_pool(path, 10)
    with sqlite3.connect(path / DB_NAME) as db:
        (vid,) = db.execute("SELECT id FROM volumes WHERE name = 'v'").fetchone()
        (pid,) = db.execute("SELECT page_id FROM roots WHERE volume_id = ? AND page_index = 4", (vid,)).fetchone()
        (blob,) = db.execute("SELECT entries FROM pages WHERE id = ?", (pid,)).fetchone()
        assert blob[:1] == b"S"
        db.execute("UPDATE pages SET entries = ? WHERE id = ?", (blob + blob[1:3], pid))  # a torn extra slot
    out = thinblock("pool", "check", str(path), check=False)
    assert out.returncode == 1
    assert f"mapping page {pid} is 13 bytes, a length its encoding 'S' cannot have" in out.stdout + out.stderr
    thinblock("pool", "repair", str(path))
    thinblock("pool", "check", str(path))
    lost = range(4 * PAGE_ENTRIES, 5 * PAGE_ENTRIES)
    _read_back(path, {vb: (bytes(BLOCK) if vb in lost else data) for vb, data in written.items()})
