"""Open-file-description byte-range locks (F_OFD_SETLK), the one lock primitive of
directory pools: the pool's lock file (backends/directory.py) and the per-volume
leases (meta/sqlite.py).

An OFD lock belongs to one open file description, not to a process: it dies with
the last descriptor of it (so with a killed process at once), closing some other
descriptor of the same file never drops it, and two descriptors in one process
exclude each other (so threads can hold different ones). Byte ranges of one
descriptor are locked and unlocked independently.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

# struct flock on Linux: l_type, l_whence (short), l_start, l_len (off_t), l_pid (pid_t).
_FLOCK = "hh4xqqi4x"


def lock_range(fd: int, start: int = 0, length: int = 0, *, wait: bool = False, shared: bool = False) -> bool:
    """Take a write lock (shared: a read lock) on [start, start + length) (length 0: to
    the end of any file); False if another description holds a lock on part of it that
    conflicts (with wait, block until it is free)."""
    command = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
    kind = fcntl.F_RDLCK if shared else fcntl.F_WRLCK
    try:
        fcntl.fcntl(fd, command, struct.pack(_FLOCK, kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock_range(fd: int, start: int = 0, length: int = 0) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, start, length, 0))


def range_lock_shared(fd: int, start: int = 0, length: int = 0) -> bool:
    """Whether what another description holds on part of the range is a read lock."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    return bool(struct.unpack(_FLOCK, got)[0] == fcntl.F_RDLCK)


def range_locked(fd: int, start: int = 0, length: int = 0) -> bool:
    """Whether some other open file description holds a lock on part of the range."""
    got = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    return bool(struct.unpack(_FLOCK, got)[0] != fcntl.F_UNLCK)
