"""The metadata store's ownership contract (meta/base.py, meta/owners.py): per-volume
leases, guarded commits, shared counts committed as changes, grants, the
pool-level lock and id ranges. One suite, run against every store: SQLite,
memory and RADOS. Several store objects on one pool stand for several owners;
real processes do too, on SQLite (their leases are OFD locks that die with
them) and on RADOS (each with a Ceph client of its own; their leases lapse).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.conftest import new_rados_locator
from thinblock.backends import Location, locate
from thinblock.backends.memory import MemoryLocation
from thinblock.backends.rados import RadosLocation
from thinblock.errors import PoolBusyError
from thinblock.meta.base import Grant, Lease, MetadataStore, Transaction, VolumeBusyError, VolumeRow

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = 256  # the pool's blocks (1 MiB of 4 KiB)
LOCATIONS: dict[str, Callable[[pytest.FixtureRequest, Path], str]] = {
    "directory-sqlite": lambda request, tmp: str(tmp / "pool"),
    "memory": lambda request, tmp: f"memory:owners-{uuid.uuid4().hex}",
    "rados-omap": lambda request, tmp: new_rados_locator(request, "owners"),
}


def counts(*values: int) -> bytes:
    """A refcount page whose first counts are values (the rest zero)."""
    page = np.zeros(1024, dtype=np.uint32)
    page[: len(values)] = values
    return page.tobytes()


def read_counts(meta: MetadataStore, n: int = 8) -> list[int]:
    blob = meta.refcount_pages().get(0, bytes(4096))
    return [int(x) for x in np.frombuffer(blob, dtype=np.uint32)[:n]]


@pytest.fixture(params=list(LOCATIONS))
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Location]:
    loc = locate(LOCATIONS[request.param](request, tmp_path))
    loc.create({"block_size": 4096, "size_bytes": BLOCKS * 4096, "clean": True}, BLOCKS * 4096, None)
    # A RADOS store commits beside other owners only while its process shares the pool.
    shared = loc.own_shared("owners contract") if isinstance(loc, RadosLocation) else None
    seed = loc.open_meta(readonly=False)
    seed.commit(
        Transaction(
            volumes=[VolumeRow(1, "a", 1 << 20, "on", 1.0), VolumeRow(2, "b", 1 << 20, "on", 1.0)],
            pages={7: (2, b"shared page")},
            refcount_pages={0: counts(1, 1, 2)},
            superblock={"used_blocks": 3, "snapshots_taken": 3},
        )
    )
    seed.close()
    try:
        yield loc
    finally:
        if shared is not None:
            shared.release()
        if isinstance(loc, MemoryLocation):
            loc.remove_created()


@pytest.fixture
def owners(location: Location) -> Iterator[Callable[[], MetadataStore]]:
    """Opens one more store on the pool: one more owner."""
    opened: list[MetadataStore] = []

    def open_one() -> MetadataStore:
        opened.append(location.open_meta(readonly=False))
        return opened[-1]

    yield open_one
    for meta in opened:
        meta.close()


def refused(exc: pytest.ExceptionInfo[OSError], code: int, *words: str) -> None:
    assert exc.value.errno == code, exc.value
    for word in words:
        assert word in str(exc.value), exc.value


# ----- leases and the guarded commit ----------------------------------------------------


def test_a_lease_is_held_by_one_owner_and_names_it(owners: Callable[[], MetadataStore]) -> None:
    a, b = owners(), owners()
    lease = a.claim_volume(1, "server-a")
    assert lease == Lease(1, "server-a", 1)
    with pytest.raises(VolumeBusyError, match="volume 1 is owned by server-a"):
        b.claim_volume(1, "server-b")
    with pytest.raises(VolumeBusyError):
        a.claim_volume(1, "server-a")  # once per owner, too
    assert b.volume_holder(1) == "server-a" and a.volume_holder(1) == "server-a"
    assert b.volume_holder(2) is None
    assert b.lease_live(1, 1) and not b.lease_live(1, 2)
    assert b.claim_volume(2, "server-b").epoch == 1  # other volumes are free
    a.release_volume(lease)
    assert b.volume_holder(1) is None and not b.lease_live(1, 1)
    assert b.claim_volume(1, "server-b") == Lease(1, "server-b", 2)  # the epoch goes on


def test_leases_claimed_together_are_all_taken_or_none(owners: Callable[[], MetadataStore]) -> None:
    """claim_volumes (a server's start, one step on SQLite) is claim_volume for each,
    all or none; release_volumes gives each up, and the epochs go on."""
    a, b = owners(), owners()
    held = b.claim_volume(2, "server-b")
    with pytest.raises(VolumeBusyError, match="volume 2 is owned by server-b"):
        a.claim_volumes([1, 2], "server-a")
    assert b.volume_holder(1) is None  # the free one was not kept
    b.release_volume(held)
    leases = a.claim_volumes([1, 2], "server-a")
    assert sorted(leases) == [1, 2] and {lease.owner for lease in leases.values()} == {"server-a"}
    assert leases[2].epoch == 2  # (a store may have used an epoch of 1 for the refused claim)
    assert b.volume_holder(1) == b.volume_holder(2) == "server-a"
    with pytest.raises(VolumeBusyError):
        b.claim_volumes([2], "server-b")
    a.release_volumes(list(leases.values()))
    assert b.volume_holder(1) is None and b.volume_holder(2) is None
    again = b.claim_volumes([1, 2], "server-b")
    assert again == {1: Lease(1, "server-b", leases[1].epoch + 1), 2: Lease(2, "server-b", 3)}


def test_an_owner_that_ends_frees_its_leases(owners: Callable[[], MetadataStore]) -> None:
    a, b = owners(), owners()
    a.claim_volume(1, "server-a")
    a.close()  # as a killed process: no release
    assert b.volume_holder(1) is None
    assert b.claim_volume(1, "server-b").epoch == 2


def test_a_commit_under_a_lost_lease_is_refused_and_changes_nothing(owners: Callable[[], MetadataStore]) -> None:
    a, b = owners(), owners()
    old = a.claim_volume(1, "server-a")
    a.commit(Transaction(leases=[old], volumes=[VolumeRow(1, "a", 2 << 20, "on", 1.0)]))
    a.release_volume(old)
    new = b.claim_volume(1, "server-b")
    before = b.volumes()
    with pytest.raises(OSError) as exc:
        a.commit(Transaction(leases=[old], volumes=[VolumeRow(1, "a", 3 << 20, "on", 1.0)]))
    refused(exc, errno.ESTALE, "epoch 1", "server-b (epoch 2)")
    assert b.volumes() == before and before[0].size_bytes == 2 << 20
    b.commit(Transaction(leases=[new], volumes=[VolumeRow(1, "a", 4 << 20, "on", 1.0)]))
    assert a.volumes()[0].size_bytes == 4 << 20


def _state(meta: MetadataStore) -> tuple[list[VolumeRow], list[tuple[int, int, int]]]:
    return meta.volumes(), sorted(meta.all_roots())


def test_an_owner_may_not_change_a_volume_another_lease_holds(owners: Callable[[], MetadataStore]) -> None:
    a, b = owners(), owners()
    la, lb = a.claim_volume(1, "server-a"), b.claim_volume(2, "server-b")
    b.commit(Transaction(leases=[lb], roots={(2, 0): 7}))
    before = _state(a)
    b_row = VolumeRow(2, "b", 9 << 20, "on", 1.0)
    for txn in (
        Transaction(leases=[la], volumes=[b_row]),  # b's row
        Transaction(leases=[la], roots={(2, 0): 8}),  # b's root entry
        Transaction(leases=[la], roots={(2, 1): None}),
        Transaction(leases=[la], deleted_volumes=[2]),  # b's removal
        # refused whole: its own row does not go in either
        Transaction(leases=[la], volumes=[VolumeRow(1, "a", 5 << 20, "on", 1.0)], roots={(2, 0): None}),
    ):
        with pytest.raises(OSError) as exc:
            a.commit(txn)
        refused(exc, errno.EPERM, "of volume 2", "held by server-b (epoch 1)", "volume 1 (epoch 1)")
        assert _state(a) == before
    # What a names is its own; a volume nobody holds is a pool-level step's, which names
    # no lease; and the rule is another's live lease, not a lease this commit lacks.
    a.commit(Transaction(leases=[la], volumes=[VolumeRow(1, "a", 5 << 20, "on", 1.0)], roots={(1, 0): 9}))
    a.commit(Transaction(volumes=[VolumeRow(2, "b", 6 << 20, "on", 1.0, origin_id=1)]))
    b.close()  # b dies (on SQLite its record stays, its lock goes)
    a.commit(Transaction(leases=[la], volumes=[b_row], roots={(2, 0): None}))
    assert [(v.id, v.size_bytes) for v in a.volumes()] == [(1, 5 << 20), (2, 9 << 20)]
    assert sorted(a.all_roots()) == [(1, 0, 9)]


def test_a_snapshots_roots_and_removal_are_its_volumes(owners: Callable[[], MetadataStore]) -> None:
    a, c = owners(), owners()
    la, lc = a.claim_volume(1, "server-a"), c.claim_volume(2, "server-c")
    # 3 is a snapshot of 1, 4 a snapshot of 3: both a's, by their origins.
    snaps = [
        VolumeRow(3, "a@s", 1 << 20, "on", 1.0, kind="snapshot", origin_id=1),
        VolumeRow(4, "a@t", 1 << 20, "on", 1.0, kind="snapshot", origin_id=3),
    ]
    a.commit(Transaction(leases=[la], volumes=snaps, roots={(3, 0): 7, (4, 0): 7}))
    before = _state(c)
    for txn in (
        Transaction(leases=[lc], roots={(4, 0): None}),
        Transaction(leases=[lc], deleted_volumes=[3]),
        # a rewrite cannot take it away: the committed origin counts
        Transaction(leases=[lc], volumes=[VolumeRow(4, "a@t", 1 << 20, "on", 1.0, kind="snapshot")], roots={(4, 0): 8}),
        # a new snapshot of a's volume is a's to take
        Transaction(leases=[lc], volumes=[VolumeRow(5, "a@u", 1 << 20, "on", 1.0, kind="snapshot", origin_id=1)]),
    ):
        with pytest.raises(OSError) as exc:
            c.commit(txn)
        refused(exc, errno.EPERM, "a snapshot of volume 1", "held by server-a (epoch 1)")
        assert _state(c) == before
    # An existing snapshot's row is not: a clone's owner rolling back to it sets its
    # exclusive count (core/snapshot.py's rollback).
    counted = VolumeRow(
        3, "a@s", 1 << 20, "on", 1.0, kind="snapshot", origin_id=1, exclusive_blocks=0, exclusive_epoch=5
    )
    c.commit(Transaction(leases=[lc], volumes=[counted]))
    assert [v.exclusive_epoch for v in c.volumes() if v.id == 3] == [5]


# ----- shared counts as changes -----------------------------------------------------------


def test_owners_changes_to_one_refcount_page_add_up(owners: Callable[[], MetadataStore]) -> None:
    a, b = owners(), owners()
    la, lb = a.claim_volume(1, "a"), b.claim_volume(2, "b")
    a.commit(Transaction(leases=[la], grants=[Grant(1, la.epoch, 3, 1)]))
    b.commit(Transaction(leases=[lb], grants=[Grant(2, lb.epoch, 4, 1)]))
    base = counts(1, 1, 2)
    # A free block is taken only from one's own grant: not from another's, nor from none.
    for taken in (counts(1, 1, 2, 0, 1), counts(1, 1, 2, 0, 0, 1)):
        with pytest.raises(OSError) as exc:
            a.commit(Transaction(leases=[la], refcount_pages={0: taken}, refcount_bases={0: base}))
        refused(exc, errno.EIO, "is free, and in no grant this commit holds")
    assert read_counts(a)[:6] == [1, 1, 2, 0, 0, 0]
    # Both made their change on the same view: a takes dblock 3 and shares 2 once more,
    # b takes dblock 4 and drops its share of 2.
    ra = a.commit(Transaction(leases=[la], refcount_pages={0: counts(1, 1, 3, 1)}, refcount_bases={0: base}))
    assert read_counts(a)[:5] == [1, 1, 3, 1, 0]
    rb = b.commit(Transaction(leases=[lb], refcount_pages={0: counts(1, 1, 1, 0, 1)}, refcount_bases={0: base}))
    assert read_counts(a)[:5] == [1, 1, 2, 1, 1]
    # Each commit tells its owner what is committed now, the other's changes included.
    assert list(np.frombuffer(ra.refcount_pages[0], dtype=np.uint32)[:5]) == [1, 1, 3, 1, 0]
    assert list(np.frombuffer(rb.refcount_pages[0], dtype=np.uint32)[:5]) == [1, 1, 2, 1, 1]


def test_only_its_holder_or_a_fencing_recovery_returns_a_grant(owners: Callable[[], MetadataStore]) -> None:
    a, b = owners(), owners()
    la, lb = a.claim_volume(1, "a"), b.claim_volume(2, "b")
    grant = Grant(1, la.epoch, 10, 4)
    a.commit(Transaction(leases=[la], grants=[grant]))
    for txn in (Transaction(leases=[lb], returned_grants=[grant]), Transaction(returned_grants=[grant])):
        with pytest.raises(OSError) as exc:
            b.commit(txn)
        refused(exc, errno.EIO, "only its holder returns it")
    assert b.grants() == [grant]
    a.commit(Transaction(leases=[la], returned_grants=[grant]))
    assert b.grants() == []


def test_the_store_counts_used_blocks_from_the_counts_themselves(owners: Callable[[], MetadataStore]) -> None:
    """Dblock 2 has two references, one each: both owners drop theirs on a view that
    says 2 -> 1, so neither sees it freed, yet the store reaches zero and used_blocks
    must follow. Owners never send used_blocks as a change."""
    a, b = owners(), owners()
    la, lb = a.claim_volume(1, "a"), b.claim_volume(2, "b")
    base = counts(1, 1, 2)
    for meta, lease in ((a, la), (b, lb)):
        result = meta.commit(Transaction(leases=[lease], refcount_pages={0: counts(1, 1, 1)}, refcount_bases={0: base}))
    assert read_counts(a)[:3] == [1, 1, 0] and a.superblock()["used_blocks"] == 2
    assert result.counters["used_blocks"] == 2
    with pytest.raises(OSError) as exc:
        a.commit(Transaction(leases=[la], superblock={"used_blocks": 9}, counter_bases={"used_blocks": 2}))
    refused(exc, errno.EIO, "counted by the store")


def test_freeing_a_dblock_another_owner_still_counts_is_refused(owners: Callable[[], MetadataStore]) -> None:
    a, b = owners(), owners()
    la, lb = a.claim_volume(1, "a"), b.claim_volume(2, "b")
    base = counts(1, 1, 2)
    b.commit(Transaction(leases=[lb], refcount_pages={0: counts(1, 1, 3)}, refcount_bases={0: base}))
    before = a.refcount_pages()
    with pytest.raises(OSError) as exc:  # a's view: it held dblock 2 twice and drops both
        a.commit(Transaction(leases=[la], refcount_pages={0: counts(1, 1, 0)}, refcount_bases={0: base}))
    refused(exc, errno.EIO, "dblock 2 is still referenced (1)")
    assert a.refcount_pages() == before
    with pytest.raises(OSError) as exc:
        a.commit(Transaction(leases=[la], refcount_pages={0: counts(0, 0, 0)}, refcount_bases={0: counts(2)}))
    refused(exc, errno.EIO, "dblock 0's refcount would go below zero")
    assert a.refcount_pages() == before


def test_page_counts_and_counters_are_changes_and_orphans_are_reported(owners: Callable[[], MetadataStore]) -> None:
    a, b = owners(), owners()
    la, lb = a.claim_volume(1, "a"), b.claim_volume(2, "b")
    with pytest.raises(OSError) as exc:  # b's view says it holds the last share: it does not
        b.commit(Transaction(leases=[lb], pages={7: None}, page_ref_bases={7: 1}))
    refused(exc, errno.EIO, "mapping page 7 is still referenced (1)")
    # Page 7 is shared by both volumes (count 2): each drops its share on its own view.
    ra = a.commit(
        Transaction(
            leases=[la],
            page_refcounts={7: 1},
            page_ref_bases={7: 2},
            superblock={"snapshots_taken": 4},
            counter_bases={"snapshots_taken": 3},
        )
    )
    assert ra.page_refcounts == {7: 1} and ra.orphans == [] and ra.counters == {"snapshots_taken": 4}
    rb = b.commit(
        Transaction(
            leases=[lb],
            page_refcounts={7: 1},
            page_ref_bases={7: 2},
            superblock={"snapshots_taken": 2},
            counter_bases={"snapshots_taken": 3},
        )
    )
    # Neither view reached zero, the store did: the page is an orphan for the fold.
    assert rb.page_refcounts == {7: 0} and rb.orphans == [7]
    assert a.orphans() == [7] and a.page(7) == (0, b"shared page")
    assert a.superblock()["snapshots_taken"] == 3 and rb.counters == {"snapshots_taken": 3}
    with pytest.raises(OSError) as exc:
        b.commit(Transaction(leases=[lb], page_refcounts={7: 1}, page_ref_bases={7: 3}))
    refused(exc, errno.EIO, "mapping page 7's refcount would go below zero")
    with pytest.raises(OSError) as exc:
        b.commit(Transaction(leases=[lb], page_refcounts={9: 1}, page_ref_bases={9: 2}))
    refused(exc, errno.EIO, "mapping page 9 changed from count 2 no longer exists")
    b.commit(Transaction(leases=[lb], pages={7: None}, page_ref_bases={7: 0}))  # the fold deletes it
    assert a.orphans() == [] and a.page(7) is None


# ----- grants ---------------------------------------------------------------------------------


def test_grants_cover_free_blocks_once_and_go_back(owners: Callable[[], MetadataStore]) -> None:
    a, b = owners(), owners()
    la, lb = a.claim_volume(1, "a"), b.claim_volume(2, "b")
    ga = Grant(1, la.epoch, 8, 16)
    a.commit(Transaction(leases=[la], grants=[ga]))
    assert b.grants() == [ga]
    before = a.grants()
    for grant, lease, words in (
        (Grant(2, lb.epoch, 20, 8), lb, ("overlaps volume 1's grant 8+16",)),
        (Grant(2, lb.epoch, 1, 4), lb, ("covers dblock 1, which is in use",)),
        (Grant(2, lb.epoch, BLOCKS - 2, 4), lb, (f"outside the pool's {BLOCKS} blocks",)),
        (Grant(1, la.epoch, 40, 4), lb, ("not a lease held",)),
    ):
        with pytest.raises(OSError) as exc:
            b.commit(Transaction(leases=[lease], grants=[grant]))
        refused(exc, errno.EIO, *words)
    assert a.grants() == before
    with pytest.raises(OSError) as exc:
        b.commit(Transaction(leases=[lb], returned_grants=[Grant(2, lb.epoch, 8, 16)]))
    refused(exc, errno.EIO, "grant 8+16 of volume 2 is not held")
    # A grant and the counts of the blocks it hands out may come in one commit.
    gb = Grant(2, lb.epoch, 24, 8)
    b.commit(Transaction(leases=[lb], grants=[gb], refcount_pages={0: counts(1, 1, 2)}))
    a.commit(Transaction(leases=[la], returned_grants=[ga]))
    assert a.grants() == [gb] and a.stale_grants() == []
    b.close()  # b dies holding its grant: it is stale for everyone else
    assert a.stale_grants() == [gb]


# ----- the pool-level lock and ids -----------------------------------------------------------


def test_pool_level_steps_run_one_at_a_time_and_ids_never_collide(owners: Callable[[], MetadataStore]) -> None:
    stores = [owners(), owners()]
    got: list[range] = []
    got_lock = threading.Lock()

    def run(meta: MetadataStore) -> None:
        for _ in range(40):
            with meta.pool_lock():
                # An unguarded read-modify-write: only the pool-level lock keeps it exact.
                value = int(meta.superblock().get("steps", 0))
                meta.commit(Transaction(superblock={"steps": value + 1}))
                first = meta.reserve_ids("page", 3)
            with got_lock:
                got.append(range(first, first + 3))

    threads = [threading.Thread(target=run, args=(meta,)) for meta in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stores[0].superblock()["steps"] == 80
    ids = [i for r in got for i in r]
    assert len(ids) == len(set(ids)) == 240 and min(ids) > 7  # above every committed page


def test_reserve_ids_refuses_nonsense(owners: Callable[[], MetadataStore]) -> None:
    meta = owners()
    with pytest.raises(ValueError):
        meta.reserve_ids("dblock", 1)
    with meta.pool_lock():
        assert meta.reserve_ids("volume", 2) == 3  # volumes 1 and 2 exist


# ----- a state machine: owners with stale views against a plain model --------------------------


class TwoOwners(RuleBasedStateMachine):
    """Two owners change one refcount page on views that go stale, each with a grant
    of four dblocks; the store must hold exactly the model's counts, and refuse
    exactly the commits that would free a dblock the other owner still counts or
    take a free dblock outside the owner's grant."""

    def __init__(self) -> None:
        super().__init__()
        self.location = locate(f"memory:machine-{uuid.uuid4().hex}")
        self.location.create({"block_size": 4096, "size_bytes": BLOCKS * 4096}, BLOCKS * 4096, None)
        self.stores = [self.location.open_meta(readonly=False) for _ in range(2)]
        self.leases = [meta.claim_volume(i + 1, f"owner-{i}") for i, meta in enumerate(self.stores)]
        for i, (meta, lease) in enumerate(zip(self.stores, self.leases, strict=True)):  # dblocks 0-3, 4-7
            meta.commit(Transaction(leases=[lease], grants=[Grant(lease.volume_id, lease.epoch, 4 * i, 4)]))
        self.granted = [np.arange(8) // 4 == i for i in range(2)]
        self.model = np.zeros(8, dtype=np.int64)  # committed counts
        self.held = [np.zeros(8, dtype=np.int64) for _ in range(2)]  # each owner's committed references
        self.base = [np.zeros(8, dtype=np.int64) for _ in range(2)]
        self.view = [np.zeros(8, dtype=np.int64) for _ in range(2)]

    @initialize()
    def start(self) -> None:
        pass

    @rule(owner=st.integers(0, 1), dblock=st.integers(0, 7))
    def take(self, owner: int, dblock: int) -> None:
        self.view[owner][dblock] += 1

    @precondition(lambda self: any((self.view[i] - self.base[i] + self.held[i] > 0).any() for i in range(2)))
    @rule(owner=st.integers(0, 1), dblock=st.integers(0, 7))
    def drop(self, owner: int, dblock: int) -> None:
        # An owner drops only references it holds (committed or pending).
        if self.held[owner][dblock] + self.view[owner][dblock] - self.base[owner][dblock] > 0:
            self.view[owner][dblock] -= 1

    @rule(owner=st.integers(0, 1))
    def commit(self, owner: int) -> None:
        new, base = self.view[owner], self.base[owner]
        expected = self.model + new - base
        frees_shared = ((new == 0) & (base > 0) & (expected != 0)).any()
        takes_free = ((self.model == 0) & (expected > 0) & ~self.granted[owner]).any()
        txn = Transaction(
            leases=[self.leases[owner]],
            refcount_pages={0: counts(*new.tolist())},
            refcount_bases={0: counts(*base.tolist())},
        )
        try:
            result = self.stores[owner].commit(txn)
        except OSError as exc:
            assert frees_shared or takes_free, exc
            says = "still referenced" if frees_shared else "in no grant this commit holds"
            assert exc.errno == errno.EIO and says in str(exc)
            return
        assert not frees_shared and not takes_free
        self.model = expected
        self.held[owner] += new - base
        committed = np.frombuffer(result.refcount_pages[0], dtype=np.uint32)[:8].astype(np.int64)
        assert (committed == self.model).all()
        self.base[owner] = committed.copy()
        self.view[owner] = committed.copy()

    @rule(owner=st.integers(0, 1))
    def refresh(self, owner: int) -> None:
        stored = np.array(read_counts(self.stores[owner]), dtype=np.int64)
        self.view[owner] = stored + self.view[owner] - self.base[owner]
        self.base[owner] = stored

    @invariant()
    def store_holds_the_model(self) -> None:
        assert read_counts(self.stores[0]) == self.model.tolist()
        assert (self.model == self.held[0] + self.held[1]).all()

    def teardown(self) -> None:
        for meta in self.stores:
            meta.close()
        assert isinstance(self.location, MemoryLocation)
        self.location.remove_created()


TestTwoOwners = TwoOwners.TestCase


# ----- real processes on one SQLite pool --------------------------------------------------------

_OWNER = """
import sys
import numpy as np
from thinblock.backends import locate
from thinblock.meta.base import Grant, Transaction
pool, vid, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
loc = locate(pool)
if pool.startswith("rados:"):
    shared = loc.own_shared(f"process-{vid}")  # a RADOS store commits beside others only so
meta = loc.open_meta(readonly=False)
lease = meta.claim_volume(vid, f"process-{vid}")
with meta.pool_lock():
    meta.commit(Transaction(leases=[lease], grants=[Grant(vid, lease.epoch, 100 + 40 * vid, 10)]))
base = np.frombuffer(meta.refcount_pages()[0], dtype=np.uint32).copy()
page = base.copy()
ids = []
for i in range(rounds):
    page[100 + 40 * vid] += 1  # its own dblock, from its grant
    page[2] += 1  # one all share
    result = meta.commit(Transaction(
        leases=[lease],
        refcount_pages={0: page.tobytes()}, refcount_bases={0: base.tobytes()},
        page_refcounts={7: 2 + i + 1}, page_ref_bases={7: 2 + i},
    ))
    base = np.frombuffer(result.refcount_pages[0], dtype=np.uint32).copy()
    page = base.copy()
    if i % 10 == 0:
        with meta.pool_lock():
            first = meta.reserve_ids("page", 5)
        ids += range(first, first + 5)
print(" ".join(map(str, ids)), flush=True)
if len(sys.argv) > 4:
    sys.stdin.readline()  # hold the lease until told, or killed
"""


def _owner_process(pool: str, vid: int, rounds: int, *, hold: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    args = [sys.executable, "-c", _OWNER, pool, str(vid), str(rounds)] + (["hold"] if hold else [])
    return subprocess.Popen(args, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _seeded_pool(pool: str) -> str:
    loc = locate(pool)
    loc.create({"block_size": 4096, "size_bytes": BLOCKS * 4096, "clean": True}, BLOCKS * 4096, None)
    shared = loc.own_shared("seed") if isinstance(loc, RadosLocation) else None
    meta = loc.open_meta(readonly=False)
    meta.commit(
        Transaction(
            volumes=[VolumeRow(vid, f"v{vid}", 1 << 20, "on", 1.0) for vid in (1, 2, 3)],
            pages={7: (2, b"shared page")},
            refcount_pages={0: counts(1, 1, 2)},
        )
    )
    meta.close()
    if shared is not None:
        shared.release()
    return pool


@pytest.fixture
def sqlite_pool(tmp_path: Path) -> str:
    return _seeded_pool(str(tmp_path / "pool"))


@pytest.fixture(params=["sqlite", "rados"])
def process_pool(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A pool that owner processes share: SQLite (leases die with their process) and
    RADOS (leases lapse 2 s after their holder stops renewing them)."""
    monkeypatch.setenv("THINBLOCK_RADOS_LEASE_S", "2")
    if request.param == "sqlite":
        return _seeded_pool(str(tmp_path / "pool"))
    return _seeded_pool(new_rados_locator(request, "processes"))


@contextlib.contextmanager
def owner_store(pool: str) -> Iterator[MetadataStore]:
    """A store of this process as one more owner (sharing a RADOS pool first)."""
    loc = locate(pool)
    shared = loc.own_shared("test owner") if isinstance(loc, RadosLocation) else None
    meta = loc.open_meta(readonly=False)
    try:
        yield meta
    finally:
        meta.close()
        if shared is not None:
            shared.release()


def test_owner_processes_commit_to_one_pool_at_once(process_pool: str) -> None:
    procs = [_owner_process(process_pool, vid, 100) for vid in (1, 2, 3)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    meta = locate(process_pool).open_meta(readonly=True)
    try:
        got = np.frombuffer(meta.refcount_pages()[0], dtype=np.uint32)
        assert [int(got[100 + 40 * vid]) for vid in (1, 2, 3)] == [100, 100, 100] and int(got[2]) == 2 + 300
        assert meta.page(7) == (2 + 300, b"shared page")
        assert sorted((g.volume_id, g.start) for g in meta.grants()) == [(1, 140), (2, 180), (3, 220)]
    finally:
        meta.close()
    ids = [int(x) for out in outs for x in out.split()]
    assert len(ids) == len(set(ids)) == 150


def test_a_killed_owner_process_frees_its_volume_and_its_grants_go_stale(process_pool: str) -> None:
    proc = _owner_process(process_pool, 1, 1, hold=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline()  # it holds volume 1 now
        with owner_store(process_pool) as meta:
            with pytest.raises(VolumeBusyError, match="volume 1 is owned by process-1"):
                meta.claim_volume(1, "me")
            assert meta.stale_grants() == []
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            _until_lapsed(meta, 1)
            assert meta.stale_grants() == [Grant(1, 1, 140, 10)]
            lease = meta.claim_volume(1, "me")
            assert lease.epoch == 2
            with meta.pool_lock():  # the next pool-level step takes the grant back, fencing its lease
                meta.commit(Transaction(returned_grants=meta.stale_grants(), fenced=[(1, 1)]))
            assert meta.grants() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _exists(loc: RadosLocation, name: str) -> bool:
    import rados

    try:
        loc.cluster().ioctx(loc.ceph_pool).stat(name)
    except rados.ObjectNotFound:
        return False
    return True


def _until_lapsed(meta: MetadataStore, vid: int) -> None:
    """Wait until nobody live holds the volume: at once on SQLite (the lock died with
    its process), once the lease lapses on RADOS (bounded: a minute)."""
    deadline = time.monotonic() + 60
    while meta.volume_holder(vid) is not None:
        assert time.monotonic() < deadline, f"volume {vid}'s lease never lapsed"
        time.sleep(0.1)


# ----- RADOS: a pool is owned whole or shared per volume, never both ----------------------------


def test_a_rados_pool_is_held_whole_or_shared_never_both(request: pytest.FixtureRequest) -> None:
    """A sharer is refused while a process holds the pool whole, and a whole holder
    while sharers do."""
    loc = locate(new_rados_locator(request, "owners"))
    loc.create({"block_size": 4096, "size_bytes": 1 << 20, "clean": True}, 1 << 20, None)
    meta = loc.open_meta(readonly=False)
    ownership = loc.own("owners contract")
    try:
        with pytest.raises(PoolBusyError, match="it owns the whole pool"):
            locate(loc.name).own_shared("a sharer")
        assert not loc.served_per_volume()
    finally:
        ownership.release()
        meta.close()
    shared = [locate(loc.name).own_shared(f"sharer {i}") for i in range(2)]
    try:
        assert loc.served_per_volume()
        with pytest.raises(PoolBusyError, match="served per volume by other processes"):
            locate(loc.name).own("a whole owner")
    finally:
        for one in shared:
            one.release()
    assert not loc.served_per_volume()
    loc.own("a whole owner").release()


def test_pool_level_steps_nest_in_one_thread(owners: Callable[[], MetadataStore]) -> None:
    """A step may call another (a grant that first takes back stale grants): the
    pool-level lock is reentrant in its thread, and still excludes other owners."""
    meta, other = owners(), owners()
    done = threading.Event()
    entered: list[bool] = []

    def nested() -> None:
        with meta.pool_lock(), meta.pool_lock():
            meta.reserve_ids("volume", 1)  # takes it a third time
        done.set()

    worker = threading.Thread(target=nested)
    worker.start()
    worker.join(timeout=60)
    assert done.is_set(), "nested pool-level steps deadlocked"

    def outsider() -> None:
        with other.pool_lock():
            entered.append(True)

    with meta.pool_lock():
        with meta.pool_lock():
            pass  # the inner step's end must not let other owners in
        blocked = threading.Thread(target=outsider)
        blocked.start()
        blocked.join(timeout=0.3)  # one-sided: it must still be waiting, however long we look
        assert entered == []
    blocked.join(timeout=60)
    assert entered == [True]


def test_threads_of_one_owner_never_interleave_their_commits(owners: Callable[[], MetadataStore]) -> None:
    """Two threads of one owner (its committer and a pool-level step) commit at once on
    one store object, and two store objects on one pool do too: every commit is whole
    and the shared counter sums exactly (one connection's transactions never mix)."""
    first, second = owners(), owners()
    lease = first.claim_volume(1, "a")
    failures: list[str] = []

    def pages(meta: MetadataStore, base_id: int) -> None:
        for n in range(60):
            ids = range(base_id + n * 20, base_id + n * 20 + 20)
            used = int(meta.superblock().get("steps", 0))
            try:
                meta.commit(
                    Transaction(
                        leases=[lease] if meta is first else [],
                        pages={i: (1, bytes(64)) for i in ids},
                        superblock={"steps": used + 1},
                        counter_bases={"steps": used},
                    )
                )
            except OSError as exc:
                failures.append(str(exc))

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: interleavings show up in a short run
    threads = [
        threading.Thread(target=pages, args=(first, 1000)),
        threading.Thread(target=pages, args=(first, 5000)),
        threading.Thread(target=pages, args=(second, 9000)),
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert failures == []
    assert first.superblock()["steps"] == 180
    assert len(first.pages(range(1000, 12000))) == 180 * 20


def test_recovery_fences_an_owner_that_lost_its_lock_but_still_runs(sqlite_pool: str) -> None:
    """A lease whose lock is gone is dead to the pool: recovery takes its grants back
    and, in the same commit, forgets the owner, so a process still running on it
    (its lock lost some other way: the leases file replaced, a lost network lock)
    is refused from then on instead of writing into blocks granted to another."""
    from thinblock.core.pool_steps import recover_stale_grants
    from thinblock.meta.filelocks import unlock_range
    from thinblock.meta.sqlite import SqliteMetadata

    loc = locate(sqlite_pool)
    zombie, heir = loc.open_meta(readonly=False), loc.open_meta(readonly=False)
    try:
        assert isinstance(zombie, SqliteMetadata)
        lease = zombie.claim_volume(1, "zombie")
        grant = Grant(1, lease.epoch, 10, 4)
        zombie.commit(Transaction(leases=[lease], grants=[grant]))
        unlock_range(zombie._fd(), 1 + 1, 1)  # the lock is lost; the process goes on
        assert recover_stale_grants(heir) == [grant]
        with pytest.raises(OSError) as exc:
            zombie.commit(Transaction(leases=[lease], refcount_pages={0: counts(1, 1, 2, 0, 0, 0, 0, 0, 0, 0, 1)}))
        refused(exc, errno.ESTALE, "lost")
        assert read_counts(heir, 11)[10] == 0
        assert heir.claim_volume(1, "heir").epoch == lease.epoch + 1
    finally:
        zombie.close()
        heir.close()


def test_a_shorter_view_of_a_refcount_page_leaves_its_tail_alone() -> None:
    """An owner whose view of the last refcount page is shorter (made before a grow)
    changes only what it covers: the tail it does not see is not freed."""
    from thinblock.meta.owners import refcount_page

    stored = base = np.array([1, 1, 1, 1], dtype=np.uint32).tobytes()
    new = np.array([2, 1], dtype=np.uint32).tobytes()
    got = np.frombuffer(refcount_page(0, stored, new, base), dtype=np.uint32).tolist()
    assert got == [2, 1, 1, 1]


class _CommitFailsOnce:
    """A SQLite connection whose next COMMIT fails as a full disk makes it fail
    (SQLITE_FULL at the write of the log), leaving the transaction open."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.armed = True

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if self.armed and sql == "COMMIT":
            self.armed = False
            raise sqlite3.OperationalError("database or disk is full")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> object:
        return getattr(self._conn, name)


def test_a_lease_record_whose_commit_fails_is_rolled_back(sqlite_pool: str) -> None:
    """A claim whose record's COMMIT fails is refused whole (EIO, no lock kept, no
    row naming it), and the connection is usable after: without the rollback every
    later write transaction would fail ("cannot start a transaction within a
    transaction"). The same for a release, which gives the lease up regardless."""
    a = locate(sqlite_pool).open_meta(readonly=False)
    b = locate(sqlite_pool).open_meta(readonly=False)
    real = a.conn  # type: ignore[attr-defined]
    try:
        a.conn = _CommitFailsOnce(real)  # type: ignore[attr-defined]
        with pytest.raises(OSError) as info:
            a.claim_volume(1, "server-a")
        refused(info, errno.EIO, "metadata lease record failed", "disk is full")
        assert not real.in_transaction
        assert b.volume_holder(1) is None
        lease = b.claim_volume(1, "server-b")  # a kept no lock
        b.release_volume(lease)
        lease = a.claim_volume(1, "server-a")  # and its connection writes again
        assert b.volume_holder(1) == "server-a"
        a.conn = _CommitFailsOnce(real)  # type: ignore[attr-defined]
        with pytest.raises(OSError, match="metadata lease record failed"):
            a.release_volume(lease)
        assert not real.in_transaction
        assert b.claim_volume(1, "server-b").epoch == lease.epoch + 1  # the lease went all the same
    finally:
        a.conn = real  # type: ignore[attr-defined]
        a.close()
        b.close()


_STALLED = """
import sys
from thinblock.backends import locate
from thinblock.meta.base import Grant, Transaction, VolumeRow
pool, probe = sys.argv[1], sys.argv[2]
loc = locate(pool)
shared = loc.own_shared("stalled owner")
meta = loc.open_meta(readonly=False)
lease = meta.claim_volume(1, "stalled")
if len(sys.argv) > 3:  # and a grant, which it never gives back
    with meta.pool_lock():
        meta.commit(Transaction(leases=[lease], grants=[Grant(1, lease.epoch, 100, 10)]))
print("held", flush=True)
sys.stdin.readline()  # stopped here (SIGSTOP) while another takes the volume over
try:
    meta.commit(Transaction(leases=[lease], volumes=[VolumeRow(1, "v1", 7 << 20, "on", 1.0)]))
    print("commit: landed", flush=True)
except OSError as exc:
    print(f"commit: refused: {exc}", flush=True)
try:
    meta.io.write_full(probe, b"written by a fenced owner")
    print("write: landed", flush=True)
except Exception as exc:
    print(f"write: refused: {exc}", flush=True)
"""


def test_a_stalled_rados_owner_whose_volume_was_taken_writes_nothing(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner stopped (SIGSTOP) past its lease: the next claim fences its client
    before writing its own record, so when it wakes up neither its metadata commit
    nor any write of its to RADOS lands (RBD's exclusive lock: lease, blocklist, epoch)."""
    monkeypatch.setenv("THINBLOCK_RADOS_LEASE_S", "2")
    pool = _seeded_pool(new_rados_locator(request, "stalled"))
    probe = f"thinblock-fence-probe-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALLED, pool, probe], env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "held"
        proc.send_signal(signal.SIGSTOP)
        with owner_store(pool) as meta:
            deadline = time.monotonic() + 60
            while True:  # refused while the lease lives, taken (and its holder fenced) once it lapsed
                try:
                    lease = meta.claim_volume(1, "heir")
                    break
                except VolumeBusyError as exc:
                    assert "owned by stalled" in str(exc)
                    assert time.monotonic() < deadline, "the stalled owner's lease never lapsed"
                    time.sleep(0.1)
            assert lease.epoch == 2
            proc.send_signal(signal.SIGCONT)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out = proc.communicate(timeout=120)[0]
            assert "commit: refused" in out and "write: refused" in out, out
            assert [v.size_bytes for v in meta.volumes() if v.id == 1] == [1 << 20]
            loc = locate(pool)
            assert isinstance(loc, RadosLocation)
            assert not _exists(loc, probe)
            meta.commit(Transaction(leases=[lease], volumes=[VolumeRow(1, "v1", 3 << 20, "on", 1.0)]))
            assert [v.size_bytes for v in meta.volumes() if v.id == 1] == [3 << 20]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_a_pool_level_step_whose_lock_was_lost_commits_nothing(request: pytest.FixtureRequest) -> None:
    """A pool-level step that stalled past its lock's lease read what another step may
    have changed since: its commit (an absolute value, as reserve_ids writes) must be
    refused, not land over the other's (RADOS: the step's lock is asserted in it), and
    so must its committer's meanwhile and every later one of that owner (they would
    carry the step's changes)."""
    pool = _seeded_pool(new_rados_locator(request, "step"))
    with owner_store(pool) as stalled, owner_store(pool) as other:
        with stalled.pool_lock():
            before = int(stalled.superblock().get("steps", 0))
            _break_step_lock(stalled)  # its lease lapsed while it stood still, and the lock was taken
            with other.pool_lock():
                other.commit(Transaction(superblock={"steps": before + 10}))
            # Its committer's commit meanwhile (another thread) may carry the step's
            # changes: it asserts the step's lock too.
            failed: list[BaseException] = []

            def committer() -> None:
                try:
                    stalled.commit(Transaction(superblock={"steps": before + 1}))
                except BaseException as e:  # handed to the test's thread
                    failed.append(e)

            thread = threading.Thread(target=committer)
            thread.start()
            thread.join()
            assert failed and isinstance(failed[0], OSError), failed
            assert failed[0].errno == errno.ESTALE and "the pool-level step's lock was lost" in str(failed[0])
        # Put back, the step's changes would go with the next commit, step or not: none
        # lands from this owner any more.
        with pytest.raises(OSError) as exc:
            stalled.commit(Transaction(superblock={"steps": before + 1}))
        refused(exc, errno.EIO, "the pool-level step's lock was lost")
        assert other.superblock()["steps"] == before + 10


def test_a_whole_pool_open_after_owners_per_volume_fences_them_and_takes_their_grants_back(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server per volume stalls (SIGSTOP) holding a volume and a grant; once its
    leases lapsed, a process opens the pool whole: it fences that owner (it never let
    go) and takes its grant back, so the stalled owner, when it wakes up, neither
    commits nor writes anything."""
    from thinblock.core.pool import Pool
    from thinblock.errors import PoolBusyError as Busy

    monkeypatch.setenv("THINBLOCK_RADOS_LEASE_S", "2")
    pool = new_rados_locator(request, "whole")
    Pool.create(pool, 64 << 20, block_size=64 << 10).close()
    with Pool.open(pool) as whole:
        whole.create_volume("v1", 1 << 20)
    probe = f"thinblock-fence-probe-{uuid.uuid4().hex}"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _STALLED, pool, probe, "grant"],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "held"
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while True:  # refused while its shared lease lives
            try:
                opened = Pool.open(pool, autocommit=False)
                break
            except Busy:
                assert time.monotonic() < deadline, "the stalled owner's shared lease never lapsed"
                time.sleep(0.2)
        with opened:
            assert opened.meta.grants() == []
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = proc.communicate(timeout=120)[0]
        assert "commit: refused" in out and "write: refused" in out, out
        loc = locate(pool)
        assert isinstance(loc, RadosLocation)
        assert not _exists(loc, probe)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def test_a_commit_of_an_owner_too_large_for_one_rados_operation_goes_through_a_journal(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit larger than one WriteOp (a snapshot of a big volume) is decided by the
    guarded operation that records its journal; another owner's next commit applies
    what is left before its own (here: the first owner stops right after deciding),
    and the counts of both add up."""
    from thinblock.meta import rados as rados_meta

    monkeypatch.setattr(rados_meta, "MAX_OP_KEYS", 16)
    pool = _seeded_pool(new_rados_locator(request, "journal"))
    with owner_store(pool) as a, owner_store(pool) as b:
        assert isinstance(a, rados_meta.RadosMetadata)
        la, lb = a.claim_volume(1, "a"), b.claim_volume(2, "b")
        applied: list[int] = []
        monkeypatch.setattr(a, "_finish_shared_journal", lambda epoch: applied.append(epoch))
        a.commit(
            Transaction(
                leases=[la],
                pages={1000 + i: (1, bytes([i]) * 32) for i in range(40)},
                roots={(1, i): 1000 + i for i in range(40)},
                page_refcounts={7: 3},
                page_ref_bases={7: 2},
            )
        )
        assert applied and a.journal_pending()  # decided, not applied yet
        b.commit(Transaction(leases=[lb], roots={(2, 0): 7}, page_refcounts={7: 4}, page_ref_bases={7: 3}))
        assert isinstance(b, rados_meta.RadosMetadata) and not b.journal_pending()
        assert len(b.pages(range(1000, 1040))) == 40 and b.roots(1) == {i: 1000 + i for i in range(40)}
        assert b.page(7) == (2 + 1 + 1, b"shared page")
        assert b.roots(2) == {0: 7}
        loc = locate(pool)
        assert isinstance(loc, RadosLocation)
        assert not any(
            o.key.startswith(f"{loc.meta_object}.journal.") for o in loc.cluster().ioctx(loc.ceph_pool).list_objects()
        )


def _break_step_lock(meta: MetadataStore) -> None:
    """What another process does to a step that stalled past its lease: breaks its lock."""
    from thinblock.ceph import cls_lock
    from thinblock.meta.rados import RadosMetadata
    from thinblock.meta.rados_leases import POOL_STEP_LOCK

    assert isinstance(meta, RadosMetadata)
    for locker in meta.leases().lockers(POOL_STEP_LOCK)[0]:
        meta.io.execute(
            meta.obj, "lock", "break_lock", cls_lock.break_lock_args(POOL_STEP_LOCK, locker.instance, locker.cookie)
        )


def test_a_pool_level_step_that_ended_without_its_lock_stops_the_owner(request: pytest.FixtureRequest) -> None:
    """A step whose lock was broken (it stalled past its lease) and that then ended, with
    no commit of its owner meanwhile: its changes may still be in the owner's open
    transaction, so the owner's next commit, step or not, is refused."""
    pool = _seeded_pool(new_rados_locator(request, "stepend"))
    with owner_store(pool) as stalled, owner_store(pool) as other:
        before = int(stalled.superblock().get("steps", 0))
        with stalled.pool_lock():
            _break_step_lock(stalled)
            with other.pool_lock():
                other.commit(Transaction(superblock={"steps": before + 10}))
        with pytest.raises(OSError) as exc:
            stalled.commit(Transaction(superblock={"steps": before + 1}))
        refused(exc, errno.ESTALE, "the pool-level step's lock was lost", "commits nothing more")
        assert other.superblock()["steps"] == before + 10


def test_a_commit_racing_the_end_of_a_pool_level_step_goes_again_without_it(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The committer's commit asserts the step lock of a step that is running; the step
    ends and lets its lock go before the commit reaches the OSD, which refuses the
    assertion. That step ended with its lock: the commit goes again without it and
    lands, and the owner commits on (no false "lease lost")."""
    from thinblock.meta.rados import RadosMetadata

    pool = _seeded_pool(new_rados_locator(request, "steprace"))
    with owner_store(pool) as meta:
        assert isinstance(meta, RadosMetadata)
        before = int(meta.superblock().get("steps", 0))
        in_step, sent, ended = threading.Event(), threading.Event(), threading.Event()
        asserted: list[str | None] = []
        real = meta._guarded_write

        def reaches_the_osd_late(*args: Any, **kwargs: Any) -> None:
            asserted.append(kwargs.get("step"))
            if len(asserted) == 1:
                sent.set()
                assert ended.wait(60)
            real(*args, **kwargs)

        def step() -> None:
            with meta.pool_lock():
                in_step.set()
                assert sent.wait(60)
            ended.set()

        monkeypatch.setattr(meta, "_guarded_write", reaches_the_osd_late)
        stepper = threading.Thread(target=step)
        stepper.start()
        assert in_step.wait(60)
        meta.commit(Transaction(superblock={"steps": before + 1}))
        stepper.join()
        assert asserted[0] is not None and asserted[-1] is None, asserted
        meta.commit(Transaction(superblock={"steps": before + 2}))
        assert int(meta.superblock()["steps"]) == before + 2


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_a_commit_whose_outcome_is_unknown_stops_the_owner_and_counts_once(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, landed: bool
) -> None:
    """The cluster does not answer a guarded commit in time (ETIMEDOUT): it may have
    landed or not. Sent again, its changes to shared counts would count twice, so the
    owner commits nothing more and gives its leases up (its server stops); the counter
    holds the change once or not at all, never twice."""
    import rados

    from thinblock.meta.rados import RadosMetadata

    monkeypatch.setenv("THINBLOCK_RADOS_LEASE_S", "2")
    pool = _seeded_pool(new_rados_locator(request, "timeout"))
    with owner_store(pool) as meta:
        assert isinstance(meta, RadosMetadata)
        lease = meta.claim_volume(1, "a")
        lost: list[tuple[int, str]] = []
        meta.watch_leases(lambda vid, why: lost.append((vid, why)))
        before = int(meta.superblock().get("steps", 0))
        real = meta._guarded_write

        def timed_out(*args: Any, **kwargs: Any) -> None:
            if landed:
                real(*args, **kwargs)
            raise rados.TimedOut("injected: the OSD did not answer in time", errno=errno.ETIMEDOUT)

        monkeypatch.setattr(meta, "_guarded_write", timed_out)
        change = Transaction(leases=[lease], superblock={"steps": before + 1}, counter_bases={"steps": before})
        with pytest.raises(OSError) as exc:
            meta.commit(change)
        refused(exc, errno.EIO, "outcome is unknown")
        monkeypatch.setattr(meta, "_guarded_write", real)  # the cluster answers again
        with pytest.raises(OSError) as exc:
            meta.commit(change)  # what a committer retries after a failure
        refused(exc, errno.EIO, "commits nothing more")
        assert [vid for vid, _why in lost] == [1]
        assert int(meta.superblock().get("steps", 0)) == before + (1 if landed else 0)
    # It never let go: the next owner claims the volume once its lock lapsed, fencing it.
    with owner_store(pool) as heir:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert heir.claim_volume(1, "b").epoch == lease.epoch + 1
                break
            except VolumeBusyError:
                assert time.monotonic() < deadline, "the given-up lease never lapsed"
                time.sleep(0.2)
        assert int(heir.superblock().get("steps", 0)) == before + (1 if landed else 0)
