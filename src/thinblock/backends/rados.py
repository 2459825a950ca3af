"""Pools in a Ceph cluster (`rados:CEPHPOOL/NAME`): metadata in the omap of the
object `thinblock.NAME`, data in objects `thinblock_data.ID.OBJNO`, served by
one process at a time, taken over by another with fencing.

Ownership follows RBD's exclusive-lock model:
- The holder takes the exclusive lock `thinblock` on the metadata object with a
  lease of lease_s() seconds, renewed every third of that, and records who it is
  (host, pid, purpose, its Ceph client address and instance) in `x.owner`.
- A second opener is refused while the lock is held, and told who holds it.
- Once the lease has lapsed (a dead or stalled holder), or with `takeover`, the
  new holder breaks the lock, blocklists the old holder's client address (a
  lapsed lease alone does not stop a holder that resumes), waits for the new
  OSD map, and bumps `x.epoch`. Every metadata commit compares the epoch, so the
  old holder can commit nothing, and the blocklist fails all its data writes.
- A holder that lets go cleanly removes `x.owner`, so the next one fences no one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from thinblock.backends.base import Location, Ownership
from thinblock.bindings import RADOS_POOLS, require
from thinblock.ceph import cls_lock
from thinblock.ceph.cluster import BLOCKLISTED, Cluster, as_oserror, connect, rados_errno
from thinblock.errors import PoolBusyError, ThinblockError
from thinblock.meta.base import Transaction
from thinblock.meta.rados import EPOCH_KEY, OWNER_KEY, RadosMetadata, epoch_value
from thinblock.meta.rados_leases import BLOCKLIST_S, MUST_RENEW, lease_s, parse_record, read_lockers, unlapsed
from thinblock.runtime import private_runtime_dir, runtime_base
from thinblock.sizes import format_size
from thinblock.stats import LEASE_EVENTS
from thinblock.steps import Step, timed
from thinblock.store.base import DataStore
from thinblock.store.hostspace import HostSpace, NoHostSpace
from thinblock.store.owned import RADOS_TAIL_OFFSET, OwnedStore
from thinblock.store.rados import DEFAULT_OBJECT_SIZE, RadosStore

rados = require("rados", feature=RADOS_POOLS)

log = logging.getLogger("thinblock.rados")

LOCK_NAME = "thinblock"


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,99}$")
SHARED_TAG = "per-volume"  # the tag of the shared lock that servers per volume hold


class _Lease(Ownership):
    """The exclusive lock, renewed by a thread until release, or until renewing fails
    because this process was taken over or fenced (it logs why)."""

    def __init__(self, location: RadosLocation, io: Any, cookie: str, desc: str, epoch: int) -> None:
        self.location = location
        self.io = io
        self.cookie = cookie
        self.desc = desc
        self.epoch = epoch
        self.on_lost: Callable[[str], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="thinblock-lease", daemon=True)
        self._thread.start()

    def watch_lost(self, lost: Callable[[str], None]) -> None:
        self.on_lost = lost

    def _renew_loop(self) -> None:
        while not self._stop.wait(lease_s() / 3):
            began = time.monotonic()
            try:
                self.io.lock_exclusive(
                    self.location.meta_object, LOCK_NAME, self.cookie, desc=self.desc, duration=lease_s(), flags=1
                )
            except rados.Error as exc:
                if self._stop.is_set():
                    return
                lost = isinstance(exc, rados.ObjectBusy) or rados_errno(exc) == BLOCKLISTED
                LEASE_EVENTS.add(self.location.name, "lost" if lost else "renew_failed")
                log.error(
                    "pool %s: renewing the lease failed after %.3f s: %s; commits will be refused if another host"
                    " took over",
                    self.location.name,
                    time.monotonic() - began,
                    as_oserror(exc, "lock").strerror,
                    extra={"step": "lease renewal", "elapsed_s": round(time.monotonic() - began, 6)},
                )
                if lost:
                    if self.on_lost is not None:
                        fenced = rados_errno(exc) == BLOCKLISTED
                        self.on_lost(
                            "this Ceph client was fenced off (blocklisted)" if fenced else "another took it over"
                        )
                    return  # taken over, or fenced: nothing more to renew
                continue
            took = time.monotonic() - began
            # A renewal slower than a third of the lease eats into the margin before
            # another host may take over: worth a warning, the rest only at debug.
            log.log(
                logging.WARNING if took > lease_s() / 3 else logging.DEBUG,
                "pool %s: renewed the %d s lease in %.3f s",
                self.location.name,
                lease_s(),
                took,
                extra={"step": "lease renewal", "elapsed_s": round(took, 6)},
            )

    def forget(self) -> None:
        """The metadata object is about to go (pool remove): renew no more (a renewal
        would make the object again), and release nothing later."""
        self._stop.set()
        self._thread.join()
        self.location.held_epoch = None

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        LEASE_EVENTS.add(self.location.name, "released")
        self.location.held_epoch = None
        with contextlib.suppress(rados.Error):
            with rados.WriteOpCtx() as op:
                op.omap_cmp(EPOCH_KEY, epoch_value(self.epoch), rados.LIBRADOS_CMPXATTR_OP_EQ)
                self.io.remove_omap_keys(op, (OWNER_KEY,))
                self.io.operate_write_op(op, self.location.meta_object)
            self.io.unlock(self.location.meta_object, LOCK_NAME, self.cookie)


class _SharedLease(Ownership):
    """The shared lock of a server per volume, renewed by a thread until release."""

    def __init__(self, location: RadosLocation, io: Any, cookie: str, desc: str) -> None:
        self.location, self.io, self.cookie, self.desc = location, io, cookie, desc
        self.on_lost: Callable[[str], None] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="thinblock-shared-lease", daemon=True)
        self._thread.start()

    def watch_lost(self, lost: Callable[[str], None]) -> None:
        self.on_lost = lost

    def _renew_loop(self) -> None:
        while not self._stop.wait(lease_s() / 3):
            try:
                self.io.lock_shared(
                    self.location.meta_object,
                    LOCK_NAME,
                    self.cookie,
                    SHARED_TAG,
                    desc=self.desc,
                    duration=lease_s(),
                    flags=MUST_RENEW,
                )
            except rados.Error as exc:
                if self._stop.is_set():
                    return
                log.error("pool %s: renewing the shared lease failed: %s", self.location.name, exc)
                if isinstance(exc, rados.ObjectBusy | rados.ObjectNotFound) or rados_errno(exc) == BLOCKLISTED:
                    # Lapsed and broken by a process that took the pool whole (and bumped
                    # its epoch), or this client fenced: its commits are refused from now on.
                    if self.on_lost is not None:
                        self.on_lost("the pool was taken whole by another server, or this client fenced off")
                    return

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self.location.shared_epoch = None
        with contextlib.suppress(rados.Error):
            self.io.unlock(self.location.meta_object, LOCK_NAME, self.cookie)


class RadosSpace(NoHostSpace):
    """The layer below a RADOS pool: no host disk, no slack file; the Ceph pool's
    own figures for `pool status`."""

    def __init__(self, location: RadosLocation) -> None:
        super().__init__()
        self.location = location

    def below_status(self) -> dict[str, Any]:
        """Each figure on its own: one the cluster cannot give now (a mgr not yet
        reporting, a monitor command refused) is None, with the reason in ceph_error."""
        cluster = self.location.cluster()
        pool = self.location.ceph_pool
        # RADOS cannot reserve space: provisioned blocks are set aside in the pool only.
        out: dict[str, Any] = {"ceph_pool": pool, "below_reserves_space": False}
        errors: list[str] = []

        def pool_stats() -> dict[str, Any]:
            stats = cluster.ioctx(pool).get_stats()
            return {"ceph_pool_stored_bytes": int(stats["num_bytes"]), "ceph_pool_objects": int(stats["num_objects"])}

        def quota() -> dict[str, Any]:
            got = cluster.mon_command({"prefix": "osd pool get-quota", "pool": pool, "format": "json"})
            return {
                "ceph_pool_quota_bytes": int(got.get("quota_max_bytes") or 0) or None,
                "ceph_pool_quota_objects": int(got.get("quota_max_objects") or 0) or None,
            }

        def cluster_stats() -> dict[str, Any]:
            cs = cluster.rados.get_cluster_stats()
            return {"ceph_cluster_bytes": int(cs["kb"]) * 1024, "ceph_cluster_avail_bytes": int(cs["kb_avail"]) * 1024}

        for figures, keys in (
            (pool_stats, ("ceph_pool_stored_bytes", "ceph_pool_objects")),
            (quota, ("ceph_pool_quota_bytes", "ceph_pool_quota_objects")),
            (cluster_stats, ("ceph_cluster_bytes", "ceph_cluster_avail_bytes")),
        ):
            try:
                out.update(figures())
            except (rados.Error, ThinblockError, KeyError, ValueError) as exc:
                out.update(dict.fromkeys(keys))
                errors.append(str(exc))
        out["ceph_error"] = "; ".join(errors) or None
        return out

    def capacity_warning(self, size_bytes: int, data_path: str) -> str | None:
        """A sentence when the Ceph pool cannot take a pool of size_bytes: room is its
        max_avail (what `ceph df` shows: replication and the full ratio counted),
        bounded by what its quota leaves. No figures (no mgr yet): no warning."""
        cluster = self.location.cluster()
        pool = self.location.ceph_pool
        try:
            df = cluster.mon_command({"prefix": "df", "format": "json"})
            stats = next(p["stats"] for p in df["pools"] if p["name"] == pool)
            room, why = int(stats["max_avail"]), "the cluster has room for"
            quota = int(
                cluster.mon_command({"prefix": "osd pool get-quota", "pool": pool, "format": "json"}).get(
                    "quota_max_bytes"
                )
                or 0
            )
        except (rados.Error, ThinblockError, KeyError, ValueError, TypeError, StopIteration) as exc:
            log.debug("no capacity figures for Ceph pool %s: %s", pool, exc)
            return None
        if quota and quota - int(stats["stored"]) < room:
            room, why = max(0, quota - int(stats["stored"])), "its quota leaves room for"
        if size_bytes <= room:
            return None
        return (
            f"pool {self.location.name} ({format_size(size_bytes)}) is larger than Ceph pool {pool} can hold"
            f" ({why} {format_size(room)} more): writes will fail with ENOSPC before the pool is full"
        )


class RadosLocation(Location):
    """`rados:CEPHPOOL/NAME`. The cluster is whatever CEPH_CONF / CEPH_ID name."""

    takes_object_size = True
    fences_per_process = True
    can_fence = True
    remote_owners = True

    def __init__(self, rest: str) -> None:
        self.name = f"rados:{rest}"
        ceph_pool, sep, pool_name = rest.partition("/")
        if not sep or not ceph_pool or not _NAME.match(pool_name):
            raise ThinblockError(
                f"invalid locator {self.name!r}: expected rados:CEPHPOOL/NAME, NAME of letters, digits and ._+-"
            )
        self.ceph_pool = ceph_pool
        self.pool_name = pool_name
        self.meta_object = f"thinblock.{pool_name}"
        self.held_epoch: int | None = None
        self.shared_epoch: int | None = None  # the pool epoch while served per volume (own_shared)
        self._cluster: Cluster | None = None
        self._cluster_pid = 0

    def cluster(self) -> Cluster:
        if self._cluster is None or self._cluster_pid != os.getpid():  # a forked worker connects anew
            self._cluster, self._cluster_pid = connect(), os.getpid()
        return self._cluster

    def _io(self) -> Any:
        return self.cluster().ioctx(self.ceph_pool)

    def key(self) -> str:
        return self.name

    def runtime_dir(self) -> str:
        return private_runtime_dir("rados", self.ceph_pool, self.pool_name)  # its sockets are the owner's alone

    def runtime_path(self) -> str:
        return os.path.join(runtime_base(), "rados", self.ceph_pool, self.pool_name)

    shorter_runtime_path = "set THINBLOCK_RUNTIME_DIR to a shorter directory, or give the pool a shorter name"

    def exists(self) -> bool:
        try:
            self._io().stat(self.meta_object)
        except rados.ObjectNotFound:
            return False
        except rados.Error as exc:
            raise ThinblockError(f"cannot reach pool {self.name}: {as_oserror(exc, 'RADOS').strerror}") from None
        return True

    def create(self, superblock: dict[str, Any], size_bytes: int, device: str | None) -> None:
        if device is not None:
            raise ThinblockError("a pool in Ceph keeps its data in RADOS objects: --data does not apply")
        object_size = int(superblock.get("object_size") or DEFAULT_OBJECT_SIZE)
        block_size = int(superblock["block_size"])
        if size_bytes > RADOS_TAIL_OFFSET:
            raise ThinblockError(f"a pool in Ceph holds at most {format_size(RADOS_TAIL_OFFSET)}")
        if object_size < block_size or object_size & (object_size - 1) or object_size > (64 << 20):
            raise ThinblockError(
                f"invalid object size {format_size(object_size)}: a power of two from the block size"
                f" ({format_size(block_size)}) to 64M"
            )
        superblock = {**superblock, "object_size": object_size, "rados_id": uuid.uuid4().hex[:16]}
        RadosMetadata.create(self.cluster(), self.ceph_pool, self.meta_object, superblock)

    def remove_created(self) -> None:
        with contextlib.suppress(rados.Error):
            self._io().remove_object(self.meta_object)

    def open_meta(self, *, readonly: bool) -> RadosMetadata:
        if not self.exists():
            raise ThinblockError(f"no pool at {self.name}: Ceph pool {self.ceph_pool} has no object {self.meta_object}")
        meta = RadosMetadata(
            self.cluster(),
            self.ceph_pool,
            self.meta_object,
            epoch=lambda: self.held_epoch,
            shared_epoch=lambda: self.shared_epoch,
            readonly=readonly,
        )
        if readonly and meta.journal_pending():
            raise ThinblockError(
                f"pool {self.name} has a large commit recorded but not yet applied:"
                " open it for writing once (any pool command) to finish it"
            )
        return meta

    @staticmethod
    def data_prefix(superblock: dict[str, Any]) -> str:
        """The data objects are PREFIX.OBJNO."""
        return f"thinblock_data.{superblock['rados_id']}"

    def data_name(self, superblock: dict[str, Any]) -> str:
        return f"Ceph pool {self.ceph_pool}, objects {self.data_prefix(superblock)}.*"

    def open_data(self, superblock: dict[str, Any], *, readonly: bool = False) -> DataStore:
        return RadosStore(
            self.cluster(),
            self.ceph_pool,
            self.data_prefix(superblock),
            int(superblock["size_bytes"]),
            object_size=int(superblock.get("object_size") or DEFAULT_OBJECT_SIZE),
            readonly=readonly,
        )

    def owned_store(self, superblock: dict[str, Any], store: DataStore) -> OwnedStore:
        # The header and birth table: objects of the same prefix far above the data.
        tail = self.open_data({**superblock, "size_bytes": RADOS_TAIL_OFFSET * 2})
        return OwnedStore(store, int(superblock["block_size"]), tail=tail, fixed_header_offset=RADOS_TAIL_OFFSET)

    def data_owner(self) -> str:
        return self.name

    # ----- ownership ---------------------------------------------------------------

    def _holder(self, io: Any) -> tuple[dict[str, Any] | None, int]:
        """The recorded holder (None if the last one let go) and the epoch, in one read."""
        with rados.ReadOpCtx() as op:
            it, _ = io.get_omap_vals_by_keys(op, (OWNER_KEY, EPOCH_KEY))
            io.operate_read_op(op, self.meta_object)
            got = dict(it)
        return (json.loads(got[OWNER_KEY]) if OWNER_KEY in got else None), int(got.get(EPOCH_KEY, b"0"))

    def own(self, purpose: str, *, takeover: bool = False) -> Ownership:
        cluster = self.cluster()
        io = self._io()
        cookie = uuid.uuid4().hex
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "purpose": purpose or "a thinblock command",
            "addr": cluster.address,
            "instance": cluster.instance_id,
            "cookie": cookie,
            "since": time.time(),
        }
        desc = json.dumps({k: me[k] for k in ("host", "pid", "purpose")})
        with timed(log, f"pool {self.name}: taking ownership{' (--takeover)' if takeover else ''}") as step:
            try:
                try:
                    io.lock_exclusive(self.meta_object, LOCK_NAME, cookie, desc=desc, duration=lease_s())
                    step.mark("took the lock")
                except rados.ObjectBusy:
                    if self.served_per_volume():
                        raise PoolBusyError(
                            f"pool {self.name} is served per volume by other processes (thinblock serve --volume);"
                            " commands reach its volumes through them, or stop them first"
                        ) from None
                    holder, _epoch = self._holder(io)
                    step.mark(
                        "the lock is held by %s", self._who(holder) if holder else "a client that recorded no owner"
                    )
                    if not takeover:
                        raise PoolBusyError(self._busy(holder)) from None
                    if holder is None:
                        raise PoolBusyError(
                            f"pool {self.name} is locked by a client that recorded no owner: break it with"
                            f" 'rados -p {self.ceph_pool} lock break {self.meta_object} {LOCK_NAME} ...'"
                        ) from None
                    io.execute(
                        self.meta_object,
                        "lock",
                        "break_lock",
                        cls_lock.break_lock_args(LOCK_NAME, holder["instance"], holder["cookie"]),
                    )
                    LEASE_EVENTS.add(self.name, "lock_broken")
                    step.mark("broke the lock of %s", self._who(holder), level=logging.WARNING)
                    io.lock_exclusive(self.meta_object, LOCK_NAME, cookie, desc=desc, duration=lease_s())
                    step.mark("took the lock")
                try:
                    epoch = self._fence_and_bump(cluster, io, me, step)
                except BaseException:
                    with contextlib.suppress(rados.Error):
                        io.unlock(self.meta_object, LOCK_NAME, cookie)
                    raise
            except rados.ObjectBusy:
                raise PoolBusyError(f"pool {self.name} was taken by another client at the same moment") from None
            except rados.Error as exc:
                raise ThinblockError(f"cannot take pool {self.name}: {as_oserror(exc, 'RADOS').strerror}") from None
            self.held_epoch = epoch
            LEASE_EVENTS.add(self.name, "acquired")
            lease = _Lease(self, io, cookie, desc, epoch)
            try:
                RadosMetadata(cluster, self.ceph_pool, self.meta_object, epoch=lambda: epoch).finish_journal()
            except BaseException:
                lease.release()
                raise
            step.mark("metadata journal finished")
        return lease

    def own_shared(self, purpose: str) -> Ownership:
        """The shared lock `thinblock` (tag per-volume), renewed like the exclusive one:
        refused while a process holds the pool whole, and keeps any from taking it
        whole meanwhile. A holder of the whole pool that never let go (its lease
        lapsed) is fenced first, and the epoch bumped, as a takeover does."""
        cluster = self.cluster()
        io = self._io()
        cookie = uuid.uuid4().hex
        desc = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "purpose": purpose or "a thinblock command"}
        )
        with timed(log, f"pool {self.name}: sharing it per volume") as step:
            try:
                try:
                    io.lock_shared(self.meta_object, LOCK_NAME, cookie, SHARED_TAG, desc=desc, duration=lease_s())
                except rados.ObjectBusy:
                    holder, _epoch = self._holder(io)
                    raise PoolBusyError(
                        f"pool {self.name} is held whole by"
                        f" {self._who(holder) if holder else 'a client that recorded no owner'}: it owns the whole pool"
                    ) from None
                step.mark("took the shared lock")
                while True:
                    holder, epoch = self._holder(io)
                    if holder is None:
                        break
                    if holder.get("addr") != cluster.address:
                        LEASE_EVENTS.add(self.name, "fenced_holder")
                        step.mark("fencing its previous holder %s", self._who(holder), level=logging.WARNING)
                        cluster.blocklist(str(holder["addr"]), BLOCKLIST_S, on_step=step.mark)
                    try:
                        with rados.WriteOpCtx() as op:
                            op.omap_cmp(EPOCH_KEY, epoch_value(epoch), rados.LIBRADOS_CMPXATTR_OP_EQ)
                            io.set_omap(op, (EPOCH_KEY,), (epoch_value(epoch + 1).encode(),))
                            io.remove_omap_keys(op, (OWNER_KEY,))
                            io.operate_write_op(op, self.meta_object)
                    except rados.Error as exc:
                        if rados_errno(exc) != errno.ECANCELED:
                            raise
                        continue  # another sharer bumped it first
                    step.mark("took epoch %d", epoch + 1)
                    epoch += 1
                    break
                RadosMetadata(cluster, self.ceph_pool, self.meta_object, epoch=lambda: epoch).finish_journal()
            except rados.Error as exc:
                with contextlib.suppress(rados.Error):
                    io.unlock(self.meta_object, LOCK_NAME, cookie)
                raise ThinblockError(f"cannot share pool {self.name}: {as_oserror(exc, 'RADOS').strerror}") from None
            except BaseException:
                with contextlib.suppress(rados.Error):
                    io.unlock(self.meta_object, LOCK_NAME, cookie)
                raise
        self.shared_epoch = epoch
        return _SharedLease(self, io, cookie, desc)

    def served_per_volume(self) -> bool:
        try:
            lockers, kind = read_lockers(self._io(), self.meta_object, LOCK_NAME)
        except (OSError, ThinblockError):
            return False
        now = time.time()
        return kind == cls_lock.SHARED and any(unlapsed(lk, now) for lk in lockers)

    def _fence_and_bump(self, cluster: Cluster, io: Any, me: dict[str, Any], step: Step) -> int:
        """We hold the lock: fence the previous holder if it never let go, then take
        the next epoch (one guarded op, so a racing taker cannot get the same one)."""
        previous, old = self._holder(io)
        if previous is not None and previous.get("addr") != me["addr"]:
            LEASE_EVENTS.add(self.name, "fenced_holder")
            step.mark("fencing its previous holder %s", self._who(previous), level=logging.WARNING)
            cluster.blocklist(str(previous["addr"]), BLOCKLIST_S, on_step=step.mark)
        else:
            step.mark("its previous holder let go: nothing to fence")
        # Owners per volume the pool had (their shared locks lapsed, or this would not
        # hold it): one that never let go may only be stalled, and would write into
        # the blocks of a volume this holder now serves.
        meta = RadosMetadata(cluster, self.ceph_pool, self.meta_object, epoch=lambda: None)
        records = [rec for _k, v in meta.items("o.") if (rec := parse_record(v)) is not None]
        fenced: set[str] = set()
        for rec in records:
            addr = rec.get("addr") if rec and rec.get("owner") else None
            if addr and addr != me["addr"] and addr not in fenced:
                LEASE_EVENTS.add(self.name, "fenced_holder")
                step.mark("fencing %s, which held a volume and never let go", rec.get("owner"), level=logging.WARNING)
                cluster.blocklist(str(addr), BLOCKLIST_S, on_step=step.mark)
                fenced.add(str(addr))
        with rados.WriteOpCtx() as op:
            op.omap_cmp(EPOCH_KEY, epoch_value(old), rados.LIBRADOS_CMPXATTR_OP_EQ)
            io.set_omap(op, (EPOCH_KEY, OWNER_KEY), (epoch_value(old + 1).encode(), json.dumps(me).encode()))
            io.operate_write_op(op, self.meta_object)
        step.mark("took epoch %d", old + 1)
        return old + 1

    @staticmethod
    def _who(holder: dict[str, Any]) -> str:
        return f"{holder.get('purpose')} on host {holder.get('host')} (pid {holder.get('pid')}, Ceph client {holder.get('addr')})"

    def _busy(self, holder: dict[str, Any] | None) -> str:
        who = self._who(holder) if holder else "a client that recorded no owner"
        return (
            f"pool {self.name} is already held by {who}; its {lease_s()} s lease is renewed while it lives."
            " Wait for the lease to lapse after it stops, or pass --takeover to fence it off and take over"
        )

    def is_owned(self) -> bool:
        io = self._io()
        probe = uuid.uuid4().hex
        try:
            io.lock_exclusive(self.meta_object, LOCK_NAME, probe, desc="probe", duration=1)
        except rados.ObjectBusy:
            return True
        except rados.Error:
            return False
        with contextlib.suppress(rados.Error):
            io.unlock(self.meta_object, LOCK_NAME, probe)
        return False

    # ----- the layer below, restore and repair -------------------------------------

    def host(self, superblock: dict[str, Any]) -> HostSpace:
        return RadosSpace(self)

    def replace_meta(self, superblock: dict[str, Any], txn: Transaction, *, keep: str | None = None) -> str | None:
        """The replacement itself is one journalled write (RadosMetadata.replace); keep
        copies the object's omap to thinblock.NAME.KEEP first."""
        kept = self._copy_meta(f"{self.meta_object}.{keep}", fresh=True) if keep else None
        self.open_meta(readonly=False).replace(superblock, txn)
        return kept

    # ----- removal ------------------------------------------------------------------

    def _pool_objects(self, superblock: dict[str, Any]) -> list[str]:
        """The pool's objects besides its metadata object: its data objects (their prefix
        holds the pool's random rados_id), a large commit's journal left behind, and the
        metadata copies restore and repair kept. A `thinblock.NAME.*` object is one of
        those only if it says so (a journal piece has no omap; a copy carries this
        pool's rados_id), never merely by its name: another pool may be called NAME.x."""
        io = self._io()
        data = self.data_prefix(superblock) + "."
        mine = f"{self.meta_object}."
        found, maybe = [], []
        for obj in io.list_objects():
            if obj.key.startswith(data):
                found.append(obj.key)
            elif obj.key.startswith(mine):
                maybe.append(obj.key)
        want = json.dumps(superblock["rados_id"]).encode()
        for name in maybe:
            with rados.ReadOpCtx() as op:
                it, _ = io.get_omap_vals_by_keys(op, ("s.rados_id", "s.format_version"))
                try:
                    io.operate_read_op(op, name)
                except rados.ObjectNotFound:
                    continue
                got = dict(it)
            journal = re.fullmatch(re.escape(mine) + r"journal\.\d+\.\d+", name) is not None and not got
            if journal or got.get("s.rados_id") == want:
                found.append(name)
        return sorted(found)

    def removal(self, superblock: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        objects = self._pool_objects(superblock)
        data = [o for o in objects if o.startswith(self.data_prefix(superblock) + ".")]
        items: list[dict[str, Any]] = []
        if data:
            items.append({"kind": "objects", "name": f"{self.data_prefix(superblock)}.* ({len(data)})", "bytes": None})
        items += [{"kind": "object", "name": o, "bytes": None} for o in objects if o not in data]
        items.append({"kind": "object", "name": self.meta_object, "bytes": None})
        return [{**i, "name": f"Ceph pool {self.ceph_pool}: {i['name']}"} for i in items], []

    def remove_pool(self, superblock: dict[str, Any], ownership: Ownership) -> None:
        io = self._io()
        objects = self._pool_objects(superblock)
        for start in range(0, len(objects), 256):
            pending = [io.aio_remove(name) for name in objects[start : start + 256]]
            for completion in pending:
                completion.wait_for_complete()
                code = completion.get_return_value()
                if code < 0 and -code != errno.ENOENT:
                    raise ThinblockError(
                        f"cannot remove pool {self.name}: removing its objects failed ({os.strerror(-code)});"
                        " run 'pool remove' again to finish"
                    )
        assert isinstance(ownership, _Lease)
        ownership.forget()
        try:
            # Last, and only while the epoch is still ours: a process that took the pool
            # over meanwhile keeps it (and is told by its next commit that data is gone).
            with rados.WriteOpCtx() as op:
                op.omap_cmp(EPOCH_KEY, epoch_value(ownership.epoch), rados.LIBRADOS_CMPXATTR_OP_EQ)
                op.remove()
                io.operate_write_op(op, self.meta_object)
        except rados.Error as exc:
            raise ThinblockError(
                f"cannot remove pool {self.name}'s metadata object {self.meta_object}:"
                f" {as_oserror(exc, 'RADOS').strerror}"
            ) from None

    def keep_copy(self) -> str:
        """Copy the metadata object's omap to thinblock.NAME.bad.TIME."""
        return self._copy_meta(f"{self.meta_object}.bad.{int(time.time())}")

    def _copy_meta(self, dest: str, *, fresh: bool = False) -> str:
        """Copy the metadata object's omap to dest (fresh: an earlier dest is removed first)."""
        io = self._io()
        if fresh:
            with contextlib.suppress(rados.ObjectNotFound):
                io.remove_object(dest)
        meta = RadosMetadata(self.cluster(), self.ceph_pool, self.meta_object, epoch=lambda: None)
        batch: dict[str, bytes] = {}

        def flush() -> None:
            with rados.WriteOpCtx() as op:
                io.set_omap(op, tuple(batch), tuple(batch.values()))
                io.operate_write_op(op, dest)
            batch.clear()

        for key, value in meta.items(""):
            batch[key] = value
            if len(batch) >= 1000:
                flush()
        if batch:
            flush()
        return f"Ceph object {dest} in pool {self.ceph_pool}"
