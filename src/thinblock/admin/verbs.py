"""Pool administration verbs, one table for every way of reaching a pool.

`run_verb(pool, verb, args)` runs one on an open pool: for the command line
directly, or in a server for a control-socket client (control.py; access.py
picks which). Verbs take and return JSON-able values; errors travel as
ThinblockError or OpError with their errno.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from thinblock.admin.schema import validate
from thinblock.core.allocation_map import allocation_map
from thinblock.core.delta import delta_dict
from thinblock.core.pool import Pool
from thinblock.core.snapshot import clone, create_snapshot, rollback
from thinblock.core.volume import Volume
from thinblock.errors import ThinblockError
from thinblock.meta.base import RESERVE_FULL
from thinblock.tools.dump import dump_metadata


def _reserve_bytes(value: object) -> int:
    """A reservation as the control protocol carries it: "full", "none" or bytes."""
    if value == "full":
        return RESERVE_FULL
    if value == "none":
        return 0
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise ThinblockError(f"invalid reservation {value!r}: a size in bytes, full or none")


def _volume_set(pool: Pool, name: str, **changes: Any) -> dict[str, Any]:
    vol = pool.volume(name, kind="volume")
    if changes.get("detect_zeroes") is not None:
        pool.set_detect_zeroes(name, changes["detect_zeroes"])
    if changes.get("reserve") is not None:
        pool.set_reserve(name, _reserve_bytes(changes["reserve"]))
    if "low_water" in changes:
        pool.set_low_water(name, changes["low_water"], changes.get("on_low_water") or vol.row.on_low_water)
    elif changes.get("on_low_water") is not None:
        pool.set_low_water(name, vol.row.low_water, changes["on_low_water"])
    return pool.volume_info(vol)


def _visible(pool: Pool, name: str) -> Volume:
    """A volume or snapshot a user may name (staging volumes are the pool's own)."""
    vol = pool.visible_volume(name)
    if vol is None:
        raise ThinblockError(f"no volume or snapshot {name!r} in pool {pool.path}")
    return vol


def _volume_info(pool: Pool, name: str) -> dict[str, Any]:
    """One volume or snapshot as volume list shows it, with its lineage: the
    snapshots taken of it and the volumes cloned from it (those whose origin it is)."""
    with pool.lock:  # one moment for the figures and the lineage
        vol = _visible(pool, name)
        children = sorted((v for v in pool.visible().values() if v.row.origin_id == vol.row.id), key=lambda v: v.name)
        return {
            **pool.volume_info(vol),
            "block_size": pool.block_size,
            "snapshots": [v.name for v in children if v.row.kind == "snapshot"],
            "clones": [v.name for v in children if v.row.kind == "volume"],
        }


def _dump(pool: Pool) -> dict[str, Any]:
    pool.commit()  # everything completed so far, then a dump of that committed state
    return pool.between_commits(dump_metadata)


VERBS: dict[str, Callable[..., Any]] = {
    "status": lambda pool: pool.status(),
    "pool_grow": lambda pool, size_bytes: {"warnings": pool.grow(size_bytes)},
    "pool_set": lambda pool, **changes: (pool.set_policy(changes), pool.policy.settings())[1],
    "pool_dump": _dump,
    "volume_list": lambda pool, kind=None: pool.volume_list(kind),
    "volume_info": _volume_info,
    "volume_map": lambda pool, name, columns, max_rows: allocation_map(_visible(pool, name), columns, max_rows),
    "volume_create": lambda pool, name, size_bytes, detect_zeroes="on": pool.volume_info(
        pool.create_volume(name, size_bytes, detect_zeroes=detect_zeroes)
    ),
    "volume_remove": lambda pool, name, kind=None: pool.remove_volume(name, kind=kind),
    "volume_resize": lambda pool, name, size_bytes, allow_shrink=False: {
        "warnings": pool.resize_volume(name, size_bytes, allow_shrink=allow_shrink)
    },
    "volume_rename": lambda pool, name, new_name, kind: pool.rename_volume(name, new_name, kind=kind),
    "volume_set": _volume_set,
    "volume_clone": lambda pool, snapshot, name: pool.volume_info(clone(pool, snapshot, name)),
    "volume_rollback": lambda pool, name, snapshot: rollback(pool, name, snapshot),
    "snapshot_create": lambda pool, volume, name: pool.volume_info(create_snapshot(pool, volume, name)),
    "delta": lambda pool, source, target: delta_dict(pool.volume(source), pool.volume(target)),
}


def run_verb(pool: Pool, verb: str, args: dict[str, Any]) -> Any:
    """Run one verb on an open pool (locally, or for a control-socket client)."""
    if verb not in VERBS:  # the schema also knows verbs only a server offers (fuse_mount)
        raise ThinblockError(f"unknown administration verb {verb[:60]!r}")
    validate(verb, args)  # types and ranges first: a bad request changes nothing
    return run_validated(pool, verb, args)


def run_validated(pool: Pool, verb: str, args: dict[str, Any]) -> Any:
    """run_verb, for a caller that has validated the request already (the control server).
    An owner per volume commits first, so that the verb's own commit, under the
    pool-level lock (Pool.pool_step), has next to no data to sync."""
    if pool.owner is not None and verb not in _READS:
        pool.commit()
    with pool.pool_step():
        if pool.owner is not None and verb not in _READS:
            pool.catch_up()
        return VERBS[verb](pool, **args)


_READS = {"status", "pool_dump", "volume_list", "volume_info", "volume_map", "delta"}
