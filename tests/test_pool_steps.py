"""The pool-level steps of ownership per volume (core/pool_steps.py) on a real
directory pool (SQLite metadata, a sparse data file): grants of free space,
taking back a dead owner's grants, folding orphan pages. Failures of the
layers below are injected at every call site of each step (tests/faults.py):
a step that fails changes nothing in the store, and running it again works.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from tests.cli import thinblock
from tests.faults import Fault, FaultyMeta, FaultyStore
from tests.test_meta_owners import counts, read_counts
from thinblock.backends import locate
from thinblock.backends.directory import LEASES_FILE
from thinblock.core.mapping import BlockState, Page, empty_entries, make_entry
from thinblock.core.pool_steps import fold_orphans, recover_stale_grants, return_grant, take_grant
from thinblock.meta.base import Grant, MetadataStore, Transaction, VolumeRow
from thinblock.meta.filelocks import range_locked
from thinblock.store.base import DataStore

ROOT = Path(__file__).resolve().parent.parent
BS = 4096
BLOCKS = 64
JUNK = b"\xa5" * BS


@pytest.fixture
def pool(tmp_path: Path) -> str:
    path = str(tmp_path / "pool")
    loc = locate(path)
    loc.create({"block_size": BS, "size_bytes": BLOCKS * BS, "clean": True}, BLOCKS * BS, None)
    entries = empty_entries()
    for slot, dblock in enumerate((0, 1, 2)):
        entries[slot] = make_entry(dblock, BlockState.DATA)
    meta = loc.open_meta(readonly=False)
    meta.commit(
        Transaction(
            volumes=[VolumeRow(vid, f"v{vid}", 1 << 20, "on", 1.0) for vid in (1, 2)],
            roots={(1, 0): 7, (2, 0): 7},
            pages={7: (2, Page(7, 2, entries).to_blob())},  # both volumes share page 7
            refcount_pages={0: counts(1, 1, 2)},  # dblock 2 also held by some other page
            superblock={"used_blocks": 3},
        )
    )
    meta.close()
    return path


@pytest.fixture
def opened(pool: str) -> Iterator[tuple[MetadataStore, DataStore]]:
    loc = locate(pool)
    meta = loc.open_meta(readonly=False)
    store = loc.open_data(meta.superblock())
    yield meta, store
    store.close()
    meta.close()


def block(store: DataStore, dblock: int) -> bytes:
    return store.pread(dblock * BS, BS)


def test_a_grant_is_free_space_punched_to_zero_and_never_given_twice(opened: tuple[MetadataStore, DataStore]) -> None:
    meta, store = opened
    for dblock in range(3, 12):  # bytes nobody committed, in free blocks
        store.pwritev(dblock * BS, [JUNK])
    a, b = meta.claim_volume(1, "a"), meta.claim_volume(2, "b")
    ga = take_grant(meta, store, a, 4)
    assert ga == Grant(1, a.epoch, 3, 4)
    assert all(block(store, d) == bytes(BS) for d in range(3, 7))
    assert block(store, 7) == JUNK  # not granted: left alone
    gb = take_grant(meta, store, b, 100)  # more than is free: the rest of the pool
    assert gb == Grant(2, b.epoch, 7, BLOCKS - 7)
    with pytest.raises(OSError) as exc:
        take_grant(meta, store, a, 1)
    assert exc.value.errno == errno.ENOSPC and "outside the grants other owners hold" in str(exc.value)
    assert meta.grants() == [ga, gb]
    return_grant(meta, b, gb)
    # Fragmented free space: a used block inside the free run shortens the grant.
    meta.commit(Transaction(leases=[a], refcount_pages={0: counts(1, 1, 2, 0, 0, 0, 0, 0, 0, 1)}))
    assert take_grant(meta, store, b, 10) == Grant(2, b.epoch, 7, 2)


def test_a_grant_takes_back_a_dead_owners_grant_first(pool: str, opened: tuple[MetadataStore, DataStore]) -> None:
    meta, store = opened
    dead = locate(pool).open_meta(readonly=False)
    lease = dead.claim_volume(2, "dead")
    dead.commit(Transaction(leases=[lease], grants=[Grant(2, lease.epoch, 3, BLOCKS - 3)]))  # all the free space
    dead.close()  # its process ends: the lease goes, the grant stays
    assert take_grant(meta, store, meta.claim_volume(1, "a"), 4).start == 3
    assert [g.volume_id for g in meta.grants()] == [1]


def test_a_killed_owners_grant_is_taken_back_and_its_unsaved_bytes_never_show(pool: str) -> None:
    script = (
        "import sys\n"
        "from thinblock.backends import locate\n"
        "from thinblock.core.pool_steps import take_grant\n"
        "loc = locate(sys.argv[1]); meta = loc.open_meta(readonly=False)\n"
        "store = loc.open_data(meta.superblock())\n"
        "lease = meta.claim_volume(1, 'doomed')\n"
        "g = take_grant(meta, store, lease, 8)\n"
        f"store.pwritev(g.start * {BS}, [b'\\xa5' * {BS} * g.count]); store.flush()\n"
        "print(g.start, g.count, flush=True); sys.stdin.readline()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, pool], env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        start, count = map(int, proc.stdout.readline().split())
        loc = locate(pool)
        meta = loc.open_meta(readonly=False)
        store = loc.open_data(meta.superblock())
        try:
            assert recover_stale_grants(meta) == []  # alive: its grant stays
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            assert recover_stale_grants(meta) == [Grant(1, 1, start, count)]
            assert meta.grants() == []
            lease = meta.claim_volume(1, "heir")
            again = take_grant(meta, store, lease, count)
            assert (again.start, again.count) == (start, count)
            assert all(block(store, d) == bytes(BS) for d in range(start, start + count))
        finally:
            store.close()
            meta.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_fold_frees_a_page_both_owners_let_go(opened: tuple[MetadataStore, DataStore]) -> None:
    meta, _store = opened
    assert fold_orphans(meta).pages == []
    a, b = meta.claim_volume(1, "a"), meta.claim_volume(2, "b")
    for lease in (a, b):  # each drops its share of page 7 on a view that says 2
        meta.commit(
            Transaction(
                leases=[lease], roots={(lease.volume_id, 0): None}, page_refcounts={7: 1}, page_ref_bases={7: 2}
            )
        )
    assert meta.orphans() == [7]
    folded = fold_orphans(meta)
    assert (folded.pages, folded.freed) == ([7], [0, 1])
    assert meta.page(7) is None and meta.orphans() == []
    assert read_counts(meta)[:3] == [0, 0, 1] and meta.superblock()["used_blocks"] == 1


def _orphaned(meta: MetadataStore) -> None:
    meta.commit(Transaction(page_refcounts={7: 0}, page_ref_bases={7: 2}))


@pytest.mark.parametrize("kind", ["eio", "enospc"])
@pytest.mark.parametrize(
    ("step", "verbs"),
    [
        ("grant", ("punch",)),
        ("grant", ("flush",)),
        ("grant", ("commit",)),
        ("return", ("commit",)),
        ("recover", ("commit",)),
        ("fold", ("pages",)),
        ("fold", ("commit",)),
    ],
)
def test_a_step_that_fails_below_changes_nothing_and_runs_again(
    opened: tuple[MetadataStore, DataStore], step: str, verbs: tuple[str, ...], kind: str
) -> None:
    inner_meta, inner_store = opened
    meta, store = FaultyMeta(inner_meta), FaultyStore(inner_store)
    for dblock in range(3, 11):  # bytes nobody committed, in the free blocks the grants take
        inner_store.pwritev(dblock * BS, [JUNK])
    lease = inner_meta.claim_volume(1, "a")
    granted = take_grant(inner_meta, inner_store, lease, 4)
    if step == "recover":
        inner_meta.release_volume(lease)
    if step == "fold":
        _orphaned(inner_meta)

    def run() -> object:
        m = cast(MetadataStore, meta)
        if step == "grant":
            return take_grant(m, cast(Any, store), lease, 4)
        if step == "return":
            return_grant(m, lease, granted)
            return None
        if step == "recover":
            return recover_stale_grants(m)
        return fold_orphans(m)

    before = (inner_meta.grants(), inner_meta.refcount_pages(), inner_meta.orphans(), inner_meta.superblock())
    fault = Fault(verbs, 0, kind)
    (meta if verbs[0] in ("commit", "pages") else store).arm(fault)
    with pytest.raises(OSError) as exc:
        run()
    assert fault.fired and exc.value.errno == (errno.EIO if kind == "eio" else errno.ENOSPC)
    assert (inner_meta.grants(), inner_meta.refcount_pages(), inner_meta.orphans(), inner_meta.superblock()) == before
    run()  # the fault has passed: the same step succeeds
    after = inner_meta.grants()
    if step == "grant":
        assert len(after) == 2 and after[1].start == granted.start + granted.count
    elif step in ("return", "recover"):
        assert after == []
    else:
        assert inner_meta.orphans() == [] and read_counts(inner_meta)[:3] == [0, 0, 1]
    if step == "grant":  # both grants' blocks were punched by their taker
        assert np.all(np.frombuffer(inner_store.pread(3 * BS, 8 * BS), dtype=np.uint8) == 0)


def test_a_grant_is_punched_outside_the_pool_level_lock(pool: str, opened: tuple[MetadataStore, DataStore]) -> None:
    """No data I/O under the pool-level lock: while the taker punches and syncs its
    grant, another process's pool-level step could run (the lock byte is free)."""
    meta, inner = opened
    seen: list[bool] = []
    lease = meta.claim_volume(1, "a")  # makes the leases file
    leases = os.open(os.path.join(pool, LEASES_FILE), os.O_RDWR)
    try:

        class Watching(FaultyStore):
            def punch(self, offset: int, length: int) -> None:
                seen.append(range_locked(leases, 0, 1))
                super().punch(offset, length)

            def flush(self) -> None:
                seen.append(range_locked(leases, 0, 1))
                super().flush()

        take_grant(meta, cast(Any, Watching(inner)), lease, 4)
    finally:
        os.close(leases)
    assert seen == [False, False]


