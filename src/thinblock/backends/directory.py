"""The embedded default: a pool directory with a sparse data file (or a raw
device it names) and SQLite metadata, owned through a flock on POOL/lock.

This module is the only one that knows the pool directory's file names; the
SQLite specifics stay in meta/sqlite.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import sys
from typing import Any

from thinblock.backends.base import Location, Ownership
from thinblock.errors import PoolBusyError, ThinblockError
from thinblock.meta.base import Transaction
from thinblock.meta.sqlite import DB_NAME, SqliteMetadata
from thinblock.store.base import DataStore
from thinblock.store.fallback import FallbackStore
from thinblock.store.file import FileStore
from thinblock.store.hostspace import SLACK_FILE, HostSpace, beyond_file_limit, default_slack_bytes

DATA_FILE = "data"
LOCK_FILE = "lock"


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
        self.path = path
        self.db = os.path.join(path, DB_NAME)
        self._made_dir = False

    def key(self) -> str:
        return os.path.realpath(self.path)

    def runtime_dir(self) -> str:
        return self.path

    def exists(self) -> bool:
        return os.path.exists(self.db)

    def create(self, superblock: dict[str, Any], size_bytes: int, device: str | None) -> None:
        if self.exists():
            raise ThinblockError(f"a pool already exists at {self.path}")
        made_dir = self._made_dir = not os.path.exists(self.path)
        made: list[str] = []
        try:
            os.makedirs(self.path, exist_ok=True)
            if device is None:
                data_file = os.path.join(self.path, DATA_FILE)
                with open(data_file, "xb") as f:
                    made.append(data_file)
                    try:
                        f.truncate(size_bytes)
                    except OSError as exc:
                        if exc.errno == errno.EFBIG:
                            raise beyond_file_limit(size_bytes, self.path) from None
                        raise
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
            os.unlink(os.path.join(self.path, DATA_FILE))

    def destroy(self, whole: bool, files: list[str]) -> None:
        """Remove what a create made (all or nothing)."""
        if whole:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for name in [*files, os.path.join(self.path, SLACK_FILE), os.path.join(self.path, LOCK_FILE)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)

    def open_meta(self, *, readonly: bool) -> SqliteMetadata:
        if not os.path.isdir(self.path):
            raise ThinblockError(f"no pool at {self.path}: not a directory")
        if not os.path.exists(self.db):
            raise ThinblockError(f"no pool at {self.path}: {DB_NAME} is missing")
        return SqliteMetadata.open(self.db, readonly=readonly)

    def data_name(self, superblock: dict[str, Any]) -> str:
        return str(superblock.get("data_path") or os.path.join(self.path, DATA_FILE))

    def open_data(self, superblock: dict[str, Any], *, readonly: bool = False) -> DataStore:
        return FileStore(self.data_name(superblock), readonly=readonly)

    def _lock_fd(self) -> int:
        try:
            return os.open(os.path.join(self.path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ThinblockError(f"cannot open pool {self.path} for writing: {exc.strerror}") from None

    def own(self, purpose: str, *, takeover: bool = False) -> Ownership:
        if not os.path.isdir(self.path):
            raise ThinblockError(f"no pool at {self.path}: not a directory")
        fd = self._lock_fd()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            hint = ": --takeover is for pools in Ceph; stop that process instead" if takeover else ""
            raise PoolBusyError(
                f"pool {self.path} is already held by another thinblock process (pid {holder}){hint}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {purpose or ' '.join(sys.argv[:2])}".strip().encode() + b"\n", 0)
        return _Flock(fd)

    def is_owned(self) -> bool:
        try:
            fd = os.open(os.path.join(self.path, LOCK_FILE), os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing releases the probe's lock
        return False

    def host(self, superblock: dict[str, Any]) -> HostSpace:
        return HostSpace(
            self.path,
            int(superblock.get("metadata_slack_bytes") or default_slack_bytes(int(superblock["size_bytes"]))),
            data_on_device=bool(superblock.get("data_path")),
        )

    def replace_meta(self, superblock: dict[str, Any], txn: Transaction) -> None:
        """Build the new database beside the old one, then rename it over it."""
        tmp = self.db + ".restore"
        for leftover in (tmp, tmp + "-wal", tmp + "-shm"):
            if os.path.exists(leftover):
                os.unlink(leftover)
        meta = SqliteMetadata.create(tmp, superblock)
        try:
            meta.commit(txn)
            meta.checkpoint()
        finally:
            meta.close()
        for suffix in ("-wal", "-shm"):
            if os.path.exists(self.db + suffix):
                os.unlink(self.db + suffix)
        os.replace(tmp, self.db)
        dirfd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)

    def keep_copy(self) -> str:
        backup = self.db + ".bad"
        SqliteMetadata.copy_database(self.db, backup)
        return backup
