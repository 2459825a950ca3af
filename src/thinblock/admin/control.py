"""The control socket: live administration of a pool a server holds.

Whoever holds a pool (thinblock serve, the FUSE daemon, a command running a
job) listens on POOL/control.sock (mode 0600). The protocol is one JSON object
per line:

    -> {"verb": "snapshot_create", "args": {"volume": "vm1", "name": "s1"}}
    <- {"ok": <result>}          or  {"error": "sentence", "errno": 28}

Verbs are admin.verbs.VERBS, run in the server process on the live pool object
(each takes the locks it needs, see core/pool.py), so a snapshot of a busy
volume falls between its requests. Job verbs (admin/jobs.py) also carry the
open files they read or write, passed with the request line (SCM_RIGHTS), and
are answered with progress lines before the reply:

    <- {"progress": [done, total]}   (at most ten a second, and every HEARTBEAT_S)

A malformed line gets an error reply; it never stops the server.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from thinblock.admin.jobs import JOBS, close_fds, run_job
from thinblock.admin.schema import validate
from thinblock.admin.verbs import VERBS, run_validated
from thinblock.backends import Location
from thinblock.core.owner import owner_pid
from thinblock.core.pool import Pool
from thinblock.errors import (
    NoSpaceError,
    NotSupportedError,
    OpError,
    OutputClosed,
    PoolBusyError,
    RangeError,
    ReadOnlyError,
    ThinblockError,
)
from thinblock.listen import accept_loop, bind_unix
from thinblock.progress import ProgressFn
from thinblock.runtime import CONTROL_SOCKET, release_runtime_dir
from thinblock.sizes import env_seconds

log = logging.getLogger("thinblock.control")
MAX_LINE = 1 << 20
_ERRORS: dict[int, type[OpError]] = {
    cls.code: cls for cls in (NoSpaceError, RangeError, NotSupportedError, ReadOnlyError)
}


def control_socket_name(pool: Pool) -> str:
    """The control socket's name in the pool's runtime directory: an owner per volume
    has its own, by pid (the pid its leases name, core/owner.py)."""
    return CONTROL_SOCKET if pool.owner is None else owner_socket_name(os.getpid())


def owner_socket_name(pid: int) -> str:
    return f"control.{pid}.sock"


def owner_socket(pool: Location, holder: str) -> str | None:
    """The control socket of the server a lease's holder names (core/owner.py's
    owner_name), or None when that server is on another host."""
    pid = owner_pid(holder)
    return None if pid is None else os.path.join(pool.runtime_dir(), owner_socket_name(pid))


IDLE_CLIENT_S = 300.0  # a control client silent this long is dropped
MAX_FDS = 4  # open files a request may carry (a job takes one)
HEARTBEAT_S = 5.0  # a running job tells its command it is alive this often
DRAIN_GRACE_S = 2.0  # a stopping server waits this long for an idle client's next request


class ControlServer:
    def __init__(self, pool: Pool, extra_verbs: dict[str, Callable[..., Any]] | None = None) -> None:
        """extra_verbs: what only this process can do (a server hosting FUSE mounts)."""
        self.pool = pool
        self.extra_verbs = extra_verbs or {}
        # Absolute: a FUSE mount this process hosts chdir()s to /, and the socket must
        # still be found to be removed at the end.
        self.path = os.path.abspath(os.path.join(pool.location.runtime_dir(), control_socket_name(pool)))
        # We hold the pool lock, so a socket left here is a dead server's: replace it.
        # Only the pool's owner may connect (0600).
        self._stopping = threading.Event()
        self._local = threading.local()  # per connection thread: what runs once its reply is sent
        self._connections = 0  # being served (drain waits for them)
        self._served = threading.Condition()
        try:
            self.sock = bind_unix(self.path, live_ok=True)
            self.sock.listen(16)
            self._thread = threading.Thread(target=self._accept_loop, name="thinblock-control", daemon=True)
            self._thread.start()
        except BaseException:  # a Ctrl-C or SIGTERM of the command just now, too: leave no socket
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise

    def _accept_loop(self) -> None:
        accept_loop(self.sock, self._stopping, self._take, log, "the control socket")

    def _take(self, conn: socket.socket) -> None:
        conn.settimeout(1.0)  # wake up now and then: to drop an idle client, or when stopping
        with self._served:
            self._connections += 1
        threading.Thread(target=self._serve, args=(conn,), name="thinblock-control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._requests(conn)
        finally:
            with self._served:
                self._connections -= 1
                self._served.notify_all()

    def _requests(self, conn: socket.socket) -> None:
        requests = _Requests(conn)
        idle_since = time.monotonic()
        while True:
            try:
                got = requests.next()
            except TimeoutError:
                idle = time.monotonic() - idle_since
                # A client that connects and says nothing lets go; so does an idle one
                # when this server is stopping.
                if idle >= IDLE_CLIENT_S or (self._stopping.is_set() and idle >= DRAIN_GRACE_S):
                    return
                continue
            except OSError:
                return  # gone
            if got is None:
                return
            line, fds = got
            if _gave_up(conn):
                # Its client timed out while this server was stopped or busy, and told
                # its user the request failed: running it now would make that a lie.
                close_fds(fds)
                log.warning("control: a request dropped unrun: its client gave up waiting for it")
                return
            sender = _Sender(conn)
            reply = self._handle(line, fds, sender)
            sent = sender.send(reply)
            after, self._local.after = getattr(self._local, "after", None), None
            if after is not None:
                after()
            if not sent:
                return
            idle_since = time.monotonic()

    def answer(self, verb: str, args: object) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """One request that came another way (a notify from another host,
        admin/notify.py): the reply, and what to run once it is delivered. Of the
        jobs, only those that take no file (sparsify) come this way, and without
        progress lines."""
        line = json.dumps({"verb": verb, "args": args}).encode() + b"\n"
        reply = self._handle(line, [], _NoJobs(verb))
        after, self._local.after = getattr(self._local, "after", None), None
        return reply, after

    def after_reply(self, action: Callable[[], None]) -> None:
        """Run action once the reply to the request being handled (in this thread) is
        sent: a server that stops because of a request answers it first."""
        self._local.after = action

    def drain(self) -> None:
        """Stop taking connections, then wait for those being served to finish their
        requests (a command that held the pool for a job lets the jobs of other
        commands, run in its process meanwhile, end before it closes the pool)."""
        self.close()
        with self._served:
            while self._connections:
                self._served.wait(0.5)

    def _handle(self, line: bytes, fds: list[int], sender: _Sender | _NoJobs) -> dict[str, Any]:
        try:
            if len(line) > MAX_LINE or not line.endswith(b"\n"):
                raise ThinblockError("control request too long or not terminated by a newline")
            try:
                request = json.loads(line)
            except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deep
                raise ThinblockError(f"control request is not JSON: {str(exc)[:100]}") from None
            if not isinstance(request, dict) or not isinstance(request.get("verb"), str):
                raise ThinblockError('a control request is {"verb": ..., "args": {...}}')
            args = request.get("args") or {}
            if not isinstance(args, dict):
                raise ThinblockError("control request args must be an object")
            verb = request["verb"]
            extra = self.extra_verbs.get(verb)
            if extra is None and verb not in VERBS and verb not in JOBS:
                raise ThinblockError(f"unknown administration verb {verb[:60]!r}")
            validate(verb, args)  # once, before the log line and the verb
            log.info("control: %s %s", verb, json.dumps(args)[:200])
            if verb in JOBS:
                job_fds, fds = fds, []
                with sender.heartbeat():
                    return {"ok": run_job(self.pool, verb, args, job_fds, sender.progress, sender.check)}
            return {"ok": extra(**args) if extra is not None else run_validated(self.pool, verb, args)}
        except JobCancelled as exc:
            log.warning("control: %s", exc)
            return {"error": str(exc)}
        except OpError as exc:
            return {"error": exc.strerror or str(exc), "errno": exc.errno}
        except PoolBusyError as exc:
            return {"error": str(exc), "busy": True}
        except OutputClosed as exc:  # the command's reader went: the command ends quietly
            return {"error": str(exc), "output_closed": True}
        except ThinblockError as exc:
            return {"error": str(exc)}
        except Exception as exc:
            log.exception("control request failed")
            return {"error": f"internal error: {exc}"}
        finally:
            close_fds(fds)  # passed with a request that takes none

    def close(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        release_runtime_dir(os.path.dirname(self.path))  # a rados: or memory: pool's, when empty now


def _gave_up(conn: socket.socket) -> bool:
    """Whether the client has closed its socket already (checked before a request runs).
    POLLHUP, not POLLRDHUP: a client that only shut its sending side down after its
    request (`socat`, `nc -N`) still waits for the answer."""
    poller = select.poll()
    poller.register(conn, select.POLLHUP)
    return any(events & select.POLLHUP for _fd, events in poller.poll(0))


class _Requests:
    """Request lines from a control connection, with the open files passed along with
    each (SCM_RIGHTS: a job's source or destination)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = bytearray()
        self.fds: list[int] = []

    def next(self) -> tuple[bytes, list[int]] | None:
        """The next request line and the files that came with it; None at the end."""
        while True:
            end = self.buf.find(b"\n")
            if end >= 0 or len(self.buf) > MAX_LINE:
                cut = end + 1 if end >= 0 else len(self.buf)
                line = bytes(self.buf[:cut])
                del self.buf[:cut]
                fds, self.fds = self.fds, []
                return line, fds
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.conn, 1 << 16, MAX_FDS)
            except TimeoutError:
                raise  # nothing lost: what came so far stays for the next call
            except BaseException:
                self._close_fds()
                raise
            self.fds += fds
            if not data:
                self._close_fds()
                return None
            self.buf += data

    def _close_fds(self) -> None:
        close_fds(self.fds)
        self.fds = []


