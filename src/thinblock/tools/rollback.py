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
