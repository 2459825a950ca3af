"""Progress bars for long commands, drawn by tqdm on standard error.

Only on a terminal, and not with --no-progress: a script reading stdout, or
stderr sent to a log, gets no escape codes. The bar appears on the first report
that has something to count, so work that turns out to be instant (recovery on
a pool closed cleanly) shows nothing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from thinblock.progress import ProgressFn, no_progress


def wanted(args: Any) -> bool:
    return not getattr(args, "no_progress", False) and sys.stderr.isatty()


@contextlib.contextmanager
def progress_bar(label: str, enabled: bool, *, unit: str = "B") -> Iterator[ProgressFn]:
    """A ProgressFn drawing `label`: done and total, rate and time left (bytes by default)."""
    if not enabled:
        yield no_progress
        return
    from tqdm import tqdm

    bar: list[Any] = []

    def update(done: int, total: int) -> None:
        if not bar:
            if not total and not done:
                return
            scaled = unit == "B"
            bar.append(
                tqdm(
                    desc=label,
                    total=total or None,
                    unit=unit,
                    unit_scale=scaled,
                    unit_divisor=1024 if scaled else 1000,
                    file=sys.stderr,
                    dynamic_ncols=True,
                )
            )
        shown = bar[0]
        if total and shown.total != total:
            shown.total = total
        shown.update(done - shown.n)

    try:
        yield update
    finally:
        if bar:
            bar[0].close()
