"""rbd's incremental diff streams ("rbd diff v1", "rbd diff v2") and its
"rbd image v2" export stream, as a codec with no I/O (Ceph doc/dev/rbd-diff.rst
and rbd-export.rst).

Like h11, the decoder is fed bytes as they arrive and hands back events; what to
do with them (and where the bytes come from) is the caller's business. Every way
a stream can be wrong ends in one StreamError sentence naming the byte offset,
before the caller has been handed anything the mistake could have spoiled: a
record is checked whole (and against the image size) before its event is given.

A diff stream:   header, metadata records (f, t, s, and in v2 any unknown tag,
                 skipped by its length), data records (w with its payload, z),
                 then e.
An image stream: "rbd image v2\\n", metadata records (tag, le64 length, value)
                 up to E, "rbd image diffs v2\\n", le64 count, then that many
                 v2 diff streams, each with its own header.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from thinblock.errors import ThinblockError

DIFF_V1 = b"rbd diff v1\n"
DIFF_V2 = b"rbd diff v2\n"
IMAGE_V2 = b"rbd image v2\n"
IMAGE_DIFFS_V2 = b"rbd image diffs v2\n"
MAX_NAME = 4096  # a snapshot name; rbd's are far shorter
MAX_CHUNK = 4 << 20  # payload is handed out in pieces of at most this
_U32, _U64, _U64X2 = struct.Struct("<I"), struct.Struct("<Q"), struct.Struct("<QQ")


class StreamError(ThinblockError):
    """A diff or image stream that is truncated, malformed or not one at all."""


# ----- events -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Named:
    name: str


class FromSnap(_Named):
    """The 'f' record: the snapshot the diff starts from."""


class ToSnap(_Named):
    """The 't' record: the snapshot the diff ends at (none: the image's head)."""


@dataclass(frozen=True)
class Size:
    size_bytes: int


@dataclass(frozen=True)
class _Range:
    offset: int
    length: int


class Data(_Range):
    """A 'w' record; its `length` bytes follow as Payload events."""


class Zero(_Range):
    """A 'z' record: the range reads zeros."""


@dataclass(frozen=True)
class Payload:
    data: bytes


@dataclass(frozen=True)
class End:
    pass


class NeedData:
    """next_event has nothing until more bytes are fed."""


NEED_DATA = NeedData()
Event = FromSnap | ToSnap | Size | Data | Payload | Zero | End


# ----- encoding ---------------------------------------------------------------------


class DiffEncoder:
    """The bytes of one diff stream, record by record (version 1 or 2)."""

    def __init__(self, version: int = 1) -> None:
        if version not in (1, 2):
            raise ValueError(f"rbd diff version {version}")
        self.version = version

    def header(self) -> bytes:
        return DIFF_V1 if self.version == 1 else DIFF_V2

    def _record(self, tag: bytes, body: bytes, extra: int = 0) -> bytes:
        if self.version == 1:
            return tag + body
        return tag + _U64.pack(len(body) + extra) + body

    def from_snap(self, name: str) -> bytes:
        raw = name.encode()
        return self._record(b"f", _U32.pack(len(raw)) + raw)

    def to_snap(self, name: str) -> bytes:
        raw = name.encode()
        return self._record(b"t", _U32.pack(len(raw)) + raw)

    def size(self, size_bytes: int) -> bytes:
        return self._record(b"s", _U64.pack(size_bytes))

    def data(self, offset: int, length: int) -> bytes:
        """The head of a 'w' record: `length` bytes of payload must follow."""
        return self._record(b"w", _U64X2.pack(offset, length), extra=length)

    def zero(self, offset: int, length: int) -> bytes:
        return self._record(b"z", _U64X2.pack(offset, length))

    def end(self) -> bytes:
        return b"e"


def image_header(order: int = 22, diffs: int = 1) -> bytes:
    """The start of an "rbd image v2" stream: its object order, the end of the
    metadata, and the count of diffs that follow (one per snapshot, oldest first,
    then one for the image's head, as `rbd export --export-format 2` writes)."""
    if diffs < 1:
        raise ValueError("an rbd image stream holds at least one diff")
    return IMAGE_V2 + b"O" + _U64.pack(8) + _U64.pack(order) + b"E" + IMAGE_DIFFS_V2 + _U64.pack(diffs)


# ----- decoding ---------------------------------------------------------------------


class _Buffer:
    """Bytes fed and not yet decoded, and where they start in the stream."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # offset of _buf[0] in the stream (or in the part this decodes)

    def _take(self, n: int) -> bytes | None:
        """The next n bytes, consumed; None until that many have been fed."""
        if len(self._buf) < n:
            return None
        out = bytes(self._buf[:n])
        del self._buf[:n]
        self._pos += n
        return out

    def _peek(self, n: int) -> bytes | None:
        return bytes(self._buf[:n]) if len(self._buf) >= n else None


class DiffDecoder(_Buffer):
    """Events from one diff stream (v1 or v2, told by its header).

    Checks as it goes: metadata before data, at most one f, t and s, snapshot names
    that are printable UTF-8 (no NUL, no control characters), a size before any
    data unless the image's size is given, every w and z inside the image's size,
    v2 lengths that match their records. `done` is True once the 'e' record is read; bytes after it stay in
    `rest()` (an image stream's next diff, or trailing junk in a diff file).
    """

    def __init__(self, *, what: str = "rbd diff", base_offset: int = 0, image_size_bytes: int | None = None) -> None:
        super().__init__()
        self.what = what
        # The size of the image the diff applies to. A diff need not carry a size
        # record: rbd import-diff then keeps the image's size, and so do we; its data
        # records are checked against this instead (None: none is known, so a diff
        # without a size record may hold no data records).
        self.image_size_bytes = image_size_bytes
        self.version = 0
        self._base = base_offset  # where this stream starts in a larger one (messages)
        self._payload_left = 0
        self._skip_left = 0
        self._in_data = False
        self.from_snap: str | None = None
        self.to_snap: str | None = None
        self.size_bytes: int | None = None
        self.done = False

    # -- feeding

    def feed(self, data: bytes) -> None:
        self._buf += data

    def rest(self) -> bytes:
        return bytes(self._buf)

    @property
    def offset(self) -> int:
        """Bytes of the stream consumed so far."""
        return self._base + self._pos

    def _fail(self, message: str, at: int | None = None) -> StreamError:
        where = self.offset if at is None else at
        return StreamError(f"malformed {self.what} at byte {where}: {message}")

    def truncated(self) -> StreamError:
        """The error for a stream that ended now (call when the source is exhausted)."""
        if not self.version:
            got = bytes(self._buf[:16])
            if not (DIFF_V1.startswith(got) or DIFF_V2.startswith(got)):
                return StreamError(f"not an {self.what} stream: it starts with {got!r}")
            return StreamError(f"truncated {self.what}: it ends inside its header")
        if self._payload_left:
            return StreamError(
                f"truncated {self.what}: it ends at byte {self.offset + len(self._buf)}, inside the data of a 'w'"
                f" record, {self._payload_left} bytes short"
            )
        return StreamError(
            f"truncated {self.what}: it ends at byte {self.offset + len(self._buf)} with no end ('e') record"
        )

    # -- events

    def next_event(self) -> Event | NeedData:
        if self.done:
            return NEED_DATA
        if not self.version:
            head = self._peek(len(DIFF_V1))
            if head is None:
                got = bytes(self._buf)
                if not (DIFF_V1.startswith(got) or DIFF_V2.startswith(got)):
                    raise StreamError(f"not an {self.what} stream: it starts with {got[:16]!r}")
                return NEED_DATA
            if head not in (DIFF_V1, DIFF_V2):
                raise StreamError(f"not an {self.what} stream: it starts with {head!r}")
            self._take(len(head))
            self.version = 1 if head == DIFF_V1 else 2
        if self._payload_left:
            n = min(self._payload_left, len(self._buf), MAX_CHUNK)
            if not n:
                return NEED_DATA
            self._payload_left -= n
            return Payload(self._take(n) or b"")
        while True:
            while self._skip_left:
                n = min(self._skip_left, len(self._buf))
                if not n:
                    return NEED_DATA
                self._take(n)
                self._skip_left -= n
            event = self._record()
            if event is not None:
                return event

    def _record(self) -> Event | NeedData | None:
        """The next record's event; None when it was an unknown v2 record, now skipped."""
        at = self.offset
        tag = self._peek(1)
        if tag is None:
            return NEED_DATA
        if tag == b"e":
            self._take(1)
            self.done = True
            return End()
        head = 1 + (8 if self.version == 2 else 0)
        if tag in (b"f", b"t"):
            got = self._peek(head + 4)
            if got is None:
                return NEED_DATA
            (n,) = _U32.unpack_from(got, head)
            if n > MAX_NAME:
                raise self._fail(f"snapshot name of {n} bytes (at most {MAX_NAME})")
            self._check_length(got, 4 + n, tag)
            record = self._take(head + 4 + n)
            if record is None:
                return NEED_DATA
            if self._in_data:
                raise self._fail(f"metadata record {tag.decode()!r} after the data records", at)
            try:
                name = record[head + 4 :].decode()
            except UnicodeDecodeError:
                raise self._fail("snapshot name is not UTF-8", at) from None
            if not name:
                raise self._fail("empty snapshot name", at)
            if not name.isprintable():
                raise self._fail(f"snapshot name {name!r} holds a control or other unprintable character", at)
            if tag == b"f":
                if self.from_snap is not None:
                    raise self._fail("two from-snapshot ('f') records", at)
                self.from_snap = name
                return FromSnap(name)
            if self.to_snap is not None:
                raise self._fail("two to-snapshot ('t') records", at)
            self.to_snap = name
            return ToSnap(name)
        if tag == b"s":
            got = self._take_checked(head, 8, tag)
            if got is None:
                return NEED_DATA
            if self._in_data:
                raise self._fail("size ('s') record after the data records", at)
            if self.size_bytes is not None:
                raise self._fail("two size ('s') records", at)
            (self.size_bytes,) = _U64.unpack_from(got, head)
            return Size(self.size_bytes)
        if tag in (b"w", b"z"):
            got = self._peek(head + 16)
            if got is None:
                return NEED_DATA
            offset, length = _U64X2.unpack_from(got, head)
            self._check_length(got, 16 + (length if tag == b"w" else 0), tag)
            size = self.size_bytes if self.size_bytes is not None else self.image_size_bytes
            if size is None:
                raise self._fail(f"data record {tag.decode()!r} before the size ('s') record")
            if offset + length > size:
                raise self._fail(f"{tag.decode()!r} record [{offset}, +{length}) ends past the image size {size}")
            self._take(head + 16)
            self._in_data = True
            if tag == b"z":
                return Zero(offset, length)
            self._payload_left = length
            return Data(offset, length)
        if self.version == 1:
            raise self._fail(f"unknown record tag {tag!r}")
        if tag == b"p":
            # A snapshot's protection status: rbd writes a length of 8 and then one byte,
            # and its importer reads one byte, whatever the length says; so do we.
            if self._in_data:
                raise self._fail("metadata record 'p' after the data records", at)
            return None if self._take(head + 1) is not None else NEED_DATA
        got = self._peek(head)  # v2: a record we do not know is skipped by its length
        if got is None:
            return NEED_DATA
        (self._skip_left,) = _U64.unpack_from(got, 1)
        self._take(head)
        return None

    def _check_length(self, got: bytes, want: int, tag: bytes) -> None:
        if self.version == 2:
            (length,) = _U64.unpack_from(got, 1)
            if length != want:
                raise self._fail(f"{tag.decode()!r} record says it is {length} bytes long, it is {want}")

    def _take_checked(self, head: int, n: int, tag: bytes) -> bytes | None:
        got = self._peek(head + n)
        if got is None:
            return None
        self._check_length(got, n, tag)
        return self._take(head + n)


class ImageDecoder(_Buffer):
    """Events of an "rbd image v2" stream: the diffs it holds, one after another
    (each a DiffDecoder's events, ToSnap naming the snapshot it ends at)."""

    def __init__(self) -> None:
        super().__init__()
        self._stage = "header"
        self.order: int | None = None
        self.diffs_left = 0
        self.diff: DiffDecoder | None = None
        self.done = False

    def feed(self, data: bytes) -> None:
        if self.diff is not None:
            self.diff.feed(data)
        else:
            self._buf += data

    def rest(self) -> bytes:
        """Bytes fed but not used: after the last diff, whatever follows the stream."""
        return self.diff.rest() if self.diff is not None else bytes(self._buf)

    @property
    def offset(self) -> int:
        return self.diff.offset if self.diff is not None else self._pos

    def _fail(self, message: str) -> StreamError:
        return StreamError(f"malformed rbd image stream at byte {self._pos}: {message}")

    def truncated(self) -> StreamError:
        if self.diff is not None:
            return self.diff.truncated()
        if self._stage == "header" and not IMAGE_V2.startswith(bytes(self._buf[: len(IMAGE_V2)])):
            return StreamError(f"not an rbd image v2 stream: it starts with {bytes(self._buf[:16])!r}")
        return StreamError(f"truncated rbd image stream: it ends at byte {self._pos + len(self._buf)}")

    def next_event(self) -> Event | NeedData:
        while True:
            if self.diff is not None:
                event = self.diff.next_event()
                if not isinstance(event, End):
                    return event
                self._buf = bytearray(self.diff.rest())
                self._pos = self.diff.offset
                self.diff = None
                self.diffs_left -= 1
                if not self.diffs_left:
                    self.done = True
                return event
            if self.done:
                return NEED_DATA
            if self._stage == "header":
                got = self._take(len(IMAGE_V2))
                if got is None:
                    if not IMAGE_V2.startswith(bytes(self._buf)):
                        raise StreamError(f"not an rbd image v2 stream: it starts with {bytes(self._buf)!r}")
                    return NEED_DATA
                if got != IMAGE_V2:
                    raise StreamError(f"not an rbd image v2 stream: it starts with {got!r}")
                self._stage = "meta"
            elif self._stage == "meta":
                if not self._buf:
                    return NEED_DATA
                if self._buf[:1] == b"E":
                    self._take(1)
                    self._stage = "diffs"
                    continue
                if len(self._buf) < 9:
                    return NEED_DATA
                (length,) = _U64.unpack_from(self._buf, 1)
                if length > 1 << 20:
                    raise self._fail(f"metadata record of {length} bytes")
                record = self._take(9 + length)
                if record is None:
                    return NEED_DATA
                if record[:1] == b"O" and length == 8:
                    (self.order,) = _U64.unpack_from(record, 9)
            elif self._stage == "diffs":
                got = self._take(len(IMAGE_DIFFS_V2) + 8)
                if got is None:
                    return NEED_DATA
                if got[: len(IMAGE_DIFFS_V2)] != IMAGE_DIFFS_V2:
                    raise self._fail(f"expected {IMAGE_DIFFS_V2!r}, found {got[:20]!r}")
                (self.diffs_left,) = _U64.unpack_from(got, len(IMAGE_DIFFS_V2))
                if not self.diffs_left:
                    raise self._fail("the stream holds no diffs")
                self._stage = "diff"
            else:
                self.diff = DiffDecoder(what="rbd image stream", base_offset=self._pos)
                self.diff.feed(bytes(self._buf))
                self._buf = bytearray()
