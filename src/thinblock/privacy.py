"""Private by default: the pool's owner is the trust boundary.

Every file thinblock creates for a pool (data, metadata and its journal files,
lock, slack, logs) is mode 0600 and every directory it creates 0700, whatever
the umask: anyone who can read a pool file can read every volume. Creation
never follows a symlink. (Sockets: listen.py.)
"""

from __future__ import annotations

import contextlib
import os
import stat

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def create_private_file(path: str, *, exclusive: bool = True) -> int:
    """Open path for writing, created 0600 (exclusive: it must not exist); a symlink is refused."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_EXCL if exclusive else 0)
    fd = os.open(path, flags, PRIVATE_FILE)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != PRIVATE_FILE:
            # An older, wider file becomes private; a umask of 0777 had left the owner out.
            os.fchmod(fd, PRIVATE_FILE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def touch_private(path: str) -> None:
    """Create path empty and 0600 (it must not exist)."""
    os.close(create_private_file(path))


def make_private_dir(path: str, *, tighten: bool = False) -> None:
    """Create path (and parents, which keep the umask's mode) as a 0700 directory.
    An existing one is left as it is, unless tighten: then one of ours is made 0700
    (a directory that becomes a pool's, or one an older thinblock made wider)."""
    if os.path.isdir(path):
        st = os.stat(path)
        if tighten and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != PRIVATE_DIR:
            os.chmod(path, PRIVATE_DIR)
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, PRIVATE_DIR)
    os.chmod(path, PRIVATE_DIR)


def open_to_others(path: str) -> str | None:
    """'readable' / 'writable' / 'accessible' when users other than the owner may get at
    the file or directory through its mode (group or world bits), else None."""
    try:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
    except OSError:
        return None
    if mode & 0o044:
        return "readable"
    if mode & 0o022:
        return "writable"
    if os.path.isdir(path) and mode & 0o011:
        return "accessible"
    return None
