"""A pool owns its data, and its metadata never goes back in time unnoticed
(store/owned.py): real `thinblock serve` processes write and flush through libnbd,
the metadata is copied, rolled back or taken from another pool by hand, and the
next open must refuse it in one sentence; `pool repair --accept-rollback` then
gives a pool in which no volume reads another volume's bytes.

The foreign-bytes scenario: a 16-block pool, volume a fills blocks 0-7 with "A"
(the older metadata is taken then); afterwards a is trimmed, the frees become
durable, and volume b fills all 16 blocks with "B", so it reuses a's old
dblocks. Older metadata served over that data would show b's bytes in a."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import nbd
import pytest

from tests.cli import thinblock
from tests.conftest import new_rados_locator
from tests.nbd_server import Server

BS = 64 << 10
POOL_BLOCKS = 16
A, B = b"A" * BS, b"B" * BS
META = ("metadata.sqlite", "metadata.sqlite-wal", "metadata.sqlite-shm")


def _handle(server: Server, name: str) -> nbd.NBD:
    h = nbd.NBD()
    h.connect_uri(server.unix_uri(name))
    return h


def _make_pool(pool: str) -> None:
    thinblock("pool", "create", pool, "--size", str(POOL_BLOCKS * BS))
    thinblock("volume", "create", pool, "a", "--size", "1M")
    thinblock("volume", "create", pool, "b", "--size", "1M")


def _write_a(pool: str) -> None:
    """a holds "A" in its first 8 blocks, flushed; the server stops cleanly."""
    server = Server(pool)
    try:
        h = _handle(server, "a")
        for i in range(8):
            h.pwrite(A, i * BS)
        h.flush()
        h.shutdown()
    finally:
        server.stop()


def _trim_a_fill_b(server: Server) -> None:
    """a's blocks are freed (committed, punched, synced), then b takes every block."""
    a, b = _handle(server, "a"), _handle(server, "b")
    a.trim(8 * BS, 0)
    a.flush()  # the commit that frees them
    a.flush()  # the sync that makes their punch durable: allocatable again
    for i in range(POOL_BLOCKS):
        b.pwrite(B, i * BS)
    b.flush()
    a.shutdown()
    b.shutdown()


def _refused(pool: str) -> str:
    proc = thinblock("volume", "list", pool, check=False)
    assert proc.returncode == 1, f"opened: {proc.stdout}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("thinblock: error:"), proc.stderr
    return lines[0]


def _read_all(pool: str, name: str) -> bytes:
    server = Server(pool)
    try:
        h = _handle(server, name)
        data = h.pread(h.get_size(), 0)
        h.shutdown()
        return bytes(data)
    finally:
        server.stop()


def _accept_and_verify(pool: str) -> None:
    """repair --accept-rollback: a no longer reads b's bytes, pool check is clean."""
    out = json.loads(thinblock("pool", "repair", pool, "--accept-rollback", "--json").stdout)
    assert any("given out after generation" in s for s in out["lost"]), out
    thinblock("pool", "check", pool)
    a = _read_all(pool, "a")
    assert b"B" not in a, "volume a reads volume b's bytes after accepting the rollback"
    check = json.loads(thinblock("pool", "check", pool, "--json").stdout)
    assert check["ok"] and check["generation"]["data_store"] <= check["generation"]["metadata"], check


def _rollback_sentence(line: str) -> None:
    assert "older than its data store" in line and "--accept-rollback" in line, line


