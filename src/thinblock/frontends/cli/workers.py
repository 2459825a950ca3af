"""`thinblock serve POOL --workers N`: one listener, N worker processes.

Python runs one thread of bytecode at a time, so one process serves a pool on
one core. With --workers N the pool is served per volume (core/owner.py) by N
processes forked from this one: the volumes are dealt out among them, each
owns its share (leases, grants, its own commits), and all of them accept on the
listening sockets made here, so clients keep one unix socket and one TCP port.
A connection accepted by a worker that does not own the export it asks for is
handed to the one that does (frontends/nbd/workers.py).

On a Ceph pool a fence covers a whole client, so the volumes are not dealt out:
each gets a worker of its own (as with --volume), and without --volume one more
worker, the spare, owns none. A volume nobody holds that a client asks for is
claimed by the spare (any worker hands the client to it); the spare tells this
process (SIGUSR1), which starts the next spare.

This process serves nothing itself: it forwards SIGHUP (--tls-authz reload) and
SIGINT/SIGTERM to the workers, and restarts a worker that dies, on the volumes
of its share that nobody else took meanwhile (their leases died with it, so
they are recovered as after any owner's death). A worker that keeps dying (more
than RESTARTS times in RESTART_WINDOW_S) is not restarted again: its volumes
are then refused, with why, and the others go on being served.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from thinblock import systemd
from thinblock.admin.handover import take_over, unheld_volumes, volumes_held_by, volumes_to_serve
from thinblock.backends import Location
from thinblock.core.registry import STAGING_PREFIX, base_row_id
from thinblock.errors import LeasesLost, ThinblockError
from thinblock.listen import LISTEN_BACKLOG, bind_tcp, bind_unix, remove_socket
from thinblock.sizes import env_seconds

log = logging.getLogger("thinblock.serve")

RESTARTS = 3
LEASES_LOST_EXIT = 75  # a worker's exit status when it stopped because its leases were taken (not restarted)
RESTART_PAUSE_S = 0.25  # the first pause before restarting a worker that died again (doubles, up to 2 s)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
RESTART_WINDOW_S = 60.0
# What the supervisor takes (SIGUSR1: a spare claimed a volume); blocked across a fork.
SUPERVISOR_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGUSR1)


@dataclass
class WorkerSpec:
    """What a forked worker's `serve` takes from its supervisor instead of making it."""

    group: int  # the supervisor's pid: the group's name (frontends/nbd/workers.py)
    index: int  # which worker: its log lines say so
    handoff_dir: str  # the group's private directory of hand-over sockets
    listeners: list[tuple[socket.socket, str]]
    ready_fd: int  # "ready" or "error: ..." is written here once, then it is closed
    claims: bool = False  # no --volume: a volume nobody holds is claimed when a client asks
    one_each: bool = False  # a worker per volume: claims are the spare worker's

    def report(self, text: str) -> None:
        if self.ready_fd < 0:
            return
        with contextlib.suppress(OSError):
            os.write(self.ready_fd, text.encode()[:4000] + b"\n")
            os.close(self.ready_fd)
        self.ready_fd = -1


@dataclass
class _Worker:
    index: int
    volumes: list[str]
    pid: int = 0
    deaths: list[float] = field(default_factory=list)
    given_up: bool = False
    restart_at: float | None = None  # when it is restarted (monotonic), after a pause
    spare: bool = False  # a worker per volume: it owns none yet, and claims the next


