"""A data store in memory, for tests: sparse chunks, with the optional verbs it
does natively chosen by the caller (so the fallback path runs against it too)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from thinblock.errors import NotSupportedError, ThinblockError
from thinblock.store.base import OPTIONAL_VERBS, DataStore, Support

CHUNK_BYTES = 64 << 10


class MemoryStore(DataStore):
    """Bytes in a dict of CHUNK_BYTES chunks; absent chunks read zero. `native`
    names the optional verbs it does itself (the rest are NONE). Data survives
    close() while the object lives, so a pool can be reopened on it."""

    def __init__(self, size_bytes: int, *, native: Iterable[str] = OPTIONAL_VERBS) -> None:
        self._size = size_bytes
        self._chunks: dict[int, bytearray] = {}
        self._lock = threading.Lock()
        native = set(native)
        self._caps = {verb: Support.NATIVE if verb in native else Support.NONE for verb in OPTIONAL_VERBS}
        self.closed = False

    @property
    def size_bytes(self) -> int:
        return self._size

    def allocated_bytes(self, below: int | None = None) -> int:
        """Bytes held (for tests: what punch gave back), or those below an offset."""
        with self._lock:
            if below is None:
                return len(self._chunks) * CHUNK_BYTES
            return sum(CHUNK_BYTES for index in self._chunks if index * CHUNK_BYTES < below)

    def _pieces(self, offset: int, length: int) -> Iterable[tuple[int, int, int]]:
        end = offset + length
        while offset < end:
            index, within = divmod(offset, CHUNK_BYTES)
            n = min(CHUNK_BYTES - within, end - offset)
            yield index, within, n
            offset += n

    def pread(self, offset: int, length: int) -> bytes:
        out = bytearray()
        with self._lock:
            for index, within, n in self._pieces(offset, length):
                chunk = self._chunks.get(index)
                out += chunk[within : within + n] if chunk is not None else bytes(n)
        return bytes(out)

    def pwritev(self, offset: int, buffers: Sequence[bytes | memoryview]) -> None:
        data = b"".join(buffers)
        if offset + len(data) > self._size:
            raise OSError(28, "write beyond the end of the memory store")
        with self._lock:
            pos = 0
            for index, within, n in self._pieces(offset, len(data)):
                chunk = self._chunks.setdefault(index, bytearray(CHUNK_BYTES))
                chunk[within : within + n] = data[pos : pos + n]
                pos += n

    def _require(self, verb: str) -> None:
        if self._caps[verb] is not Support.NATIVE:
            raise NotSupportedError(f"{verb} is not native on this memory store")

    def punch(self, offset: int, length: int) -> None:
        self._require("punch")
        with self._lock:
            for index, within, n in self._pieces(offset, length):
                if n == CHUNK_BYTES:
                    self._chunks.pop(index, None)
                elif index in self._chunks:
                    self._chunks[index][within : within + n] = bytes(n)

    def zero(self, offset: int, length: int) -> None:
        self._require("zero")
        with self._lock:
            for index, within, n in self._pieces(offset, length):
                self._chunks.setdefault(index, bytearray(CHUNK_BYTES))[within : within + n] = bytes(n)

    def preallocate(self, offset: int, length: int) -> None:
        self._require("preallocate")
        with self._lock:
            for index, _within, _n in self._pieces(offset, length):
                self._chunks.setdefault(index, bytearray(CHUNK_BYTES))

    def flush(self) -> None:
        if self.closed:
            raise ThinblockError("memory store is closed")

    def grow(self, new_size_bytes: int) -> None:
        self._size = max(self._size, new_size_bytes)

    def capabilities(self) -> dict[str, Support]:
        return dict(self._caps)

    def close(self) -> None:
        self.closed = True

    def reopen(self) -> MemoryStore:
        self.closed = False
        return self
