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

A commit is one WriteOp on this object, which RADOS applies atomically: first
`omap_cmp(x.epoch == ours)`, then the removals and the new values. A holder that
was fenced off (another took the pool over and bumped the epoch) gets ECANCELED
and changes nothing. A commit too large for one operation (restore, a huge
first commit) is written to journal objects first; one guarded operation that
records the journal is its commit point; then the journal is applied in guarded
pieces and dropped. An interrupted application is finished by the next holder.
Every step is a set or a removal of known keys, so applying it twice is harmless.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import struct
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from thinblock.bindings import RADOS_POOLS, require
from thinblock.ceph.cluster import Cluster, as_oserror, rados_errno
from thinblock.errors import ThinblockError
from thinblock.meta.base import (
    CommitResult,
    MetadataStore,
    Transaction,
    VolumeRow,
    check_format,
    initial_superblock,
)

rados = require("rados", feature=RADOS_POOLS)

EPOCH_KEY = "x.epoch"
OWNER_KEY = "x.owner"
MAX_PAGE_KEY = "x.max_page_id"
JOURNAL_KEY = "x.journal"
BACKEND_KEYS = ("rados_id", "object_size")  # superblock keys that name the data objects
PAGE_LIMIT = 1024  # get_omap_vals returns at most this many per call, whatever it is asked
MAX_OP_BYTES = 8 << 20
MAX_OP_KEYS = 8192


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


class RadosMetadata(MetadataStore):
    """The omap of object `obj` in the Ceph pool. `epoch()` gives the epoch this
    process holds the pool under (None when it holds nothing: commits refuse)."""

    def __init__(
        self,
        cluster: Cluster,
        ceph_pool: str,
        obj: str,
        *,
        epoch: Callable[[], int | None],
        readonly: bool = False,
    ) -> None:
        self.cluster = cluster
        self.io = cluster.ioctx(ceph_pool)
        self.obj = obj
        self._epoch = epoch
        self.readonly = readonly
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

    def items(self, prefix: str) -> Iterator[tuple[str, bytes]]:
        """Every (key, value) whose key starts with prefix, in key order, page by page."""
        after = ""
        while True:
            try:
                with rados.ReadOpCtx() as op:
                    it, _ = self.io.get_omap_vals(op, after, prefix, PAGE_LIMIT)
                    self.io.operate_read_op(op, self.obj)
                    items = list(it)
            except rados.Error as exc:
                raise self._read_failed(exc) from None
            if not items:
                return
            yield from items
            after = items[-1][0]

    def _get_many(self, keys: list[str]) -> dict[str, bytes]:
        """_get in operations of at most PAGE_LIMIT keys (a snapshot asks for every page's)."""
        out: dict[str, bytes] = {}
        for at in range(0, len(keys), PAGE_LIMIT):
            out.update(self._get(keys[at : at + PAGE_LIMIT]))
        return out

    def _get(self, keys: list[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        try:
            with rados.ReadOpCtx() as op:
                it, _ = self.io.get_omap_vals_by_keys(op, tuple(keys))
                self.io.operate_read_op(op, self.obj)
                return dict(it)
        except rados.Error as exc:
            raise self._read_failed(exc) from None

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
        """The omap changes of txn, and the volume names and largest page id after it."""
        ops = _Ops()
        if fresh:
            names: dict[int, str] = {}
            high = 0
        else:
            if self._names is None:
                self._names = {int(k[2:]): json.loads(v)["name"] for k, v in self.items("v.")}
            if self._max_page is None:
                self._max_page = self.max_page_id()
            names, high = dict(self._names), self._max_page
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
        elsewhere = [pid for pid in txn.page_refcounts if pid not in txn.pages]
        # A page's count key exists exactly while its entries do: asking for the small
        # count keys, not the entries, keeps a snapshot's commit from reading every page.
        existing = set(self._get_many([_qkey(pid) for pid in elsewhere])) if elsewhere and not fresh else set()
        for pid, count in txn.page_refcounts.items():
            if (txn.pages.get(pid) is not None) or _qkey(pid) in existing:
                ops.sets[_qkey(pid)] = str(count).encode()
        for index, blob in txn.refcount_pages.items():
            ops.sets[_ckey(index)] = bytes(blob)
        if txn.pages:
            high = max(high, *txn.pages)
            ops.sets[MAX_PAGE_KEY] = str(high).encode()
        return ops, names, high

    def commit(self, txn: Transaction) -> CommitResult:
        if self.readonly:
            raise OSError(errno.EROFS, "metadata store opened read-only")
        if txn.shared():  # one owner per pool, under the pool's lock and epoch (meta/base.py)
            raise OSError(errno.EOPNOTSUPP, "metadata commit refused: a RADOS pool has one owner; no per-volume leases")
        epoch = self._held_epoch()
        if self._journal_maybe:
            self.finish_journal()
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
        base = f"{self.obj}.journal.{epoch}"
        names = []
        for i, piece in enumerate(pieces):
            name = f"{base}.{i}"
            try:
                self.io.write_full(name, piece.encode())
            except rados.Error as exc:
                raise as_oserror(exc, "metadata journal write") from None
            names.append(name)
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
        self._operate(epoch, _Ops(), drop=(JOURNAL_KEY,))
        for name in names:
            try:
                self.io.remove_object(name)
            except rados.ObjectNotFound:
                pass
            except rados.Error as exc:
                raise as_oserror(exc, "metadata journal removal") from None
        self._journal_maybe = False

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
        pass  # the connection is the process's
