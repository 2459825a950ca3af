"""sparsify: give back the space of a volume's blocks that hold only zeros, online."""

from __future__ import annotations

import threading
import time
from typing import Any

from thinblock.core.pool import Pool
from thinblock.errors import ThinblockError
from thinblock.progress import ProgressFn
from thinblock.transfer.common import Progress, chunks, data_extents, elapsed, run_all, visible

SPARSIFY_STEP = 16 << 20  # each step holds this much of the volume in its range lock


def sparsify(pool: Pool, name: str, progress: ProgressFn) -> dict[str, Any]:
    """Give back the space of a volume's blocks that hold only zeros (Volume.sparsify),
    online: clients may keep using the volume. Blocks shared with a snapshot or clone
    stay as they are and are counted apart (freeing them would free nothing)."""
    start = time.monotonic()
    vol = visible(pool, name)
    if vol.readonly:
        raise ThinblockError(
            f"{name} is a snapshot, and snapshots are read-only: sparsify the volume (blocks it shares with the"
            " snapshot stay shared)"
        )
    free_before = pool.space_figures()["free_bytes"]
    extents = [e for e in data_extents(vol) if e[2]]
    tell = Progress(progress, sum(n for _, n, _ in extents))
    totals = [0, 0, 0, 0]
    lock = threading.Lock()

    def step(piece: tuple[int, int]) -> None:
        result = vol.sparsify(*piece)  # each step holds its own range: steps run side by side
        with lock:
            for i, value in enumerate(result):
                totals[i] += value
        tell.add(piece[1])

    run_all(step, (piece for offset, n, _data in extents for piece in chunks(offset, n, SPARSIFY_STEP)))
    if pool.owner is None:
        pool.settle_frees()  # the freed blocks are punched and free before this returns
        freed = pool.space_figures()["free_bytes"] - free_before
    else:
        # An owner per volume frees into the pool once committed (whoever is granted the
        # blocks next punches them), and its own figures are those of its grants: what
        # went back is what was unmapped, which this volume held alone.
        pool.commit()
        freed = totals[1]
    tell.end()
    return {
        "volume": name,
        "data_bytes": totals[0],
        "unmapped_bytes": totals[1],
        "zeroed_bytes": totals[2],
        "shared_zero_bytes": totals[3],
        "freed_bytes": freed,
        "seconds": elapsed(start),
    }
