"""A power-cut filesystem for tests, in the spirit of LazyFS: a FUSE passthrough
(mfusepy) that keeps every write, truncate and fallocate of a file in memory
until that file is fsync'ed or fdatasync'ed. Killing this process is the power
cut: whatever was not synced is gone, and the backing directory holds exactly
what a disk that honours flushes would.

    python tests/powercut_fs.py BACKING_DIR MOUNTPOINT

Killing it drops every unsynced change (LazyFS's model). Writing "reorder SEED"
to the file `.powercut` at the mount's root cuts the power like a disk that
reorders: a random subset of each file's unsynced changes (SEED picks it)
reaches the backing files, the rest is lost, and the process exits. Writing
"eio" makes every later write, truncate, fallocate and fsync fail with EIO (a
failing disk), "eio-sync" only every fsync, until "ok" is written. Software
that only relies on fsync as a barrier, as SQLite and thinblock must, survives
both.

Directory operations (create, mkdir, rename, unlink, mknod) are applied to the
backing directory at once, as a journaling filesystem makes them durable
quickly; only file contents are lazy, which is where thinblock's ordering
rules live. Reads see the pending changes, as the page cache would.
"""

from __future__ import annotations

import errno
import os
import random
import stat
import sys
import threading
from typing import Any

os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")

import mfusepy

from thinblock.store.file import fallocate

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

CUT_FILE = "/.powercut"
Op = tuple[Any, ...]  # ("write", offset, data) | ("truncate", size) | ("fallocate", mode, offset, length)


class _File:
    """A file's unsynced changes, in order, over its backing file."""

    def __init__(self, size: int) -> None:
        self.ops: list[Op] = []
        self.size = size  # as the pending changes leave it

    def overlay(self, buf: bytearray, offset: int) -> None:
        """Apply the pending changes to buf, which holds the backing bytes at offset."""
        end = offset + len(buf)
        for op in self.ops:
            if op[0] == "write":
                _, off, data = op
                lo, hi = max(off, offset), min(off + len(data), end)
                if lo < hi:
                    buf[lo - offset : hi - offset] = data[lo - off : hi - off]
            elif op[0] == "truncate":
                lo = max(op[1], offset)
                if lo < end:
                    buf[lo - offset :] = bytes(end - lo)
            elif op[1] & (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_ZERO_RANGE):
                _, _, off, length = op
                lo, hi = max(off, offset), min(off + length, end)
                if lo < hi:
                    buf[lo - offset : hi - offset] = bytes(hi - lo)


