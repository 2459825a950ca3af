"""A commit that fails changes nothing in memory, the committer never dies, and
everything resumes on its own when the layer below recovers (docs/architecture.md rule 2)."""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

import pytest

from tests.faults import Fault, FaultyMeta, FaultyStore, install
from thinblock import NoSpaceError, Pool, Volume
from thinblock.backends import locate
from thinblock.errors import CommitError
from thinblock.tools.check import check_metadata

BS = 64 << 10


def _check(path: Path) -> list[str]:
    meta = locate(str(path)).open_meta(readonly=True)
    try:
        return check_metadata(meta)
    finally:
        meta.close()


def test_committer_survives_failures_and_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "pool"
    pool = Pool.create(str(path), 64 * BS)
    meta = FaultyMeta(pool.meta)
    install(pool, meta=meta)
    vol = pool.create_volume("v", 32 * BS)
    vol.write(0, b"a" * (4 * BS))
    vol.flush()
    caplog.set_level(logging.WARNING, logger="thinblock.pool")
    meta.arm(Fault(("commit",), 0, "enospc", times=6))  # the host is full for a while
    vol.write(BS, b"b" * BS)  # an overwrite: needs no new space
    vol.write(3 * BS, bytes(BS))  # DATA -> ZEROED: a metadata change, no new space
    with pytest.raises(CommitError) as info:
        vol.flush()  # a flush fails honestly, and says ENOSPC
    assert info.value.errno == errno.ENOSPC
    assert vol.read(0, 2 * BS) == b"a" * BS + b"b" * BS  # reads go on
    with pytest.raises(NoSpaceError):
        vol.write(8 * BS, b"c" * BS)  # new space is refused while commits fail
    deadline = time.monotonic() + 20
    while pool.commit_failure is not None:
        assert time.monotonic() < deadline, "commits never recovered"
        assert pool.committer._thread is not None and pool.committer._thread.is_alive(), "the committer died"
        time.sleep(0.1)
    assert meta.fault is not None and meta.fault.times == 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failed" in m for m in messages) == 1, messages  # logged once, not per retry
    assert any("succeed again" in m for m in messages)
    vol.write(8 * BS, b"c" * BS)  # resumed, with no restart
    pool.close()
    assert _check(path) == []
    with Pool.open(str(path)) as again:
        assert again.volume("v").read(0, 9 * BS) == b"a" * BS + b"b" * BS + b"a" * BS + bytes(5 * BS) + b"c" * BS


def test_failed_commit_keeps_refcounts_pending(tmp_path: Path) -> None:
    """The reported case: a failed commit lost dirty refcount pages, so later commits
    wrote wrong refcounts and a new volume's writes landed in another's data."""
    path = tmp_path / "pool"
    pool = Pool.create(str(path), 16 * BS, block_size=BS)
    meta = FaultyMeta(pool.meta)
    install(pool, meta=meta)
    a = pool.create_volume("a", 8 * BS)
    a.write(0, b"A" * (8 * BS))
    meta.arm(Fault(("commit",), 0, "enospc", times=2))  # past the metadata slack too
    with pytest.raises(CommitError):
        pool.commit()
    pool.commit()  # retried: the same refcount pages, now written
    pool.close()
    assert _check(path) == []
    with Pool.open(str(path)) as again:
        b = again.create_volume("b", 8 * BS)
        b.write(0, b"B" * (8 * BS))
        assert again.volume("a").read(0, 8 * BS) == b"A" * (8 * BS)


def _pool_over_a_faulty_store(path: Path) -> tuple[Pool, FaultyStore, Volume]:
    """A pool on a FaultyStore (not armed yet) with a volume v whose first block holds x."""
    pool = Pool.create(str(path), 16 * BS, block_size=BS)
    store = FaultyStore(pool.store)
    install(pool, store=store)
    vol = pool.create_volume("v", 8 * BS)
    vol.write(0, b"x" * BS)
    return pool, store, vol


def test_failed_data_sync_fails_the_flush_and_commits_nothing(tmp_path: Path) -> None:
    path = tmp_path / "pool"
    pool, store, vol = _pool_over_a_faulty_store(path)
    store.arm(Fault(("flush",), 0, "eio"))
    with pytest.raises(CommitError) as info:
        vol.flush()
    assert info.value.errno == errno.EIO
    assert _check(path) == []
    vol.flush()
    pool.close()
    with Pool.open(str(path)) as again:
        assert again.volume("v").read(0, BS) == b"x" * BS


@pytest.mark.parametrize("failing", ["write_births", "write_header"])
def test_the_owner_tail_failing_changes_nothing(tmp_path: Path, failing: str) -> None:
    """The birth table (written before the data sync) and the generation (after the
    metadata commit) failing below: a births failure fails the commit and changes
    nothing, retried whole; a header failure is logged and the next commit records
    it. Every flushed byte is there afterwards, and the metadata checks clean."""
    path = str(tmp_path / "pool")
    pool = Pool.create(path, 16 << 20)
    try:
        assert pool.owned is not None
        vol = pool.create_volume("v", 4 << 20)
        real = getattr(pool.owned, failing)
        calls: list[int] = []

        def eio(*args: object) -> None:
            calls.append(1)
            raise OSError(errno.EIO, "injected")

        setattr(pool.owned, failing, eio)
        vol.write(0, b"x" * (128 << 10))
        if failing == "write_births":
            with pytest.raises(CommitError):
                pool.commit()
            before = locate(path).open_meta(readonly=True)
            try:  # nothing of the failed commit is in the metadata
                assert [r.data_blocks for r in before.volumes()] == [0]
            finally:
                before.close()
        else:
            pool.commit()  # the generation lags one commit: never refused, recorded later
        assert calls
        setattr(pool.owned, failing, real)
        pool.commit()
        assert vol.read(0, 128 << 10) == b"x" * (128 << 10)
    finally:
        pool.close()
    meta = locate(path).open_meta(readonly=True)
    try:
        assert check_metadata(meta) == []
        assert [r.data_blocks for r in meta.volumes()] == [2]
    finally:
        meta.close()
    with Pool.open(path) as again:  # opens (no false rollback refusal) and reads back
        assert again.volume("v").read(0, 128 << 10) == b"x" * (128 << 10)


def test_an_overwrite_in_place_on_a_full_layer_below_is_enospc_and_changes_nothing(tmp_path: Path) -> None:
    """An overwrite of a block the volume holds alone takes the short path (no plan,
    no entry changes); the layer below saying ENOSPC there is the pool's ENOSPC,
    naming that layer, as on the general path, and the block keeps its bytes."""
    path = tmp_path / "pool"
    pool, store, vol = _pool_over_a_faulty_store(path)
    store.arm(Fault(("pwritev",), 0, "enospc", times=2))  # the short path, then the general one
    with pytest.raises(NoSpaceError, match="data store below pool"):
        vol.write(4096, b"y" * 4096)
    assert store.fault is not None and store.fault.times == 0
    assert vol.read(0, BS) == b"x" * BS
    vol.write(4096, b"y" * 4096)  # the layer below has room again
    assert vol.read(0, 8192) == b"x" * 4096 + b"y" * 4096
    pool.close()
    assert _check(path) == []
