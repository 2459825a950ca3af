"""`pool check` of the kept exclusive-block counters (core/exclusive.py).

Each volume's exclusive count is recomputed from the tables alone: the root
tables say how many volumes hold each mapping page, the pages say how many
pages point at each dblock, and an entry is exclusive when both are 1. A
committed count may be a lower bound (stamped with an older sharing epoch); it
is drift when it claims to be exact and differs, or when it exceeds the truth.
Vectorised (numpy) and O(mapped entries) in time and memory: only the mapped
entries of each page are kept while counting.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from thinblock.core.mapping import Page
from thinblock.errors import CorruptionError
from thinblock.meta.base import MetadataStore


def check_counters(meta: MetadataStore) -> list[str]:
    """One sentence per volume whose committed exclusive count drifted (empty when none)."""
    sb = meta.superblock()
    epoch = int(sb.get("sharing_epoch") or 0)
    n_blocks = int(sb["size_bytes"]) // int(sb["block_size"])
    dblocks: dict[int, np.ndarray] = {}  # page id -> the dblocks its mapped entries point at
    for page_id, refcount, blob in meta.all_pages():
        try:
            entries = np.frombuffer(Page.from_blob(page_id, refcount, blob).entries, dtype=np.uint64)
        except CorruptionError:
            continue  # the main check reports the page
        mapped = entries[entries != 0] >> np.uint64(3)
        dblocks[page_id] = mapped[mapped < n_blocks].astype(np.intp)  # beyond: reported by the main check
    holders: Counter[int] = Counter()
    roots: defaultdict[int, list[int]] = defaultdict(list)
    for volume_id, _page_index, page_id in meta.all_roots():
        holders[page_id] += 1
        roots[volume_id].append(page_id)
    everything = [d for d in dblocks.values() if len(d)]
    refs = np.bincount(np.concatenate(everything), minlength=n_blocks) if everything else np.zeros(n_blocks, np.intp)
    problems = []
    for row in meta.volumes():
        alone = [dblocks[p] for p in roots.get(row.id, ()) if holders[p] == 1 and p in dblocks]
        actual = int(np.count_nonzero(refs[np.concatenate(alone)] == 1)) if alone else 0
        stored = row.exclusive_blocks
        exact = row.exclusive_epoch == epoch or stored == row.data_blocks + row.zeroed_blocks
        if exact and stored != actual:
            problems.append(f"{row.kind} {row.name}: {stored} exclusive blocks recorded as exact, {actual} found")
        elif stored > actual:
            problems.append(f"{row.kind} {row.name}: at least {stored} exclusive blocks recorded, {actual} found")
    return problems
