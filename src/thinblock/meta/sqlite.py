"""The embedded metadata store: SQLite in the pool directory (meta/base.py's contract).

The pool collects changes in memory and hands them to `commit()` as one
transaction, so the on-disk metadata is always the state at some commit. Page
loads use a second connection: in WAL mode they never wait for a commit's
write and fsync, so a request that misses the page cache is not held by it.

Tables
  superblock(key, value)                 format, block size, size, counters
  volumes(id, name, kind, origin_id, ...) one row per volume or snapshot
  roots(volume_id, page_index, page_id)  each volume's root table, sparse
  pages(id, refcount, entries)           mapping pages, as core/mapping.py encodes them; the
                                         refcount column is the count when the entries were written
  page_refs(id, refcount)                every page's refcount: the authority. Apart from
                                         the entries, so that a snapshot's commit changing
                                         10^5 counts rewrites 10^5 small rows, not every
                                         page's entries (SQLite rewrites a whole row, blob
                                         included, when an integer in it changes size)
  refcount_pages(idx, counts)            dblock refcounts, 1024 uint32 a page
  volume_owners(volume_id, owner, epoch) who holds each volume's lease ('' once released)
                                         and its owner epoch, kept after release
  grants(volume_id, epoch, start, count) free blocks handed to a volume's owner

Ownership per volume (meta/base.py): a lease is an OFD lock on byte 1 + volume id
of the leases file the backend names (meta/filelocks.py), so it dies with its
process; the table says who took it and at which epoch. The pool-level lock is
byte 0 of the same file. Every commit is one BEGIN IMMEDIATE transaction, so
owners in several processes write one at a time, each applying its changes to
what the others committed (meta/owners.py).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar, cast

from thinblock.errors import CorruptionError, ThinblockError
from thinblock.meta import owners
from thinblock.meta.base import (
    FORMAT_VERSION,
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
from thinblock.meta.filelocks import lock_range, range_locked, unlock_range
from thinblock.privacy import create_private_file, touch_private

DB_NAME = "metadata.sqlite"
SqliteError = sqlite3.Error  # what the backend catches, without knowing SQLite itself

_SCHEMA = """
CREATE TABLE superblock (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE volumes (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    size_bytes INTEGER NOT NULL,
    detect_zeroes TEXT NOT NULL,
    created REAL NOT NULL,
    data_blocks INTEGER NOT NULL DEFAULT 0,
    zeroed_blocks INTEGER NOT NULL DEFAULT 0,
    pinned_blocks INTEGER NOT NULL DEFAULT 0,
    kind TEXT NOT NULL DEFAULT 'volume',
    origin_id INTEGER,
    reserve_bytes INTEGER NOT NULL DEFAULT 0,
    low_water REAL,
    on_low_water TEXT,
    exclusive_blocks INTEGER NOT NULL DEFAULT 0,
    exclusive_epoch INTEGER NOT NULL DEFAULT -1
);
CREATE TABLE roots (
    volume_id INTEGER NOT NULL,
    page_index INTEGER NOT NULL,
    page_id INTEGER NOT NULL,
    PRIMARY KEY (volume_id, page_index)
) WITHOUT ROWID;
CREATE TABLE pages (id INTEGER PRIMARY KEY, refcount INTEGER NOT NULL, entries BLOB NOT NULL);
CREATE TABLE refcount_pages (idx INTEGER PRIMARY KEY, counts BLOB NOT NULL);
"""
_PAGE_REFS_TABLE = "CREATE TABLE page_refs (id INTEGER PRIMARY KEY, refcount INTEGER NOT NULL)"
_SCHEMA += _PAGE_REFS_TABLE + ";"
_OWNER_TABLES = (
    "CREATE TABLE IF NOT EXISTS volume_owners"
    " (volume_id INTEGER PRIMARY KEY, owner TEXT NOT NULL, epoch INTEGER NOT NULL)",
    "CREATE TABLE IF NOT EXISTS grants (volume_id INTEGER NOT NULL, epoch INTEGER NOT NULL,"
    " start INTEGER NOT NULL, count INTEGER NOT NULL, PRIMARY KEY (start)) WITHOUT ROWID",
)
_SCHEMA += ";".join(_OWNER_TABLES) + ";"
_PAGES_IN = (
    "SELECT p.id, COALESCE(r.refcount, 0), p.entries FROM pages p LEFT JOIN page_refs r ON r.id = p.id"
    " WHERE p.id IN ({})"
)
# Largest IN (...) list of one batch read (SQLite's variable limit is 32766 since 3.32).
_BATCH_IDS = 900


_VOLUME_COLUMNS = (
    "id, name, size_bytes, detect_zeroes, created, data_blocks, zeroed_blocks, pinned_blocks,"
    " kind, origin_id, reserve_bytes, low_water, on_low_water, exclusive_blocks, exclusive_epoch"
)
# What a format-2 database read without upgrading (opened read-only) gives for the
# columns format 3 added: an exclusive count never known exactly (VolumeRow's defaults).
_VOLUME_COLUMNS_2 = _VOLUME_COLUMNS.replace("exclusive_blocks, exclusive_epoch", "0, -1")
# Format 1 had no snapshots, reservations or low-water marks; the columns default sensibly.
_MIGRATE_1_TO_2 = (
    "ALTER TABLE volumes ADD COLUMN kind TEXT NOT NULL DEFAULT 'volume'",
    "ALTER TABLE volumes ADD COLUMN origin_id INTEGER",
    "ALTER TABLE volumes ADD COLUMN reserve_bytes INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE volumes ADD COLUMN low_water REAL",
    "ALTER TABLE volumes ADD COLUMN on_low_water TEXT",
)
# Format 3 keeps each volume's exclusive-block count (core/exclusive.py); an upgraded
# pool's are not known yet (-1), so each is counted the first time it is asked for.
_MIGRATE_2_TO_3 = (
    "ALTER TABLE volumes ADD COLUMN exclusive_blocks INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE volumes ADD COLUMN exclusive_epoch INTEGER NOT NULL DEFAULT -1",
)


_P = ParamSpec("_P")
_T = TypeVar("_T")


def _damaged(where: str, exc: sqlite3.Error) -> ThinblockError:
    code = getattr(exc, "sqlite_errorcode", None)
    if (code is not None and code & 0xFF == sqlite3.SQLITE_IOERR) or "disk I/O error" in str(exc):
        # The file may be fine: the disk under it fails. Restoring would not help.
        return ThinblockError(
            f"{where} cannot be read or written ({exc}): the storage under it fails (see the system log);"
            " nothing was changed"
        )
    return CorruptionError(
        f"{where} is damaged or not a thinblock pool's ({exc}); restore it from a dump with 'thinblock pool restore'"
    )


def _reads(method: Callable[_P, _T]) -> Callable[_P, _T]:
    """A read of the database: SQLite's complaints about a damaged or foreign file
    become one CorruptionError sentence (never a traceback)."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        try:
            return method(*args, **kwargs)
        except sqlite3.DatabaseError as exc:
            raise _damaged("the pool's metadata database", exc) from None

    return wrapper


def _conn_reads(method: Callable[_P, _T]) -> Callable[_P, _T]:
    """A read on the writing connection (`_reads`), under its lock (SqliteMetadata.conn_lock)."""
    checked = _reads(method)

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        with cast(SqliteMetadata, args[0]).conn_lock:
            return checked(*args, **kwargs)

    return wrapper


def _connect(path: str, readonly: bool, *, immutable: bool = False) -> sqlite3.Connection:
    uri = f"file:{path}?mode={'ro' if readonly else 'rw'}" + ("&immutable=1" if immutable else "")
    conn = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None, timeout=30)
    conn.execute("PRAGMA synchronous=FULL")
    return conn


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)).fetchone() is not None