def test_wal_deleted_after_sigkill_is_refused(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    _make_pool(pool)
    _write_a(pool)  # checkpointed into metadata.sqlite when it closed
    server = Server(pool)
    _trim_a_fill_b(server)  # these commits are only in the WAL
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    assert os.path.getsize(Path(pool) / "metadata.sqlite-wal") > 0
    for name in META[1:]:
        (Path(pool) / name).unlink()
    _rollback_sentence(_refused(pool))
    problems = json.loads(thinblock("pool", "check", pool, "--json", check=False).stdout)
    assert not problems["ok"] and any("older than its data store" in p for p in problems["problems"]), problems
    _accept_and_verify(pool)


def test_older_metadata_copied_back_is_refused(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    _make_pool(pool)
    _write_a(pool)
    old = tmp_path / "old.sqlite"
    shutil.copy(Path(pool) / "metadata.sqlite", old)
    server = Server(pool)
    try:
        _trim_a_fill_b(server)
    finally:
        server.stop()
    shutil.copy(old, Path(pool) / "metadata.sqlite")
    _rollback_sentence(_refused(pool))
    # plain repair does not accept it either
    proc = thinblock("pool", "repair", pool, check=False)
    assert proc.returncode == 1 and "--accept-rollback" in proc.stderr, proc.stderr
    _accept_and_verify(pool)


def test_directory_copied_while_served_is_refused(tmp_path: Path) -> None:
    """cp -r of a served pool, made deterministic: the metadata files are copied
    first, more is written and flushed, then the data file is copied."""
    pool, copy = tmp_path / "pool", tmp_path / "copy"
    _make_pool(str(pool))
    _write_a(str(pool))
    server = Server(str(pool))
    try:
        copy.mkdir(mode=0o700)
        for name in META:
            if (pool / name).exists():
                shutil.copy(pool / name, copy / name)
        _trim_a_fill_b(server)
        subprocess.run(["cp", "--sparse=always", str(pool / "data"), str(copy / "data")], check=True)
    finally:
        server.stop()
    _rollback_sentence(_refused(str(copy)))
    thinblock("pool", "check", str(pool))  # the original is untouched
    _accept_and_verify(str(copy))


def test_lost_data_store_generation_never_refuses(tmp_path: Path) -> None:
    """A power cut that loses only the header writes of the last commits (the data
    store's generation falls behind the metadata's): the pool opens, check is clean."""
    pool = tmp_path / "pool"
    _make_pool(str(pool))
    size = os.path.getsize(pool / "data")
    with open(pool / "data", "rb") as f:  # the header as of the create
        f.seek(size - 4096)
        early = f.read(4096)
    early_generation = json.loads(thinblock("pool", "check", str(pool), "--json").stdout)["generation"]["data_store"]
    _write_a(str(pool))
    server = Server(str(pool))
    _trim_a_fill_b(server)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    with open(pool / "data", "r+b") as f:  # as if no header write since the create reached the disk
        f.seek(size - 4096)
        f.write(early)
    check = json.loads(thinblock("pool", "check", str(pool), "--json").stdout)
    assert check["ok"], check
    generation = check["generation"]
    assert generation["data_store"] == early_generation < generation["metadata"], generation
    text = thinblock("pool", "check", str(pool)).stdout
    assert f"generation: metadata {generation['metadata']}, data store {early_generation}" in text, text
    assert _read_all(str(pool), "b") == B * POOL_BLOCKS
    # the next commit brings the data store's generation up again
    check = json.loads(thinblock("pool", "check", str(pool), "--json").stdout)
    assert check["generation"]["data_store"] == check["generation"]["metadata"], check


def test_copied_rados_metadata_object_is_refused(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """`rados cp thinblock.P1 thinblock.P2` gives P2 P1's metadata and so P1's data
    prefix: P2 is refused, and P1 keeps every byte."""
    p1 = new_rados_locator(request, "own1")
    p2 = new_rados_locator(request, "own2")
    ceph_pool, name1 = p1[len("rados:") :].split("/")
    name2 = p2.split("/")[1]
    thinblock("pool", "create", p1, "--size", "16M")
    thinblock("volume", "create", p1, "v", "--size", "4M")
    work = tmp_path / "w"
    work.mkdir()
    server = Server(p1, "--socket", str(work / "p1.sock"), workdir=work)
    try:
        h = _handle(server, "v")
        h.pwrite(A * 8, 0)
        h.flush()
        h.shutdown()
    finally:
        server.stop()
    subprocess.run(
        ["rados", "-c", os.environ["CEPH_CONF"], "-p", ceph_pool, "cp", f"thinblock.{name1}", f"thinblock.{name2}"],
        check=True,
        capture_output=True,
    )
    line = _refused(p2)
    assert "belongs to another pool" in line and p1 in line, line
    proc = thinblock("serve", p2, "--socket", str(work / "p2.sock"), check=False)
    assert proc.returncode == 1 and "belongs to another pool" in proc.stderr, proc.stderr
    check = json.loads(thinblock("pool", "check", p2, "--json", check=False).stdout)
    assert not check["ok"] and any("belongs to another pool" in p for p in check["problems"]), check
    thinblock("pool", "check", p1)
    server = Server(p1, "--socket", str(work / "p1.sock"), workdir=work)
    try:
        h = _handle(server, "v")
        assert h.pread(8 * BS, 0) == A * 8
        h.shutdown()
    finally:
        server.stop()


def test_two_directories_naming_one_device(tmp_path: Path, loop_file: tuple[str, Path]) -> None:
    """A pool directory copied while its data is a raw device: both name the device.
    Once the original writes, the copy's metadata is older than the device and is
    refused; the original keeps serving every byte."""
    dev, _backing = loop_file
    pool, copy = tmp_path / "pool", tmp_path / "copy"
    thinblock("pool", "create", str(pool), "--data", dev, "--size", str(POOL_BLOCKS * BS))
    thinblock("volume", "create", str(pool), "a", "--size", "1M")
    thinblock("volume", "create", str(pool), "b", "--size", "1M")
    subprocess.run(["cp", "-r", str(pool), str(copy)], check=True)
    _write_a(str(pool))
    line = _refused(str(copy))
    _rollback_sentence(line)
    assert _read_all(str(pool), "a")[: 8 * BS] == A * 8
    thinblock("pool", "check", str(pool))
    # A device too small for the pool and its header is refused at create.
    proc = thinblock("pool", "create", str(tmp_path / "big"), "--data", dev, "--size", "64M", check=False)
    assert proc.returncode == 1 and "header" in proc.stderr, proc.stderr


def test_power_cut_losing_the_generation_write_never_refuses(tmp_path: Path) -> None:
    """A real power cut (tests/powercut_fs.py) right after a flush: the metadata commit
    was synced, the header write after it was not, so the data store's generation is
    one behind after the cut. The pool opens, checks clean and serves the flushed bytes."""
    from tests.test_power_cut import rig

    with rig(tmp_path, {"v": "4M"}) as r:
        r.serve()
        h = r.connect("v")
        h.pwrite(A * 8, 0)
        h.flush()
        r.cut()
        r.restart()  # pool check passes
        generation = json.loads(thinblock("pool", "check", r.pool, "--json").stdout)["generation"]
        assert generation["data_store"] < generation["metadata"], generation
        assert _read_all_at(r.pool, tmp_path / "sock", "v", 8 * BS) == A * 8


def _read_all_at(pool: str, socket: Path, name: str, length: int) -> bytes:
    server = Server(pool, "--socket", str(socket), workdir=socket.parent)
    try:
        h = _handle(server, name)
        data = bytes(h.pread(length, 0))
        h.shutdown()
        return data
    finally:
        server.stop()


def test_accept_rollback_after_sharers_went(tmp_path: Path) -> None:
    """The older metadata has a, its snapshot s and the clone c of s sharing a's
    blocks; afterwards a and s are removed and c overwrites those blocks in place
    (they became c's alone). Accepting the older metadata must not show c's bytes
    in a or s."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", str(POOL_BLOCKS * BS))
    thinblock("volume", "create", pool, "a", "--size", "1M")
    _write_a(pool)
    thinblock("snapshot", "create", pool, "a", "s")
    thinblock("volume", "clone", pool, "s", "c")
    old = tmp_path / "old.sqlite"
    shutil.copy(Path(pool) / "metadata.sqlite", old)
    thinblock("volume", "remove", pool, "a")
    thinblock("snapshot", "remove", pool, "s")
    server = Server(pool)
    try:
        h = _handle(server, "c")
        for i in range(8):
            h.pwrite(b"C" * BS, i * BS)
        h.flush()
        h.shutdown()
    finally:
        server.stop()
    shutil.copy(old, Path(pool) / "metadata.sqlite")
    _rollback_sentence(_refused(pool))
    thinblock("pool", "repair", pool, "--accept-rollback")
    thinblock("pool", "check", pool)
    for name in ("a", "s", "c"):
        assert b"C" not in _read_all(pool, name), f"{name} reads c's bytes after accepting the rollback"


def test_restoring_an_older_dump_shows_no_reused_block(tmp_path: Path) -> None:
    """A dump is one generation's metadata: restored after its blocks were freed and
    given to another volume, it is a rollback, and restore drops what was reused."""
    pool = str(tmp_path / "pool")
    _make_pool(pool)
    _write_a(pool)
    dump = tmp_path / "older.dump"
    thinblock("pool", "dump", pool, "-o", str(dump))
    server = Server(pool)
    try:
        _trim_a_fill_b(server)
    finally:
        server.stop()
    proc = thinblock("pool", "restore", pool, str(dump))
    assert "restored under a data store of generation" in proc.stderr, proc.stderr
    thinblock("pool", "check", pool)
    assert b"B" not in _read_all(pool, "a"), "a restored older dump shows volume b's bytes in a"
    # A dump that does not say which generation it is of cannot be judged: refused.
    text = "\n".join(
        " ".join(w for w in line.split(" ") if not w.startswith("transaction_id="))
        for line in dump.read_text().splitlines()
    )
    blind = tmp_path / "blind.dump"
    blind.write_text(text + "\n")
    refused = thinblock("pool", "restore", pool, str(blind), check=False)
    assert refused.returncode == 1 and "does not record the generation" in refused.stderr, refused.stderr
