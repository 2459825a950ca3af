"""How long work tells its caller how far it has got.

A job calls `progress(done, total)` (bytes, or whatever unit it counts in) now
and then and once at the end; the caller draws a bar on a terminal
(frontends/cli/progress.py), sends a line to a control client, or ignores it.
A progress function may raise to cancel the work (the client went away): the
work stops between steps, as after any failure.
"""

from __future__ import annotations

from collections.abc import Callable

ProgressFn = Callable[[int, int], None]


def no_progress(done: int, total: int) -> None:
    """A ProgressFn that shows nothing."""
