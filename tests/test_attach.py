"""Kernel block devices on thin volumes: FUSE + loop, real mkfs, mount, fstrim, e2fsck."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli import fuse_daemon_pids, stop_pid, thinblock

MiB = 1 << 20
GiB = 1 << 30


def sh(*cmd: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, f"{cmd}: {proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private runtime dir; afterwards every mount, loop device and daemon of the test is gone."""
    run = tmp_path / "run"
    monkeypatch.setenv("THINBLOCK_RUNTIME_DIR", str(run))
    yield tmp_path
    # Loop devices first, while their backing files still show their paths: once the
    # FUSE mount is gone (lazily), a loop's backing file reads as "/NAME" and no longer
    # names this test. Then the mounts, then any daemon of this test still running.
    out = subprocess.run(["losetup", "--json", "--list"], capture_output=True, text=True).stdout
    for dev in json.loads(out)["loopdevices"] if out.strip() else []:
        if str(tmp_path) in (dev.get("back-file") or ""):
            subprocess.run(["losetup", "-d", dev["name"]], check=False)
    with open("/proc/mounts") as f:
        mounts = [line.split()[1] for line in f if str(tmp_path) in line.split()[1]]
    daemons = fuse_daemon_pids(run)  # before unmounting: a daemon that exits removes nothing, detach does
    for target in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], check=False)
    for pid in daemons:  # by pid only: never a pattern over every process on the machine
        stop_pid(pid, "fuse-daemon")


def _loop_files() -> list[tuple[str, str]]:
    out = subprocess.run(["losetup", "--json", "--list"], capture_output=True, text=True).stdout
    return [(d["name"], d.get("back-file") or "") for d in json.loads(out)["loopdevices"]] if out.strip() else []


def make_pool(root: Path, *volumes: tuple[str, str], size: str = "8G") -> str:
    pool = str(root / "pool")
    thinblock("pool", "create", pool, "--size", size)
    for name, vsize in volumes:
        thinblock("volume", "create", pool, name, "--size", vsize)
    return pool


def volume(pool: str, name: str) -> dict[str, Any]:
    return json.loads(thinblock("volume", "info", pool, name, "--json").stdout)


