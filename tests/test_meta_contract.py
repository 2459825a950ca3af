"""The metadata-store contract (meta/base.py), one suite run against every
backend's metadata store. A new backend is one line in LOCATIONS."""

from __future__ import annotations

import errno
import threading
import uuid
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import new_rados_locator
from thinblock.backends import Location, locate
from thinblock.backends.memory import MemoryLocation
from thinblock.core.mapping import DBLOCK_SHIFT, PAGE_ENTRIES, BlockState, Page, empty_entries, make_entry
from thinblock.errors import PoolBusyError
from thinblock.meta.base import FORMAT_VERSION, MetadataStore, Transaction, VolumeRow

PAGE = bytes(range(256)) * 16  # a 4 KiB blob (pages are opaque to the store)

LOCATIONS: dict[str, Callable[[pytest.FixtureRequest, Path], str]] = {
    "directory-sqlite": lambda request, tmp: str(tmp / "pool"),
    "memory": lambda request, tmp: f"memory:contract-{uuid.uuid4().hex}",
    "rados-omap": lambda request, tmp: new_rados_locator(request, "contract"),
}


@pytest.fixture(params=list(LOCATIONS))
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Location]:
    loc = locate(LOCATIONS[request.param](request, tmp_path))
    loc.create({"block_size": 4096, "size_bytes": 1 << 20, "clean": True}, 1 << 20, None)
    try:
        yield loc
    finally:
        if isinstance(loc, MemoryLocation):
            loc.remove_created()


@pytest.fixture
def meta(location: Location) -> Iterator[MetadataStore]:
    """The store as its owner uses it (a RADOS store commits only under its holder's epoch)."""
    store = location.open_meta(readonly=False)
    ownership = location.own("meta contract")
    try:
        yield store
    finally:
        ownership.release()
        store.close()


def _row(vid: int, name: str) -> VolumeRow:
    return VolumeRow(vid, name, 1 << 20, "on", 1.0, data_blocks=3)


def _txn(vid: int = 1, name: str = "a") -> Transaction:
    return Transaction(
        superblock={"transaction_id": vid},
        volumes=[_row(vid, name)],
        roots={(vid, 0): 10 * vid, (vid, 5): 10 * vid + 1},
        pages={10 * vid: (1, PAGE), 10 * vid + 1: (2, PAGE[::-1])},
        refcount_pages={0: b"\x01\x00\x00\x00" * 1024},
    )


def _snapshot(meta: MetadataStore) -> tuple[object, ...]:
    return (
        meta.superblock(),
        meta.volumes(),
        sorted(meta.all_roots()),
        sorted(meta.all_pages()),
        meta.refcount_pages(),
        meta.max_page_id(),
        meta.max_volume_id(),
    )


def test_a_new_store_holds_the_superblock(meta: MetadataStore) -> None:
    sb = meta.superblock()
    assert sb["format_version"] == FORMAT_VERSION and sb["transaction_id"] == 0 and sb["block_size"] == 4096
    assert meta.volumes() == [] and list(meta.all_roots()) == [] and list(meta.all_pages()) == []
    assert meta.max_page_id() == 0 and meta.max_volume_id() == 0 and meta.integrity_problems() == []


def test_commit_is_visible_everywhere(meta: MetadataStore) -> None:
    meta.commit(_txn())
    assert meta.superblock()["transaction_id"] == 1
    assert [v.name for v in meta.volumes()] == ["a"] and meta.volumes()[0].data_blocks == 3
    assert meta.roots(1) == {0: 10, 5: 11}
    assert meta.page(10) == (1, PAGE) and meta.page(11) == (2, PAGE[::-1]) and meta.page(12) is None
    assert meta.max_page_id() == 11 and meta.max_volume_id() == 1
    assert meta.refcount_pages() == {0: b"\x01\x00\x00\x00" * 1024}


def test_deletes_and_refcount_only_changes(meta: MetadataStore) -> None:
    meta.commit(_txn())
    meta.commit(_txn(2, "b"))
    meta.commit(Transaction(roots={(1, 5): None}, pages={11: None}, page_refcounts={10: 7}))
    assert meta.roots(1) == {0: 10} and meta.page(11) is None and meta.page(10) == (7, PAGE)
    meta.commit(Transaction(deleted_volumes=[1]))
    assert [v.name for v in meta.volumes()] == ["b"] and meta.roots(1) == {}
    assert meta.max_page_id() >= 21  # ids are never handed out twice


