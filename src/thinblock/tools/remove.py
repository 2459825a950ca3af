"""Removing a whole pool (`pool remove`, lvm2's vgremove): one place for its rules.

A pool is removed only by a process that owns it, so never while it is served or
attached (whoever holds it is named, and nothing is touched). What would go is
described first: the backend's files or objects, and the volumes with the data
they hold. When any volume holds data, nothing is deleted unless the caller
confirmed (--yes); an empty pool goes without. The backend deletes its metadata
last, so an interrupted removal leaves a pool that `pool remove` can finish.
"""

from __future__ import annotations

import os
import time
from typing import Any

from thinblock.admin.access import wait_s
from thinblock.backends import Location, Ownership, locate
from thinblock.core.pool import volume_dict
from thinblock.errors import PoolBusyError, ThinblockError
from thinblock.runtime import CONTROL_SOCKET


def _take(location: Location) -> Ownership:
    """Own the pool, or PoolBusyError naming its holder. A server or FUSE daemon (it has
    a control socket) is refused at once; another command is waited for, up to --wait."""
    deadline = time.monotonic() + wait_s()
    pause = 0.02
    while True:
        try:
            return location.own("thinblock pool remove")
        except PoolBusyError as exc:
            served = os.path.exists(os.path.join(location.runtime_dir(), CONTROL_SOCKET))
            if served or time.monotonic() >= deadline:
                held = str(exc).replace(f"pool {location.name} is ", "it is ", 1)
                raise PoolBusyError(
                    f"cannot remove pool {location.name}: {held}; stop that server (or detach the pool's"
                    " devices) first. Nothing was deleted"
                ) from None
            time.sleep(pause)
            pause = min(0.25, pause * 2)


def remove_pool(locator: str, *, confirmed: bool) -> dict[str, Any]:
    """Remove the pool at locator. Returns what it holds and what is (or would be)
    deleted; "removed" says whether it was. Not confirmed and some volume holds data:
    nothing is deleted."""
    location = locate(locator)
    if not location.exists():
        location.open_meta(readonly=True)  # its one sentence: no pool there, or why it cannot be read
        raise ThinblockError(f"no pool at {location.name}")
    ownership = _take(location)
    try:
        meta = location.open_meta(readonly=True)
        try:
            sb = meta.superblock()
            rows = meta.volumes()
        finally:
            meta.close()
        bs = int(sb["block_size"])
        names = {r.id: r.name for r in rows}
        volumes = [
            {k: v for k, v in volume_dict(r, bs, names.get(r.origin_id or 0)).items() if k in _SHOWN} for r in rows
        ]
        deletes, kept = location.removal(sb)
        result: dict[str, Any] = {
            "pool": location.name,
            "size_bytes": int(sb["size_bytes"]),
            "volumes": volumes,
            "data_bytes": sum(v["data_bytes"] for v in volumes),
            "deletes": deletes,
            "kept": kept,
            "removed": False,
        }
        if result["data_bytes"] and not confirmed:
            return result
        location.remove_pool(sb, ownership)
        result["removed"] = True
        return result
    finally:
        ownership.release()


_SHOWN = ("name", "kind", "origin", "size_bytes", "data_bytes", "mapped_bytes")
