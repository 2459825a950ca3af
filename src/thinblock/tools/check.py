"""`pool check`: verify the committed metadata offline, from its tables alone.

It recomputes what the pool maintains incrementally (page and dblock
refcounts, per-volume counters, used blocks) and compares. Problems are
sentences for a person; an empty list means the pool is consistent.
"""

from __future__ import annotations

import os
import stat
from array import array
from collections import Counter
from typing import Any

from thinblock.backends import Location, locate
from thinblock.core.mapping import PAGE_ENTRIES, BlockState, Page, entry_dblock, entry_pinned, entry_state, entry_valid
from thinblock.core.pool import check_data_size
from thinblock.core.spacemap import REFCOUNT_PAGE_ENTRIES
from thinblock.errors import CorruptionError, ThinblockError
from thinblock.meta.base import RESERVE_FULL, MetadataStore, VolumeRow, reserve_blocks
from thinblock.privacy import open_to_others
from thinblock.store.owned import inspect
from thinblock.tools.check_counters import check_counters


def check_metadata(meta: MetadataStore) -> list[str]:
    """All problems found in the metadata (an empty list when it is consistent)."""
    try:
        return _check(meta)
    except (CorruptionError, ValueError, KeyError, TypeError) as exc:
        return [f"metadata cannot be read: {exc}"]


def check_privacy(locator: str | Location, meta: MetadataStore) -> list[str]:
    """Warnings, not problems: pool files or directories other users can get at. Anyone
    who can read them can read every volume (the pool's owner is the trust boundary)."""
    try:
        paths = locate(locator).local_paths(meta.superblock())
    except (CorruptionError, ThinblockError):
        return []
    warnings = []
    for path in paths:
        how = open_to_others(path)
        if how is not None:
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            fix = "700" if os.path.isdir(path) else "600"
            warnings.append(f"{path} is {how} by other users (mode {mode:04o}): chmod {fix} {path}")
    return warnings


def check_data_store(locator: str | Location, meta: MetadataStore) -> list[str]:
    """What the superblock promises about the data store, checked against it: it
    exists and holds at least the pool's size (a shorter one would serve its
    missing tail as zeros)."""
    try:
        sb = meta.superblock()
        size_bytes, block_size = int(sb["size_bytes"]), int(sb["block_size"])
    except (CorruptionError, KeyError, ValueError, TypeError) as exc:
        return [f"superblock cannot be read: {exc}"]
    problems = []
    if size_bytes <= 0 or size_bytes % block_size:
        problems.append(f"superblock pool size {size_bytes} is not a positive multiple of the block size {block_size}")
    if not 0 <= int(sb.get("used_blocks") or 0) <= size_bytes // max(1, block_size):
        problems.append(f"superblock records {sb.get('used_blocks')} used blocks in a pool of {size_bytes} bytes")
    location = locate(locator)
    data_path = location.data_name(sb)
    try:
        store = location.open_data(sb, readonly=True)
    except ThinblockError as exc:
        return [*problems, str(exc)]
    try:
        check_data_size(store, size_bytes, data_path)
    except CorruptionError as exc:
        problems.append(str(exc))
    finally:
        store.close()
    return problems


def check_generation(locator: str | Location, meta: MetadataStore) -> tuple[dict[str, Any], list[str]]:
    """The two generations (the metadata's transaction_id, the data store's header) and
    the owner check of store/owned.py, as problems: another pool's data, no header,
    metadata older than its data."""
    location = locate(locator)
    try:
        sb = meta.superblock()
        figures: dict[str, Any] = {
            "pool_uuid": sb.get("pool_uuid"),
            "metadata": int(sb.get("transaction_id") or 0),
            "data_store": None,
        }
        store = location.owned_store(sb, location.open_data(sb, readonly=True))
    except (CorruptionError, ThinblockError, KeyError, ValueError, TypeError) as exc:
        return {"metadata": None, "data_store": None}, [f"the data store's owner header cannot be read: {exc}"]
    try:
        why = inspect(store, sb, location.data_owner(), location.name, location.data_name(sb))
    except OSError as exc:
        return figures, [f"the data store's owner header cannot be read: {exc.strerror or exc}"]
    finally:
        store.close()
    if store.header is not None:
        figures["data_store"] = store.header.generation
    elif sb.get("pool_uuid") is None:
        figures["note"] = "made by an older thinblock: the next open writes the data store's owner header"
    return figures, [] if why is None else [why.replace(" cannot be opened:", ":", 1)]


def _check_lineage_and_reservations(
    meta: MetadataStore,
    volumes: dict[int, VolumeRow],
    pages: dict[int, Page],
    dblock_refs: array[int],
    block_size: int,
    n_blocks: int,
) -> list[str]:
    """Snapshots are read-only volumes with a valid origin; reservations fit in the pool."""
    problems: list[str] = []
    for row in volumes.values():
        if row.kind not in ("volume", "snapshot"):
            problems.append(f"volume {row.name}: unknown kind {row.kind!r}")
        if row.origin_id is not None and row.origin_id not in volumes:
            problems.append(f"{row.kind} {row.name}: origin id {row.origin_id} does not exist")
        if row.kind == "snapshot" and row.reserve_bytes:
            problems.append(f"snapshot {row.name} has a reservation (only volumes may)")
        if row.reserve_bytes < RESERVE_FULL:
            problems.append(f"volume {row.name}: invalid reservation {row.reserve_bytes}")
    # What reservations set aside: R - blocks the volume owns alone, summed.
    reserved = 0
    for vid, row in volumes.items():
        if not row.reserve_bytes:
            continue
        owned = 0
        for _pi, page_id in meta.roots(vid).items():
            page = pages.get(page_id)
            if page is None or page.refcount > 1:
                continue
            owned += sum(
                1 for e in page.entries if e and entry_dblock(e) < n_blocks and dblock_refs[entry_dblock(e)] == 1
            )
        reserved += max(0, reserve_blocks(row.reserve_bytes, row.size_bytes, block_size) - owned)
    free = n_blocks - sum(1 for count in dblock_refs if count)
    if reserved > free:
        problems.append(f"reservations set aside {reserved} blocks but only {free} are free")
    return problems


