"""Owners per volume in one process, step by step: the cases an independent review
found (each failed before its fix), kept as plain tests beside the model test.

Several Pool objects opened with `volumes=[...]` on one directory pool behave as
separate processes would: each has its own SQLite connection and its own OFD
locks on the leases file.
"""

from __future__ import annotations

import errno
import sys
import threading
from pathlib import Path

import pytest

from tests.test_commands import until
from thinblock import Pool, ThinblockError
from thinblock.admin.idle_grants import give_back_idle_grants
from thinblock.admin.verbs import run_verb
from thinblock.core.snapshot import clone, create_snapshot
from thinblock.errors import CommitError, UncleanCloseError
from thinblock.meta.base import Transaction
from thinblock.tools.check import check_metadata

BS = 4096


def _pool(tmp_path: Path, blocks: int = 16384) -> str:
    path = str(tmp_path / "pool")
    Pool.create(path, blocks * BS, block_size=BS).close()
    return path


def _check(path: str) -> None:
    with Pool.open(path) as whole:
        assert check_metadata(whole.meta) == []


def test_a_failed_page_id_reservation_in_a_copy_on_write_changes_nothing(tmp_path: Path) -> None:
    path = _pool(tmp_path, 256)
    with Pool.open(path) as p:
        p.create_volume("a", 64 * BS).write(0, b"o" * (4 * BS))
        create_snapshot(p, "a", "a@s")
    pool = Pool.open(path, volumes=["a"], autocommit=False, purpose="A")
    vol, snap = pool.volume("a"), pool.volume("a@s")
    # The ids reserved ahead are used up: the copy's id needs a reservation, which fails.
    pool.txn._spare_page_ids.clear()
    pool.txn._next_page_id = pool.txn._page_id_end
    real = pool.txn.reserve_page_ids

    def failing(count: int) -> int:
        raise OSError(5, "metadata store: I/O error")

    pool.txn.reserve_page_ids = failing
    with pytest.raises(OSError):
        vol.write(0, b"N" * BS)
    pool.txn.reserve_page_ids = real
    assert pool.txn.page(vol.root[0]).refcount == 2  # still shared with a@s
    vol.write(BS, b"M" * BS)  # so this write copies the page, never writes it in place
    assert snap.read(0, 4 * BS) == b"o" * (4 * BS)
    pool.close()
    with Pool.open(path) as whole:
        assert whole.volume("a@s").read(0, 4 * BS) == b"o" * (4 * BS)
        assert whole.volume("a").read(0, 2 * BS) == b"o" * BS + b"M" * BS
    _check(path)


def test_a_pool_level_step_counts_what_other_owners_committed(tmp_path: Path) -> None:
    """A's view of a snapshot page's count is stale (another owner's rollback shared
    it since): removing the snapshot must not free the page, and A keeps committing."""
    path = _pool(tmp_path)
    with Pool.open(path) as p:
        v = p.create_volume("vm1", 64 * BS)
        v.write(0, b"v" * BS)
        create_snapshot(p, "vm1", "vm1@s")
        v.write(0, b"w" * BS)
        clone(p, "vm1@s", "test1")
        p.volume("test1").write(0, b"t" * BS)
    a = Pool.open(path, volumes=["vm1"], autocommit=False, purpose="A")
    assert a.volume("vm1@s").read(0, BS) == b"v" * BS  # its page is in A's cache now
    c = Pool.open(path, volumes=["test1"], autocommit=False, purpose="C")
    run_verb(c, "volume_rollback", {"name": "test1", "snapshot": "vm1@s"})
    c.close()
    run_verb(a, "volume_remove", {"name": "vm1@s", "kind": "snapshot"})
    a.volume("vm1").write(BS, b"x" * BS)
    a.commit()
    a.close()
    with Pool.open(path) as whole:
        assert whole.volume("test1").read(0, BS) == b"v" * BS
        assert whole.volume("vm1").read(0, 2 * BS) == b"w" * BS + b"x" * BS
    _check(path)


def test_an_owner_never_writes_back_a_dependent_another_process_removed(tmp_path: Path) -> None:
    path = _pool(tmp_path)
    with Pool.open(path) as p:
        p.create_volume("vm1", 64 * BS).write(0, b"v" * (4 * BS))
        create_snapshot(p, "vm1", "vm1@s")
        clone(p, "vm1@s", "test1")
    a = Pool.open(path, volumes=["vm1"], autocommit=False, purpose="A")
    command = Pool.open(path, volumes=[], autocommit=False, purpose="command")
    run_verb(command, "volume_remove", {"name": "test1"})
    made = run_verb(command, "volume_create", {"name": "test1", "size_bytes": 16 * BS})
    command.close()
    run_verb(a, "volume_remove", {"name": "vm1@s", "kind": "snapshot"})
    a.volume("vm1").write(0, b"z" * BS)
    a.commit()
    a.close()
    with Pool.open(path) as whole:
        test1 = whole.volume("test1")
        assert test1.size_bytes == made["size_bytes"] == 16 * BS  # the new one, not the old row
        assert test1.read(0, BS) == bytes(BS)
        assert sorted(whole.volumes) == ["test1", "vm1"]
    _check(path)


