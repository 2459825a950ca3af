"""Connections handed between the worker processes of one server (serve --workers).

`thinblock serve POOL --workers N` runs N processes that own the pool's volumes
between them (ownership per volume, core/owner.py) and accept on the same
listening sockets. Any worker may accept a connection; once an option names an
export (INFO, GO, EXPORT_NAME, a META_CONTEXT option), the export's owner
serves it. If that is a sibling, the protocol core leaves the option unanswered
(a Route event) and the connection moves: its socket, with what was
negotiated, goes to the sibling over a unix socket (SCM_RIGHTS), and the
sibling answers that option as if it had been there from the start.

A TLS session cannot move between processes (Python's ssl has no kernel TLS),
so a TLS connection stays with the worker that accepted it: it hands the
sibling one end of a socket pair, with the client's certificate for
--tls-authz, and relays the bytes (server.relay).

Each worker listens for hand-overs on an abstract unix socket named after the
group (the supervising process's pid) and its own pid; a volume's owner is
found from its lease (the holder names its pid), so a worker restarted under a
new pid, or a volume moved by a handover, is followed without any table. A
hand-over is accepted only from a process of the same user whose parent is the
group's supervisor: it carries the client's identity, which must not be forged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
import threading
from typing import Any

from thinblock.core.owner import owner_pid
from thinblock.core.pool import Pool
from thinblock.core.registry import STAGING_PREFIX
from thinblock.core.volume import Volume
from thinblock.errors import ThinblockError
from thinblock.frontends.nbd.protocol import ExportElsewhere, ExportRouted
from thinblock.frontends.nbd.server import Handed, NBDServer, PoolCatalog
from thinblock.listen import accept_loop
from thinblock.meta.base import VolumeBusyError, VolumeRow

log = logging.getLogger("thinblock.nbd")

MAX_MESSAGE_BYTES = 512 << 10  # a hand-over: one option (64 KiB at most) and what was negotiated
HANDOFF_TIMEOUT_S = 5.0
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


def handoff_address(group: int, pid: int) -> str:
    """The abstract unix socket where worker pid of group takes hand-overs."""
    return f"\0thinblock-nbd-worker.{group}.{pid}"


def parent_pid(pid: int) -> int | None:
    """The parent of a process on this host, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # After "pid (comm) state ": comm may hold spaces and parentheses, so split after the last ")".
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


class WorkerGroup:
    """This worker's view of its siblings: which pids belong to the group."""

    def __init__(self, group: int) -> None:
        self.group = group

    def member(self, pid: int) -> bool:
        return pid != os.getpid() and parent_pid(pid) == self.group


class GroupCatalog(PoolCatalog):
    """A worker's exports: its own volumes (and their snapshots) are served here; one
    a sibling owns is routed to it; a listing names the whole group's. Names this
    worker's registry does not know yet (a snapshot a sibling took since) are looked
    up in the store, whose leases say who owns what."""

    def __init__(self, pool: Pool, *, read_only: bool, group: WorkerGroup, claims: bool = False) -> None:
        """claims: the group serves every volume no other server holds (`serve POOL
        --workers N` without --volume), so a volume nobody holds (made since the workers
        started, or left by a server that stopped) is claimed by the worker a client
        asks, and served there."""
        super().__init__(pool, read_only=read_only)
        self.group = group
        self.claims = claims

    def _sibling(self, base_id: int | None) -> str | None:
        """The pid (as text) of the sibling holding volume base_id, if one does."""
        if base_id is None:
            return None
        try:
            holder = self.pool.meta.volume_holder(base_id)
        except (OSError, ThinblockError):
            return None
        pid = owner_pid(holder) if holder else None
        return str(pid) if pid is not None and self.group.member(pid) else None

    def elsewhere(self, vol: Volume) -> Volume:
        claimed = self._route_or_claim(vol.name)
        if claimed is not None:
            return claimed
        return super().elsewhere(vol)

    def unknown(self, name: str) -> Volume | None:
        return self._route_or_claim(name)

    def _route_or_claim(self, name: str) -> Volume | None:
        """For an export this worker does not serve: ExportRouted to the sibling holding
        its volume; else, claiming, that volume taken here, and the export (None if it
        does not exist, or another server holds it)."""
        rows = self._stored_rows()
        row = next((r for r in rows.values() if r.name == name), None)
        if row is None or name.startswith(STAGING_PREFIX):
            return None
        base = _base_id(row, rows)
        target = self._sibling(base)
        if target is not None:
            raise ExportRouted(target, name)
        holder = None if base is None else self._holder(base)
        if holder is not None:  # another server's: say whose, as for a volume known here
            raise ExportElsewhere(f"{row.kind} {name} is not served here: it is served by {holder}")
        if not self.claims or base is None:
            return None
        try:
            self.pool.claim_volume(rows[base].name)
        except VolumeBusyError:  # a sibling was quicker: it serves it now
            target = self._sibling(base)
            if target is not None:
                raise ExportRouted(target, name) from None
            return None
        except (OSError, ThinblockError) as exc:
            log.warning("claiming volume %s for a client failed: %s", rows[base].name, exc)
            return None
        with self.pool.lock:
            vol = self.pool.visible_volume(name)
        return vol if vol is not None and self.pool.serves(vol) else None

    def _holder(self, base_id: int) -> str | None:
        try:
            return self.pool.meta.volume_holder(base_id)
        except (OSError, ThinblockError):
            return None

    def list_names(self) -> list[tuple[str, str]]:
        """This worker's exports and its siblings', sorted by name."""
        mine = super().list_names()
        names = {name for name, _ in mine}
        rows = self._stored_rows()
        theirs: dict[int, bool] = {}  # base volume id -> held by a sibling
        for row in rows.values():
            if row.name in names or row.name.startswith(STAGING_PREFIX):
                continue
            base = _base_id(row, rows)
            if base is None:
                continue
            if base not in theirs:
                theirs[base] = self._sibling(base) is not None
            if theirs[base]:
                mine.append((row.name, _describe_row(row, rows)))
        mine.sort()
        return mine

    def _stored_rows(self) -> dict[int, VolumeRow]:
        try:
            return {row.id: row for row in self.pool.meta.volumes()}
        except (OSError, ThinblockError):
            return {}


