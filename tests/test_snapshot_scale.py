"""Snapshots of volumes with many spread mapping pages: shared by their refcounts alone.

A snapshot takes one more reference on every page of its volume without loading
any page (the counts are read in one batch: MetadataStore.page_refcounts), and
its removal gives them back; the counts are right after reopening and `pool
check` is clean. A failing batch read or commit changes nothing.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults import Fault, FaultyMeta, install
from thinblock import Pool
from thinblock.backends import locate
from thinblock.backends.memory import MemoryLocation
from thinblock.core.mapping import PAGE_ENTRIES
from thinblock.core.snapshot import adopt, create_snapshot, rollback, stage
from thinblock.errors import CommitError
from thinblock.tools.check import check_metadata

BS = 4096
PAGES = 300  # one mapped block per page: as many pages as blocks


@pytest.fixture(params=["directory", "memory"])
def locator(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "directory":
        yield str(tmp_path / "pool")
        return
    name = f"memory:scale-{uuid.uuid4().hex}"
    yield name
    location = locate(name)
    assert isinstance(location, MemoryLocation)
    location.remove_created()


def _spread(locator: str) -> None:
    """Volume v with block 0 of every page written (one more than its index as data:
    an all-zero write would map nothing)."""
    with Pool.create(locator, 4 * PAGES * BS, block_size=BS) as pool:
        vol = pool.create_volume("v", PAGES * PAGE_ENTRIES * BS)
        for i in range(PAGES):
            vol.write(i * PAGE_ENTRIES * BS, _data(i))


def _data(i: int) -> bytes:
    return (i + 1).to_bytes(4, "little") * (BS // 4)


def _counts(locator: str, volume: str) -> list[int]:
    """The committed refcount of every page of the volume's root table."""
    meta = locate(locator).open_meta(readonly=True)
    try:
        row = next(r for r in meta.volumes() if r.name == volume)
        ids = list(meta.roots(row.id).values())
        counts = meta.page_refcounts(ids)
        assert meta.page_refcounts([max(ids) + 1000]) == {}  # a missing page has no count
        return [counts[pid] for pid in ids]
    finally:
        meta.close()


def _problems(locator: str) -> list[str]:
    meta = locate(locator).open_meta(readonly=True)
    try:
        return check_metadata(meta)
    finally:
        meta.close()


def _block(pool: Pool, name: str, i: int) -> bytes:
    return pool.volume(name).read(i * PAGE_ENTRIES * BS, BS)


def test_a_snapshot_shares_every_spread_page_without_loading_one(locator: str) -> None:
    _spread(locator)
    with Pool.open(locator) as pool:
        snap = create_snapshot(pool, "v", "s")
        assert pool.txn.pages == {}, "a snapshot loaded mapping pages to share them"
        assert len(snap.root) == PAGES
    assert _counts(locator, "v") == [2] * PAGES and _counts(locator, "s") == [2] * PAGES
    assert _problems(locator) == []
    with Pool.open(locator) as pool:
        pool.volume("v").write(0, b"\xff" * BS)  # copy-on-write of page 0: v's copy, s keeps the old
        assert _block(pool, "s", 0) == _data(0) and _block(pool, "v", 7) == _data(7)
        # The overwrite left a block to one holder: every volume sharing blocks recounts
        # its exclusive blocks, reading only the pages it holds alone (v's copy of page 0).
        loaded = set(pool.txn.pages)
        pool.volume_list(None)
        assert set(pool.txn.pages) - loaded <= {pool.volume("v").root[0]}
        pool.remove_volume("s")
    assert _counts(locator, "v") == [1] * PAGES and _problems(locator) == []
    with Pool.open(locator) as pool:
        assert _block(pool, "v", 0) == b"\xff" * BS and _block(pool, "v", PAGES - 1) == _data(PAGES - 1)


def test_a_failing_count_read_changes_nothing(locator: str) -> None:
    _spread(locator)
    with Pool.open(locator) as pool:
        meta = FaultyMeta(pool.meta)
        install(pool, meta=meta)
        meta.arm(Fault(("page_refcounts",), 0, "eio"))
        with pytest.raises(OSError, match="injected"):
            create_snapshot(pool, "v", "s")
        assert meta.fired and "s" not in pool.volumes and not pool.txn.dirty and pool.txn.page_refs == {}
        create_snapshot(pool, "v", "s")  # works once the store reads again
        create_snapshot(pool, "v", "t")
    with Pool.open(locator) as pool:
        meta = FaultyMeta(pool.meta)
        install(pool, meta=meta)
        for fail in (lambda: pool.remove_volume("s"), lambda: rollback(pool, "v", "t")):
            meta.arm(Fault(("page_refcounts",), 0, "eio"))
            with pytest.raises(OSError, match="injected"):
                fail()
            assert meta.fired and "s" in pool.volumes and not pool.txn.dirty and pool.txn.page_refs == {}
            assert len(pool.volume("v").root) == PAGES and len(pool.volume("s").root) == PAGES
        pool.remove_volume("t")
        # Now removing s leaves v alone on every page: the removal needs their entries.
        meta.arm(Fault(("pages",), 0, "eio"))
        with pytest.raises(OSError, match="injected"):
            pool.remove_volume("s")
        assert meta.fired and "s" in pool.volumes and not pool.txn.dirty and pool.txn.pages == {}
        assert set(pool.txn.page_refs.values()) == {2} and len(pool.volume("s").root) == PAGES
    assert _counts(locator, "v") == [2] * PAGES and _problems(locator) == []


