"""Requests to the owner of a volume on another host, over RADOS watch/notify (as
rbd's exclusive-lock owner takes requests on its image's header object).

A server per volume on a Ceph pool watches one object per volume it owns,
`thinblock_data.<rados_id>.watch.<volume id>` (under the pool's data prefix, so
`pool remove` takes it with the data). A command on any host that wants that
volume changed (a snapshot, a resize, a rollback, a handover) notifies it with
the request; the owner runs it as it runs one from its control socket
(admin/control.py) and writes the answer to a reply object the asker named,
before it acknowledges. The Python binding's notify returns no payload, hence
the reply object. A notify that times out, or that no watcher acknowledged
(nobody watches: its owner is gone), is "no answer" (control.NoAnswer, as from
a control socket that does not answer).

The asker makes the reply object before it notifies (with the key ASKED) and
removes it once it has read it or given up; the owner's answer is one WriteOp
that lands only while that key is there. So an answer later than the asker's
patience finds no object and creates none: nothing is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import threading
import uuid
from typing import TYPE_CHECKING, Any

from thinblock.admin.control import NoAnswer
from thinblock.bindings import RADOS_POOLS, require
from thinblock.ceph.cluster import as_oserror
from thinblock.errors import ThinblockError

if TYPE_CHECKING:
    from thinblock.admin.control import ControlServer
    from thinblock.backends.rados import RadosLocation
    from thinblock.core.pool import Pool

rados = require("rados", feature=RADOS_POOLS)

log = logging.getLogger("thinblock.control")

SYNC_S = 1.0  # how often the watches follow the volumes this process owns
MAX_REQUEST = 1 << 16
JOB_TIMEOUT_S = 3600.0  # a sparsify by notify: no progress lines come, so the asker waits this long
ASKED = "asked"  # the reply object's key while its asker waits


def _keep_forever(watch: Any) -> None:
    """A watch whose close failed (a fenced client gets ESHUTDOWN, an unreachable
    cluster a timeout), or that is left to lapse: the binding's Watch unwatches again
    when it is freed, and a second unwatch of one watch corrupts librados' heap (seen
    here: "malloc(): unsorted double linked list corrupted", SIGABRT). So it is
    never freed: one reference more than Python will ever drop."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(watch))


def watch_object(location: RadosLocation, superblock: dict[str, Any], volume_id: int) -> str:
    return f"{location.data_prefix(superblock)}.watch.{volume_id}"


def notify_seconds(timeout_s: float) -> float:
    return float(max(1, math.ceil(timeout_s)))


def answer_if_asked(io: Any, reply: str, answer: bytes) -> str | None:
    """Write the answer to the reply object while its asker still waits there (its key
    ASKED is set); otherwise why it was not written (when the asker gave up, the
    object is gone, and stays gone)."""
    try:
        with rados.WriteOpCtx() as op:
            op.omap_cmp(ASKED, "1", rados.LIBRADOS_CMPXATTR_OP_EQ)
            op.write_full(answer)
            io.operate_write_op(op, reply)
    except rados.ObjectNotFound:
        return "its asker gave up waiting"
    except rados.Error as exc:
        return f"the answer could not be written ({as_oserror(exc, 'write').strerror})"
    return None


class NotifyClient:
    """A ControlClient's `call`, to the owner of one volume through watch/notify."""

    def __init__(self, location: RadosLocation, superblock: dict[str, Any], volume_id: int, timeout_s: float) -> None:
        self.location = location
        self.io = location.cluster().ioctx(location.ceph_pool)
        self.obj = watch_object(location, superblock, volume_id)
        self.reply_prefix = f"{location.data_prefix(superblock)}.reply."
        # The OSD counts a notify's timeout in whole seconds, truncated, and takes 0
        # for its default (30 s, measured here): so whole seconds, at least one.
        self.timeout_s = notify_seconds(timeout_s)

    def call(self, verb: str, **args: Any) -> Any:
        reply = f"{self.reply_prefix}{uuid.uuid4().hex}"
        message = json.dumps({"verb": verb, "args": args, "reply": reply})
        try:
            with rados.WriteOpCtx() as op:
                self.io.set_omap(op, (ASKED,), (b"1",))
                self.io.operate_write_op(op, reply)
        except rados.Error as exc:
            raise ThinblockError(f"cannot ask the owner: {as_oserror(exc, 'reply object').strerror}") from None
        try:
            raw = self._ask(message, reply)
        finally:
            with contextlib.suppress(rados.Error):
                self.io.remove_object(reply)
        answer = json.loads(raw)
        if "error" in answer:
            raise ThinblockError(str(answer["error"]))
        return answer.get("ok")

    def _ask(self, message: str, reply: str) -> bytes:
        """Notify the owner and read its answer from the reply object."""
        try:
            self.io.notify(self.obj, message, int(self.timeout_s * 1000))
        except rados.ObjectNotFound:
            raise NoAnswer(f"nobody watches {self.obj}: its owner does not serve it") from None
        except rados.Error as exc:
            raise NoAnswer(
                f"its owner did not answer within {self.timeout_s:g} s ({as_oserror(exc, 'notify').strerror})"
            ) from None
        try:
            raw: bytes = self.io.read(reply, MAX_REQUEST * 4, 0)
        except rados.Error as exc:
            raise ThinblockError(f"cannot read the owner's answer: {as_oserror(exc, 'read').strerror}") from None
        if not raw:
            raise NoAnswer("no owner answered (nobody watches the volume, or its owner gave it up)")
        return raw

    def job(self, verb: str, fds: list[int], progress: Any, **args: Any) -> Any:
        """A job at the owner: only one that takes no file (sparsify), with no progress
        lines on the way, waiting up to JOB_TIMEOUT_S for its answer."""
        from thinblock.admin.control import FILELESS_JOBS
        from thinblock.admin.jobs import close_fds

        if fds or verb not in FILELESS_JOBS:
            close_fds(fds)
            raise ThinblockError(
                f"{verb.replace('_', ' ')} of a volume served on another host streams through its server's control"
                " socket: run it on that host"
            )
        timeout, self.timeout_s = self.timeout_s, max(self.timeout_s, JOB_TIMEOUT_S)  # both whole seconds
        try:
            return self.call(verb, **args)
        finally:
            self.timeout_s = timeout

    def close(self) -> None:
        pass


