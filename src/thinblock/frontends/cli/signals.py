"""SIGTERM and SIGHUP stop a command's job the way Ctrl-C (SIGINT) does.

systemd, `timeout` and `kill` send SIGTERM, and a closed terminal sends SIGHUP;
by default they end the process where it stands, with no cleanup: no staging
volume removed, no control socket taken away, no final commit. While a job
runs, all three raise `Interrupted` (a KeyboardInterrupt) in the main thread, so
the job unwinds as for Ctrl-C: the job is cancelled, what it made is removed,
the pool is closed and the runtime files go. Once the job has ended (or the
first signal is being handled), further signals wait until the cleanup is
done, so that a second Ctrl-C or SIGTERM cannot cut the cleanup short. The
command then exits with 128 + the signal's number (130, 143, 129), as a shell
reports a process killed by it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A job stopped by a signal; signum says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class JobSignals:
    """The state of one job_signals() block: raising, or holding a signal back."""

    def __init__(self) -> None:
        self.raising = True
        self.held: int | None = None

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.raising:
            self.raising = False  # the cleanup this starts is not interrupted again
            raise Interrupted(signum)
        if self.held is None:
            self.held = signum

    def defer(self) -> None:
        """From here on (the job's cleanup), signals are held back until the block ends."""
        self.raising = False


@contextlib.contextmanager
def job_signals() -> Iterator[JobSignals]:
    """SIGINT, SIGTERM and SIGHUP raise Interrupted inside the block until defer() is
    called; after that one is raised when the block ends. Outside the main thread
    (no signal handlers there) the block changes nothing."""
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
    if state.held is not None:
        raise Interrupted(state.held)