def test_pages_and_refcounts_are_read_in_batches(meta: MetadataStore) -> None:
    """Counts of existing pages, without their entries, and whole pages; missing ids are
    left out, and a count-only change is what the batches read next (past one SQL batch
    and one omap read)."""
    assert meta.page_refcounts([10, 11]) == {}
    meta.commit(_txn())
    assert meta.page_refcounts([11, 10, 12]) == {10: 1, 11: 2} and meta.page_refcounts([]) == {}
    many = {1000 + i: (1 + i % 3, PAGE[:8]) for i in range(2500)}
    meta.commit(Transaction(pages=dict(many)))
    assert meta.page_refcounts(many) == {pid: page[0] for pid, page in many.items()}
    meta.commit(Transaction(page_refcounts={pid: 9 for pid in many} | {10: 5, 4242424: 1}))
    assert meta.page_refcounts([*many, 10, 4242424]) == {pid: 9 for pid in many} | {10: 5}
    assert meta.page(10) == (5, PAGE) and meta.integrity_problems() == []
    assert meta.pages([10, 11, 12]) == {10: (5, PAGE), 11: (2, PAGE[::-1])} and meta.pages([]) == {}
    assert meta.pages(many) == {pid: (9, page[1]) for pid, page in many.items()}


def test_a_rename_is_a_row_update(location: Location, meta: MetadataStore) -> None:
    """volume rename commits the same row (same id) with a new name: the old name is
    free afterwards, roots and pages stay, and it lasts past reopening; renaming
    onto a name another row holds fails the whole commit."""
    meta.commit(_txn())
    meta.commit(_txn(2, "b"))
    meta.commit(Transaction(volumes=[_row(1, "renamed")]))
    assert [(v.id, v.name) for v in meta.volumes()] == [(2, "b"), (1, "renamed")]
    assert meta.roots(1) == {0: 10, 5: 11} and meta.page(10) == (1, PAGE)
    meta.commit(Transaction(volumes=[_row(2, "a")]))  # the old name is free for another
    before = _snapshot(meta)
    with pytest.raises(OSError):
        meta.commit(Transaction(volumes=[_row(1, "a")]))
    assert _snapshot(meta) == before
    again = location.open_meta(readonly=True)
    try:
        assert [(v.id, v.name) for v in again.volumes()] == [(2, "a"), (1, "renamed")]
    finally:
        again.close()


def test_names_swapped_in_one_commit(location: Location, meta: MetadataStore) -> None:
    """Renames that swap two names (a to t, b to a, t to b) can land in one commit,
    when a commit in flight or a failing one holds them back: only the names after
    the commit must be unique, or every later commit fails and the pool is wedged."""
    meta.commit(_txn())
    meta.commit(_txn(2, "b"))
    meta.commit(Transaction(volumes=[_row(1, "b"), _row(2, "a")]))
    assert sorted((v.id, v.name) for v in meta.volumes()) == [(1, "b"), (2, "a")]
    assert meta.roots(1) == {0: 10, 5: 11}
    again = location.open_meta(readonly=True)
    try:
        assert sorted((v.id, v.name) for v in again.volumes()) == [(1, "b"), (2, "a")]
    finally:
        again.close()


def test_a_failed_commit_changes_nothing(meta: MetadataStore) -> None:
    meta.commit(_txn())
    before = _snapshot(meta)
    bad = _txn(2, "a")  # a second volume named "a": the store refuses the whole transaction
    bad.superblock["transaction_id"] = 99
    with pytest.raises(OSError) as info:
        meta.commit(bad)
    assert info.value.errno in (errno.EIO, errno.ENOSPC)
    assert _snapshot(meta) == before
    meta.commit(_txn(2, "b"))  # and the store works on
    assert [v.name for v in meta.volumes()] == ["a", "b"]


def test_commits_survive_reopening(location: Location, meta: MetadataStore) -> None:
    meta.commit(_txn())
    again = location.open_meta(readonly=True)
    try:
        assert _snapshot(again) == _snapshot(meta)
    finally:
        again.close()


