"""Pool space: reservations and set-asides, taking space for a request, growth,
and requests held by the wait policy until space appears.

`check_space()` is the one gate every allocation passes: it answers ENOSPC (nothing
changed) or lets the caller take the blocks from the space map.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from thinblock.core.commit import COMMIT_INTERVAL_S
from thinblock.core.reservation import row_target, set_aside_blocks
from thinblock.core.spacemap import SpaceMap
from thinblock.core.transaction import OpenTransaction
from thinblock.errors import CommitError, FreedSpacePending, GrantNeeded, NoSpaceError, ThinblockError
from thinblock.sizes import format_size
from thinblock.store.base import DataStore
from thinblock.store.hostspace import HostSpace, beyond_file_limit

if TYPE_CHECKING:
    from thinblock.core.owner import VolumeOwner
    from thinblock.core.space_policy import SpacePolicy
    from thinblock.core.volume import Volume

log = logging.getLogger("thinblock.pool")


class SpaceAccounts:
    """The pool's space: the free map, the reserved total and the gate every
    allocation passes. Shared by every volume of the pool; changed under the pool lock."""

    def __init__(
        self,
        *,
        path: str,
        lock: threading.RLock,
        block_size: int,
        size_bytes: int,
        space: SpaceMap,
        store: DataStore,
        host: HostSpace,
        data_path: str,
        txn: OpenTransaction,
        policy: SpacePolicy,
        commit: Callable[[], None],
        kick_commit: Callable[[], None],
        commit_failure: Callable[[], str | None],
    ) -> None:
        self.path = path
        self.lock = lock
        self.block_size = block_size
        self.size_bytes = size_bytes
        self.space = space
        self.store = store
        self.host = host
        self.data_path = data_path
        self.txn = txn
        self.policy = policy
        self._commit = commit  # the committer's, so that freed space can be settled
        self._kick_commit = kick_commit
        self._commit_failure = commit_failure
        self.reserved_total = 0  # the set-asides of every volume, kept by retally_set_aside
        self.reserved_volumes: set[Volume] = set()  # the volumes with a reservation
        # Writers held by the wait policy sleep on this; grow, frees and removals wake them.
        self.space_changed = threading.Condition(lock)
        self.waits_cancelled = threading.Event()
        # Owner mode (core/owner.py): blocks come from this owner's grants; a request
        # short of them asks for more (GrantNeeded) and plans again once they came.
        self.owner: VolumeOwner | None = None
        self._wanted: tuple[int, Volume | None] = (0, None)
        self._no_grant: str | None = None  # why the last grant failed, told to the next request
        # Owner mode, during a pool-level step (Pool.catch_up, under the pool-level lock):
        # the free blocks outside every grant less what other holders' reservations still
        # need of them (core/reservation.py's still_needed). None outside a step.
        self.pool_room: int | None = None

    # ----- reservations (the rule: core/reservation.py) ------------------------------
    # The exclusive count is a lower bound (core/exclusive.py), which only over-reserves;
    # decisions that could fail recount the stale ones first (refresh_reserved). A staging
    # volume that will replace a volume (Volume.replaces, set by stand_in) owns its
    # blocks toward that volume's reservation and may allocate from its set-aside.

    def reserve_target(self, vol: Volume) -> int:
        return row_target(vol.row, self.block_size)

    def set_aside(self, vol: Volume, reserve_bytes: int | None = None) -> int:
        """What the pool holds aside for vol (were its reservation reserve_bytes, if given)."""
        row = vol.row if reserve_bytes is None else dataclasses.replace(vol.row, reserve_bytes=reserve_bytes)
        replacing = sum(staged.row.exclusive_blocks for staged in vol.replacements)
        return set_aside_blocks(row, self.block_size, replacement_blocks=replacing)

    def reserved_blocks(self) -> int:
        return self.reserved_total

    def own_set_aside(self, vol: Volume) -> int:
        """The part of the reserved total vol may allocate from: its own set-aside, and a
        staging volume's the one of the volume it replaces."""
        replaced = vol.replaces
        return vol.set_aside_counted + (replaced.set_aside_counted if replaced is not None else 0)

    def stand_in(self, staging: Volume, vol: Volume) -> None:
        """staging (hidden) will replace vol: its blocks count toward vol's reservation
        from now on (call under the pool lock, in the hold that added staging). The link
        is staging's origin, so `pool check` and a reopened pool see it too; it ends
        when either goes."""
        if vol.removed:
            return
        if staging.row.origin_id != vol.row.id:
            staging.row.origin_id = vol.row.id
            self.txn.mark_volume_dirty(staging)
        staging.replaces = vol
        vol.replacements.append(staging)
        self.retally_set_aside(vol)

    def counts_reservation(self, vol: Volume) -> bool:
        """Whether vol's set-aside is this process's to keep: every volume's for the whole
        pool's owner; an owner per volume keeps only its own volumes' (what other holders'
        reservations need, its grant steps leave in the free space: core/pool_steps.py)."""
        return self.owner is None or self.owner.holds(vol.row.id)

    def retally_set_aside(self, vol: Volume) -> None:
        """vol's reservation, size or exclusive count changed, or it went: the pool's
        reserved total follows (O(1), so the allocation gate never sums volumes). For a
        staging volume, the volume it replaces is counted again."""
        counted = 0 if vol.removed or not self.counts_reservation(vol) else self.set_aside(vol)
        self.reserved_total += counted - vol.set_aside_counted
        vol.set_aside_counted = counted
        if vol.row.reserve_bytes and not vol.removed and self.counts_reservation(vol):
            self.reserved_volumes.add(vol)
        else:
            self.reserved_volumes.discard(vol)
        replaced = vol.replaces
        if vol.removed:
            for staged in vol.replacements:  # what replaced it replaces nothing now
                staged.replaces = None
            vol.replacements = []
            if replaced is not None:
                vol.replaces = None
                replaced.replacements.remove(vol)
        if replaced is not None:
            self.retally_set_aside(replaced)

    def set_exclusive(self, vol: Volume, count: int, *, exact: bool = True) -> None:
        """vol's exclusive count as just established: exact now (stamped with the current
        sharing epoch), or only a lower bound. Committed with the volume's row."""
        vol.row.exclusive_blocks = count
        vol.row.exclusive_epoch = self.space.sharing_epoch if exact else -1
        self.txn.mark_volume_dirty(vol)
        self.retally_set_aside(vol)

    def refresh_reserved(self) -> bool:
        """Recount the stale exclusive counts of reserved volumes (call under the pool
        lock); whether the reserved total changed."""
        before = self.reserved_total
        for vol in list(self.reserved_volumes):
            vol.fresh_exclusive()
            for staged in list(vol.replacements):
                staged.fresh_exclusive()
        return self.reserved_total != before

    def check_reservable(self, vol: Volume, new_set_aside: int, what: str, freed: int = 0, why: str = "") -> None:
        """Refuse (ENOSPC, nothing changed) when vol's set-aside cannot grow to new_set_aside.

        An owner per volume weighs it in a pool-level step, against the room the step
        found outside every grant (pool_room) plus what lies unused in its own grants,
        less its own volumes' set-asides; the change is committed before the step ends,
        so every later grant step leaves the new set-aside in the free space."""
        self.refresh_reserved()
        extra = new_set_aside - self.set_aside(vol)
        if extra <= 0:
            return
        if self.owner is None:
            available = self.space.free_blocks + freed - self.reserved_blocks()
        elif self.pool_room is None:
            raise ThinblockError(f"pool {self.path}: a reservation grows only in a pool-level step (Pool.pool_step)")
        else:
            available = self.pool_room + self.space.allocatable_blocks + freed - self.reserved_blocks()
        if extra > available:
            raise NoSpaceError(
                f"cannot {what} {vol.name}: its reservation needs {format_size(extra * self.block_size)} more"
                f" set aside{why}, and the pool has {format_size(max(0, available) * self.block_size)} unreserved free"
            )

    # ----- space ------------------------------------------------------------------

    def grow(self, size_bytes: int, *, commit: bool = True) -> list[str]:
        """Grow the pool online; shrinking is refused. Returns warnings for a person
        (a pool larger than the host can hold). Autogrow passes commit=False: it runs
        in the middle of a request's planning, under the pool lock (the next commit
        records the new size)."""
        with self.lock:
            if size_bytes % self.block_size:
                raise ThinblockError(f"pool size must be a multiple of the block size ({format_size(self.block_size)})")
            if size_bytes < self.size_bytes:
                raise ThinblockError(
                    f"shrinking a pool is not supported ({format_size(self.size_bytes)} -> {format_size(size_bytes)})"
                )
            if size_bytes == self.size_bytes:
                return []
            try:
                self.store.grow(size_bytes)
            except OSError as exc:
                if exc.errno == errno.EFBIG:
                    raise beyond_file_limit(size_bytes, self.path) from None
                raise ThinblockError(f"cannot grow the data store of pool {self.path}: {exc.strerror}") from None
            warning = self.host.capacity_warning(size_bytes, self.data_path)
            self.space.grow(size_bytes // self.block_size)
            self.size_bytes = size_bytes
            self.txn.touch()
        if commit:
            self._commit()
        log.info("pool %s grown to %s", self.path, format_size(size_bytes))
        if warning:
            log.warning("%s", warning)
        self.wake_space_waiters()
        return [warning] if warning else []

    def check_space(self, n_blocks: int, vol: Volume | None = None) -> None:
        """Ensure n_blocks can be allocated now for vol, or raise NoSpaceError (nothing changed).

        vol may use its own set-aside (a staging volume also the one of the volume it
        replaces); everyone else's stays untouched. While commits
        fail, or while the host is full (the metadata slack is out), nothing new is
        allocated: the open transaction must not grow beyond what one commit can write."""
        failure = self._commit_failure()
        if failure is not None:
            raise NoSpaceError(f"pool {self.path} takes no new space while its commits fail: {failure}")
        if self.host.slack_released:
            self._kick_commit()
            raise NoSpaceError(
                f"the host filesystem under pool {self.path} is full: new space is refused until freed space returns"
            )
        # An owner per volume counts only its own volumes' set-asides here (reserved_total):
        # its grants hold them first, and its grant steps keep the rest (core/pool_steps.py).
        others = self.reserved_total - (self.own_set_aside(vol) if vol is not None else 0)
        if n_blocks <= self.space.allocatable_blocks - others:
            return
        if others and self.refresh_reserved():  # stale counts over-reserve: recount, then decide
            return self.check_space(n_blocks, vol)
        if self.owner is not None:
            if self._no_grant is not None:
                why, self._no_grant = self._no_grant, None
                raise NoSpaceError(why)
            self._wanted = (n_blocks + others, vol)  # the grants must hold the others' set-asides too
            raise GrantNeeded(f"pool {self.path}: {n_blocks} blocks are needed beyond this owner's grants")
        if n_blocks <= self.space.free_blocks - others:
            # Freed blocks become usable once committed, punched and synced: the caller
            # commits twice with the pool lock released, then plans again.
            raise FreedSpacePending(f"pool {self.path}: {n_blocks} blocks are free once freed space is committed")
        if self.policy.autogrow_for(n_blocks + others - self.space.free_blocks):
            return self.check_space(n_blocks, vol)
        raise NoSpaceError(
            f"pool {self.path} is out of space: {n_blocks} blocks needed,"
            f" {max(0, self.space.free_blocks - others)} free"
            + (f" ({others} reserved by other volumes)" if others else "")
        )

    def settle_frees(self) -> None:
        """Make the blocks freed so far allocatable: one commit punches them, the next
        one's data sync makes the punch durable (call without holding the pool lock).
        An owner per volume takes grants instead, for what the last request lacked."""
        if self.owner is not None:
            wanted, vol = self._wanted
            try:
                self.owner.take_space(wanted, vol)
            except NoSpaceError as exc:
                with self.lock:
                    self._no_grant = str(exc)
            return
        try:
            self._commit()
            self._commit()
        except CommitError as exc:
            raise NoSpaceError(f"pool {self.path} cannot reuse freed space: {exc.strerror}") from exc

    def return_fresh(self, blocks: list[int]) -> None:
        """Fresh dblocks a failed operation took go back (see SpaceMap.unallocate)."""
        if blocks:
            self.space.unallocate(blocks)
            self.txn.touch()

    def wait_for_space(self, deadline: float) -> bool:
        """Under the wait policy, sleep (pool lock released) until space may have
        appeared; False once the deadline passed or the pool closes."""
        with self.space_changed:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.waits_cancelled.is_set():
                return False
            self.space_changed.wait(min(remaining, COMMIT_INTERVAL_S))
            return not self.waits_cancelled.is_set()

    def wake_space_waiters(self) -> None:
        """Space may have appeared (growth, frees, smaller set-asides, shutdown): requests
        held by the wait policy re-plan."""
        with self.space_changed:
            self.space_changed.notify_all()

    def cancel_waits(self) -> None:
        """Shutting down: requests held by the wait policy get ENOSPC now."""
        self.waits_cancelled.set()
        self.wake_space_waiters()  # under the condition's lock: no waiter misses it

    def space_figures(self) -> dict[str, int]:
        """Pool space in bytes, O(1): what statfs and low-water marks need. Set-asides
        are as counted (they may over-reserve); status() recounts stale ones first."""
        with self.lock:
            bs = self.block_size
            used = self.space.used_blocks * bs
            reserved = self.reserved_blocks() * bs
            return {
                "size_bytes": self.size_bytes,
                "used_bytes": used,
                "free_bytes": self.size_bytes - used,
                "reserved_bytes": reserved,
                "available_bytes": max(0, self.size_bytes - used - reserved),
            }

    def host_figures(self) -> dict[str, Any]:
        """The layer below: what it can still take, and whether commits are healthy."""
        return {
            "host_free_bytes": self.host.host_free_bytes(),
            "metadata_slack_bytes": 0 if self.host.slack_released else self.host.slack_bytes,
            "commit_failure": self._commit_failure(),
            **self.host.below_status(),
        }
