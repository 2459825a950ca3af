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

Each worker listens for hand-overs on a unix socket named after its pid in a
directory the supervisor made private (0700) for the group; a volume's owner is
found from its lease (the holder names its pid), so a worker restarted under a
new pid, or a volume moved by a handover, is followed without any table. Both
ends check who is at the other (SO_PEERCRED): a hand-over goes only to the pid
that owns the volume and is taken only from a process of the same user whose
parent is the group's supervisor, since it carries the client's identity. Once
the socket has been sent it belongs to the receiver alone: the sender never
writes to the client again, and a receiver that cannot serve it answers the
pending option itself.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import struct
import threading
import time
from typing import Any

from thinblock.core.owner import owner_pid
from thinblock.core.pool import Pool
from thinblock.core.registry import STAGING_PREFIX, base_row_id
from thinblock.core.volume import Volume
from thinblock.errors import ThinblockError
from thinblock.frontends.nbd.protocol import ExportElsewhere, ExportRouted, RemoteProtocolError, ServerConnection
from thinblock.frontends.nbd.server import Handed, NBDServer, PoolCatalog, describe_row
from thinblock.listen import accept_loop, peer_credentials
from thinblock.meta.base import VolumeBusyError, VolumeRow

log = logging.getLogger("thinblock.nbd")

MAX_MESSAGE_BYTES = 512 << 10  # a hand-over: one option (64 KiB at most) and what was negotiated
HANDOFF_TIMEOUT_S = 5.0


HANDED_OVER_GRACE_S = 30.0  # a volume handed over is left to its taker this long
SPARE_FILE = "spare"  # in the group's directory: the pid of the worker that claims next (a worker per volume)
SPARE_WAIT_S = 30.0  # how long a lookup waits for the supervisor's next spare worker


def handed_over_mark(directory: str, volume_id: int) -> str:
    """A file whose time says when a worker of the group handed volume_id over."""
    return os.path.join(directory, f"handed-over.{volume_id}")


