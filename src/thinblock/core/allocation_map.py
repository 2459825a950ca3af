"""A volume's allocation as runs and as a bounded grid of cells: what `volume map` draws.

People read a picture of allocation more easily than `nbdinfo --map` output. The
walk lives here, once, for every picture (PNG, SVG, terminal) and for --json:

* `allocation_runs(vol)` gives (length_blocks, state, shared) runs covering the
  whole volume. It walks the root table, not the blocks: a page absent from it
  is one UNMAPPED run at once, so a 1 PiB volume with a few blocks written costs
  a few pages. A block is shared when its mapping page is held by another root
  table (refcount > 1) or its dblock by another page (refcount > 1): writing it
  would copy it, as Volume.usage() counts it.
* `allocation_map(vol, columns, max_rows)` folds the runs into at most
  columns * max_rows cells of equal numbers of blocks, so that what crosses the
  control socket is bounded by the picture, not by the volume.

A cell shows the most allocated state any of its blocks has (DATA over ZEROED
over UNMAPPED), so one written block in a petabyte stays visible; it is drawn
shared when at least half of its blocks in that state are shared. The figures
beside the map are exact, counted from the runs, not from the cells.
"""

from __future__ import annotations

from itertools import groupby
from typing import TYPE_CHECKING, Any

from thinblock.core.mapping import DBLOCK_SHIFT, PAGE_ENTRIES, STATE_MASK, BlockState
from thinblock.core.runs import Runs
from thinblock.errors import ThinblockError

if TYPE_CHECKING:
    from thinblock.core.volume import Volume

UNMAPPED, ZEROED, DATA = int(BlockState.UNMAPPED), int(BlockState.ZEROED), int(BlockState.DATA)

# Cell codes: one character each, also the plain-text map's characters.
CELL_STATES = {
    "D": ("data", False),
    "d": ("data", True),
    "Z": ("zeroed", False),
    "z": ("zeroed", True),
    ".": ("unmapped", False),
}
CELL_NAMES = {"D": "data", "d": "data, shared", "Z": "zeroed", "z": "zeroed, shared", ".": "unmapped"}
MAX_CELLS = 1 << 18  # what one map may ask for: 512 x 512 cells