def test_a_failing_metadata_read_anywhere_in_adopt_changes_nothing(locator: str) -> None:
    """import-diff's last step (adopt) with each of its metadata reads failing in turn:
    every read comes before the first change, so a failure leaves the volume, its
    snapshot and the staging volume exactly as they were."""
    _spread(locator)
    with Pool.open(locator) as pool:
        create_snapshot(pool, "v", "s")
        staging = stage(pool, pool.volume("v"), "import-diff")
        staging.write(0, b"\xee" * BS)  # the diff: page 0 copied, the rest shared three ways
        meta = FaultyMeta(pool.meta)
        install(pool, meta=meta)
        for after in range(8):
            pool.commit()
            pool.txn.pages.clear()  # a fresh process: nothing loaded
            pool.txn.page_refs.clear()
            root = dict(pool.volume("v").root)
            meta.arm(Fault(("page", "pages", "page_refcounts"), after, "eio"))
            try:
                adopt(pool, "v", staging, None)
            except OSError as exc:
                assert "injected" in str(exc) and meta.fired
                assert staging.name in pool.volumes and not staging.removed and not pool.txn.dirty
                assert pool.volume("v").root == root
                continue
            assert not meta.fired
            break
        else:
            raise AssertionError("adopt never got past its reads")
        assert _block(pool, "v", 0) == b"\xee" * BS and _block(pool, "s", 0) == _data(0)
    assert _problems(locator) == []


def test_a_rollback_in_a_fresh_process_reads_shared_pages_once(locator: str) -> None:
    """The volume and its snapshot share every page: the batch reads name each once."""
    _spread(locator)
    with Pool.open(locator) as pool:
        create_snapshot(pool, "v", "s")
    with Pool.open(locator) as pool:
        pool.volume("v").write(0, b"\xff" * BS)
    with Pool.open(locator) as pool:
        rollback(pool, "v", "s")
        assert _block(pool, "v", 0) == _data(0)
    assert _problems(locator) == []


def test_a_failing_commit_of_a_share_is_retried_whole(locator: str) -> None:
    _spread(locator)
    with Pool.open(locator) as pool:
        meta = FaultyMeta(pool.meta)
        install(pool, meta=meta)
        meta.arm(Fault(("commit",), 0, "eio"))
        with pytest.raises(CommitError):
            create_snapshot(pool, "v", "s")
        assert meta.fired and pool.txn.dirty  # pending, in memory: the next commit writes it
        pool.commit()
    assert _counts(locator, "s") == [2] * PAGES and _problems(locator) == []
    with Pool.open(locator) as pool:
        meta = FaultyMeta(pool.meta)
        install(pool, meta=meta)
        meta.arm(Fault(("commit",), 0, "eio"))
        with pytest.raises(CommitError):
            pool.remove_volume("s")
        pool.commit()
    assert _counts(locator, "v") == [1] * PAGES and _problems(locator) == []


def test_a_pool_from_before_page_refs_is_read_and_upgraded(tmp_path: Path) -> None:
    """A pool whose counts live in the pages table only (before page_refs): read-only
    it is read through a view of them, opened for writing it gets the table."""
    locator = str(tmp_path / "pool")
    _spread(locator)
    with Pool.open(locator) as pool:
        create_snapshot(pool, "v", "s")
    db = sqlite3.connect(tmp_path / "pool" / "metadata.sqlite")
    with db:
        db.execute("UPDATE pages SET refcount = (SELECT refcount FROM page_refs r WHERE r.id = pages.id)")
        db.execute("DROP TABLE page_refs")
    db.close()
    assert _counts(locator, "v") == [2] * PAGES and _problems(locator) == []
    with Pool.open(locator) as pool:
        create_snapshot(pool, "v", "t")
    db = sqlite3.connect(tmp_path / "pool" / "metadata.sqlite")
    assert db.execute("SELECT COUNT(*), MIN(refcount) FROM page_refs").fetchone() == (PAGES, 3)
    db.close()
    assert _problems(locator) == []