def _has_page_refs(conn: sqlite3.Connection) -> bool:
    return _has_table(conn, "page_refs")


class SqliteMetadata(MetadataStore):
    """One SQLite database; every write goes through `commit`."""

    def __init__(
        self, conn: sqlite3.Connection, path: str, *, readonly: bool = False, leases_path: str | None = None
    ) -> None:
        self.conn = conn
        self.path = path
        self._reader: sqlite3.Connection | None = None
        self._reader_lock = threading.Lock()
        self._readonly = readonly
        self._columns = _VOLUME_COLUMNS
        self._leases_path = leases_path
        self._leases_fd = -1
        self._closed = False  # the leases file is not opened again once closed
        self._held: dict[int, Lease] = {}  # the leases this store object holds
        self._owner_lock = threading.Lock()  # the fd and _held
        self._pool_lock = threading.RLock()  # pool_lock() within this process (a step may call another)
        self._pool_depth = 0  # pool_lock() nesting: the OFD byte is taken at the outermost only
        # The writing connection is one per store object, shared by its threads (an
        # owner's committer, a pool-level step, lease records): a transaction on it must
        # never interleave with another thread's statements, or one thread's failed
        # BEGIN would roll back the other's open transaction and leave its writes
        # applied piecemeal. Its reads wait too, so that none sees another thread's
        # uncommitted writes. Page reads use their own connection and never wait.
        self.conn_lock = threading.RLock()

    @classmethod
    def create(cls, path: str, superblock: dict[str, object]) -> SqliteMetadata:
        try:
            return cls._create(path, superblock)
        except sqlite3.Error as exc:
            raise ThinblockError(f"cannot create the metadata database {path}: {exc}") from None

    @classmethod
    def _create(cls, path: str, superblock: dict[str, object]) -> SqliteMetadata:
        touch_private(path)  # SQLite gives its -wal and -shm files the database's mode
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("BEGIN")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        sb = initial_superblock(superblock)
        conn.executemany("INSERT INTO superblock VALUES (?, ?)", [(k, json.dumps(v)) for k, v in sb.items()])
        conn.execute("COMMIT")
        return cls(conn, path)

    @classmethod
    def open(cls, path: str, *, readonly: bool = False, leases_path: str | None = None) -> SqliteMetadata:
        writable_dir = os.access(os.path.dirname(path) or ".", os.W_OK) and os.access(path, os.W_OK)
        if not readonly and not writable_dir:
            raise ThinblockError(
                f"pool directory {os.path.dirname(path) or '.'} is read-only: cannot open the pool for writing"
            )
        conn: sqlite3.Connection | None = None
        try:
            # On a read-only filesystem SQLite cannot make the WAL index: read the file as immutable.
            conn = _connect(path, readonly, immutable=readonly and not writable_dir)
            store = cls(conn, path, readonly=readonly, leases_path=leases_path)
            version = check_format(store.superblock().get("format_version"), f"metadata database {path}")
            if version == 1 and readonly:
                raise ThinblockError(
                    f"metadata format 1 in {path}: open the pool once for writing (any pool command) to upgrade it"
                )
            if version != FORMAT_VERSION and not readonly:
                store._migrate(version)
            elif version == 2:  # read-only: read as it is; the next writable open upgrades it
                store._columns = _VOLUME_COLUMNS_2
            if not _has_page_refs(conn):  # made before page refcounts had their own table
                store._add_page_refs()
            if not readonly and not _has_table(conn, "grants"):  # made before ownership per volume
                store._add_owner_tables()
        except (sqlite3.DatabaseError, ThinblockError) as exc:
            if conn is not None:
                conn.close()
            if isinstance(exc, sqlite3.DatabaseError):
                raise _damaged(f"metadata database {path}", exc) from None
            raise
        return store

    def _migrate(self, version: int) -> None:
        """Upgrade the tables from an older format, in one transaction."""
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            for statement in (_MIGRATE_1_TO_2 if version < 2 else ()) + _MIGRATE_2_TO_3:
                c.execute(statement)
            c.execute("UPDATE superblock SET value = ? WHERE key = 'format_version'", (json.dumps(FORMAT_VERSION),))
        except BaseException:
            c.execute("ROLLBACK")
            raise
        c.execute("COMMIT")

    def _add_page_refs(self) -> None:
        """A pool made before page_refs: writable, it gets the table from the pages' own
        counts (one transaction); read-only, a view of those counts stands in for it."""
        c = self.conn
        if self._readonly:
            c.execute("CREATE TEMP VIEW page_refs AS SELECT id, refcount FROM pages")
            return
        c.execute("BEGIN IMMEDIATE")
        try:
            c.execute(_PAGE_REFS_TABLE)
            c.execute("INSERT INTO page_refs SELECT id, refcount FROM pages")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        c.execute("COMMIT")

    def _add_owner_tables(self) -> None:
        c = self.conn
        c.execute("BEGIN IMMEDIATE")
        try:
            for statement in _OWNER_TABLES:
                c.execute(statement)
        except BaseException:
            c.execute("ROLLBACK")
            raise
        c.execute("COMMIT")

    @_conn_reads
    def superblock(self) -> dict[str, Any]:
        out = {}
        for key, value in self.conn.execute("SELECT key, value FROM superblock"):
            try:
                out[key] = json.loads(value)
            except (ValueError, TypeError):
                raise CorruptionError(
                    f"the pool's metadata database is damaged: superblock entry {key!r} is not a value"
                    " thinblock wrote; restore it from a dump with 'thinblock pool restore'"
                ) from None
        return out

    @_conn_reads
    def volumes(self) -> list[VolumeRow]:
        rows = self.conn.execute(f"SELECT {self._columns} FROM volumes ORDER BY name")
        return [VolumeRow(*row) for row in rows]

    @_conn_reads
    def roots(self, volume_id: int) -> dict[int, int]:
        rows = self.conn.execute("SELECT page_index, page_id FROM roots WHERE volume_id = ?", (volume_id,))
        return dict(rows)

    def all_roots(self) -> Iterator[tuple[int, int, int]]:
        yield from self._walk("SELECT volume_id, page_index, page_id FROM roots")

    @_reads
    def page(self, page_id: int) -> tuple[int, bytes] | None:
        with self._reader_lock:
            if self._reader is None:
                self._reader = self.conn if self._readonly else _connect(self.path, True)
            row = self._reader.execute(
                "SELECT COALESCE(r.refcount, 0), p.entries FROM pages p LEFT JOIN page_refs r ON r.id = p.id"
                " WHERE p.id = ?",
                (page_id,),
            ).fetchone()
        return None if row is None else (row[0], row[1])

    @_reads
    def page_refcounts(self, page_ids: Iterable[int]) -> dict[int, int]:
        ids = list(page_ids)
        if len(ids) > _BATCH_IDS:
            low, high = min(ids), max(ids)
            if high - low < 4 * len(ids):
                # A volume's pages mostly have neighbouring ids (made in order): one range
                # scan of their span reads far faster than lists of ids, even with others'.
                wanted = set(ids)
                with self._reader_lock:
                    if self._reader is None:
                        self._reader = self.conn if self._readonly else _connect(self.path, True)
                    rows = self._reader.execute(
                        "SELECT id, refcount FROM page_refs WHERE id BETWEEN ? AND ?", (low, high)
                    ).fetchall()
                return {pid: count for pid, count in rows if pid in wanted}
        return dict(self._batch(ids, "SELECT id, refcount FROM page_refs WHERE id IN ({})"))

    @_reads
    def pages(self, page_ids: Iterable[int]) -> dict[int, tuple[int, bytes]]:
        return {pid: (count, blob) for pid, count, blob in self._batch(page_ids, _PAGES_IN)}

    def _batch(self, page_ids: Iterable[int], query: str) -> list[Any]:
        """Rows of query (one IN list) for page_ids, read by the page reader in batches:
        committed state, like page(), never waiting for a commit."""
        ids = list(page_ids)
        rows: list[Any] = []
        with self._reader_lock:
            if self._reader is None:
                self._reader = self.conn if self._readonly else _connect(self.path, True)
            for at in range(0, len(ids), _BATCH_IDS):
                chunk = ids[at : at + _BATCH_IDS]
                rows += self._reader.execute(query.format(",".join("?" * len(chunk))), chunk).fetchall()
        return rows

    def all_pages(self) -> Iterator[tuple[int, int, bytes]]:
        # A page without a count reads 0: pool check then reports its refcount as wrong.
        yield from self._walk(
            "SELECT p.id, COALESCE(r.refcount, 0), p.entries FROM pages p LEFT JOIN page_refs r ON r.id = p.id"
        )

    def _walk(self, query: str) -> Iterator[Any]:
        try:
            yield from self.conn.execute(query)
        except sqlite3.DatabaseError as exc:
            raise _damaged("the pool's metadata database", exc) from None

    @_conn_reads
    def max_page_id(self) -> int:
        return int(self.conn.execute("SELECT COALESCE(MAX(id), 0) FROM pages").fetchone()[0])

    @_conn_reads
    def max_volume_id(self) -> int:
        return int(self.conn.execute("SELECT COALESCE(MAX(id), 0) FROM volumes").fetchone()[0])

    @_conn_reads
    def refcount_pages(self) -> dict[int, bytes]:
        return dict(self.conn.execute("SELECT idx, counts FROM refcount_pages"))

    def commit(self, txn: Transaction) -> CommitResult:
        """Apply the whole transaction atomically, or nothing of it.

        A failure is an OSError: ENOSPC when the filesystem under the database is
        full (SQLITE_FULL), EIO otherwise (ESTALE for a lost lease); the database is
        then as before."""
        with self.conn_lock:
            return self._commit(txn)

    def _commit(self, txn: Transaction) -> CommitResult:
        c = self.conn
        try:
            c.execute("BEGIN IMMEDIATE")
            try:
                result = _apply(c, txn, lambda vid: self._live_holder(c, vid))
            except BaseException:
                c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")
        except sqlite3.Error as exc:
            with contextlib.suppress(sqlite3.Error):
                if c.in_transaction:
                    c.execute("ROLLBACK")
            full = getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(exc)
            raise OSError(errno.ENOSPC if full else errno.EIO, f"metadata commit failed: {exc}") from exc
        return result

    # ----- ownership per volume ------------------------------------------------------

    def _fd(self) -> int:
        """The leases file, opened once (under _owner_lock or _pool_lock)."""
        if self._leases_path is None or self._readonly:
            raise ThinblockError(f"metadata database {self.path} is not open for ownership per volume")
        if self._closed:  # a thread still at work after the close (the committer's last step)
            raise ThinblockError(f"metadata database {self.path} is closed")
        if self._leases_fd < 0:
            self._leases_fd = create_private_file(self._leases_path, exclusive=False)
        return self._leases_fd

    def _write_many_locked(self, statement: str, rows: list[tuple[object, ...]]) -> None:
        """One short write transaction applying statement to each row (conn_lock held)."""
        if not rows:
            return
        c = self.conn
        try:
            c.execute("BEGIN IMMEDIATE")
            try:
                c.executemany(statement, rows)
                c.execute("COMMIT")
            except BaseException:
                # A COMMIT that failed (busy past the timeout, a full disk) leaves the
                # transaction open: every later BEGIN would fail until it is rolled back.
                if c.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        c.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise OSError(errno.EIO, f"metadata lease record failed: {exc}") from exc

    @_conn_reads
    def _owner_row(self, volume_id: int) -> tuple[str, int] | None:
        row = self.conn.execute("SELECT owner, epoch FROM volume_owners WHERE volume_id = ?", (volume_id,)).fetchone()
        return None if row is None else (str(row[0]), int(row[1]))

    def _live_holder(self, c: sqlite3.Connection, volume_id: int) -> tuple[str, int] | None:
        """Inside a commit: the (owner, epoch) of the live lease on the volume, or None.
        Without _owner_lock, which a claim takes before the connection's lock: the
        leases this object holds are read as they are, others' by their OFD lock."""
        recorded = _stored_owner(c, volume_id)
        if recorded is None:
            return None
        mine = self._held.get(volume_id)
        if mine is not None:
            return (mine.owner, mine.epoch)
        fd = self._leases_fd
        # A store that never opened the leases file holds no lease: it cannot tell a
        # live holder from a dead one, and counts the record as live (refusing is safe).
        if fd < 0 or range_locked(fd, 1 + volume_id, 1):
            return recorded
        return None

    def claim_volume(self, volume_id: int, owner: str) -> Lease:
        return self.claim_volumes([volume_id], owner)[volume_id]

    def claim_volumes(self, volume_ids: Sequence[int], owner: str) -> dict[int, Lease]:
        """Every lock first, then the records in one write transaction: a server of
        thousands of volumes starts without a transaction per volume."""
        if not owner:
            raise ValueError("an owner needs a name")
        ids = list(dict.fromkeys(volume_ids))
        with self._owner_lock:
            fd = self._fd()
            locked: list[int] = []
            try:
                for vid in ids:
                    if vid in self._held or not lock_range(fd, 1 + vid, 1):
                        row = self._owner_row(vid)
                        holder = row[0] if row and row[0] else "another process (unknown)"
                        raise VolumeBusyError(f"volume {vid} is owned by {holder}")
                    locked.append(vid)
                with self.conn_lock:
                    epochs = self._epochs(ids)
                    leases = {vid: Lease(vid, owner, epochs.get(vid, 0) + 1) for vid in ids}
                    self._write_many_locked(
                        "INSERT OR REPLACE INTO volume_owners VALUES (?, ?, ?)",
                        [(lease.volume_id, owner, lease.epoch) for lease in leases.values()],
                    )
            except BaseException:
                for vid in locked:
                    unlock_range(fd, 1 + vid, 1)
                raise
            self._held.update(leases)
            return leases

    def release_volumes(self, leases: Sequence[Lease]) -> None:
        with self._owner_lock:
            mine = [lease for lease in leases if self._held.get(lease.volume_id) == lease]
            try:
                with self.conn_lock:
                    self._write_many_locked(
                        "UPDATE volume_owners SET owner = '' WHERE volume_id = ? AND epoch = ?",
                        [(lease.volume_id, lease.epoch) for lease in mine],
                    )
            finally:
                # The locks go whatever happens: a row left naming us is stale, and the
                # next claim overwrites it.
                fd = self._fd()
                for lease in mine:
                    del self._held[lease.volume_id]
                    unlock_range(fd, 1 + lease.volume_id, 1)

    @_conn_reads
    def _epochs(self, volume_ids: list[int]) -> dict[int, int]:
        """The last epoch recorded for each of these volumes (read in batches of at most
        500: SQLite bounds the parameters of one statement)."""
        epochs: dict[int, int] = {}
        for at in range(0, len(volume_ids), 500):
            batch = volume_ids[at : at + 500]
            marks = ",".join("?" * len(batch))
            query = f"SELECT volume_id, epoch FROM volume_owners WHERE volume_id IN ({marks})"
            epochs.update((int(vid), int(epoch)) for vid, epoch in self.conn.execute(query, batch))
        return epochs

    def release_volume(self, lease: Lease) -> None:
        self.release_volumes([lease])

    def volume_holder(self, volume_id: int) -> str | None:
        with self._owner_lock:
            if volume_id in self._held:
                return self._held[volume_id].owner
            if not range_locked(self._fd(), 1 + volume_id, 1):
                return None
        row = self._owner_row(volume_id)
        return row[0] if row and row[0] else "another process (unknown)"

    @_conn_reads
    def recorded_holders(self) -> dict[int, str]:
        rows = self.conn.execute("SELECT volume_id, owner FROM volume_owners WHERE owner != ''").fetchall()
        return {int(vid): str(owner) for vid, owner in rows}

    def lease_live(self, volume_id: int, epoch: int) -> bool:
        with self._owner_lock:
            held = self._held.get(volume_id)
            if held is not None:
                return held.epoch == epoch
            fd = self._probe_fd()
            if fd < 0 or not range_locked(fd, 1 + volume_id, 1):
                return False
        row = self._owner_row(volume_id)
        return row is not None and row[1] == epoch and bool(row[0])

    def _probe_fd(self) -> int:
        """The leases file for testing locks (under _owner_lock): a read-only opening
        (pool check) may test them too, on the file opened for reading; -1 if none."""
        if not self._readonly:
            return self._fd()
        if self._leases_fd < 0 and self._leases_path is not None and not self._closed:
            with contextlib.suppress(FileNotFoundError):
                self._leases_fd = os.open(self._leases_path, os.O_RDONLY | os.O_CLOEXEC)
        return self._leases_fd

    @contextlib.contextmanager
    def pool_lock(self) -> Iterator[None]:
        with self._pool_lock:
            with self._owner_lock:
                fd = self._fd()
            if self._pool_depth == 0:
                lock_range(fd, 0, 1, wait=True)
            self._pool_depth += 1
            try:
                yield
            finally:
                self._pool_depth -= 1
                if self._pool_depth == 0:
                    unlock_range(fd, 0, 1)

    @_conn_reads
    def grants(self) -> list[Grant]:
        if not _has_table(self.conn, "grants"):
            return []
        return [Grant(*row) for row in self.conn.execute("SELECT volume_id, epoch, start, count FROM grants")]

    @_conn_reads
    def orphans(self) -> list[int]:
        return [pid for (pid,) in self.conn.execute("SELECT id FROM page_refs WHERE refcount = 0 ORDER BY id")]

    @_conn_reads
    def integrity_problems(self) -> list[str]:
        rows = self.conn.execute("PRAGMA integrity_check").fetchall()
        problems = [] if rows == [("ok",)] else [f"sqlite integrity: {row[0]}" for row in rows[:20]]
        for query, what in (
            ("SELECT id FROM pages WHERE id NOT IN (SELECT id FROM page_refs)", "mapping page {} has no refcount"),
            (
                "SELECT id FROM page_refs WHERE id NOT IN (SELECT id FROM pages)",
                "refcount of a missing mapping page {}",
            ),
        ):
            problems += [what.format(pid) for (pid,) in self.conn.execute(query + " ORDER BY id LIMIT 20")]
        return problems

    @staticmethod
    def copy_database(path: str, dest: str) -> None:
        """A consistent copy of the database at path (repair keeps one)."""
        touch_private(dest)
        try:
            with contextlib.closing(sqlite3.connect(path)) as src, contextlib.closing(sqlite3.connect(dest)) as dst:
                src.backup(dst)
        except sqlite3.Error as exc:
            for name in (dest, dest + "-journal"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
            raise ThinblockError(f"cannot copy the metadata database {path} to {dest}: {exc}") from None

    @staticmethod
    def fold_wal(path: str) -> bool:
        """Fold the WAL of the (closed) database at path into it; False when it cannot be
        read (a damaged database: its WAL then stays beside it)."""
        if not os.path.exists(path + "-wal"):
            return True
        try:
            with contextlib.closing(sqlite3.connect(path)) as conn:
                busy, _log, _done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                return not busy
        except sqlite3.Error:
            return False

    def checkpoint(self) -> None:
        """Fold the WAL into the database file (before it is renamed or copied)."""
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        with self._owner_lock:
            self._closed = True
            if self._leases_fd >= 0:
                os.close(self._leases_fd)  # every lease this store held ends here
                self._leases_fd = -1
            self._held.clear()
        with self._reader_lock:
            if self._reader is not None and self._reader is not self.conn:
                self._reader.close()
            self._reader = None
        self.conn.close()


def volume_tuple(v: VolumeRow) -> tuple[object, ...]:
    return (
        v.id,
        v.name,
        v.size_bytes,
        v.detect_zeroes,
        v.created,
        v.data_blocks,
        v.zeroed_blocks,
        v.pinned_blocks,
        v.kind,
        v.origin_id,
        v.reserve_bytes,
        v.low_water,
        v.on_low_water,
        v.exclusive_blocks,
        v.exclusive_epoch,
    )


def _committed_name(c: sqlite3.Connection, vid: int) -> str | None:
    row = c.execute("SELECT name FROM volumes WHERE id = ?", (vid,)).fetchone()
    return None if row is None else str(row[0])


def _stored_owner(c: sqlite3.Connection, volume_id: int) -> tuple[str, int] | None:
    row = c.execute("SELECT owner, epoch FROM volume_owners WHERE volume_id = ?", (volume_id,)).fetchone()
    return None if row is None or not row[0] else (str(row[0]), int(row[1]))


def _stored_refcount(c: sqlite3.Connection, page_id: int) -> int | None:
    row = c.execute("SELECT refcount FROM page_refs WHERE id = ?", (page_id,)).fetchone()
    return None if row is None else int(row[0])


def _stored_link(c: sqlite3.Connection, volume_id: int) -> owners.Link | None:
    row = c.execute("SELECT kind, origin_id FROM volumes WHERE id = ?", (volume_id,)).fetchone()
    return None if row is None else (str(row[0]), None if row[1] is None else int(row[1]))


def _apply_shared(
    c: sqlite3.Connection, txn: Transaction, result: CommitResult, holder: Callable[[int], tuple[str, int] | None]
) -> Transaction:
    """txn with every count that has a base turned into the value to store (stored +
    new - base, meta/owners.py), after the lease check and the check of what it may
    change (holder: a volume's live lease); result gets those values."""
    owners.check_leases(txn.leases, lambda vid: _stored_owner(c, vid))
    owners.check_volume_writes(txn, lambda vid: _stored_link(c, vid), holder)
    c.executemany("UPDATE volume_owners SET owner = '' WHERE volume_id = ? AND epoch = ?", txn.fenced)
    superblock = dict(txn.superblock)
    if txn.counter_bases:
        stored = {k: json.loads(v) for k, v in c.execute("SELECT key, value FROM superblock")}
        for key, base in txn.counter_bases.items():
            if key in superblock:
                superblock[key] = owners.counter(key, stored.get(key), superblock[key], base)
                result.counters[key] = int(superblock[key])  # type: ignore[call-overload]
    pages = dict(txn.pages)
    page_refcounts = dict(txn.page_refcounts)
    for pid, base in txn.page_ref_bases.items():
        stored_count = _stored_refcount(c, pid)
        if pid in pages:
            page = pages[pid]
            count = owners.page_count(pid, stored_count, 0 if page is None else page[0], base, deleting=page is None)
            if page is not None:
                pages[pid] = (count, page[1])
                result.page_refcounts[pid] = count
        elif pid in page_refcounts:
            count = owners.page_count(pid, stored_count, page_refcounts[pid], base, deleting=False)
            page_refcounts[pid] = result.page_refcounts[pid] = count
    result.orphans = sorted(pid for pid, count in result.page_refcounts.items() if count == 0)
    refcount_pages = dict(txn.refcount_pages)
    held_grants = (
        [Grant(*row) for row in c.execute("SELECT volume_id, epoch, start, count FROM grants")]
        if txn.refcount_bases and _has_table(c, "grants")
        else []
    )
    used_change = 0
    for index, base_blob in txn.refcount_bases.items():
        if index in refcount_pages:
            row = c.execute("SELECT counts FROM refcount_pages WHERE idx = ?", (index,)).fetchone()
            refcount_pages[index] = owners.refcount_page(
                index,
                None if row is None else row[0],
                bytes(refcount_pages[index]),
                base_blob,
                owners.granted_mask(txn, held_grants, index),
            )
            used_change += owners.nonzero_change(None if row is None else row[0], refcount_pages[index])
            result.refcount_pages[index] = refcount_pages[index]
    if txn.refcount_bases:
        used = c.execute("SELECT value FROM superblock WHERE key = ?", (owners.USED,)).fetchone()
        superblock[owners.USED] = owners.used_after(None if used is None else json.loads(used[0]), used_change)
        result.counters[owners.USED] = int(superblock[owners.USED])  # type: ignore[call-overload]
    if txn.grants or txn.returned_grants:
        held = [Grant(*row) for row in c.execute("SELECT volume_id, epoch, start, count FROM grants")]
        sb = {k: json.loads(v) for k, v in c.execute("SELECT key, value FROM superblock")}
        n_blocks = int(superblock.get("size_bytes", sb["size_bytes"])) // int(sb["block_size"])  # type: ignore[call-overload]

        def refcount_of(start: int, count: int) -> Any:
            wanted = owners.refcount_pages_for(start, count)
            have = {i: refcount_pages[i] for i in wanted if i in refcount_pages}
            for i in wanted:
                if i not in have:
                    row = c.execute("SELECT counts FROM refcount_pages WHERE idx = ?", (i,)).fetchone()
                    if row is not None:
                        have[i] = row[0]
            return owners.refcounts_in(have, start, count)

        owners.check_grants(txn, held, n_blocks, refcount_of)
        c.executemany(
            "DELETE FROM grants WHERE volume_id = ? AND epoch = ? AND start = ? AND count = ?",
            [(g.volume_id, g.epoch, g.start, g.count) for g in txn.returned_grants],
        )
        c.executemany(
            "INSERT INTO grants VALUES (?, ?, ?, ?)", [(g.volume_id, g.epoch, g.start, g.count) for g in txn.grants]
        )
    return owners.absolute(txn, superblock, pages, refcount_pages, page_refcounts)


def _apply(c: sqlite3.Connection, txn: Transaction, holder: Callable[[int], tuple[str, int] | None]) -> CommitResult:
    result = CommitResult()
    if txn.shared():
        txn = _apply_shared(c, txn, result, holder)
    if txn.superblock:
        c.executemany(
            "INSERT OR REPLACE INTO superblock VALUES (?, ?)",
            [(k, json.dumps(v)) for k, v in txn.superblock.items()],
        )
    for vid in txn.deleted_volumes:
        c.execute("DELETE FROM volumes WHERE id = ?", (vid,))
        c.execute("DELETE FROM roots WHERE volume_id = ?", (vid,))
    # Renames first step aside: SQLite checks UNIQUE(name) row by row, so renames that
    # swap names within this transaction (a to t, b to a, t to b) would fail it, and
    # every later commit with it. A renamed row takes a name no volume can have ('/'
    # and its id) until the upsert below; only the names after the commit must differ.
    renamed = [v.id for v in txn.volumes if v.name != _committed_name(c, v.id)]
    c.executemany("UPDATE volumes SET name = '/' || id WHERE id = ?", [(vid,) for vid in renamed])
    # An upsert on the id, not INSERT OR REPLACE: a row that would take another's name
    # must fail the commit, not silently delete that other volume.
    updates = ", ".join(f"{col.strip()} = excluded.{col.strip()}" for col in _VOLUME_COLUMNS.split(",")[1:])
    c.executemany(
        f"INSERT INTO volumes ({_VOLUME_COLUMNS}) VALUES ({', '.join('?' * len(_VOLUME_COLUMNS.split(',')))})"
        f" ON CONFLICT(id) DO UPDATE SET {updates}",
        [volume_tuple(v) for v in txn.volumes],
    )
    c.executemany(
        "DELETE FROM roots WHERE volume_id = ? AND page_index = ?",
        [key for key, page_id in txn.roots.items() if page_id is None],
    )
    c.executemany(
        "INSERT OR REPLACE INTO roots VALUES (?, ?, ?)",
        [(*key, page_id) for key, page_id in txn.roots.items() if page_id is not None],
    )
    deleted = [(pid,) for pid, page in txn.pages.items() if page is None]
    c.executemany("DELETE FROM pages WHERE id = ?", deleted)
    c.executemany("DELETE FROM page_refs WHERE id = ?", deleted)
    c.executemany(
        "INSERT OR REPLACE INTO pages VALUES (?, ?, ?)",
        [(pid, *page) for pid, page in txn.pages.items() if page is not None],
    )
    c.executemany(
        "INSERT OR REPLACE INTO page_refs VALUES (?, ?)",
        [(pid, page[0]) for pid, page in txn.pages.items() if page is not None],
    )
    # Count-only changes (a snapshot's shares) touch page_refs alone, never the entries' rows.
    c.executemany("UPDATE page_refs SET refcount = ? WHERE id = ?", [(n, pid) for pid, n in txn.page_refcounts.items()])
    c.executemany("INSERT OR REPLACE INTO refcount_pages VALUES (?, ?)", txn.refcount_pages.items())
    return result
