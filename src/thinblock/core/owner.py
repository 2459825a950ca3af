"""One process's part of a pool served per volume (issue 22's owner mode).

A pool opened with `Pool.open(..., volumes=[...])` owns just those volumes: it
holds each one's lease (meta/base.py), and every commit it makes is guarded by
them and sends shared counts as changes (core/commit.py). Several such
processes share one pool. What they share changes only in the pool-level steps
of core/pool_steps.py, under the store's pool-level lock and never around data
I/O. This module holds what is this owner's alone:

- its leases, taken when the pool opens, given up when it closes;
- its grants of free blocks: it allocates only from them (core/spacemap.py's
  owner mode), takes another when they run low (sized by how fast it writes,
  1 to 64 MiB), and gives back what it did not use when it closes;
- the recovery of the volumes it takes: their ZEROED blocks may hold what an
  owner that died wrote and never committed, so they are zeroed again (every
  one, shared or not) before the first request (the rule spacemap's rule 2 keeps for free
  blocks, which a grant's taker punches).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from thinblock.core.mapping import BlockState, entry_dblock, entry_state
from thinblock.core.pool_settings import take_grant_growing
from thinblock.core.pool_steps import fold_orphans, punch_grant, recover_stale_grants, return_grant
from thinblock.core.registry import STAGING_PREFIX
from thinblock.core.spacemap import to_runs
from thinblock.errors import NoSpaceError, PoolBusyError, ThinblockError
from thinblock.meta.base import Grant, Lease, MetadataStore, VolumeBusyError
from thinblock.sizes import format_size

if TYPE_CHECKING:
    from thinblock.core.pool import Pool
    from thinblock.core.volume import Volume

log = logging.getLogger("thinblock.pool")
MIN_GRANT_BYTES = 1 << 20
MAX_GRANT_BYTES = 64 << 20
FIRST_GRANT_BYTES = 4 << 20
FAST_GRANTS_S = 1.0  # a grant taken sooner than this after the last one doubles the next
PREFETCH_FROM_BYTES = 16 << 20  # grants this large (a streaming writer's) are taken ahead of need
PREFETCH_WAIT_S = 30.0  # how long a closing owner waits for a grant being taken ahead of need


# What a lease's holder is, as its name begins: those that serve for as long as they run.
SERVE_PURPOSE = "thinblock serve"
ATTACH_PURPOSE = "thinblock fuse-daemon"


def owner_name(purpose: str) -> str:
    """Who holds a lease, as other processes are told: host, pid and what it is."""
    return f"{purpose or 'thinblock'} (pid {os.getpid()} on {socket.gethostname()})"


def owner_pid(name: str) -> int | None:
    """The pid an owner_name names, when it is on this host."""
    found = re.search(r"\(pid (\d+) on (.*)\)$", name)
    if found is None or found.group(2) != socket.gethostname():
        return None
    return int(found.group(1))


class VolumeOwner:
    """The leases and grants of one owner of a pool shared per volume."""

    def __init__(self, pool: Pool, name: str) -> None:
        self.pool = pool
        self.name = name
        self._leases: dict[int, Lease] = {}  # volume id -> lease
        self._staging: set[int] = set()  # leases of staging volumes this owner made
        self.grants: list[Grant] = []
        self._granted = threading.Condition()  # _granting changed
        self._granting = 0  # grants committed, being punched (not allocatable yet)
        self._wanting = 0  # requests in take_space (give_back_idle waits for them)
        self._prefetching = False  # a thread takes the next grant ahead of need (maybe_prefetch)
        self._no_prefetch = False  # none may (quiesce_prefetch: a handover or the close is under way)
        self._leaving: set[int] = set()  # volumes being handed over: served no more
        self._grant_bytes = FIRST_GRANT_BYTES
        self._last_grant = 0.0
        self.clock: Callable[[], float] = time.monotonic  # grant sizing; a test's own, to be deterministic
        # Has the other owners give back the grants they keep idle (a server's: it
        # reaches them through their control sockets, admin/idle_grants.py); True if
        # one answered. None: ENOSPC as soon as nothing is left outside the grants.
        self.ask_others: Callable[[], bool] | None = None

    @property
    def meta(self) -> MetadataStore:
        return self.pool.meta  # the pool's, whatever wraps it (tests put faults there)

    # ----- leases -----------------------------------------------------------------

    @staticmethod
    def claim(pool_meta: MetadataStore, ids: dict[str, int], name: str) -> dict[int, Lease]:
        """The leases of the volumes named (name -> id), all or none: VolumeBusyError
        naming the holder of the first one held elsewhere."""
        try:
            return pool_meta.claim_volumes(list(ids.values()), name)
        except VolumeBusyError as exc:
            for vol_name, vid in ids.items():  # none was taken: name the first held
                holder = pool_meta.volume_holder(vid)
                if holder is not None:
                    raise VolumeBusyError(f"volume {vol_name} is served by {holder}") from None
            raise VolumeBusyError(f"{exc}") from None

    def adopt(self, leases: dict[int, Lease]) -> None:
        self._leases = dict(leases)

    def take(self, vid: int, lease: Lease) -> None:
        """A volume claimed at runtime (core/claim.py), ready: served from now on."""
        self._leases[vid] = lease
        self._leaving.discard(vid)

    def claim_staging(self, vid: int) -> None:
        """Hold the lease of a staging volume this owner makes (a job's, before its row is
        committed): while it is held the volume is this job's, and one whose lease nobody
        holds was left by an owner that died, for any pool-level step to remove
        (Pool.drop_stale_staging). Given up once the volume is gone (forget_staging), or
        when the owner closes."""
        self._leases[vid] = self.meta.claim_volume(vid, self.name)
        self._staging.add(vid)

    def forget_staging(self) -> None:
        """After a job, once its changes are committed: give up the leases of its staging
        volumes that are gone (dropped, or adopted), unless a grant is under one (it goes
        back when the owner closes). A staging volume made a volume keeps its lease."""
        gone = {vid for vid in self._staging if self.pool.volume_by_id(vid) is None}
        gone -= {g.volume_id for g in self.grants}
        for vid in gone:
            self._staging.discard(vid)
            self.meta.release_volume(self._leases.pop(vid))

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def owns(self, vol: Volume) -> bool:
        return self.owns_id(vol.row.id)

    def leave(self, vid: int) -> None:
        """vid is being handed over: no new client may open it here from now on."""
        self._leaving.add(vid)

    def stay(self, vid: int) -> None:
        """The handover of vid failed: it is served here again."""
        self._leaving.discard(vid)

    def holds(self, vid: int) -> bool:
        """Whether this owner holds vid's lease (a volume being handed over included)."""
        return vid in self._leases

    def owned_ids(self) -> set[int]:
        return set(self._leases) - self._leaving

    def owns_id(self, vid: int) -> bool:
        """owns, by volume id (a snapshot's base: asked once per export listed)."""
        return vid in self._leases and vid not in self._leaving

    def lease_of(self, vol: Volume | None) -> Lease:  # take_space has checked there is one
        """The lease a grant for vol is taken under (any of ours for a volume not ours)."""
        # The volume a staging one replaces first: its lease lasts beyond the job.
        if vol is not None and vol.replaces is not None and vol.replaces.row.id in self._leases:
            return self._leases[vol.replaces.row.id]
        if vol is not None and vol.row.id in self._leases:
            return self._leases[vol.row.id]
        return next(iter(self._leases.values()))

    # ----- recovery of volumes an owner left --------------------------------------

    def rezero(self) -> None:
        """Zero again every ZEROED block our volumes map (see the module's docstring),
        shared or not: a page shared now may have been the dead owner's alone when it
        wrote into the block in place (a command may snapshot or clone a volume nobody
        holds), and the sharing would hide the bytes only until it ends. A ZEROED block
        reads zero for everyone, and nobody writes in place into a block two pages
        reference, so zeroing it changes nothing anyone may see."""
        pool = self.pool
        dblocks: set[int] = set()
        for vid in self._leases:
            vol = pool.volume_by_id(vid)
            if vol is None:
                continue
            pool.txn.load_pages(vol.root.values())
            for page_id in vol.root.values():
                for entry in pool.txn.page(page_id).entries:
                    if entry and entry_state(entry) == BlockState.ZEROED:
                        dblocks.add(entry_dblock(entry))
        bs = pool.block_size
        for start, count in to_runs(sorted(dblocks)):
            pool.store.zero(start * bs, count * bs)
        if dblocks:
            pool.store.flush()
            log.info("pool %s: zeroed %d ZEROED blocks again of the volumes taken over", pool.path, len(dblocks))

    def drop_stale_staging(self) -> None:
        """Remove the staging volumes a job that died left (their lease is held by
        nobody: every owner holds the lease of the staging volumes it makes), as the
        whole pool's open does; a staged snapshot of a volume another server holds is
        left to that server (it removes it when it next opens). Their grants are taken
        back first, so none is left for a volume that does not exist."""
        pool = self.pool
        stale = [
            vol.name
            for vol in list(pool.volumes.values())
            if vol.name.startswith(STAGING_PREFIX) and vol.row.id not in self._leases
        ]
        if not stale:
            return
        with pool.pool_step():
            recover_stale_grants(self.meta)
            for name in stale:
                vol = pool.volumes.get(name)
                if vol is None or self.meta.volume_holder(vol.row.id) is not None:
                    continue
                try:
                    pool.check_may_change(vol)
                except PoolBusyError:
                    continue
                log.info("pool %s: removing staging volume %s left by an interrupted job", pool.path, name)
                pool.catch_up()
                pool.remove_volume(name)

    # ----- grants -----------------------------------------------------------------

    def take_space(self, wanted: int, vol: Volume | None) -> None:
        """Take grants (outside the pool lock) until `wanted` blocks are allocatable, or
        NoSpaceError when the pool has no free block left outside others' grants.

        The decision and the grant's commit run under the store's pool-level lock (one
        at a time, across threads and processes); the punch and sync of its blocks run
        after it, outside every lock, and only then are they allocatable. A thread that
        finds a grant on its way waits for it rather than taking another."""
        pool = self.pool
        if not self._leases:
            raise NoSpaceError(f"pool {pool.path}: a command owning no volume takes no new space")
        with self._granted:
            self._wanting += 1
        try:
            self._gather(wanted, vol)
        finally:
            with self._granted:
                self._wanting -= 1

    def _gather(self, wanted: int, vol: Volume | None) -> None:
        pool = self.pool
        space = pool.accounts.space
        bs = pool.block_size
        asked_others = False
        while True:
            with self._granted:
                while self._granting:
                    self._granted.wait(1.0)
                with pool.lock:
                    if wanted <= space.allocatable_blocks:
                        return
            with self.meta.pool_lock():
                with self._granted, pool.lock:
                    short = wanted - space.allocatable_blocks
                    if self._granting or short <= 0:
                        continue
                now = self.clock()
                if now - self._last_grant < FAST_GRANTS_S:
                    self._grant_bytes = min(MAX_GRANT_BYTES, self._grant_bytes * 2)
                elif now - self._last_grant > 10 * FAST_GRANTS_S:
                    self._grant_bytes = max(MIN_GRANT_BYTES, self._grant_bytes // 2)
                self._last_grant = now
                blocks = max(short, self._grant_size(), 1)
                lease = self.lease_of(vol)
                full: OSError | None = None
                try:  # the pool's size and policy followed first; autogrow when none is free
                    grant = take_grant_growing(pool, lease, blocks, short)
                except OSError as exc:
                    full = exc
                else:
                    with self._granted:
                        self._granting += 1
            if full is not None:
                # Outside the pool-level lock, which the others take to give grants back:
                # space they keep idle is the pool's too, so ENOSPC waits until they have
                # given it back, once per request.
                if not asked_others and self.ask_others is not None and self.ask_others():
                    asked_others = True
                    continue
                raise NoSpaceError(f"pool {pool.path} is out of space: {full.strerror}") from None
            in_flight = True

            def done() -> None:
                nonlocal in_flight
                if in_flight:
                    in_flight = False
                    with self._granted:
                        self._granting -= 1
                        self._granted.notify_all()

            try:
                try:
                    # No longer in flight before a failed grant goes back, which takes the
                    # pool-level lock: a step holding that lock may be waiting for it.
                    punch_grant(self.meta, pool.store, lease, grant, before_return=done)
                except OSError as exc:
                    raise NoSpaceError(f"pool {pool.path}: preparing granted space failed: {exc.strerror}") from None

                def added(meta: object, grant: Grant = grant) -> None:
                    # Between commits: the view of the grant's refcount pages follows the
                    # store's (others' frees in them included) with no commit in flight.
                    stored = self.meta.refcount_pages()
                    with pool.lock:
                        space.add_grant(grant.start, grant.count, stored)
                        self.grants.append(grant)

                pool.between_commits(added)
            finally:
                done()
            log.debug(
                "pool %s: granted %s at block %d to volume %d",
                pool.path,
                format_size(grant.count * bs),
                grant.start,
                grant.volume_id,
            )

    def maybe_prefetch(self, vol: Volume) -> None:
        """After a write that allocated: when less than half a grant is left allocatable
        and the grants come fast (a writer streams), take the next one now, on a thread
        of its own, so that the writer does not wait for its pool-level step (a few
        RADOS round trips on Ceph). A heuristic: read without the pool lock."""
        space = self.pool.accounts.space
        if (
            self._prefetching
            or self._no_prefetch
            or self._granting
            or self._grant_bytes < PREFETCH_FROM_BYTES
            or space.allocatable_blocks >= self._grant_size() // 2
        ):
            return
        with self._granted:
            if self._prefetching or self._no_prefetch or self._granting:
                return
            self._prefetching = True
        threading.Thread(target=self._prefetch, args=(vol,), name="thinblock-grant-ahead", daemon=True).start()

    def _prefetch(self, vol: Volume) -> None:
        try:
            with self.pool.lock:
                wanted = self.pool.accounts.space.allocatable_blocks + self._grant_size() // 2
            self.take_space(wanted, vol)
        except Exception as exc:  # a thread of its own: the writer that needs the space says what failed
            log.debug("pool %s: taking a grant ahead of need failed: %s", self.pool.path, exc)
        finally:
            with self._granted:
                self._prefetching = False
                self._granted.notify_all()

    def quiesce_prefetch(self) -> None:
        """No grant is taken ahead of need from now on (until allow_prefetch), and one
        being taken is waited for: call with no lock held (it needs them), before a
        handover or the close give grants and leases back."""
        with self._granted:
            self._no_prefetch = True
            self._granted.wait_for(lambda: not self._prefetching, timeout=PREFETCH_WAIT_S)

    def allow_prefetch(self) -> None:
        self._no_prefetch = False

    def idle_limit(self, *, margin: bool = True) -> int:
        """How many allocatable blocks this owner keeps in its grants at most; the
        rest goes back to the pool (others may need it: a trimmed volume's space).
        Without margin, only what its own volumes' reservations set aside."""
        # Two grants' worth: less would give back the grant just taken, and take it
        # again at the next write. Beyond that, what its volumes' reservations set
        # aside: its allocation gate keeps that unused, and would take it again at once.
        return (max(1, 2 * self._grant_size()) if margin else 0) + self.pool.accounts.reserved_blocks()

    def _grant_size(self) -> int:
        """The blocks a grant holds now: by the write rate, and an eighth of a small pool
        at most (it is shared in smaller grants)."""
        return min(self._grant_bytes // self.pool.block_size, self.pool.accounts.space.n_blocks // 8)

    def give_back_idle(self, *, margin: bool = True) -> None:
        """Return whole grants while more than idle_limit blocks lie allocatable in
        them (after a commit, between commits: call with no lock held). Without margin
        (after a handover): every whole grant its own set-asides do not need, since
        the blocks it kept for the volume handed over are the new holder's to have. A grant goes
        back only when nothing uncommitted touches it: no fresh block in flight, no
        free waiting for its punch, no refcount change not yet committed, since the
        next commit would count a block outside every grant, or a late punch would
        wipe what the next taker wrote there."""
        pool = self.pool
        space = pool.accounts.space
        with self._granted:
            if self._wanting:  # a request is gathering grants: what lies idle is for it
                return
        with pool.lock:
            if space.allocatable_blocks <= self.idle_limit(margin=margin):
                return

        def give(meta: object) -> None:
            with pool.lock:  # the grants holding most allocatable blocks first
                order = sorted(self.grants, key=lambda g: -space.busy.count(0, g.start, g.start + g.count))
            for grant in order:
                with pool.lock:
                    if space.allocatable_blocks <= self.idle_limit(margin=margin):
                        return
                    if self._unsettled(grant):
                        continue
                    was_idle = space.drop_grant(grant.start, grant.count)
                    self.grants.remove(grant)
                lease = self._leases.get(grant.volume_id)
                try:
                    if lease is None:
                        raise ThinblockError(f"volume {grant.volume_id}'s lease is gone")
                    return_grant(self.meta, lease, grant)
                except (OSError, ThinblockError) as exc:
                    log.warning("pool %s: giving back grant %d+%d failed: %s", pool.path, grant.start, grant.count, exc)
                    with pool.lock:
                        space.restore_grant(grant.start, grant.count, was_idle)
                        self.grants.insert(0, grant)
                    return
                log.debug("pool %s: gave back grant %d+%d", pool.path, grant.start, grant.count)

        with self.meta.pool_lock():  # before the turn, as every pool-level step takes them
            pool.between_commits(give)
        pool.accounts.wake_space_waiters()

    def release_volume(self, vid: int) -> None:
        """Give one volume up while serving the others (a handover): its clients are
        gone (the caller hung them up, and holds its whole range and the pool-level
        lock). Its grants leave the allocator first, between commits, then what was
        allocated from them is committed, then they go back and the lease is released;
        the volume is not ours from then on. If they do not settle, they are put back
        and nothing is released (ThinblockError: the handover may be asked again)."""
        pool = self.pool
        space = pool.accounts.space
        lease = self._leases[vid]
        mine = [g for g in self.grants if g.volume_id == vid]

        idle: dict[Grant, set[int]] = {}

        def drop(_meta: object) -> None:
            with pool.lock:
                for grant in mine:
                    idle[grant] = space.drop_grant(grant.start, grant.count)
                    self.grants.remove(grant)

        def put_back(_meta: object) -> None:
            with pool.lock:
                for grant in mine:
                    space.restore_grant(grant.start, grant.count, idle.get(grant, set()))
                    self.grants.append(grant)

        pool.between_commits(drop)
        try:
            for _attempt in range(10):  # writes in flight when they left the allocator settle
                pool.commit()
                if pool.between_commits(lambda _meta: not any(self._unsettled(g) for g in mine)):
                    break
            else:
                raise ThinblockError(f"volume {vid}'s grants did not settle: ask for the handover again")
        except BaseException:
            pool.between_commits(put_back)
            raise
        while mine:
            try:
                return_grant(self.meta, lease, mine[0])
            except BaseException:
                pool.between_commits(put_back)  # those not given back are ours again
                raise
            mine.pop(0)
        try:
            self.meta.release_volume(lease)
        except (OSError, ThinblockError) as exc:
            # The store gives the lease up even so (meta/base.py): only its record may
            # still name this owner until the next claim. Served here it must not be.
            log.warning("pool %s: volume %d's lease given up with an error: %s", pool.path, vid, exc)
        finally:
            del self._leases[vid]
            self._leaving.discard(vid)

    def _unsettled(self, grant: Grant) -> bool:
        """Whether something not yet committed touches the grant's blocks: a count that
        differs from the store's as last seen (a fresh block in flight, a free or a share
        not committed), or a free waiting for its punch."""
        space = self.pool.accounts.space
        end = grant.start + grant.count
        with self.pool.lock:
            pending = (*space.pending_free, *space.unsynced_free, *space.punching)
            return any(grant.start <= d < end for d in pending) or space.uncommitted_in(grant.start, grant.count)

    def fold(self) -> None:
        """Pages our commit left at count zero with others' changes: fold them now."""
        try:
            fold_orphans(self.meta)
        except (OSError, ThinblockError) as exc:  # folded by the next step that runs
            log.warning("pool %s: folding orphan pages failed: %s", self.pool.path, exc)

    def release(self) -> list[str]:
        """After the final commit: give back every grant, then every lease. What could
        not be given back is left to the next pool-level step (a stale grant, a dead
        lease) and returned as warnings."""
        problems: list[str] = []
        for grant in self.grants:
            lease = self._leases.get(grant.volume_id)
            if lease is None:
                continue
            try:
                return_grant(self.meta, lease, grant)
            except (OSError, ThinblockError) as exc:
                problems.append(f"grant {grant.start}+{grant.count} not given back: {exc}")
        self.grants = []
        self._staging = set()
        try:
            self.meta.release_volumes(list(self._leases.values()))
        except (OSError, ThinblockError) as exc:
            # The store gives them up even so (meta/base.py): only their records may
            # still name this owner, until the next claim overwrites them.
            problems.append(f"the leases of {len(self._leases)} volume(s) given up with an error: {exc}")
        self._leases = {}
        return problems
