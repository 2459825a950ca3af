"""A volume taken at runtime by an owner per volume (Pool.claim_volume).

An owner per volume (core/owner.py) takes its volumes' leases when it opens.
Later it may take the lease of a volume nobody holds (one made since it opened,
or one another owner gave up or left when it died) and serve it from then on
exactly as if it had been taken at open. What this process knows of that
volume may be older than the store:

- its row and those of its snapshots: made, resized, renamed or removed by
  another process since; they are read again, and the registry follows them;
- its root tables: read again, never the ones loaded before;
- the mapping pages this process has cached that they reach. A page is
  written in place only by the holder of its one reference (Volume.
  _writable_page copies a shared one), so a page a volume this process serves
  reaches now has not changed behind it: whoever else reaches it shares it,
  and nobody writes a shared page in place. Any other cached page may have:
  its sharing with this process ended (a snapshot removed, a copy-on-write, a
  volume handed over), and the one holder left wrote it in place. Such a page
  leaves the cache (its count stays: it is this process's view, caught up by
  the step) and is read again when next used;
- its ZEROED blocks: what an owner that died wrote into them and never
  committed must not show, so they are zeroed again (VolumeOwner.rezero does
  it for the volumes taken at open).

The store reads and the change of the views run in one pool-level step (which
catches the shared counts up first), the views changed between commits under
the pool lock with nothing left to fail; the zeroing is data I/O, so it runs
after the step, outside every lock, while the lease keeps everyone else off
the volume. Only then is the volume served. A claim that fails anywhere
releases the lease and leaves the volume unserved; what it changed is the
views of committed state, which were stale.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING

from thinblock.core.mapping import BlockState, Page, entry_dblock, entry_state
from thinblock.core.owner import VolumeOwner
from thinblock.core.registry import STAGING_PREFIX, base_row_id
from thinblock.core.spacemap import to_runs
from thinblock.core.volume import Volume
from thinblock.errors import ThinblockError
from thinblock.meta.base import Lease, MetadataStore, VolumeRow

if TYPE_CHECKING:
    from thinblock.core.pool import Pool

log = logging.getLogger("thinblock.pool")


def claim_volume(pool: Pool, name: str) -> Volume:
    """Take volume `name`'s lease and serve it from now on (see the module's docstring);
    VolumeBusyError naming its holder when another process holds it."""
    owner = pool.owner
    if owner is None:
        raise ThinblockError(f"pool {pool.path} is served whole here: every volume is served already")
    with pool.lock:
        known = pool.visible_volume(name)
        if known is not None and known.row.kind == "volume" and owner.owns(known):
            return known
    with pool.pool_step():
        pool.catch_up()
        rows = {row.id: row for row in pool.meta.volumes()}
        row = next((r for r in rows.values() if r.name == name), None)
        if row is None or name.startswith(STAGING_PREFIX):
            raise ThinblockError(f"no volume {name!r} in pool {pool.path}")
        if row.kind != "volume":
            raise ThinblockError(
                f"{name!r} is a {row.kind}, not a volume: a snapshot is served by the server of the volume it was taken of"
            )
        lease = VolumeOwner.claim(pool.meta, {name: row.id}, owner.name)[row.id]
        try:
            family = [
                r for r in rows.values() if not r.name.startswith(STAGING_PREFIX) and base_row_id(r, rows) == row.id
            ]
            roots = {r.id: pool.meta.roots(r.id) for r in family}
            zeroed = _zeroed_blocks(pool.meta, roots)
            pool.between_commits(lambda _meta: _follow(pool, row.id, family, roots))
        except BaseException:
            _release(pool.meta, lease)
            raise
    try:
        _zero_again(pool, zeroed)
    except BaseException:
        _release(pool.meta, lease)
        raise
    vol = pool.volume_by_id(row.id)
    assert vol is not None  # _follow registered it, and only its lease holder removes it
    with pool.lock:
        owner.take(row.id, lease)
        pool.accounts.retally_set_aside(vol)  # its set-aside is in this owner's grants now
    log.info("pool %s: volume %s claimed (%d ZEROED blocks zeroed again)", pool.path, name, len(zeroed))
    return vol


def _release(meta: MetadataStore, lease: Lease) -> None:
    with contextlib.suppress(Exception):  # a lease not released dies with the process
        meta.release_volume(lease)


def _zeroed_blocks(meta: MetadataStore, roots: dict[int, dict[int, int]]) -> list[int]:
    """The dblocks of every ZEROED entry of these root tables, from the store's pages."""
    page_ids = list(dict.fromkeys(pid for root in roots.values() for pid in root.values()))
    found = meta.pages(page_ids)
    if len(found) != len(page_ids):
        missing = next(pid for pid in page_ids if pid not in found)
        raise ThinblockError(f"mapping page {missing} is referenced but missing (run 'thinblock pool check')")
    dblocks: set[int] = set()
    for page_id, (count, blob) in found.items():
        for entry in Page.from_blob(page_id, count, blob).entries:
            if entry and entry_state(entry) == BlockState.ZEROED:
                dblocks.add(entry_dblock(entry))
    return sorted(dblocks)


def _zero_again(pool: Pool, dblocks: list[int]) -> None:
    """Zero them (shared or not: a ZEROED block reads zero for everyone, and nobody
    writes in place into a block two pages reference)."""
    bs = pool.block_size
    for start, count in to_runs(dblocks):
        pool.store.zero(start * bs, count * bs)
    if dblocks:
        pool.store.flush()


def _follow(pool: Pool, vid: int, family: list[VolumeRow], roots: dict[int, dict[int, int]]) -> None:
    """Between commits, under the pool lock: the registry holds the volume and its
    snapshots as the store has them, with these root tables, and no cached page they
    reach may be stale. Nothing here reads the store or can fail half-way."""
    with pool.lock:
        # Pages a served volume reaches now: current here (the module's docstring).
        current: set[int] = set()
        for vol in pool.volumes.values():
            root = vol.loaded_root
            if root is not None and pool.serves(vol):
                current.update(root.values())
        ids = {r.id for r in family}
        for vol in list(pool.volumes.values()):  # gone from the store meanwhile: removed by another
            if vol.row.id not in ids and pool.base_volume_id(vol) == vid:
                _unregister(pool, vol)
        for stored in family:
            _register(pool, dataclasses.replace(stored), roots[stored.id])
        reached = {pid for root in roots.values() for pid in root.values()}
        pool.txn.drop_cached(reached - current)


def _unregister(pool: Pool, vol: Volume) -> None:
    pool.volumes.tally(vol, False)
    del pool.volumes[vol.name]
    vol.removed = True
    pool.accounts.retally_set_aside(vol)


def _register(pool: Pool, row: VolumeRow, root: dict[int, int]) -> None:
    """The registry holds row (by its id) with this root table."""
    vol = pool.volume_by_id(row.id)
    squatter = pool.volumes.get(row.name)
    if squatter is not None and squatter is not vol:  # the name's older holder, gone from the store
        _unregister(pool, squatter)
    if vol is None:
        vol = Volume(pool, row, root)
        pool.volumes[row.name] = vol
        pool.volumes.tally(vol, True)
        pool.accounts.retally_set_aside(vol)
        return
    with pool.volumes.tallied(vol):
        if vol.name != row.name:  # renamed meanwhile
            del pool.volumes[vol.name]
            vol.row.name = row.name
            pool.volumes[row.name] = vol
        for column in dataclasses.fields(row):
            setattr(vol.row, column.name, getattr(row, column.name))
        vol.reset_root(root)
