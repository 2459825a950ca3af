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
from collections.abc import Iterator
from typing import Any

import numpy as np
from numpy.typing import NDArray

from thinblock.admin.schema import DUMP_POOL, DUMP_VOLUME, check_fields
from thinblock.backends import Location
from thinblock.backends.base import KEEP_BEFORE_RESTORE
from thinblock.core.mapped import Mapped, mapped_entries
from thinblock.core.mapping import (
    DBLOCK_SHIFT,
    PAGE_ENTRIES,
    PINNED,
    STATE_MASK,
    BlockState,
    Page,
    entry_dblock,
    mapped_pairs,
)
from thinblock.core.pool import validate_name
from thinblock.core.registry import STAGING_PREFIX
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


def mapping_runs(vblocks: NDArray[np.int64], entries: NDArray[np.uint64]) -> list[list[Any]]:
    """Sorted vblocks and their entries as [vblock, dblock, count, state, pinned] runs:
    a run continues while vblock and dblock both step by one under the same state and pin."""
    if not len(vblocks):
        return []
    dblocks = (entries >> np.uint64(DBLOCK_SHIFT)).astype(np.int64)
    flags = entries & np.uint64(STATE_MASK | PINNED)
    breaks = np.flatnonzero((np.diff(vblocks) != 1) | (np.diff(dblocks) != 1) | (np.diff(flags) != 0)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [len(vblocks)])))
    names = {int(s): BlockState(s).name.lower() for s in (BlockState.DATA, BlockState.ZEROED)}
    return [
        [v, d, n, names[f & STATE_MASK], bool(f & PINNED)]
        for v, d, n, f in zip(
            vblocks[starts].tolist(), dblocks[starts].tolist(), counts.tolist(), flags[starts].tolist(), strict=True
        )
    ]


