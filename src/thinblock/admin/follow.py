"""Telling every owner of a pool served per volume that its size or policy changed.

`pool grow` and `pool set` on such a pool run as pool-level steps in the command
(core/pool_settings.py). Each owner follows the stored size and policy at its next
grant anyway; this makes it follow now, over its control socket (`pool_follow`):
writers the `wait` policy holds wake and take the new space at once, and a policy
change shows in the owner's behaviour from the next request on. An owner that
cannot be told (another host, no answer) is named in a warning, and still follows
at its next grant.
"""

from __future__ import annotations

import logging

from thinblock.admin.control import ControlClient, owner_socket
from thinblock.core.pool import Pool
from thinblock.errors import ThinblockError

log = logging.getLogger("thinblock.admin")
FOLLOW_TIMEOUT_S = 10.0  # pool_follow takes no data lock: an owner that answers answers fast


def owners(pool: Pool) -> list[str]:
    """The holders of every lease now (each owner once, this process left out)."""
    me = pool.owner.name if pool.owner is not None else None
    found: dict[str, None] = {}
    for row in pool.meta.volumes():
        holder = pool.meta.volume_holder(row.id)
        if holder is not None and holder != me:
            found[holder] = None
    return list(found)


def tell_owners(pool: Pool) -> list[str]:
    """Have every other owner follow the stored size and policy; warnings for those
    that could not be told."""
    warnings = []
    for holder in owners(pool):
        sock = owner_socket(pool.location, holder)
        try:
            if sock is None:
                raise ThinblockError("it is on another host")
            client = ControlClient(sock, FOLLOW_TIMEOUT_S)
            try:
                client.call("pool_follow")
            finally:
                client.close()
        except ThinblockError as exc:
            warnings.append(f"{holder} was not told ({exc}); it follows at its next grant of space")
    for warning in warnings:
        log.warning("%s", warning)
    return warnings