def sync_volume(env_root: Path, name: str) -> None:
    """fsync the volume's FUSE file: the daemon commits, so status is current."""
    (mnt,) = (env_root / "run").glob("*/mnt")
    fd = os.open(mnt / name, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def sparse_loop_usage(root: Path, size: int, mkfs: list[str]) -> int:
    """Host bytes a format takes on a loop device over a plain sparse file (upstream's setup)."""
    img = root / f"sparse-{mkfs[0]}.img"
    with open(img, "wb") as f:
        f.truncate(size)
    dev = sh("losetup", "--find", "--show", str(img)).stdout.strip()
    try:
        sh(*mkfs, dev)
    finally:
        sh("losetup", "-d", dev)
    used = os.stat(img).st_blocks * 512
    img.unlink()
    return used


def test_thinblock_mkfs_on_200g_uses_almost_nothing(env: Path) -> None:
    pool = make_pool(env, ("big", "200G"))
    result = json.loads(thinblock("mkfs", pool, "big", "--json").stdout)
    assert result["prezeroed_hint"] is True
    assert "assume_storage_prezeroed=1" in " ".join(result["command"])
    assert result["percent_of_volume"] <= 0.02, result
    assert json.loads(thinblock("attach", "--list", "--json").stdout) == []  # mkfs detached again
    dev = thinblock("attach", pool, "big").stdout.strip()
    assert sh("e2fsck", "-fn", dev).returncode == 0
    thinblock("detach", dev)


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_plain_mkfs_uses_no_more_than_a_sparse_file(env: Path, fs: str) -> None:
    pool = make_pool(env, ("v", "200G"))
    dev = thinblock("attach", pool, "v").stdout.strip()
    cmd = ["mke2fs", "-q", "-t", "ext4", "-F"] if fs == "ext4" else ["mkfs.xfs", "-q", "-f"]
    sh(*cmd, dev)
    sync_volume(env, "v")
    used = volume(pool, "v")["mapped_bytes"]
    thinblock("detach", dev)
    sparse = sparse_loop_usage(env, 200 * GiB, cmd)
    assert used <= sparse * 1.02, (used, sparse)


def trim_until_it_frees_nothing(env_root: Path, pool: str, mnt: Path, bound: int, rounds: int = 10) -> int:
    """fstrim until the volume is within bound, or two rounds in a row free nothing; the
    volume's mapped bytes then. XFS does not discard extents still busy in its log
    (freed in a checkpoint not yet on disk), so under load one fstrim may miss
    them: each round first pushes the log out (sync, then a freeze and thaw, which
    checkpoints it) and then trims."""
    mapped = volume(pool, "v")["mapped_bytes"]
    idle = 0  # rounds in a row that freed nothing
    for _ in range(rounds):
        sh("sync")
        sh("fsfreeze", "-f", str(mnt))
        sh("fsfreeze", "-u", str(mnt))
        sh("fstrim", str(mnt))
        sync_volume(env_root, "v")
        before, mapped = mapped, volume(pool, "v")["mapped_bytes"]
        idle = idle + 1 if mapped >= before else 0
        if mapped <= bound or idle == 2:
            break
    return int(mapped)


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_files_roundtrip_then_fstrim_returns_space(env: Path, fs: str) -> None:
    pool = make_pool(env, ("v", "200G"))
    result = json.loads(thinblock("mkfs", pool, "v", "-t", fs, "--json").stdout)
    empty = result["volume_mapped_bytes"]
    dev = thinblock("attach", pool, "v").stdout.strip()
    mnt = env / "mnt"
    mnt.mkdir()
    sh("mount", dev, str(mnt))
    sums = {}
    for i in range(12):
        data = os.urandom((i + 1) * 1024 * 1024 + i * 4097)
        (mnt / f"f{i}").write_bytes(data)
        sums[f"f{i}"] = hashlib.sha256(data).hexdigest()
    sh("sync")
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    for name, digest in sums.items():
        assert hashlib.sha256((mnt / name).read_bytes()).hexdigest() == digest
    sync_volume(env, "v")
    assert volume(pool, "v")["data_bytes"] >= 78 * MiB
    detach = thinblock("detach", dev, check=False)  # refused while mounted
    assert detach.returncode == 1 and "mounted" in detach.stderr
    for name in sums:
        (mnt / name).unlink()
    after = trim_until_it_frees_nothing(env, pool, mnt, bound=empty + 4 * MiB)
    sh("umount", str(mnt))
    if fs == "ext4":
        sh("e2fsck", "-fn", dev)
    else:
        sh("xfs_repair", "-n", dev)
    assert after <= empty + 4 * MiB, (after, empty)
    thinblock("detach", dev)
    assert thinblock("pool", "check", pool).returncode == 0


def test_volume_with_data_never_gets_the_hint(env: Path) -> None:
    pool = make_pool(env, ("v", "10G"))
    dev = thinblock("attach", pool, "v").stdout.strip()
    sh("dd", "if=/dev/urandom", f"of={dev}", "bs=64K", "count=1", "seek=1000", "oflag=direct", "status=none")
    thinblock("detach", dev)
    result = json.loads(thinblock("mkfs", pool, "v", "--force", "--json").stdout)
    assert result["prezeroed_hint"] is False and result["storage_was_zero"] is False
    assert "assume_storage_prezeroed" not in " ".join(result["command"])


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
def test_mkfs_refuses_a_volume_that_holds_data(env: Path, fs: str) -> None:
    """Both filesystems refuse alike, naming what they found, unless --force."""
    pool = make_pool(env, ("raw", "1G"), ("hasxfs", "1G"), ("hasext4", "1G"))
    dev = thinblock("attach", pool, "raw").stdout.strip()
    sh("dd", "if=/dev/urandom", f"of={dev}", "bs=64K", "count=3", "seek=100", "oflag=direct", "status=none")
    thinblock("detach", dev)
    thinblock("mkfs", pool, "hasxfs", "-t", "xfs", "--", "-L", "keepme")
    thinblock("mkfs", pool, "hasext4", "-t", "ext4")
    before = {v["name"]: v["data_bytes"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout)}
    for name, found in (
        ("raw", "holds 196608 bytes of data (192K)"),
        ("hasxfs", "holds a filesystem signature: xfs labelled 'keepme'"),
        ("hasext4", "holds a filesystem signature: ext4 (blkid)"),
    ):
        refused = thinblock("mkfs", pool, name, "-t", fs, check=False)
        assert refused.returncode == 1 and found in refused.stderr and "--force" in refused.stderr, refused.stderr
    after = {v["name"]: v["data_bytes"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout)}
    assert after == before  # nothing was written
    dev = thinblock("attach", pool, "hasxfs").stdout.strip()
    assert sh("blkid", "-o", "value", "-s", "LABEL", dev).stdout.strip() == "keepme"
    thinblock("detach", dev)
    assert json.loads(thinblock("attach", "--list", "--json").stdout) == []  # refusing detached again
    thinblock("mkfs", pool, "hasxfs", "-t", fs, "--force")
    dev = thinblock("attach", pool, "hasxfs").stdout.strip()
    assert sh("blkid", "-o", "value", "-s", "TYPE", dev).stdout.strip() == fs
    thinblock("detach", dev)


def test_mkfs_refuses_a_snapshot_before_attaching_it(env: Path) -> None:
    """A snapshot is read-only: mkfs says so in one sentence (it used to attach it and,
    with --force, pass mke2fs's 'Operation not permitted while setting up superblock' on),
    and attaches nothing; an empty snapshot is refused too."""
    pool = make_pool(env, ("v", "64M"), ("empty", "64M"))
    dev = thinblock("attach", pool, "v").stdout.strip()
    sh("dd", "if=/dev/urandom", f"of={dev}", "bs=64K", "count=2", "oflag=direct", "status=none")
    thinblock("detach", dev)
    thinblock("snapshot", "create", pool, "v@s")
    thinblock("snapshot", "create", pool, "empty@s")
    for name, extra in (("v@s", ["--force"]), ("v@s", []), ("empty@s", []), ("empty@s", ["-t", "xfs", "--force"])):
        refused = thinblock("mkfs", pool, name, *extra, check=False)
        assert refused.returncode == 1, refused
        assert refused.stderr == (
            f"thinblock: error: cannot format {name}: it is a snapshot, read-only; clone it"
            f" ('thinblock volume clone POOL {name} NEWVOLUME') and format the clone\n"
        ), refused.stderr
        assert json.loads(thinblock("attach", "--list", "--json").stdout) == []
    assert volume(pool, "v@s")["data_bytes"] == 2 * 65536


def test_detach_refuses_a_device_a_process_holds_open(env: Path) -> None:
    """As rbd unmap and dmsetup remove say EBUSY: a device open by a process (not a
    mount) is refused, naming the process, and stays attached. It used to print
    'detached' after 10 s while the kernel kept the device until the process closed it,
    and then the pool's FUSE daemon stayed behind holding the pool with no device."""
    pool = make_pool(env, ("v", "64M"))
    dev = thinblock("attach", pool, "v").stdout.strip()
    holder = subprocess.Popen(
        [
            "python3",
            "-c",
            f"import os, sys, time; fd = os.open({dev!r}, os.O_RDWR); print(flush=True); time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "\n"  # it has the device open
        refused = thinblock("detach", dev, check=False)
        assert refused.returncode == 1, refused
        assert refused.stderr == (
            f"thinblock: error: cannot detach {dev}: it is open by pid {holder.pid} (python3): close it first\n"
        ), refused.stderr
        refused = thinblock("detach", pool, "v", check=False)
        assert refused.returncode == 1 and f"open by pid {holder.pid} (python3)" in refused.stderr, refused.stderr
        (listed,) = json.loads(thinblock("attach", "--list", "--json").stdout)
        assert (listed["device"], listed["state"]) == (dev, "attached")
    finally:
        holder.kill()
        holder.wait()
    assert thinblock("detach", dev).stdout == f"detached {dev}\n"
    assert json.loads(thinblock("attach", "--list", "--json").stdout) == []
    deadline = time.monotonic() + 30
    while fuse_daemon_pids(env / "run") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fuse_daemon_pids(env / "run") == []  # the daemon let go of the pool
    thinblock("pool", "remove", pool, "--yes")


def test_attach_list_of_a_pool_shows_only_that_pool(env: Path) -> None:
    """`attach --list POOL [NAME]` shows that pool's devices (of that volume), as
    `losetup -j FILE` does; the pool used to be taken and ignored, listing every pool's."""
    one = make_pool(env, ("a", "64M"), ("b", "64M"))
    other = str(env / "other")
    thinblock("pool", "create", other, "--size", "1G")
    thinblock("volume", "create", other, "a", "--size", "64M")
    devs = {(one, "a"): "", (one, "b"): "", (other, "a"): ""}
    for pool, name in devs:
        devs[pool, name] = thinblock("attach", pool, name).stdout.strip()

    def listed(*args: str) -> set[tuple[str, str, str]]:
        rows = json.loads(thinblock("attach", "--list", *args, "--json").stdout)
        return {(r["device"], r["pool"], r["volume"]) for r in rows}

    assert listed() == {(d, os.path.realpath(p), n) for (p, n), d in devs.items()}
    assert listed(one) == {(devs[one, n], os.path.realpath(one), n) for n in ("a", "b")}
    assert listed(other, "a") == {(devs[other, "a"], os.path.realpath(other), "a")}
    assert listed(one, "nosuch") == set()
    text = thinblock("attach", "--list", other).stdout
    assert text == f"{devs[other, 'a']}  {os.path.realpath(other)}  a\n", text
    refused = thinblock("attach", "--list", str(env / "nopool"), check=False)
    assert refused.returncode == 1 and "no pool at" in refused.stderr, refused.stderr
    for dev in devs.values():
        thinblock("detach", dev)


def test_zero_writes_through_the_loop_device_use_no_space(env: Path) -> None:
    pool = make_pool(env, ("v", "4G"))
    dev = thinblock("attach", pool, "v").stdout.strip()
    sh("dd", "if=/dev/zero", f"of={dev}", "bs=1M", "count=256", "oflag=direct", "status=none")
    sync_volume(env, "v")
    assert volume(pool, "v")["mapped_bytes"] == 0
    # SEEK_DATA/SEEK_HOLE on the volume file follow block status
    sh("dd", "if=/dev/urandom", f"of={dev}", "bs=1M", "count=1", "seek=10", "oflag=direct", "status=none")
    (mnt,) = (env / "run").glob("*/mnt")
    fd = os.open(mnt / "v", os.O_RDONLY)
    try:
        assert os.lseek(fd, 0, os.SEEK_DATA) == 10 * MiB
        assert os.lseek(fd, 10 * MiB, os.SEEK_HOLE) == 11 * MiB
    finally:
        os.close(fd)
    thinblock("detach", dev)


def test_attach_errors_and_list(env: Path) -> None:
    pool = make_pool(env, ("a", "1G"), ("b", "1G"))
    missing = thinblock("attach", pool, "nope", check=False)
    assert missing.returncode == 1 and "no volume 'nope'" in missing.stderr
    assert thinblock("attach", str(env / "nopool"), "a", check=False).returncode == 1
    da = thinblock("attach", pool, "a").stdout.strip()
    db = thinblock("attach", pool, "b").stdout.strip()
    assert thinblock("attach", pool, "a").stdout.strip() == da  # idempotent
    listed = {(a["device"], a["volume"]) for a in json.loads(thinblock("attach", "--list", "--json").stdout)}
    assert listed == {(da, "a"), (db, "b")}
    assert thinblock("detach", "/dev/null", check=False).returncode == 1
    (log,) = (env / "run").glob("*/daemon.log")
    assert "Ignoring invalid max threads" not in log.read_text()  # libfuse is configured fully
    thinblock("detach", da)
    thinblock("detach", db)
    assert json.loads(thinblock("attach", "--list", "--json").stdout) == []


def test_dead_daemon_gives_io_errors_and_detach_cleans_up(env: Path) -> None:
    pool = make_pool(env, ("v", "1G"))
    dev = thinblock("attach", pool, "v").stdout.strip()
    (info,) = (env / "run").glob("*/daemon.json")
    pid = json.loads(info.read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    read = sh("dd", f"if={dev}", "of=/dev/null", "bs=4K", "count=1", "iflag=direct", "status=none", ok=False)
    assert read.returncode != 0
    (listed,) = json.loads(thinblock("attach", "--list", "--json").stdout)
    assert (listed["device"], listed["volume"], listed["daemon_alive"]) == (dev, "v", False)
    assert listed["state"] == "daemon dead"
    assert "daemon dead: I/O fails; detach cleans up" in thinblock("attach", "--list").stdout
    # Even with the dead mount gone, the device is still found (attach recorded it).
    sh("umount", "-l", json.loads(info.read_text())["mnt"])
    assert [a["device"] for a in json.loads(thinblock("attach", "--list", "--json").stdout)] == [dev]
    thinblock("detach", dev)
    assert not any(d == dev for d, _b in _loop_files())
    assert json.loads(thinblock("attach", "--list", "--json").stdout) == []
    assert thinblock("pool", "check", pool).returncode == 0


def test_mkfs_passes_extra_arguments(env: Path) -> None:
    pool = make_pool(env, ("v", "1G"))
    thinblock("mkfs", pool, "v", "-t", "ext4", "--", "-L", "tblabel")
    dev = thinblock("attach", pool, "v").stdout.strip()
    assert sh("blkid", "-o", "value", "-s", "LABEL", dev).stdout.strip() == "tblabel"
    thinblock("detach", dev)


def test_prezeroed_format_matches_a_sparse_file_at_the_same_granularity(env: Path) -> None:
    """With 4 KiB pool blocks (the filesystem's own block size), the hinted format
    uses no more pool space than the same mke2fs uses on a sparse file (within 2%)."""
    pool = str(env / "pool")
    thinblock("pool", "create", pool, "--size", "4G", "--block-size", "4K")
    thinblock("volume", "create", pool, "v", "--size", "200G")
    result = json.loads(thinblock("mkfs", pool, "v", "--json").stdout)
    assert result["prezeroed_hint"] is True
    sparse = sparse_loop_usage(env, 200 * GiB, ["mke2fs", "-q", "-t", "ext4", "-F", "-E", "assume_storage_prezeroed=1"])
    assert result["volume_mapped_bytes"] <= sparse * 1.02, (result["volume_mapped_bytes"], sparse)


def test_snapshot_of_an_attached_volume_attaches_read_only(env: Path) -> None:
    pool = make_pool(env, ("vm", "1G"))
    dev = thinblock("attach", pool, "vm").stdout.strip()
    data = os.urandom(MiB)
    with open(dev, "r+b", buffering=0) as f:
        os.pwrite(f.fileno(), data, 0)
        os.fsync(f.fileno())
    # The FUSE daemon holds the pool: these commands go through its control socket.
    thinblock("snapshot", "create", pool, "vm", "snap")
    thinblock("volume", "create", pool, "late", "--size", "64M")
    listing = {v["name"]: v for v in json.loads(thinblock("volume", "list", pool, "--json").stdout)}
    assert listing["snap"]["kind"] == "snapshot" and listing["vm"]["open_clients"] >= 1
    snap_dev = thinblock("attach", pool, "snap").stdout.strip()
    assert sh("blockdev", "--getro", snap_dev).stdout.strip() == "1"
    with open(snap_dev, "rb", buffering=0) as f:
        assert f.read(MiB) == data
    with open(dev, "r+b", buffering=0) as f:  # the volume moves on, the snapshot does not
        os.pwrite(f.fileno(), bytes(MiB), 0)
        os.fsync(f.fileno())
    with open(snap_dev, "rb", buffering=0) as f:
        assert f.read(MiB) == data
    assert thinblock("attach", pool, "late").stdout.startswith("/dev/loop")
    refused = thinblock("serve", pool, check=False)
    assert refused.returncode == 1 and "detach its devices first" in refused.stderr
    busy = thinblock("volume", "remove", pool, "vm", check=False)
    assert busy.returncode == 1 and "open by" in busy.stderr
    for d in (snap_dev, dev):
        thinblock("detach", d)


def test_attach_and_mkfs_on_a_served_pool(env: Path) -> None:
    from tests.nbd_server import Server

    pool = make_pool(env, ("vm", "1G"), ("fresh", "200G"))
    server = Server(pool)
    try:
        dev = thinblock("attach", pool, "vm").stdout.strip()
        data = os.urandom(MiB)
        with open(dev, "r+b", buffering=0) as f:
            os.pwrite(f.fileno(), data, 0)
            os.fsync(f.fileno())
        # The server hosts the FUSE mount: the NBD export and the loop device share the volume.
        got = sh("qemu-io", "-f", "raw", "-r", "-c", "read -v 0 16", server.unix_uri("vm")).stdout
        assert data[:16].hex()[:8] in got.replace(" ", "")
        listing = json.loads(thinblock("attach", "--list", "--json").stdout)
        assert [(a["volume"], a["daemon_pid"]) for a in listing] == [("vm", server.proc.pid)]
        result = json.loads(thinblock("mkfs", pool, "fresh", "--json").stdout)
        assert result["prezeroed_hint"] and result["pool_bytes_used"] < 200 * GiB * 0.0002
        thinblock("detach", dev)
        assert server.alive()  # detaching the last device unmounts, the server goes on
        assert not any(
            "thinblock" in line for line in Path("/proc/mounts").read_text().splitlines() if str(env) in line
        )
        assert thinblock("attach", pool, "vm").stdout.strip().startswith("/dev/loop")
        thinblock("detach", thinblock("attach", pool, "vm").stdout.strip())
    finally:
        out = server.stop()
    assert "stopped" in out and "Traceback" not in server.log.read_text()
    sh("e2fsck", "-fn", thinblock("attach", pool, "fresh").stdout.strip())


def test_a_server_given_a_relative_pool_path_removes_its_sockets(env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The FUSE mount a server hosts chdir()s its process to /: the sockets it made at a
    relative path must still be removed when it stops."""
    from tests.nbd_server import Server

    make_pool(env, ("vm", "1G"))
    monkeypatch.chdir(env)
    server = Server("pool")
    try:
        assert (env / "pool" / "control.sock").exists()
        thinblock("detach", thinblock("attach", "pool", "vm").stdout.strip())
    finally:
        server.stop()
    assert not (env / "pool" / "control.sock").exists()
    assert "Traceback" not in server.log.read_text()


def test_stopping_a_server_detaches_the_devices_on_its_mount(env: Path) -> None:
    """A served pool's attached devices do not outlive the server: it detaches them."""
    from tests.nbd_server import Server

    pool = make_pool(env, ("vm", "1G"))
    thinblock("snapshot", "create", pool, "vm", "snap")
    server = Server(pool)
    try:
        devices = [thinblock("attach", pool, name).stdout.strip() for name in ("vm", "snap")]
        assert sh("blockdev", "--getro", devices[1]).stdout.strip() == "1"
    finally:
        server.stop()
    assert "detached" in server.log.read_text()
    bound = {d for d, _b in _loop_files()}
    assert not bound & set(devices), bound
    assert json.loads(thinblock("attach", "--list", pool, "--json").stdout) == []
    # This test's mounts only: another run on the machine may have its own.
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    assert not [m for m in mounts if m[2] == "fuse.thinblock" and m[1].startswith(str(env))], mounts


def test_stopping_a_server_fails_a_held_loop_write_at_once(env: Path) -> None:
    """A write through an attached device, held by the wait policy on a full pool,
    fails with ENOSPC as soon as the server is told to stop, as a held NBD write does
    (allocation.md). It used to be held until the server had waited 10 s for its FUSE
    mount, which the writer kept busy, to end."""
    from tests.nbd_server import Server

    pool = make_pool(env, ("vm", "16M"), size="4M")
    thinblock("pool", "set", pool, "--when-full", "wait:300")
    server = Server(pool)
    try:
        dev = thinblock("attach", pool, "vm").stdout.strip()
        writer = subprocess.Popen(
            ["dd", "if=/dev/urandom", f"of={dev}", "bs=1M", "count=8", "oflag=direct", "status=none"],
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 30
        while (
            json.loads(thinblock("pool", "status", pool, "--json").stdout)["free_bytes"] and time.monotonic() < deadline
        ):
            time.sleep(0.1)
        time.sleep(0.5)  # the write past the end of the pool is held now
        assert writer.poll() is None
    finally:
        started = time.monotonic()
        server.stop()
    took = time.monotonic() - started
    _out, err = writer.communicate(timeout=60)
    assert writer.returncode == 1 and "No space left on device" in err, err
    assert took < 5, f"the server took {took:.1f} s to stop"
    assert json.loads(thinblock("attach", "--list", "--json").stdout) == []


def _size(dev: str) -> int:
    return int(sh("blockdev", "--getsize64", dev).stdout)


def _can_resize_ext4_online() -> bool:
    """ext4's online resize needs CAP_SYS_RESOURCE, which some containers drop from root."""
    caps = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) >> 24 & 1)  # CAP_SYS_RESOURCE = 24


def _grow_filesystem(fs: str, dev: str, mnt: Path) -> None:
    """Grow the filesystem on dev, mounted at mnt, to the device's size: online (xfs_growfs,
    resize2fs); ext4 without CAP_SYS_RESOURCE offline, unmounted and mounted again."""
    if fs == "xfs":
        sh("xfs_growfs", str(mnt))
    elif _can_resize_ext4_online():
        sh("resize2fs", dev)
    else:
        sh("umount", str(mnt))
        sh("e2fsck", "-fy", dev)
        sh("resize2fs", dev)
        sh("mount", dev, str(mnt))


@pytest.mark.parametrize("fs", ["ext4", "xfs"])
@pytest.mark.parametrize("served", [False, True], ids=["fuse-daemon", "served"])
def test_growing_an_attached_volume_grows_its_device_at_once(env: Path, served: bool, fs: str) -> None:
    """`volume resize` of an attached volume makes its loop device show the new size at
    once (no `losetup -c`), so the mounted filesystem can grow, whether the pool's FUSE
    daemon or a `thinblock serve` hosts the mount; shrinking stays refused."""
    from tests.nbd_server import Server

    pool = make_pool(env, ("vm", "320M"), size="1G")  # mkfs.xfs wants 300M at least
    server = Server(pool) if served else None
    mnt = env / "mnt"
    mnt.mkdir()
    try:
        dev = thinblock("attach", pool, "vm").stdout.strip()
        assert _size(dev) == 320 * MiB
        sh(*(["mke2fs", "-q", "-t", "ext4", "-F"] if fs == "ext4" else ["mkfs.xfs", "-q", "-f"]), dev)
        sh("mount", dev, str(mnt))
        try:
            data = os.urandom(3 * MiB)
            (mnt / "f").write_bytes(data)
            before = os.statvfs(mnt)
            grown = thinblock("volume", "resize", pool, "vm", "--size", "512M")
            assert "warning" not in grown.stderr, grown.stderr
            assert _size(dev) == 512 * MiB  # at once: no losetup -c
            (fuse_mnt,) = (env / "run").glob("*/mnt")
            assert os.stat(fuse_mnt / "vm").st_size == 512 * MiB  # the FUSE file too
            _grow_filesystem(fs, dev, mnt)
            after = os.statvfs(mnt)
            assert after.f_blocks * after.f_frsize >= before.f_blocks * before.f_frsize + 150 * MiB
            assert (mnt / "f").read_bytes() == data
            thinblock("volume", "resize", pool, "vm", "--size", "640M")  # and again
            assert _size(dev) == 640 * MiB
            shrink = thinblock("volume", "resize", pool, "vm", "--size", "320M", "--allow-shrink", check=False)
            assert shrink.returncode == 1 and "open by" in shrink.stderr, shrink.stderr
            assert _size(dev) == 640 * MiB
        finally:
            sh("umount", str(mnt))
        sh(*(["e2fsck", "-fn"] if fs == "ext4" else ["xfs_repair", "-n"]), dev)
        thinblock("detach", dev)
    finally:
        if server is not None:
            server.stop()
    assert volume(pool, "vm")["size_bytes"] == 640 * MiB
    assert thinblock("pool", "check", pool).returncode == 0


def test_a_device_that_does_not_follow_a_resize_is_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop half on its own, on a plain file: a device grows with its file; one that
    cannot be told is a warning naming `losetup -c DEV`, not an error."""
    from thinblock.frontends.fuse import loopsize

    img = tmp_path / "file.img"
    with open(img, "wb") as f:
        f.truncate(64 * MiB)
    dev = sh("losetup", "--find", "--show", "--direct-io=on", str(img)).stdout.strip()
    try:
        os.truncate(img, 96 * MiB)
        assert loopsize.loops_on(str(img)) == [dev]
        assert loopsize.follow_size(str(img), 96 * MiB) == []
        assert _size(dev) == 96 * MiB
        os.truncate(img, 128 * MiB)

        def refuse(device: str) -> None:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

        monkeypatch.setattr(loopsize, "set_capacity", refuse)
        (warning,) = loopsize.follow_size(str(img), 128 * MiB)
        assert f"run 'losetup -c {dev}'" in warning and "not permitted" in warning and "128M" in warning, warning
        assert _size(dev) == 96 * MiB
    finally:
        sh("losetup", "-d", dev)


def test_a_failing_size_watcher_leaves_the_resize_done(tmp_path: Path) -> None:
    from thinblock.core.pool import Pool

    told: list[tuple[str, int]] = []

    def tells(name: str, size_bytes: int) -> list[str]:
        told.append((name, size_bytes))
        return ["first"]

    def fails(name: str, size_bytes: int) -> list[str]:
        raise OSError(errno.EIO, "no device")

    with Pool.create(str(tmp_path / "pool"), 64 * MiB) as pool:
        pool.create_volume("vm", 16 * MiB)
        pool.size_watchers += [tells, fails]
        warnings = pool.resize_volume("vm", 32 * MiB)
        assert warnings[0] == "first" and "telling its devices failed" in warnings[1], warnings
        assert pool.resize_volume("vm", 32 * MiB) == []  # the same size: nobody is told
        assert told == [("vm", 32 * MiB)]
    with Pool.open(str(tmp_path / "pool")) as pool:
        assert pool.volume("vm").size_bytes == 32 * MiB
