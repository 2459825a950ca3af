"""The control socket: live administration of a pool a server holds.

Whoever holds a pool (thinblock serve, the FUSE daemon) listens on
POOL/control.sock (mode 0600). The protocol is one JSON object per line:

    -> {"verb": "snapshot_create", "args": {"volume": "vm1", "name": "s1"}}
    <- {"ok": <result>}          or  {"error": "sentence", "errno": 28}

Verbs are admin.verbs.VERBS, run in the server process on the live pool object
(each takes the locks it needs, see core/pool.py), so a snapshot of a busy
volume falls between its requests. A malformed line
gets an error reply; it never stops the server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from thinblock.admin.schema import validate
from thinblock.admin.verbs import CONTROL_SOCKET, VERBS, run_validated
from thinblock.core.pool import Pool
from thinblock.errors import (
    NoSpaceError,
    NotSupportedError,
    OpError,
    PoolBusyError,
    RangeError,
    ReadOnlyError,
    ThinblockError,
)
from thinblock.listen import accept_loop, bind_unix

log = logging.getLogger("thinblock.control")
MAX_LINE = 1 << 20
_ERRORS: dict[int, type[OpError]] = {
    cls.code: cls for cls in (NoSpaceError, RangeError, NotSupportedError, ReadOnlyError)
}


IDLE_CLIENT_S = 300.0  # a control client silent this long is dropped


class ControlServer:
    def __init__(self, pool: Pool, extra_verbs: dict[str, Callable[..., Any]] | None = None) -> None:
        """extra_verbs: what only this process can do (a server hosting FUSE mounts)."""
        self.pool = pool
        self.extra_verbs = extra_verbs or {}
        self.path = os.path.join(pool.location.runtime_dir(), CONTROL_SOCKET)
        # We hold the pool lock, so a socket left here is a dead server's: replace it.
        # Only the pool's owner may connect (0600).
        self._stopping = threading.Event()
        self.sock = bind_unix(self.path, live_ok=True)
        self.sock.listen(16)
        self._thread = threading.Thread(target=self._accept_loop, name="thinblock-control", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        accept_loop(self.sock, self._stopping, self._take, log, "the control socket")

    def _take(self, conn: socket.socket) -> None:
        conn.settimeout(IDLE_CLIENT_S)  # a client that connects and says nothing lets go
        threading.Thread(target=self._serve, args=(conn,), name="thinblock-control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as rfile:
            while True:
                try:
                    line = rfile.readline(MAX_LINE + 1)
                except OSError:
                    return  # idle too long, or gone
                if not line:
                    return
                reply = self._handle(line)
                try:
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except OSError:
                    return

    def _handle(self, line: bytes) -> dict[str, Any]:
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
            if extra is None and verb not in VERBS:
                raise ThinblockError(f"unknown administration verb {verb[:60]!r}")
            validate(verb, args)  # once, before the log line and the verb
            log.info("control: %s %s", verb, json.dumps(args)[:200])
            return {"ok": extra(**args) if extra is not None else run_validated(self.pool, verb, args)}
        except OpError as exc:
            return {"error": exc.strerror or str(exc), "errno": exc.errno}
        except PoolBusyError as exc:
            return {"error": str(exc), "busy": True}
        except ThinblockError as exc:
            return {"error": str(exc)}
        except Exception as exc:
            log.exception("control request failed")
            return {"error": f"internal error: {exc}"}

    def close(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def env_seconds(name: str, default: float, minimum: float) -> float:
    """A duration from the environment, at least minimum; default when unset or unreadable."""
    try:
        return max(minimum, float(os.environ.get(name, default)))
    except ValueError:
        return default


def control_timeout_s() -> float:
    """How long a control call may take before the CLI gives up on the server
    (THINBLOCK_CONTROL_TIMEOUT_S, default 120 s: a big snapshot or dump still fits)."""
    return env_seconds("THINBLOCK_CONTROL_TIMEOUT_S", 120.0, 0.1)


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
            raise ThinblockError(f"the pool is held by a server whose control socket {path} refuses: {exc}") from None
        self.sock.settimeout(self.timeout_s)
        self.rfile = self.sock.makefile("rb")

    def call(self, verb: str, **args: Any) -> Any:
        try:
            self.sock.sendall(json.dumps({"verb": verb, "args": args}).encode() + b"\n")
            line = self.rfile.readline()
        except TimeoutError:
            raise ThinblockError(
                f"the server holding the pool did not answer {verb} on its control socket {self.path}"
                f" within {self.timeout_s:g} s (THINBLOCK_CONTROL_TIMEOUT_S)"
            ) from None
        except OSError as exc:
            raise ThinblockError(f"the control socket {self.path} failed: {exc.strerror or exc}") from None
        if not line:
            raise ThinblockError("the server closed its control socket without replying")
        reply = json.loads(line)
        if "error" not in reply:
            return reply["ok"]
        code = reply.get("errno")
        if code:
            raise _ERRORS.get(code, OpError)(reply["error"])
        if reply.get("busy"):
            raise PoolBusyError(reply["error"])
        raise ThinblockError(reply["error"])

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()