def _check(meta: MetadataStore) -> list[str]:
    problems: list[str] = []
    integrity = meta.integrity_problems()
    if integrity:
        return integrity
    sb = meta.superblock()
    block_size = int(sb["block_size"])
    size_bytes = int(sb["size_bytes"])
    n_blocks = size_bytes // block_size
    if block_size <= 0 or block_size & (block_size - 1):
        problems.append(f"superblock block size {block_size} is not a power of two")
    if sb.get("page_entries") != PAGE_ENTRIES:
        problems.append(f"superblock says {sb.get('page_entries')} entries per page, expected {PAGE_ENTRIES}")

    volumes = {row.id: row for row in meta.volumes()}
    pages: dict[int, Page] = {}
    for page_id, refcount, blob in meta.all_pages():
        try:
            pages[page_id] = Page.from_blob(page_id, refcount, blob)
        except CorruptionError as exc:
            problems.append(str(exc))

    page_refs: Counter[int] = Counter()
    for volume_id, page_index, page_id in meta.all_roots():
        if volume_id not in volumes:
            problems.append(f"root table entry for missing volume id {volume_id}")
            continue
        row = volumes[volume_id]
        if page_index * PAGE_ENTRIES * block_size >= row.size_bytes:
            problems.append(f"volume {row.name}: mapping page at index {page_index} lies beyond its size")
        if page_id not in pages:
            problems.append(f"volume {row.name}: page index {page_index} points at missing mapping page {page_id}")
            continue
        page_refs[page_id] += 1

    dblock_refs = array("I", bytes(4 * n_blocks))
    counters: dict[int, Counter[str]] = {vid: Counter() for vid in volumes}
    for page_id, page in pages.items():
        if page.refcount != page_refs[page_id]:
            problems.append(
                f"mapping page {page_id}: refcount {page.refcount} stored, {page_refs[page_id]} root tables use it"
            )
        for slot, entry in enumerate(page.entries):
            if not entry:
                continue
            if not entry_valid(entry):
                problems.append(f"mapping page {page_id} slot {slot}: invalid entry state {entry_state(entry)}")
                continue
            dblock = entry_dblock(entry)
            if dblock >= n_blocks:
                problems.append(
                    f"mapping page {page_id} slot {slot}: dblock {dblock} is beyond the data store ({n_blocks} blocks)"
                )
                continue
            dblock_refs[dblock] += 1
    # Per-volume counters count entries in each volume's pages (a shared page counts for each).
    for volume_id, _page_index, page_id in meta.all_roots():
        if volume_id in counters and page_id in pages:
            c = counters[volume_id]
            for entry in pages[page_id].entries:
                if entry:
                    c[BlockState(entry_state(entry)).name] += 1
                    c["PINNED"] += entry_pinned(entry)
    for vid, row in volumes.items():
        c = counters[vid]
        for label, stored, actual in (
            ("data blocks", row.data_blocks, c["DATA"]),
            ("zeroed blocks", row.zeroed_blocks, c["ZEROED"]),
            ("provisioned blocks", row.pinned_blocks, c["PINNED"]),
        ):
            if stored != actual:
                problems.append(f"volume {row.name}: {stored} {label} recorded, {actual} mapped")

    problems.extend(_check_lineage_and_reservations(meta, volumes, pages, dblock_refs, block_size, n_blocks))

    stored_refs = array("I", bytes(4 * n_blocks))
    for index, blob in meta.refcount_pages().items():
        chunk = array("I")
        chunk.frombytes(blob)
        start = index * REFCOUNT_PAGE_ENTRIES
        for i, count in enumerate(chunk):
            if not count:
                continue
            if start + i >= n_blocks:
                problems.append(f"dblock {start + i}: refcount {count} recorded beyond the data store")
            else:
                stored_refs[start + i] = count
    bad = [d for d in range(n_blocks) if stored_refs[d] != dblock_refs[d]] if stored_refs != dblock_refs else []
    for dblock in bad[:50]:
        stored, actual = stored_refs[dblock], dblock_refs[dblock]
        if stored == 0:
            problems.append(f"dblock {dblock}: mapped {actual} times but recorded as free")
        elif actual == 0:
            problems.append(f"dblock {dblock}: refcount {stored} recorded but nothing maps it (leaked space)")
        else:
            problems.append(f"dblock {dblock}: refcount {stored} recorded, {actual} references found")
    if len(bad) > 50:
        problems.append(f"... and {len(bad) - 50} more dblocks with wrong refcounts")
    used = sum(1 for count in dblock_refs if count)
    if sb.get("used_blocks") != used:
        problems.append(f"superblock records {sb.get('used_blocks')} used blocks, {used} are referenced")
    problems.extend(check_counters(meta))
    return problems
