"""The reservation rule, in one place: what a volume's reservation holds aside.

A volume with a reservation of R blocks may own R blocks exclusively without
ever failing with ENOSPC (ZFS refreservation). The pool sets aside what it does
not own yet: max(0, R - exclusive). RESERVE_FULL follows the volume's size, and
a reservation that covers every block of a writable volume is what makes its
mapped ranges `thinblock:guaranteed` (docs/allocation.md). A snapshot shares
everything the volume owned, so it raises the set-aside to R and is refused
when the pool cannot hold that (core/snapshot.py). The pool's accounts
(core/space.py), the volume, snapshots, rollback and `pool check` all ask here.

A volume's replacement counts as the volume: import (and import-diff) build a
volume's new contents in a hidden staging volume that takes its place in one
commit (core/snapshot.py adopt), and until then the blocks that staging volume
owns alone count toward the reservation of the volume it replaces, so the
replacement may allocate into that volume's set-aside (and shrinks it as it
does), never into another volume's. Whichever of the two is kept, the set-aside
left covers it: the one that goes frees its blocks. The link is the staging
row's origin (replaced_id).
"""

from __future__ import annotations

from thinblock.core.registry import STAGING_PREFIX
from thinblock.meta.base import RESERVE_FULL, VolumeRow


def target_blocks(reserve_bytes: int, size_bytes: int, block_size: int) -> int:
    """The blocks a reservation stands for (RESERVE_FULL: the whole volume size)."""
    target = size_bytes if reserve_bytes == RESERVE_FULL else reserve_bytes
    return -(-target // block_size)


def row_target(row: VolumeRow, block_size: int) -> int:
    """The blocks row's reservation stands for, at its size."""
    return target_blocks(row.reserve_bytes, row.size_bytes, block_size)


def set_aside_blocks(
    row: VolumeRow, block_size: int, exclusive: int | None = None, *, replacement_blocks: int = 0
) -> int:
    """What the pool holds aside for row: its target less what it owns alone (the kept
    exclusive count unless another is given; a lower bound only over-reserves) and
    less what the staging volumes that will replace it own alone (replacement_blocks)."""
    if not row.reserve_bytes:
        return 0
    owned = (row.exclusive_blocks if exclusive is None else exclusive) + replacement_blocks
    return max(0, row_target(row, block_size) - owned)


def replaced_id(row: VolumeRow) -> int | None:
    """The id of the volume a staging volume will replace (its origin), whose
    reservation its blocks count toward; None for every other row (a staged snapshot
    replaces nothing: its blocks go when it does)."""
    if row.kind != "volume" or not row.name.startswith(STAGING_PREFIX):
        return None
    return row.origin_id


def covers_every_block(row: VolumeRow, block_size: int) -> bool:
    """Whether row is writable and its reservation covers every block of it."""
    if row.kind == "snapshot" or not row.reserve_bytes:
        return False
    return row_target(row, block_size) >= -(-row.size_bytes // block_size)


# ----- across owners (ownership per volume: core/owner.py, core/pool_steps.py) --------
# Each owner allocates only from its grants, and its own allocation gate (core/space.py)
# keeps its volumes' set-asides out of what its other volumes may take, so the blocks
# lying unused in its grants hold its reservations first. What they do not cover must
# stay in the free space outside every grant: a grant to anyone else leaves it there.
# None as a holder stands for the volumes nobody holds (their set-asides wait in the
# free space whole, for whoever takes them next).


def still_needed(
    set_aside_by_holder: dict[str | None, int], unused_by_holder: dict[str, int], but: str | None = None
) -> int:
    """What reservations still need from the free space outside every grant: for each
    holder except `but` (the owner being granted space, whose own set-asides its gate
    keeps), its volumes' set-asides less the unused blocks of its grants."""
    total = 0
    for holder, set_aside in set_aside_by_holder.items():
        if holder is not None and holder == but:
            continue
        credit = unused_by_holder.get(holder, 0) if holder is not None else 0
        total += max(0, set_aside - credit)
    return total
