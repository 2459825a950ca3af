"""Dump, restore and repair: the metadata in a neutral, versioned form.

Like thin_dump / thin_restore / thin_repair, the neutral form knows volumes
and their mappings (vblock -> dblock runs with a state), not pages, page ids or
refcounts: those are derived again on restore. Two forms carry the same dict:
JSON (`--json`) and a line-oriented text for people:

    thinblock-dump 1
    pool block_size=65536 size_bytes=1073741824 data_path=null ...
    volume id=1 name="vm1" kind="volume" origin_id=null size_bytes=... ...
      map VBLOCK DBLOCK COUNT data|zeroed [pinned]

Every `key=value` value is JSON. A dump is untrusted input (people keep,
pass around and edit them): restore checks all of it against the pool first
(plan_restore: admin/schema.py's field checks, then block size, data store
size, origins, ranges and shared blocks), takes only the settings DUMP_SETS
names from it, and has the backend switch the new metadata in at once.
Restore rebuilds every table from the dict; identical pages at one page index
of several volumes become one shared page again, so snapshots keep sharing
pages. Repair salvages what it can read into that dict and restores it
through the same checks, reporting what it could not save.
"""

from __future__ import annotations

import contextlib
import json
import re
from array import array
from collections import Counter
from typing import Any

from thinblock.admin.schema import DUMP_POOL, DUMP_VOLUME, check_fields
from thinblock.backends import Location
from thinblock.backends.base import KEEP_BEFORE_RESTORE
from thinblock.core.mapping import (
    PAGE_ENTRIES,
    BlockState,
    Page,
    encode_entries,
    entry_dblock,
    entry_pinned,
    entry_state,
    make_entry,
    mapped_pairs,
)
from thinblock.core.pool import STAGING_PREFIX, validate_name
from thinblock.core.space_policy import check_autogrow
from thinblock.core.spacemap import REFCOUNT_PAGE_ENTRIES
from thinblock.errors import CorruptionError, ThinblockError
from thinblock.meta.base import MetadataStore, Transaction, VolumeRow
from thinblock.progress import ProgressFn, no_progress
from thinblock.sizes import format_size
from thinblock.store.base import DataStore
from thinblock.store.owned import inspect
from thinblock.tools.rollback import drop_reborn, guard_restore, successor

DUMP_FORMAT = "thinblock-dump"
DUMP_VERSION = 1
_STATES = {"data": BlockState.DATA, "zeroed": BlockState.ZEROED}
_IDENTITY_KEYS = ("transaction_id", "pool_uuid")
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
    if not text.strip():
        raise ThinblockError("not a thinblock dump: it is empty")
    if text.lstrip().startswith(("{", "[")):
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ThinblockError(f"dump is not valid JSON: {exc}") from None
        except RecursionError:
            raise ThinblockError("not a thinblock dump: its JSON nests too deep") from None
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
                raise ValueError(f"not a thinblock dump: the first line must be '{DUMP_FORMAT} {DUMP_VERSION}'")
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

# The superblock keys a dump may set: the pool's settings and its size. Every other
# key is the pool's own and is kept from its current metadata, never taken from a
# dump: data_path (and any other host path), the pool's identity (pool_uuid or
# whatever id the backend or the data store checks), its generation,
# object_size, metadata_slack_bytes, format_version. A key added to the
# superblock later is thereby the pool's until it is named here.
DUMP_SETS = ("size_bytes", "when_full", "low_water", "on_low_water", "autogrow")
# Taken from the dump only when the pool has no readable metadata left to keep them from.
_DUMP_FALLBACK = ("block_size", "created")
MAX_DUMP_BYTES = 1 << 30  # larger than any dump of a pool thinblock can open in memory


