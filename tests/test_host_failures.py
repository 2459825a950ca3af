"""The layer below failing for real: a full host disk, a truncated data file,
damaged or foreign metadata, a read-only pool directory, a pool the host
cannot hold. Real processes, real filesystems (a small loop-mounted ext4)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import time
from pathlib import Path

import nbd
import pytest

from tests.cli import thinblock
from tests.nbd_server import Server, connect
from tests.smallfs import host_free, remount, small_ext4
from tests.test_attach import env, sh
from thinblock import Pool
from thinblock.store.owned import tail_bytes

MiB = 1 << 20
BS = 64 << 10
# A line of serve's log (logsetup's text format), as opposed to what it says to a person.
_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ thinblock\.[a-z.]+ [a-z]+: ")
__all__ = ["env"]  # the attach tests' fixture: no mount, loop device or daemon outlives a test


def _pattern(tag: int, n: int) -> bytes:
    return bytes([tag]) * n


def test_full_host_disk_through_nbd(tmp_path: Path) -> None:
    """Fill the host under a served pool: clean ENOSPC, nothing flushed lost, failed
    copy-on-write leaves the old bytes, freed space reaches the host at once, and
    writing resumes without a restart."""
    with small_ext4(tmp_path, 40) as mnt:
        pool = str(mnt / "pool")
        created = thinblock("pool", "create", pool, "--size", "256M")
        assert "larger than the host filesystem" in created.stderr  # a warning, not a failure
        thinblock("volume", "create", pool, "disk", "--size", "200M")
        server = Server(pool)
        try:
            h = connect(server)
            a = _pattern(0xA1, 4 * MiB)
            h.pwrite(a, 0)
            h.flush()
            thinblock("snapshot", "create", pool, "disk", "snap")
            # Fill the host with flushed data beyond the snapshot's range.
            written: list[int] = []
            offset = 8 * MiB
            while True:
                try:
                    h.pwrite(_pattern(0xB2, MiB), offset)
                    h.flush()
                except nbd.Error as exc:
                    assert exc.errno in ("ENOSPC", "EIO"), exc
                    break
                written.append(offset)
                offset += MiB
                assert offset < 200 * MiB, "the host never filled"
            assert written, "nothing fit on the host"
            # Overwrites of snapshot-shared blocks need fresh space: ENOSPC, old bytes stay.
            for off in range(0, 4 * MiB, 256 << 10):
                with pytest.raises(nbd.Error) as info:
                    h.pwrite(_pattern(0xC3, 4096), off + 4096)
                assert info.value.errno == "ENOSPC"
            assert h.pread(4 * MiB, 0) == a
            for off in written:
                assert h.pread(MiB, off) == _pattern(0xB2, MiB)
            status = json.loads(thinblock("pool", "status", pool, "--json").stdout)
            # The host filled: either a data write hit it first (slack still held), or a
            # commit did and the 4 MiB slack was given back for it; both are full hosts.
            slack_out = 4 * MiB if status["metadata_slack_bytes"] == 0 else 0
            assert status["host_free_bytes"] < 2 * MiB + slack_out, status
            # Trim gives the space back to the host promptly, with no restart.
            free_before = host_free(mnt)
            h.trim(len(written) * MiB, 8 * MiB)
            deadline = time.monotonic() + 30  # "promptly": no restart needed; a loaded machine commits slowly
            while host_free(mnt) < free_before + len(written) * MiB // 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert host_free(mnt) >= free_before + len(written) * MiB // 2, "freed space did not reach the host"
            # Writing resumes on its own (the metadata slack is taken back first).
            deadline = time.monotonic() + 30
            while True:
                try:
                    h.pwrite(_pattern(0xC3, 4096), 4096)
                    break
                except nbd.Error:
                    assert time.monotonic() < deadline, "writes did not resume"
                    time.sleep(0.2)
            h.flush()
            expected = bytearray(a)
            expected[4096:8192] = _pattern(0xC3, 4096)
            assert h.pread(4 * MiB, 0) == bytes(expected)
            h.shutdown()
        finally:
            server.stop()
        log = server.log.read_text()
        assert "Traceback" not in log, log
        thinblock("pool", "check", pool)
        with Pool.open(pool) as p:
            assert p.volume("disk").read(0, 4 * MiB) == bytes(expected)
            assert p.volume("snap").read(0, 4 * MiB) == a


def test_truncated_data_file_is_refused_then_repaired(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    with Pool.create(pool, 64 * MiB) as p:
        vol = p.create_volume("v", 32 * MiB)
        vol.write(0, _pattern(1, 4 * MiB))
        vol.write(20 * MiB, _pattern(2, 4 * MiB))  # lands beyond 1 MiB of the data file
    data = tmp_path / "pool" / "data"
    os.truncate(data, MiB)
    for args in (("serve", pool), ("volume", "list", pool)):
        out = thinblock(*args, check=False)
        assert out.returncode == 1 and "truncated" in out.stderr, out.stderr
    check = thinblock("pool", "check", pool, check=False)
    assert check.returncode == 1 and "truncated" in check.stdout
    repaired = json.loads(thinblock("pool", "repair", pool, "--json").stdout)
    assert any("lost tail" in s for s in repaired["lost"])
    assert any("extended" in s for s in repaired["lost"])
    assert os.path.getsize(data) == 64 * MiB + tail_bytes(64 * MiB // (64 << 10))  # the blocks, then the owner header
    thinblock("pool", "check", pool)
    with Pool.open(pool) as p:
        got = p.volume("v").read(0, 32 * MiB)
    # What the data file still held is intact; what it lost reads zeros, never garbage.
    assert got[:MiB] == _pattern(1, MiB)
    assert set(got[MiB:]) <= {0, 1, 2}


@pytest.mark.parametrize("offset", [16, 28, 40, 52, 96])
def test_damaged_metadata_header_is_one_sentence(tmp_path: Path, offset: int) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "16M")
    thinblock("volume", "create", pool, "v", "--size", "8M")
    db = tmp_path / "pool" / "metadata.sqlite"
    with open(db, "r+b") as f:
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in f.read(8)))
    for args in (("pool", "status", pool), ("volume", "list", pool), ("pool", "check", pool)):
        out = thinblock(*args, check=False)  # asserts no traceback
        if out.returncode == 0:
            continue  # SQLite did not need the damaged bytes for this command
        assert out.stderr.count("\n") <= 2, out.stderr
    try:
        server = Server(pool)
    except RuntimeError as exc:  # refused: one sentence, no traceback
        assert "Traceback" not in str(exc) and "error:" in str(exc), exc
    else:
        server.stop()  # SQLite did not need the damaged bytes: it served


def test_foreign_metadata_is_refused(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    pool.mkdir()
    conn = sqlite3.connect(pool / "metadata.sqlite")
    conn.execute("CREATE TABLE photos (id INTEGER, name TEXT)")
    conn.commit()
    conn.close()
    (pool / "data").write_bytes(b"")
    for args in (("serve", str(pool)), ("pool", "status", str(pool)), ("pool", "repair", str(pool))):
        out = thinblock(*args, check=False)
        assert out.returncode == 1 and "thinblock pool" in out.stderr, out.stderr


def test_read_only_pool_directory(tmp_path: Path) -> None:
    with small_ext4(tmp_path, 16) as mnt:
        pool = str(mnt / "pool")
        thinblock("pool", "create", pool, "--size", "64M")
        thinblock("volume", "create", pool, "v", "--size", "8M")
        dump = tmp_path / "dump.txt"
        thinblock("pool", "dump", pool, "-o", str(dump))
        remount(mnt, read_only=True)
        try:
            # check reads the last commit; every command that would change the pool says
            # why it cannot, in one sentence.
            thinblock("pool", "check", pool)
            for args in (
                ("serve", pool),
                ("volume", "create", pool, "w", "--size", "1M"),
                ("volume", "remove", pool, "v"),
                ("snapshot", "create", pool, "v", "s"),
                ("pool", "grow", pool, "--size", "128M"),
                ("pool", "repair", pool),
                ("pool", "restore", pool, str(dump)),
                ("pool", "status", pool),
            ):
                out = thinblock(*args, check=False)
                assert out.returncode == 1 and "read-only" in out.stderr.lower(), (args, out.stderr)
                # serve logs its steps at info (the pool's opening began): the error
                # itself is still one sentence, and nothing else complains.
                said = [line for line in out.stderr.splitlines() if not _LOG_LINE.match(line)]
                assert len(said) == 1, out.stderr
        finally:
            remount(mnt, read_only=False)


def test_pool_the_host_cannot_hold(tmp_path: Path) -> None:
    with small_ext4(tmp_path, 16) as mnt:
        pool = str(mnt / "pool")
        out = thinblock("pool", "create", pool, "--size", "1P", check=False)
        assert out.returncode == 1 and "largest file" in out.stderr, out.stderr
        assert not os.path.exists(pool), "a failed create left debris"
        os.mkdir(pool)  # an existing empty directory is kept, and stays empty
        out = thinblock("pool", "create", pool, "--size", "1P", check=False)
        assert out.returncode == 1 and os.listdir(pool) == []
        thinblock("pool", "create", pool, "--size", "8M")  # a retry works
        out = thinblock("pool", "grow", pool, "--size", "1P", check=False)
        assert out.returncode == 1 and "largest file" in out.stderr, out.stderr
        grown = thinblock("pool", "grow", pool, "--size", "1G")
        assert "larger than the host filesystem" in grown.stderr
        thinblock("pool", "check", pool)


def test_low_water_mark_watches_the_host(tmp_path: Path) -> None:
    """The pool's low-water mark also fires, as `host-low-water`, when the host has
    less free space than that share of the pool (the pool itself is nearly empty)."""
    events = tmp_path / "events"
    with small_ext4(tmp_path, 40) as mnt, Pool.create(str(mnt / "pool"), 256 * MiB) as pool:
        pool.set_policy(
            {"low_water": 20, "on_low_water": f'echo "$THINBLOCK_EVENT $THINBLOCK_HOST_FREE_BYTES" >> {events}'}
        )
        pool.create_volume("v", 64 * MiB).write(0, b"x" * MiB)
        deadline = time.monotonic() + 30
        while not (events.exists() and events.read_text().strip()):
            assert time.monotonic() < deadline, "no host-low-water event"
            time.sleep(0.05)
        kind, free = events.read_text().split()
        assert kind == "host-low-water" and int(free) < 40 * MiB


def test_full_host_disk_through_an_attached_device(env: Path) -> None:
    """The same through a kernel block device: dd fills the host and gets an error,
    what was synced before stays, blkdiscard gives the space back to the host at
    once, and writing resumes."""
    with small_ext4(env, 40) as mnt:
        pool = str(mnt / "pool")
        thinblock("pool", "create", pool, "--size", "256M")
        thinblock("volume", "create", pool, "v", "--size", "128M")
        keep = env / "keep.bin"
        keep.write_bytes(os.urandom(4 * MiB))
        dev = thinblock("attach", pool, "v").stdout.strip()
        try:
            sh("dd", f"if={keep}", f"of={dev}", "bs=1M", "oflag=direct", "conv=fsync")
            fill = sh("dd", "if=/dev/urandom", f"of={dev}", "bs=1M", "seek=8", "oflag=direct", ok=False)
            assert fill.returncode != 0, "the host never filled"
            assert host_free(mnt) < 2 * MiB
            free_before = host_free(mnt)
            sh("blkdiscard", "-o", str(8 * MiB), dev)
            deadline = time.monotonic() + 30
            while host_free(mnt) < free_before + 8 * MiB and time.monotonic() < deadline:
                time.sleep(0.05)
            assert host_free(mnt) >= free_before + 8 * MiB, "freed space did not reach the host"
            deadline = time.monotonic() + 30
            while sh(
                "dd", f"if={keep}", f"of={dev}", "bs=1M", "seek=16", "oflag=direct", "conv=fsync", ok=False
            ).returncode:
                assert time.monotonic() < deadline, "writes did not resume"
                time.sleep(0.2)
            back = sh("sh", "-c", f"dd if={dev} bs=1M count=4 iflag=direct status=none | sha256sum").stdout.split()[0]
            assert back == hashlib.sha256(keep.read_bytes()).hexdigest()
        finally:
            thinblock("detach", dev)
        thinblock("pool", "check", pool)