def dump_metadata(meta: MetadataStore) -> dict[str, Any]:
    """The committed metadata as the neutral dict (salvage's walk, refusing any loss)."""
    dump, lost = salvage(meta)
    if lost:
        raise CorruptionError(
            f"the metadata cannot be dumped whole ({len(lost)} problem(s)); 'thinblock pool repair' would do this:"
            f" {lost[0]}"
        )
    return dump


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
    rows, mapped = _validated_volumes(dump["volumes"], block_size, n_blocks)
    txn = Transaction()
    page_ids: dict[tuple[int, bytes], int] = {}
    page_refs: Counter[int] = Counter()
    blobs: dict[int, bytes] = {}
    page_dblocks: list[NDArray[np.int64]] = []  # of each distinct page, in id order
    for row in rows:
        vblocks, entries = mapped[row.id]
        indexes = vblocks // PAGE_ENTRIES
        cuts = np.flatnonzero(np.diff(indexes)) + 1
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(vblocks)], strict=True):
            if lo == hi:
                continue
            page = np.zeros(PAGE_ENTRIES, np.uint64)
            page[vblocks[lo:hi] % PAGE_ENTRIES] = entries[lo:hi]
            page_entries = array("Q")
            page_entries.frombytes(page.tobytes())
            blob = Page(0, 0, page_entries).to_blob()
            page_index = int(indexes[lo])
            page_id = page_ids.setdefault((page_index, blob), len(page_ids) + 1)
            if page_id not in blobs:
                blobs[page_id] = blob
                page_dblocks.append((entries[lo:hi] >> np.uint64(DBLOCK_SHIFT)).astype(np.int64))
            page_refs[page_id] += 1
            txn.roots[(row.id, page_index)] = page_id
    # Refcounts are derived, never read from the dump: one per page that maps the block.
    dblocks = np.concatenate(page_dblocks) if page_dblocks else np.zeros(0, np.int64)
    counts = np.bincount(dblocks, minlength=n_blocks).astype(np.uint32)
    used_blocks = int(np.count_nonzero(counts))
    txn.pages = {pid: (page_refs[pid], blob) for pid, blob in blobs.items()}
    for index in np.unique(dblocks // REFCOUNT_PAGE_ENTRIES).tolist():  # the last page stops at the pool's end
        txn.refcount_pages[index] = counts[
            index * REFCOUNT_PAGE_ENTRIES : (index + 1) * REFCOUNT_PAGE_ENTRIES
        ].tobytes()
    txn.volumes = rows
    kept = dict(current or {})
    superblock = {**kept, **{k: pool.get(k) for k in DUMP_SETS}}
    for key in _DUMP_FALLBACK:
        superblock.setdefault(key, pool.get(key))
    # Above both the dump's and the metadata's transaction: restored metadata is never
    # taken for metadata rolled back to an older transaction.
    transaction_id = max(int(kept.get("transaction_id") or 0), int(pool.get("transaction_id") or 0)) + 1
    superblock.update(page_entries=PAGE_ENTRIES, used_blocks=used_blocks, clean=False, transaction_id=transaction_id)
    # The kept exclusive counts (core/exclusive.py), exact from the start: an entry is
    # exclusive when its page has one holder and its dblock one page.
    epoch = int(superblock.get("sharing_epoch") or 0)
    exclusive: Counter[int] = Counter()
    for (volume_id, _index), held in txn.roots.items():
        if held is not None and page_refs[held] == 1:
            exclusive[volume_id] += int(np.count_nonzero(counts[page_dblocks[held - 1]] == 1))
    for row in rows:
        row.exclusive_blocks, row.exclusive_epoch = exclusive[row.id], epoch
    return superblock, txn


def _validated_volumes(
    volumes: list[Any], block_size: int, n_blocks: int
) -> tuple[list[VolumeRow], dict[int, tuple[NDArray[np.int64], NDArray[np.uint64]]]]:
    """The volume rows of the dump, counters counted, and each volume's mapped vblocks
    (sorted) and entries; or one sentence on the first thing wrong."""
    rows: list[VolumeRow] = []
    ids: set[int] = set()
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
        if row.id in ids or row.name in names:
            raise ThinblockError(f"{where}: id or name appears twice in the dump")
        names.add(row.name)
        ids.add(row.id)
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
    owners = np.full(n_blocks, -1, np.int64)
    mapped: dict[int, tuple[NDArray[np.int64], NDArray[np.uint64]]] = {}
    for row, v in zip(rows, volumes, strict=True):
        mapped[row.id] = _volume_blocks(row, v["mappings"], owners, block_size, n_blocks)
    return rows, mapped


def _volume_blocks(
    row: VolumeRow, runs: list[Any], owners: NDArray[np.int64], block_size: int, n_blocks: int
) -> tuple[NDArray[np.int64], NDArray[np.uint64]]:
    """One volume's runs checked and expanded to (sorted vblocks, entries), its counters
    counted and owners updated. The runs are judged one by one (each is a Python
    object), their blocks all at once; the sentence is the one for the first thing
    wrong in the dump's order, as a block-by-block walk would find it."""
    where = f"dump, volume {row.name!r}"
    n_vblocks = -(-row.size_bytes // block_size)
    good: list[tuple[int, int, int, int]] = []
    bad_run: str | None = None
    for run in runs:
        if (
            len(run) != 5
            or not all(type(x) is int for x in run[:3])
            or run[3] not in _STATES
            or type(run[4]) is not bool
        ):
            bad_run = (
                f"{where}: a mapping must be [VBLOCK, DBLOCK, COUNT, 'data'|'zeroed', PINNED], not {str(run)[:80]}"
            )
            break
        vblock, dblock, count, state, pinned = run
        if count <= 0 or vblock < 0 or dblock < 0:
            bad_run = f"{where}: invalid mapping {vblock} {dblock} {count} {state}"
            break
        if vblock + count > n_vblocks or dblock + count > n_blocks:
            bad_run = f"{where}: mapping {vblock}+{count} -> {dblock} lies beyond the volume or the pool"
            break
        good.append((vblock, dblock, count, _STATES[state] | (PINNED if pinned else 0)))
    table = np.array(good, dtype=np.int64).reshape(-1, 4)
    counts = table[:, 2]
    offsets = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    vblocks = np.repeat(table[:, 0], counts) + offsets
    dblocks = np.repeat(table[:, 1], counts) + offsets
    flags = np.repeat(table[:, 3], counts)
    # A vblock mapped twice: any but its first appearance. A dblock at another vblock
    # than its owner's: the owner is an earlier volume's, else this one's first.
    twice = np.ones(len(vblocks), np.bool_)
    twice[np.unique(vblocks, return_index=True)[1]] = False
    uniq, first, inverse = np.unique(dblocks, return_index=True, return_inverse=True)
    owner_of = np.where(owners[uniq] >= 0, owners[uniq], vblocks[first])
    owner = owner_of[inverse]
    fail = twice | (owner != vblocks)
    if fail.any():
        at = int(np.argmax(fail))
        if twice[at]:
            raise ThinblockError(f"{where}: vblock {vblocks[at]} is mapped twice")
        raise ThinblockError(
            f"{where}: dblock {dblocks[at]} is mapped at vblock {vblocks[at]} and at vblock {owner[at]};"
            " only snapshots and clones share a block, at one vblock"
        )
    if bad_run is not None:
        raise ThinblockError(bad_run)
    owners[uniq] = owner_of
    states = flags & STATE_MASK
    row.data_blocks += int(np.count_nonzero(states == BlockState.DATA))
    row.zeroed_blocks += int(np.count_nonzero(states == BlockState.ZEROED))
    row.pinned_blocks += int(np.count_nonzero(flags & PINNED))
    order = np.argsort(vblocks, kind="stable")
    entries = ((dblocks << DBLOCK_SHIFT) | flags).astype(np.uint64)
    return vblocks[order], entries[order]


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
    all_roots = sorted(meta.all_roots())
    where, mapped = _salvage_pages(meta, {page_id for _v, _i, page_id in all_roots})
    # Every mapped entry of the rows salvage keeps, judged all at once; a row with an
    # entry that cannot be kept is walked entry by entry below, to name each.
    keep_rows = np.array(
        [r for r, (v, _i, p) in enumerate(all_roots) if v in rows and where.get(p) is not None], dtype=np.intp
    )
    pos = np.array([where[all_roots[r][2]] for r in keep_rows.tolist()], dtype=np.intp)
    item, index = _gather(mapped, pos)
    row_of = keep_rows[item]
    volume_of = np.array([v for v, _i, _p in all_roots], dtype=np.int64)[row_of]
    entries = mapped.entry[index]
    state, dblock = entries & np.uint64(STATE_MASK), (entries >> np.uint64(DBLOCK_SHIFT)).astype(np.int64)
    vblock = np.array([i for _v, i, _p in all_roots], dtype=np.int64)[row_of] * PAGE_ENTRIES + mapped.slot[index]
    size_of = {vid: -(-row.size_bytes // block_size) for vid, row in rows.items()}
    n_vblocks = np.array([size_of.get(v, 0) for v, _i, _p in all_roots], dtype=np.int64)[row_of]
    valid = ((state == BlockState.DATA) | (state == BlockState.ZEROED)) & (dblock < n_blocks) & (vblock < n_vblocks)
    kept = valid & ~((dblock >= present) & (state == BlockState.DATA))
    bad_rows = set(row_of[~kept].tolist())
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
        first = page_index * PAGE_ENTRIES
        if where.get(page_id) is None:
            lost.append(
                f"volume {row.name}: blocks {first}-{first + PAGE_ENTRIES - 1} lost"
                f" (mapping page {page_id} unreadable); they now read zeros"
            )
            continue
        if done in bad_rows:
            lo, hi = np.searchsorted(row_of, [done, done + 1])  # row_of is sorted
            here = np.flatnonzero(~kept[lo:hi]) + lo
            for at, entry, ok in zip(vblock[here].tolist(), entries[here].tolist(), valid[here].tolist(), strict=True):
                if not ok:
                    lost.append(f"volume {row.name}: block {at} had an invalid mapping {entry:#x}; it now reads zeros")
                else:
                    lost.append(
                        f"volume {row.name}: block {at} was in the lost tail of the data store"
                        f" (dblock {entry_dblock(entry)}); it now reads zeros"
                    )
    volume_of, vblock, entries = volume_of[kept], vblock[kept], entries[kept]
    by_volume = {}
    for vid in rows:  # volume_of is sorted: each volume's entries are one slice
        lo, hi = np.searchsorted(volume_of, [vid, vid + 1])
        by_volume[vid] = (vblock[lo:hi], entries[lo:hi])
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
        "volumes": [
            {**{k: getattr(rows[vid], k) for k in _VOLUME_KEYS}, "mappings": mapping_runs(*by_volume[vid])}
            for vid in sorted(rows)
        ],
    }
    return dump, lost


def _salvage_pages(meta: MetadataStore, wanted: set[int]) -> tuple[dict[int, int | None], Mapped]:
    """The mapped entries of the wanted pages, and each page's position among them
    (None: missing or unreadable). One walk of all_pages; when the store cannot walk
    them (damaged), the pages are read one by one, so each damaged one is lost alone."""
    where: dict[int, int | None] = dict.fromkeys(wanted)

    def walk() -> Iterator[tuple[array[int], array[int]]]:
        for page_id, _refcount, blob in meta.all_pages():
            if page_id in where and where[page_id] is None:
                try:
                    pairs = mapped_pairs(blob, page_id)
                except CorruptionError:
                    continue
                where[page_id] = len(positions)
                positions.append(page_id)
                yield pairs

    def one_by_one() -> Iterator[tuple[array[int], array[int]]]:
        for page_id in sorted(wanted):
            try:
                found = meta.page(page_id)
                if found is None:
                    continue
                pairs = mapped_pairs(found[1], page_id)
            except CorruptionError:
                continue
            where[page_id] = len(positions)
            positions.append(page_id)
            yield pairs

    positions: list[int] = []
    try:
        return where, mapped_entries(walk())
    except CorruptionError:
        where = dict.fromkeys(wanted)
        positions.clear()
        return where, mapped_entries(one_by_one())


def _gather(mapped: Mapped, pages: NDArray[np.intp]) -> tuple[NDArray[np.intp], NDArray[np.intp]]:
    """For a sequence of page positions (a page may come twice): for every mapped entry
    of each in turn, which item of the sequence it belongs to and its index in mapped."""
    bounds = np.searchsorted(mapped.page, np.arange(int(pages.max(initial=-1)) + 2))
    lo, counts = bounds[pages], bounds[pages + 1] - bounds[pages]
    row_of = np.repeat(np.arange(len(pages), dtype=np.intp), counts)
    starts = np.cumsum(counts) - counts
    index = (np.arange(int(counts.sum()), dtype=np.intp) - np.repeat(starts, counts) + np.repeat(lo, counts)).astype(
        np.intp
    )
    return row_of, index


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
