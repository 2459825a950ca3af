"""Per-volume leases on a RADOS pool served per volume (meta/base.py's ownership
contract, issue 23's first step): the locks, the records naming their holders,
and the thread that renews them.

- A volume's lease is the exclusive cls lock `volume.<id>` on the metadata
  object, taken with a fresh cookie and a lease of lease_s() seconds, renewed
  every third of that. RADOS lets it lapse when its holder stops renewing (it
  died, stalled, or lost the cluster), and then any other client may take it.
- The omap key `o.<id>` records who holds it: owner, epoch, cookie, and the Ceph
  client (address, instance). A holder that lets go cleanly empties the owner
  and keeps the epoch; the next claim takes the epoch above.
- A claim that finds the record still naming a holder (it never let go)
  blocklists that holder's client before writing anything: a stalled holder
  that wakes up can then write nothing at all, data or metadata. One client
  serves all of a process's volumes for now, so this fences the whole process,
  which has lost every lease by then anyway (one thread renews them all).
- Every commit under a lease asserts, inside its WriteOp, that the lock still
  lists the lease's cookie (meta/rados.py): nothing lands once another took it.
- Pool-level steps take the exclusive cls lock `pool-step` the same way.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from thinblock.bindings import RADOS_POOLS, require
from thinblock.ceph import cls_lock
from thinblock.ceph.cluster import BLOCKLISTED, Cluster, as_oserror, rados_errno
from thinblock.errors import ThinblockError
from thinblock.meta.base import Lease
from thinblock.sizes import env_seconds

rados = require("rados", feature=RADOS_POOLS)

log = logging.getLogger("thinblock.rados")

POOL_STEP_LOCK = "pool-step"
# cls_lock's LOCK_FLAG_MUST_RENEW: a renewal of a lock this cookie no longer holds
# (broken, or taken by another after it lapsed) fails with ENOENT instead of taking it
# again, which the may-renew flag (1) would do: a stalled holder must not get it back.
MUST_RENEW = 2
# A lock whose expiry is this close to now still counts as held: the OSD's clock
# decides when another may take it, and hosts' clocks differ a little.
CLOCK_MARGIN_S = 1.0
BLOCKLIST_S = 3600  # long enough for the fenced process to notice and give up


def lease_s() -> int:
    """The lease, in whole seconds (THINBLOCK_RADOS_LEASE_S, default 15, 1 to 3600)."""
    return max(1, round(env_seconds("THINBLOCK_RADOS_LEASE_S", 15.0, 1.0, 3600.0)))


STEPS_REMEMBERED = 64  # how the last steps ended, for commits still in flight when they did


def volume_lock(volume_id: int) -> str:
    return f"volume.{volume_id}"


def record_key(volume_id: int) -> str:
    return f"o.{volume_id:012d}"


def parse_record(raw: bytes | None) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        got = json.loads(raw)
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def read_lockers(io: Any, obj: str, name: str) -> tuple[list[cls_lock.Locker], int]:
    """The lockers of lock `name` on obj and the lock's type (cls_lock get_info; none
    and 0 when the object does not exist)."""
    try:
        _ret, out = io.execute(obj, "lock", "get_info", cls_lock.get_info_args(name))
        return cls_lock.lock_info(out)
    except rados.ObjectNotFound:
        return [], 0
    except rados.Error as exc:
        raise as_oserror(exc, "lock info") from None
    except Exception as exc:  # struct.error: a reply this thinblock cannot read
        raise ThinblockError(f"cannot read the lock {name} of {obj}: {exc}") from None


def unlapsed(locker: cls_lock.Locker, now: float) -> bool:
    """Whether a locker's lease still runs at `now` (this host's clock), by the
    expiry the OSD set, CLOCK_MARGIN_S given for the two clocks (0: no expiry)."""
    return locker.expires == 0 or locker.expires + CLOCK_MARGIN_S > now


class LockRenewer:
    """One thread renewing every lock a store holds, until it is stopped, and a
    watchdog. A lock is lost when another took it, when this client was fenced, or
    when it could not be renewed for a whole lease (the cluster out of reach: it may
    have lapsed, and been taken, already): it is dropped from `held`, and `on_lost`
    is told, so that its holder stops acting on it at once."""

    def __init__(self, io: Any, obj: str, label: str) -> None:
        self.io, self.obj, self.label = io, obj, label
        self.held: dict[str, tuple[str, str]] = {}  # lock name -> (cookie, description)
        # lock name -> when the last request that took or renewed it was sent (monotonic):
        # its lease ends no sooner than a lease after that, by the OSD's reckoning.
        self.renewed: dict[str, float] = {}
        self.lost: set[str] = set()
        self.on_lost: Callable[[str, str], None] | None = None  # (lock name, why)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def add(self, name: str, cookie: str, desc: str, *, taken_at: float | None = None) -> None:
        with self._lock:
            self.held[name] = (cookie, desc)
            self.renewed[name] = time.monotonic() if taken_at is None else taken_at
            self.lost.discard(name)
            if not self._threads:
                for target, what in ((self._loop, "leases"), (self._watchdog, "lease-watchdog")):
                    thread = threading.Thread(target=target, name=f"thinblock-{what}", daemon=True)
                    thread.start()
                    self._threads.append(thread)

    def drop(self, name: str) -> None:
        with self._lock:
            self.held.pop(name, None)

    def _lose(self, name: str, cookie: str, why: str) -> None:
        with self._lock:
            if self.held.get(name, (None,))[0] != cookie:
                return  # given up, or lost, meanwhile
            del self.held[name]
            self.lost.add(name)
        log.error("%s: lost the lease %s: %s", self.label, name, why)
        if self.on_lost is not None:
            self.on_lost(name, why)

    def _loop(self) -> None:
        while not self._stop.wait(lease_s() / 3):
            with self._lock:
                held = list(self.held.items())
            for name, (cookie, desc) in held:
                sent = time.monotonic()
                try:
                    self.io.lock_exclusive(self.obj, name, cookie, desc=desc, duration=lease_s(), flags=MUST_RENEW)
                except rados.Error as exc:
                    if self._stop.is_set():
                        return
                    if isinstance(exc, rados.ObjectBusy | rados.ObjectNotFound) or rados_errno(exc) == BLOCKLISTED:
                        fenced = rados_errno(exc) == BLOCKLISTED
                        self._lose(
                            name,
                            cookie,
                            "this Ceph client was fenced off (blocklisted)"
                            if fenced
                            else "another client took it, or broke it, after it lapsed",
                        )
                    else:
                        log.warning("%s: renewing the lease %s failed: %s", self.label, name, exc)
                    continue
                with self._lock:
                    if self.held.get(name, (None,))[0] == cookie:
                        self.renewed[name] = sent

    def _watchdog(self) -> None:
        """A renewal may block for the op timeout while the cluster is out of reach: this
        thread alone says when a lease has run out unrenewed."""
        while not self._stop.wait(min(0.25, lease_s() / 6)):
            now = time.monotonic()
            with self._lock:
                overdue = [
                    (name, cookie) for name, (cookie, _d) in self.held.items() if now - self.renewed[name] >= lease_s()
                ]
            for name, cookie in overdue:
                self._lose(
                    name,
                    cookie,
                    f"it could not be renewed for its whole {lease_s()} s lease (the cluster is out of reach):"
                    " another may hold it now",
                )

    def give_up_all(self, why: str) -> None:
        """Declare every lock held lost (its holder can no longer act on any safely)."""
        with self._lock:
            held = [(name, cookie) for name, (cookie, _d) in self.held.items()]
        for name, cookie in held:
            self._lose(name, cookie, why)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()


class VolumeLeases:
    """The per-volume lease verbs of a RADOS metadata store (one per store object)."""

    def __init__(self, cluster: Cluster, io: Any, obj: str) -> None:
        self.cluster, self.io, self.obj = cluster, io, obj
        self.held: dict[int, tuple[Lease, str]] = {}  # volume id -> (lease, cookie)
        self.renewer = LockRenewer(io, obj, f"metadata {obj}")
        self._step_lock = threading.RLock()  # held for a whole step: one thread's steps nest
        self._step_depth = 0
        # The running step's cookie (a fresh one per step), the one whose end is on its
        # way, and how the last steps ended (cookie -> its lock was lost), for a commit
        # that asserted a step's lock and was refused: it asks how that step ended.
        self._step_state = threading.Condition()
        self._step_cookie: str | None = None
        self._step_ending: str | None = None
        self._steps_ended: dict[str, bool] = {}
        self.lost_step: str | None = None  # why a step's lock was lost: this owner commits nothing more

    # ----- reading --------------------------------------------------------------------

    def lockers(self, name: str) -> tuple[list[cls_lock.Locker], int]:
        return read_lockers(self.io, self.obj, name)

    def locked_by(self, name: str, cookie: str) -> bool:
        """Whether the lock lists this cookie with a lease not yet lapsed."""
        now = time.time()
        lockers, _kind = self.lockers(name)
        return any(lk.cookie == cookie and unlapsed(lk, now) for lk in lockers)

    def live_record(self, volume_id: int, record: dict[str, Any] | None) -> bool:
        """Whether a record's holder still holds the volume's lock (read from RADOS)."""
        if not record or not record.get("owner"):
            return False
        mine = self.held.get(volume_id)
        if mine is not None:
            return mine[1] == record.get("cookie")
        return self.locked_by(volume_lock(volume_id), str(record.get("cookie")))

    # ----- taking and giving up --------------------------------------------------------

    def give_up_all(self, why: str) -> None:
        self.renewer.give_up_all(why)

    def lock(self, volume_id: int, desc: str) -> tuple[str, float]:
        """Take the volume's lock with a new cookie; rados.ObjectBusy if it is held.
        Returns the cookie and when the request was sent (monotonic)."""
        cookie = uuid.uuid4().hex
        sent = time.monotonic()
        self.io.lock_exclusive(self.obj, volume_lock(volume_id), cookie, desc=desc, duration=lease_s())
        return cookie, sent

    def renew(self, volume_id: int, cookie: str, desc: str) -> float:
        """Renew a volume's lock this cookie holds (rados.Error if it does not: a claim
        that stalled past it); returns when the request was sent."""
        sent = time.monotonic()
        self.io.lock_exclusive(
            self.obj, volume_lock(volume_id), cookie, desc=desc, duration=lease_s(), flags=MUST_RENEW
        )
        return sent

    def unlock(self, volume_id: int, cookie: str) -> None:
        self.renewer.drop(volume_lock(volume_id))
        with contextlib.suppress(rados.Error):
            self.io.unlock(self.obj, volume_lock(volume_id), cookie)

    def me(self) -> dict[str, Any]:
        return {"addr": self.cluster.address, "instance": self.cluster.instance_id}

    def fence(self, record: dict[str, Any], why: str) -> None:
        """Blocklist the client a record names, unless it is this process's own."""
        addr = record.get("addr")
        if not addr or addr == self.cluster.address:
            return
        log.warning("metadata %s: fencing %s (Ceph client %s): %s", self.obj, record.get("owner"), addr, why)
        try:
            self.cluster.blocklist(str(addr), BLOCKLIST_S)
        except rados.Error as exc:
            raise as_oserror(exc, "blocklist") from None

    # ----- the pool-level step lock ----------------------------------------------------

    @contextlib.contextmanager
    def pool_step(self) -> Iterator[None]:
        with self._step_lock:
            if self._step_depth == 0:
                cookie = uuid.uuid4().hex
                self._take_step_lock(cookie)
                with self._step_state:
                    self._step_cookie = cookie
            self._step_depth += 1
            try:
                yield
            finally:
                if self._step_depth == 1:
                    self._end_step()
                self._step_depth -= 1

    def _end_step(self) -> None:
        """Let the step's lock go, and note whether it was still this step's: if it was
        not (it lapsed while the step stalled, and may have been taken), what the step
        decided may still be in this owner's open transaction, so nothing more of the
        owner may land (`lost_step`)."""
        cookie = self._step_cookie
        assert cookie is not None
        with self._step_state:
            self._step_ending = cookie
        lost = POOL_STEP_LOCK in self.renewer.lost  # its watchdog gave it up
        self.renewer.drop(POOL_STEP_LOCK)
        try:
            self.io.unlock(self.obj, POOL_STEP_LOCK, cookie)
        except rados.Error:
            lost = True  # not this step's any more (ENOENT), or the cluster did not say: as lost
        with self._step_state:
            self._step_cookie = self._step_ending = None
            self._steps_ended[cookie] = lost
            while len(self._steps_ended) > STEPS_REMEMBERED:
                del self._steps_ended[next(iter(self._steps_ended))]
            if lost and self.lost_step is None:
                self.lost_step = "the pool-level step's lock was lost while it ran (it stalled past its lease)"
            self._step_state.notify_all()

    def step_cookie(self) -> str | None:
        """The running pool-level step's cookie, whichever thread of this store asks: the
        committer's commit meanwhile may carry the step's changes, so it asserts the
        step's lock as the step's own commit does."""
        return self._step_cookie

    def step_listed(self, cookie: str) -> bool:
        """Whether the step lock lists this cookie now."""
        return any(lk.cookie == cookie for lk in self.lockers(POOL_STEP_LOCK)[0])

    def step_ended_cleanly(self, cookie: str) -> bool:
        """For a commit that asserted the step lock with this cookie and found it gone:
        True if that step has ended, its lock still its own until it let it go (the
        commit may go again, asserting the next step's lock or none); False if the step
        runs on without its lock, or lost it (waiting for an end under way)."""
        with self._step_state:
            while self._step_ending == cookie:
                self._step_state.wait()
            if cookie == self._step_cookie:
                return False
            return self._steps_ended.get(cookie) is False

    def _take_step_lock(self, cookie: str) -> None:
        pause = 0.005
        while True:
            sent = time.monotonic()
            try:
                self.io.lock_exclusive(self.obj, POOL_STEP_LOCK, cookie, desc="pool step", duration=lease_s())
            except rados.ObjectBusy:
                time.sleep(pause)
                pause = min(0.1, pause * 2)
                continue
            except rados.Error as exc:
                raise as_oserror(exc, "pool-level lock") from None
            self.renewer.add(POOL_STEP_LOCK, cookie, "pool step", taken_at=sent)
            return

    def close(self) -> None:
        self.renewer.stop()
