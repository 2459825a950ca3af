"""The space of the host filesystem under a pool, and the slack that keeps commits possible.

A sparse data file lets a pool promise more than the host disk holds. When the
host fills up, two things must still work: the metadata commit (it is what
makes freed space safe to punch, and what makes acknowledged writes durable),
and the return of freed space. So the pool keeps *metadata slack*: a file
`POOL/metadata.slack` of preallocated host space. When a commit fails because
the host is full, the slack file is emptied and the commit retried; from then
on the pool refuses new allocations (ENOSPC) until the slack could be taken
back, which happens after a commit as soon as the host has that much room
again (trims punched, or space freed by someone else). While the slack is
out, reads, overwrites of mapped blocks, trims and flushes all keep working.

This module also answers what the host can hold: its free bytes, and whether a
pool size fits (for the warnings of `pool create` and `pool grow`).
"""

from __future__ import annotations

import logging
import os
import threading

from thinblock.errors import ThinblockError
from thinblock.privacy import create_private_file
from thinblock.sizes import format_size
from thinblock.store.file import fallocate

log = logging.getLogger("thinblock.host")

SLACK_FILE = "metadata.slack"
MIN_SLACK_BYTES = 4 << 20
MAX_SLACK_BYTES = 64 << 20


def default_slack_bytes(pool_size_bytes: int) -> int:
    """1/64 of the pool, between 4 MiB and 64 MiB: one commit of a busy second fits."""
    return max(MIN_SLACK_BYTES, min(MAX_SLACK_BYTES, pool_size_bytes // 64))


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer can still put on the filesystem holding path."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def beyond_file_limit(size_bytes: int, pool_dir: str) -> ThinblockError:
    """The one sentence for a pool size the host filesystem cannot hold in one file (EFBIG)."""
    return ThinblockError(
        f"pool size {format_size(size_bytes)} is beyond the largest file the filesystem under {pool_dir} can hold"
    )


def allocated_bytes(path: str) -> int:
    """Host bytes a (sparse) file occupies."""
    return os.stat(path).st_blocks * 512


class HostSpace:
    """The host filesystem under one pool directory and its metadata slack."""

    def __init__(self, pool_dir: str, slack_bytes: int, *, data_on_device: bool) -> None:
        self.pool_dir = pool_dir
        self.slack_bytes = slack_bytes
        self.data_on_device = data_on_device
        self.slack_path = os.path.join(pool_dir, SLACK_FILE)
        self.slack_released = False
        self._lock = threading.Lock()

    def below_status(self) -> dict[str, object]:
        """Figures of the layer below for `pool status` beyond the host's free bytes."""
        return {}

    def host_free_bytes(self) -> int | None:
        """What the layer below can still take for data: None for a raw device (the
        pool's own free space is all there is)."""
        if self.data_on_device:
            return None
        return free_bytes(self.pool_dir)

    def take_slack(self) -> bool:
        """Preallocate the slack file; False (and the slack counted as released) when
        the host has not got the room."""
        with self._lock:
            try:
                fd = create_private_file(self.slack_path, exclusive=False)
            except OSError as exc:
                log.error("cannot create metadata slack %s: %s", self.slack_path, exc.strerror)
                self.slack_released = True
                return False
            try:
                fallocate(fd, 0, 0, self.slack_bytes)
            except OSError as exc:
                os.ftruncate(fd, 0)
                was = self.slack_released
                self.slack_released = True
                if not was:
                    log.warning(
                        "pool %s: no room for %d bytes of metadata slack on the host (%s);"
                        " new space is refused until there is",
                        self.pool_dir,
                        self.slack_bytes,
                        exc.strerror,
                    )
                return False
            finally:
                os.close(fd)
            if self.slack_released:
                log.warning("pool %s: metadata slack is back; new space can be allocated again", self.pool_dir)
            self.slack_released = False
            return True

    def release_slack(self) -> bool:
        """The host is full and a commit needs room: empty the slack file. Whether
        there was slack to give (if not, the commit fails)."""
        with self._lock:
            if self.slack_released:
                return False
            self.slack_released = True
            try:
                os.truncate(self.slack_path, 0)
            except OSError as exc:
                log.error("cannot release metadata slack %s: %s", self.slack_path, exc.strerror)
                return False
            log.warning(
                "pool %s: the host disk is full; released %d bytes of metadata slack for the commit."
                " New space is refused until freed space returns",
                self.pool_dir,
                self.slack_bytes,
            )
            return True

    def after_commit(self) -> None:
        """Take the slack back once the host has room for it (and a little more)."""
        if self.slack_released:
            free = free_bytes(self.pool_dir)
            if free >= 2 * self.slack_bytes:
                self.take_slack()

    def capacity_warning(self, size_bytes: int, data_path: str) -> str | None:
        """A sentence when a sparse pool of size_bytes is larger than the host can hold."""
        if self.data_on_device:
            return None
        room = free_bytes(self.pool_dir) + allocated_bytes(data_path)
        if size_bytes <= room:
            return None
        return (
            f"pool {self.pool_dir} ({format_size(size_bytes)}) is larger than the host filesystem under it"
            f" can hold ({format_size(room)} of data): writes will fail with ENOSPC before the pool is full"
        )


class NoHostSpace(HostSpace):
    """A layer below with no host filesystem to watch and no slack (memory pools)."""

    def __init__(self) -> None:
        super().__init__("", 0, data_on_device=True)

    def host_free_bytes(self) -> int | None:
        return None

    def take_slack(self) -> bool:
        return True

    def release_slack(self) -> bool:
        return False

    def after_commit(self) -> None:
        return None

    def capacity_warning(self, size_bytes: int, data_path: str) -> str | None:
        return None