class VolumeWatches:
    """The watches of one server per volume on a Ceph pool: one per volume it owns,
    kept in step with them by a thread, each answering with the control server's verbs."""

    def __init__(self, pool: Pool, control: ControlServer) -> None:
        from thinblock.backends.rados import RadosLocation

        assert isinstance(pool.location, RadosLocation)
        self.pool = pool
        self.control = control
        self.location = pool.location
        self.io = self.location.cluster().ioctx(self.location.ceph_pool)
        self.superblock = pool.meta.superblock()
        self.watches: dict[int, Any] = {}  # volume id -> rados Watch
        self._stop = threading.Event()
        self.sync()
        self._thread = threading.Thread(target=self._loop, name="thinblock-watches", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(SYNC_S):
            try:
                self.sync()
            except Exception as exc:  # a thread of its own: one failed round is logged, the next tries again
                log.warning("watches of pool %s: %s", self.location.name, exc)

    def sync(self) -> None:
        owner = self.pool.owner
        wanted = owner.owned_ids() if owner is not None else set()
        for vid in sorted(set(self.watches) - wanted):
            self._unwatch(vid)
        for vid in sorted(wanted - set(self.watches)):
            obj = watch_object(self.location, self.superblock, vid)
            try:
                with rados.WriteOpCtx() as op:
                    op.new(rados.LIBRADOS_CREATE_IDEMPOTENT)
                    self.io.operate_write_op(op, obj)
                self.watches[vid] = self.io.watch(
                    obj,
                    lambda notify_id, notifier_id, watch_id, data, vid=vid: self._request(vid, data),
                    lambda error, vid=vid: log.warning(
                        "the watch of volume %d on pool %s failed (%d)", vid, self.location.name, error
                    ),
                )
            except rados.Error as exc:
                log.warning("cannot watch volume %d of pool %s: %s", vid, self.location.name, exc)

    def _unwatch(self, vid: int, *, fenced: bool = False) -> None:
        watch = self.watches.pop(vid)
        if fenced:  # its unwatch would fail, or hang: never close it (_keep_forever says why)
            _keep_forever(watch)
            return
        try:
            watch.close()
        except rados.Error as exc:
            log.warning("the watch of volume %d on pool %s could not be closed: %s", vid, self.location.name, exc)
            _keep_forever(watch)

    def _request(self, vid: int, data: bytes) -> None:
        """A request for volume vid (librados' callback thread): run it, write the answer,
        and return, which acknowledges the notify. A volume this process no longer
        owns (handed over, its watch not yet dropped) gets no answer from it: its new
        owner, which watches too, gives the one answer."""
        owner = self.pool.owner
        if owner is None or not owner.owns_id(vid):
            return
        try:
            request = json.loads(data)
            reply = str(request["reply"])
            if not reply.startswith(f"{self.location.data_prefix(self.superblock)}.reply."):
                raise ValueError("a reply object outside this pool")
            verb, args = request["verb"], request.get("args") or {}
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("watch of volume %d: a request that is not one (%s)", vid, exc)
            return
        answer, after = self.control.answer(verb, args)  # a verb or args not as they must be: an error answer
        undelivered = answer_if_asked(self.io, reply, json.dumps(answer).encode())
        if undelivered is not None:
            log.warning("watch of volume %d: %s ran, but %s", vid, verb, undelivered)
        if after is not None:
            after()

    def close(self, *, abandon: bool = False) -> None:
        """Stop watching. abandon: this server lost a lease (its client may be fenced, or
        the cluster out of reach): nothing is asked of the cluster, and nothing waited
        for; the watches lapse with the connection."""
        self._stop.set()
        if not abandon:
            self._thread.join()
        for vid in list(self.watches):
            self._unwatch(vid, fenced=abandon)
