"""The file an export or export-diff writes: private unless asked, never written
through a symlink, never another user's file written into.

An exported image holds every byte of a volume, so it is made 0600 (whatever the
umask) unless --mode says otherwise. A path that is a symlink is refused, even
with --force: a link planted in a shared directory such as /tmp would send the
volume wherever its maker chose. An existing regular file is not truncated and
written in place (it may be someone else's, opened for them to read). The
export goes to a new file beside it, which is renamed over it once the job has
succeeded, so a failed export leaves the old file as it was. A new file is
written beside its name too, and linked there (never over a file that appeared
meanwhile) once the job has succeeded: a raw export is made its full size
first, so a file at DEST from an export killed half way (SIGKILL, a power cut)
would look whole, its missing blocks reading as zeros. A killed export leaves
only the hidden `.NAME.thinblock-*` file. A block device named with --force is
written in place, as before.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import stat
import uuid
from dataclasses import dataclass

from thinblock.frontends.cli.common import UsageError

DEFAULT_MODE = 0o600


def mode_arg(text: str) -> int:
    """--mode: an octal file mode such as 600 or 0640 (permission bits only)."""
    try:
        mode = int(text, 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid mode {text!r}: an octal file mode such as 600 or 0640") from None
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(
            f"invalid mode {text!r}: permission bits only (at most 0777, no setuid, setgid or sticky)"
        )
    return mode


@dataclass
class Destination:
    """An open destination: write to fd; commit() puts it in place, discard() undoes it."""

    fd: int
    path: str
    temp: str | None  # the file written, put at path by commit (None: written in place)
    created: bool  # path did not exist: commit links temp there, never over a file that appeared

    def commit(self) -> None:
        if self.temp is not None:
            try:
                if self.created:
                    self._link()
                else:
                    os.rename(self.temp, self.path)
            except FileExistsError:
                self.discard()
                raise UsageError(
                    f"{self.path} appeared while it was being written: pass --force to overwrite it"
                ) from None
            except OSError as exc:
                self.discard()
                raise UsageError(f"cannot replace {self.path}: {exc.strerror}; it is left as it was") from None
            self.temp = None
            with contextlib.suppress(OSError):
                dir_fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY | os.O_DIRECTORY)
                try:
                    os.fsync(dir_fd)  # the rename is durable too
                finally:
                    os.close(dir_fd)

    def _link(self) -> None:
        """temp at path, which must not exist; temp's own name goes."""
        assert self.temp is not None
        try:
            os.link(self.temp, self.path, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            # No hard links here (vfat, some FUSE file systems): the name was free
            # when the export started, and a rename replaces, never writes into.
            if os.path.lexists(self.path):
                raise FileExistsError(errno.EEXIST, "exists") from None
            os.rename(self.temp, self.path)
            return
        with contextlib.suppress(OSError):
            os.unlink(self.temp)

    def discard(self) -> None:
        if self.temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.temp)


def _refuse_link(dest: str) -> UsageError:
    try:
        target = os.readlink(dest)
    except OSError:
        target = "somewhere"
    return UsageError(
        f"{dest} is a symbolic link (to {target}): thinblock never writes through one; give the file itself"
    )


def open_destination(dest: str, *, force: bool, mode: int | None) -> Destination:
    """Open the file DEST for an export (see the module's docstring)."""
    try:
        st: os.stat_result | None = os.lstat(dest)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UsageError(f"cannot create {dest}: {exc.strerror}") from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise _refuse_link(dest)
    if st is not None and not force:
        raise UsageError(f"{dest} exists: pass --force to overwrite it")
    if st is not None and stat.S_ISBLK(st.st_mode):
        if mode is not None:
            raise UsageError(f"--mode applies to files: {dest} is a block device")
        try:
            fd = os.open(dest, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise UsageError(f"cannot open {dest}: {exc.strerror}") from None
        return Destination(fd, dest, temp=None, created=False)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{dest} is neither a regular file nor a block device")
    # A new file beside DEST, put in place by commit (see the module's docstring).
    # O_EXCL never follows a symlink, even one planted between the lstat and this open.
    head, tail = os.path.split(dest)
    where = os.path.join(head, f".{tail}.thinblock-{uuid.uuid4().hex[:12]}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(where, flags, DEFAULT_MODE)
    except FileExistsError:
        if os.path.islink(where):
            raise _refuse_link(where) from None
        raise UsageError(f"{dest} appeared while it was being created: pass --force to overwrite it") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse_link(where) from None
        raise UsageError(f"cannot create {dest}: {exc.strerror}") from None
    os.fchmod(fd, DEFAULT_MODE if mode is None else mode)  # exactly that, whatever the umask
    return Destination(fd, dest, temp=where, created=st is None)
