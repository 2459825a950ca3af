"""Where a user's runtime state lives (control and NBD sockets of rados: and
memory: pools, FUSE mounts and daemon records of attach), and the rule that keeps
everyone else out of it.

Whoever controls a runtime directory controls what is in it: a user who makes
/tmp/thinblock-UID before its owner does, or swaps a symlink in for a directory
below it, could read a pool's volumes through its FUSE mount or stand in for its
control socket. So every directory of the tree, from the base down, is checked
when it is opened. It must be a real directory, not a symlink, owned by this
user, and mode 0700. One that is ours with a wider mode is narrowed to 0700.
Anything else is refused with one sentence, never used.

A directory goes when its last user goes (release_runtime_dir), so that folders
under /run/thinblock do not pile up after servers stop and devices are detached.

The base: THINBLOCK_RUNTIME_DIR when set. Otherwise /run/thinblock for root (one
place for every root shell, whatever its environment), $XDG_RUNTIME_DIR/thinblock
for a user who has one (the login's own private directory), else
/tmp/thinblock-UID.
"""

from __future__ import annotations

import contextlib
import os
import stat

from thinblock.errors import ThinblockError
from thinblock.privacy import PRIVATE_DIR

# The sockets a pool's runtime directory holds (a directory pool's is the pool
# directory itself): the server's control socket, and serve's default NBD socket.
CONTROL_SOCKET = "control.sock"
NBD_SOCKET = "nbd.sock"
# sockaddr_un's sun_path is 108 bytes with its terminating NUL: a longer path cannot
# be bound, and no client (libnbd, qemu, nbdinfo) can connect to it.
SOCKET_PATH_MAX = 107


def socket_path_problem(path: str) -> str | None:
    """Why no unix socket can live at path (its absolute form is too long), or None."""
    length = len(os.fsencode(os.path.abspath(path)))
    if length <= SOCKET_PATH_MAX:
        return None
    return f"{length} bytes long, beyond the {SOCKET_PATH_MAX} a unix socket path can have"


def require_socket_room(runtime_dir: str, shorter: str) -> None:
    """ThinblockError unless every socket of a pool's runtime directory fits
    sockaddr_un; shorter says how to get a shorter path."""
    sock = os.path.join(runtime_dir, max((CONTROL_SOCKET, NBD_SOCKET), key=len))
    problem = socket_path_problem(sock)
    if problem:
        raise ThinblockError(f"the pool could not be served: its control socket {sock} would be {problem}; {shorter}")


def runtime_base() -> str:
    """The base of this user's runtime tree (a path; nothing is created)."""
    chosen = os.environ.get("THINBLOCK_RUNTIME_DIR")
    if chosen:
        return os.path.abspath(chosen)
    if os.geteuid() == 0:
        return "/run/thinblock"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg):
        return os.path.join(xdg, "thinblock")
    return f"/tmp/thinblock-{os.geteuid()}"


def private_runtime_dir(*parts: str) -> str:
    """base/PARTS..., each directory made 0700 if missing and checked (ours, not a
    symlink, 0700) whether made or found; returns its path. Each step opens the
    next directory relative to the one checked before it, without following
    symlinks, so nothing can be swapped in between the check and the use."""
    base = runtime_base()
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\0" in part:
            raise ThinblockError(f"{part!r} cannot name a directory under the runtime directory {base}")
    parent, top = os.path.split(base)
    os.makedirs(parent, exist_ok=True)  # /run, /tmp, $XDG_RUNTIME_DIR or the chosen one's parents
    path = parent
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in (top, *parts):
            path = os.path.join(path, name)
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, PRIVATE_DIR, dir_fd=fd)
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                raise _refusal(path, fd, name, exc) from None
            os.close(fd)
            fd = child
            _check(path, fd)
    finally:
        os.close(fd)
    return path


def release_runtime_dir(path: str) -> bool:
    """Remove path, a directory of the runtime tree, when its last user is gone: every
    holder (serve's NBD socket, a control socket, a hosted FUSE mount) calls this after
    removing its own file there, and rmdir succeeds only for the one that leaves it
    empty, so nobody's socket is ever taken from under it. Only directories strictly
    below the runtime base are touched (a directory pool's sockets live in the pool's
    own directory, which is never removed); the base and the shared levels above a
    pool's directory (rados/, rados/CEPHPOOL/) stay, a handful whatever happens.
    True when it was removed (or was not there)."""
    base = runtime_base()
    path = os.path.abspath(path)
    if os.path.dirname(path) == path or os.path.commonpath([base, path]) != base or path == base:
        return False
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError:  # not empty (someone still uses it), or not ours to remove
        return False
    return True


def _check(path: str, fd: int) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise ThinblockError(
            f"the runtime directory {path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}): another"
            " user made it, so thinblock will not use it; remove it or set THINBLOCK_RUNTIME_DIR to a directory"
            " of your own"
        )
    if stat.S_IMODE(st.st_mode) != PRIVATE_DIR:
        try:
            os.fchmod(fd, PRIVATE_DIR)
        except OSError as exc:
            raise ThinblockError(
                f"the runtime directory {path} has mode {stat.S_IMODE(st.st_mode):04o} and cannot be made 0700:"
                f" {exc.strerror}"
            ) from None


def _refusal(path: str, dir_fd: int, name: str, exc: OSError) -> ThinblockError:
    """The sentence for a runtime path that could not be opened as a directory."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        return ThinblockError(
            f"the runtime directory {path} is a symbolic link (to {os.readlink(name, dir_fd=dir_fd)}): thinblock"
            " never follows one there; remove it"
        )
    if st is not None and not stat.S_ISDIR(st.st_mode):
        return ThinblockError(f"the runtime directory {path} is not a directory: remove it")
    return ThinblockError(f"cannot open the runtime directory {path}: {exc.strerror}")
