"""SIGTERM and SIGHUP stop a command's job the way Ctrl-C (SIGINT) does.

systemd, `timeout` and `kill` send SIGTERM, and a closed terminal sends SIGHUP;
by default they end the process where it stands, with no cleanup: no staging
volume removed, no control socket taken away, no final commit. While a job
runs, all three stop it with `Interrupted` (a KeyboardInterrupt) in the main
thread, so the job unwinds as for Ctrl-C: the job is cancelled, what it made is
removed, the pool is closed and the runtime files go.

Where the signal is raised matters. A job that runs in this process holds the
pool: its main thread takes the pool's locks and commits, and an exception
raised between two bytecodes there (say, after a commit claimed its turn and
before the `try` that gives it back) leaves the pool waiting forever for a
commit that never ends. So in such a job the handler only records the signal
(`pending`), and `check()` raises it at the job's safe points: each progress
report, and every second while the job waits on a stream (transfer/images.py).
Only while the main thread does nothing but wait on a server's control socket
(`asynchronous`) does the handler raise at once.

Once the job has ended (or the first signal is being handled), further signals
wait until the cleanup is done, so that a second Ctrl-C or SIGTERM cannot cut
the cleanup short. The command then exits with 128 + the signal's number (130,
143, 129), as a shell reports a process killed by it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from thinblock.progress import ProgressFn

JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A job stopped by a signal; signum says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class JobSignals:
    """The state of one job_signals() block: taking a signal (raised at once, or
    kept for the next check), or holding it back for the block's end."""

    def __init__(self) -> None:
        self.raising = True
        self.asynchronous = False  # raise in the handler: only while nothing but a socket is waited on
        self.pending: int | None = None  # taken, to be raised by the next check()
        self.held: int | None = None

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.raising:
            self.raising = False  # the cleanup this starts is not interrupted again
            if self.asynchronous:
                raise Interrupted(signum)
            self.pending = signum
            return
        if self.held is None:
            self.held = signum

    def check(self) -> None:
        """A safe point of the job: raise the signal taken since, if any."""
        signum, self.pending = self.pending, None
        if signum is not None:
            raise Interrupted(signum)

    def go_asynchronous(self) -> None:
        """From here on the main thread only waits on a socket: raise at once (and now,
        for a signal taken before)."""
        self.asynchronous = True
        self.check()

    def checked(self, progress: ProgressFn) -> ProgressFn:
        """progress, then a check: every progress report is a safe point."""

        def report(done: int, total: int) -> None:
            progress(done, total)
            self.check()

        return report

    def defer(self) -> None:
        """From here on (the job's cleanup), signals are held back until the block ends;
        one taken but not yet raised is raised then."""
        self.raising = False
        self.asynchronous = False
        if self.pending is not None and self.held is None:
            self.held = self.pending
        self.pending = None


@contextlib.contextmanager
def job_signals() -> Iterator[JobSignals]:
    """SIGINT, SIGTERM and SIGHUP stop the block with Interrupted (at its next check(),
    or at once when asynchronous) until defer() is called; after that one is raised
    when the block ends. Outside the main thread (no signal handlers there) the
    block changes nothing."""
    state = JobSignals()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return
    before = {sig: signal.signal(sig, state.handle) for sig in JOB_SIGNALS}
    try:
        yield state
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    state.defer()  # a signal taken after the last check is raised now
    if state.held is not None:
        raise Interrupted(state.held)
