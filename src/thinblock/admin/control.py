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

from thinblock.admin.verbs import CONTROL_SOCKET, run_verb
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

log = logging.getLogger("thinblock.control")
MAX_LINE = 1 << 20
_ERRORS: dict[int, type[OpError]] = {
    cls.code: cls for cls in (NoSpaceError, RangeError, NotSupportedError, ReadOnlyError)
}


class ControlServer:
    def __init__(self, pool: Pool, extra_verbs: dict[str, Callable[..., Any]] | None = None) -> None:
        """extra_verbs: what only this process can do (a server hosting FUSE mounts)."""
        self.pool = pool
        self.extra_verbs = extra_verbs or {}
        self.path = os.path.join(pool.location.runtime_dir(), CONTROL_SOCKET)
        # We hold the pool lock, so a socket file left here is a dead server's.
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(self.path)
        finally:
            os.umask(old)
        self.sock.listen(16)
        self._thread = threading.Thread(target=self._accept_loop, name="thinblock-control", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), name="thinblock-control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as rfile:
            while line := rfile.readline(MAX_LINE + 1):
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
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ThinblockError(f"control request is not JSON: {exc}") from None
            if not isinstance(request, dict) or not isinstance(request.get("verb"), str):
                raise ThinblockError('a control request is {"verb": ..., "args": {...}}')
            args = request.get("args") or {}
            if not isinstance(args, dict):
                raise ThinblockError("control request args must be an object")
            log.info("control: %s %s", request["verb"], json.dumps(args)[:200])
            extra = self.extra_verbs.get(request["verb"])
            if extra is not None:
                return {"ok": extra(**args)}
            return {"ok": run_verb(self.pool, request["verb"], args)}
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
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class ControlClient:
    """The admin.Admin interface over a server's control socket."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise ThinblockError(f"the pool is held by a server whose control socket {path} refuses: {exc}") from None
        self.rfile = self.sock.makefile("rb")

    def call(self, verb: str, **args: Any) -> Any:
        self.sock.sendall(json.dumps({"verb": verb, "args": args}).encode() + b"\n")
        line = self.rfile.readline()
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
