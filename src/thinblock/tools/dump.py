"""Dump, restore and repair: the metadata in a neutral, versioned form.

Like thin_dump / thin_restore / thin_repair, the neutral form knows volumes
and their mappings (vblock -> dblock runs with a state), not pages, page ids or
refcounts: those are derived again on restore. Two forms carry the same dict:
JSON (`--json`) and a line-oriented text for people:

    thinblock-dump 1
    pool block_size=65536 size_bytes=1073741824 data_path=null ...
    volume id=1 name="vm1" kind="volume" origin_id=null size_bytes=... ...
      map VBLOCK DBLOCK COUNT data|zeroed [pinned]

Every `key=value` value is JSON. Restore rebuilds every table from the dict;
identical pages at one page index of several volumes become one shared page
again, so snapshots keep sharing pages. Repair salvages what it can read into
that dict and restores it, reporting what it could not save.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import Counter
from typing import Any

from thinblock.backends import Location
from thinblock.core.mapping import PAGE_ENTRIES, BlockState, Page, entry_dblock, entry_pinned, entry_state, make_entry
from thinblock.core.spacemap import REFCOUNT_PAGE_ENTRIES
from thinblock.errors import CorruptionError, ThinblockError
from thinblock.meta.base import MetadataStore, Transaction, VolumeRow
from thinblock.progress import ProgressFn, no_progress
from thinblock.store.base import DataStore
from thinblock.store.owned import inspect
from thinblock.tools.rollback import drop_reborn, successor

DUMP_FORMAT = "thinblock-dump"
DUMP_VERSION = 1
_STATES = {"data": BlockState.DATA, "zeroed": BlockState.ZEROED}
_POOL_KEYS = ("block_size", "size_bytes", "data_path", "created", "when_full", "low_water", "on_low_water", "autogrow")
_VOLUME_KEYS = (
    "id",
    "name",
    "kind",
    "origin_id",
    "size_bytes",
    "detect_zeroes",
    "created",
    "reserve_bytes",
    "low_water",
    "on_low_water",
)
_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


# ----- dump ------------------------------------------------------------------------


def mapping_runs(entries: list[tuple[int, int]]) -> list[list[Any]]:
    """Sorted (vblock, entry) pairs as [vblock, dblock, count, state, pinned] runs."""
    runs: list[list[Any]] = []
    for vblock, entry in entries:
        dblock, state, pinned = entry_dblock(entry), BlockState(entry_state(entry)).name.lower(), entry_pinned(entry)
        last = runs[-1] if runs else None
        if (
            last is not None
            and last[0] + last[2] == vblock
            and last[1] + last[2] == dblock
            and last[3] == state
            and last[4] == pinned
        ):
            last[2] += 1
        else:
            runs.append([vblock, dblock, 1, state, pinned])
    return runs


def dump_metadata(meta: MetadataStore) -> dict[str, Any]:
    """The committed metadata as the neutral dict (salvage's walk, refusing any loss)."""
    dump, lost = salvage(meta)
    if lost:
        raise CorruptionError(
            f"the metadata cannot be dumped whole ({len(lost)} problem(s)); 'thinblock pool repair' would do this:"
            f" {lost[0]}"
        )
    return dump


def _volume_dict(row: VolumeRow, entries: list[tuple[int, int]]) -> dict[str, Any]:
    return {**{k: getattr(row, k) for k in _VOLUME_KEYS}, "mappings": mapping_runs(entries)}


def format_text(dump: dict[str, Any]) -> str:
    out = [f"{DUMP_FORMAT} {dump['version']}"]
    out.append("pool " + " ".join(f"{k}={json.dumps(v)}" for k, v in dump["pool"].items()))
    for vol in dump["volumes"]:
        out.append("volume " + " ".join(f"{k}={json.dumps(vol[k])}" for k in _VOLUME_KEYS))
        for vblock, dblock, count, state, pinned in vol["mappings"]:
            out.append(f"  map {vblock} {dblock} {count} {state}{' pinned' if pinned else ''}")
    return "\n".join(out) + "\n"


def parse_dump(text: str) -> dict[str, Any]:
    """Either form back into the dict; ThinblockError with a line number when malformed."""
    if text.lstrip().startswith("{"):
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ThinblockError(f"dump is not valid JSON: {exc}") from None
        if not isinstance(loaded, dict):
            raise ThinblockError("dump is not a thinblock dump")
        _check_header(loaded.get("format"), loaded.get("version"))
        return loaded
    lines = text.splitlines()
    dump: dict[str, Any] = {"format": DUMP_FORMAT, "pool": None, "volumes": []}
    for number, line in enumerate(lines, 1):
        words = line.split()
        try:
            if not words or words[0].startswith("#"):
                continue
            if words[0] == DUMP_FORMAT:
                _check_header(DUMP_FORMAT, int(words[1]))
                dump["version"] = int(words[1])
            elif "version" not in dump:
                raise ValueError(f"the first line must be '{DUMP_FORMAT} {DUMP_VERSION}'")
            elif words[0] == "pool":
                dump["pool"] = _pairs(line[4:])
            elif words[0] == "volume":
                dump["volumes"].append({**_pairs(line[6:]), "mappings": []})
            elif words[0] == "map" and dump["volumes"]:
                pinned = words[5:] == ["pinned"]
                if len(words) not in (5, 6) or (len(words) == 6 and not pinned):
                    raise ValueError("use: map VBLOCK DBLOCK COUNT data|zeroed [pinned]")
                dump["volumes"][-1]["mappings"].append([int(words[1]), int(words[2]), int(words[3]), words[4], pinned])
            else:
                raise ValueError(f"unexpected {words[0]!r}")
        except (ValueError, IndexError, json.JSONDecodeError) as exc:
            raise ThinblockError(f"dump line {number}: {exc}") from None
    if dump["pool"] is None:
        raise ThinblockError("dump has no 'pool' line")
    return dump


def _check_header(fmt: object, version: object) -> None:
    if fmt != DUMP_FORMAT:
        raise ThinblockError(f"not a thinblock dump (format {fmt!r})")
    if version != DUMP_VERSION:
        raise ThinblockError(f"dump version {version!r} is not supported (this thinblock reads {DUMP_VERSION})")


def _pairs(text: str) -> dict[str, Any]:
    return {m.group(1): json.loads(m.group(2)) for m in _PAIR.finditer(text)}


# ----- restore ---------------------------------------------------------------------


def build_metadata(location: Location, dump: dict[str, Any], identity: dict[str, Any] | None = None) -> None:
    """Write fresh metadata from a dump (validated first; nothing is
    written when it is inconsistent). The pool is marked unclean so that its
    next open punches every free block (the data file may hold stale bytes there)."""
    try:
        pool = dump["pool"]
        block_size, size_bytes = int(pool["block_size"]), int(pool["size_bytes"])
        n_blocks = size_bytes // block_size
        rows, roots = _validated_volumes(dump["volumes"], block_size, n_blocks)
    except (KeyError, TypeError, ValueError) as exc:
        raise ThinblockError(f"dump is incomplete or malformed: {exc!r}") from None
    txn = Transaction()
    page_ids: dict[tuple[int, bytes], int] = {}
    page_refs: Counter[int] = Counter()
    blobs: dict[int, bytes] = {}
    for row in rows:
        for page_index, entries in sorted(roots[row.id].items()):
            blob = entries.tobytes()
            page_id = page_ids.setdefault((page_index, blob), len(page_ids) + 1)
            blobs[page_id] = blob
            page_refs[page_id] += 1
            txn.roots[(row.id, page_index)] = page_id
    refcounts = array("I", bytes(4 * n_blocks))
    for blob in blobs.values():
        for entry in Page.from_blob(0, 0, blob).entries:
            if entry:
                refcounts[entry_dblock(entry)] += 1
    txn.pages = {pid: (page_refs[pid], blob) for pid, blob in blobs.items()}
    for index in range(0, n_blocks, REFCOUNT_PAGE_ENTRIES):
        chunk = refcounts[index : index + REFCOUNT_PAGE_ENTRIES]
        if any(chunk):
            txn.refcount_pages[index // REFCOUNT_PAGE_ENTRIES] = chunk.tobytes()
    txn.volumes = rows
    superblock = {k: pool.get(k) for k in _POOL_KEYS}
    superblock.update(page_entries=PAGE_ENTRIES, used_blocks=sum(1 for c in refcounts if c), clean=False)
    superblock.update(identity if identity is not None else successor(location, superblock))  # see tools/rollback.py
    location.replace_meta(superblock, txn)


def _validated_volumes(
    volumes: list[dict[str, Any]], block_size: int, n_blocks: int
) -> tuple[list[VolumeRow], dict[int, dict[int, array[int]]]]:
    rows: list[VolumeRow] = []
    roots: dict[int, dict[int, array[int]]] = {}
    ids = {int(v["id"]) for v in volumes}
    names: set[str] = set()
    for v in volumes:
        row = VolumeRow(
            id=int(v["id"]),
            name=str(v["name"]),
            size_bytes=int(v["size_bytes"]),
            detect_zeroes=str(v["detect_zeroes"]),
            created=float(v["created"]),
            kind=str(v["kind"]),
            origin_id=None if v["origin_id"] is None else int(v["origin_id"]),
            reserve_bytes=int(v["reserve_bytes"]),
            low_water=None if v["low_water"] is None else float(v["low_water"]),
            on_low_water=v["on_low_water"],
        )
        where = f"volume {row.name!r}"
        if row.id in roots or row.name in names:
            raise ThinblockError(f"{where}: id or name appears twice in the dump")
        if row.kind not in ("volume", "snapshot") or row.detect_zeroes not in ("off", "on", "unmap"):
            raise ThinblockError(f"{where}: invalid kind or detect_zeroes")
        if row.origin_id is not None and row.origin_id not in ids:
            raise ThinblockError(f"{where}: origin id {row.origin_id} is not in the dump")
        if row.size_bytes <= 0 or row.size_bytes % 512:
            raise ThinblockError(f"{where}: invalid size {row.size_bytes}")
        names.add(row.name)
        pages: dict[int, array[int]] = {}
        n_vblocks = -(-row.size_bytes // block_size)
        for vblock, dblock, count, state, pinned in v["mappings"]:
            vblock, dblock, count = int(vblock), int(dblock), int(count)
            if state not in _STATES or count <= 0 or vblock < 0 or dblock < 0:
                raise ThinblockError(f"{where}: invalid mapping {vblock} {dblock} {count} {state}")
            if vblock + count > n_vblocks or dblock + count > n_blocks:
                raise ThinblockError(
                    f"{where}: mapping {vblock}+{count} -> {dblock} lies beyond the volume or the data store"
                )
            for i in range(count):
                page_index, slot = divmod(vblock + i, PAGE_ENTRIES)
                entries = pages.setdefault(page_index, array("Q", bytes(8 * PAGE_ENTRIES)))
                if entries[slot]:
                    raise ThinblockError(f"{where}: vblock {vblock + i} is mapped twice")
                entries[slot] = make_entry(dblock + i, _STATES[state], pinned)
                if state == "data":
                    row.data_blocks += 1
                else:
                    row.zeroed_blocks += 1
                row.pinned_blocks += bool(pinned)
        roots[row.id] = pages
        rows.append(row)
    return rows, roots


def restore(locator: str, dump: dict[str, Any], progress: ProgressFn | None = None) -> dict[str, Any]:
    """`pool restore`: replace the pool's metadata with the dump's (pool not in use).
    progress follows the punching of free space at the first open (bytes)."""
    from thinblock.core.pool import Pool, owned

    with owned(locator, "thinblock restore") as location:
        build_metadata(location, dump)
    with Pool.open(locator, autocommit=False, progress=progress) as pool:  # recovers free space, then closes clean
        used_bytes = pool.space_figures()["used_bytes"]
    return {"volumes": len(dump["volumes"]), "used_bytes": used_bytes}


# ----- repair ----------------------------------------------------------------------


def salvage(
    meta: MetadataStore, data_bytes: int | None = None, progress: ProgressFn | None = None
) -> tuple[dict[str, Any], list[str]]:
    """A dump of everything readable, and sentences on what was lost. With
    data_bytes (a data store shorter than the pool), mappings into the missing
    tail are lost too: their bytes are gone. progress counts mapping pages read."""
    lost: list[str] = []
    sb = meta.superblock()
    block_size = int(sb["block_size"])
    n_blocks = int(sb["size_bytes"]) // block_size
    present = n_blocks if data_bytes is None else min(n_blocks, data_bytes // block_size)
    rows = {row.id: row for row in meta.volumes()}
    by_volume: dict[int, list[tuple[int, int]]] = {vid: [] for vid in rows}
    pages: dict[int, Page | None] = {}
    all_roots = sorted(meta.all_roots())
    tell = progress or no_progress
    for done, (volume_id, page_index, page_id) in enumerate(all_roots):
        if done % 64 == 0:
            tell(done, len(all_roots))
        row = rows.get(volume_id)
        if row is None:
            lost.append(f"root table rows of missing volume id {volume_id} dropped")
            continue
        if page_id not in pages:
            try:
                found = meta.page(page_id)
                pages[page_id] = None if found is None else Page.from_blob(page_id, *found)
            except CorruptionError:
                pages[page_id] = None
        page = pages[page_id]
        first = page_index * PAGE_ENTRIES
        if page is None:
            lost.append(
                f"volume {row.name}: blocks {first}-{first + PAGE_ENTRIES - 1} lost"
                f" (mapping page {page_id} unreadable); they now read zeros"
            )
            continue
        n_vblocks = -(-row.size_bytes // block_size)
        for slot, entry in enumerate(page.entries):
            if not entry:
                continue
            vblock, state, dblock = first + slot, entry_state(entry), entry_dblock(entry)
            if state not in (BlockState.DATA, BlockState.ZEROED) or dblock >= n_blocks or vblock >= n_vblocks:
                lost.append(f"volume {row.name}: block {vblock} had an invalid mapping {entry:#x}; it now reads zeros")
                continue
            if dblock >= present and state == BlockState.DATA:
                lost.append(
                    f"volume {row.name}: block {vblock} was in the lost tail of the data store (dblock {dblock});"
                    " it now reads zeros"
                )
                continue
            by_volume[volume_id].append((vblock, entry))
    for row in rows.values():
        if row.origin_id is not None and row.origin_id not in rows:
            row.origin_id = None
    tell(len(all_roots), len(all_roots))
    dump = {
        "format": DUMP_FORMAT,
        "version": DUMP_VERSION,
        "pool": {k: sb.get(k) for k in _POOL_KEYS},
        "volumes": [_volume_dict(rows[vid], sorted(entries)) for vid, entries in sorted(by_volume.items())],
    }
    return dump, lost


def repair(locator: str, progress: ProgressFn | None = None, *, accept_rollback: bool = False) -> dict[str, Any]:
    """`pool repair`: rebuild refcounts, counters and free space from the readable
    mappings (pool not in use). A copy of the old metadata is kept (for a
    directory pool, metadata.sqlite.bad). Metadata older than the data store is
    repaired only with accept_rollback (tools/rollback.py)."""
    from thinblock.core.pool import Pool, owned

    with owned(locator, "thinblock repair") as location:
        name = location.name
        try:
            meta = location.open_meta(readonly=False)
            try:
                sb = meta.superblock()
                store = location.owned_store(sb, location.open_data(sb))
                why = inspect(store, sb, location.data_owner(), name, location.data_name(sb))
                header, tid = store.header, int(sb.get("transaction_id") or 0)
                rolled_back = header is not None and header.uuid == sb.get("pool_uuid") and header.generation > tid
                # A data file cut short lost its tail, header included: repair writes it again.
                lost_tail = header is None and store.size_bytes < int(sb["size_bytes"])
                if why is not None and not (rolled_back and accept_rollback) and not lost_tail:
                    store.close()
                    raise ThinblockError(f"cannot repair {name}: {why.split(': ', 1)[1]}")
                size_bytes = int(sb["size_bytes"])
                data_bytes = store.size_bytes
                if data_bytes < size_bytes and getattr(store.inner, "is_block_device", False):
                    store.close()
                    raise ThinblockError(
                        f"cannot repair {name}: data device {location.data_name(sb)} holds {data_bytes} bytes,"
                        f" less than the pool's {size_bytes}; a device cannot be extended"
                    )
                dump, lost = salvage(meta, data_bytes, progress)
                if rolled_back and header is not None:
                    n_blocks = size_bytes // int(sb["block_size"])
                    drop_reborn(dump, store.read_births(n_blocks), tid, header.births_since, lost)
                    lost.append(
                        f"metadata of generation {tid} accepted under a data store of generation {header.generation}"
                    )
            finally:
                meta.close()
        except (CorruptionError, KeyError, ValueError) as exc:
            raise ThinblockError(f"cannot repair {name}: the metadata cannot be read ({exc})") from None
        try:
            backup = location.keep_copy()
            identity = successor(location, sb)
            build_metadata(location, dump, identity)
            if data_bytes < size_bytes:
                _extend(store, data_bytes, size_bytes, lost, location.data_name(sb))
            new_tid = int(identity["transaction_id"])
            if lost_tail:
                uuid, owner = str(identity.get("pool_uuid") or sb.get("pool_uuid")), location.data_owner()
                store.format(store.fresh_layout(size_bytes, uuid, owner, new_tid, since=new_tid))
                lost.append(f"data store {location.data_name(sb)} lost its owner header with its tail; written again")
            store.write_header(new_tid)
            store.flush()
        except OSError as exc:
            raise ThinblockError(f"cannot repair {name}: {exc.strerror or exc}") from None
        finally:
            store.close()
    if rolled_back:
        with Pool.open(locator, autocommit=False, purpose="thinblock repair"):
            pass  # the unclean open punches every free block, the dropped ones too
    return {"lost": lost, "volumes": len(dump["volumes"]), "backup": backup}


def _extend(store: DataStore, have: int, size_bytes: int, lost: list[str], name: str) -> None:
    store.grow(size_bytes)  # the lost tail reads zeros again; nothing maps its data
    store.flush()
    lost.append(f"data store {name} was extended from {have} to {size_bytes} bytes")
