"""Listening sockets every server uses: unix sockets private from their first
instant, and the accept() errors a listener survives.

A unix socket gets its mode (0600 unless the user shares it with a group) and
group before anyone can connect: it is bound in a private directory and renamed
into place. An existing path is replaced only if it is a dead server's socket.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable

from thinblock.privacy import PRIVATE_FILE
from thinblock.runtime import socket_path_problem

LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn

# accept() errors that pass (out of descriptors or memory, a client gone before it
# was accepted): the listener is fine; pause and go on accepting.
ACCEPT_RETRY = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED, errno.EPROTO}


def accept_loop(
    listener: socket.socket,
    stopping: threading.Event,
    handle: Callable[[socket.socket], None],
    log: logging.Logger,
    what: str,
) -> None:
    """Hand each accepted connection to handle until stopping is set or the listener
    closes. An error in ACCEPT_RETRY is logged once, then accepting is retried after a
    pause growing from 50 ms to 1 s, so a listener never dies of a passing shortage."""
    pause = 0.0
    while not stopping.is_set():
        try:
            sock, _addr = listener.accept()
        except TimeoutError:  # a listener with a timeout (shared by workers): look at stopping
            continue
        except OSError as exc:
            if stopping.is_set() or exc.errno not in ACCEPT_RETRY:
                return  # the listener was closed: shutting down
            if not pause:
                log.error("%s cannot accept connections (%s): retrying until it clears", what, exc.strerror)
            pause = min(1.0, pause * 2 or 0.05)
            stopping.wait(pause)
            continue
        if pause:
            log.info("%s is accepting connections again", what)
            pause = 0.0
        handle(sock)


def bind_unix(path: str, *, mode: int = PRIVATE_FILE, gid: int | None = None, live_ok: bool = False) -> socket.socket:
    """A unix socket bound at path with exactly `mode` (and group `gid`) from its first
    instant: it is bound in a fresh 0700 directory beside path, given its mode and
    group there, then renamed into place (replacing a dead server's socket atomically).

    An existing path is refused unless it is a socket nobody listens on (live_ok: the
    caller holds the pool lock, so a socket there is its own dead predecessor's); a
    symlink is never followed or replaced."""
    problem = socket_path_problem(path)
    if problem:
        raise OSError(errno.ENAMETOOLONG, f"its path {path} is {problem}")
    check_socket_path(path, live_ok=live_ok)
    workdir = tempfile.mkdtemp(prefix=".tb", dir=os.path.dirname(os.path.abspath(path)))
    tmp = os.path.join(workdir, "s")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dir_fd = os.open(workdir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # Bound through /proc/self/fd, always short: the temporary name is longer
        # than the final one, and must not be what makes a path too long.
        sock.bind(f"/proc/self/fd/{dir_fd}/s")
        os.chmod(tmp, mode)
        if gid is not None:
            os.chown(tmp, -1, gid)
        os.rename(tmp, path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(dir_fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        os.rmdir(workdir)
    return sock


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound at host:port (IPv6 for a host with a colon), not listening yet."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def listening_addresses(socks: list[socket.socket]) -> tuple[str | None, tuple[str, int] | None]:
    """The first unix socket path and the first TCP (host, port) among listening
    sockets (those of socket activation), for the export URIs."""
    unix_path: str | None = None
    tcp: tuple[str, int] | None = None
    for sock in socks:
        name = sock.getsockname()
        if isinstance(name, str):  # a unix socket (an abstract one has bytes)
            unix_path = unix_path or name or None
        elif isinstance(name, tuple):
            tcp = tcp or (str(name[0]), int(name[1]))
    return unix_path, tcp


def remove_socket(path: str, inode: int | None) -> None:
    """Remove the unix socket at path if it is still the one bound there (its inode):
    never a newer server's."""
    with contextlib.suppress(OSError):
        if os.stat(path).st_ino == inode:
            os.unlink(path)


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected unix socket, as the
    kernel recorded them when it connected or listened (SO_PEERCRED)."""
    pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


def listener_pid(path: str) -> int | None:
    """The pid of the process listening on a unix socket, None if none."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2)
    try:
        probe.connect(path)
        return peer_credentials(probe)[0]
    except OSError:
        return None
    finally:
        probe.close()


def wait_for_socket_path(path: str, timeout_s: float) -> None:
    """Wait (bounded) until no live server listens on path (a server handing its last
    volume over stops); FileExistsError if one still does."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check_socket_path(path)
            return
        except FileExistsError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
        time.sleep(0.05)


def check_socket_path(path: str, *, live_ok: bool = False) -> None:
    """Refuse (FileExistsError) a path holding anything but a dead server's socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "it is a symlink; not following or replacing it")
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "something other than a socket is there; not replacing it")
    if live_ok:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2)
    try:
        probe.connect(path)
    except OSError:
        return  # nobody listens: a dead server's socket, safe to replace
    finally:
        probe.close()
    raise FileExistsError(errno.EADDRINUSE, "a live server is listening on it")
