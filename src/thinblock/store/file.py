"""Where block bytes live, behind one small contract (borgstore / nbdkit style).

A data store is a flat byte space addressed by offset. It is *asked* what it
can do natively; `FallbackStore` is the single place where a missing native
operation is emulated (punch -> zero-range -> written zeros; allocate ->
written zeros), so no caller ever silently skips one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import errno
import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Sequence

from thinblock.errors import NotSupportedError, ThinblockError
from thinblock.iovec import write_all
from thinblock.zeros import ZERO_CHUNK_BYTES, zero_bytes

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) with any mode (os.posix_fallocate only knows mode 0 and emulates)."""
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class Support(enum.Enum):
    """How a store does an operation: natively, emulated by FallbackStore, or unknown yet."""

    NATIVE = "native"
    EMULATE = "emulate"
    UNKNOWN = "unknown"


class DataStore(ABC):
    """The contract every data store keeps.

    Offsets and lengths are bytes; callers only ever pass ranges inside
    `size_bytes`. A method that the store cannot do natively raises
    NotSupportedError and changes nothing.
    """

    @property
    @abstractmethod
    def size_bytes(self) -> int:
        """Current size of the byte space."""

    @abstractmethod
    def pread(self, offset: int, length: int) -> bytes:
        """Exactly `length` bytes at `offset`."""

    @abstractmethod
    def pwritev(self, offset: int, buffers: Sequence[bytes | memoryview]) -> None:
        """Write the buffers back to back from `offset`, all of them."""

    @abstractmethod
    def punch(self, offset: int, length: int) -> None:
        """Give the range's space back to the layer below; it then reads zeros."""

    @abstractmethod
    def zero(self, offset: int, length: int) -> None:
        """Make the range read zeros and keep its space allocated."""

    @abstractmethod
    def allocate(self, offset: int, length: int) -> None:
        """Reserve real space for the range; its contents are unspecified."""

    @abstractmethod
    def flush(self) -> None:
        """Make every completed write durable."""

    @abstractmethod
    def grow(self, new_size_bytes: int) -> None:
        """Make the byte space at least new_size_bytes, or raise ThinblockError."""

    @abstractmethod
    def support(self) -> dict[str, Support]:
        """What is native: keys `punch`, `zero`, `allocate`."""

    @abstractmethod
    def close(self) -> None:
        """Release the store's resources."""


class FileStore(DataStore):
    """A sparse regular file (the default) or a raw block device."""

    def __init__(self, path: str, *, readonly: bool = False) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY if readonly else os.O_RDWR)
        except OSError as exc:
            raise ThinblockError(f"cannot open data store {path}: {exc.strerror}") from exc
        self.is_block_device = stat.S_ISBLK(os.fstat(self._fd).st_mode)
        self._support = {name: Support.UNKNOWN for name in ("punch", "zero", "allocate")}

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

    def _fallocate(self, name: str, mode: int, offset: int, length: int) -> None:
        if self._support[name] is Support.EMULATE:
            raise NotSupportedError(f"{name} is not native on {self.path}")
        try:
            fallocate(self._fd, mode, offset, length)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENODEV):
                self._support[name] = Support.EMULATE
                raise NotSupportedError(f"{name} is not native on {self.path}") from exc
            raise
        self._support[name] = Support.NATIVE

    def punch(self, offset: int, length: int) -> None:
        self._fallocate("punch", FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)

    def zero(self, offset: int, length: int) -> None:
        self._fallocate("zero", FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, offset, length)

    def allocate(self, offset: int, length: int) -> None:
        if self.is_block_device:
            # A block device's space is its own: mode-0 fallocate is meaningless there.
            self._support["allocate"] = Support.NATIVE
            return
        self._fallocate("allocate", FALLOC_FL_KEEP_SIZE, offset, length)

    def flush(self) -> None:
        os.fdatasync(self._fd)

    def grow(self, new_size_bytes: int) -> None:
        if new_size_bytes <= self.size_bytes:
            return
        if self.is_block_device:
            raise ThinblockError(
                f"data device {self.path} holds {self.size_bytes} bytes; it cannot grow to {new_size_bytes}"
            )
        os.ftruncate(self._fd, new_size_bytes)

    def support(self) -> dict[str, Support]:
        return dict(self._support)

    def disable_native(self, *names: str) -> None:
        """Pretend the named operations are not native (for tests of the emulation path)."""
        for name in names:
            self._support[name] = Support.EMULATE

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class FilterStore(DataStore):
    """A layer over another store that passes every verb to it (nbdkit's filter
    holding `next`): subclasses override only what they change."""

    def __init__(self, inner: DataStore) -> None:
        self.inner = inner

    @property
    def size_bytes(self) -> int:
        return self.inner.size_bytes

    def pread(self, offset: int, length: int) -> bytes:
        return self.inner.pread(offset, length)

    def pwritev(self, offset: int, buffers: Sequence[bytes | memoryview]) -> None:
        self.inner.pwritev(offset, buffers)

    def punch(self, offset: int, length: int) -> None:
        self.inner.punch(offset, length)

    def zero(self, offset: int, length: int) -> None:
        self.inner.zero(offset, length)

    def allocate(self, offset: int, length: int) -> None:
        self.inner.allocate(offset, length)

    def flush(self) -> None:
        self.inner.flush()

    def grow(self, new_size_bytes: int) -> None:
        self.inner.grow(new_size_bytes)

    def support(self) -> dict[str, Support]:
        return self.inner.support()

    def close(self) -> None:
        self.inner.close()


class FallbackStore(FilterStore):
    """A filter over another store that emulates what it lacks (the one place this happens)."""

    def _write_zeros(self, offset: int, length: int) -> None:
        end = offset + length
        while offset < end:
            n = min(ZERO_CHUNK_BYTES, end - offset)
            self.inner.pwritev(offset, [zero_bytes(n)])
            offset += n

    def punch(self, offset: int, length: int) -> None:
        try:
            self.inner.punch(offset, length)
        except NotSupportedError:
            self.zero(offset, length)

    def zero(self, offset: int, length: int) -> None:
        try:
            self.inner.zero(offset, length)
        except NotSupportedError:
            self._write_zeros(offset, length)

    def allocate(self, offset: int, length: int) -> None:
        try:
            self.inner.allocate(offset, length)
        except NotSupportedError:
            # Callers allocate only space whose contents do not matter yet.
            self._write_zeros(offset, length)
