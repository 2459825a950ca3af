"""Reaching a pool's administration: directly, or through the server that holds it.

`open_admin(path)` gives an object with `call(verb, **args)`: when no process
holds the pool it opens the pool itself; when a server (`thinblock serve`, the
FUSE daemon) holds it, it sends the same call over the server's control
socket (control.py), so nothing touches the metadata behind a live server.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any, Protocol

from thinblock.admin.control import ControlClient, ControlServer, control_timeout_s
from thinblock.admin.jobs import Check, run_job
from thinblock.admin.verbs import run_verb
from thinblock.backends import locate
from thinblock.core.pool import Pool
from thinblock.errors import PoolBusyError, ThinblockError
from thinblock.progress import ProgressFn, no_progress
from thinblock.runtime import CONTROL_SOCKET
from thinblock.sizes import env_seconds


class Admin(Protocol):
    def call(self, verb: str, **args: Any) -> Any: ...

    def job(self, verb: str, fds: list[int], progress: ProgressFn | None, **args: Any) -> Any:
        """A job verb (admin/jobs.py), given its open files (they are the job's
        from then on) and told of its progress."""
        ...


class LocalAdmin:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def call(self, verb: str, **args: Any) -> Any:
        return run_verb(self.pool, verb, args)

    def job(self, verb: str, fds: list[int], progress: ProgressFn | None, *, check: Check = None, **args: Any) -> Any:
        """While a job runs here, this process holds the pool as a server would: it
        commits in the background, and it offers the control socket, so that other
        commands get through meanwhile (`export-diff POOL ... - | import-diff - POOL
        ...` on one pool: the second command's job runs in the first's process).
        check is called at the job's safe points (cli/signals.py): it raises to stop it."""
        self.pool.start_committer()
        server: ControlServer | None = None
        try:
            server = ControlServer(self.pool)
            return run_job(self.pool, verb, args, list(fds), progress or no_progress, check)
        finally:
            if server is not None:
                server.drain()


DEFAULT_WAIT_S = 60.0


def wait_s() -> float:
    """How long a command waits for its turn on a busy pool (--wait, THINBLOCK_WAIT_S)."""
    return env_seconds("THINBLOCK_WAIT_S", DEFAULT_WAIT_S, 0.0)


@contextlib.contextmanager
def open_admin(path: str, *, wait: float | None = None, progress: ProgressFn | None = None) -> Iterator[Admin]:
    """Administer the pool at path: directly, or through the server that holds it.

    When another process holds the pool and offers no control socket (another
    command, or a server still starting), wait for it up to `wait` seconds, the way
    LVM commands wait for their lock; then fail naming the holder. progress is told
    how the recovery after an unclean shutdown goes, when this opens the pool itself."""
    budget = wait_s() if wait is None else wait
    timeout_s = control_timeout_s()  # read first: a bad value is its own sentence, not "does not answer"
    deadline = time.monotonic() + budget
    pause = 0.02
    while True:
        try:
            pool = Pool.open(path, autocommit=False, purpose="thinblock admin command", progress=progress)
            break
        except PoolBusyError as exc:
            socket_path = os.path.join(locate(path).runtime_dir(), CONTROL_SOCKET)
            if os.path.exists(socket_path):
                try:
                    client = ControlClient(socket_path, timeout_s)
                except ThinblockError:
                    # A holder whose socket does not answer died or stalled: say who holds the pool.
                    raise PoolBusyError(f"{exc}; its control socket {socket_path} does not answer") from None
                try:
                    yield client
                finally:
                    client.close()
                return
            if time.monotonic() >= deadline:
                waited = f"; waited {budget:g} s (--wait)"
                holder = ", which offers no control socket" if "already held" in str(exc) else ""
                raise PoolBusyError(f"{exc}{holder}{waited}") from None
            time.sleep(pause)
            pause = min(0.25, pause * 2)
    try:
        yield LocalAdmin(pool)
    finally:
        pool.close()
