"""Writing a list of buffers completely through a call that may write only part
(pwritev to a file, sendmsg to a socket), IOV_MAX buffers at a time."""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence

IOV_MAX = 1024  # Linux's limit on buffers per vectored call


def write_all(write: Callable[[list[memoryview]], int], buffers: Sequence[bytes | memoryview]) -> None:
    """Call write(views) until every byte is written; write returns how many bytes it took."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        done = write(views[:IOV_MAX])
        if done <= 0:
            raise OSError(errno.EIO, "vectored write made no progress")
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]
