"""Space other owners keep idle in their grants, asked back before ENOSPC.

An owner per volume keeps up to two grants' worth of allocatable blocks for its
next writes (core/owner.py's idle_limit). On a nearly full pool that space is
the pool's too: an owner that finds no free block outside the grants asks every
other live owner holding one, through its control socket, to give back what its
volumes' reservations do not need (`grants_idle_back`), then tries once more.
Only then is the answer ENOSPC, as with one process owning the whole pool.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from thinblock.admin.control import ask_each, reachable_sockets
from thinblock.errors import ThinblockError

if TYPE_CHECKING:
    from thinblock.core.pool import Pool

log = logging.getLogger("thinblock.pool")

ASK_TIMEOUT_S = 5.0  # an owner that does not answer this soon keeps its grants (all are asked at once)


def ask_back_idle_grants(pool: Pool) -> bool:
    """Have every other live owner holding grants give back its idle ones; True if one
    answered (the caller then tries its grant again)."""
    owner = pool.owner
    if owner is None:
        return False
    try:
        holders = {pool.meta.volume_holder(grant.volume_id) for grant in pool.meta.grants()}
    except (OSError, ThinblockError) as exc:
        log.warning("pool %s: cannot read the grants to ask their idle space back: %s", pool.path, exc)
        return False
    sockets = reachable_sockets(pool.location, sorted(h for h in holders if h is not None and h != owner.name))
    answered = False
    for holder, answer in ask_each(sockets, "grants_idle_back", ASK_TIMEOUT_S).items():
        if isinstance(answer, Exception):
            log.info("pool %s: %s did not give its idle grants back: %s", pool.path, holder, answer)
        else:
            answered = True
    return answered


def give_back_idle_grants(pool: Pool) -> dict[str, int]:
    """The control verb: give back every whole grant this owner's reservations do not
    need (another owner found the pool full); what it still holds unused, in bytes."""
    if pool.owner is None:  # owning the whole pool, it holds no grants
        return {"granted_unused_bytes": 0}
    pool.owner.give_back_idle(margin=False)
    with pool.lock:
        return {"granted_unused_bytes": pool.accounts.space.allocatable_blocks * pool.block_size}
