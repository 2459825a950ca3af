"""Metadata in the omap of one RADOS object (meta/base.py's contract).

Keys (numbers zero-padded, so that key order is number order):

    s.<name>               superblock values, JSON
    v.<id>                 a volume or snapshot, JSON
    r.<volume>.<index>     a root table entry: the page id
    p.<id> / q.<id>        a mapping page (core/mapping.py encodes it) / its refcount
    c.<index>              a refcount page
    x.epoch                the holder's epoch (20 digits); every commit compares it
    x.owner                who holds the pool (backends/rados.py writes it)
    x.max_page_id          the largest page id ever committed
    x.journal              a large commit's journal, while it is being applied
    x.journal_next         the next of its pieces to apply (owners per volume)
    o.<volume>             a volume's lease record (meta/rados_leases.py)
    g.<vol>.<ep>.<start>.<count>  a grant of free blocks to a volume's owner
    x.version              bumped by every commit of owners per volume (meta/rados_shared.py)

A commit of the pool's whole holder is one WriteOp on this object, which RADOS applies atomically: first
`omap_cmp(x.epoch == ours)`, then the removals and the new values. A holder that
was fenced off (another took the pool over and bumped the epoch) gets ECANCELED
and changes nothing. A commit too large for one operation (restore, a huge
first commit) is written to journal objects first; one guarded operation that
records the journal is its commit point; then the journal is applied in guarded
pieces and dropped. An interrupted application is finished by the next holder.
Every step is a set or a removal of known keys, so applying it twice is harmless.
Commits of owners per volume (a pool shared: RadosLocation.own_shared) are
guarded by x.version and their leases instead, and their journals are applied
by whichever commit comes next (_write_shared).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from thinblock.bindings import RADOS_POOLS, require
from thinblock.ceph import cls_lock
from thinblock.ceph.cluster import OP_TIMEOUT_S, Cluster, as_oserror, rados_errno
from thinblock.errors import ThinblockError
from thinblock.meta import rados_shared
from thinblock.meta.base import (
    CommitResult,
    Grant,
    Lease,
    MetadataStore,
    Transaction,
    VolumeBusyError,
    VolumeRow,
    check_format,
    initial_superblock,
)
from thinblock.meta.rados_leases import POOL_STEP_LOCK, VolumeLeases, parse_record, record_key, volume_lock

rados = require("rados", feature=RADOS_POOLS)

log = logging.getLogger("thinblock.rados")

EPOCH_KEY = "x.epoch"
OWNER_KEY = "x.owner"
MAX_PAGE_KEY = "x.max_page_id"
JOURNAL_KEY = "x.journal"
JOURNAL_NEXT_KEY = "x.journal_next"  # the next piece of a journal of owners per volume to apply
BACKEND_KEYS = ("rados_id", "object_size")  # superblock keys that name the data objects
PAGE_LIMIT = 1024  # get_omap_vals returns at most this many per call, whatever it is asked
MAX_OP_BYTES = 8 << 20
MAX_OP_KEYS = 8192
COMMIT_ATTEMPTS = 200  # a commit of owners per volume, started again after another landed first


def epoch_value(epoch: int) -> str:
    """The epoch as stored and compared: omap_cmp compares strings bytewise."""
    return f"{epoch:020d}"


def _vkey(vid: int) -> str:
    return f"v.{vid:012d}"


def _rprefix(vid: int) -> str:
    return f"r.{vid:012d}."


def _rkey(vid: int, index: int) -> str:
    return f"{_rprefix(vid)}{index:012d}"


def _pkey(pid: int) -> str:
    return f"p.{pid:016d}"


def _qkey(pid: int) -> str:
    return f"q.{pid:016d}"


def _ckey(index: int) -> str:
    return f"c.{index:012d}"


@dataclasses.dataclass
class _Ops:
    """What a commit does to the omap: range removals, removals, then sets."""

    ranges: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    removes: set[str] = dataclasses.field(default_factory=set)
    sets: dict[str, bytes] = dataclasses.field(default_factory=dict)

    def pieces(self) -> list[_Ops]:
        """The same changes in pieces that each fit one operation, removals first."""
        out = [_Ops(ranges=list(self.ranges))]
        budget = [MAX_OP_BYTES, MAX_OP_KEYS]

        def room(n: int) -> _Ops:
            if budget[0] < n or budget[1] < 1:
                out.append(_Ops())
                budget[:] = [MAX_OP_BYTES, MAX_OP_KEYS]
            budget[0] -= n
            budget[1] -= 1
            return out[-1]

        for key in sorted(self.removes):
            room(len(key)).removes.add(key)
        for key, value in self.sets.items():
            room(len(key) + len(value)).sets[key] = value
        return out

    def encode(self) -> bytes:
        parts = []
        for tag, key, value in (
            *((b"G", a, b.encode()) for a, b in self.ranges),
            *((b"R", k, b"") for k in sorted(self.removes)),
            *((b"S", k, v) for k, v in self.sets.items()),
        ):
            k = key.encode()
            parts += [tag, struct.pack("<II", len(k), len(value)), k, value]
        return b"".join(parts)

    @classmethod
    def decode(cls, blob: bytes) -> _Ops:
        try:
            return cls._decode(blob)
        except (struct.error, UnicodeDecodeError):
            raise ThinblockError("a metadata journal object is damaged") from None

    @classmethod
    def _decode(cls, blob: bytes) -> _Ops:
        ops, pos = cls(), 0
        while pos < len(blob):
            tag = blob[pos : pos + 1]
            klen, vlen = struct.unpack_from("<II", blob, pos + 1)
            pos += 9
            key, value = blob[pos : pos + klen].decode(), blob[pos + klen : pos + klen + vlen]
            pos += klen + vlen
            if tag == b"G":
                ops.ranges.append((key, value.decode()))
            elif tag == b"R":
                ops.removes.add(key)
            elif tag == b"S":
                ops.sets[key] = value
            else:
                raise ThinblockError("a metadata journal object is damaged")
        return ops


def translate(
    txn: Transaction, names: dict[int, str], high: int, existing: set[str]
) -> tuple[_Ops, dict[int, str], int]:
    """The omap changes of txn (every value absolute), given the volume names and the
    largest page id before it and which count keys exist of the pages whose counts
    alone change; returns them with the names and largest page id after it."""
    ops = _Ops()
    names = dict(names)
    for k, v in txn.superblock.items():
        ops.sets[f"s.{k}"] = json.dumps(v).encode()
    for vid in txn.deleted_volumes:
        names.pop(vid, None)
        ops.removes.add(_vkey(vid))
        ops.ranges.append((_rprefix(vid), _rprefix(vid)[:-1] + "/"))  # '/' sorts right after '.'
    for row in txn.volumes:
        names[row.id] = row.name
        ops.sets[_vkey(row.id)] = json.dumps(dataclasses.asdict(row)).encode()
    if len(set(names.values())) != len(names):
        raise OSError(errno.EIO, "metadata commit failed: two volumes would share a name")
    for (vid, index), pid in txn.roots.items():
        if pid is None:
            ops.removes.add(_rkey(vid, index))
        else:
            ops.sets[_rkey(vid, index)] = str(pid).encode()
    for pid, page in txn.pages.items():
        if page is None:
            ops.removes |= {_pkey(pid), _qkey(pid)}
        else:
            ops.sets[_pkey(pid)] = bytes(page[1])
            ops.sets[_qkey(pid)] = str(page[0]).encode()
    for pid, count in txn.page_refcounts.items():
        if (txn.pages.get(pid) is not None) or _qkey(pid) in existing:
            ops.sets[_qkey(pid)] = str(count).encode()
    for index, blob in txn.refcount_pages.items():
        ops.sets[_ckey(index)] = bytes(blob)
    if txn.pages:
        high = max(high, *txn.pages)
        ops.sets[MAX_PAGE_KEY] = str(high).encode()
    return ops, names, high


class RadosMetadata(MetadataStore):
    """The omap of object `obj` in the Ceph pool. `epoch()` gives the epoch this
    process holds the whole pool under; `shared_epoch()` the pool epoch under which
    it shares the pool with other owners per volume (meta/rados_shared.py,
    meta/rados_leases.py). Commits refuse when both are None."""

    def __init__(
        self,
        cluster: Cluster,
        ceph_pool: str,
        obj: str,
        *,
        epoch: Callable[[], int | None],
        shared_epoch: Callable[[], int | None] = lambda: None,
        readonly: bool = False,
    ) -> None:
        self.cluster = cluster
        self.io = cluster.ioctx(ceph_pool)
        self.obj = obj
        self._epoch = epoch
        self._shared_epoch = shared_epoch
        self.readonly = readonly
        self._leases: VolumeLeases | None = None
        self._commit_lock = threading.Lock()
        self._unsure: str | None = None  # why commits are refused for good (an outcome unknown, a step's lock lost)
        self._names: dict[int, str] | None = None  # volume id -> name, as committed
        self._max_page: int | None = None
        # Whether a journal may be recorded but not applied: unknown until the first
        # commit looks; afterwards only a commit of ours that failed past its commit
        # point leaves one, so commits need not read the omap for it every time.
        self._journal_maybe = True

    # ----- making one --------------------------------------------------------------

    @classmethod
    def create(cls, cluster: Cluster, ceph_pool: str, obj: str, superblock: dict[str, Any]) -> None:
        """Write a new pool's metadata object, or refuse if one exists."""
        io = cluster.ioctx(ceph_pool)
        sb = initial_superblock(superblock)
        keys = [f"s.{k}" for k in sb] + [EPOCH_KEY, MAX_PAGE_KEY]
        values = [json.dumps(v).encode() for v in sb.values()] + [epoch_value(0).encode(), b"0"]
        with rados.WriteOpCtx() as op:
            op.new(rados.LIBRADOS_CREATE_EXCLUSIVE)
            io.set_omap(op, tuple(keys), tuple(values))
            try:
                io.operate_write_op(op, obj)
            except rados.ObjectExists:
                raise ThinblockError(f"a pool already exists in Ceph object {obj}") from None
            except rados.Error as exc:
                raise ThinblockError(f"cannot create the pool: {as_oserror(exc, 'RADOS').strerror}") from None

    # ----- reading -----------------------------------------------------------------

    def _read_failed(self, exc: Exception) -> ThinblockError:
        if isinstance(exc, rados.ObjectNotFound):
            return ThinblockError(f"no pool's metadata in Ceph object {self.obj}")
        return ThinblockError(f"cannot read the pool's metadata in Ceph: {as_oserror(exc, 'RADOS').strerror}")

    @staticmethod
    def _read_in_commit(exc: Exception) -> OSError:
        return as_oserror(exc, "metadata read")  # inside a commit: its contract speaks OSError

    def _pages(
        self, prefix: str, failed: Callable[[Exception], Exception], *, versioned: bool = False
    ) -> Iterator[tuple[list[tuple[str, bytes]], bytes]]:
        """The (key, value) pairs whose keys start with prefix, a page (one read) at a time,
        in key order, the last page empty; each with x.version read in the same operation
        when versioned (else b""). A failed read raises failed(the librados error)."""
        after = ""
        while True:
            try:
                with rados.ReadOpCtx() as op:
                    it, _ = self.io.get_omap_vals(op, after, prefix, PAGE_LIMIT)
                    if versioned:
                        vit, _ = self.io.get_omap_vals_by_keys(op, (rados_shared.VERSION_KEY,))
                    self.io.operate_read_op(op, self.obj)
                    items = list(it)
                    version = dict(vit).get(rados_shared.VERSION_KEY, b"") if versioned else b""
            except rados.Error as exc:
                raise failed(exc) from None
            yield items, version
            if not items:
                return
            after = items[-1][0]

    def _keys(self, keys: Iterable[str], failed: Callable[[Exception], Exception]) -> dict[str, bytes]:
        """Those of keys that exist, in one read; a failed read raises failed(the error)."""
        try:
            with rados.ReadOpCtx() as op:
                it, _ = self.io.get_omap_vals_by_keys(op, tuple(keys))
                self.io.operate_read_op(op, self.obj)
                return dict(it)
        except rados.Error as exc:
            raise failed(exc) from None

    def items(self, prefix: str) -> Iterator[tuple[str, bytes]]:
        """Every (key, value) whose key starts with prefix, in key order, page by page."""
        for items, _version in self._pages(prefix, self._read_failed):
            yield from items

    def _get_many(self, keys: list[str]) -> dict[str, bytes]:
        """_get in operations of at most PAGE_LIMIT keys (a snapshot asks for every page's)."""
        out: dict[str, bytes] = {}
        for at in range(0, len(keys), PAGE_LIMIT):
            out.update(self._get(keys[at : at + PAGE_LIMIT]))
        return out

    def _get(self, keys: list[str]) -> dict[str, bytes]:
        return self._keys(keys, self._read_failed) if keys else {}

    def superblock(self) -> dict[str, Any]:
        return {k[2:]: json.loads(v) for k, v in self.items("s.")}

    def volumes(self) -> list[VolumeRow]:
        rows = [VolumeRow(**json.loads(v)) for _k, v in self.items("v.")]
        return sorted(rows, key=lambda row: row.name)

    def roots(self, volume_id: int) -> dict[int, int]:
        prefix = _rprefix(volume_id)
        return {int(k[len(prefix) :]): int(v) for k, v in self.items(prefix)}

    def all_roots(self) -> Iterator[tuple[int, int, int]]:
        for k, v in self.items("r."):
            _, vid, index = k.split(".")
            yield int(vid), int(index), int(v)

    def page(self, page_id: int) -> tuple[int, bytes] | None:
        got = self._get([_pkey(page_id), _qkey(page_id)])
        blob = got.get(_pkey(page_id))
        return None if blob is None else (int(got.get(_qkey(page_id), b"0")), blob)

    def page_refcounts(self, page_ids: Iterable[int]) -> dict[int, int]:
        got = self._get_many([_qkey(pid) for pid in page_ids])
        return {int(k[2:]): int(v) for k, v in got.items()}

    def pages(self, page_ids: Iterable[int]) -> dict[int, tuple[int, bytes]]:
        ids = list(page_ids)
        got = self._get_many([key for pid in ids for key in (_pkey(pid), _qkey(pid))])
        return {pid: (int(got.get(_qkey(pid), b"0")), got[_pkey(pid)]) for pid in ids if _pkey(pid) in got}

    def all_pages(self) -> Iterator[tuple[int, int, bytes]]:
        counts = {int(k[2:]): int(v) for k, v in self.items("q.")}
        for k, blob in self.items("p."):
            pid = int(k[2:])
            yield pid, counts.get(pid, 0), blob

    def max_page_id(self) -> int:
        return int(self._get([MAX_PAGE_KEY]).get(MAX_PAGE_KEY, b"0"))

    def max_volume_id(self) -> int:
        return max((int(k[2:]) for k, _v in self.items("v.")), default=0)

    def refcount_pages(self) -> dict[int, bytes]:
        return {int(k[2:]): v for k, v in self.items("c.")}

    def journal_pending(self) -> bool:
        return JOURNAL_KEY in self._get([JOURNAL_KEY])

    # ----- committing --------------------------------------------------------------

    def _translate(self, txn: Transaction, *, fresh: bool) -> tuple[_Ops, dict[int, str], int]:
        """The omap changes of txn, and the volume names and largest page id after it
        (one owner: what this process committed last is what is stored)."""
        if fresh:
            names: dict[int, str] = {}
            high = 0
        else:
            if self._names is None:
                self._names = self._names_in(self.items("v."))
            if self._max_page is None:
                self._max_page = self.max_page_id()
            names, high = dict(self._names), self._max_page
        elsewhere = [pid for pid in txn.page_refcounts if pid not in txn.pages]
        # A page's count key exists exactly while its entries do: asking for the small
        # count keys, not the entries, keeps a snapshot's commit from reading every page.
        existing = set(self._get_many([_qkey(pid) for pid in elsewhere])) if elsewhere and not fresh else set()
        return translate(txn, names, high, existing)

    @staticmethod
    def _names_in(rows: Iterable[tuple[str, bytes]]) -> dict[int, str]:
        """volume id -> name, of the `v.` rows given."""
        return {int(k[2:]): json.loads(v)["name"] for k, v in rows}

    def commit(self, txn: Transaction) -> CommitResult:
        if self.readonly:
            raise OSError(errno.EROFS, "metadata store opened read-only")
        held, shared = self._epoch(), self._shared_epoch()
        if held is None and shared is not None:
            with self._commit_lock:
                return self._commit_shared(txn, shared)
        epoch = self._held_epoch()
        if self._journal_maybe:
            self.finish_journal()
        if txn.shared():
            # The whole pool's holder taking back what owners per volume left (their
            # grants, their records): the same guarded commit, under its own epoch.
            with self._commit_lock:
                result = self._commit_shared(txn, epoch)
            self._names, self._max_page = None, None
            return result
        ops, names, high = self._translate(txn, fresh=False)
        self._write(epoch, ops)
        self._names, self._max_page = names, high
        return CommitResult()

    def replace(self, superblock: dict[str, Any], txn: Transaction) -> None:
        """Restore and repair: exactly superblock and txn, replacing everything but the
        holder's keys, atomically (through the journal when it does not fit one op)."""
        epoch = self._held_epoch()
        self.finish_journal()
        ops, _names, _high = self._translate(txn, fresh=True)
        # Where this pool's data objects are is the backend's, not the dump's: keep it.
        current = self.superblock()
        sb = {**initial_superblock(superblock), **txn.superblock}
        sb.update({k: current[k] for k in BACKEND_KEYS if k in current})
        ops.sets.update({f"s.{k}": json.dumps(v).encode() for k, v in sb.items()})
        ops.sets.setdefault(MAX_PAGE_KEY, b"0")
        ops.ranges.insert(0, ("", "x."))  # everything but the x.* keys
        self._write(epoch, ops, journal=True)
        self._names, self._max_page = None, None

    def _held_epoch(self) -> int:
        epoch = self._epoch()
        if epoch is None:
            raise OSError(errno.EIO, "metadata commit refused: this process does not hold the pool")
        return epoch

    def _operate(
        self, epoch: int, ops: _Ops, extra: dict[str, bytes] | None = None, drop: tuple[str, ...] = ()
    ) -> None:
        """One guarded WriteOp: nothing of it lands unless x.epoch is still ours."""
        sets = {**ops.sets, **(extra or {})}
        try:
            with rados.WriteOpCtx() as op:
                op.omap_cmp(EPOCH_KEY, epoch_value(epoch), rados.LIBRADOS_CMPXATTR_OP_EQ)
                for begin, end in ops.ranges:
                    self.io.remove_omap_range2(op, begin, end)
                if ops.removes or drop:
                    self.io.remove_omap_keys(op, tuple(sorted(ops.removes)) + drop)
                if sets:
                    self.io.set_omap(op, tuple(sets), tuple(sets.values()))
                self.io.operate_write_op(op, self.obj)
        except rados.Error as exc:
            if rados_errno(exc) == errno.ECANCELED:
                raise OSError(
                    errno.EIO, "metadata commit refused: another host took the pool over (its epoch is newer)"
                ) from None
            raise as_oserror(exc, "metadata commit") from None

    def _write(self, epoch: int, ops: _Ops, *, journal: bool = False) -> None:
        pieces = ops.pieces()
        if not journal and len(pieces) == 1:  # it fits one operation
            self._operate(epoch, pieces[0])
            return
        names: list[str] = []
        self._write_pieces(f"{self.obj}.journal.{epoch}", pieces, names)
        self._operate(epoch, _Ops(), {JOURNAL_KEY: json.dumps(names).encode()})  # the commit point
        self._journal_maybe = True
        self.finish_journal()

    def finish_journal(self) -> None:
        """Apply a recorded journal (a commit that was interrupted, or just made)."""
        got = self._get([JOURNAL_KEY]).get(JOURNAL_KEY)
        if got is None:
            self._journal_maybe = False
            return
        epoch = self._held_epoch()
        names = json.loads(got)
        for name in names:
            try:
                blob = self.io.read(name, MAX_OP_BYTES * 2, 0)
            except rados.Error as exc:
                raise as_oserror(exc, "metadata journal read") from None
            self._operate(epoch, _Ops.decode(blob))
        self._operate(epoch, _Ops(), drop=(JOURNAL_KEY, JOURNAL_NEXT_KEY))
        for name in names:
            try:
                self.io.remove_object(name)
            except rados.ObjectNotFound:
                pass
            except rados.Error as exc:
                raise as_oserror(exc, "metadata journal removal") from None
        self._journal_maybe = False

    # ----- commits of owners per volume (meta/rados_shared.py) ----------------------

    def _versioned_get(self, keys: list[str]) -> dict[str, bytes]:
        """keys and x.version, in operations of at most PAGE_LIMIT keys each."""
        out: dict[str, bytes] = {}
        at = 0
        while True:
            got = self._keys([rados_shared.VERSION_KEY, *keys[at : at + PAGE_LIMIT - 1]], self._read_in_commit)
            version = got.pop(rados_shared.VERSION_KEY, b"")
            if at and version != out.get(rados_shared.VERSION_KEY, b""):
                raise rados_shared.Raced
            out.update(got)
            out[rados_shared.VERSION_KEY] = version
            at += PAGE_LIMIT - 1
            if at >= len(keys):
                if not out[rados_shared.VERSION_KEY]:
                    del out[rados_shared.VERSION_KEY]
                return out

    def _versioned_items(self, prefix: str) -> Iterator[tuple[str, bytes]]:
        """items(prefix), each page read together with x.version (yielded as a pair)."""
        for items, version in self._pages(prefix, self._read_in_commit, versioned=True):
            yield rados_shared.VERSION_KEY, version
            yield from items

    def _commit_shared(self, txn: Transaction, pool_epoch: int) -> CommitResult:
        """One commit beside other owners: read, judge, write guarded by x.version, and
        start again from fresh reads whenever another commit landed in between."""
        if self._unsure is not None:
            raise OSError(errno.EIO, self._unsure)
        leases = self.leases()
        if leases.lost_step is not None:
            raise self._stop_committing(leases.lost_step)
        for vid, epoch in txn.fenced:  # a lease judged dead: its client may write nothing more
            rec = parse_record(self._get([record_key(vid)]).get(record_key(vid)))
            if rec is not None and rec.get("owner") and int(rec.get("epoch", -1)) == epoch:
                leases.fence(rec, f"its lease of volume {vid} (epoch {epoch}) lapsed and is recovered")
        for _attempt in range(COMMIT_ATTEMPTS):
            view = rados_shared.View(self._versioned_get, self._versioned_items)
            try:
                if view.one(JOURNAL_KEY) is not None:  # a large commit decided: applied before anything else
                    self._finish_shared_journal(pool_epoch)
                    continue
                got = rados_shared.resolve(view, txn, leases.live_record)
                names = self._names_in(view.items("v.")) if (txn.volumes or txn.deleted_volumes) else {}
                high = int(view.one(MAX_PAGE_KEY) or b"0") if txn.pages else 0
                elsewhere = [pid for pid in got.txn.page_refcounts if pid not in got.txn.pages]
                existing = set(view.get([_qkey(pid) for pid in elsewhere]))
                ops, _names, _high = translate(got.txn, names, high, existing)
            except rados_shared.Raced:
                continue
            except OSError:
                if self._version_moved(view):
                    continue  # judged on a state another commit has changed since: judge again
                raise
            ops.sets.update(got.sets)
            ops.removes |= got.removes
            try:
                self._write_shared(pool_epoch, view.version, ops, got.locks)
            except rados_shared.Raced:
                time.sleep(min(0.05, 0.0005 * _attempt))  # many owners at once: let one through
                continue
            return got.result
        raise OSError(errno.EIO, f"metadata commit: other owners' commits landed first {COMMIT_ATTEMPTS} times")

    def _write_shared(self, pool_epoch: int, version: bytes | None, ops: _Ops, locks: list[tuple[int, str]]) -> None:
        """ops in one guarded WriteOp, or, when they do not fit one, through a journal:
        the pieces are written to objects of their own, one guarded WriteOp records
        them (the commit point: decided from then on), then they are applied in order,
        each in a WriteOp guarded by x.version that also advances x.journal_next. Every
        commit of every owner finishes a recorded journal before anything of its own,
        so nothing lands between a journal's commit point and its last piece."""
        pieces = ops.pieces()
        if len(pieces) == 1:
            self._operate_shared(pool_epoch, version, pieces[0], locks)
            return
        base = f"{self.obj}.journal.{pool_epoch}{uuid.uuid4().int % 10**12:012d}"
        names: list[str] = []
        try:
            self._write_pieces(base, pieces, names)
            record = {JOURNAL_KEY: json.dumps(names).encode(), JOURNAL_NEXT_KEY: b"0"}
            self._operate_shared(pool_epoch, version, _Ops(sets=record), locks)
        except BaseException:
            self._remove_objects(names)
            raise
        try:
            self._finish_shared_journal(pool_epoch)
        except (OSError, ThinblockError) as exc:  # decided: the next commit, anyone's, applies the rest
            log.warning("metadata %s: a large commit is decided, its journal not yet applied: %s", self.obj, exc)

    def _write_pieces(self, base: str, pieces: list[_Ops], names: list[str]) -> None:
        """Write a journal's pieces to objects `base.N`, each named in names once written
        (so a caller may remove what was written when a later one fails)."""
        for i, piece in enumerate(pieces):
            name = f"{base}.{i}"
            try:
                self.io.write_full(name, piece.encode())
            except rados.Error as exc:
                raise as_oserror(exc, "metadata journal write") from None
            names.append(name)

    def _finish_shared_journal(self, pool_epoch: int) -> None:
        """Apply a recorded journal's pieces from x.journal_next on, then drop it."""
        while True:
            got = self._versioned_get([JOURNAL_KEY, JOURNAL_NEXT_KEY])
            raw = got.get(JOURNAL_KEY)
            if raw is None:
                return
            names = json.loads(raw)
            at = int(got.get(JOURNAL_NEXT_KEY, b"0"))
            piece = _Ops()
            if at < len(names):
                try:
                    piece = _Ops.decode(self.io.read(names[at], MAX_OP_BYTES * 2, 0))
                except rados.Error as exc:
                    raise as_oserror(exc, "metadata journal read") from None
            last = at + 1 >= len(names)
            if last:
                piece.removes |= {JOURNAL_KEY, JOURNAL_NEXT_KEY}
            else:
                piece.sets[JOURNAL_NEXT_KEY] = str(at + 1).encode()
            try:
                self._operate_shared(pool_epoch, got.get(rados_shared.VERSION_KEY), piece, [])
            except rados_shared.Raced:
                continue  # another finisher (or committer) moved on: read where it stands
            if last:
                self._remove_objects(names)
                return

    def _remove_objects(self, names: list[str]) -> None:
        for name in names:
            try:
                self.io.remove_object(name)
            except rados.Error:
                log.debug("metadata %s: journal object %s not removed", self.obj, name)

    def _version_moved(self, view: rados_shared.View) -> bool:
        try:
            now = self._get([rados_shared.VERSION_KEY]).get(rados_shared.VERSION_KEY)
        except ThinblockError:
            return False
        return now != view.version

    def _operate_shared(self, pool_epoch: int, version: bytes | None, ops: _Ops, locks: list[tuple[int, str]]) -> None:
        """One WriteOp: lands only if x.version is what the attempt read, the pool epoch
        is the one shared, every lease's lock still lists its cookie, and, for a
        commit made inside a pool-level step, the step's lock still lists this
        store's (a step that stalled past that lock's lease read what others may
        have changed since: its absolute values, next ids among them, would be stale)."""
        step = self.leases().step_cookie()
        try:
            self._guarded_write(version, ops, locks, pool_epoch=pool_epoch, step=step)
        except rados.Error as exc:
            code = rados_errno(exc)
            if code == errno.ECANCELED:
                epoch = self._get([EPOCH_KEY]).get(EPOCH_KEY)
                if epoch is not None and int(epoch) != pool_epoch:
                    raise OSError(
                        errno.EIO, "metadata commit refused: another host took the whole pool over (its epoch is newer)"
                    ) from None
                raise rados_shared.Raced from None
            if code == errno.EBUSY:
                leases = self.leases()
                if step is not None and not leases.step_listed(step):
                    if leases.step_ended_cleanly(step):
                        raise rados_shared.Raced from None  # it ended meanwhile: again, without it
                    # What the step changed in memory was decided on reads another step
                    # may have changed since; put back, the next commit would carry it
                    # without the step's assertion. So nothing more lands from here.
                    why = leases.lost_step or "the pool-level step's lock was lost while it ran"
                    raise self._stop_committing(why) from None
                mine = ", ".join(f"volume {vid}" for vid, _c in locks)
                raise OSError(
                    errno.ESTALE, f"metadata commit refused: the lease of {mine} was lost (another took it)"
                ) from None
            if code == errno.ETIMEDOUT:
                # It may have landed, or not: its changes to shared counts are sums, and
                # sent again they would count twice. This owner commits nothing more; the
                # next owner of its volumes recovers them from what is committed.
                why = f"a commit's outcome is unknown (the cluster did not answer within {OP_TIMEOUT_S} s)"
                raise self._stop_committing(why, errno.EIO) from None
            raise as_oserror(exc, "metadata commit") from None

    def _stop_committing(self, why: str, code: int = errno.ESTALE) -> OSError:
        """Nothing more of this owner may land (a commit whose outcome is unknown, or a
        pool-level step that lost its lock): every later commit is refused, and its
        leases are given up (its server stops)."""
        self._unsure = f"metadata commit refused: {why}; this owner commits nothing more: restart it"
        self.leases().give_up_all(why)
        return OSError(code, self._unsure)

    # ----- ownership per volume (meta/rados_leases.py) --------------------------------

    def leases(self) -> VolumeLeases:
        if self._leases is None:
            self._leases = VolumeLeases(self.cluster, self.io, self.obj)
        return self._leases

    def _record(self, volume_id: int) -> dict[str, Any] | None:
        return parse_record(self._get([record_key(volume_id)]).get(record_key(volume_id)))

    def claim_volume(self, volume_id: int, owner: str) -> Lease:
        return self.claim_volumes([volume_id], owner)[volume_id]

    def claim_volumes(self, volume_ids: Sequence[int], owner: str) -> dict[int, Lease]:
        """Every lock first, then every record in one guarded WriteOp. A record still
        naming a holder (it never let go, and its lock lapsed) is fenced first."""
        if not owner:
            raise ValueError("an owner needs a name")
        if self.readonly:
            raise OSError(errno.EROFS, "metadata store opened read-only")
        leases = self.leases()
        ids = list(dict.fromkeys(volume_ids))
        cookies: dict[int, str] = {}
        taken_at: dict[int, float] = {}
        try:
            for vid in ids:
                try:
                    if vid in leases.held:
                        raise rados.ObjectBusy("held by this store")
                    cookies[vid], taken_at[vid] = leases.lock(vid, owner)
                except rados.ObjectBusy:
                    rec = self._record(vid)
                    holder = rec.get("owner") if rec and rec.get("owner") else "another client (unknown)"
                    raise VolumeBusyError(f"volume {vid} is owned by {holder}") from None
                except rados.Error as exc:
                    raise as_oserror(exc, f"lock of volume {vid}") from None
            for vid, rec in self._records(ids).items():
                if rec is not None and rec.get("owner"):
                    leases.fence(rec, f"it never let go of volume {vid}, and its lease lapsed")
            got = self._write_records(cookies, owner)
            for vid in ids:  # fencing can take seconds: the leases run from now, renewed
                try:
                    taken_at[vid] = leases.renew(vid, cookies[vid], owner)
                except rados.Error as exc:
                    raise as_oserror(exc, f"lock of volume {vid} (lost while it was claimed)") from None
        except BaseException:
            for vid, cookie in cookies.items():
                leases.unlock(vid, cookie)
            raise
        for vid, lease in got.items():
            leases.held[vid] = (lease, cookies[vid])
            leases.renewer.add(volume_lock(vid), cookies[vid], owner, taken_at=taken_at[vid])
        return got

    def _records(self, ids: list[int]) -> dict[int, dict[str, Any] | None]:
        got = self._get_many([record_key(vid) for vid in ids])
        return {vid: parse_record(got.get(record_key(vid))) for vid in ids}

    def _write_records(self, cookies: dict[int, str], owner: str) -> dict[int, Lease]:
        me = self.leases().me()
        leases: dict[int, Lease] = {}

        def claimed(vid: int, rec: dict[str, Any] | None) -> dict[str, Any]:
            epoch = int(rec.get("epoch", 0)) + 1 if rec else 1
            leases[vid] = Lease(vid, owner, epoch)
            return {"owner": owner, "epoch": epoch, "cookie": cookies[vid], **me}

        self._update_records(cookies, claimed)
        return leases

    def _guarded_write(
        self,
        version: bytes | None,
        ops: _Ops,
        locks: list[tuple[int, str]],
        *,
        pool_epoch: int | None = None,
        step: str | None = None,
    ) -> None:
        """ops in one WriteOp that compares x.version with version and bumps it, asserts
        each (volume, cookie) lock, and, when given, compares the pool epoch and asserts
        the pool-level step's lock; rados.Error (ECANCELED, EBUSY: nothing applied)."""
        before = int(version) if version else 0
        sets = {**ops.sets, rados_shared.VERSION_KEY: rados_shared.version_value(before + 1).encode()}
        with rados.WriteOpCtx() as op:
            op.omap_cmp(rados_shared.VERSION_KEY, (version or b"").decode(), rados.LIBRADOS_CMPXATTR_OP_EQ)
            if pool_epoch is not None:
                op.omap_cmp(EPOCH_KEY, epoch_value(pool_epoch), rados.LIBRADOS_CMPXATTR_OP_EQ)
            for vid, cookie in locks:
                op.execute("lock", "assert_locked", cls_lock.assert_locked_args(volume_lock(vid), cookie))
            if step is not None:
                op.execute("lock", "assert_locked", cls_lock.assert_locked_args(POOL_STEP_LOCK, step))
            for begin, end in ops.ranges:
                self.io.remove_omap_range2(op, begin, end)
            if ops.removes:
                self.io.remove_omap_keys(op, tuple(sorted(ops.removes)))
            self.io.set_omap(op, tuple(sets), tuple(sets.values()))
            self.io.operate_write_op(op, self.obj)

    def _operate_records(self, version: bytes | None, ops: _Ops, locks: list[tuple[int, str]]) -> None:
        try:
            self._guarded_write(version, ops, locks)
        except rados.Error as exc:
            if rados_errno(exc) == errno.ECANCELED:
                raise rados_shared.Raced from None
            raise as_oserror(exc, "metadata lease record") from None

    def release_volume(self, lease: Lease) -> None:
        self.release_volumes([lease])

    def release_volumes(self, leases: Sequence[Lease]) -> None:
        """Empty each record (guarded by the lock, so a lease taken since is left
        alone), then unlock; the locks go whatever happens."""
        store = self.leases()
        mine = {
            lease.volume_id: store.held[lease.volume_id][1]
            for lease in leases
            if store.held.get(lease.volume_id, (None,))[0] == lease
        }
        try:
            if mine:
                self._empty_records(mine)
        finally:
            for vid, cookie in mine.items():
                store.held.pop(vid, None)  # the watchdog may have dropped it meanwhile
                store.unlock(vid, cookie)

    def _empty_records(self, cookies: dict[int, str]) -> None:
        def emptied(vid: int, rec: dict[str, Any] | None) -> dict[str, Any] | None:
            return {**rec, "owner": ""} if rec is not None and rec.get("cookie") == cookies[vid] else None

        try:
            self._update_records(cookies, emptied)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise  # EBUSY: a lock another took since: its record is the taker's now

    def _update_records(
        self, cookies: dict[int, str], change: Callable[[int, dict[str, Any] | None], dict[str, Any] | None]
    ) -> None:
        """Rewrite the lease records of these volumes (change(volume id, record as
        stored): the new record, or None to leave it) in one WriteOp guarded by
        x.version and each volume's lock (its cookie here), read and tried again
        whenever another commit landed first."""
        for _attempt in range(COMMIT_ATTEMPTS):
            view = rados_shared.View(self._versioned_get, self._versioned_items)
            try:
                got = view.get([record_key(vid) for vid in cookies])
            except rados_shared.Raced:
                continue
            ops = _Ops()
            for vid in cookies:
                new = change(vid, parse_record(got.get(record_key(vid))))
                if new is not None:
                    ops.sets[record_key(vid)] = json.dumps(new).encode()
            try:
                self._operate_records(view.version, ops, list(cookies.items()))
            except rados_shared.Raced:
                continue
            return
        raise OSError(errno.EIO, f"metadata lease record: other commits landed first {COMMIT_ATTEMPTS} times")

    def _held_whole(self) -> bool:
        """Whether this process holds the pool whole: then no owner per volume can hold
        a lease (each shares the pool's lock, which excludes that), whatever a lapsed
        lock's expiry, judged by this host's clock, still says."""
        return self._epoch() is not None

    def volume_holder(self, volume_id: int) -> str | None:
        store = self.leases()
        held = store.held.get(volume_id)
        if held is not None:
            return held[0].owner
        if self._held_whole():
            return None
        rec = self._record(volume_id)
        return str(rec["owner"]) if rec is not None and store.live_record(volume_id, rec) else None

    def lease_live(self, volume_id: int, epoch: int) -> bool:
        store = self.leases()
        held = store.held.get(volume_id)
        if held is not None:
            return held[0].epoch == epoch
        if self._held_whole():
            return False
        rec = self._record(volume_id)
        return rec is not None and int(rec.get("epoch", -1)) == epoch and store.live_record(volume_id, rec)

    def recorded_holders(self) -> dict[int, str]:
        out = {}
        for k, v in self.items("o."):
            rec = parse_record(v)
            if rec and rec.get("owner"):
                out[int(k[2:])] = str(rec["owner"])
        return out

    def fence_volume(self, volume_id: int) -> str:
        """Blocklist the client the volume's record names (one process per volume on
        Ceph: nothing else of it), then break its lock, so the next claim takes it."""
        store = self.leases()
        rec = self._record(volume_id)
        if rec is None or not rec.get("owner"):
            return "nobody"
        store.fence(rec, f"serve --takeover of volume {volume_id}")
        lockers, _kind = store.lockers(volume_lock(volume_id))
        for locker in lockers:
            try:
                self.io.execute(
                    self.obj,
                    "lock",
                    "break_lock",
                    cls_lock.break_lock_args(volume_lock(volume_id), locker.instance, locker.cookie),
                )
            except rados.ObjectNotFound:
                pass  # broken meanwhile (its lease lapsed, and another took it)
            except rados.Error as exc:
                raise as_oserror(exc, f"breaking the lock of volume {volume_id}") from None
        return str(rec["owner"])

    def watch_leases(self, lost: Callable[[int, str], None]) -> None:
        store = self.leases()

        def on_lost(name: str, why: str) -> None:
            if name.startswith("volume."):
                vid = int(name.removeprefix("volume."))
                store.held.pop(vid, None)
                lost(vid, why)

        store.renewer.on_lost = on_lost
        for name in list(store.renewer.lost):  # lost before anyone watched (a slow start)
            if name.startswith("volume.") and int(name.removeprefix("volume.")) in store.held:
                on_lost(name, "it was lost while the server was starting")

    def pool_lock(self) -> contextlib.AbstractContextManager[None]:
        return self.leases().pool_step()

    def grants(self) -> list[Grant]:
        return [rados_shared.parse_grant(k) for k, _v in self.items(rados_shared.GRANT_PREFIX)]

    def orphans(self) -> list[int]:
        return sorted(int(k[2:]) for k, v in self.items("q.") if int(v) == 0)

    # ----- checking and closing ------------------------------------------------------

    def integrity_problems(self) -> list[str]:
        problems = []
        if self.journal_pending():
            problems.append("a large commit's journal is recorded but not applied (the next holder applies it)")
        pages = {k[2:] for k, _ in self.items("p.")}
        counts = {k[2:] for k, _ in self.items("q.")}
        problems += [f"mapping page {int(p)} has no refcount" for p in sorted(pages - counts)[:20]]
        problems += [f"refcount of a missing mapping page {int(p)}" for p in sorted(counts - pages)[:20]]
        try:  # an older format reads as it is (the next writable open upgrades it)
            check_format(self.superblock().get("format_version"), "the pool's omap")
        except ThinblockError as exc:
            problems.append(str(exc))
        return problems

    def close(self) -> None:
        """Like a process's end: the leases this store object holds are given up (the
        connection is the process's, and stays)."""
        if self._leases is None:
            return
        held = [lease for lease, _cookie in list(self._leases.held.values())]
        with contextlib.suppress(OSError, ThinblockError):
            self.release_volumes(held)
        self._leases.close()