class PowerCutFS(mfusepy.Operations):  # type: ignore[misc]
    use_ns = True

    def __init__(self, backing: str) -> None:
        self.backing = backing
        self.files: dict[str, _File] = {}
        self._mutex = threading.Lock()
        # "eio" written to CUT_FILE: every change fails with EIO; "eio-sync": only
        # fsync does; "ok" ends it.
        self.failing = ""

    def _fail(self, path: str, *, sync: bool = False) -> None:
        if path != CUT_FILE and (self.failing == "eio" or (self.failing == "eio-sync" and sync)):
            raise mfusepy.FuseOSError(errno.EIO)

    def _path(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _file(self, path: str) -> _File:
        state = self.files.get(path)
        if state is None:
            state = self.files[path] = _File(os.path.getsize(self._path(path)))
        return state

    def _apply(self, path: str, ops: list[Op]) -> None:
        fd = self._os(os.open, self._path(path), os.O_WRONLY)
        try:
            for op in ops:
                if op[0] == "write":
                    os.pwrite(fd, op[2], op[1])
                elif op[0] == "truncate":
                    os.ftruncate(fd, op[1])
                else:
                    fallocate(fd, op[1], op[2], op[3])
            os.fsync(fd)
        finally:
            os.close(fd)

    def _cut_reordering(self, seed: int) -> None:
        """The power goes on a disk that reorders: some unsynced changes landed."""
        rng = random.Random(seed)
        with self._mutex:
            for path, state in self.files.items():
                kept = [op for op in state.ops if rng.random() < 0.5]
                if kept:
                    self._apply(path, kept)
            os._exit(0)

    def _os(self, func: Any, *args: Any) -> Any:
        try:
            return func(*args)
        except OSError as exc:
            raise mfusepy.FuseOSError(exc.errno or errno.EIO) from None

    # ----- names: applied at once ---------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        if path == CUT_FILE:
            return {"st_mode": stat.S_IFREG | 0o200, "st_nlink": 1, "st_size": 0}
        st = self._os(os.lstat, self._path(path))
        attrs = {key: getattr(st, key) for key in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks")}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        with self._mutex:
            if path in self.files:
                attrs["st_size"] = self.files[path].size
        return attrs

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *self._os(os.listdir, self._path(path))]

    def mkdir(self, path: str, mode: int) -> int:
        self._os(os.mkdir, self._path(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        self._os(os.rmdir, self._path(path))
        return 0

    def mknod(self, path: str, mode: int, dev: int) -> int:
        self._os(os.mknod, self._path(path), mode, dev)
        return 0

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        fd = self._os(os.open, self._path(path), os.O_CREAT | os.O_WRONLY, mode)
        os.close(fd)
        return 0

    def open(self, path: str, flags: int) -> int:
        if flags & os.O_TRUNC and path != CUT_FILE:
            self.truncate(path, 0)
        return 0

    def unlink(self, path: str) -> int:
        with self._mutex:
            self._os(os.unlink, self._path(path))
            self.files.pop(path, None)
        return 0

    def rename(self, old: str, new: str) -> int:
        with self._mutex:
            self._os(os.rename, self._path(old), self._path(new))
            self.files.pop(new, None)
            if old in self.files:
                self.files[new] = self.files.pop(old)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        self._os(os.chmod, self._path(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        self._os(os.chown, self._path(path), uid, gid)
        return 0

    def utimens(self, path: str, times: Any = None) -> int:
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._path(path))
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_namemax")
        return {key: getattr(st, key) for key in keys}

    # ----- contents: kept until synced ------------------------------------------

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        with self._mutex:
            state = self._file(path)
            length = max(0, min(size, state.size - offset))
            with open(self._path(path), "rb") as f:
                f.seek(offset)
                buf = bytearray(f.read(length).ljust(length, b"\0"))
            state.overlay(buf, offset)
            return bytes(buf)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        if path == CUT_FILE:
            mode, _, seed = bytes(data).decode().partition(" ")
            if mode.strip() in ("eio", "eio-sync", "ok"):
                self.failing = "" if mode.strip() == "ok" else mode.strip()
                return len(data)
            if mode.strip() != "reorder":
                raise mfusepy.FuseOSError(errno.EINVAL)
            self._cut_reordering(int(seed))
        self._fail(path)
        with self._mutex:
            state = self._file(path)
            state.ops.append(("write", offset, bytes(data)))
            state.size = max(state.size, offset + len(data))
        return len(data)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        self._fail(path)
        with self._mutex:
            state = self._file(path)
            state.ops.append(("truncate", length))
            state.size = length
        return 0

    def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
        self._fail(path)
        with self._mutex:
            state = self._file(path)
            state.ops.append(("fallocate", mode, offset, size))
            if not mode & FALLOC_FL_KEEP_SIZE:
                state.size = max(state.size, offset + size)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        self._fail(path, sync=True)
        with self._mutex:
            state = self.files.pop(path, None)
            if state is not None:
                self._apply(path, state.ops)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0  # close() is not a sync

    def release(self, path: str, fh: int) -> int:
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        return 0


def main() -> None:
    backing, mountpoint = sys.argv[1], sys.argv[2]
    mfusepy.FUSE(PowerCutFS(os.path.abspath(backing)), mountpoint, foreground=True, fsname="powercut")


if __name__ == "__main__":
    main()