def test_an_owner_changes_only_what_is_its_own(tmp_path: Path) -> None:
    path = _pool(tmp_path)
    with Pool.open(path) as p:
        p.create_volume("a", 64 * BS)
        p.create_volume("b", 64 * BS)
    a = Pool.open(path, volumes=["a"], autocommit=False, purpose="A")
    b = Pool.open(path, volumes=["b"], autocommit=False, purpose="B")
    try:
        with pytest.raises(ThinblockError, match="cannot be changed here"):
            run_verb(a, "volume_resize", {"name": "b", "size_bytes": 128 * BS})
        # Growth is a pool-level step either owner may run; the other's old view of the
        # size is no base for it (the stored size is).
        old_size = b.size_bytes
        a.grow(2 * old_size)
        assert b.meta.superblock()["size_bytes"] == 2 * old_size == a.size_bytes
        with pytest.raises(ThinblockError, match="shrinking"):
            b.grow(old_size + BS)
        with pytest.raises(ThinblockError, match="already exists"):
            run_verb(a, "snapshot_create", {"volume": "a", "name": "b"})
        run_verb(a, "snapshot_create", {"volume": "a", "name": "a@1"})
        run_verb(a, "snapshot_create", {"volume": "a@1", "name": "a@2"})  # a snapshot of a snapshot
        assert a.serves(a.volume("a@2")) and not b.serves(b.volume("a"))
        with pytest.raises(ThinblockError, match="cannot be changed here"):
            command = Pool.open(path, volumes=[], autocommit=False, purpose="command")
            try:
                run_verb(command, "volume_remove", {"name": "a@2", "kind": "snapshot"})
            finally:
                command.close()
    finally:
        a.close()
        b.close()
    _check(path)


def test_a_grant_kept_after_all_never_hands_out_a_block_freed_meanwhile(tmp_path: Path) -> None:
    """A handover or give-back that fails keeps its grants (restore_grant): a block
    freed in the open transaction stays on the freed-block path (committed, punched,
    synced), never allocatable at once; a block that was allocatable is again."""
    path = _pool(tmp_path, 1024)
    with Pool.open(path) as p:
        p.create_volume("a", 64 * BS)
    pool = Pool.open(path, volumes=["a"], autocommit=False, purpose="A")
    try:
        vol = pool.volume("a")
        vol.write(0, b"S" * BS)
        pool.commit()
        dblock = vol._entry(0) >> 3
        vol.trim(0, BS)  # freed in the open transaction: still mapped in committed state
        space = pool.accounts.space
        grant = pool.owner.grants[0] if pool.owner else None
        assert grant is not None and grant.start <= dblock < grant.start + grant.count
        with pool.lock:
            idle_before = space.allocatable_blocks
            was_idle = space.drop_grant(grant.start, grant.count)
            assert space.allocatable_blocks == idle_before - len(was_idle)
            space.restore_grant(grant.start, grant.count, was_idle)
            assert space.busy[dblock] == 1 and dblock in space.pending_free
            assert space.allocatable_blocks == idle_before
        vol.write(BS, b"T" * 512)  # a fresh block: never the one just freed
        assert vol._entry(1) >> 3 != dblock
        assert vol.read(BS, BS) == b"T" * 512 + bytes(BS - 512)
        pool.commit()
    finally:
        pool.close()
    _check(path)


def _die(pool: Pool) -> None:
    """What SIGKILL leaves: nothing committed or released; its locks go with its files."""
    pool.committer.closed.set()
    pool.store.close()
    pool.meta.close()
    pool._ownership.release()


