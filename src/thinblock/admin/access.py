"""Reaching a pool's administration: directly, or through the server that holds it.

`open_admin(path)` gives an object with `call(verb, **args)`: when no process
holds the pool it opens the pool itself; when a server (`thinblock serve`, the
FUSE daemon) holds it, it sends the same call over the server's control
socket (control.py), so nothing touches the metadata behind a live server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from thinblock.admin.control import (
    ControlClient,
    ControlServer,
    ask_each,
    control_timeout_s,
    owner_socket,
    reachable_sockets,
)
from thinblock.admin.follow import tell_owners
from thinblock.admin.idle_grants import ask_back_idle_grants, give_back_idle_grants
from thinblock.admin.jobs import Check, run_job
from thinblock.admin.verbs import run_verb
from thinblock.backends import locate
from thinblock.core.pool import Pool
from thinblock.errors import PoolBusyError, ThinblockError
from thinblock.progress import ProgressFn, no_progress
from thinblock.runtime import CONTROL_SOCKET
from thinblock.sizes import env_seconds

if TYPE_CHECKING:
    from thinblock.admin.notify import NotifyClient

log = logging.getLogger("thinblock.admin")


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
        extra: dict[str, Callable[..., Any]] = {}
        pool, owner = self.pool, self.pool.owner
        if owner is not None:  # a job beside owners per volume: idle grants both ways
            owner.ask_others = lambda: ask_back_idle_grants(pool)
            extra["grants_idle_back"] = lambda: give_back_idle_grants(pool)
        try:
            server = ControlServer(self.pool, extra)
            return run_job(self.pool, verb, args, list(fds), progress or no_progress, check)
        finally:
            if server is not None:
                server.drain()


class SharedAdmin:
    """A pool served per volume (serve --volume): a verb that changes a volume goes to
    the control socket of the server owning it (as rbd's exclusive-lock owner takes
    requests), the rest run here, in this command's pool-level step (Pool.pool_step)
    on the pool opened as an owner of no volume."""

    # verb -> the argument naming the volume it changes
    ROUTED: ClassVar[dict[str, str]] = {
        "snapshot_create": "volume",
        "volume_resize": "name",
        "volume_set": "name",
        "volume_rollback": "name",
        "volume_remove": "name",
        "volume_rename": "name",
        "volume_clone": "snapshot",  # the snapshot's row changes too (its exclusive count)
    }

    def __init__(self, pool: Pool, timeout_s: float) -> None:
        self.pool = pool
        self.timeout_s = timeout_s

    def _owner_target(self, name: str | None) -> str | int | None:
        """The control socket of the server owning name's volume (for a snapshot, the
        volume it was taken of), or that volume's id when its server is on another host
        of a pool whose owners take requests by watch/notify; None when nobody holds it,
        or there is no such name."""
        vol = self.pool.visible_volume(name) if name is not None else None
        if vol is None:
            return None
        vid = self.pool.base_volume_id(vol)
        holder = self.pool.meta.volume_holder(vid) if vid is not None else None
        if holder is None or vid is None:
            return None
        sock = owner_socket(self.pool.location, holder)
        if self.pool.location.remote_owners and (sock is None or not os.path.exists(sock)):
            return vid
        if sock is None:
            raise PoolBusyError(f"{vol.row.kind} {vol.name} is served by {holder}, which this host cannot reach")
        return sock

    @contextlib.contextmanager
    def _owner(self, target: str | int, name: str | None) -> Iterator[ControlClient | NotifyClient]:
        """A client of the server owning name: its control socket, or a notify of its
        volume's watch object (another host's server)."""
        if isinstance(target, int):
            from thinblock.admin.notify import NotifyClient

            yield NotifyClient(self.pool.location, self.pool.meta.superblock(), target, self.timeout_s)  # type: ignore[arg-type]
            return
        try:
            client = ControlClient(target, self.timeout_s)
        except ThinblockError as exc:
            raise PoolBusyError(f"the server owning {name} does not answer: {exc}") from None
        try:
            yield client
        finally:
            client.close()

    def call(self, verb: str, **args: Any) -> Any:
        key = self.ROUTED.get(verb)
        name = str(args.get(key)) if key else None
        target = self._owner_target(name)
        if target is None:
            result = run_verb(self.pool, verb, args)
            if verb in ("volume_list", "volume_info"):
                self._owners_clients(result if verb == "volume_list" else [result])
            if verb in ("pool_grow", "pool_set"):  # a pool-level step here: the owners follow now
                tell_owners(self.pool)
            return result
        with self._owner(target, name) as client:
            return client.call(verb, **args)

    def _owners_clients(self, rows: list[dict[str, Any]]) -> None:
        """Fill each listed row's open_clients from the server holding it (read here
        they would all be 0): one open_clients call per holder, all at once. A holder
        that is gone has none; one that does not answer soon, unknown (None): a
        stalled owner must not stall the listing, this figure is a hint."""
        try:
            recorded = self.pool.meta.recorded_holders()
        except (OSError, ThinblockError) as exc:
            log.warning("pool %s: open clients unknown: %s", self.pool.path, exc)
            for row in rows:
                row["open_clients"] = None
            return
        holder_of: dict[str, tuple[str, int]] = {}  # name -> (holder, the volume it holds)
        with self.pool.lock:
            for name, vol in self.pool.visible().items():
                base = self.pool.base_volume_id(vol)
                if base is not None and base in recorded:
                    holder_of[name] = (recorded[base], base)
        sockets = reachable_sockets(self.pool.location, {holder for holder, _vid in holder_of.values()})
        answers = ask_each(sockets, "open_clients", min(self.timeout_s, LIST_CLIENTS_TIMEOUT_S))
        live: dict[str, bool] = {}  # a holder that did not answer: one lock probe, whatever it held
        for row in rows:
            if row["name"] not in holder_of:
                continue
            holder, vid = holder_of[row["name"]]
            answer = answers.get(holder)
            if isinstance(answer, dict):
                row["open_clients"] = answer.get(row["name"], 0)
                continue
            if holder not in live:
                live[holder] = self._live(vid, holder)
            # Not answering (or on another host): unknown; gone, its record outliving it: none.
            row["open_clients"] = None if live[holder] else 0

    def _live(self, vid: int, holder: str) -> bool:
        try:
            return self.pool.meta.volume_holder(vid) == holder
        except (OSError, ThinblockError):
            return True  # cannot tell: unknown rather than none

    def job(self, verb: str, fds: list[int], progress: ProgressFn | None, **args: Any) -> Any:
        with self.for_job(verb, args) as admin:
            return admin.job(verb, fds, progress, **args)

    @contextlib.contextmanager
    def for_job(self, verb: str, args: dict[str, Any]) -> Iterator[LocalAdmin | ControlClient | NotifyClient]:
        """Where a job runs: at the server owning its volume (the volume a snapshot was
        taken of), over its control socket, as a job goes to a whole-pool server; or, on
        a volume nobody holds or a new one, here, on the pool opened as the owner of
        just that volume (or of none: the staging volume an import builds is this
        process's from the start, core/owner.py), which gives its leases up at the end."""
        name = str(args.get("name"))
        target = self._owner_target(name)
        if target is not None:
            with self._owner(target, name) as client:
                yield client  # by notify (another host): only a job that takes no file
            return
        vol = self.pool.visible_volume(name)
        base = self.pool.volume_by_id(self.pool.base_volume_id(vol)) if vol is not None else None
        owned = [base.name] if base is not None else []
        purpose = f"thinblock {verb.replace('volume_', '').replace('_', '-')}"
        with Pool.open(self.pool.location, autocommit=False, purpose=purpose, volumes=owned) as pool:
            yield LocalAdmin(pool)


DEFAULT_WAIT_S = 60.0
LIST_CLIENTS_TIMEOUT_S = 2.0  # how long volume list waits for an owner's open clients


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
            if locate(path).served_per_volume():
                shared = Pool.open(path, autocommit=False, purpose="thinblock admin command", volumes=[])
                try:
                    yield SharedAdmin(shared, timeout_s)
                finally:
                    shared.close()
                return
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