def end_with_parent(supervisor: int) -> None:
    """SIGKILL when the supervisor dies, however it dies (prctl PR_SET_PDEATHSIG): a
    killed server goes whole, as one process would, leaving no worker serving on
    and its leases free at once (what was flushed is durable, as after any kill;
    an orderly stop is the supervisor's SIGTERM, forwarded). Exits at once if it
    died already."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != supervisor:
        os._exit(1)


def parse_workers(text: str) -> int:
    """--workers: a count from 1, or "auto" for the cores this process may use."""
    if text == "auto":
        return max(1, len(os.sched_getaffinity(0)))
    if not text.isdigit() or not 1 <= int(text) <= 256:
        raise argparse.ArgumentTypeError(f"invalid --workers {text!r}: a count from 1 to 256, or auto")
    return int(text)


def listen(socket_path: str | None, mode: int, gid: int | None, tcp: tuple[str, int] | None) -> list[socket.socket]:
    """The listening sockets the workers share: the unix socket, and TCP if asked."""
    made: list[socket.socket] = []
    try:
        if socket_path is not None:
            made.append(bind_unix(socket_path, mode=mode, gid=gid))
        if tcp is not None:
            made.append(bind_tcp(*tcp))
        for sock in made:
            sock.listen(LISTEN_BACKLOG)
    except BaseException:
        for sock in made:
            sock.close()
        raise
    return made


class Supervisor:
    """The workers of one `serve --workers N`, started, watched and stopped."""

    def __init__(
        self,
        location: Location,
        listeners: list[socket.socket],
        run_worker: Callable[[WorkerSpec, list[str]], None],
    ) -> None:
        self.location = location
        self.listeners = listeners
        self.run_worker = run_worker
        self.restart_pause_s = restart_pause_s()  # read first: a bad value refuses the start
        self.claims = False  # the workers claim volumes nobody holds (serve POOL without --volume)
        self.one_each = location.fences_per_process  # a worker per volume, and a spare that claims
        self.follow_at: float | None = None  # when follow_claims is tried again (monotonic)
        self.workers: list[_Worker] = []
        # Where the workers take hand-overs from each other: a fresh directory only this
        # user may enter, so no other user can listen in a worker's place.
        self.handoff_dir = tempfile.mkdtemp(prefix="thinblock-workers.")

    def deal(self, names: list[str], count: int) -> None:
        """Deal the volumes out to count workers (fewer when there are fewer volumes); a
        worker per volume, and the spare when claiming, where a fence covers a client."""
        if self.one_each:
            self.workers = [_Worker(i, [name]) for i, name in enumerate(names)]
            if self.claims or not self.workers:
                self.workers.append(_Worker(len(self.workers), [], spare=True))
            return
        count = max(1, min(count, len(names)))
        self.workers = [_Worker(i, names[i::count]) for i in range(count)]

    def follow_claims(self) -> None:
        """SIGUSR1 from the spare: once it holds a volume, it is that volume's worker,
        and the next spare starts. The store out of reach is tried again a second
        later (a spare that claimed keeps asking meanwhile), never the server's end."""
        self.follow_at = None
        spare = next((w for w in self.workers if w.spare and w.pid), None)
        if spare is None:
            return
        try:
            held = volumes_held_by(self.location, spare.pid)
        except (OSError, ThinblockError) as exc:
            log.warning("cannot read what the spare worker %d claimed (tried again in 1 s): %s", spare.index, exc)
            self.follow_at = time.monotonic() + 1.0
            return
        if not held:
            return
        spare.spare, spare.volumes = False, held
        log.info(
            "worker %d (pid %d) claimed %s; starting the next spare worker", spare.index, spare.pid, ", ".join(held)
        )
        worker = _Worker(len(self.workers), [], spare=True)
        self.workers.append(worker)
        error = self._start(worker)
        if error is not None:
            log.error("the next spare worker could not start: %s", error)
            self._restart(worker, "failed to start")

    def _name_spare(self, pid: int) -> None:
        """Tell the workers which of them claims next (written whole, then renamed)."""
        from thinblock.frontends.nbd.workers import SPARE_FILE

        path = os.path.join(self.handoff_dir, SPARE_FILE)
        try:
            with open(path + ".new", "w") as f:
                f.write(f"{pid}\n")
            os.replace(path + ".new", path)
        except OSError as exc:  # the workers then find no spare, and say so to the client
            log.error("cannot name worker pid %d the spare in %s: %s", pid, self.handoff_dir, exc)

    def start_all(self) -> None:
        try:
            for worker in self.workers:
                error = self._start(worker)
                if error is not None:
                    raise ThinblockError(f"worker {worker.index} could not start: {error}")
        except BaseException:
            self.stop()
            raise

    def _start(self, worker: _Worker) -> str | None:
        """Fork the worker; None once it is serving, else why it is not (it has exited)."""
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        old = signal.pthread_sigmask(signal.SIG_BLOCK, SUPERVISOR_SIGNALS)
        supervisor = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker: it never returns into the supervisor's code
            code = 1
            try:
                os.close(read_fd)
                signal.set_wakeup_fd(-1)
                for signum in SUPERVISOR_SIGNALS:
                    signal.signal(signum, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
                os.environ.pop("NOTIFY_SOCKET", None)  # readiness is the supervisor's to tell
                end_with_parent(supervisor)
                spec = WorkerSpec(
                    supervisor,
                    worker.index,
                    self.handoff_dir,
                    [(s, "worker") for s in self.listeners],
                    write_fd,
                    one_each=self.one_each,
                )
                try:
                    self.run_worker(spec, worker.volumes)
                    code = 0
                except LeasesLost as exc:
                    log.error("worker %d: %s", worker.index, exc)
                    code = LEASES_LOST_EXIT
                except (ThinblockError, OSError) as exc:
                    spec.report(f"error: {exc}")
                    log.error("worker %d: %s", worker.index, exc)
                except BaseException as exc:
                    spec.report(f"error: {exc!r}")
                    log.exception("worker %d failed", worker.index)
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        os.close(write_fd)
        worker.pid = pid
        with os.fdopen(read_fd, "rb") as ready:
            answer = ready.readline().decode(errors="replace").strip()
        if answer == "ready":
            log.info("worker %d (pid %d) serves %s", worker.index, pid, ", ".join(worker.volumes) or "no volume")
            if worker.spare:
                self._name_spare(pid)
            return None
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        worker.pid = 0
        return answer.removeprefix("error: ") or "it exited before it was ready"

    def names_served(self) -> list[str]:
        """The workers' volumes and the snapshots of them, as the store has them now."""
        meta = self.location.open_meta(readonly=True)
        try:
            rows = {row.id: row for row in meta.volumes()}
        finally:
            meta.close()
        owned = {name for w in self.workers if not w.given_up for name in w.volumes}
        served = []
        for row in rows.values():
            base = base_row_id(row, rows)
            if base is not None and rows[base].name in owned and not row.name.startswith(STAGING_PREFIX):
                served.append(row.name)
        return sorted(served)

    def forward(self, signum: int) -> None:
        for worker in self.workers:
            if worker.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signum)

    def reap(self) -> None:
        """Restart each worker that died (SIGCHLD), unless it keeps dying."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            worker = next((w for w in self.workers if w.pid == pid), None)
            if worker is None:
                continue
            worker.pid = 0
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) == LEASES_LOST_EXIT:
                worker.given_up = True  # another server holds its volumes now: nothing to take back
                log.warning(
                    "worker %d stopped: another server took %s over; not restarting it",
                    worker.index,
                    ", ".join(worker.volumes),
                )
                continue
            how = (
                f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
                if os.WIFSIGNALED(status)
                else f"exit status {os.WEXITSTATUS(status)}"
            )
            self._restart(worker, how)

    def _restart(self, worker: _Worker, how: str) -> None:
        now = time.monotonic()
        worker.deaths = [t for t in worker.deaths if now - t < RESTART_WINDOW_S] + [now]
        if len(worker.deaths) > RESTARTS:
            worker.given_up = True
            log.error(
                "worker %d ended (%s) %d times in %.0f s: not restarting it; its volumes (%s) are not served",
                worker.index,
                how,
                len(worker.deaths),
                RESTART_WINDOW_S,
                ", ".join(worker.volumes),
            )
            return
        free = set(unheld_volumes(self.location))
        taken = [name for name in worker.volumes if name not in free]
        if taken:
            log.warning("worker %d: %s now served elsewhere; not taking them back", worker.index, ", ".join(taken))
        worker.volumes = [name for name in worker.volumes if name in free]
        if not worker.volumes and not (worker.spare if self.one_each else self.claims):  # nothing to restart for
            worker.given_up = True
            log.info("worker %d ended (%s): its volumes are served elsewhere now; not restarting it", worker.index, how)
            return
        log.warning(
            "worker %d ended (%s): restarting it for %s",
            worker.index,
            how,
            ", ".join(worker.volumes) or ("no volume (the spare)" if worker.spare else "the volumes it claims"),
        )
        # Dying again soon: wait a little, growing, before the next try. The wait is
        # the main loop's (restart_due): signals are taken meanwhile, so a SIGTERM
        # stops the server at once instead of after the pause and the restart.
        first = self.restart_pause_s
        pause = 0.0 if len(worker.deaths) == 1 else min(max(2.0, first), first * 2 ** (len(worker.deaths) - 2))
        worker.restart_at = time.monotonic() + pause
        if pause:
            log.info("worker %d: restarting in %.2f s", worker.index, pause)
        else:
            self.restart_due()

    def next_restart_s(self) -> float | None:
        """Seconds until the next restart waiting its pause, or the next try at following
        a claim (0 if due), None if none waits."""
        waits = [w.restart_at for w in self.workers if w.restart_at is not None]
        if self.follow_at is not None:
            waits.append(self.follow_at)
        return None if not waits else max(0.0, min(waits) - time.monotonic())

    def restart_due(self) -> None:
        """Start each worker whose pause has passed; one that fails to start counts as
        another death. Follow a claim whose try is due."""
        now = time.monotonic()
        if self.follow_at is not None and self.follow_at <= now:
            self.follow_claims()
        for worker in self.workers:
            if worker.restart_at is None or worker.restart_at > now:
                continue
            worker.restart_at = None
            error = self._start(worker)
            if error is not None:
                log.error("worker %d could not be restarted: %s", worker.index, error)
                self._restart(worker, "failed to start")

    def alive(self) -> bool:
        """Whether a worker serves, or one waits to be restarted."""
        return any(w.pid or w.restart_at is not None for w in self.workers)

    def stop(self) -> None:
        """SIGTERM to every worker, then wait for each: they drain and commit."""
        self.forward(signal.SIGTERM)
        for worker in self.workers:
            while worker.pid:
                try:
                    os.waitpid(worker.pid, 0)
                except ChildProcessError:
                    pass
                except InterruptedError:
                    continue
                worker.pid = 0
        shutil.rmtree(self.handoff_dir, ignore_errors=True)


def restart_pause_s() -> float:
    """RESTART_PAUSE_S, or THINBLOCK_RESTART_PAUSE_S (tests lengthen it)."""
    return env_seconds("THINBLOCK_RESTART_PAUSE_S", RESTART_PAUSE_S, 0.0)


def supervise(
    args: argparse.Namespace,
    location: Location,
    listeners: list[socket.socket],
    announce: Callable[[list[str]], str],
    run_worker: Callable[[WorkerSpec, list[str]], None],
    next_signal: Callable[[float | None], int | None],
) -> None:
    """Run the workers until SIGINT or SIGTERM. announce prints the exports of the
    names served and returns the status line; run_worker is `serve` in a worker."""
    volumes: list[str] | None = args.volumes
    if volumes and args.takeover:
        take_over(location, volumes)
    names = list(dict.fromkeys(volumes)) if volumes else volumes_to_serve(location)
    supervisor = Supervisor(location, listeners, run_worker)
    supervisor.claims = not volumes  # its workers claim volumes nobody holds: one with none still serves
    supervisor.deal(names, args.workers)
    if supervisor.one_each and not volumes:
        log.info(
            "pool %s: %d volume(s) nobody holds, one worker process each, and a spare that claims the next"
            " (fencing one owner must not reach the others)",
            args.pool,
            len(names),
        )
    if volumes and len(supervisor.workers) < args.workers:
        # A volume is served by one process: more workers than volumes would idle.
        log.warning(
            "--workers %d for %d volume(s) given with --volume: %d worker(s), one per volume",
            args.workers,
            len(names),
            len(supervisor.workers),
        )
    log.info("the workers hand connections to each other through sockets in %s", supervisor.handoff_dir)
    supervisor.start_all()
    why = "an error"
    try:
        status = announce(supervisor.names_served())
        status = f"{status} with {len(supervisor.workers)} worker process(es)"
        print(f"ready: {status}", flush=True)
        systemd.notify("READY=1", f"MAINPID={os.getpid()}", f"STATUS={status}")
        while True:
            signum = next_signal(supervisor.next_restart_s())
            if signum is None:  # a restart's pause has passed
                supervisor.restart_due()
                if not supervisor.alive():
                    raise ThinblockError("every worker has ended and none can be restarted: stopping")
            elif signum == signal.SIGHUP:
                systemd.notify("RELOADING=1", "STATUS=reloading --tls-authz in every worker")
                supervisor.forward(signal.SIGHUP)
                systemd.notify("READY=1", f"STATUS={status}")
            elif signum == signal.SIGUSR1:
                supervisor.follow_claims()
            elif signum == signal.SIGCHLD:
                supervisor.reap()
                if not supervisor.alive():
                    raise ThinblockError("every worker has ended and none can be restarted: stopping")
            else:
                why = signal.Signals(signum).name
                break
        systemd.notify("STOPPING=1", "STATUS=stopping: the workers finish requests and commit")
        print("stopping: finishing requests and committing", flush=True)
    finally:
        started = time.monotonic()
        supervisor.stop()
        log.info(
            "stopping on %s: %d worker(s) stopped in %.3f s", why, len(supervisor.workers), time.monotonic() - started
        )


def close_listeners(listeners: list[socket.socket], unix_path: str | None, inode: int | None) -> None:
    """Close the shared listening sockets; remove the unix socket unless a newer
    server's socket has replaced it meanwhile (its inode is not the one made here)."""
    for sock in listeners:
        with contextlib.suppress(OSError):
            sock.close()
    if unix_path is not None:
        remove_socket(unix_path, inode)