@pytest.mark.parametrize("shared_meanwhile", [False, True], ids=["alone", "snapshot-meanwhile"])
def test_a_dead_owners_bytes_in_a_zeroed_block_never_show(tmp_path: Path, shared_meanwhile: bool) -> None:
    """An owner wrote into a provisioned (ZEROED) block in place and died before any
    commit. Its next owner zeroes it again, even when a command snapshotted the
    volume meanwhile (the page is shared then, and the snapshot's end would unshare it)."""
    path = _pool(tmp_path, 4096)
    with Pool.open(path) as p:
        p.create_volume("a", 64 * BS).provision(0, 4 * BS)
    first = Pool.open(path, volumes=["a"], autocommit=False, purpose="A")
    first.volume("a").write(0, b"X" * BS)
    _die(first)
    if shared_meanwhile:
        command = Pool.open(path, volumes=[], autocommit=False, purpose="command")
        run_verb(command, "snapshot_create", {"volume": "a", "name": "a@s"})
        command.close()
    second = Pool.open(path, volumes=["a"], autocommit=False, purpose="B")
    try:
        if shared_meanwhile:
            run_verb(second, "volume_remove", {"name": "a@s", "kind": "snapshot"})
            second.commit()
        second.volume("a").write(0, b"y" * 512)  # the rest of the block must read zero
        second.commit()
        assert second.volume("a").read(0, BS) == b"y" * 512 + bytes(BS - 512)
    finally:
        second.close()
    with Pool.open(path) as whole:
        assert whole.volume("a").read(0, BS) == b"y" * 512 + bytes(BS - 512)
    _check(path)


def test_an_owner_that_bypasses_the_core_check_is_refused_by_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """check_may_change is the core's rule; the store keeps it too (meta/owners.py's
    check_volume_writes): B, owning b, changes nothing of A's volume a or its snapshot,
    whether its core check is patched away or it commits to the store itself."""
    path = _pool(tmp_path)
    with Pool.open(path) as p:
        p.create_volume("a", 64 * BS).write(0, b"a" * BS)
        p.create_volume("b", 64 * BS)
        create_snapshot(p, "a", "a@s")
    a = Pool.open(path, volumes=["a"], autocommit=False, purpose="A")
    b = Pool.open(path, volumes=["b"], autocommit=False, purpose="B")
    a_id, snap_id = a.volume("a").row.id, a.volume("a@s").row.id
    stored = (a.meta.volumes(), sorted(a.meta.all_roots()))
    try:
        monkeypatch.setattr(b, "check_may_change", lambda vol: None)
        with pytest.raises(CommitError, match="volume 1 is not this owner's to change: it is held by A"):
            run_verb(b, "volume_resize", {"name": "a", "size_bytes": 128 * BS})
        assert b.owner is not None
        for txn in (
            Transaction(leases=b.owner.leases(), deleted_volumes=[a_id]),
            Transaction(leases=b.owner.leases(), roots={(snap_id, 0): None}),
        ):
            with pytest.raises(OSError) as exc:
                b.meta.commit(txn)
            assert exc.value.errno == errno.EPERM and "held by A" in str(exc.value)
        assert (a.meta.volumes(), sorted(a.meta.all_roots())) == stored  # nothing changed
        a.volume("a").write(BS, b"A" * BS)  # and A goes on
        a.commit()
        with pytest.raises(UncleanCloseError):  # B's refused resize is still pending
            b.close()
    finally:
        b.close()
        a.close()
    with Pool.open(path) as whole:
        assert whole.volume("a").size_bytes == 64 * BS
        assert whole.volume("a").read(0, 2 * BS) == b"a" * BS + b"A" * BS
        assert whole.volume("a@s").read(0, 2 * BS) == b"a" * BS + bytes(BS)
    _check(path)


def _hand_over(pool: Pool, name: str) -> None:
    pool.give_up(name, lambda _vol: 0)


def test_a_runtime_claim_never_serves_a_page_written_in_place_since_it_was_cached(tmp_path: Path) -> None:
    """A serves a, caches its page, hands a over; B writes the page in place (a alone
    holds it) and hands it back: A's claim must not serve the page it cached."""
    path = _pool(tmp_path, 256)
    with Pool.open(path) as p:
        p.create_volume("a", 64 * BS).write(0, b"o" * BS)
        p.create_volume("b", 64 * BS)
    first = Pool.open(path, volumes=["b"], autocommit=False, purpose="A")
    first.claim_volume("a")
    assert first.volume("a").read(0, 2 * BS) == b"o" * BS + bytes(BS)  # the page is cached here
    _hand_over(first, "a")
    second = Pool.open(path, volumes=["a"], autocommit=False, purpose="B")
    page_id = second.volume("a").root[0]
    second.volume("a").write(BS, b"N" * BS)  # in place: a alone holds its page
    assert second.volume("a").root[0] == page_id
    _hand_over(second, "a")
    vol = first.claim_volume("a")
    assert vol.read(0, 2 * BS) == b"o" * BS + b"N" * BS
    vol.write(2 * BS, b"M" * BS)
    first.close()
    second.close()
    _check(path)
    with Pool.open(path) as whole:
        assert whole.volume("a").read(0, 3 * BS) == b"o" * BS + b"N" * BS + b"M" * BS


