"""Reaching a pool's administration: directly, or through the server that holds it.

`open_admin(path)` gives an object with `call(verb, **args)`: when no process
holds the pool it opens the pool itself; when a server (`thinblock serve`, the
FUSE daemon) holds it, it sends the same call over the server's control
socket (control.py), so nothing touches the metadata behind a live server.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Protocol

from thinblock.admin.control import ControlClient
from thinblock.admin.verbs import CONTROL_SOCKET, run_verb
from thinblock.backends import locate
from thinblock.core.pool import Pool
from thinblock.errors import PoolBusyError, ThinblockError


class Admin(Protocol):
    def call(self, verb: str, **args: Any) -> Any: ...


class LocalAdmin:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def call(self, verb: str, **args: Any) -> Any:
        return run_verb(self.pool, verb, args)


@contextlib.contextmanager
def open_admin(path: str) -> Iterator[Admin]:
    """Administer the pool at path: directly, or through the server that holds it."""
    try:
        pool = Pool.open(path, autocommit=False, purpose="thinblock admin command")
    except PoolBusyError as exc:
        socket_path = os.path.join(locate(path).runtime_dir(), CONTROL_SOCKET)
        if not os.path.exists(socket_path):
            raise PoolBusyError(f"{exc}, which offers no control socket") from None
        try:
            client = ControlClient(socket_path)
        except ThinblockError:
            # A holder whose socket does not answer died or stalled: say who holds the pool.
            raise PoolBusyError(f"{exc}; its control socket {socket_path} does not answer") from None
        try:
            yield client
        finally:
            client.close()
        return
    try:
        yield LocalAdmin(pool)
    finally:
        pool.close()
