"""Fast all-zero tests without copying (bytes.startswith is a memcmp)."""

from __future__ import annotations

ZERO_CHUNK_BYTES = 1 << 20
_ZEROS = bytes(ZERO_CHUNK_BYTES)


def is_zero(buf: bytes | bytearray | memoryview) -> bool:
    """True when every byte of buf is zero."""
    view = memoryview(buf).cast("B")
    for start in range(0, len(view), ZERO_CHUNK_BYTES):
        if not _ZEROS.startswith(view[start : start + ZERO_CHUNK_BYTES]):
            return False
    return True


def zero_bytes(n_bytes: int) -> bytes:
    """A zero buffer of n_bytes (shared for the common small sizes)."""
    if n_bytes <= ZERO_CHUNK_BYTES:
        return _ZEROS[:n_bytes] if n_bytes < ZERO_CHUNK_BYTES else _ZEROS
    return bytes(n_bytes)
