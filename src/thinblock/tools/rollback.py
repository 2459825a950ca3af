"""`pool repair` and the generation check (store/owned.py): which metadata a repair
writes, and what `--accept-rollback` drops.

Metadata written by repair (and restore) keeps the pool's uuid and takes a
transaction_id above both the current metadata's and the data store's
generation, so the next open's check passes and every later birth is above
every birth of the abandoned history. Accepting rolled-back metadata of
generation G drops each mapping whose dblock was born after G (the birth table's
reasoning is in store/owned.py); the unclean open that follows punches every
free block, which now includes the dropped ones.
"""

from __future__ import annotations

from array import array
from typing import Any

from thinblock.backends import Location
from thinblock.errors import CorruptionError, ThinblockError
from thinblock.store.owned import OwnedStore


def successor(location: Location, new_superblock: dict[str, Any]) -> dict[str, Any]:
    """pool_uuid and transaction_id for metadata that replaces the current one (whose
    superblock, when it cannot be read, new_superblock stands in for to find the data)."""
    try:
        meta = location.open_meta(readonly=True)
        try:
            sb = meta.superblock()
        finally:
            meta.close()
    except (CorruptionError, ThinblockError, KeyError, ValueError):
        sb = {}
    store: OwnedStore | None = None
    gen = 0
    uuid = sb.get("pool_uuid")
    try:
        where = sb or new_superblock
        store = location.owned_store(where, location.open_data(where, readonly=True))
        header = store.load()
        if header is not None:
            gen, uuid = header.generation, uuid or header.uuid
    except (ThinblockError, OSError, KeyError, ValueError):
        pass  # no data store to read: the metadata's own figures decide
    finally:
        if store is not None:
            store.close()
    out: dict[str, Any] = {"transaction_id": max(int(sb.get("transaction_id") or 0), gen) + 1}
    if uuid:
        out["pool_uuid"] = uuid
    return out


def drop_reborn(dump: dict[str, Any], births: array[int], accepted: int, since: int, lost: list[str]) -> None:
    """Drop from dump every mapping whose dblock was born after generation `accepted`
    (all of them when the birth table starts later than accepted + 1)."""
    complete = since <= accepted + 1
    for volume in dump["volumes"]:
        kept: list[list[Any]] = []
        dropped = 0
        for vblock, dblock, count, state, pinned in volume["mappings"]:
            run: list[Any] | None = None
            for i in range(count):
                d = dblock + i
                if complete and d < len(births) and births[d] <= accepted:
                    if run is not None and run[1] + run[2] == d:
                        run[2] += 1
                    else:
                        run = [vblock + i, d, 1, state, pinned]
                        kept.append(run)
                else:
                    dropped += 1
                    run = None
        volume["mappings"] = kept
        if dropped:
            why = (
                f"were given out after generation {accepted}"
                if complete
                else f"cannot be told apart (the birth table starts at generation {since})"
            )
            lost.append(f"{volume['kind']} {volume['name']}: {dropped} block(s) {why}; they now read zeros")


def guard_restore(location: Location, current: dict[str, Any] | None, dump: dict[str, Any]) -> list[str]:
    """Restore's rollback rule, applied to the dump before anything is written. A
    dump is the metadata of one generation (its pool's transaction_id); restoring
    it under a data store that has moved on is a rollback, so, as repair
    --accept-rollback does, every mapping whose dblock got a new owner after that
    generation is dropped (it may hold another volume's bytes now), and named in
    the returned list. A dump of another pool (its pool_uuid) is refused, and so
    is one that records no generation where the data store has one."""
    pool = dump["pool"]
    where = current or {"block_size": pool["block_size"], "size_bytes": pool["size_bytes"]}
    try:
        store = location.owned_store(where, location.open_data(where, readonly=True))
    except (ThinblockError, OSError, KeyError, ValueError):
        return []  # no data store to read: restore's own checks refuse what needs one
    try:
        header = store.load()
        if header is None:
            return []
        dump_uuid = pool.get("pool_uuid")
        if dump_uuid is not None and dump_uuid != header.uuid:
            raise ThinblockError(
                f"the dump is of another pool (uuid {dump_uuid}) and this pool's data store belongs to"
                f" {header.uuid}: its mappings would show that pool's blocks; nothing was changed"
            )
        tid = pool.get("transaction_id")
        if tid is None:
            if header.generation == 0:
                return []
            raise ThinblockError(
                "the dump does not record the generation it was made at (transaction_id), so restore cannot"
                " tell which of its blocks were freed and reused since; make it with 'thinblock pool dump';"
                " nothing was changed"
            )
        if int(tid) >= header.generation:
            return []
        n_blocks = min(int(pool["size_bytes"]) // int(pool["block_size"]), header.births_blocks)
        lost: list[str] = []
        drop_reborn(dump, store.read_births(n_blocks), int(tid), header.births_since, lost)
        lost.append(f"a dump of generation {tid} restored under a data store of generation {header.generation}")
        return lost
    finally:
        store.close()