def test_a_runtime_claim_of_a_clone_after_the_sharing_ended(tmp_path: Path) -> None:
    """A owns a, snapshots it and clones the snapshot (c: nobody's), reads through the
    shared page, then removes the snapshot and copies a's page away: c alone holds the
    page A cached. B claims c, writes the page in place and gives it up; A claims c."""
    path = _pool(tmp_path, 256)
    with Pool.open(path) as p:
        p.create_volume("a", 64 * BS).write(0, b"o" * BS)
    owner = Pool.open(path, volumes=["a"], autocommit=False, purpose="A")
    run_verb(owner, "snapshot_create", {"volume": "a", "name": "s"})
    run_verb(owner, "volume_clone", {"snapshot": "s", "name": "c"})
    assert owner.volume("s").read(0, BS) == b"o" * BS
    owner.volume("a").write(BS, b"x" * BS)  # a's copy of the page
    run_verb(owner, "volume_remove", {"name": "s", "kind": "snapshot"})
    other = Pool.open(path, volumes=[], autocommit=False, purpose="B")
    clone_vol = other.claim_volume("c")
    clone_vol.write(2 * BS, b"C" * BS)  # in place: c alone holds the page now
    other.commit()
    with pytest.raises(ThinblockError, match="served by B"):
        owner.claim_volume("c")
    _hand_over(other, "c")
    vol = owner.claim_volume("c")
    assert vol.read(0, 3 * BS) == b"o" * BS + bytes(BS) + b"C" * BS
    assert owner.volume("a").read(0, 3 * BS) == b"o" * BS + b"x" * BS + bytes(BS)
    owner.close()
    other.close()
    _check(path)


def test_a_runtime_claim_takes_a_volume_made_since_and_a_failed_one_releases_its_lease(tmp_path: Path) -> None:
    path = _pool(tmp_path, 256)
    with Pool.open(path) as p:
        p.create_volume("a", 64 * BS)
    owner = Pool.open(path, volumes=["a"], autocommit=False, purpose="A")
    with Pool.open(path, volumes=[], purpose="command") as command:  # a volume create elsewhere
        command.create_volume("n", 32 * BS)
        run_verb(command, "snapshot_create", {"volume": "n", "name": "n@1"})
    assert owner.visible_volume("n") is None
    real = owner.store.zero

    def failing(offset: int, length: int) -> None:
        raise OSError(errno.EIO, "data store: I/O error")

    owner.store.zero = failing  # type: ignore[method-assign]
    with Pool.open(path, volumes=[], purpose="maker") as maker:  # a ZEROED block to zero again
        maker.claim_volume("n").provision(0, BS)
        maker.commit()
    with pytest.raises(OSError):
        owner.claim_volume("n")
    assert not owner.serves(owner.volume("n"))
    owner.store.zero = real  # type: ignore[method-assign]
    vol = owner.claim_volume("n")  # the failed claim released the lease
    assert owner.serves(vol) and owner.serves(owner.volume("n@1"))
    vol.write(0, b"n" * BS)
    assert owner.volume("n@1").read(0, BS) == bytes(BS)
    with pytest.raises(ThinblockError, match="snapshot"):
        owner.claim_volume("n@1")
    owner.close()
    _check(path)


def _blocked_in(thread: threading.Thread, function: str) -> bool:
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def test_an_owner_closing_while_it_gives_idle_grants_back_does_not_deadlock(tmp_path: Path) -> None:
    """Another owner's ask for idle grants (a control request: the pool-level lock, then
    this pool's lock) while the owner closes (this pool's lock, then the pool-level lock
    to give its grants back): the close takes them in the step's order, so both end."""
    path = _pool(tmp_path)
    with Pool.open(path) as p:
        p.create_volume("a", 1024 * BS).write(0, b"x" * BS)
        p.create_volume("b", 1024 * BS).write(0, b"y" * BS)
    b = Pool.open(path, volumes=["a"], autocommit=False, purpose="B")
    c = Pool.open(path, volumes=["b"], autocommit=False, purpose="C")
    try:
        b.volume("a").write(BS, b"z" * BS)
        b.commit()  # b keeps idle blocks in its grant
        with c.meta.pool_lock():  # another owner's pool-level step holds the lock a while
            asked = threading.Thread(target=give_back_idle_grants, args=(b,), daemon=True)
            asked.start()
            until(lambda: _blocked_in(asked, "pool_lock"), "the ask waits for the pool-level lock")
            closing = threading.Thread(target=b.close, daemon=True)
            closing.start()
            until(lambda: _blocked_in(closing, "pool_lock"), "the close waits for the pool-level lock")
        asked.join(30)
        closing.join(30)
        assert not asked.is_alive() and not closing.is_alive(), "the ask and the close wait on each other"
    finally:
        c.close()
    _check(path)
