"""Untrusted images: `thinblock import` of a qcow2 reads that file and nothing else.

Each evil image is made with the real qemu-img (`create -b ... -F raw`, `-o
data_file=`, `json:` backing names, a backing file that is another real server's NBD
socket) and imported with the real command line into a real server, which does the
work with its own rights (the case of a server running as root). Each is refused
with one sentence and exit 1, nothing is made in the pool, and the secret bytes
appear nowhere in the pool's data. Also: a truncated qcow2 (qemu-img check errors),
virtual sizes beyond --max-size, a 2 EiB image with one allocated cluster (walked in
well under a second, where every GiB was asked about before), and import-diff and
rbd image streams that would resize or grow a volume.
"""

from __future__ import annotations

import base64
import json
import os
import random
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.cli import ROOT
from tests.nbd_server import Server, served_pool, thinblock
from thinblock.formats import rbd

MiB = 1 << 20
SECRET = b"TOP-SECRET-HOST-BYTES-" * 4096  # 88 KiB that must never reach a volume
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real command line; a run past timeout fails the test (not the suite)."""
    proc = subprocess.run(
        [sys.executable, "-m", "thinblock", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def _qemu_img(*args: str) -> None:
    subprocess.run(["qemu-img", *args], check=True, capture_output=True)


def _names(pool: str) -> list[str]:
    return sorted(v["name"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout))


def _refused(proc: subprocess.CompletedProcess[str], says: str) -> None:
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert says in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # one sentence


def _no_secret_in(pool: Path, *secrets: bytes) -> None:
    """Neither secret is anywhere in the pool's data (the data file is read whole)."""
    data = (pool / "data").read_bytes()
    for secret in secrets:
        assert secret[:64] not in data


@contextmanager
def _qemu_nbd(image: Path, socket: Path) -> Iterator[None]:
    """Another real NBD server (a pool's private export, say), serving image."""
    proc = subprocess.Popen(["qemu-nbd", "--socket", str(socket), "--persistent", "--format=raw", str(image)])
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():  # qemu-nbd binds before it serves: wait for the socket
            assert proc.poll() is None and time.monotonic() < deadline, "qemu-nbd did not start"
            time.sleep(0.02)
        yield
    finally:
        proc.terminate()
        proc.wait(10)


def _evil_images(tmp_path: Path, nbd_socket: Path) -> dict[str, tuple[Path, str]]:
    """name -> (image, what its refusal says), each made with the real qemu-img."""
    private = tmp_path / "private"
    private.mkdir()
    secret = private / "secret"
    secret.write_bytes(SECRET + bytes(MiB - len(SECRET)))
    secret.chmod(0o600)  # a root-only file, when the tests run as root
    images = tmp_path / "images"
    images.mkdir()
    made: dict[str, tuple[Path, str]] = {}

    def backed(name: str, backing: str) -> None:
        path = images / f"{name}.qcow2"
        _qemu_img("create", "-q", "-f", "qcow2", "-u", "-b", backing, "-F", "raw", str(path), "1M")
        made[name] = (path, "has a backing file")

    backed("shadow", "/etc/shadow")
    backed("root-only", str(secret))
    backed("relative", "../private/secret")
    backed("json-file", "json:" + json.dumps({"file.driver": "file", "file.filename": str(secret)}))
    nbd = {"file.driver": "nbd", "file.server.type": "unix", "file.server.path": str(nbd_socket)}
    backed("json-nbd", "json:" + json.dumps(nbd))
    # An external data file: qemu-img create empties it, so the secret goes in after.
    data_file = private / "data-file"
    path = images / "data-file.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", "-o", f"data_file={data_file},data_file_raw=on", str(path), "1M")
    data_file.write_bytes(SECRET + bytes(MiB - len(SECRET)))
    made["data-file"] = (path, "external data file")
    return made


def test_evil_qcow2_images_are_refused_and_read_nothing_from_the_host(tmp_path: Path) -> None:
    """Into a served pool: the server does the work, with its own rights."""
    other = tmp_path / "other-secret.raw"
    other_secret = b"ANOTHER-POOLS-PRIVATE-EXPORT-" * 2048
    other.write_bytes(other_secret + bytes(MiB - len(other_secret)))
    sock = tmp_path / "other.sock"
    shadow = Path("/etc/shadow").read_bytes()[:64] or b"\x00-no-shadow-"
    with _qemu_nbd(other, sock), served_pool(tmp_path / "p", "256M", {}) as served:
        pool = served.pool
        evil = _evil_images(tmp_path, sock)
        for name, (image, says) in evil.items():
            proc = _run("import", str(image), pool, name, "--no-progress")
            _refused(proc, says)
            # --force lets a damaged image through, never a host file.
            _refused(_run("import", str(image), pool, name, "--force", "--no-progress"), says)
        assert _names(pool) == []
        # With --allow-backing, json: and protocol names stay refused, and the data
        # file too: only a chain of plain local files is ever read.
        for name in ("json-file", "json-nbd"):
            proc = _run("import", str(evil[name][0]), pool, name, "--allow-backing", "--no-progress")
            _refused(proc, "not a plain local file name")
        _refused(_run("import", str(evil["data-file"][0]), pool, "d", "--allow-backing"), "external data file")
        assert _names(pool) == []
        thinblock("pool", "check", pool)
        _no_secret_in(Path(pool), SECRET, other_secret, shadow)
        assert "Traceback" not in served.log.read_text()