def handoff_address(directory: str, pid: int) -> str:
    """The unix socket where worker pid of the group whose private directory this is
    takes hand-overs."""
    return os.path.join(directory, f"{pid}.sock")


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
    """This worker's view of its siblings: which pids belong to the group (children of
    its supervisor), and the private directory of their hand-over sockets."""

    def __init__(self, group: int, directory: str) -> None:
        self.group = group
        self.directory = directory

    def member(self, pid: int) -> bool:
        return pid != os.getpid() and parent_pid(pid) == self.group

    def spare(self) -> int | None:
        """The worker that claims the next volume nobody holds, when the group runs a
        worker per volume (its supervisor names it: cli/workers.py)."""
        if not self.directory:
            return None
        try:
            with open(os.path.join(self.directory, SPARE_FILE)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None


class GroupCatalog(PoolCatalog):
    """A worker's exports: its own volumes (and their snapshots) are served here; one
    a sibling owns is routed to it; a listing names the whole group's. Names this
    worker's registry does not know yet (a snapshot a sibling took since) are looked
    up in the store, whose leases say who owns what."""

    def __init__(
        self, pool: Pool, *, read_only: bool, group: WorkerGroup, claims: bool = False, one_each: bool = False
    ) -> None:
        """claims: the group serves every volume no other server holds (`serve POOL
        --workers N` without --volume), so a volume nobody holds (made since the workers
        started, or left by a server that stopped) is claimed by the worker a client
        asks, and served there. one_each: a worker per volume (a Ceph pool, where a
        fence covers a whole client): the claim is the spare worker's, which owns none
        yet, and a worker that owns one hands the client to it."""
        super().__init__(pool, read_only=read_only)
        self.group = group
        self.claims = claims
        self.one_each = one_each
        # One claim at a time here: a client asking for a volume this worker is claiming
        # waits for that claim instead of being told the worker itself holds it.
        self._claiming = threading.Lock()

    def _sibling(self, base_id: int | None) -> str | None:
        """The pid (as text) of the sibling holding volume base_id, if one does."""
        return self._sibling_of(self._holder(base_id))

    def _sibling_of(self, holder: str | None) -> str | None:
        pid = owner_pid(holder) if holder else None
        return str(pid) if pid is not None and self.group.member(pid) else None

    def _holder(self, base_id: int | None) -> str | None:
        if base_id is None:
            return None
        try:
            return self.pool.meta.volume_holder(base_id)
        except (OSError, ThinblockError):
            return None

    def elsewhere(self, vol: Volume) -> Volume:
        # Known here: its volume is found in the registry, with no read of every row.
        claimed = self._route_or_claim(vol.name, vol.row.kind, self.pool.base_volume_id(vol))
        if claimed is not None:
            return claimed
        return super().elsewhere(vol)

    def unknown(self, name: str) -> Volume | None:
        """A name this worker's registry does not know (made since it opened): the store's rows say."""
        rows = self._stored_rows()
        row = next((r for r in rows.values() if r.name == name), None)
        if row is None or name.startswith(STAGING_PREFIX):
            return None
        return self._route_or_claim(name, row.kind, base_row_id(row, rows))

    def volume(self, name: str) -> Volume | None:
        """As for one process serving the pool whole, "" is the default export only when
        the pool has one volume, whichever worker holds it (not this worker's only one)."""
        if name != "":
            return super().volume(name)
        rows = self._stored_rows()
        volumes = [r for r in rows.values() if r.kind == "volume" and not r.name.startswith(STAGING_PREFIX)]
        return super().volume(volumes[0].name) if len(volumes) == 1 else None

    def _route_or_claim(self, name: str, kind: str, base: int | None) -> Volume | None:
        """For an export this worker does not serve, of the volume base: ExportRouted to
        the sibling holding that volume; else, claiming, that volume taken here, and the
        export (None if it does not exist, or another server holds it)."""
        if base is None:
            return None
        holder = self._holder(base)  # read once: who holds it decides all that follows
        target = self._sibling_of(holder)
        if target is not None:
            raise ExportRouted(target, name)
        mine = self.pool.owner.name if self.pool.owner is not None else None
        if holder is not None and holder == mine:  # being claimed here by another client's lookup
            with self._claiming:
                return self._served_here(name)
        if holder is not None:  # another server's: say whose, as for a volume known here
            raise ExportElsewhere(f"{kind} {name} is not served here: it is served by {holder}")
        if not self.claims:
            return None
        if self._just_handed_over(base):
            # Its taker claims it next: a client reconnecting here meanwhile must not
            # take it back (the takeover would then fail, the volume served here again).
            raise ExportElsewhere(f"{kind} {name} is not served here: it was just handed over to another server")
        with self._claiming:
            if (vol := self._served_here(name)) is not None:  # claimed while this lookup waited
                return vol
            if not self.one_each or (not self._owns_a_volume() and self.group.spare() == os.getpid()):
                return self._claim(base, name)
        raise ExportRouted(self._next_spare(kind, name), name)  # waited for with no lock held

    def _owns_a_volume(self) -> bool:
        owner = self.pool.owner
        if owner is None:
            return True
        with self.pool.lock:
            return any(
                vol.row.kind == "volume" and not vol.name.startswith(STAGING_PREFIX) and owner.owns_id(vol.row.id)
                for vol in self.pool.volumes.values()
            )

    def _next_spare(self, kind: str, name: str) -> str:
        """The spare worker's pid, once the supervisor has named one other than this
        worker (it starts the next as soon as a spare has claimed its volume). Each
        second of waiting asks the supervisor again, so a claim it missed is followed."""
        started = time.monotonic()
        asked = started
        while True:
            spare = self.group.spare()
            if spare is not None and self.group.member(spare):
                return str(spare)
            now = time.monotonic()
            if now - started > SPARE_WAIT_S:
                raise ExportElsewhere(f"{kind} {name} is not served yet: no worker process is free to claim it")
            if now - asked >= 1.0:
                asked = now
                self._tell_supervisor()
            time.sleep(0.05)

    def _tell_supervisor(self) -> None:
        """SIGUSR1: a spare may have claimed a volume (cli/workers.py follows it). Only to
        this worker's own parent, so never to a process that took its pid since."""
        if os.getppid() == self.group.group:
            with contextlib.suppress(OSError):
                os.kill(self.group.group, signal.SIGUSR1)

    def _just_handed_over(self, base: int) -> bool:
        """Whether this worker, or a sibling (a mark in the group's directory), handed
        volume base over less than HANDED_OVER_GRACE_S ago."""
        now = time.monotonic()
        if now - self.pool.handed_over.get(base, -HANDED_OVER_GRACE_S) < HANDED_OVER_GRACE_S:
            return True
        if not self.group.directory:
            return False
        try:
            age = time.time() - os.stat(handed_over_mark(self.group.directory, base)).st_mtime
        except OSError:
            return False
        return age < HANDED_OVER_GRACE_S

    def _served_here(self, name: str) -> Volume | None:
        with self.pool.lock:
            vol = self.pool.visible_volume(name)
        return vol if vol is not None and self.pool.serves(vol) else None

    def _claim(self, base: int, name: str) -> Volume | None:
        stored = self._stored_rows().get(base)  # its name now (a rename elsewhere is followed)
        if stored is None:
            return None
        try:
            self.pool.claim_volume(stored.name)
        except VolumeBusyError:  # a sibling was quicker: it serves it now
            target = self._sibling(base)
            if target is not None:
                raise ExportRouted(target, name) from None
            return None
        except (OSError, ThinblockError) as exc:
            log.warning("claiming volume %s for a client failed: %s", stored.name, exc)
            return None
        if self.one_each:  # the supervisor names the next spare
            self._tell_supervisor()
        return self._served_here(name)

    def list_names(self) -> list[tuple[str, str]]:
        """This worker's exports, its siblings', and, claiming, those nobody serves (a
        client may ask for them: they are served once asked), sorted by name."""
        mine = super().list_names()
        names = {name for name, _ in mine}
        rows = self._stored_rows()
        # Who holds what, from the records in one read (no lock probe per volume: a
        # pool of thousands is listed in one pass); a record left by a dead sibling
        # names no live member. A client's lookup of one export checks its lease.
        try:
            recorded = self.pool.meta.recorded_holders()
        except (OSError, ThinblockError):
            recorded = {}
        # holder -> whether its exports are listed here: a live sibling's; and, claiming,
        # those of volumes nobody holds (a client asking for one has it claimed here),
        # whose record names nobody or a holder that died (one lock probe per holder).
        listed: dict[str | None, bool] = {}
        for row in rows.values():
            if row.name in names or row.name.startswith(STAGING_PREFIX):
                continue
            base = base_row_id(row, rows)
            if base is None:
                continue
            holder = recorded.get(base)
            if holder not in listed:
                listed[holder] = self._sibling_of(holder) is not None or (
                    self.claims and (holder is None or self._holder(base) is None)
                )
            if listed[holder]:
                origin = rows.get(row.origin_id) if row.origin_id is not None else None
                mine.append((row.name, describe_row(row, origin.name if origin else None)))
        mine.sort()
        return mine

    def _stored_rows(self) -> dict[int, VolumeRow]:
        try:
            return {row.id: row for row in self.pool.meta.volumes()}
        except (OSError, ThinblockError):
            return {}


class Handoffs:
    """The hand-over endpoint of one worker (taking connections from siblings) and its
    router (sending them): the server's Router."""

    def __init__(self, server: NBDServer, group: WorkerGroup) -> None:
        self.server = server
        self.group = group
        self.stopping = threading.Event()
        self.path = handoff_address(group.directory, os.getpid())
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a dead worker's of the same pid: the directory is the group's alone
        self.listener.bind(self.path)
        self.listener.listen(64)
        self.thread = threading.Thread(target=self._accept, name="thinblock-nbd-handoff", daemon=True)
        self.thread.start()
        server.router = self

    # ----- sending ------------------------------------------------------------------

    def send(self, target: str, sock: socket.socket, handed: Handed) -> None:
        """Hand sock over to worker target. Raises (and sock stays this worker's) only
        when nothing was sent; once it has been, the connection is the target's alone."""
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
            ctl.connect(handoff_address(self.group.directory, pid))
            peer_pid, uid = peer_credentials(ctl)
            if peer_pid != pid or uid != os.geteuid():
                raise ThinblockError(f"the hand-over socket of worker {pid} is held by pid {peer_pid} (uid {uid})")
            socket.send_fds(ctl, [message], [sock.fileno()])  # atomic: all of it was queued, or nothing

    # ----- taking -------------------------------------------------------------------

    def _accept(self) -> None:
        accept_loop(self.listener, self.stopping, self._take_safely, log, "the worker hand-over socket")

    def _take_safely(self, ctl: socket.socket) -> None:
        try:
            with ctl:
                self._take(ctl)
        except Exception:
            log.exception("dropped a connection handed over by a sibling: internal error")

    def _take(self, ctl: socket.socket) -> None:
        pid, uid = peer_credentials(ctl)
        if uid != os.geteuid() or not self.group.member(pid):  # before reading anything from it
            log.warning("refused a hand-over from pid %d (uid %d): not a worker of this server", pid, uid)
            return
        ctl.settimeout(HANDOFF_TIMEOUT_S)  # a sibling sends at once after connecting
        message, fds, _flags, _addr = socket.recv_fds(ctl, MAX_MESSAGE_BYTES, 1)
        if not fds:
            return
        sock = socket.socket(fileno=fds[0])
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
            log.error("a hand-over from pid %d was malformed (%s): its client is disconnected", pid, exc)
            sock.close()
            return
        refused = self.server.adopt(sock, handed)
        if refused is not None:
            log.warning("a connection handed over by pid %d was refused here: %s", pid, refused)
            _answer_and_close(sock, handed, refused)

    def close(self) -> None:
        self.stopping.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _answer_and_close(sock: socket.socket, handed: Handed, why: str) -> None:
    """A connection this worker was handed and cannot serve: its pending option is
    answered with why (the client learns it, as from the worker that accepted it),
    then it is closed."""
    try:
        conn = ServerConnection.resume(_Nothing(), handed.state, tls_required=False, tls_available=False)
        conn.refuse_routed(why)
        sock.settimeout(1.0)
        sock.sendall(conn.data_to_send())
    except (OSError, RemoteProtocolError, struct.error):
        pass
    finally:
        sock.close()


class _Nothing:
    """The catalog of a connection that is only told why it is refused."""

    def list_names(self) -> list[tuple[str, str]]:
        return []

    def lookup(self, name: str) -> None:
        return None


def _tuples(value: Any) -> Any:
    """A certificate as ssl.getpeercert() gives it (tuples, which authz.py expects),
    from its JSON form (lists)."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value
