"""One connection to a Ceph cluster per process and configuration, and the one
place where librados' errors and quirks are turned into thinblock's terms.

Configuration comes from librados' usual sources: CEPH_CONF (or the default
search path, /etc/ceph/ceph.conf), CEPH_ARGS, and the client id in CEPH_ID
(`thinblock --ceph-conf PATH --ceph-id NAME` sets both). Every operation is
bounded in time (rados_osd_op_timeout, rados_mon_op_timeout): an unreachable
cluster or a stuck OSD gives one sentence, never a hang.

Quirks handled here (docs/ceph.md): the Python binding's WriteOp.zero passes
its two arguments to librados in the wrong order in Pacific, and a zero of length
0 crashes the OSD, so the order is probed once per connection, on first use; writes carry
FULL_TRY, so a full pool or quota answers EDQUOT at once instead of pausing the
write until the op timeout.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

from thinblock.bindings import RADOS_POOLS, require
from thinblock.errors import ThinblockError
from thinblock.steps import timed

log = logging.getLogger("thinblock.ceph")

rados = require("rados", feature=RADOS_POOLS)

OP_TIMEOUT_S = 15
CONNECT_TIMEOUT_S = 10
BLOCKLISTED = errno.ESHUTDOWN  # what every operation of a fenced (blocklisted) client gets


def rados_errno(exc: BaseException) -> int:
    """The positive errno of a librados failure (EIO when it carries none)."""
    code = getattr(exc, "errno", None)
    return abs(int(code)) if isinstance(code, int) and code else errno.EIO


def as_oserror(exc: BaseException, what: str) -> OSError:
    """A librados failure as the OSError the stores' contracts speak (ENOSPC for a
    full cluster or quota, EIO for a fenced client, the errno otherwise)."""
    return errno_error(rados_errno(exc), what)


def errno_error(code: int, what: str) -> OSError:
    """The OSError for a librados errno (see as_oserror)."""
    if code in (errno.EDQUOT, errno.ENOSPC):
        return OSError(errno.ENOSPC, f"{what}: the Ceph pool is full or over its quota")
    if code == BLOCKLISTED:
        return OSError(
            errno.EIO, f"{what}: this client was fenced off (blocklisted); another owner took over what it held"
        )
    if code == errno.ETIMEDOUT:
        return OSError(errno.EIO, f"{what}: the Ceph cluster did not answer within {OP_TIMEOUT_S} s")
    return OSError(code, f"{what}: {os.strerror(code)}")


def _in_a_fresh_thread(work: Callable[[], object]) -> None:
    """Run work in a thread of its own, and raise what it raised. librados draws a
    client's nonce, part of the address a blocklist entry names, from a random
    engine per thread, seeded once: the children a thread forks all copy its state,
    so every worker of one supervisor would draw the same address (measured here:
    the third such client's operations hung, and one fence would reach them all).
    A new thread seeds its own engine."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="thinblock-ceph-connect")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


class Cluster:
    """A connected librados handle, shared by every pool of this process that uses
    the same configuration. A fenced (blocklisted) handle is dead for good: the
    process that held it restarts to serve again."""

    def __init__(self, conffile: str | None, client_id: str | None) -> None:
        self.rados = rados.Rados(rados_id=client_id) if client_id else rados.Rados()
        try:
            self.rados.conf_read_file(conffile)
        except rados.Error as exc:
            if conffile is None and rados_errno(exc) == errno.ENOENT:
                raise ThinblockError(
                    "no Ceph configuration found: set CEPH_CONF or pass --ceph-conf PATH"
                    " (looked for /etc/ceph/ceph.conf, ~/.ceph/config and ./ceph.conf)"
                ) from None
            reason = "no such file" if rados_errno(exc) == errno.ENOENT else "not a valid Ceph configuration"
            raise ThinblockError(f"cannot read the Ceph configuration {conffile}: {reason}") from None
        self.rados.conf_parse_env()
        for key in ("rados_osd_op_timeout", "rados_mon_op_timeout", "client_mount_timeout"):
            self.rados.conf_set(key, str(OP_TIMEOUT_S))
        try:
            with timed(log, "connecting to the Ceph cluster"):
                _in_a_fresh_thread(lambda: self.rados.connect(timeout=CONNECT_TIMEOUT_S))
        except rados.Error as exc:
            self.rados.shutdown()
            code = rados_errno(exc)
            if code in (errno.EACCES, errno.EPERM):
                reason = "the credentials were refused (check the client id and keyring)"
            elif code == errno.ETIMEDOUT:
                reason = f"no monitor answered within {CONNECT_TIMEOUT_S} s"
            else:
                reason = str(exc)
            raise ThinblockError(f"cannot connect to the Ceph cluster: {reason}") from None
        self._ioctxs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.zero_swapped: bool | None = None

    @property
    def address(self) -> str:
        """This client's address, as the blocklist names it."""
        return str(self.rados.get_addrs())

    @property
    def instance_id(self) -> int:
        return int(self.rados.get_instance_id())

    def ioctx(self, pool: str) -> Any:
        """The I/O context of a Ceph pool, or one sentence if it does not exist."""
        with self._lock:
            io = self._ioctxs.get(pool)
            if io is None:
                try:
                    io = self.rados.open_ioctx(pool)
                except rados.ObjectNotFound:
                    raise ThinblockError(f"there is no Ceph pool {pool!r} in the cluster") from None
                except rados.Error as exc:
                    raise ThinblockError(
                        f"cannot open the Ceph pool {pool!r}: {as_oserror(exc, 'open').strerror}"
                    ) from None
                io.set_osdmap_full_try()
                self._ioctxs[pool] = io
            return io

    def mon_command(self, command: dict[str, Any]) -> Any:
        """A monitor command; its JSON answer, or ThinblockError with the monitor's words."""
        ret, out, err = self.rados.mon_command(json.dumps(command), b"", timeout=OP_TIMEOUT_S)
        if ret != 0:
            raise ThinblockError(f"Ceph refused {command['prefix']!r}: {err or os.strerror(-ret)}")
        return json.loads(out) if out else None

    def blocklist(self, address: str, expire_s: int, *, on_step: Callable[[str], None] | None = None) -> None:
        """Fence a client off: from the next OSD map on, everything it sends fails.
        on_step is told as each of the two parts ends (they can take seconds each)."""
        self.mon_command({"prefix": "osd blocklist", "blocklistop": "add", "addr": address, "expire": float(expire_s)})
        if on_step:
            on_step(f"the monitors blocklisted {address}")
        self.rados.wait_for_latest_osdmap()
        if on_step:
            on_step("got the OSD map with the blocklist")


def _probe_zero_order(io: Any) -> bool:
    """Whether WriteOp.zero(offset, length) reaches librados as (length, offset)."""
    name = f"thinblock.probe.{uuid.uuid4().hex}"
    io.write_full(name, b"AAAAAAAA")
    try:
        with rados.WriteOpCtx() as op:
            op.zero(2, 4)  # both nonzero: either order is a valid request
            io.operate_write_op(op, name)
        got = io.read(name, 8, 0)
    finally:
        io.remove_object(name)
    return bool(got == b"AAAA\0\0AA")


def probe_zero_order(cluster: Cluster, io: Any) -> None:
    """Learn the binding's WriteOp.zero argument order once, in io's pool (a full pool
    refuses the probe's write: an OSError, and the caller's zero waits for later)."""
    if cluster.zero_swapped is None:
        try:
            cluster.zero_swapped = _probe_zero_order(io)
        except rados.Error as exc:
            raise as_oserror(exc, "probing WriteOp.zero") from None


def write_op_zero(cluster: Cluster, op: Any, offset: int, length: int) -> None:
    """Add a zero of [offset, offset+length) to a WriteOp, whatever the binding's order
    (probe_zero_order must have run)."""
    if length <= 0 or offset < 0 or cluster.zero_swapped is None:
        raise ValueError(f"zero of {length} bytes at {offset}")  # a zero of length 0 crashes a Pacific OSD
    if cluster.zero_swapped:
        op.zero(length, offset)
    else:
        op.zero(offset, length)


_CLUSTERS: dict[tuple[str | None, str | None, int], Cluster] = {}
_CLUSTERS_LOCK = threading.Lock()


def _fresh_lock_in_child() -> None:
    # A thread of the parent may have held the lock at the fork (serve's supervisor
    # forks its workers while others read the store): the child's copy would stay held.
    global _CLUSTERS_LOCK
    _CLUSTERS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def connect(conffile: str | None = None, client_id: str | None = None) -> Cluster:
    """The process's connection for this configuration (made on first use)."""
    conffile = conffile or os.environ.get("CEPH_CONF") or None
    client_id = client_id or os.environ.get("CEPH_ID") or None
    # A forked child (a worker of serve --workers) makes its own: librados' threads
    # do not survive a fork, and a client of its own is what fencing one worker needs.
    key = (conffile, client_id, os.getpid())
    with _CLUSTERS_LOCK:
        cluster = _CLUSTERS.get(key)
        if cluster is None:
            cluster = _CLUSTERS[key] = Cluster(conffile, client_id)
        return cluster


def disconnect_all() -> None:
    """Shut down every connection this process made, once its command is done: a
    librados handle still connected when the process exits may abort it ("terminate
    called without an active exception", seen once at the end of a `pool repair`),
    as its threads are torn down by exit rather than joined."""
    with _CLUSTERS_LOCK:
        clusters = [c for key, c in _CLUSTERS.items() if key[2] == os.getpid()]  # a parent's are not ours to shut
        _CLUSTERS.clear()
    for cluster in clusters:
        try:
            for io in cluster._ioctxs.values():
                io.close()
            cluster.rados.shutdown()
        except Exception as exc:  # at the very end: a sentence in the log, never a traceback
            log.warning("closing the Ceph connection failed: %s", exc)
