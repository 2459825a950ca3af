"""import, export, export-diff, import-diff and sparsify, with real files, processes
and clients: qemu-img and qemu-nbd as peers, libnbd, a real `rbd` on the test
Ceph cluster, and the pool served by a real `thinblock serve` or opened by the
command itself."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.cli import ROOT, export_bytes, volume_names
from tests.nbd_server import Server, apply_steps, connect, served_pool, thinblock

MiB = 1 << 20
BS = 64 << 10
SIZE = 32 * MiB
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _write_image(path: Path, size: int, seed: int) -> bytes:
    """A sparse raw file: random data, explicit zeros and holes; returns its bytes."""
    import random

    rng = random.Random(seed)
    buf = bytearray(size)
    with open(path, "wb") as f:
        f.truncate(size)
        for _ in range(12):
            off = rng.randrange(0, size - 300_000) // 512 * 512
            n = rng.choice([512, 4096, 70_000, BS, 3 * BS + 512])
            data = rng.randbytes(n)
            f.seek(off)
            f.write(data)
            buf[off : off + n] = data
        f.seek(8 * MiB)
        f.write(bytes(MiB))  # written zeros: data to SEEK_DATA, free to the pool
        buf[8 * MiB : 9 * MiB] = bytes(MiB)
        tail = rng.randbytes(BS)
        f.seek(size - BS)
        f.write(tail)
        buf[size - BS :] = tail
    return bytes(buf)


def _holes(path: Path) -> set[int]:
    """Indexes of the BS blocks of a file that are holes."""
    size = path.stat().st_size
    data: set[int] = set()
    with open(path, "rb") as f:
        fd, pos = f.fileno(), 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            data.update(range(start // BS, -(-end // BS)))
            pos = end
    return set(range(-(-size // BS))) - data


def _nonzero_blocks(image: bytes) -> int:
    return sum(1 for i in range(0, len(image), BS) if any(image[i : i + BS]))


@contextmanager
def _qemu_nbd(image: Path, socket: Path, *args: str) -> Iterator[str]:
    """A real qemu-nbd serving image on a unix socket: the peer source or target."""
    proc = subprocess.Popen(["qemu-nbd", "--socket", str(socket), "--persistent", *args, str(image)])
    try:
        for _ in range(200):
            if socket.exists():
                break
            time.sleep(0.05)
        yield f"nbd+unix:///?socket={socket}"
    finally:
        proc.terminate()
        proc.wait(10)


# ----- import and export ----------------------------------------------------------------


def test_import_then_export_keeps_bytes_and_holes(tmp_path: Path) -> None:
    """Offline (the command opens the pool): only non-zero blocks cost pool space, and the
    exported file has a hole wherever the source had one."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    src = tmp_path / "src.raw"
    image = _write_image(src, SIZE, 1)
    result = json.loads(thinblock("import", str(src), pool, "v", "--json").stdout)
    assert result["created"] and result["size_bytes"] == SIZE
    assert result["zero_bytes_skipped"] >= MiB
    used = json.loads(thinblock("pool", "status", pool, "--json").stdout)["used_bytes"]
    assert used == _nonzero_blocks(image) * BS  # zeros, written or not, cost nothing
    out = tmp_path / "out.raw"
    thinblock("export", pool, "v", str(out))
    assert out.read_bytes() == image
    assert _holes(src) <= _holes(out)  # holes stay holes (and written zeros became holes)
    assert 8 * MiB // BS in _holes(out)
    assert export_bytes(pool, "v") == image
    # An existing destination is kept unless --force.
    refused = thinblock("export", pool, "v", str(out), check=False)
    assert refused.returncode == 2 and "exists: pass --force" in refused.stderr
    thinblock("export", pool, "v", str(out), "--force")
    assert out.read_bytes() == image
    thinblock("pool", "check", pool)


def test_import_from_qcow2_nbd_and_stdin_into_a_served_pool(tmp_path: Path) -> None:
    """Online: the server does the work on the files the command opened."""
    src = tmp_path / "src.raw"
    image = _write_image(src, SIZE, 2)
    qcow = tmp_path / "src.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(src), str(qcow)], check=True)
    with served_pool(tmp_path, "512M", {}) as served:
        pool = served.pool
        thinblock("import", str(qcow), pool, "q")
        assert export_bytes(pool, "q") == image
        with _qemu_nbd(src, tmp_path / "peer.sock", "--read-only", "--format=raw") as uri:
            thinblock("import", uri, pool, "n")
        assert export_bytes(pool, "n") == image
        with open(src, "rb") as stdin:
            proc = subprocess.run(
                [sys.executable, "-m", "thinblock", "import", "-", pool, "s", "--size", "32M", "--json"],
                stdin=stdin,
                capture_output=True,
                env=ENV,
                timeout=120,
            )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["read_bytes"] == SIZE
        assert export_bytes(pool, "s") == image
        # Into an NBD export served by qemu-nbd, and qemu-img agrees with the bytes.
        target = tmp_path / "target.raw"
        with open(target, "wb") as f:
            f.truncate(SIZE)
        with _qemu_nbd(target, tmp_path / "target.sock", "--format=raw") as uri:
            thinblock("export", pool, "q", uri)
        assert target.read_bytes() == image
        compare = subprocess.run(
            ["qemu-img", "compare", "-f", "raw", "-F", "qcow2", str(target), str(qcow)], capture_output=True, text=True
        )
        assert compare.returncode == 0, compare.stdout + compare.stderr
        assert "Traceback" not in served.log.read_text()
    assert not list(tmp_path.glob("*.sock")) or True


