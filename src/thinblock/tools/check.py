"""`pool check`: verify the committed metadata offline, from its tables alone.

It recomputes what the pool maintains incrementally (page and dblock
refcounts, per-volume counters, used blocks) and compares. Problems are
sentences for a person; an empty list means the pool is consistent.

The tables are read once (one walk of all_pages and of all_roots) and the
recomputation is numpy over the concatenated mapped entries (core/mapped.py):
bincount for refcounts and counters, masks for states, pins and dblocks, so
the cost is O(mapped) with no Python object per entry. Each part that finds
something wrong then walks its rows one by one, only then, to name each problem.
"""

from __future__ import annotations

import itertools
import os
import stat
from array import array
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from thinblock.backends import Location, locate
from thinblock.core.mapped import Mapped, mapped_entries, positions
from thinblock.core.mapping import PAGE_ENTRIES, BlockState, entry_dblock, entry_state, entry_valid, mapped_pairs
from thinblock.core.pool import check_data_size
from thinblock.core.pool_steps import grant_problems
from thinblock.core.reservation import replaced_id, set_aside_blocks, still_needed
from thinblock.core.spacemap import REFCOUNT_PAGE_ENTRIES
from thinblock.errors import CorruptionError, ThinblockError
from thinblock.meta.base import RESERVE_FULL, MetadataStore, VolumeRow
from thinblock.privacy import open_to_others
from thinblock.store.owned import inspect


