"""The two systemd protocols a service speaks, without a library (both are a few
lines of socket code, as nbdkit and qemu-nbd do them):

- readiness (sd_notify): when $NOTIFY_SOCKET names a unix datagram socket (an
  abstract one when it starts with '@'), a state such as READY=1 or STOPPING=1
  is one datagram sent to it. Without the variable nothing is sent.
- socket activation (sd_listen_fds): when $LISTEN_PID is this process and
  $LISTEN_FDS is N, descriptors 3 .. 3+N-1 are listening sockets made for us,
  named by $LISTEN_FDNAMES. They are taken once: the variables are removed (so
  no child takes them again) and the descriptors made close-on-exec.
"""

from __future__ import annotations

import logging
import os
import socket

from thinblock.errors import ThinblockError

log = logging.getLogger("thinblock.systemd")

LISTEN_FDS_START = 3


def notify(*states: str) -> bool:
    """Send states (READY=1, STOPPING=1, STATUS=...) to the service manager; False
    when there is none ($NOTIFY_SOCKET unset) or it could not be reached (logged)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not states:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        log.warning("NOTIFY_SOCKET %r is neither a path nor an abstract socket: not notifying", address)
        return False
    message = "\n".join(state.replace("\n", " ") for state in states).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message, address)
    except OSError as exc:
        log.warning("cannot notify the service manager at %s: %s", address.lstrip("\0"), exc.strerror or exc)
        return False
    return True


def listen_fds() -> list[tuple[socket.socket, str]]:
    """The listening sockets passed by socket activation, with their names (empty
    when there are none for this process). Each must be a listening stream socket
    (unix or TCP); anything else is refused with one sentence (ThinblockError)."""
    count_text, pid_text = os.environ.get("LISTEN_FDS"), os.environ.get("LISTEN_PID")
    names_text = os.environ.get("LISTEN_FDNAMES")
    if count_text is None:
        return []
    for name in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if pid_text is None or not pid_text.isdigit() or int(pid_text) != os.getpid():
        return []  # meant for another process (a parent that did not take them)
    if not count_text.isdigit():
        raise ThinblockError(f"LISTEN_FDS={count_text!r} from the service manager is not a number of sockets")
    count = int(count_text)
    names = names_text.split(":") if names_text else []
    taken: list[tuple[socket.socket, str]] = []
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + count):
        name = names[fd - LISTEN_FDS_START] if fd - LISTEN_FDS_START < len(names) else "unknown"
        try:
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
        except OSError:
            raise ThinblockError(
                f"descriptor {fd} passed by socket activation (LISTEN_FDS) is not a listening stream socket"
            ) from None
        if (
            sock.family not in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6)
            or sock.type != socket.SOCK_STREAM
            or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        ):
            sock.detach()
            raise ThinblockError(
                f"descriptor {fd} passed by socket activation (LISTEN_FDS) is not a listening stream socket"
            )
        taken.append((sock, name))
    return taken


def describe(sock: socket.socket) -> str:
    """Where a listening socket listens: `unix socket PATH` or `TCP HOST:PORT`."""
    where = sock.getsockname()
    if sock.family == socket.AF_UNIX:
        shown = where.decode(errors="replace") if isinstance(where, bytes) else where
        return f"unix socket {shown.replace(chr(0), '@', 1) if shown.startswith(chr(0)) else shown or '(unnamed)'}"
    host, port = where[0], where[1]
    return f"TCP [{host}]:{port}" if sock.family == socket.AF_INET6 else f"TCP {host}:{port}"