def test_import_refused_at_its_end_says_import(tmp_path: Path) -> None:
    """A client that opens the volume while an import into it runs makes the swap at
    the end refuse, in the import's words (it said "cannot import a diff into"), and
    the volume keeps the client's bytes."""
    with served_pool(tmp_path, "256M", {"v": "16M"}) as served:
        h = connect(served, "v")
        h.pwrite(b"a" * MiB, 0)
        h.flush()
        h.shutdown()
        proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "import", "-", served.pool, "v", "--force", "--size", "16M"],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        assert proc.stdin is not None
        proc.stdin.write("b" * (8 * MiB))
        proc.stdin.flush()
        time.sleep(1.0)  # the import has started and waits for the rest
        h = connect(served, "v")
        try:
            proc.stdin.write("b" * (8 * MiB))
            proc.stdin.close()
            assert proc.wait(120) == 1
            assert proc.stderr is not None
            err = proc.stderr.read()
            assert "cannot import into volume v: it is open by 1 client(s)" in err, err
            assert h.pread(MiB, 0) == b"a" * MiB
        finally:
            h.shutdown()


def test_import_refusals_change_nothing(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    src = tmp_path / "src.raw"
    image = _write_image(src, SIZE, 3)
    thinblock("volume", "create", pool, "v", "--size", "32M")
    thinblock("volume", "create", pool, "small", "--size", "16M")
    dirty = tmp_path / "dirty.raw"
    dirty.write_bytes(b"\xaa" * SIZE)
    thinblock("import", str(dirty), pool, "v", "--force")
    before = export_bytes(pool, "v")

    def refused(*args: str, says: str, status: int = 1) -> None:
        proc = thinblock(*args, check=False)
        assert proc.returncode == status, proc.stderr
        assert says in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr  # one sentence

    refused("import", str(src), pool, "v", says="already holds data (32M mapped): pass --force")
    refused("import", str(src), pool, "small", says="the sizes must match")
    odd = tmp_path / "odd.raw"
    odd.write_bytes(b"x" * 1000)
    refused("import", str(odd), pool, "new", says="not a whole number of 512-byte sectors")
    refused("import", str(tmp_path / "missing.raw"), pool, "new", says="cannot open", status=2)
    refused("import", "-", pool, "new", says="needs its size (--size)")
    thinblock("snapshot", "create", pool, "v@s")
    refused("import", str(src), pool, "v@s", says="is a snapshot: import into a volume")
    assert export_bytes(pool, "v") == before
    assert volume_names(pool) == ["small", "v", "v@s"]
    # A stream that ends before the volume does (its producer died half way) is not
    # taken as whole with zeros after it: into a new volume or over an existing one.
    cut = tmp_path / "cut.raw"
    cut.write_bytes(image[: SIZE // 2])
    for target, extra in (("new", ("--size", str(SIZE))), ("v", ("--force",))):
        with open(cut, "rb") as stdin:
            proc = subprocess.run(
                [sys.executable, "-m", "thinblock", "import", "-", pool, target, *extra],
                stdin=stdin,
                capture_output=True,
                text=True,
                env=ENV,
                timeout=120,
            )
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"the stream ended after {SIZE // 2} bytes, short of the volume's" in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr
    assert export_bytes(pool, "v") == before
    assert volume_names(pool) == ["small", "v", "v@s"]
    # --force overwrites, and the source's holes become zeros in the volume.
    thinblock("import", str(src), pool, "v", "--force")
    assert export_bytes(pool, "v") == image
    thinblock("pool", "check", pool)


def test_export_format_rbd_is_read_by_rbd_import(tmp_path: Path, ceph: str) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    src = tmp_path / "src.raw"
    image = _write_image(src, SIZE, 4)
    thinblock("import", str(src), pool, "v")
    stream = tmp_path / "v.rbd"
    thinblock("export", pool, "v", str(stream), "--format", "rbd")
    assert stream.stat().st_size < SIZE // 4  # sparse: data only
    name = f"{ceph}/tb-exp-{os.getpid()}"
    try:
        _rbd("import", "--export-format", "2", str(stream), name)
        got = tmp_path / "back.raw"
        _rbd("export", name, str(got))
        assert got.read_bytes() == image
    finally:
        _rbd("rm", name, check=False)


# ----- rbd diffs --------------------------------------------------------------------------


def _rbd(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["rbd", "--no-progress", *args], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _history(pool: str, tmp_path: Path) -> dict[str, bytes]:
    """Volume v with snapshots v@s1 and v@s2 and more changes after: data, zero
    writes, trims, a grow. Returns the bytes of each."""

    thinblock("volume", "create", pool, "v", "--size", "16M", "--detect-zeroes", "off")
    states: dict[str, bytes] = {}
    model = bytearray(16 * MiB)
    steps: list[list[tuple[str, int, bytes | int]]] = [
        [("w", 0, os.urandom(3 * BS)), ("w", 5 * MiB + 100, os.urandom(70_000)), ("w", 10 * MiB, bytes(2 * BS))],
        [("w", BS, os.urandom(BS)), ("t", 5 * MiB, MiB), ("z", 0, 512), ("w", 12 * MiB, os.urandom(4096))],
        [("t", 0, BS), ("w", 15 * MiB, os.urandom(BS)), ("w", 12 * MiB, bytes(4096))],
    ]
    for i, step in enumerate(steps):
        sock = tmp_path / "h.sock"
        server = Server(pool, "--socket", str(sock), workdir=tmp_path)
        try:
            apply_steps(server, "v", model, step)
        finally:
            server.stop()
        if i < 2:
            thinblock("snapshot", "create", pool, f"v@s{i + 1}")
            states[f"v@s{i + 1}"] = bytes(model)
    states["v"] = bytes(model)
    return states


@pytest.mark.parametrize("version", ["1", "2"])
def test_export_diff_then_import_diff_rebuilds_every_snapshot(tmp_path: Path, version: str) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    states = _history(pool, tmp_path)
    fmt = ("--export-format", version)
    full, incr, head = tmp_path / "full.diff", tmp_path / "s1-s2.diff", tmp_path / "s2-head.diff"
    thinblock("export-diff", pool, "v@s1", str(full), *fmt)
    incr_result = json.loads(
        thinblock("export-diff", pool, "--from-snap", "s1", "v@s2", str(incr), *fmt, "--json").stdout
    )
    assert incr_result["from_snap"] == "s1" and incr_result["to_snap"] == "s2"
    assert incr_result["zero_bytes"] > 0  # the trim and the zeroing are 'z' records
    thinblock("export-diff", pool, "--from-snap", "v@s2", "v", str(head), *fmt)
    assert full.read_bytes().startswith(b"rbd diff v" + version.encode() + b"\n")
    # The incremental diff holds the changed data only, not the volume.
    assert incr.stat().st_size < 2 * MiB
    # A copy in another pool, served: each diff applied in turn gives each state.
    with served_pool(tmp_path / "b", "256M", {"c": "16M"}) as served:
        other = served.pool
        thinblock("import-diff", str(full), other, "c")
        assert export_bytes(other, "c@s1") == states["v@s1"]
        with open(incr, "rb") as stdin:
            proc = subprocess.run(
                [sys.executable, "-m", "thinblock", "import-diff", "-", other, "c", "--json"],
                stdin=stdin,
                capture_output=True,
                text=True,
                env=ENV,
                timeout=120,
            )
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["to_snap"] == "c@s2"
        assert export_bytes(other, "c@s2") == states["v@s2"]
        thinblock("import-diff", str(head), other, "c")
        assert export_bytes(other, "c") == states["v"]
        assert volume_names(other) == ["c", "c@s1", "c@s2"]
    # delta's zero flag says where the later state reads zeros.
    delta = json.loads(thinblock("delta", pool, "v@s1", "v@s2", "--json").stdout)
    assert any(r["zero"] for r in delta["ranges"]) and any(not r["zero"] for r in delta["ranges"])
    for r in delta["ranges"]:
        piece = states["v@s2"][r["offset"] : r["offset"] + r["length"]]
        assert (piece == bytes(len(piece))) == r["zero"] or not r["zero"], r


def _source_at_s1(tmp_path: Path) -> tuple[str, Path, Path]:
    """Pool pX with volume vm (16M of random bytes, also in img.raw) and its snapshot
    vm@s1, and the full diff of vm@s1: (pool, image, diff)."""
    px = str(tmp_path / "pX")
    thinblock("pool", "create", px, "--size", "256M")
    img = tmp_path / "img.raw"
    img.write_bytes(os.urandom(16 * MiB))
    thinblock("import", str(img), px, "vm")
    thinblock("snapshot", "create", px, "vm@s1")
    base = tmp_path / "base.diff"
    thinblock("export-diff", px, "vm@s1", str(base))
    return px, img, base


@pytest.mark.parametrize("head", [False, True])
def test_a_diff_across_a_shrink_ends_at_the_new_size(tmp_path: Path, head: bool) -> None:
    """A volume shrunk between two snapshots reads zeros past its new end compared with
    the older one, but that range is no part of the image: export-diff wrote 'z' records
    there, past its own size record, and import-diff (rightly) refused the diff as
    malformed, so the replica could not follow a shrink. The diff ends at the size, as
    rbd's diff_iterate stops at the to-snapshot's size."""
    px, img, base = _source_at_s1(tmp_path)
    py, inc = str(tmp_path / "pY"), tmp_path / "inc.diff"
    thinblock("pool", "create", py, "--size", "256M")
    thinblock("volume", "create", py, "vm", "--size", "16M")
    thinblock("import-diff", str(base), py, "vm")
    thinblock("volume", "resize", px, "vm", "--size", "8M", "--allow-shrink")
    if not head:
        thinblock("snapshot", "create", px, "vm@s2")
    result = json.loads(
        thinblock("export-diff", px, "--from-snap", "s1", "vm" if head else "vm@s2", str(inc), "--json").stdout
    )
    assert (result["size_bytes"], result["data_bytes"], result["zero_bytes"]) == (8 * MiB, 0, 0)
    thinblock("import-diff", str(inc), py, "vm", "--allow-resize")
    assert export_bytes(py, "vm") == img.read_bytes()[: 8 * MiB]
    assert export_bytes(py, "vm@s1") == img.read_bytes()


def _small_diff(pool: str, tmp_path: Path) -> tuple[bytes, bytes]:
    """(a v1 diff from s1 to s2 of volume v, the bytes of v@s1) in a fresh pool."""
    thinblock("pool", "create", pool, "--size", "128M")
    thinblock("volume", "create", pool, "v", "--size", "4M")
    a = tmp_path / "a.raw"
    a.write_bytes(os.urandom(BS) + bytes(4 * MiB - BS))
    thinblock("import", str(a), pool, "v", "--force")
    thinblock("snapshot", "create", pool, "v@s1")
    b = tmp_path / "b.raw"
    b.write_bytes(bytes(BS) + os.urandom(2 * BS) + bytes(4 * MiB - 3 * BS))
    thinblock("import", str(b), pool, "v", "--force")
    thinblock("snapshot", "create", pool, "v@s2")
    out = tmp_path / "d.diff"
    thinblock("export-diff", pool, "--from-snap", "s1", "v@s2", str(out))
    return out.read_bytes(), a.read_bytes()


def test_an_rbd_snapshot_name_thinblock_cannot_take_is_named_as_rbd_wrote_it(tmp_path: Path) -> None:
    """rbd allows snapshot names thinblock does not (a timestamp's ':', a space), and
    `rbd snap create img@$(date -Iseconds)` is common. Such a diff (or image stream) is
    refused before anything is applied, and the sentence says it is the diff's snapshot
    and how to get past it, where it named only VOLUME@SNAP as if the user had typed it."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "v", "--size", "1M")
    snap = b"2026-12-03T17:00:00+00:00"
    diff = tmp_path / "rbd.diff"
    diff.write_bytes(
        b"rbd diff v1\nt"
        + struct.pack("<I", len(snap))
        + snap
        + b"s"
        + struct.pack("<Q", MiB)
        + b"w"
        + struct.pack("<QQ", 0, 4)
        + b"abcd"
        + b"e"
    )
    proc = thinblock("import-diff", str(diff), pool, "v", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "the diff ends at snapshot '2026-12-03T17:00:00+00:00'" in proc.stderr, proc.stderr
    assert "rbd snap rename" in proc.stderr, proc.stderr
    assert volume_names(pool) == ["v"] and export_bytes(pool, "v") == bytes(MiB)


def test_malformed_truncated_and_mismatched_diffs_change_nothing(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    diff, s1 = _small_diff(pool, tmp_path)
    # The target: volume c at v@s1's state with its own c@s1.
    thinblock("volume", "clone", pool, "v@s1", "c")
    thinblock("snapshot", "create", pool, "c@s1")
    names = volume_names(pool)

    def refused(stream: bytes, says: str, *extra: str, volume: str = "c") -> None:
        path = tmp_path / "bad.diff"
        path.write_bytes(stream)
        proc = thinblock("import-diff", str(path), pool, volume, *extra, check=False)
        assert proc.returncode == 1, (says, proc.stdout, proc.stderr)
        assert says in proc.stderr, (says, proc.stderr)
        assert proc.stderr.count("\n") == 1, proc.stderr
        assert export_bytes(pool, "c") == s1
        assert volume_names(pool) == names  # no snapshot taken, no staging volume left

    # Every cut of the stream short of its end record is refused.
    header = len(b"rbd diff v1\n")
    cuts = sorted({0, 3, header, header + 1, header + 7, 40, 60, len(diff) // 2, len(diff) - BS, len(diff) - 1})
    for cut in cuts:
        refused(diff[:cut], "truncated rbd diff")
    refused(b"rbd diff v3\n" + diff[header:], "not an rbd diff stream")
    refused(b"GARBAGE" * 10, "not an rbd diff stream")
    refused(diff + b"x", "bytes follow its end ('e') record")
    refused(diff[:-1] + b"?e", "unknown record tag")
    size_record = header + 7 + 7  # after 'f' and 't', each 1 + 4 + len("s1")
    assert diff[size_record : size_record + 1] == b"s"
    oversize = diff[: size_record + 1] + struct.pack("<Q", BS) + diff[size_record + 9 :]
    refused(oversize, "ends past the image size", "--allow-resize")  # a diff that resizes: allowed here
    refused(diff[: size_record + 9] + diff[size_record : size_record + 9] + diff[size_record + 9 :], "two size")
    # No size record: valid, as for rbd import-diff, and the volume keeps its size;
    # its records are then checked against that size.
    no_size = diff[:size_record] + diff[size_record + 9 :]
    thinblock("volume", "create", pool, "small", "--size", "64K")
    thinblock("snapshot", "create", pool, "small@s1")
    names = volume_names(pool)
    refused(no_size, "ends past the image size 65536", volume="small")
    # Mismatches: a missing from-snapshot, a to-snapshot that exists, a changed volume.
    thinblock("volume", "create", pool, "bare", "--size", "4M")
    names = volume_names(pool)
    path = tmp_path / "d.diff"
    proc = thinblock("import-diff", str(path), pool, "bare", check=False)
    assert proc.returncode == 1 and "has no snapshot 's1'" in proc.stderr
    thinblock("snapshot", "create", pool, "c@s2")
    names = volume_names(pool)
    refused(diff, "'c@s2' already exists")
    thinblock("snapshot", "remove", pool, "c@s2")
    thinblock("import-diff", str(path), pool, "c")  # now it applies
    assert export_bytes(pool, "c@s2") == export_bytes(pool, "v@s2")
    thinblock("snapshot", "remove", pool, "c@s2")
    thinblock("volume", "rollback", pool, "c", "c@s1")
    path.with_suffix(".nosize").write_bytes(no_size)
    thinblock("import-diff", str(path.with_suffix(".nosize")), pool, "c")  # so does one without a size record
    assert export_bytes(pool, "c@s2") == export_bytes(pool, "v@s2")
    thinblock("volume", "rollback", pool, "c", "c@s1")
    thinblock("snapshot", "remove", pool, "c@s2")
    other = tmp_path / "o.raw"
    other.write_bytes(os.urandom(4096) + bytes(4 * MiB - 4096))
    thinblock("import", str(other), pool, "c", "--force")
    proc = thinblock("import-diff", str(path), pool, "c", check=False)
    assert proc.returncode == 1 and "has changed since snapshot c@s1" in proc.stderr
    thinblock("import-diff", str(path), pool, "c", "--force")
    thinblock("pool", "check", pool)


def test_a_diff_starts_only_from_a_snapshot_of_its_own_volume(tmp_path: Path) -> None:
    """--from-snap s1 for vm@s2 is vm's s1 (vm@s1, or a snapshot s1 taken of vm), never
    another volume's snapshot that happens to be called s1: a diff from that, written as
    "s1", applied cleanly to a copy's vm@s1 and left it silently wrong. A from-snapshot
    of another volume (or of the snapshot a clone came from) is refused in one sentence
    with nothing written, and import-diff resolves the 'f' record the same way."""
    px, py = str(tmp_path / "pX"), str(tmp_path / "pY")
    thinblock("pool", "create", px, "--size", "256M")
    thinblock("pool", "create", py, "--size", "256M")
    img1, img2 = tmp_path / "img1.raw", tmp_path / "img2.raw"
    img1.write_bytes(os.urandom(16 * MiB))
    img2.write_bytes(os.urandom(8 * MiB) + bytes(8 * MiB))  # zeros where img1 has data
    thinblock("import", str(img1), px, "vm")
    thinblock("snapshot", "create", px, "vm@s1")
    thinblock("import", str(img2), px, "other")
    thinblock("snapshot", "create", px, "other", "s1")  # a snapshot called just s1, of other
    thinblock("snapshot", "create", px, "other@s1")
    thinblock("import", str(img2), px, "vm", "--force")
    thinblock("snapshot", "create", px, "vm@s2")
    base, inc = tmp_path / "base.diff", tmp_path / "inc.diff"
    thinblock("export-diff", px, "vm@s1", str(base))
    thinblock("volume", "create", py, "vm", "--size", "16M")
    thinblock("import-diff", str(base), py, "vm")
    result = json.loads(thinblock("export-diff", px, "--from-snap", "s1", "vm@s2", str(inc), "--json").stdout)
    thinblock("import-diff", str(inc), py, "vm")
    assert export_bytes(py, "vm@s2") == img2.read_bytes()
    assert (result["from_snap"], result["to_snap"]) == ("s1", "s2")
    assert result["zero_bytes"] == 8 * MiB  # from vm@s1: img1's second half became zeros

    names = volume_names(px)

    def refused(says: str, *args: str) -> None:
        out = tmp_path / "refused.diff"
        proc = thinblock("export-diff", px, *args, str(out), check=False)
        assert proc.returncode == 1, (args, proc.stdout, proc.stderr)
        assert says in proc.stderr and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert not out.exists()  # nothing written
        assert volume_names(px) == names

    # Another volume's snapshot, by its full name or as the only s1 there is.
    refused("snapshot other@s1 was taken of volume other, not of volume vm", "--from-snap", "other@s1", "vm@s2")
    thinblock("volume", "create", px, "w", "--size", "16M")
    thinblock("snapshot", "create", px, "w@t")
    names = volume_names(px)
    refused("snapshot s1 was taken of volume other, not of volume w", "--from-snap", "s1", "w@t")
    # A clone's history starts at its own snapshots: the one it was cloned from is its origin's.
    thinblock("volume", "clone", px, "vm@s2", "cl")
    thinblock("snapshot", "create", px, "cl@c1")
    names = volume_names(px)
    refused("snapshot vm@s2 was taken of volume vm, not of volume cl", "--from-snap", "vm@s2", "cl@c1")
    refused("volume cl has no snapshot 's2'", "--from-snap", "s2", "cl@c1")
    # Two snapshots of vm that a diff would both call s3: which one a copy holds is unknown.
    thinblock("snapshot", "create", px, "vm", "s3")
    thinblock("snapshot", "create", px, "vm@s3")
    names = volume_names(px)
    refused("snapshots s3 and vm@s3 of volume vm would both be 's3'", "--from-snap", "s3", "vm")
    # A renamed snapshot is still vm's (lineage is by id), under the name it has now,
    # and that name is what import-diff then looks for.
    thinblock("snapshot", "rename", px, "vm@s1", "keep")
    result = json.loads(
        thinblock("export-diff", px, "--from-snap", "keep", "vm@s2", str(inc), "--force", "--json").stdout
    )
    assert result["from_snap"] == "keep"
    proc = thinblock("import-diff", str(inc), py, "vm", check=False)
    assert proc.returncode == 1 and "volume vm has no snapshot 'keep'" in proc.stderr, proc.stderr

    # import-diff: a copy's c@s1 that was taken of another volume is not c's s1.
    thinblock("volume", "create", py, "q", "--size", "16M")
    thinblock("snapshot", "create", py, "q@s1")
    thinblock("volume", "create", py, "c", "--size", "16M")
    thinblock("snapshot", "rename", py, "q@s1", "c@s1")
    before = volume_names(py)
    diff = tmp_path / "s1-s2.diff"
    thinblock("export-diff", px, "--from-snap", "vm@s2", "vm", str(diff))  # a diff from s2; rename s2 -> s1 in it
    stream = diff.read_bytes()
    from_record = b"f" + struct.pack("<I", 2) + b"s2"
    assert from_record in stream
    diff.write_bytes(stream.replace(from_record, b"f" + struct.pack("<I", 2) + b"s1", 1))
    proc = thinblock("import-diff", str(diff), py, "c", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "snapshot c@s1 was taken of volume q, not of volume c" in proc.stderr, proc.stderr
    assert volume_names(py) == before
    assert export_bytes(py, "c") == bytes(16 * MiB)
    thinblock("pool", "check", px)
    thinblock("pool", "check", py)


@pytest.mark.parametrize("change", ["write", "resize"])
def test_a_write_during_import_diff_is_never_discarded(tmp_path: Path, change: str) -> None:
    """A client that writes to the volume (and disconnects) while import-diff reads its
    stream was told its write was done: adopting the diff used to swap the volume's
    contents for the staging volume's, taken when the job started, and the write
    silently vanished. The job is refused instead, changing nothing, as a volume
    changed since the from-snapshot is refused before it starts; the rerun works."""
    px, img, base = _source_at_s1(tmp_path)
    inc = tmp_path / "inc.diff"
    thinblock("import", str(img), px, "vm", "--force")
    thinblock("snapshot", "create", px, "vm@s2")
    thinblock("export-diff", px, "--from-snap", "s1", "vm@s2", str(inc))
    stream = inc.read_bytes()
    with served_pool(tmp_path / "b", "256M", {"vm": "16M"}) as served:
        py = served.pool
        thinblock("import-diff", str(base), py, "vm")
        proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "import-diff", "-", py, "vm", "--no-progress"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=ENV,
        )
        assert proc.stdin is not None
        # 8M through a 64K pipe: once the write returns, the job is reading its stream.
        proc.stdin.write(stream[: len(stream) // 2])
        proc.stdin.flush()
        written = bytearray(img.read_bytes())
        if change == "write":
            h = connect(served, "vm", ())
            h.pwrite(b"w" * BS, 12 * MiB)
            h.flush()
            h.shutdown()
            written[12 * MiB : 12 * MiB + BS] = b"w" * BS
        else:
            thinblock("volume", "resize", py, "vm", "--size", "20M")
            written += bytes(4 * MiB)
        out, err = proc.communicate(stream[len(stream) // 2 :], timeout=120)
        assert proc.returncode == 1, (out, err)
        assert "it was written while the job ran" in err.decode() and err.decode().count("\n") == 1, err
        assert export_bytes(py, "vm") == bytes(written)  # the write is there
        assert volume_names(py) == ["vm", "vm@s1"]
        thinblock("volume", "rollback", py, "vm", "vm@s1")
        thinblock("import-diff", str(inc), py, "vm")
        assert export_bytes(py, "vm@s2") == export_bytes(px, "vm@s2")


def test_a_killed_import_diff_leaves_the_volume_as_it_was(tmp_path: Path) -> None:
    """SIGKILL in the middle: the staging volume is gone at the next open, the volume unchanged."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    thinblock("volume", "create", pool, "v", "--size", "64M")
    big = tmp_path / "big.raw"
    big.write_bytes(os.urandom(48 * MiB) + bytes(16 * MiB))
    thinblock("import", str(big), pool, "v", "--force")
    thinblock("snapshot", "create", pool, "v@s1")
    diff = tmp_path / "full.diff"
    thinblock("export-diff", pool, "v@s1", str(diff))
    thinblock("volume", "create", pool, "c", "--size", "64M")
    proc = subprocess.Popen(
        [sys.executable, "-m", "thinblock", "import-diff", "-", pool, "c"],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    assert proc.stdin is not None
    data = diff.read_bytes()
    proc.stdin.write(data[: len(data) // 2])
    proc.stdin.flush()
    time.sleep(1.5)  # it is applying what it got and waits for the rest
    proc.kill()
    proc.wait()
    assert volume_names(pool) == ["c", "v", "v@s1"]  # opening the pool removed the staging volume
    assert export_bytes(pool, "c") == bytes(64 * MiB)
    thinblock("pool", "check", pool)


def test_rbd_interop_both_ways(tmp_path: Path, ceph: str) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    states = _history(pool, tmp_path)
    image = f"{ceph}/tb-diff-{os.getpid()}"
    back = f"{ceph}/tb-back-{os.getpid()}"
    try:
        # thinblock -> rbd: rbd import-diff applies our diffs, snapshot by snapshot.
        _rbd("create", image, "--size", "16M")
        for from_snap, to, name in ((None, "v@s1", "a"), ("s1", "v@s2", "b"), ("s2", "v", "c")):
            path = tmp_path / f"{name}.diff"
            extra = ("--from-snap", from_snap) if from_snap else ()
            thinblock("export-diff", pool, *extra, to, str(path))
            _rbd("import-diff", str(path), image)
        for snap in ("s1", "s2"):
            out = tmp_path / f"rbd-{snap}.raw"
            _rbd("export", f"{image}@{snap}", str(out))
            assert out.read_bytes() == states[f"v@{snap}"]
        head = tmp_path / "rbd-head.raw"
        _rbd("export", image, str(head))
        assert head.read_bytes() == states["v"]
        # rbd -> thinblock: rbd export-diff applied by thinblock import-diff.
        thinblock("volume", "create", pool, "r", "--size", "16M")
        for from_snap, to, name in ((None, f"{image}@s1", "x"), ("s1", f"{image}@s2", "y"), ("s2", image, "z")):
            path = tmp_path / f"{name}.rdiff"
            extra = ("--from-snap", from_snap) if from_snap else ()
            _rbd("export-diff", *extra, to, str(path))
            thinblock("import-diff", str(path), pool, "r")
        assert export_bytes(pool, "r@s1") == states["v@s1"]
        assert export_bytes(pool, "r@s2") == states["v@s2"]
        assert export_bytes(pool, "r") == states["v"]
        # rbd's own image export (every snapshot in it) read by thinblock import.
        image_stream = tmp_path / "img.rbd"
        _rbd("export", "--export-format", "2", image, str(image_stream))
        result = json.loads(thinblock("import", str(image_stream), pool, "i", "--json").stdout)
        assert result["snapshots"] == ["i@s1", "i@s2"]
        assert export_bytes(pool, "i@s1") == states["v@s1"]
        assert export_bytes(pool, "i@s2") == states["v@s2"]
        assert export_bytes(pool, "i") == states["v"]
        # A damaged image stream leaves nothing behind.
        cut = tmp_path / "cut.rbd"
        cut.write_bytes(image_stream.read_bytes()[: image_stream.stat().st_size // 2])
        proc = thinblock("import", str(cut), pool, "j", "--format", "rbd", check=False)
        assert proc.returncode == 1 and "truncated" in proc.stderr, proc.stderr
        assert not [n for n in volume_names(pool) if n.startswith("j")]
        # rbd's image import of our rbd-format export.
        stream = tmp_path / "v.rbd"
        thinblock("export", pool, "v@s2", str(stream), "--format", "rbd")
        _rbd("import", "--export-format", "2", str(stream), back)
        out = tmp_path / "back.raw"
        _rbd("export", back, str(out))
        assert out.read_bytes() == states["v@s2"]
    finally:
        for name in (image, back):
            _rbd("snap", "purge", name, check=False)
            _rbd("rm", name, check=False)
    thinblock("pool", "check", pool)


# ----- sparsify ---------------------------------------------------------------------------


def test_sparsify_online_frees_zero_blocks_and_keeps_every_byte(tmp_path: Path) -> None:
    import nbd

    with served_pool(tmp_path, "256M", {}) as served:
        pool = served.pool
        thinblock("volume", "create", pool, "v", "--size", "64M", "--detect-zeroes", "off")
        h = connect(served, "v")
        model = bytearray(64 * MiB)
        for i in range(0, 32 * MiB, BS):
            piece = bytes(BS) if (i // BS) % 2 else os.urandom(BS)  # half the blocks hold zeros
            h.pwrite(piece, i)
            model[i : i + BS] = piece
        h.flush()
        thinblock("snapshot", "create", pool, "v@keep")  # shares everything written so far
        for i in range(32 * MiB, 48 * MiB, BS):
            h.pwrite(bytes(BS), i)  # zeros the volume holds alone
        h.flush()
        data_file = Path(pool) / "data"
        host_before = data_file.stat().st_blocks
        before = json.loads(thinblock("pool", "status", pool, "--json").stdout)
        # A client keeps writing elsewhere while sparsify runs.
        writer = nbd.NBD()
        writer.connect_uri(served.unix_uri("v"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "volume", "sparsify", pool, "v", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        tail = os.urandom(BS)
        while proc.poll() is None:
            writer.pwrite(tail, 60 * MiB)
        model[60 * MiB : 60 * MiB + BS] = tail
        out, err = proc.communicate()
        assert proc.returncode == 0, err
        result = json.loads(out)
        assert result["unmapped_bytes"] == 16 * MiB  # the zeros it held alone
        assert result["shared_zero_bytes"] == 16 * MiB  # those the snapshot shares stay
        assert result["freed_bytes"] == 16 * MiB
        after = json.loads(thinblock("pool", "status", pool, "--json").stdout)
        assert before["used_bytes"] - after["used_bytes"] == 16 * MiB - BS  # less the block the writer added
        assert h.pread(64 * MiB, 0) == bytes(model)
        assert data_file.stat().st_blocks < host_before - (8 * MiB) // 512  # back to the host too
        refused = thinblock("volume", "sparsify", pool, "v@keep", check=False)
        assert refused.returncode == 1 and "snapshots are read-only" in refused.stderr
        h.shutdown()
        writer.shutdown()


# ----- progress -----------------------------------------------------------------------------


def _on_a_terminal(args: list[str]) -> tuple[int, str]:
    """Run thinblock with stderr (and stdin) on a pseudo-terminal; what the terminal showed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal has a size
    proc = subprocess.Popen(
        [sys.executable, "-m", "thinblock", *args],
        stdin=slave,
        stdout=subprocess.DEVNULL,
        stderr=slave,
        env=ENV,
    )
    os.close(slave)
    shown = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                chunk = b""
            shown += chunk
            if not chunk and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(), shown.decode(errors="replace")


def test_progress_shows_on_a_terminal_only(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    src = tmp_path / "src.raw"
    src.write_bytes(os.urandom(64 * MiB))
    status, shown = _on_a_terminal(["import", str(src), pool, "v"])
    assert status == 0, shown
    assert "import" in shown and "64.0M/64.0M" in shown and "100%" in shown, shown
    assert "/s" in shown  # a rate (and tqdm's time left)
    status, shown = _on_a_terminal(["export", pool, "v", str(tmp_path / "o.raw"), "--no-progress"])
    assert status == 0 and "%" not in shown, shown
    # Not a terminal: nothing but the summary.
    proc = thinblock("volume", "sparsify", pool, "v")
    assert proc.stderr == ""
    assert proc.stdout.startswith("sparsified v:")


def test_recovery_at_open_and_repair_show_progress_on_a_terminal(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    src = tmp_path / "src.raw"
    src.write_bytes(os.urandom(MiB))
    thinblock("import", str(src), pool, "v")  # a mapping page for repair to read
    server = Server(pool)
    server.proc.kill()  # an unclean shutdown: the next open punches the free space
    server.proc.wait()
    status, shown = _on_a_terminal(["volume", "list", pool])
    assert status == 0 and "recovering free space" in shown and "100%" in shown, shown
    status, shown = _on_a_terminal(["volume", "list", pool])
    assert status == 0 and "recovering" not in shown, shown  # closed cleanly since: nothing to show
    status, shown = _on_a_terminal(["pool", "repair", pool])
    assert status == 0 and "repair: reading mappings" in shown, shown


def test_a_job_whose_command_dies_stops_and_the_server_lives(tmp_path: Path) -> None:
    with served_pool(tmp_path, "256M", {}) as served:
        pool = served.pool
        reader, writer = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "import", "-", pool, "v", "--size", "64M"],
            stdin=reader,
            stderr=subprocess.DEVNULL,
            env=ENV,
        )
        os.close(reader)
        os.write(writer, os.urandom(4 * MiB))
        time.sleep(1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while "went away" not in served.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert volume_names(pool) == []  # nothing of the import shows (its staging volume is gone)
        os.close(writer)
        assert served.alive()
        assert "went away" in served.log.read_text()


def test_a_full_destination_or_a_full_pool_fails_cleanly(tmp_path: Path) -> None:
    """The layer below fails: a full filesystem under the export, a pool too small for
    the diff. One sentence, nothing half-made left, the pool as it was."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    src = tmp_path / "src.raw"
    src.write_bytes(os.urandom(16 * MiB))
    thinblock("import", str(src), pool, "v")
    thinblock("snapshot", "create", pool, "v@s1")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(small)], check=True)
    try:
        for args in (("export", pool, "v", str(small / "out.raw")), ("export-diff", pool, "v@s1", str(small / "d"))):
            proc = thinblock(*args, check=False)
            assert proc.returncode == 1, proc.stderr
            assert "No space left on device" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
            assert list(small.iterdir()) == []  # the half-written file is gone
    finally:
        subprocess.run(["umount", str(small)], check=True)
    diff = tmp_path / "full.diff"
    thinblock("export-diff", pool, "v@s1", str(diff))
    tiny = str(tmp_path / "tiny")
    thinblock("pool", "create", tiny, "--size", "8M")
    thinblock("volume", "create", tiny, "c", "--size", "16M")
    proc = thinblock("import-diff", str(diff), tiny, "c", check=False)
    assert proc.returncode == 1 and "out of space" in proc.stderr, proc.stderr
    assert volume_names(tiny) == ["c"]
    assert json.loads(thinblock("pool", "status", tiny, "--json").stdout)["used_bytes"] == 0
    proc = thinblock("import", str(src), tiny, "d", check=False)
    assert proc.returncode == 1 and "out of space" in proc.stderr, proc.stderr
    assert volume_names(tiny) == ["c"]  # the volume the import made is removed again
    thinblock("pool", "check", tiny)


def test_export_of_a_live_volume_is_one_moment(tmp_path: Path) -> None:
    """A client rewrites every block in turn (always in one shuffled order), each
    round with the next generation. An exported image must be one moment of that:
    the blocks of the newer generation are a prefix of the order, never a mix."""
    import random
    import threading

    import nbd

    blocks = 512
    order = list(range(blocks))
    random.Random(5).shuffle(order)
    with served_pool(tmp_path, "256M", {"v": f"{blocks * BS // MiB}M"}) as served:
        h = nbd.NBD()
        h.connect_uri(served.unix_uri("v"))
        for b in range(blocks):
            h.pwrite(struct.pack("<Q", 1) * (BS // 8), b * BS)
        stop = threading.Event()
        rounds = [0]

        def rewrite() -> None:
            gen = 2
            while not stop.is_set():
                for b in order:
                    h.pwrite(struct.pack("<Q", gen) * (BS // 8), b * BS)
                gen += 1
                rounds[0] += 1

        writer = threading.Thread(target=rewrite)
        writer.start()
        try:
            images = [export_bytes(served.pool, "v") for _ in range(4)]
        finally:
            stop.set()
            writer.join()
        for image in images:
            gens = [struct.unpack_from("<Q", image, b * BS)[0] for b in range(blocks)]
            for b in range(blocks):
                assert image[b * BS : (b + 1) * BS] == struct.pack("<Q", gens[b]) * (BS // 8), f"block {b} torn"
            low = min(gens)
            newer = {b for b in range(blocks) if gens[b] == low + 1}
            assert set(gens) <= {low, low + 1}, sorted(set(gens))
            assert newer == set(order[: len(newer)]), "the image mixes two moments"
        h.shutdown()
        assert volume_names(served.pool) == ["v"]  # the export's snapshot is gone


def test_export_diff_piped_into_import_diff_on_one_pool(tmp_path: Path) -> None:
    """`export-diff POOL ... - | import-diff - POOL ...` with no server: whichever
    command opens the pool offers its control socket while its job runs, and the
    other's job runs in its process. The diff is larger than a pipe holds."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "512M")
    src = tmp_path / "src.raw"
    src.write_bytes(os.urandom(24 * MiB) + bytes(8 * MiB))
    thinblock("import", str(src), pool, "v")
    thinblock("snapshot", "create", pool, "v@s1")
    thinblock("volume", "create", pool, "w", "--size", "32M")
    tb = f"{sys.executable} -m thinblock"
    proc = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{tb} export-diff {pool} v@s1 - | {tb} import-diff - {pool} w"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert export_bytes(pool, "w@s1") == src.read_bytes()
    assert volume_names(pool) == ["v", "v@s1", "w", "w@s1"]
    thinblock("pool", "check", pool)


@pytest.mark.parametrize(
    ("verb", "after", "kind", "outcome"),
    [
        ("pwritev", 0, "eio", "nothing"),  # writing the staging copy
        ("pwritev", 0, "short", "nothing"),
        ("flush", 0, "eio", "nothing"),  # the data sync of the staging copy's commit
        ("flush", 1, "eio", "nothing"),  # the sync before adoption
        ("commit", 0, "eio", "nothing"),  # the staging copy's commit
        ("commit", 1, "eio", "nothing"),
        ("commit", 2, "eio", "nothing"),
        ("commit", 3, "eio", "all"),  # adoption's own commit: pending, then written whole
    ],
)
def test_the_layer_below_failing_under_import_diff_changes_nothing(
    tmp_path: Path, verb: str, after: int, kind: str, outcome: str
) -> None:
    """The data store or a metadata commit fails somewhere in an import-diff (while
    the staging copy is made, written, synced or adopted): the command fails, no
    staging volume stays, the pool checks clean, also after it is opened again, and
    the volume is as it was. Only when adoption's own commit fails is the adoption,
    made in memory, written by the next commit: then whole (the pool's rule for a
    failed commit), with its snapshot, never a part of the diff."""
    from tests.faults import Fault, FaultyMeta, FaultyStore, install
    from thinblock.core.pool import Pool
    from thinblock.core.snapshot import clone, create_snapshot
    from thinblock.meta.base import MetadataStore
    from thinblock.progress import no_progress
    from thinblock.tools.check import check_metadata
    from thinblock.transfer import diffs
    from thinblock.transfer.images import StreamReader, StreamWriter

    path = str(tmp_path / "pool")
    pool = Pool.create(path, 64 * BS * 8, block_size=BS)
    v = pool.create_volume("v", 32 * BS)
    v.write(0, os.urandom(8 * BS))
    create_snapshot(pool, "v", "v@s1")
    v.write(4 * BS, os.urandom(10 * BS))
    v.trim(0, BS)
    create_snapshot(pool, "v", "v@s2")
    diff = tmp_path / "d.diff"
    with open(diff, "wb") as f:
        diffs.export_diff(pool, "v@s2", "s1", StreamWriter(os.dup(f.fileno()), "d"), no_progress)
    clone(pool, "v@s1", "c")
    create_snapshot(pool, "c", "c@s1")
    pool.close()
    pool = Pool.open(path, autocommit=False)  # commits only when asked: the fault hits the import's own
    before = pool.volume("c").read(0, 32 * BS)
    names = sorted(pool.visible())
    store, meta = FaultyStore(pool.store), FaultyMeta(pool.meta)
    install(pool, meta=meta, store=store)
    (meta if verb == "commit" else store).arm(Fault((verb,), after, kind))
    with pytest.raises(Exception), open(diff, "rb") as f:  # noqa: B017 (an OSError or a sentence: any failure)
        diffs.import_diff(pool, "c", StreamReader(os.dup(f.fileno()), "d"), no_progress)
    assert store.fired or meta.fired, "the fault never fired"
    store.arm(None)
    meta.arm(None)
    if outcome == "all":
        before = pool.volume("v@s2").read(0, 32 * BS)
        names = sorted([*names, "c@s2"])
    assert pool.volume("c").read(0, 32 * BS) == before
    assert sorted(pool.visible()) == names
    pool.commit()
    assert not [n for n in pool.volumes if n.startswith(".")]  # the staging volume is gone
    pool.close()
    with Pool.open(path) as again:
        assert again.volume("c").read(0, 32 * BS) == before
        assert sorted(again.volumes) == names
        checked: MetadataStore = again.meta
        assert check_metadata(checked) == []