def test_page_reads_run_beside_commits(meta: MetadataStore) -> None:
    meta.commit(_txn())
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                assert meta.page(10) == (1, PAGE)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(30):
        meta.commit(Transaction(superblock={"transaction_id": 10 + i}, pages={1000 + i: (1, PAGE)}))
    stop.set()
    thread.join()
    assert errors == []


def test_restore_replaces_everything_at_once(location: Location, meta: MetadataStore) -> None:
    meta.commit(_txn())
    meta.close()
    location.replace_meta({"block_size": 4096, "size_bytes": 1 << 20, "clean": False}, _txn(3, "c"))
    fresh = location.open_meta(readonly=True)
    try:
        assert [v.name for v in fresh.volumes()] == ["c"] and fresh.roots(1) == {} and fresh.roots(3) == {0: 30, 5: 31}
        assert fresh.superblock()["clean"] is False
    finally:
        fresh.close()


def test_ownership_is_exclusive(location: Location) -> None:
    first = location.own("test one")
    assert location.is_owned()
    with pytest.raises(PoolBusyError, match=r"test one|held"):
        location.own("test two")
    first.release()
    assert not location.is_owned()
    location.own("test three").release()


# ----- mapping pages in their stored encodings (core/mapping.py) -----------------------


def _entries(pairs: dict[int, int]) -> array[int]:
    entries = empty_entries()
    for slot, entry in pairs.items():
        entries[slot] = entry
    return entries


MAX_DBLOCK = (1 << (64 - DBLOCK_SHIFT)) - 1
ENCODED_PAGES: dict[str, array[int]] = {
    "empty": empty_entries(),
    "one entry": _entries({300: make_entry(7, BlockState.DATA)}),
    "spread": _entries({s: make_entry(1000 + s, BlockState.DATA) for s in range(0, PAGE_ENTRIES, 64)}),
    "dense sequential": _entries({s: make_entry(5 + s, BlockState.DATA) for s in range(PAGE_ENTRIES)}),
    "dense scattered": _entries({s: make_entry((s * 7919) % 65521 + 1, BlockState.DATA) for s in range(PAGE_ENTRIES)}),
    "runs": _entries(
        {s: make_entry(40 + s, BlockState.DATA if s < 200 else BlockState.ZEROED) for s in range(100, 300)}
        | {s: make_entry(9000 + s, BlockState.ZEROED, pinned=True) for s in range(400, 512)}
    ),
    "max dblock": _entries(
        {0: make_entry(MAX_DBLOCK - 1, BlockState.DATA), 1: make_entry(MAX_DBLOCK, BlockState.DATA), 511: 1 << 3 | 2}
    ),
    "pinned and zeroed": _entries(
        {
            s: make_entry(s // 2, BlockState.ZEROED if s % 3 else BlockState.DATA, pinned=s % 2 == 0)
            for s in range(0, 512, 5)
        }
    ),
}


def test_every_page_encoding_round_trips(location: Location, meta: MetadataStore) -> None:
    """The store keeps each page's blob exactly, whatever its encoding, and it decodes
    to the page that was written, through page() and all_pages(), before and after
    reopening; an old pool's dense 4096-byte blob still reads."""
    blobs = {pid: Page(pid, 1, entries).to_blob() for pid, entries in enumerate(ENCODED_PAGES.values(), 100)}
    old_dense = ENCODED_PAGES["spread"].tobytes()  # how every page was stored before
    blobs[200] = old_dense
    assert len(blobs[101]) == 11 and len(blobs[103]) == 13 and len(blobs[104]) == 8 * PAGE_ENTRIES
    meta.commit(Transaction(pages={pid: (1, blob) for pid, blob in blobs.items()}))
    want = {pid: entries for pid, entries in enumerate(ENCODED_PAGES.values(), 100)} | {200: ENCODED_PAGES["spread"]}
    again = location.open_meta(readonly=True)
    try:
        for store in (meta, again):
            for pid, entries in want.items():
                found = store.page(pid)
                assert found is not None and found[1] == blobs[pid]
                assert Page.from_blob(pid, *found).entries == entries
            walked = {pid: Page.from_blob(pid, ref, blob).entries for pid, ref, blob in store.all_pages()}
            assert walked == want
    finally:
        again.close()