class JobCancelled(ThinblockError):
    """The command that asked for a job went away: the job stops, as after a failure."""


# Jobs that take no open file: they may come without a connection (a notify).
FILELESS_JOBS = frozenset({"volume_sparsify"})


class _NoJobs:
    """The sender of a request that came without a connection: no progress lines, and
    only the jobs that take no open file (an import's stream cannot come by notify)."""

    def __init__(self, verb: str) -> None:
        self.verb = verb

    @contextlib.contextmanager
    def heartbeat(self) -> Iterator[None]:
        if self.verb not in FILELESS_JOBS:
            raise ThinblockError(
                "a job with a stream (import, export, their diffs) runs through the owner's control socket only:"
                " run it on the owner's host"
            )
        yield

    def progress(self, done: int, total: int) -> None:
        pass

    def check(self) -> None:
        pass


class _Sender:
    """Replies on one control connection: progress lines while a job runs (and every
    HEARTBEAT_S, so the command knows the server is alive), then the reply."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self.last: list[int] = [0, 0]
        self.gone = False

    def send(self, message: dict[str, Any]) -> bool:
        with self.lock:
            if self.gone:
                return False
            try:
                self.conn.sendall(json.dumps(message).encode() + b"\n")
                return True
            except OSError:
                self.gone = True
                return False

    def check(self) -> None:
        if self.gone:
            raise JobCancelled("the command that started a job went away; the job stopped")

    def progress(self, done: int, total: int) -> None:
        self.last = [done, total]
        self.send({"progress": self.last})
        self.check()

    @contextlib.contextmanager
    def heartbeat(self) -> Iterator[None]:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                self.send({"progress": self.last})

        thread = threading.Thread(target=beat, name="thinblock-job-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


def control_timeout_s() -> float:
    """How long a control call may take before the CLI gives up on the server
    (THINBLOCK_CONTROL_TIMEOUT_S, default 120 s: a big snapshot or dump still fits)."""
    return env_seconds("THINBLOCK_CONTROL_TIMEOUT_S", 120.0, 0.1)


class NoAnswer(ThinblockError):
    """The server did not answer at all (refused, failed, or timed out), as opposed to
    answering with an error: it may be stopped, hung or gone."""


class ControlClient:
    """The admin.Admin interface over a server's control socket. Every call is
    bounded: a server that does not answer is reported, never waited on forever."""

    def __init__(self, path: str, timeout_s: float | None = None) -> None:
        self.path = path
        self.timeout_s = control_timeout_s() if timeout_s is None else timeout_s
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(min(self.timeout_s, 10.0))
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise NoAnswer(f"the pool is held by a server whose control socket {path} refuses: {exc}") from None
        self.sock.settimeout(self.timeout_s)
        self.rfile = self.sock.makefile("rb")

    def call(self, verb: str, **args: Any) -> Any:
        return self.job(verb, [], None, **args)

    def job(self, verb: str, fds: list[int], progress: ProgressFn | None, **args: Any) -> Any:
        """A verb, with open files passed along (SCM_RIGHTS) and the progress lines of a
        job fed to progress until the reply comes."""
        try:
            request = json.dumps({"verb": verb, "args": args}).encode() + b"\n"
            try:
                if fds:
                    sent = socket.send_fds(self.sock, [request], fds)
                    if sent < len(request):
                        self.sock.sendall(request[sent:])
                else:
                    self.sock.sendall(request)
            finally:
                close_fds(fds)  # the server has its own copies now: the files are the job's
            while True:
                line = self.rfile.readline()
                if not line:
                    break
                reply = json.loads(line)
                if "progress" not in reply:
                    break
                if progress is not None:
                    progress(*reply["progress"])
        except TimeoutError:
            raise NoAnswer(
                f"the server holding the pool did not answer {verb} on its control socket {self.path}"
                f" within {self.timeout_s:g} s (THINBLOCK_CONTROL_TIMEOUT_S); it drops the request unrun"
                " if it had not started it"
            ) from None
        except OSError as exc:
            raise NoAnswer(f"the control socket {self.path} failed: {exc.strerror or exc}") from None
        if not line:
            raise NoAnswer("the server closed its control socket without replying")
        if "error" not in reply:
            return reply["ok"]
        code = reply.get("errno")
        if code:
            raise _ERRORS.get(code, OpError)(reply["error"])
        if reply.get("busy"):
            raise PoolBusyError(reply["error"])
        if reply.get("output_closed"):
            raise OutputClosed(reply["error"])
        raise ThinblockError(reply["error"])

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


def reachable_sockets(pool: Location, holders: Iterable[str]) -> dict[str, str]:
    """holder -> its control socket, for the holders (lease holder names) whose socket
    is on this host and still there; one on another host, or gone, is left out."""
    sockets: dict[str, str] = {}
    for holder in holders:
        sock = owner_socket(pool, holder)
        if sock is not None and os.path.exists(sock):
            sockets[holder] = sock
    return sockets


def ask_each(sockets: dict[str, str], verb: str, timeout_s: float) -> dict[str, Any]:
    """The same call to several servers' control sockets (key -> path), all at once: key
    -> its answer, or the exception that came instead (ThinblockError for one that did
    not answer within timeout_s). Stalled servers cost timeout_s once, not each."""
    return ask_all({key: functools.partial(call_at, path, verb, timeout_s) for key, path in sockets.items()})


def call_at(path: str, verb: str, timeout_s: float) -> Any:
    """One call, with no arguments, to the server whose control socket is path."""
    client = ControlClient(path, timeout_s)
    try:
        return client.call(verb)
    finally:
        client.close()


def ask_all(calls: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Several calls to servers (each bounded by its own timeout), all at once: key ->
    its answer, or the exception that came instead."""
    if not calls:
        return {}
    answers: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=min(16, len(calls)), thread_name_prefix="ask") as asking:
        futures = {key: asking.submit(call) for key, call in calls.items()}
        for key, future in futures.items():
            try:
                answers[key] = future.result()
            except Exception as exc:  # the caller says what each failure means
                answers[key] = exc
    return answers
