"""Handing a volume over between servers per volume (`serve POOL --volume NAME
--takeover`).

The taker asks the owner, through the owner's control socket, to release the
volume: the owner hangs up that volume's NBD clients (their in-flight requests
finish and are answered), commits, gives its grants back and releases the lease
(Pool.give_up); its other volumes are not touched. Then the taker claims the
lease as any server does. A directory pool's lease is a lock that dies with its
process, so an owner that died has released it already; one that is alive but
does not answer cannot be fenced off (a stalled process still holds its lock):
the taker then says so and names it. On Ceph the taker fences such an owner
off instead (meta fence_volume: its client is blocklisted, its lock broken),
and one whose control socket is on no path of this host (another host) too.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from thinblock.admin.control import ControlClient, NoAnswer, control_timeout_s, owner_socket
from thinblock.backends import Location
from thinblock.core.owner import ATTACH_PURPOSE, SERVE_PURPOSE, owner_pid
from thinblock.core.registry import STAGING_PREFIX
from thinblock.errors import PoolBusyError, ThinblockError

if TYPE_CHECKING:
    from thinblock.admin.notify import NotifyClient

log = logging.getLogger("thinblock.serve")


def take_over(location: Location, names: list[str]) -> None:
    """Ask the owners of these volumes to hand them over; returns once each is free.
    Every owner is checked first (it exists here, answers, is not an attach's daemon),
    so that a takeover refused for one volume has not taken the others."""
    meta = location.open_meta(readonly=False)
    try:
        rows = {row.name: row for row in meta.volumes()}
        asks: list[tuple[str, str, str]] = []  # (volume, holder, its control socket)
        fences: list[tuple[str, int, str, str]] = []  # (volume, id, holder, why it is fenced, not asked)
        remote: list[tuple[str, int, str]] = []  # (volume, id, holder) of owners on other hosts
        answering: set[str] = set()
        for name in dict.fromkeys(names):
            row = rows.get(name)
            if row is None:
                raise ThinblockError(f"no volume {name!r} in pool {location.name}")
            holder = meta.volume_holder(row.id)
            if holder is None:
                log.info("takeover of volume %s: nobody serves it", name)
                continue
            if holder.startswith(ATTACH_PURPOSE):
                raise PoolBusyError(
                    f"volume {name} is attached by thinblock attach (pid {owner_pid(holder)}): detach it first"
                    f" ('thinblock detach {location.name} {name}'), then serve it; nothing was taken over"
                )
            sock = owner_socket(location, holder)
            if sock is None or not os.path.exists(sock):
                if location.remote_owners:  # on another host: asked by watch/notify, fenced if silent
                    remote.append((name, row.id, holder))
                    continue
                raise PoolBusyError(f"volume {name} is served by {holder}, which offers no control socket here")
            if sock not in answering:
                try:
                    # A stopped or hung owner still accepts connections: a quick question
                    # first, so that it is named at once, not after the hand-over's timeout.
                    _answers(ControlClient(sock, min(PROBE_TIMEOUT_S, control_timeout_s())))
                except ThinblockError as exc:
                    if location.can_fence:
                        fences.append((name, row.id, holder, f"it does not answer ({exc})"))
                        continue
                    raise PoolBusyError(
                        f"volume {name} is served by {holder}, which does not answer ({exc}); on a directory pool"
                        f" a live process cannot be fenced off: stop it (kill {owner_pid(holder)}), then serve the"
                        " volume; nothing was taken over"
                    ) from None
                answering.add(sock)
            asks.append((name, holder, sock))
        if remote:
            # Here, not at the top: only a pool in Ceph has owners on other hosts, and
            # python3-rados may be missing where no pool is.
            from thinblock.admin.notify import NotifyClient

            superblock = meta.superblock()
        for name, vid, holder in remote:
            try:
                _answers(NotifyClient(location, superblock, vid, PROBE_TIMEOUT_S))  # type: ignore[arg-type]
                client = NotifyClient(location, superblock, vid, control_timeout_s())  # type: ignore[arg-type]
                _hand_over(name, f"{holder} (another host), by notify", client)
            except NoAnswer as exc:
                fences.append((name, vid, holder, f"it does not answer ({exc})"))
        for name, vid, holder, why in fences:
            started = time.monotonic()
            log.warning("takeover of volume %s: %s is its owner, and %s: fencing it off", name, holder, why)
            meta.fence_volume(vid)
            log.warning(
                "takeover of volume %s: fenced %s off in %.3f s (what it acknowledged but never flushed is lost,"
                " as after a crash)",
                name,
                holder,
                time.monotonic() - started,
            )
        for name, holder, sock in asks:
            _hand_over(name, holder, ControlClient(sock, control_timeout_s()))
    finally:
        meta.close()


PROBE_TIMEOUT_S = 5.0  # how long an owner may take to answer a question before a takeover


def _hand_over(name: str, holder: str, client: ControlClient | NotifyClient) -> None:
    """Ask the owner, through client, to hand the volume over; logs how long it took."""
    started = time.monotonic()
    log.info("takeover of volume %s: asking %s to hand it over", name, holder)
    try:
        done = client.call("volume_release", name=name)
    finally:
        client.close()
    log.info(
        "takeover of volume %s: handed over in %.3f s (%s client(s) closed)",
        name,
        time.monotonic() - started,
        done.get("clients_closed") if isinstance(done, dict) else "?",
    )


def _answers(client: ControlClient | NotifyClient) -> None:
    """NoAnswer unless the owner answers a cheap question (its socket's client, or a
    notify, made with a timeout of PROBE_TIMEOUT_S at most): any answer, an error
    too (a server of another version may not know the verb)."""
    try:
        client.call("open_clients")
    except NoAnswer:
        raise
    except ThinblockError:
        pass
    finally:
        client.close()


def volumes_to_serve(location: Location) -> list[str]:
    """What `serve POOL` serves beside servers per volume: the volumes none holds. When
    servers (or attach daemons) hold every one it is refused, naming the holders, as a
    second server of a pool owned whole is (a server of nothing would only look like one)."""
    holders = _holders(location)
    free = [name for name, holder in holders if holder is None]
    held = [f"{name} by {holder}" for name, holder in holders if holder is not None]
    # A volume a command holds (an import, a resize) is free again when it ends: the
    # workers claim it then (a client asking for it), so that alone refuses nothing.
    if held and not free and all(_lasting(holder) for _name, holder in holders):
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        attached = any(holder and holder.startswith(ATTACH_PURPOSE) for _name, holder in holders)
        how = "; an attached one is freed by thinblock detach" if attached else ""
        raise PoolBusyError(
            f"pool {location.name}: every volume is served already ({'; '.join(held[:3])}{more});"
            f" serve POOL --volume NAME --takeover moves one here{how}"
        )
    return free


def _lasting(holder: str | None) -> bool:
    """Whether a lease's holder serves for as long as it runs (a server, an attach's
    daemon), not for one command."""
    return holder is not None and holder.startswith((SERVE_PURPOSE, ATTACH_PURPOSE))


def volumes_held_by(location: Location, pid: int) -> list[str]:
    """The volumes the server of this pid (on this host) holds now."""
    return [name for name, holder in _holders(location) if holder is not None and owner_pid(holder) == pid]


def unheld_volumes(location: Location) -> list[str]:
    """The volumes no server per volume holds now (`serve POOL` beside them serves these)."""
    return [name for name, holder in _holders(location) if holder is None]


def _holders(location: Location) -> list[tuple[str, str | None]]:
    """(name, holder or None) of every volume a server may hold (not snapshots, not staging)."""
    meta = location.open_meta(readonly=False)
    try:
        return [
            (row.name, meta.volume_holder(row.id))
            for row in meta.volumes()
            if row.kind == "volume" and not row.name.startswith(STAGING_PREFIX)
        ]
    finally:
        meta.close()
