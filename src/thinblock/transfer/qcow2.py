"""Untrusted qcow2 images: an import reads the file it was given and nothing else.

A qcow2 file can name other things for qemu to open with it: a backing file (an
absolute or relative path, or a `json:`/protocol name such as another server's NBD
socket) and an external data file. Opened as it is, an image someone hands us makes
whoever runs the import (perhaps a server running as root) copy /etc/shadow, or
another pool's private export, into a volume: the image-upload hole of OpenStack's
qemu-img advisories. Glance and Nova closed it by inspecting the header before qemu
sees the file and refusing backing and data files; so does this module:

1. The header is read here, in Python, from the descriptor the command opened with
   the user's rights, before any qemu tool runs: a backing file, an external data
   file or encryption is refused in one sentence (or, with allow_backing, a backing
   chain of plain local files the command opened too).
2. qemu sees only `json:` specs built here: an explicit driver for every node, the
   file as /dev/fd/N (a descriptor it inherits, never a name it could parse as a
   protocol), and `"backing": null`. `qemu-img info` then checks again, and gives the
   virtual size, which is bounded before anything starts; `qemu-img check` errors
   (a truncated image) refuse the import unless force.
   The files must be writable by the importer alone (refuse_changeable): qemu-nbd
   reopens them after these checks, and a file rewritten in place in between
   could name what the checks never saw.
3. The active L1 table says which regions can hold data at all, so a small image
   claiming 256 TiB asks qemu-nbd's block status about its few allocated regions
   only, not about every GiB of the rest.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from thinblock.bindings import QCOW2_IMPORT, require
from thinblock.errors import ThinblockError
from thinblock.transfer.common import bound_size
from thinblock.transfer.images import QCOW2_MAGIC, NbdSource

_INCOMPAT_DATA_FILE = 1 << 2
_INCOMPAT_EXTENDED_L2 = 1 << 4
_EXT_BACKING_FORMAT = 0xE2792ACA
_EXT_DATA_FILE = 0x44415441
_L1_OFFSET_MASK = 0x00FFFFFFFFFFFE00
_MAX_L1_BYTES = 32 << 20  # qemu's QCOW_MAX_L1_SIZE: it opens no image with a larger L1 table
_QEMU_TIMEOUT_S = 600  # qemu-img info/check of one image (check walks its refcounts)
LAYER_FORMATS = ("qcow2", "raw")  # what a layer of an allowed backing chain may be


@dataclass(frozen=True)
class Header:
    version: int
    cluster_bits: int
    size_bytes: int
    encrypted: bool
    l1_entries: int
    l1_offset: int
    incompatible: int
    backing_name: str | None  # the backing file the header names, as written
    backing_format: str | None  # its format, from the header extension
    data_file: bool  # an external data file (the feature bit or the extension)

    @property
    def region_bytes(self) -> int:
        """Guest bytes one L1 entry (one L2 table) covers."""
        entry_bytes = 16 if self.incompatible & _INCOMPAT_EXTENDED_L2 else 8
        cluster = 1 << self.cluster_bits
        return cluster * (cluster // entry_bytes)


def read_header(fd: int, name: str) -> Header:
    """The header of the qcow2 image open at fd, read with pread; what qemu would
    refuse anyway (a bad magic, version or cluster size) is refused here first."""
    head = os.pread(fd, 4096, 0)
    if len(head) < 72 or head[:4] != QCOW2_MAGIC:
        raise ThinblockError(f"{name} is not a qcow2 image (no qcow2 header)")
    version, backing_offset, backing_len, cluster_bits, size = struct.unpack_from(">IQIIQ", head, 4)
    crypt, l1_entries, l1_offset = struct.unpack_from(">IIQ", head, 32)
    if version not in (2, 3) or not 9 <= cluster_bits <= 21:
        raise ThinblockError(
            f"{name} is not a qcow2 image qemu can read (version {version}, cluster bits {cluster_bits})"
        )
    incompatible, header_len = 0, 72
    if version == 3:
        if len(head) < 104:
            raise ThinblockError(f"{name} is a truncated qcow2 image (its header is cut short)")
        (incompatible,) = struct.unpack_from(">Q", head, 72)
        (header_len,) = struct.unpack_from(">I", head, 100)
    backing_format, data_ext = None, False
    pos = header_len
    while pos + 8 <= len(head):  # header extensions, up to the end one (type 0)
        kind, length = struct.unpack_from(">II", head, pos)
        if kind == 0:
            break
        if kind == _EXT_BACKING_FORMAT:
            backing_format = head[pos + 8 : pos + 8 + length].decode("utf-8", "replace")
        elif kind == _EXT_DATA_FILE:
            data_ext = True
        pos += 8 + (length + 7) // 8 * 8
    backing_name = None
    if backing_offset:
        raw = os.pread(fd, min(backing_len, 4096), backing_offset)
        backing_name = raw.decode("utf-8", "replace")
    return Header(
        version,
        cluster_bits,
        size,
        crypt != 0,
        l1_entries,
        l1_offset,
        incompatible,
        backing_name,
        backing_format,
        bool(incompatible & _INCOMPAT_DATA_FILE) or data_ext,
    )


def refuse_unsafe(header: Header, name: str, *, backing_allowed: bool) -> None:
    """One sentence for an image that would make qemu open anything but itself."""
    if header.data_file:
        raise ThinblockError(
            f"{name} keeps its data in an external data file, which the import would read from the host: refused"
            " (convert it with qemu-img convert -O qcow2 first)"
        )
    if header.encrypted:
        raise ThinblockError(f"{name} is an encrypted qcow2 image: decrypt it with qemu-img convert first")
    if header.backing_name is not None and not backing_allowed:
        raise ThinblockError(
            f"{name} has a backing file ({header.backing_name[:200]!r}) that the import would read from the host:"
            " refused (pass --allow-backing to read its backing chain of local files, or flatten it with qemu-img"
            " convert first)"
        )


def _plain_path(backing: str, image_path: str, name: str) -> str:
    """A backing name as the local file it names (relative to the image's directory,
    as qemu resolves it), or one sentence for a json: or protocol name."""
    head = backing.split("/", 1)[0]
    if backing.startswith("json:") or ":" in head or not backing or "\0" in backing:
        raise ThinblockError(
            f"{name} has a backing file {backing[:200]!r} that is not a plain local file name (json: or a"
            " protocol): refused even with --allow-backing"
        )
    return os.path.normpath(os.path.join(os.path.dirname(image_path), backing))


def backing_chain(fd: int, path: str) -> list[tuple[str, str, int]]:
    """(path, format, open fd) of the qcow2 image open at fd and of every file its
    backing chain names, walked from the headers (no qemu runs) and opened here with
    the caller's rights: each backing file must be a local file whose format the
    header records (qcow2 or raw; a format qemu would have to probe is refused), and
    the chain must end. The descriptors after the first are the caller's to close."""
    chain = [(os.path.realpath(path), "qcow2", fd)]
    try:
        while chain[-1][1] == "qcow2":
            layer, _, layer_fd = chain[-1]
            header = read_header(layer_fd, layer)
            refuse_unsafe(header, layer, backing_allowed=True)
            if header.backing_name is None:
                break
            nxt = os.path.realpath(_plain_path(header.backing_name, layer, layer))
            fmt = header.backing_format
            if fmt not in LAYER_FORMATS:
                raise ThinblockError(
                    f"{layer} does not record its backing file's format as qcow2 or raw ({fmt!r}), and qemu must"
                    f" never guess it: rebase it with qemu-img rebase -u -F FORMAT -b {nxt}"
                )
            if any(nxt == p for p, _, _ in chain) or len(chain) >= 64:
                raise ThinblockError(f"the backing chain of {path} loops or is longer than 64 files")
            try:
                nxt_fd = os.open(nxt, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise ThinblockError(f"cannot open {nxt} (in the backing chain of {path}): {exc.strerror}") from None
            chain.append((nxt, fmt, nxt_fd))
    except BaseException:
        for _, _, opened in chain[1:]:
            os.close(opened)
        raise
    return chain


def spec(fds: list[int], formats: list[str]) -> str:
    """A qemu `json:` spec opening the image at fds[0] and, below it, the chain of the
    others: an explicit driver for every node, files as /dev/fd/N, and the last
    layer's backing set to null, so qemu opens nothing the spec does not name."""
    node: dict[str, Any] | None = None
    for fd, fmt in reversed(list(zip(fds, formats, strict=True))):
        layer: dict[str, Any] = {"driver": fmt, "file": {"driver": "file", "filename": f"/dev/fd/{fd}"}}
        if fmt == "qcow2":
            layer["backing"] = node
        node = layer
    return "json:" + json.dumps(node, separators=(",", ":"))


def _qemu_img(args: list[str], fds: list[int], name: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["qemu-img", *args], pass_fds=fds, capture_output=True, text=True, timeout=_QEMU_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        raise ThinblockError("qemu-img is not installed: it is needed to import a qcow2 image") from None
    except subprocess.TimeoutExpired:
        raise ThinblockError(f"qemu-img {args[0]} of {name} took more than {_QEMU_TIMEOUT_S} s: refused") from None


def _last_line(text: str, prefix: str = "qemu-img: ") -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1].removeprefix(prefix) if lines else "no reason given"


def _qemu_nbd_said(text: str, files: dict[int, str]) -> str:
    """qemu-nbd's complaint as one clause: its lines joined, without its own name or
    the json: spec it was given, the /dev/fd/N it opened named as the files they are."""
    lines = [line.strip().removeprefix("qemu-nbd: ") for line in text.splitlines() if line.strip()]
    said = re.sub(r"Failed to blk_new_open '[^']*': ", "", ": ".join(lines))
    return re.sub(r"/dev/fd/(\d+)", lambda m: files.get(int(m.group(1)), m.group(0)), said)


# Run between libnbd and qemu-nbd: stderr onto the descriptor in argv[1], then exec
# the rest in the same process (so socket activation's LISTEN_PID still holds).
_STDERR_TO_FD = """
import os, sys
fd = int(sys.argv[1])
os.dup2(fd, 2)
os.close(fd)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as exc:
    sys.stderr.write(f"{sys.argv[2]}: cannot run it: {exc.strerror}\\n")
    sys.exit(127)
"""


@dataclass
class Checked:
    """A qcow2 image that passed the checks, ready to be served by qemu-nbd."""

    spec: str
    fds: list[int]
    formats: list[str]
    size_bytes: int
    header: Header
    files: list[str]  # what the import reads: the image, then its backing chain


def refuse_changeable(fd: int, name: str) -> None:
    """Refuse an image file someone else could rewrite while it is imported. The checks
    read the file's bytes as they are now, but qemu-nbd opens it again afterwards
    (/dev/fd/N reopens the inode), and follows whatever header it holds then: one
    rewritten in place between the two could name a data file the checks never saw.
    Only the importer (or root) may be able to write it: its owner, with no group
    or other write permission."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return
    if st.st_uid != os.geteuid():
        who = f"its owner (uid {st.st_uid})"
    elif st.st_mode & 0o022:
        who = "its group or other users (mode " + f"{stat.S_IMODE(st.st_mode):04o})"
    else:
        return
    raise ThinblockError(
        f"{name} can be rewritten by {who} while it is imported, and qemu would then read what it says"
        " instead of what was checked: copy it to a file only you can write (cp, then chmod go-w) and import that"
    )


def check_image(fds: list[int], formats: list[str], name: str, files: list[str]) -> Checked:
    """Header, qemu-img info and qemu-img check of the image open at fds[0] (and its
    backing chain at the others, when allowed): one sentence for anything unsafe or
    damaged (damage is let through with force)."""
    if not formats or formats[0] != "qcow2" or any(f not in LAYER_FORMATS for f in formats):
        raise ThinblockError(f"a qcow2 import reads a qcow2 image on top of qcow2 or raw layers, not {formats}")
    for fd, layer in zip(fds, files, strict=True):
        refuse_changeable(fd, layer)
    header = read_header(fds[0], name)
    refuse_unsafe(header, name, backing_allowed=len(fds) > 1)
    for fd, fmt, layer in zip(fds[1:], formats[1:], files[1:], strict=True):
        if fmt == "qcow2":
            refuse_unsafe(read_header(fd, layer), layer, backing_allowed=True)
    top = spec(fds[:1], formats[:1])  # qemu-img info opens no backing: its options would be refused
    info = _qemu_img(["info", "--output=json", "-U", top], fds[:1], name)
    if info.returncode != 0:
        raise ThinblockError(f"qemu-img cannot open {name} as a qcow2 image: {_last_line(info.stderr)}")
    facts = json.loads(info.stdout)
    data_file = (facts.get("format-specific") or {}).get("data", {}).get("data-file")
    if data_file is not None or (facts.get("backing-filename") is not None and len(fds) == 1):
        raise ThinblockError(f"{name} names a file outside itself ({data_file or facts['backing-filename']}): refused")
    size = int(facts["virtual-size"])
    if size != header.size_bytes:
        raise ThinblockError(f"{name}: qemu-img and the header disagree on the virtual size: refused")
    return Checked(spec(fds, formats), fds, formats, size, header, files)


def check_damage(image: Checked, name: str, *, force: bool) -> None:
    """qemu-img check: corruption or a check that could not finish refuses the
    import, unless force (leaked clusters are harmless and let through)."""
    for fd, fmt, layer in zip(image.fds, image.formats, image.files, strict=True):
        if fmt != "qcow2" or force:
            continue
        done = _qemu_img(["check", "--output=json", "-U", spec([fd], [fmt])], [fd], layer)
        if done.returncode in (0, 3):  # 3: leaked clusters only
            continue
        try:
            figures = json.loads(done.stdout)
            found = f"{figures.get('corruptions', 0)} corruptions, {figures.get('check-errors', 0)} check errors"
        except ValueError:
            found = _last_line(done.stderr)
        raise ThinblockError(
            f"qemu-img check finds {layer} damaged ({found}; a truncated image is), so what it holds may be lost"
            " or wrong: refused (pass --force to import what can be read)"
        )


def data_regions(image: Checked) -> list[tuple[int, int]]:
    """(offset, length) runs of guest bytes that can hold data: those whose L1 entry
    points at an L2 table. Elsewhere the image reads zeros (it has no backing file;
    with one, everything may hold data)."""
    h, size = image.header, image.size_bytes
    if len(image.fds) > 1:
        return [(0, size)] if size else []
    region = h.region_bytes
    wanted = min(h.l1_entries, -(-size // region))
    if wanted * 8 > _MAX_L1_BYTES:
        raise ThinblockError(f"the L1 table of the qcow2 image is larger than qemu allows ({wanted} entries)")
    table = os.pread(image.fds[0], wanted * 8, h.l1_offset)
    if len(table) < wanted * 8:
        raise ThinblockError("the qcow2 image's L1 table lies past the end of the file: it is truncated")
    runs: list[tuple[int, int]] = []
    step = 4096  # entries compared at once against zeros: a huge empty table is skipped fast
    zero_chunk = bytes(step * 8)
    for base in range(0, wanted, step):
        chunk = table[base * 8 : (base + step) * 8]
        if chunk == zero_chunk[: len(chunk)]:
            continue
        for i, (entry,) in enumerate(struct.iter_unpack(">Q", chunk)):
            if not entry & _L1_OFFSET_MASK:
                continue
            start = (base + i) * region
            length = min(region, size - start)
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((start, length))
    return runs


class Qcow2Source(NbdSource):
    """A checked qcow2 image served read-only by a qemu-nbd that libnbd starts (with
    socket activation) on the spec, and stops with the connection. Block status is
    asked about the image's data regions only."""

    def __init__(self, image: Checked, name: str) -> None:
        self.image = image
        self.regions = data_regions(image)
        # qemu-nbd inherits the image's descriptors at numbers above libnbd's
        # socket-activation fd 3, for the length of the connect (by then it has
        # opened the image); Python's own children never inherit them (close_fds).
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in image.fds]
        remap = dict(zip(image.fds, moved, strict=True))
        # qemu-nbd's stderr goes to a file of ours, kept for the source's life, so that
        # a failure (to start, or to read the image later) is told in its own words in
        # one sentence (libnbd alone says only that the socket closed).
        self._err = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
        self._files = dict(zip(moved, image.files, strict=True))
        err_fd = fcntl.fcntl(self._err.fileno(), fcntl.F_DUPFD, 10)
        moved.append(err_fd)
        qemu = ["qemu-nbd", "--read-only", spec([remap[fd] for fd in image.fds], image.formats)]
        argv = [sys.executable, "-I", "-S", "-c", _STDERR_TO_FD, str(err_fd), *qemu]
        try:
            super().__init__(name, lambda h: h.connect_systemd_socket_activation(argv), feature=QCOW2_IMPORT)
        except ThinblockError:
            said = self._qemu_said()
            self._err.close()
            if not said:
                raise
            raise ThinblockError(f"qemu-nbd cannot serve {name}: {said}") from None
        except BaseException:
            self._err.close()
            raise
        finally:
            for fd in moved:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.conn.explain = self._read_failure
        if self.size_bytes != image.size_bytes:
            self.close()
            raise ThinblockError(f"qemu-nbd serves {name} as {self.size_bytes} bytes, not its virtual size: refused")

    def _qemu_said(self) -> str:
        """What qemu-nbd wrote on its stderr so far, as one clause (empty: nothing)."""
        return _qemu_nbd_said(self._stderr(), self._files)

    def _stderr(self) -> str:
        # pread: qemu-nbd's stderr shares this file's offset, which a seek would move
        # under its next write.
        return os.pread(self._err.fileno(), 4096, 0).decode(errors="replace")

    def _read_failure(self) -> str:
        """Why a request failed, in qemu-nbd's words: it writes them before it drops the
        connection, which is how libnbd sees the failure."""
        lines = [line for line in self._stderr().splitlines() if line.strip()]
        if not lines:
            return ""
        # The first line is the cause; the ones after it are the broken pipes it left.
        said = _qemu_nbd_said(lines[0], self._files)
        for noise in ("Disconnect client, due to: ", "Failed to send reply: "):
            said = said.removeprefix(noise)
        return f"qemu-nbd could not read {self.name}: {said}"

    def close(self) -> None:
        super().close()
        self._err.close()

    def extents(self) -> Iterator[tuple[int, int, bool]]:
        pos = 0
        for start, length in self.regions:
            if start > pos:
                yield pos, start - pos, False
            yield from self.status(start, start + length)
            pos = start + length
        if pos < self.size_bytes:
            yield pos, self.size_bytes - pos, False


def open_qcow2(
    fds: list[int], name: str, backing: list[str], *, force: bool, max_size_bytes: int | None
) -> Qcow2Source:
    """The import's qcow2 source: the image at fds[0] and the backing chain at the
    others ("FORMAT:PATH" each, as backing_chain found them), checked, bounded in
    size, checked for damage, then served. Refusals come before qemu-nbd starts."""
    require("nbd", feature=QCOW2_IMPORT)  # before the checks: without it nothing can be served
    layers = [entry.split(":", 1) for entry in backing]
    formats = ["qcow2", *[fmt for fmt, _ in layers]]
    image = check_image(fds, formats, name, [name, *[path for _, path in layers]])
    bound_size(image.size_bytes, max_size_bytes, f"the virtual size of {name}")
    check_damage(image, name, force=force)
    return Qcow2Source(image, name)
