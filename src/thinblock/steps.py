"""Long steps logged with their timings: a line when a step starts, one for each
part of it as it ends (with the seconds since the start), and one at its end,
or on its failure. A takeover that takes 31 s then shows where the 31 s went.

Each line carries the fields step and elapsed_s, so a JSON log (logsetup) can
be filtered and graphed by them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from thinblock.errors import ThinblockError


class Step:
    """One long step under way (made by timed())."""

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log = log
        self.what = what
        self.started = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def mark(self, done: str, *args: object, level: int = logging.INFO) -> None:
        """Log that a part of the step is done, with the seconds since the step began."""
        elapsed = self.elapsed_s()
        self.log.log(
            level,
            "%s: " + done + " (%.3f s)",
            self.what,
            *args,
            elapsed,
            extra={"step": self.what, "elapsed_s": round(elapsed, 6)},
        )


@contextmanager
def timed(log: logging.Logger, what: str, *, level: int = logging.INFO) -> Iterator[Step]:
    """Log `what: started`, then `what: done in N s` (or `failed after N s`)."""
    step = Step(log, what)
    log.log(level, "%s: started", what, extra={"step": what, "elapsed_s": 0.0})
    try:
        yield step
    except BaseException as exc:
        elapsed = step.elapsed_s()
        # The caller reports a failure of ours itself, in one sentence: this line is
        # the log's timeline, not a second complaint, so it goes at debug for those
        # (and at the step's own level for anything unexpected).
        log.log(
            logging.DEBUG if isinstance(exc, ThinblockError) else level,
            "%s: failed after %.3f s (%s)",
            what,
            elapsed,
            type(exc).__name__ if not str(exc) else exc,
            extra={"step": what, "elapsed_s": round(elapsed, 6)},
        )
        raise
    elapsed = step.elapsed_s()
    log.log(level, "%s: done in %.3f s", what, elapsed, extra={"step": what, "elapsed_s": round(elapsed, 6)})