def _base_id(row: VolumeRow, rows: dict[int, VolumeRow]) -> int | None:
    """The volume a snapshot was taken of, through snapshots of snapshots (its owner's)."""
    seen = 0
    while row.kind == "snapshot":
        origin = rows.get(row.origin_id) if row.origin_id is not None else None
        if origin is None or seen > len(rows):
            return None
        row, seen = origin, seen + 1
    return row.id


def _describe_row(row: VolumeRow, rows: dict[int, VolumeRow]) -> str:
    if row.kind != "snapshot":
        return f"thinblock volume {row.name}"
    origin = rows.get(row.origin_id) if row.origin_id is not None else None
    return f"thinblock snapshot {row.name} of {origin.name if origin else 'a removed volume'}"


class Handoffs:
    """The hand-over endpoint of one worker (taking connections from siblings) and its
    router (sending them): the server's Router."""

    def __init__(self, server: NBDServer, group: WorkerGroup) -> None:
        self.server = server
        self.group = group
        self.stopping = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.listener.bind(handoff_address(group.group, os.getpid()))
        self.listener.listen(64)
        self.thread = threading.Thread(target=self._accept, name="thinblock-nbd-handoff", daemon=True)
        self.thread.start()
        server.router = self

    # ----- sending ------------------------------------------------------------------

    def send(self, target: str, sock: socket.socket, handed: Handed) -> None:
        pid = int(target)
        if not self.group.member(pid):
            raise ThinblockError(f"worker pid {pid} is not running")
        message = json.dumps(
            {
                "state": handed.state,
                "peer": handed.peer,
                "address": handed.address,
                "tls": handed.tls,
                "peercert": handed.peercert,
                "via": handed.via,
                "hops": handed.hops,
            }
        ).encode()
        if len(message) > MAX_MESSAGE_BYTES:
            raise ThinblockError("the client sent too much ahead of its replies to be handed over")
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as ctl:
            ctl.settimeout(HANDOFF_TIMEOUT_S)
            ctl.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 2 * MAX_MESSAGE_BYTES)
            ctl.connect(handoff_address(self.group.group, pid))
            socket.send_fds(ctl, [message], [sock.fileno()])
            answer = ctl.recv(4096)
        if answer != b"ok":
            raise ThinblockError(answer.decode(errors="replace").removeprefix("no: ") or "it closed")

    # ----- taking -------------------------------------------------------------------

    def _accept(self) -> None:
        accept_loop(self.listener, self.stopping, self._take_safely, log, "the worker hand-over socket")

    def _take_safely(self, ctl: socket.socket) -> None:
        try:
            with ctl:
                ctl.settimeout(HANDOFF_TIMEOUT_S)
                answer = self._take(ctl)
                with contextlib.suppress(OSError):
                    ctl.sendall(b"ok" if answer is None else b"no: " + answer.encode()[:4000])
        except Exception:
            log.exception("dropped a connection handed over by a sibling: internal error")

    def _take(self, ctl: socket.socket) -> str | None:
        pid, uid, _gid = _UCRED.unpack(ctl.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        trusted = uid == os.geteuid() and self.group.member(pid)
        message, fds, _flags, _addr = socket.recv_fds(ctl, MAX_MESSAGE_BYTES, 1)
        if not fds:
            return "no connection came with the hand-over"
        sock = socket.socket(fileno=fds[0])
        if not trusted:
            sock.close()
            log.warning("refused a hand-over from pid %d (uid %d): not a worker of this server", pid, uid)
            return "not a worker of this server"
        try:
            fields: dict[str, Any] = json.loads(message)
            peercert = fields["peercert"]
            handed = Handed(
                state=dict(fields["state"]),
                peer=str(fields["peer"]),
                address=None if fields["address"] is None else str(fields["address"]),
                tls=bool(fields["tls"]),
                peercert=_tuples(peercert) if isinstance(peercert, dict) else None,
                via=str(fields["via"]),
                hops=int(fields["hops"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            sock.close()
            return f"malformed hand-over: {exc}"
        refused = self.server.adopt(sock, handed)
        if refused is not None:
            sock.close()
        return refused

    def close(self) -> None:
        self.stopping.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join()


def _tuples(value: Any) -> Any:
    """A certificate as ssl.getpeercert() gives it (tuples, which authz.py expects),
    from its JSON form (lists)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value
