"""A data store on a sparse regular file (the default) or a raw block device.

It declares what the kernel does for it: on a regular file the optional verbs
are probed once at open, past the end of the file where nothing is stored; on a
block device punch and zero-range are NATIVE (the block layer emulates them for
devices that lack them). A verb the kernel refuses later is declared NONE from
then on and raises NotSupportedError, for FallbackStore to emulate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat
from collections.abc import Sequence

from thinblock.errors import NotSupportedError, ThinblockError
from thinblock.iovec import write_all
from thinblock.store.base import OPTIONAL_VERBS, DataStore, Support

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_libc.sync_file_range.restype = ctypes.c_int
_SYNC_FILE_RANGE_WRITE = 2


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) with any mode (os.posix_fallocate only knows mode 0 and emulates)."""
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


_REFUSED = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENODEV)
_MODES = {
    "punch": FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
    "zero": FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE,
    "preallocate": FALLOC_FL_KEEP_SIZE,
}


class FileStore(DataStore):
    """A sparse regular file (the default) or a raw block device."""

    def __init__(self, path: str, *, readonly: bool = False, follow: bool = True) -> None:
        """follow=False: a symlink at path is refused (a pool's own data file)."""
        self.path = path
        try:
            flags = (os.O_RDONLY if readonly else os.O_RDWR) | (0 if follow else os.O_NOFOLLOW)
            self._fd = os.open(path, flags)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ThinblockError(f"cannot open data store {path}: it is a symlink, refused") from exc
            raise ThinblockError(f"cannot open data store {path}: {exc.strerror}") from exc
        self.is_block_device = stat.S_ISBLK(os.fstat(self._fd).st_mode)
        if self.is_block_device:
            # A block device's space is its own: preallocate has nothing to do there.
            self._caps = {verb: Support.NATIVE for verb in OPTIONAL_VERBS}
        elif readonly:
            self._caps = {verb: Support.NONE for verb in OPTIONAL_VERBS}
        else:
            self._caps = {verb: self._probe(verb) for verb in OPTIONAL_VERBS}

    def _probe(self, verb: str) -> Support:
        """Ask the filesystem once, past the end of the file (KEEP_SIZE: nothing
        visible changes). A punch there frees nothing (ext4 stops at the end of the
        file), so what the probe allocated is dropped by truncating to the same size."""
        end = self.size_bytes
        try:
            fallocate(self._fd, _MODES[verb], end, 4096)
        except OSError as exc:
            if exc.errno in _REFUSED:
                return Support.NONE
            raise ThinblockError(f"cannot use data store {self.path}: {exc.strerror}") from exc
        if verb != "punch":
            os.ftruncate(self._fd, end)
        return Support.NATIVE

    @property
    def size_bytes(self) -> int:
        return os.lseek(self._fd, 0, os.SEEK_END)

    def pread(self, offset: int, length: int) -> bytes:
        data = os.pread(self._fd, length, offset)
        while len(data) < length:  # short reads happen on signals and at EOF of a growing file
            more = os.pread(self._fd, length - len(data), offset + len(data))
            if not more:
                data += bytes(length - len(data))
                break
            data += more
        return data

    def pwritev(self, offset: int, buffers: Sequence[bytes | memoryview]) -> None:
        position = offset

        def write(views: list[memoryview]) -> int:
            nonlocal position
            written = os.pwritev(self._fd, views, position)
            position += written
            return written

        write_all(write, buffers)

    def _fallocate(self, verb: str, offset: int, length: int) -> None:
        if self._caps[verb] is not Support.NATIVE:
            raise NotSupportedError(f"{verb} is not native on {self.path}")
        if verb == "preallocate" and self.is_block_device:
            return
        try:
            fallocate(self._fd, _MODES[verb], offset, length)
        except OSError as exc:
            if exc.errno in _REFUSED:
                self._caps[verb] = Support.NONE
                raise NotSupportedError(f"{verb} is not native on {self.path}") from exc
            raise

    def punch(self, offset: int, length: int) -> None:
        self._fallocate("punch", offset, length)

    def zero(self, offset: int, length: int) -> None:
        self._fallocate("zero", offset, length)

    def preallocate(self, offset: int, length: int) -> None:
        self._fallocate("preallocate", offset, length)

    def flush(self) -> None:
        os.fdatasync(self._fd)

    def start_writeback(self) -> None:
        # sync_file_range(SYNC_FILE_RANGE_WRITE) over the whole file: dirty pages start
        # going to disk now; nothing waits (and nothing is promised durable by it).
        _libc.sync_file_range(self._fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a hint: its failure changes nothing

    def grow(self, new_size_bytes: int) -> None:
        if new_size_bytes <= self.size_bytes:
            return
        if self.is_block_device:
            raise ThinblockError(
                f"data device {self.path} holds {self.size_bytes} bytes; it cannot grow to {new_size_bytes}"
            )
        os.ftruncate(self._fd, new_size_bytes)

    def capabilities(self) -> dict[str, Support]:
        return dict(self._caps)

    def disable_native(self, *verbs: str) -> None:
        """Declare the named verbs NONE (a filesystem without them, for tests)."""
        for verb in verbs:
            self._caps[verb] = Support.NONE

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
