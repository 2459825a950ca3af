"""Commits of several owners to one RADOS metadata object (a pool served per
volume): meta/owners.py's rules, applied optimistically.

RADOS applies one WriteOp on one object atomically, but has no transaction that
reads too. So a commit reads what its rules need (the lease records, the stored
counts its changes add to, the grants), computes what to store, and writes it in
one WriteOp that compares `x.version` with the value it read and bumps it: if
any other commit landed in between, nothing of it is applied, and it starts
again from fresh reads. Every read of one attempt carries `x.version` too, so
that an attempt which saw two states gives up before it judges anything.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from thinblock.meta import owners
from thinblock.meta.base import CommitResult, Grant, Transaction
from thinblock.meta.rados_leases import parse_record, record_key

VERSION_KEY = "x.version"
GRANT_PREFIX = "g."


def version_value(version: int) -> str:
    return f"{version:020d}"


def grant_key(g: Grant) -> str:
    return f"{GRANT_PREFIX}{g.volume_id:012d}.{g.epoch:012d}.{g.start:016d}.{g.count:016d}"


def parse_grant(key: str) -> Grant:
    vid, epoch, start, count = (int(x) for x in key[len(GRANT_PREFIX) :].split("."))
    return Grant(vid, epoch, start, count)


class Raced(Exception):
    """Another commit landed between two reads of one attempt: start again."""


class View:
    """One attempt's reads, each with x.version, which must all agree.

    get(keys) and items(prefix) are given by the store: they read keys (or a
    prefix) together with VERSION_KEY in one operation."""

    def __init__(
        self,
        get: Callable[[list[str]], dict[str, bytes]],
        items: Callable[[str], Iterable[tuple[str, bytes]]],
    ) -> None:
        self._get, self._items = get, items
        self.version: bytes | None = None
        self._seen_version = False
        self._cache: dict[str, bytes | None] = {}

    def _check(self, version: bytes | None) -> None:
        if not self._seen_version:
            self.version, self._seen_version = version, True
        elif version != self.version:
            raise Raced

    def get(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = list(dict.fromkeys(keys))
        missing = [k for k in keys if k not in self._cache]
        if missing or not self._seen_version:
            got = self._get(missing)
            self._check(got.pop(VERSION_KEY, None))
            for k in missing:
                self._cache[k] = got.get(k)
        return {k: v for k in keys if (v := self._cache[k]) is not None}

    def one(self, key: str) -> bytes | None:
        return self.get([key]).get(key)

    def items(self, prefix: str) -> list[tuple[str, bytes]]:
        out = []
        for key, value in self._items(prefix):
            if key == VERSION_KEY:
                self._check(value or None)
            else:
                out.append((key, value))
        return out

    def grants(self) -> list[Grant]:
        return [parse_grant(k) for k, _v in self.items(GRANT_PREFIX)]


@dataclass
class Resolved:
    """What one attempt decided: the transaction with every value absolute, the
    omap keys to set and remove beside it, and the locks whose cookies must still
    be listed when it lands."""

    txn: Transaction
    result: CommitResult
    sets: dict[str, bytes] = field(default_factory=dict)
    removes: set[str] = field(default_factory=set)
    locks: list[tuple[int, str]] = field(default_factory=list)  # (volume id, cookie)


def _json(raw: bytes | None) -> Any:
    return None if raw is None else json.loads(raw)


def resolve(view: View, txn: Transaction, live: Callable[[int, dict[str, Any]], bool]) -> Resolved:
    """txn's rules checked against what view reads, and its shared counts turned into
    the values to store (meta/owners.py). live(volume id, record): whether a record's
    holder still holds the volume's lock."""

    def record(vid: int) -> dict[str, Any] | None:
        return parse_record(view.one(record_key(vid)))

    def current(vid: int) -> tuple[str, int] | None:
        rec = record(vid)
        return None if not rec or not rec.get("owner") else (str(rec["owner"]), int(rec["epoch"]))

    named = {(lease.volume_id, lease.owner, lease.epoch) for lease in txn.leases}

    def holder(vid: int) -> tuple[str, int] | None:
        now = current(vid)
        if now is None or (vid, *now) in named:
            return now
        rec = record(vid)
        return now if rec is not None and live(vid, rec) else None

    def link(vid: int) -> owners.Link | None:
        row = _json(view.one(f"v.{vid:012d}"))
        return None if row is None else (str(row["kind"]), row.get("origin_id"))

    view.get([record_key(lease.volume_id) for lease in txn.leases] + [record_key(v) for v, _e in txn.fenced])
    owners.check_leases(txn.leases, current)
    owners.check_volume_writes(txn, link, holder)
    out = Resolved(txn=Transaction(), result=CommitResult())
    result = out.result
    for lease in txn.leases:
        rec = record(lease.volume_id)
        assert rec is not None  # check_leases found it
        out.locks.append((lease.volume_id, str(rec.get("cookie"))))
    for vid, epoch in txn.fenced:
        rec = record(vid)
        if rec is not None and rec.get("owner") and int(rec["epoch"]) == epoch:
            out.sets[record_key(vid)] = json.dumps({**rec, "owner": ""}).encode()

    superblock = dict(txn.superblock)
    if txn.counter_bases:
        stored = view.get([f"s.{k}" for k in txn.counter_bases])
        for key, base in txn.counter_bases.items():
            if key in superblock:
                superblock[key] = owners.counter(key, _json(stored.get(f"s.{key}")), superblock[key], base)
                result.counters[key] = int(superblock[key])  # type: ignore[call-overload]

    pages = dict(txn.pages)
    page_refcounts = dict(txn.page_refcounts)
    counted = view.get([f"q.{pid:016d}" for pid in [*txn.page_ref_bases, *txn.page_refcounts]])

    def stored_count(pid: int) -> int | None:
        raw = counted.get(f"q.{pid:016d}")
        return None if raw is None else int(raw)

    for pid, base in txn.page_ref_bases.items():
        if pid in pages:
            page = pages[pid]
            count = owners.page_count(
                pid, stored_count(pid), 0 if page is None else page[0], base, deleting=page is None
            )
            if page is not None:
                pages[pid] = (count, page[1])
                result.page_refcounts[pid] = count
        elif pid in page_refcounts:
            count = owners.page_count(pid, stored_count(pid), page_refcounts[pid], base, deleting=False)
            page_refcounts[pid] = result.page_refcounts[pid] = count
    result.orphans = sorted(pid for pid, count in result.page_refcounts.items() if count == 0)

    refcount_pages = {index: bytes(blob) for index, blob in txn.refcount_pages.items()}
    held = view.grants() if (txn.refcount_bases or txn.grants or txn.returned_grants) else []
    stored_pages = view.get([f"c.{index:012d}" for index in txn.refcount_bases])
    used_change = 0
    for index, base_blob in txn.refcount_bases.items():
        if index in refcount_pages:
            before = stored_pages.get(f"c.{index:012d}")
            refcount_pages[index] = owners.refcount_page(
                index, before, refcount_pages[index], base_blob, owners.granted_mask(txn, held, index)
            )
            used_change += owners.nonzero_change(before, refcount_pages[index])
            result.refcount_pages[index] = refcount_pages[index]
    if txn.refcount_bases:
        superblock[owners.USED] = owners.used_after(_json(view.one(f"s.{owners.USED}")), used_change)
        result.counters[owners.USED] = int(superblock[owners.USED])  # type: ignore[call-overload]

    if txn.grants or txn.returned_grants:
        sb = view.get(["s.size_bytes", "s.block_size"])
        size = superblock.get("size_bytes", _json(sb.get("s.size_bytes")))
        n_blocks = int(size) // int(_json(sb.get("s.block_size")) or 1)  # type: ignore[call-overload]

        def refcount_of(start: int, count: int) -> np.ndarray:
            wanted = list(owners.refcount_pages_for(start, count))
            have = {i: refcount_pages[i] for i in wanted if i in refcount_pages}
            got = view.get([f"c.{i:012d}" for i in wanted if i not in have])
            have.update({int(k[2:]): v for k, v in got.items()})
            return owners.refcounts_in(have, start, count)

        owners.check_grants(txn, held, n_blocks, refcount_of)
        out.removes |= {grant_key(g) for g in txn.returned_grants}
        out.sets.update({grant_key(g): b"" for g in txn.grants})

    out.txn = owners.absolute(txn, superblock, pages, refcount_pages, page_refcounts)
    return out