def test_allow_backing_names_the_files_it_reads(tmp_path: Path) -> None:
    """The user opts in: a relative backing chain of local files, named on stderr
    before anything is read, in the summary, and imported exactly."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    (tmp_path / "base").mkdir()
    base = tmp_path / "base" / "base.raw"
    base.write_bytes(SECRET + bytes(MiB - len(SECRET)))
    mid = tmp_path / "mid.qcow2"
    top = tmp_path / "top.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", "-b", "base/base.raw", "-F", "raw", str(mid))
    _qemu_img("create", "-q", "-f", "qcow2", "-b", "mid.qcow2", "-F", "qcow2", str(top))
    subprocess.run(["qemu-io", "-c", f"write -P 0x5a {512 * 1024} 4096", str(top)], check=True, capture_output=True)
    _refused(_run("import", str(top), pool, "v"), "has a backing file")
    proc = _run("import", str(top), pool, "v", "--allow-backing", "--json", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert f"reads its backing chain: {mid} (qcow2), {base} (raw)" in proc.stderr
    assert json.loads(proc.stdout)["files_read"] == [str(top), str(mid), str(base)]
    want = bytearray(SECRET + bytes(MiB - len(SECRET)))
    want[512 * 1024 : 512 * 1024 + 4096] = b"\x5a" * 4096
    out = tmp_path / "out.raw"
    thinblock("export", pool, "v", str(out))
    assert out.read_bytes() == bytes(want)
    thinblock("pool", "check", pool)


def test_a_truncated_qcow2_is_refused_unless_forced(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    image = tmp_path / "t.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", str(image), "4M")
    subprocess.run(["qemu-io", "-c", "write -P 0x41 0 1M", str(image)], check=True, capture_output=True)
    os.truncate(image, 400 * 1024)  # cut through its data clusters
    _refused(_run("import", str(image), pool, "t", "--no-progress"), "qemu-img check finds")
    assert _names(pool) == []
    proc = _run("import", str(image), pool, "t", "--force", "--no-progress")
    assert proc.returncode == 0, proc.stderr  # knowingly: what can be read
    assert _names(pool) == ["t"]
    thinblock("pool", "check", pool)


def test_huge_virtual_sizes_are_bounded_or_walked_fast(tmp_path: Path) -> None:
    """A 2 EiB qcow2 with one allocated cluster: --max-size refuses it before anything
    starts; without it, only its allocated region is asked about (at one block
    status per GiB it took about 33 hours)."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    image = tmp_path / "huge.qcow2"
    _qemu_img("create", "-q", "-f", "qcow2", "-o", "cluster_size=2M", str(image), "2E")
    subprocess.run(["qemu-io", "-c", "write -P 0x42 1E 1M", str(image)], check=True, capture_output=True)
    proc = _run("import", str(image), pool, "h", "--max-size", "1T", "--no-progress")
    _refused(proc, f"the virtual size of {image} is 2E (2305843009213693952 bytes), beyond --max-size 1T")
    assert _names(pool) == []
    proc = _run("import", str(image), pool, "h", "--json", "--no-progress", timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["size_bytes"] == 1 << 61 and result["written_bytes"] == MiB
    # Raw files, NBD sources and streams are bounded the same way.
    raw = tmp_path / "big.raw"
    with open(raw, "wb") as f:
        f.truncate(1 << 40)
    _refused(_run("import", str(raw), pool, "r", "--max-size", "16M"), "beyond --max-size 16M")
    _refused(_run("import", "-", pool, "s", "--size", "1T", "--max-size", "16M"), "beyond --max-size 16M")
    assert _names(pool) == ["h"]
    thinblock("pool", "check", pool)


def _diff_of_size(size: int) -> bytes:
    """A bare rbd diff v1 whose size record says size and holds no data."""
    return b"rbd diff v1\n" + b"s" + struct.pack("<Q", size) + b"e"


@pytest.mark.parametrize("served", [False, True], ids=["local", "served"])
def test_import_diff_never_resizes_without_allow_resize(tmp_path: Path, served: bool) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "v", "--size", "16M")
    huge, small = tmp_path / "huge.diff", tmp_path / "small.diff"
    huge.write_bytes(_diff_of_size((1 << 63) - (1 << 20)))
    small.write_bytes(_diff_of_size(8 * MiB))
    server = Server(pool) if served else None
    try:
        _refused(_run("import-diff", str(huge), pool, "v"), "pass --allow-resize")
        _refused(_run("import-diff", str(small), pool, "v"), "pass --allow-resize")
        _refused(
            _run("import-diff", str(huge), pool, "v", "--allow-resize", "--max-size", "1G"),
            "beyond --max-size 1G",
        )
        sizes = {v["name"]: v["size_bytes"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout)}
        assert sizes == {"v": 16 * MiB}
        proc = _run("import-diff", str(small), pool, "v", "--allow-resize", "--max-size", "1G")
        assert proc.returncode == 0, proc.stderr
        sizes = {v["name"]: v["size_bytes"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout)}
        assert sizes == {"v": 8 * MiB}
    finally:
        if server is not None:
            server.stop()
            assert "Traceback" not in server.log.read_text()
    thinblock("pool", "check", pool)


