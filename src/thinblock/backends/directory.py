"""The embedded default: a pool directory with a sparse data file (or a raw
device it names) and SQLite metadata, owned through a lock on POOL/lock.

Every file is created private (privacy.py). The lock is an open-file-description
write lock (F_OFD_SETLK): only a process that can open POOL/lock for writing (its
owner) can take it, so no other user can hold a pool hostage with flock() on a
file it may read, and closing some other descriptor of the file never drops it.

This module is the only one that knows the pool directory's file names; the
SQLite specifics stay in meta/sqlite.py.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
from typing import Any

from thinblock.backends.base import Location, Ownership
from thinblock.errors import PoolBusyError, ThinblockError
from thinblock.meta.base import Transaction
from thinblock.meta.filelocks import lock_range, range_lock_shared, range_locked
from thinblock.meta.sqlite import DB_NAME, SqliteError, SqliteMetadata
from thinblock.privacy import create_private_file, make_private_dir
from thinblock.runtime import CONTROL_SOCKET, NBD_SOCKET
from thinblock.store.base import DataStore
from thinblock.store.fallback import FallbackStore
from thinblock.store.file import FileStore
from thinblock.store.hostspace import SLACK_FILE, HostSpace, beyond_file_limit, default_slack_bytes

DATA_FILE = "data"
LOCK_FILE = "lock"
LEASES_FILE = "leases"  # the per-volume leases and the pool-level lock (meta/sqlite.py)


def _describe_holder(record: str) -> str:
    """Who the lock file says holds the pool, checked against the running processes:
    the process that takes the lock writes its pid and purpose there."""
    pid_text, _, purpose = record.partition(" ")
    if not pid_text.isdigit():
        return "already held by another thinblock process (pid unknown)"
    pid = int(pid_text)
    if os.path.exists(f"/proc/{pid}"):
        return f"already held by another thinblock process (pid {pid}, {purpose or 'thinblock'})"
    return (
        f"locked, but not by a live thinblock process: pid {pid} ({purpose or 'thinblock'}), which its"
        " lock file names, has exited, so some other process keeps the lock file open with the lock"
        " (fuser shows which)"
    )


class _Flock(Ownership):
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class DirLocation(Location):
    def __init__(self, path: str) -> None:
        self.name = path
        self.path = path  # as the user wrote it, for messages
        # Resolved once: every file of the pool is opened below this directory, so a
        # symlink swapped in for the path later cannot redirect the pool's files.
        self.dir = os.path.realpath(path)
        self.db = os.path.join(self.dir, DB_NAME)
        self._made_dir = False

    def key(self) -> str:
        return self.dir

    def runtime_dir(self) -> str:
        return self.path

    def runtime_path(self) -> str:
        return self.path

    shorter_runtime_path = "a pool's sockets live in its directory: give the pool a shorter path"

    def exists(self) -> bool:
        return os.path.exists(self.db)

    def create(self, superblock: dict[str, Any], size_bytes: int, device: str | None) -> None:
        if self.exists():
            raise ThinblockError(f"a pool already exists at {self.path}")
        made_dir = self._made_dir = not os.path.exists(self.path)
        made: list[str] = []
        try:
            make_private_dir(self.path, tighten=True)  # an existing directory becomes the pool's: private
            if device is None:
                data_file = os.path.join(self.dir, DATA_FILE)
                fd = create_private_file(data_file)
                made.append(data_file)
                try:
                    os.ftruncate(fd, size_bytes)
                except OSError as exc:
                    if exc.errno == errno.EFBIG:
                        raise beyond_file_limit(size_bytes, self.path) from None
                    raise
                finally:
                    os.close(fd)
            else:
                # Allocatable blocks must read zero (see spacemap): clear the device once.
                store = FallbackStore(FileStore(device))
                try:
                    store.punch(0, size_bytes)
                    store.flush()
                finally:
                    store.close()
            made += [self.db + suffix for suffix in ("", "-wal", "-shm")]
            superblock = {"metadata_slack_bytes": default_slack_bytes(size_bytes), **superblock}
            SqliteMetadata.create(self.db, superblock).close()
        except BaseException as exc:
            self.destroy(made_dir, made)
            if isinstance(exc, OSError) and not isinstance(exc, ThinblockError):
                raise ThinblockError(f"cannot create pool {self.path}: {exc.strerror or exc}") from exc
            raise

    def remove_created(self) -> None:
        self.destroy(self._made_dir, [self.db + suffix for suffix in ("", "-wal", "-shm")])
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.dir, DATA_FILE))

    def destroy(self, whole: bool, files: list[str]) -> None:
        """Remove what a create made (all or nothing)."""
        if whole:
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        for name in [*files, os.path.join(self.dir, SLACK_FILE), os.path.join(self.dir, LOCK_FILE)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)

    def _require_dir(self) -> None:
        """One sentence for a pool path that is no directory: there is no pool there."""
        if os.path.isdir(self.dir):
            return
        what = "no such directory" if not os.path.lexists(self.dir) else "it is not a directory"
        raise ThinblockError(f"no pool at {self.path}: {what}")

    def open_meta(self, *, readonly: bool) -> SqliteMetadata:
        self._require_dir()
        try:
            st = os.lstat(self.db)
        except FileNotFoundError:
            raise ThinblockError(f"no pool at {self.path}: {DB_NAME} is missing") from None
        except OSError as exc:  # the directory cannot be searched: another user's pool
            raise ThinblockError(
                f"cannot read pool {self.path}: {exc.strerror} (its directory is not open to you)"
            ) from None
        if stat.S_ISLNK(st.st_mode):
            raise ThinblockError(f"pool {self.path}: {DB_NAME} is a symlink; refusing to follow it")
        read_only_fs = bool(os.statvfs(self.dir).f_flag & os.ST_RDONLY)  # SQLite's open words that case
        if not os.access(self.db, os.R_OK) or not (readonly or read_only_fs or os.access(self.db, os.W_OK)):
            how = "read" if not os.access(self.db, os.R_OK) else "write"
            raise ThinblockError(
                f"cannot {how} pool {self.path}: permission denied on {DB_NAME} (owner uid {st.st_uid},"
                f" mode {stat.S_IMODE(st.st_mode):04o})"
            )
        return SqliteMetadata.open(self.db, readonly=readonly, leases_path=os.path.join(self.dir, LEASES_FILE))

    def data_name(self, superblock: dict[str, Any]) -> str:
        return str(superblock.get("data_path") or os.path.join(self.dir, DATA_FILE))

    def open_data(self, superblock: dict[str, Any], *, readonly: bool = False) -> DataStore:
        # The pool's own file is never reached through a symlink; a --data path the
        # user named (often /dev/disk/by-id/...) may be one.
        return FileStore(self.data_name(superblock), readonly=readonly, follow=bool(superblock.get("data_path")))

    def _lock_fd(self) -> int:
        try:
            return create_private_file(os.path.join(self.dir, LOCK_FILE), exclusive=False)
        except OSError as exc:
            raise ThinblockError(f"cannot open pool {self.path} for writing: {exc.strerror}") from None

    def own(self, purpose: str, *, takeover: bool = False) -> Ownership:
        self._require_dir()
        fd = self._lock_fd()
        if not lock_range(fd):
            if range_lock_shared(fd):
                os.close(fd)
                raise PoolBusyError(
                    f"pool {self.path} is served per volume by other processes (thinblock serve --volume);"
                    " commands reach its volumes through them, or stop them first"
                )
            holder = _describe_holder(os.pread(fd, 200, 0).decode(errors="replace").strip())
            os.close(fd)
            hint = ": --takeover is for pools in Ceph; stop that process instead" if takeover else ""
            raise PoolBusyError(f"pool {self.path} is {holder}{hint}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {purpose or ' '.join(sys.argv[:2])}".strip().encode() + b"\n", 0)
        return _Flock(fd)

    def own_shared(self, purpose: str) -> Ownership:
        self._require_dir()
        fd = self._lock_fd()
        if not lock_range(fd, shared=True):
            holder = _describe_holder(os.pread(fd, 200, 0).decode(errors="replace").strip())
            os.close(fd)
            raise PoolBusyError(f"pool {self.path} is {holder}: it owns the whole pool") from None
        return _Flock(fd)

    def served_per_volume(self) -> bool:
        try:
            fd = os.open(os.path.join(self.dir, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            return range_locked(fd) and range_lock_shared(fd)
        finally:
            os.close(fd)

    def is_owned(self) -> bool:
        try:
            fd = os.open(os.path.join(self.dir, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            return range_locked(fd)
        finally:
            os.close(fd)

    def host(self, superblock: dict[str, Any]) -> HostSpace:
        return HostSpace(
            self.dir,
            int(superblock.get("metadata_slack_bytes") or default_slack_bytes(int(superblock["size_bytes"]))),
            data_on_device=bool(superblock.get("data_path")),
        )

    def replace_meta(self, superblock: dict[str, Any], txn: Transaction, *, keep: str | None = None) -> str | None:
        """Build the new database beside the old one (metadata.sqlite.restore), then
        rename it over it. keep: the old one stays as metadata.sqlite.KEEP, a hard link
        to its file (no copy, nothing to run out of space). Until the rename, any
        failure removes what was built and leaves the old database as it was."""
        tmp = self.db + ".restore"
        _remove_database(tmp)
        try:
            meta = SqliteMetadata.create(tmp, superblock)
            try:
                meta.commit(txn)
                meta.checkpoint()
            finally:
                meta.close()
            _fsync(tmp, os.O_NOFOLLOW)
            # Fold the old WAL into its database first: it is removed below, and a
            # WAL beside the new database would be replayed into it.
            SqliteMetadata.fold_wal(self.db)
            kept = self._keep_old(keep) if keep else None
        except BaseException as exc:
            _remove_database(tmp)
            if isinstance(exc, SqliteError):
                raise ThinblockError(f"cannot write the new metadata {tmp}: {exc}; nothing was changed") from None
            if isinstance(exc, ThinblockError):
                raise ThinblockError(f"{exc}; nothing was changed") from None
            raise
        for suffix in ("-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.db + suffix)
        os.replace(tmp, self.db)
        _fsync(self.dir, os.O_DIRECTORY)
        return kept

    def _keep_old(self, label: str) -> str | None:
        """Keep the current database (and its WAL when it could not be folded) as DB.label."""
        if not os.path.exists(self.db):
            return None
        dest = f"{self.db}.{label}"
        _remove_database(dest)
        os.link(self.db, dest)
        wal = self.db + "-wal"
        if os.path.exists(wal) and os.path.getsize(wal) > 0:
            os.link(wal, dest + "-wal")
        return dest

    def local_paths(self, superblock: dict[str, Any]) -> list[str]:
        names = [DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", LOCK_FILE, LEASES_FILE, SLACK_FILE]
        paths = [self.dir, self.data_name(superblock), *(os.path.join(self.dir, n) for n in names)]
        return [p for p in paths if os.path.lexists(p)]

    def _own_files(self, superblock: dict[str, Any]) -> list[str]:
        """The pool's files in its directory, in the order removal deletes them: the data
        file, then what serves it, then the metadata (and its kept copies), then the lock."""
        names = [] if superblock.get("data_path") else [DATA_FILE]
        names += [SLACK_FILE, NBD_SOCKET, CONTROL_SOCKET]
        try:
            entries = sorted(os.listdir(self.dir))
        except OSError:
            entries = []
        names += [n for n in entries if n.startswith(DB_NAME + ".")]  # restore's and repair's copies
        names += [DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm", LEASES_FILE, LOCK_FILE]
        return [os.path.join(self.dir, n) for n in names if os.path.lexists(os.path.join(self.dir, n))]

    def removal(self, superblock: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        items: list[dict[str, Any]] = []
        for path in self._own_files(superblock):
            st = os.lstat(path)
            items.append({"kind": "file", "name": path, "bytes": st.st_blocks * 512})
        others = sorted(set(os.listdir(self.dir)) - {os.path.basename(i["name"]) for i in items})
        kept = []
        device = superblock.get("data_path")
        if device:
            # The device is the user's: thinblock never took it over beyond the pool, so it
            # leaves it as it is (a new `pool create --data` clears it; blkdiscard wipes it).
            kept.append(
                f"the data device {device} is left as it is: its blocks still hold the volumes' data"
                " (wipe it with blkdiscard if that matters)"
            )
        if others:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            kept.append(f"the directory {self.path} stays: it holds other files ({shown})")
        else:
            items.append({"kind": "directory", "name": self.dir, "bytes": None})
        return items, kept

    def remove_pool(self, superblock: dict[str, Any], ownership: Ownership) -> None:
        for path in self._own_files(superblock):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        _fsync(self.dir, os.O_DIRECTORY)
        ownership.release()
        with contextlib.suppress(OSError):  # only if nothing else is in it
            os.rmdir(self.dir)

    def keep_copy(self) -> str:
        backup = self.db + ".bad"
        if os.path.lexists(backup):
            os.unlink(backup)
        SqliteMetadata.copy_database(self.db, backup)
        return backup


def _remove_database(path: str) -> None:
    for name in (path, path + "-wal", path + "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def _fsync(path: str, flags: int) -> None:
    """fsync the file or directory at path, opened read-only with flags."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