def allocation_runs(vol: Volume) -> list[tuple[int, int, bool]]:
    """(length_blocks, state, shared) runs over the whole volume, equal neighbours
    merged; UNMAPPED runs are never shared. Each mapping page is read under the pool
    lock, one page at a time: a map of a volume full of data takes seconds, and
    requests on every volume of the pool must not wait that long for the lock. A page
    is consistent in itself; writes landing meanwhile show or not, as in a live pool."""
    pool = vol.pool
    with pool.lock:
        n_blocks = -(-vol.size_bytes // pool.block_size)
        page_indexes = sorted(vol.root)
    runs: Runs[int] = Runs()  # key: state * 2 + shared (0: UNMAPPED)
    add = runs.add
    refcounts = pool.accounts.space.refcounts
    pos = 0
    for page_index in page_indexes:
        first = page_index * PAGE_ENTRIES
        if first >= n_blocks:
            break  # pages past the end cannot hold mappings; stay safe if one does
        with pool.lock:
            page_id = vol.root.get(page_index)
            if page_id is None:
                continue  # released meanwhile (a trim, a removal): its blocks read as unmapped
            page = pool.txn.page(page_id)
            entries = page.entries[: min(PAGE_ENTRIES, n_blocks - first)]
            # One key per entry in a comprehension, then groupby: this loop is the
            # cost of mapping a volume full of data (about 0.6 s per million blocks).
            if page.refcount > 1:
                keys = [(e & STATE_MASK) * 2 + 1 if e else 0 for e in entries]
            else:
                keys = [(e & STATE_MASK) * 2 + (refcounts[e >> DBLOCK_SHIFT] > 1) if e else 0 for e in entries]
        add(first - pos, 0)
        for key, group in groupby(keys):
            add(sum(1 for _ in group), key)
        pos = first + len(entries)
    add(n_blocks - pos, 0)
    return [(n, key >> 1, bool(key & 1)) for n, key in runs.pairs()]


def _code(counts: list[int]) -> str:
    """The cell code of [data, data shared, zeroed, zeroed shared] block counts."""
    data, data_shared, zeroed, zeroed_shared = counts
    if data + data_shared:
        return "d" if 2 * data_shared >= data + data_shared else "D"
    if zeroed + zeroed_shared:
        return "z" if 2 * zeroed_shared >= zeroed + zeroed_shared else "Z"
    return "."


def _slot(state: int, shared: bool) -> int:
    return (0 if state == DATA else 2) + (1 if shared else 0)


def fold_cells(runs: list[tuple[int, int, bool]], n_blocks: int, blocks_per_cell: int) -> str:
    """One code per cell of blocks_per_cell blocks (the last may hold fewer). Costs
    O(runs + cells): cells inside one run take its code without being counted."""
    n_cells = -(-n_blocks // blocks_per_cell) if n_blocks else 0
    codes = ["."] * n_cells
    counts: dict[int, list[int]] = {}  # cells holding more than one run: counted
    pos = 0
    for length, state, shared in runs:
        end = pos + length
        if state != UNMAPPED:
            slot = _slot(state, shared)
            first, last = pos // blocks_per_cell, (end - 1) // blocks_per_cell
            pure = _code([length if i == slot else 0 for i in range(4)])
            for cell in (first, last):
                lo, hi = max(pos, cell * blocks_per_cell), min(end, (cell + 1) * blocks_per_cell)
                counts.setdefault(cell, [0, 0, 0, 0])[slot] += hi - lo
                if first == last:
                    break
            for cell in range(first + 1, last):
                codes[cell] = pure
        pos = end
    for cell, cell_counts in counts.items():
        codes[cell] = _code(cell_counts)
    return "".join(codes)


def figures(runs: list[tuple[int, int, bool]], size_bytes: int, block_size: int) -> dict[str, int]:
    """Exact byte figures of the runs (mapped blocks count whole, as volume info does)."""
    totals = {"data": 0, "zeroed": 0, "shared": 0, "exclusive": 0}
    for length, state, shared in runs:
        if state == UNMAPPED:
            continue
        totals["data" if state == DATA else "zeroed"] += length
        totals["shared" if shared else "exclusive"] += length
    mapped = (totals["data"] + totals["zeroed"]) * block_size
    return {
        "size_bytes": size_bytes,
        "data_bytes": totals["data"] * block_size,
        "zeroed_bytes": totals["zeroed"] * block_size,
        "unmapped_bytes": max(0, size_bytes - mapped),
        "shared_bytes": totals["shared"] * block_size,
        "exclusive_bytes": totals["exclusive"] * block_size,
    }


def grid(n_blocks: int, columns: int, max_rows: int) -> tuple[int, int]:
    """(blocks_per_cell, rows): the fewest blocks per cell whose cells fit in
    columns * max_rows; one block per cell when the volume is small enough."""
    blocks_per_cell = max(1, -(-n_blocks // (columns * max_rows)))
    n_cells = -(-n_blocks // blocks_per_cell)
    return blocks_per_cell, max(1, -(-n_cells // columns))


def cell_runs(codes: str) -> list[list[Any]]:
    """The cells as [count, state, shared] runs, for scripts (--json)."""
    out: list[list[Any]] = []
    for code in codes:
        state, shared = CELL_STATES[code]
        if out and out[-1][1] == state and out[-1][2] == shared:
            out[-1][0] += 1
        else:
            out.append([1, state, shared])
    return out


def allocation_map(vol: Volume, columns: int, max_rows: int) -> dict[str, Any]:
    """The map of vol in cells, at most columns * max_rows of them, with exact figures.

    "cells" is one code per cell (see CELL_STATES), row after row, columns wide."""
    if columns < 1 or max_rows < 1 or columns * max_rows > MAX_CELLS:
        raise ThinblockError(f"a map holds 1 to {MAX_CELLS} cells, not {columns} x {max_rows}")
    bs = vol.pool.block_size
    runs = allocation_runs(vol)
    n_blocks = sum(n for n, _, _ in runs)
    blocks_per_cell, rows = grid(n_blocks, columns, max_rows)
    return {
        "name": vol.name,
        "kind": vol.row.kind,
        "block_size": bs,
        "blocks": n_blocks,
        "blocks_per_cell": blocks_per_cell,
        "cell_bytes": blocks_per_cell * bs,
        "columns": columns,
        "rows": rows,
        **figures(runs, vol.size_bytes, bs),
        "cells": fold_cells(runs, n_blocks, blocks_per_cell),
    }
