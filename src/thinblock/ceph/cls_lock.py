"""The calls of Ceph's `lock` object class that the Python binding lacks, in
Ceph's own encoding: break a locker's lock, assert that a cookie still holds a
lock (inside a WriteOp, so that a commit lands only while its lease does), and
read who holds a lock until when.

Every op and reply is a versioned struct (`ENCODE_START(v, compat)`: two bytes
and a length), strings are a u32 length and bytes, an entity is a type byte and
a 64-bit number, a time is two u32 (seconds, nanoseconds).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

ENTITY_CLIENT = 8  # CEPH_ENTITY_TYPE_CLIENT
EXCLUSIVE = 1  # ClsLockType


def _string(value: str) -> bytes:
    raw = value.encode()
    return struct.pack("<I", len(raw)) + raw


def _versioned(body: bytes) -> bytes:
    return struct.pack("<BBI", 1, 1, len(body)) + body


def break_lock_args(name: str, instance: int, cookie: str) -> bytes:
    """cls_lock_break_op {name, locker (entity_name_t), cookie}."""
    return _versioned(_string(name) + struct.pack("<Bq", ENTITY_CLIENT, instance) + _string(cookie))


def assert_locked_args(name: str, cookie: str, tag: str = "") -> bytes:
    """cls_lock_assert_op {name, type, cookie, tag}: the op fails (EBUSY) unless a
    locker with this cookie is listed. An expired locker is still listed until
    another takes the lock, so this says "nobody took it since", not "it is live"."""
    return _versioned(_string(name) + struct.pack("<B", EXCLUSIVE) + _string(cookie) + _string(tag))


def get_info_args(name: str) -> bytes:
    """cls_lock_get_info_op {name}."""
    return _versioned(_string(name))


@dataclass(frozen=True)
class Locker:
    instance: int  # the client's global id (what break_lock names)
    cookie: str
    expires: float  # seconds since the epoch by the OSD's clock; 0: never


class _Reader:
    def __init__(self, blob: bytes) -> None:
        self.blob, self.pos = blob, 0

    def take(self, fmt: str) -> tuple[int, ...]:
        got = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return got

    def string(self) -> str:
        (n,) = self.take("<I")
        raw = self.blob[self.pos : self.pos + n]
        if len(raw) != n:
            raise struct.error("a string runs past the end")
        self.pos += n
        return raw.decode(errors="replace")

    def header(self) -> int:
        """A versioned struct's header; returns where the struct ends."""
        _v, _compat, length = self.take("<BBI")
        return self.pos + int(length)


SHARED = 2


def lock_info(reply: bytes) -> tuple[list[Locker], int]:
    """The lockers in a cls_lock_get_info_reply and the lock's type (EXCLUSIVE,
    SHARED, 0 when nobody holds it); struct.error when it is damaged.
    Each locker_info_t is skipped past its expiration by its length: the address
    that follows has an encoding of its own that nothing here needs."""
    r = _Reader(reply)
    r.header()
    (count,) = r.take("<I")
    out = []
    for _ in range(count):
        end = r.header()
        _kind, instance = r.take("<Bq")
        cookie = r.string()
        r.pos = end
        end = r.header()
        sec, nsec = r.take("<II")
        r.pos = end
        out.append(Locker(int(instance), cookie, sec + nsec / 1e9))
    (kind,) = r.take("<B")
    return out, int(kind)