def test_an_rbd_image_stream_is_bounded_by_max_size(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "big", "--size", "1T")
    stream = tmp_path / "big.rbd"
    thinblock("export", pool, "big", str(stream), "--format", "rbd")
    _refused(_run("import", str(stream), pool, "copy", "--max-size", "1G"), "beyond --max-size 1G")
    assert _names(pool) == ["big"]
    thinblock("import", str(stream), pool, "copy")
    assert _names(pool) == ["big", "copy"]


def test_an_image_someone_else_could_rewrite_is_refused(tmp_path: Path) -> None:
    """qemu-nbd reopens the image after the checks; a file another user can still write
    could be swapped in place for one naming a host file (a probe did it with a clean
    image turned into one with data_file=<a 0600 secret> while the import ran). So an
    image, or a backing file, writable by anyone but the importer is refused."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    base, image = tmp_path / "base.raw", tmp_path / "top.qcow2"
    base.write_bytes(b"b" * MiB)
    base.chmod(0o644)
    _qemu_img("create", "-q", "-f", "qcow2", "-b", str(base), "-F", "raw", str(image))
    image.chmod(0o666)
    refused = _run("import", str(image), pool, "v", "--allow-backing")  # (its first line names the chain)
    assert refused.returncode == 1 and "rewritten by its group or other users (mode 0666)" in refused.stderr
    image.chmod(0o644)
    os.chown(image, 65534, -1)
    refused = _run("import", str(image), pool, "v", "--allow-backing")
    assert refused.returncode == 1 and "rewritten by its owner (uid 65534)" in refused.stderr
    os.chown(image, os.geteuid(), -1)
    base.chmod(0o646)  # the backing file too: qemu reopens it the same way
    refused = _run("import", str(image), pool, "v", "--allow-backing")
    assert refused.returncode == 1 and f"{base} can be rewritten" in refused.stderr
    assert _names(pool) == []
    base.chmod(0o644)
    assert _run("import", str(image), pool, "v", "--allow-backing", "--no-progress").returncode == 0
    assert _names(pool) == ["v"]
    thinblock("pool", "check", pool)


def test_an_rbd_image_stream_that_takes_a_snapshot_twice_is_refused(tmp_path: Path) -> None:
    """Two diffs that both end at snapshot s1 (the second starting from it): refused as
    a malformed stream, in one sentence, with nothing made."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    enc = rbd.DiffEncoder(2)
    first = enc.header() + enc.size(MiB) + enc.to_snap("s1") + enc.end()
    again = enc.header() + enc.from_snap("s1") + enc.to_snap("s1") + enc.size(MiB) + enc.end()
    head = enc.header() + enc.from_snap("s1") + enc.size(MiB) + enc.end()
    stream = tmp_path / "twice.rbd"
    stream.write_bytes(rbd.image_header(diffs=3) + first + again + head)
    _refused(_run("import", str(stream), pool, "v"), "it takes snapshot 's1' twice")
    assert _names(pool) == []
    thinblock("pool", "check", pool)


def test_a_qcow2_image_qemu_cannot_read_whole_is_refused_in_its_words(tmp_path: Path) -> None:
    """A compressed cluster whose bytes are garbage: qemu-img check finds nothing, and
    qemu-nbd drops the connection at the read. The import fails in one sentence that
    says what qemu-nbd said (not libnbd's 'server disconnected'), and makes nothing."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    raw, image = tmp_path / "text.raw", tmp_path / "c.qcow2"
    raw.write_bytes(base64.b64encode(random.Random(7).randbytes(3 * MiB)))  # compressible, not much
    os.truncate(raw, 8 * MiB)
    _qemu_img("convert", "-c", "-f", "raw", "-O", "qcow2", str(raw), str(image))
    with open(image, "r+b") as f:
        # The start of the sixth cluster's deflate stream, found through L1 and L2
        # (qcow2 spec): 0xff there is a block of the reserved type, which zlib refuses.
        head = f.read(48)
        cluster_bits, l1_at = struct.unpack(">I", head[20:24])[0], struct.unpack(">Q", head[40:48])[0]
        f.seek(l1_at)
        l2_at = struct.unpack(">Q", f.read(8))[0] & 0x00FF_FFFF_FFFF_FE00
        f.seek(l2_at + 5 * 8)
        entry = struct.unpack(">Q", f.read(8))[0]
        assert entry & (1 << 62), "the cluster is compressed"
        f.seek(entry & ((1 << (62 - (cluster_bits - 8))) - 1))
        f.write(b"\xff" * 16)
    _refused(
        _run("import", str(image), pool, "v", "--no-progress"),
        f"qemu-nbd could not read {image}: reading from file failed: Input/output error",
    )
    assert _names(pool) == []
    thinblock("pool", "check", pool)