def test_the_fold_frees_what_it_and_an_owner_took_to_zero_together(opened: tuple[MetadataStore, DataStore]) -> None:
    """An owner drops its reference to dblock 2 (2 -> 1 on its view) between the fold's
    read and its commit: the fold's drop takes it to zero in the store, and the fold
    reports it freed (from the committed counts, not from what it read)."""
    meta, _store = opened
    owner = meta.claim_volume(2, "b")
    _orphaned(meta)

    class OwnerCommitsFirst(FaultyMeta):
        def commit(self, txn: Transaction) -> Any:
            if txn.pages:  # the fold's commit: the owner's lands just before it
                self.inner.commit(
                    Transaction(
                        leases=[owner], refcount_pages={0: counts(1, 1, 1)}, refcount_bases={0: counts(1, 1, 2)}
                    )
                )
            return super().commit(txn)

    folded = fold_orphans(cast(MetadataStore, OwnerCommitsFirst(meta)))
    assert (folded.pages, folded.freed) == ([7], [0, 1, 2])
    assert read_counts(meta)[:3] == [0, 0, 0] and meta.superblock()["used_blocks"] == 0


def test_grants_show_in_pool_status_and_pool_check_finds_bad_ones(pool: str) -> None:
    """Granted space is its own figure of `pool status` (the real CLI), and `pool check`
    names a grant that overlaps another, lies outside the pool or has no volume."""
    loc = locate(pool)
    meta = loc.open_meta(readonly=False)
    store = loc.open_data(meta.superblock())
    try:
        assert json.loads(thinblock("pool", "status", pool, "--json").stdout)["granted_bytes"] == 0
        lease = meta.claim_volume(1, "a")
        grant = take_grant(meta, store, lease, 8)
        meta.commit(
            Transaction(leases=[lease], refcount_pages={0: counts(1, 1, 2, 1)}, refcount_bases={0: counts(1, 1, 2)})
        )
        status = json.loads(thinblock("pool", "status", pool, "--json").stdout)
        assert (status["granted_bytes"], status["granted_unused_bytes"]) == (8 * BS, 7 * BS)
        assert "granted to volume owners: 32K, 28K of it unused" in thinblock("pool", "status", pool).stdout
        assert grant.start == 3
    finally:
        store.close()
        meta.close()
    db = sqlite3.connect(os.path.join(pool, "metadata.sqlite"))
    with db:  # damage the table behind the store's back, as a bad disk or a bug would
        db.executemany("INSERT INTO grants VALUES (?, ?, ?, ?)", [(2, 1, 5, 4), (9, 1, 20, 2), (2, 1, BLOCKS - 1, 4)])
    db.close()
    out = thinblock("pool", "check", pool, check=False)
    assert out.returncode == 1, out.stdout
    assert "overlap: a block could be allocated twice" in out.stdout
    assert "held for volume 9, which does not exist" in out.stdout
    assert f"lies outside the pool's {BLOCKS} blocks" in out.stdout
