"""Space other owners keep idle in their grants, asked back before ENOSPC.

An owner per volume keeps up to two grants' worth of allocatable blocks for its
next writes (core/owner.py's idle_limit). On a nearly full pool that space is
the pool's too: an owner that finds no free block outside the grants asks every
other live owner holding one to give back what its volumes' reservations do not
need (`grants_idle_back`), then tries once more. Only then is the answer ENOSPC,
as with one process owning the whole pool. An owner on this host is asked through
its control socket; on a Ceph pool, one on another host by watch/notify on a
volume it holds grants for (admin/notify.py), all at once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from thinblock.admin.control import ask_all, call_at, reachable_sockets
from thinblock.errors import ThinblockError

if TYPE_CHECKING:
    from thinblock.core.pool import Pool

log = logging.getLogger("thinblock.pool")

ASK_TIMEOUT_S = 5.0  # an owner that does not answer this soon keeps its grants (all are asked at once)
VERB = "grants_idle_back"


def ask_back_idle_grants(pool: Pool) -> bool:
    """Have every other live owner holding grants give back its idle ones; True if one
    answered (the caller then tries its grant again)."""
    owner = pool.owner
    if owner is None:
        return False
    held: dict[str, int] = {}  # another owner -> a volume it holds grants for
    try:
        for vid in sorted({grant.volume_id for grant in pool.meta.grants()}):  # one holder read per volume
            holder = pool.meta.volume_holder(vid)
            if holder is not None and holder != owner.name:
                held.setdefault(holder, vid)
        superblock = pool.meta.superblock()
    except (OSError, ThinblockError) as exc:
        log.warning("pool %s: cannot read the grants to ask their idle space back: %s", pool.path, exc)
        return False
    sockets = reachable_sockets(pool.location, sorted(held))
    calls: dict[str, Callable[[], Any]] = {
        holder: functools.partial(call_at, path, VERB, ASK_TIMEOUT_S) for holder, path in sockets.items()
    }
    if pool.location.remote_owners:  # the others are on other hosts, or gone
        for holder, vid in held.items():
            if holder not in calls:
                calls[holder] = functools.partial(_by_notify, pool, superblock, vid)
    answered = False
    for holder, answer in ask_all(calls).items():
        if isinstance(answer, Exception):
            log.info("pool %s: %s did not give its idle grants back: %s", pool.path, holder, answer)
        else:
            answered = True
    return answered


def _by_notify(pool: Pool, superblock: dict[str, Any], volume_id: int) -> Any:
    from thinblock.admin.notify import NotifyClient

    return NotifyClient(pool.location, superblock, volume_id, ASK_TIMEOUT_S).call(VERB)  # type: ignore[arg-type]


def give_back_idle_grants(pool: Pool) -> dict[str, int]:
    """The control verb: give back every whole grant this owner's reservations do not
    need (another owner found the pool full); what it still holds unused, in bytes."""
    if pool.owner is None:  # owning the whole pool, it holds no grants
        return {"granted_unused_bytes": 0}
    pool.owner.give_back_idle(margin=False)
    with pool.lock:
        return {"granted_unused_bytes": pool.accounts.space.allocatable_blocks * pool.block_size}