def superblock_problem(sb: dict[str, Any]) -> str | None:
    """Why the superblock's block size or pool size cannot be measured in, or None:
    every check below divides by one and counts in the other."""
    block_size, size_bytes = sb.get("block_size"), sb.get("size_bytes")
    for key, value in (("block size", block_size), ("pool size", size_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return f"superblock {key} {value!r} is not a positive number of bytes"
    return None


def check_metadata(meta: MetadataStore) -> list[str]:
    """All problems found in the metadata (an empty list when it is consistent)."""
    try:
        return _check(meta)
    except (CorruptionError, ValueError, KeyError, TypeError, ArithmeticError) as exc:
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
    except CorruptionError as exc:
        return [f"superblock cannot be read: {exc}"]
    problem = superblock_problem(sb)
    if problem is not None:
        return [problem]
    size_bytes, block_size = int(sb["size_bytes"]), int(sb["block_size"])
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
        if superblock_problem(sb) is not None:  # said by check_data_store; no header is measured by it
            return {"metadata": None, "data_store": None}, []
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
    except (CorruptionError, ValueError, TypeError, KeyError) as exc:  # a damaged superblock's values
        return figures, [f"the data store's owner header cannot be checked: {exc}"]
    finally:
        store.close()
    if store.header is not None:
        figures["data_store"] = store.header.generation
    elif sb.get("pool_uuid") is None:
        figures["note"] = "made by an older thinblock: the next open writes the data store's owner header"
    return figures, [] if why is None else [why.replace(" cannot be opened:", ":", 1)]


class _Tables(NamedTuple):
    """The committed tables, read once, as arrays (the pages' in all_pages order)."""

    volumes: dict[int, VolumeRow]
    page_ids: NDArray[np.int64]
    page_refcounts: NDArray[np.int64]
    mapped: Mapped  # the pages' nonzero entries
    roots: NDArray[np.int64]  # (volume id, page index, page id) rows
    root_volume: NDArray[np.intp]  # each root row's position in vol_ids
    root_page: NDArray[np.intp]  # each root row's position in page_ids
    root_ok: NDArray[np.bool_]  # the row's volume and page exist
    vol_ids: NDArray[np.int64]  # sorted


def _read_tables(meta: MetadataStore, problems: list[str]) -> _Tables:
    """One walk of volumes, pages and roots; a page that cannot be decoded is a problem
    and is left out (as if missing)."""
    volumes = {row.id: row for row in meta.volumes()}
    ids: list[int] = []
    refcounts: list[int] = []

    def decoded() -> Iterator[tuple[array[int], array[int]]]:
        for page_id, refcount, blob in meta.all_pages():
            try:
                pairs = mapped_pairs(blob, page_id)
            except CorruptionError as exc:
                problems.append(str(exc))
                continue
            ids.append(page_id)
            refcounts.append(refcount)
            yield pairs

    mapped = mapped_entries(decoded())
    page_ids = np.array(ids, dtype=np.int64)
    if len(np.unique(page_ids)) != len(page_ids):
        raise CorruptionError("the pages table holds a page id twice")
    roots = np.fromiter(itertools.chain.from_iterable(meta.all_roots()), dtype=np.int64).reshape(-1, 3)
    vol_ids = np.array(sorted(volumes), dtype=np.int64)
    root_volume, volume_ok = positions(vol_ids, roots[:, 0])
    order = np.argsort(page_ids, kind="stable")
    where, page_ok = positions(page_ids[order], roots[:, 2])
    root_page = order[where].astype(np.intp) if len(order) else where
    return _Tables(
        volumes,
        page_ids,
        np.array(refcounts, dtype=np.int64),
        mapped,
        roots,
        root_volume,
        root_page,
        volume_ok & page_ok,
        vol_ids,
    )


def _check_roots(t: _Tables, block_size: int) -> list[str]:
    """Root rows of missing volumes, beyond their volume, or at missing pages."""
    limits = np.array(
        [-(-t.volumes[int(vid)].size_bytes // (PAGE_ENTRIES * block_size)) for vid in t.vol_ids], dtype=np.int64
    )
    ok_volume = np.isin(t.roots[:, 0], t.vol_ids)
    beyond = ok_volume & (t.roots[:, 1] >= (limits[t.root_volume] if len(limits) else 0))
    beyond |= t.roots[:, 1] < 0
    tail = _entries_past_the_end(t, block_size)
    if bool(ok_volume.all()) and not beyond.any() and bool(t.root_ok.all()):
        return tail
    problems = []  # something is wrong: the detailed walk names it, row by row
    present = set(t.page_ids.tolist())
    for volume_id, page_index, page_id in t.roots.tolist():
        if volume_id not in t.volumes:
            problems.append(f"root table entry for missing volume id {volume_id}")
            continue
        row = t.volumes[volume_id]
        if page_index < 0:
            problems.append(f"volume {row.name}: mapping page at index {page_index} lies before its start")
        elif page_index * PAGE_ENTRIES * block_size >= row.size_bytes:
            problems.append(f"volume {row.name}: mapping page at index {page_index} lies beyond its size")
        if page_id not in present:
            problems.append(f"volume {row.name}: page index {page_index} points at missing mapping page {page_id}")
    return problems + tail


def _entries_past_the_end(t: _Tables, block_size: int) -> list[str]:
    """Blocks mapped past a volume's end, in the page that holds its last block: a later
    grow would show their old bytes. Only those pages are looked at (one per volume)."""
    if not len(t.roots) or not len(t.page_ids):
        return []
    sizes = np.array([-(-t.volumes[int(v)].size_bytes // block_size) for v in t.vol_ids], dtype=np.int64)
    ok = t.root_ok & (t.roots[:, 1] >= 0)
    blocks = np.zeros(len(t.roots), dtype=np.int64)  # of each row's page, inside its volume
    blocks[ok] = sizes[t.root_volume[ok]] - t.roots[ok, 1] * PAGE_ENTRIES
    rows = np.flatnonzero(ok & (blocks > 0) & (blocks < PAGE_ENTRIES))
    starts = np.searchsorted(t.mapped.page, np.arange(len(t.page_ids) + 1))  # entries come page by page
    problems = []
    for r in rows.tolist():
        volume_id, page_index, page = int(t.roots[r, 0]), int(t.roots[r, 1]), int(t.root_page[r])
        row = t.volumes[volume_id]
        slots = t.mapped.slot[starts[page] : starts[page + 1]]
        past = slots[slots >= blocks[r]]
        if past.size:
            first = page_index * PAGE_ENTRIES + int(past.min())
            problems.append(
                f"volume {row.name}: {past.size} block(s) are mapped past its end (the first at block {first}):"
                " growing it would show their old bytes"
            )
    return problems


def _check_pages(t: _Tables, n_blocks: int) -> tuple[list[str], NDArray[np.int64]]:
    """Page refcounts against the root tables, entries' states and dblocks; and the
    dblock refcounts the valid entries make (one per entry)."""
    n_pages = len(t.page_ids)
    page_refs = np.bincount(t.root_page[t.root_ok], minlength=n_pages)
    m = t.mapped
    invalid = ~m.valid()
    beyond = ~invalid & (m.dblock >= n_blocks)
    good = ~invalid & ~beyond
    dblock_refs = np.bincount(m.dblock[good], minlength=n_blocks)
    bad_pages = page_refs != t.page_refcounts
    bad_pages[m.page[~good]] = True
    problems: list[str] = []
    if not bad_pages.any():
        return problems, dblock_refs
    # The detailed walk, over the pages that are wrong only, in the pages' order.
    wrong = m.take(~good)
    for pos in np.flatnonzero(bad_pages).tolist():
        page_id = int(t.page_ids[pos])
        stored, used = int(t.page_refcounts[pos]), int(page_refs[pos])
        if stored != used:
            problems.append(f"mapping page {page_id}: refcount {stored} stored, {used} root tables use it")
        here = wrong.page == pos
        for slot, entry in zip(wrong.slot[here].tolist(), wrong.entry[here].tolist(), strict=True):
            if not entry_valid(entry):
                problems.append(f"mapping page {page_id} slot {slot}: invalid entry state {entry_state(entry)}")
            else:
                problems.append(
                    f"mapping page {page_id} slot {slot}: dblock {entry_dblock(entry)} is beyond the data store"
                    f" ({n_blocks} blocks)"
                )
    return problems, dblock_refs


def _check_counters(t: _Tables) -> list[str]:
    """Per-volume counters: entries in each volume's pages (a shared page counts for each)."""
    m, n_pages = t.mapped, len(t.page_ids)
    state = m.state

    def per_volume(which: NDArray[np.bool_]) -> list[int]:
        per_page = np.bincount(m.page[which], minlength=n_pages)
        rows = t.root_ok
        counts: list[int] = (
            np.bincount(t.root_volume[rows], weights=per_page[t.root_page[rows]], minlength=len(t.vol_ids))
            .astype(np.int64)
            .tolist()
        )
        return counts

    data = per_volume(state == BlockState.DATA)
    zeroed = per_volume(state == BlockState.ZEROED)
    pinned = per_volume(m.pinned)
    index = {int(vid): i for i, vid in enumerate(t.vol_ids)}
    problems = []
    for vid, row in t.volumes.items():
        i = index[vid]
        for label, stored, actual in (
            ("data blocks", row.data_blocks, data[i]),
            ("zeroed blocks", row.zeroed_blocks, zeroed[i]),
            ("provisioned blocks", row.pinned_blocks, pinned[i]),
        ):
            if stored != actual:
                problems.append(f"volume {row.name}: {stored} {label} recorded, {actual} mapped")
    return problems


def exclusive_problems(meta: MetadataStore) -> list[str]:
    """Only the kept exclusive counts' part of the check (the model test runs it after
    every step): empty when every committed count is right."""
    sb = meta.superblock()
    n_blocks = int(sb["size_bytes"]) // int(sb["block_size"])
    tables = _read_tables(meta, [])
    _problems, dblock_refs = _check_pages(tables, n_blocks)
    return _check_exclusive(tables, dblock_refs, n_blocks, int(sb.get("sharing_epoch") or 0))


def _check_exclusive(t: _Tables, dblock_refs: NDArray[np.int64], n_blocks: int, epoch: int) -> list[str]:
    """The kept exclusive-block counts (core/exclusive.py) against the tables: an entry is
    exclusive when one root table holds its page and one page points at its dblock. A
    count stamped with an older sharing epoch may be a lower bound; it is drift when it
    claims to be exact and differs, or when it exceeds the truth."""
    m, n_pages = t.mapped, len(t.page_ids)
    holders = np.bincount(t.root_page[t.root_ok], minlength=n_pages)
    alone = m.valid() & (m.dblock < n_blocks)  # bad entries are the page check's to report
    alone[alone] = (holders[m.page[alone]] == 1) & (dblock_refs[m.dblock[alone]] == 1)
    per_page = np.bincount(m.page[alone], minlength=n_pages)
    rows = t.root_ok.copy()
    rows[rows] = holders[t.root_page[rows]] == 1
    counts: list[int] = (
        np.bincount(t.root_volume[rows], weights=per_page[t.root_page[rows]], minlength=len(t.vol_ids))
        .astype(np.int64)
        .tolist()
    )
    index = {int(vid): i for i, vid in enumerate(t.vol_ids)}
    problems = []
    for vid, row in sorted(t.volumes.items(), key=lambda item: item[1].name):
        actual, stored = counts[index[vid]], row.exclusive_blocks
        exact = row.exclusive_epoch == epoch or stored == row.data_blocks + row.zeroed_blocks
        if exact and stored != actual:
            problems.append(f"{row.kind} {row.name}: {stored} exclusive blocks recorded as exact, {actual} found")
        elif stored > actual:
            problems.append(f"{row.kind} {row.name}: at least {stored} exclusive blocks recorded, {actual} found")
    return problems


def _check_lineage_and_reservations(
    t: _Tables, dblock_refs: NDArray[np.int64], block_size: int, n_blocks: int
) -> list[str]:
    """Snapshots are read-only volumes with a valid origin; reservations fit in the pool."""
    volumes = t.volumes
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
    free = n_blocks - int(np.count_nonzero(dblock_refs))
    reserving = [row for row in volumes.values() if row.reserve_bytes]
    if not reserving:
        return problems
    # What reservations set aside (the pool's own rule, core/reservation.py), from the
    # blocks each volume owns alone (in a page it holds alone, a dblock nothing else maps).
    m, n_pages = t.mapped, len(t.page_ids)
    dblock = m.dblock
    inside = dblock < n_blocks
    alone = np.zeros(len(dblock), np.bool_)
    alone[inside] = dblock_refs[dblock[inside]] == 1
    owned_per_page = np.bincount(m.page[alone], minlength=n_pages)
    rows = t.root_ok & (t.page_refcounts[t.root_page] <= 1) if n_pages else t.root_ok
    owned = np.bincount(
        t.root_volume[rows], weights=owned_per_page[t.root_page[rows]], minlength=len(t.vol_ids)
    ).astype(np.int64)
    index = {int(vid): i for i, vid in enumerate(t.vol_ids)}
    # A staging volume's blocks count toward the volume it will replace (same rule).
    replacing: dict[int, int] = {}
    for row in volumes.values():
        replaced = replaced_id(row)
        if replaced is not None and row.id in index:
            replacing[replaced] = replacing.get(replaced, 0) + int(owned[index[row.id]])
    reserved = 0
    for row in reserving:
        reserved += set_aside_blocks(
            row, block_size, exclusive=int(owned[index[row.id]]), replacement_blocks=replacing.get(row.id, 0)
        )
    # A checked pool is held by nobody (grants left by dead owners are free blocks
    # here): every set-aside is needed whole from the free space (the same rule).
    needed = still_needed({None: reserved}, {})
    if needed > free:
        problems.append(f"reservations set aside {needed} blocks but only {free} are free")
    return problems


def _check_refcounts(meta: MetadataStore, dblock_refs: NDArray[np.int64], n_blocks: int) -> list[str]:
    """The stored dblock refcounts against the ones the mappings make."""
    problems: list[str] = []
    stored_refs = np.zeros(n_blocks, np.uint32)
    for index, blob in meta.refcount_pages().items():
        chunk = array("I")
        chunk.frombytes(blob)  # a blob of a wrong length: "metadata cannot be read"
        counts = np.frombuffer(chunk, dtype=np.uint32)
        start = index * REFCOUNT_PAGE_ENTRIES
        inside = max(0, min(len(counts), n_blocks - start))
        stored_refs[start : start + inside] = counts[:inside]
        for i in np.flatnonzero(counts[inside:]).tolist():
            problems.append(
                f"dblock {start + inside + i}: refcount {counts[inside + i]} recorded beyond the data store"
            )
    bad = np.flatnonzero(stored_refs != dblock_refs)
    for dblock in bad[:50].tolist():
        stored, actual = int(stored_refs[dblock]), int(dblock_refs[dblock])
        if stored == 0:
            problems.append(f"dblock {dblock}: mapped {actual} times but recorded as free")
        elif actual == 0:
            problems.append(f"dblock {dblock}: refcount {stored} recorded but nothing maps it (leaked space)")
        else:
            problems.append(f"dblock {dblock}: refcount {stored} recorded, {actual} references found")
    if len(bad) > 50:
        problems.append(f"... and {len(bad) - 50} more dblocks with wrong refcounts")
    return problems


def _check(meta: MetadataStore) -> list[str]:
    """Every table recomputed from the mappings, vectorised over the mapped entries;
    each part names its problems by a detailed walk only when it found one."""
    problems: list[str] = []
    integrity = meta.integrity_problems()
    if integrity:
        return integrity
    sb = meta.superblock()
    problem = superblock_problem(sb)
    if problem is not None:
        return [problem]  # nothing below can be measured in such blocks
    block_size = int(sb["block_size"])
    size_bytes = int(sb["size_bytes"])
    if block_size & (block_size - 1):
        problems.append(f"superblock block size {block_size} is not a power of two")
    n_blocks = size_bytes // block_size
    if sb.get("page_entries") != PAGE_ENTRIES:
        problems.append(f"superblock says {sb.get('page_entries')} entries per page, expected {PAGE_ENTRIES}")
    if n_blocks < 0:
        raise ValueError(f"the pool size {size_bytes} is negative")

    tables = _read_tables(meta, problems)
    problems.extend(_check_roots(tables, block_size))
    page_problems, dblock_refs = _check_pages(tables, n_blocks)
    problems.extend(page_problems)
    problems.extend(_check_counters(tables))
    problems.extend(_check_lineage_and_reservations(tables, dblock_refs, block_size, n_blocks))
    problems.extend(_check_refcounts(meta, dblock_refs, n_blocks))
    used = int(np.count_nonzero(dblock_refs))
    if sb.get("used_blocks") != used:
        problems.append(f"superblock records {sb.get('used_blocks')} used blocks, {used} are referenced")
    problems.extend(_check_exclusive(tables, dblock_refs, n_blocks, int(sb.get("sharing_epoch") or 0)))
    problems.extend(grant_problems(meta, n_blocks, {row.id for row in meta.volumes()}))
    return problems