def read_dump(path: str) -> dict[str, Any]:
    """The dump in the file at path (either form), or one sentence saying why it is none."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_DUMP_BYTES + 1)
    except OSError as exc:
        raise ThinblockError(f"cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_DUMP_BYTES:
        raise ThinblockError(f"{path} is not a thinblock dump: it is larger than {MAX_DUMP_BYTES >> 20} MiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\0" in text:
        raise ThinblockError(f"{path} is not a thinblock dump: it is binary, not text")
    try:
        return parse_dump(text)
    except ThinblockError as exc:
        raise ThinblockError(f"{path}: {exc}") from None


def build_metadata(
    location: Location,
    dump: dict[str, Any],
    current: dict[str, Any] | None,
    data_bytes: int | None,
    keep: str | None = None,
    identity: dict[str, Any] | None = None,
) -> str | None:
    """Validate the whole dump against the pool, then replace the metadata with it at
    once (nothing is written when anything is wrong). current is the pool's superblock
    now (None when it has no readable metadata), data_bytes what its data store holds
    (None: not checked, repair extends it). The pool is marked unclean so that its next
    open punches every free block (the data file may hold stale bytes there). keep:
    where the old metadata goes (see Location.replace_meta). identity: the pool's
    uuid and a transaction id above the data store's generation (tools/rollback.py's
    successor, found here when not given); the transaction id written is left in it."""
    superblock, txn = plan_restore(dump, current, data_bytes)
    return write_planned(location, superblock, txn, keep=keep, identity=identity)


def write_planned(
    location: Location,
    superblock: dict[str, Any],
    txn: Transaction,
    *,
    keep: str | None = None,
    identity: dict[str, Any] | None = None,
) -> str | None:
    """Replace the metadata with what plan_restore made (see build_metadata)."""
    ident = identity if identity is not None else successor(location, superblock)
    ident["transaction_id"] = max(int(superblock["transaction_id"]), int(ident["transaction_id"]))
    superblock.update(ident)
    return location.replace_meta(superblock, txn, keep=keep)


def plan_restore(
    dump: dict[str, Any], current: dict[str, Any] | None, data_bytes: int | None
) -> tuple[dict[str, Any], Transaction]:
    """The superblock and transaction that restore writes, or one sentence on what is wrong."""
    if not isinstance(dump.get("pool"), dict) or not isinstance(dump.get("volumes"), list):
        raise ThinblockError("not a thinblock dump: it needs a 'pool' object and a 'volumes' list")
    pool = dump["pool"]
    check_fields("dump, pool", DUMP_POOL, pool)
    block_size, size_bytes = int(pool["block_size"]), int(pool["size_bytes"])
    pool_block_size = block_size if current is None else int(current.get("block_size") or block_size)
    if pool_block_size != block_size:
        raise ThinblockError(
            f"the dump's block size is {format_size(block_size)} but this pool's is"
            f" {format_size(pool_block_size)}: it is another pool's dump; nothing was changed"
        )
    if size_bytes % block_size:
        raise ThinblockError(f"the dump's pool size {size_bytes} is not a multiple of its block size {block_size}")
    if data_bytes is not None and size_bytes > data_bytes:
        raise ThinblockError(
            f"the dump is of a pool of {format_size(size_bytes)} but this pool's data store holds"
            f" {format_size(data_bytes)}: it is another pool's dump (or grow the data store first); nothing was changed"
        )
    autogrow = pool.get("autogrow")
    if autogrow is not None:
        check_autogrow(int(autogrow[0]), block_size)
    n_blocks = size_bytes // block_size
    rows, roots = _validated_volumes(dump["volumes"], block_size, n_blocks)
    txn = Transaction()
    page_ids: dict[tuple[int, bytes], int] = {}
    page_refs: Counter[int] = Counter()
    blobs: dict[int, bytes] = {}
    for row in rows:
        for page_index, entries in sorted(roots[row.id].items()):
            blob = encode_entries(entries)  # deterministic: equal pages still share one blob
            page_id = page_ids.setdefault((page_index, blob), len(page_ids) + 1)
            blobs[page_id] = blob
            page_refs[page_id] += 1
            txn.roots[(row.id, page_index)] = page_id
    # Refcounts are derived, never read from the dump: one per page that maps the block.
    refcounts: dict[int, array[int]] = {}
    used_blocks = 0
    for blob in blobs.values():
        for entry in mapped_pairs(blob)[1]:
            if entry:
                index, slot = divmod(entry_dblock(entry), REFCOUNT_PAGE_ENTRIES)
                chunk = refcounts.setdefault(index, array("I", bytes(4 * REFCOUNT_PAGE_ENTRIES)))
                used_blocks += chunk[slot] == 0
                chunk[slot] += 1
    txn.pages = {pid: (page_refs[pid], blob) for pid, blob in blobs.items()}
    for index, chunk in refcounts.items():  # the last page stops at the pool's end
        txn.refcount_pages[index] = chunk[: n_blocks - index * REFCOUNT_PAGE_ENTRIES].tobytes()
    txn.volumes = rows
    kept = dict(current or {})
    superblock = {**kept, **{k: pool.get(k) for k in DUMP_SETS}}
    for key in _DUMP_FALLBACK:
        superblock.setdefault(key, pool.get(key))
    # Above both the dump's and the metadata's transaction: restored metadata is never
    # taken for metadata rolled back to an older transaction.
    transaction_id = max(int(kept.get("transaction_id") or 0), int(pool.get("transaction_id") or 0)) + 1
    superblock.update(page_entries=PAGE_ENTRIES, used_blocks=used_blocks, clean=False, transaction_id=transaction_id)
    return superblock, txn


def _validated_volumes(
    volumes: list[Any], block_size: int, n_blocks: int
) -> tuple[list[VolumeRow], dict[int, dict[int, array[int]]]]:
    rows: list[VolumeRow] = []
    roots: dict[int, dict[int, array[int]]] = {}
    names: set[str] = set()
    for number, v in enumerate(volumes, 1):
        check_fields(f"dump, volume {number}", DUMP_VOLUME, v)
        row = VolumeRow(
            id=v["id"],
            name=v["name"],
            size_bytes=v["size_bytes"],
            detect_zeroes=v["detect_zeroes"],
            created=float(v["created"]),
            kind=v["kind"],
            origin_id=v["origin_id"],
            reserve_bytes=v["reserve_bytes"],
            low_water=None if v["low_water"] is None else float(v["low_water"]),
            on_low_water=v["on_low_water"],
        )
        where = f"dump, volume {row.name!r}"
        try:
            validate_name(row.name, row.kind)
        except ThinblockError as exc:
            raise ThinblockError(f"dump, volume {number}: {exc}") from None
        if row.id in roots or row.name in names:
            raise ThinblockError(f"{where}: id or name appears twice in the dump")
        names.add(row.name)
        roots[row.id] = {}
        rows.append(row)
    by_id = {row.id: row for row in rows}
    for row in rows:
        seen = {row.id}
        origin = row.origin_id
        while origin is not None:
            if origin not in by_id:
                raise ThinblockError(f"dump, volume {row.name!r}: origin id {origin} is not in the dump")
            if origin in seen:
                raise ThinblockError(
                    f"dump, volume {row.name!r}: it is its own origin (through {len(seen) - 1} other(s))"
                )
            seen.add(origin)
            origin = by_id[origin].origin_id
    # Which vblock holds each dblock: a block has two owners only at one vblock of
    # several volumes (a shared page, or a copy of one: snapshots and clones).
    owners = array("q", b"\xff" * 8 * n_blocks)
    for row, v in zip(rows, volumes, strict=True):
        where = f"dump, volume {row.name!r}"
        pages = roots[row.id]
        n_vblocks = -(-row.size_bytes // block_size)
        for run in v["mappings"]:
            if (
                len(run) != 5
                or not all(type(x) is int for x in run[:3])
                or run[3] not in _STATES
                or type(run[4]) is not bool
            ):
                raise ThinblockError(
                    f"{where}: a mapping must be [VBLOCK, DBLOCK, COUNT, 'data'|'zeroed', PINNED], not {str(run)[:80]}"
                )
            vblock, dblock, count, state, pinned = run
            if count <= 0 or vblock < 0 or dblock < 0:
                raise ThinblockError(f"{where}: invalid mapping {vblock} {dblock} {count} {state}")
            if vblock + count > n_vblocks or dblock + count > n_blocks:
                raise ThinblockError(
                    f"{where}: mapping {vblock}+{count} -> {dblock} lies beyond the volume or the pool"
                )
            for i in range(count):
                page_index, slot = divmod(vblock + i, PAGE_ENTRIES)
                entries = pages.setdefault(page_index, array("Q", bytes(8 * PAGE_ENTRIES)))
                if entries[slot]:
                    raise ThinblockError(f"{where}: vblock {vblock + i} is mapped twice")
                owner = owners[dblock + i]
                if owner < 0:
                    owners[dblock + i] = vblock + i
                elif owner != vblock + i:
                    raise ThinblockError(
                        f"{where}: dblock {dblock + i} is mapped at vblock {vblock + i} and at vblock {owner};"
                        " only snapshots and clones share a block, at one vblock"
                    )
                entries[slot] = make_entry(dblock + i, _STATES[state], pinned)
                if state == "data":
                    row.data_blocks += 1
                else:
                    row.zeroed_blocks += 1
                row.pinned_blocks += bool(pinned)
    return rows, roots


def current_state(location: Location) -> tuple[dict[str, Any] | None, int]:
    """The pool's superblock as it is (None when its metadata is missing or unreadable:
    what restore is for) and the bytes its data store holds."""
    superblock: dict[str, Any] | None = None
    if location.exists():
        try:
            meta = location.open_meta(readonly=True)
            try:
                superblock = meta.superblock()
            finally:
                meta.close()
        except (CorruptionError, OSError, ThinblockError, KeyError, ValueError):
            superblock = None  # damaged: the dump replaces it (a copy is kept)
    try:
        store = location.open_data(superblock or {}, readonly=True)
    except (KeyError, ValueError):  # a backend that needs its superblock to find its data
        raise ThinblockError(
            f"cannot restore into {location.name}: its metadata is unreadable and it says where its data is;"
            " create the pool again first"
        ) from None
    if superblock is not None:  # its blocks end where the owner tail begins (store/owned.py)
        store = location.owned_store(superblock, store)
        with contextlib.suppress(OSError, ThinblockError, ValueError):  # no header: the raw size stands
            store.load()
    try:
        return superblock, store.size_bytes
    finally:
        store.close()


def restore(locator: str, dump: dict[str, Any], progress: ProgressFn | None = None) -> dict[str, Any]:
    """`pool restore`: replace the pool's metadata with the dump's (pool not in use).
    All or nothing: the whole dump is checked against the pool, the new metadata
    is written beside the old and switched in at once; the old is kept
    (metadata.sqlite.before-restore). progress follows the punching of free
    space at the first open (bytes), after the switch."""
    from thinblock.core.pool import Pool, owned

    with owned(locator, "thinblock restore") as location:
        name = location.name
        try:
            current, data_bytes = current_state(location)
            # The dump is sound before its generation is judged; planned again only if
            # that judgement dropped mappings.
            superblock, txn = plan_restore(dump, current, data_bytes)
            dropped = guard_restore(location, current, dump)
            if dropped:
                superblock, txn = plan_restore(dump, current, data_bytes)
            kept = write_planned(location, superblock, txn, keep=KEEP_BEFORE_RESTORE)
        except OSError as exc:
            raise ThinblockError(f"cannot restore {name}: {exc.strerror or exc}; nothing was changed") from None
    try:
        with Pool.open(locator, autocommit=False, progress=progress) as pool:  # recovers free space, then closes clean
            used_bytes = pool.space_figures()["used_bytes"]
    except (OSError, ThinblockError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and not isinstance(exc, ThinblockError) else str(exc)
        raise ThinblockError(
            f"restored {name}, but its first open failed ({detail}); the next open finishes it"
            f" (the old metadata is kept in {kept})"
        ) from None
    return {"volumes": len(dump["volumes"]), "used_bytes": used_bytes, "backup": kept, "dropped": dropped}


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
    # A staging volume (an unfinished job's, named '.…') is no part of a dump: the next
    # open would remove it, and restore refuses such names.
    rows: dict[int, VolumeRow] = {}
    staging: set[int] = set()
    for volume_row in meta.volumes():
        if volume_row.name.startswith(STAGING_PREFIX):
            staging.add(volume_row.id)
        else:
            rows[volume_row.id] = volume_row
    by_volume: dict[int, list[tuple[int, int]]] = {vid: [] for vid in rows}
    pages: dict[int, Page | None] = {}
    all_roots = sorted(meta.all_roots())
    tell = progress or no_progress
    for done, (volume_id, page_index, page_id) in enumerate(all_roots):
        if done % 64 == 0:
            tell(done, len(all_roots))
        row = rows.get(volume_id)
        if volume_id in staging:
            continue
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
        # The generation and the pool's uuid: restore checks them (tools/rollback.py
        # guard_restore), never sets them.
        "pool": {**{k: sb.get(k) for k in _POOL_KEYS}, **{k: sb.get(k) for k in _IDENTITY_KEYS if k in sb}},
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
            build_metadata(location, dump, sb, None, identity=identity)
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
