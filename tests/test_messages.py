"""The messages issue 24 lists as ones a newcomer hit, each through the real
`thinblock` command: one sentence in the user's terms (what they typed, sizes as
2G), the right exit status, nothing changed, no traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.cli import ROOT, thinblock
from tests.conftest import new_rados_locator
from tests.nbd_server import Server

INTERNAL = ("size_bytes", "volume_create", "volume_resize", "bad arguments", "Traceback")


def one_error(proc: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The one sentence of a failed command (after argparse's usage lines, for exit 2)."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("thinblock: ")]
    assert len(lines) == 1 and lines[0].startswith("thinblock: error: "), proc.stderr
    assert not any(word in proc.stderr for word in INTERNAL), proc.stderr
    return lines[0].removeprefix("thinblock: error: ")


@pytest.fixture
def pool_dir(tmp_path: Path) -> str:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "v", "--size", "2M")
    return pool


def volumes(pool: str) -> list[str]:
    import json

    return [v["name"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout)]


def test_a_volume_size_beyond_the_largest(pool_dir: str) -> None:
    said = one_error(thinblock("volume", "create", pool_dir, "big", "--size", "20E", check=False))
    assert said == "volume create: volume size 20E is beyond the largest thinblock supports (8E less 16M)"
    said = one_error(thinblock("volume", "resize", pool_dir, "v", "--size", "9E", check=False))
    assert said == "volume resize: volume size 9E is beyond the largest thinblock supports (8E less 16M)"
    assert volumes(pool_dir) == ["v"]
    assert thinblock("volume", "list", pool_dir).stdout.splitlines()[1].split()[3] == "2M"


def test_a_size_of_hundreds_of_digits(pool_dir: str) -> None:
    """Too large to divide as a float: still the one sentence, not a traceback, and
    not hundreds of digits either."""
    huge = "9" * 400
    said = one_error(thinblock("volume", "create", pool_dir, "big", "--size", huge, check=False))
    assert said == "volume create: volume size over 1024E is beyond the largest thinblock supports (8E less 16M)"
    said = one_error(thinblock("volume", "resize", pool_dir, "v", "--size", huge + "E", check=False))
    assert said == "volume resize: volume size over 1024E is beyond the largest thinblock supports (8E less 16M)"
    assert volumes(pool_dir) == ["v"]


def test_an_empty_name(pool_dir: str) -> None:
    said = one_error(thinblock("volume", "create", pool_dir, "", "--size", "1M", check=False))
    assert said == "volume create: the name is empty: a name has 1 to 128 characters"
    said = one_error(thinblock("snapshot", "create", pool_dir, "v", "", check=False))
    assert said == "snapshot create: the name is empty: a name has 1 to 128 characters"
    assert volumes(pool_dir) == ["v"]


@pytest.mark.parametrize(("given", "shown"), [("32M", "32M"), ("2K", "2K"), ("3000", "3000 bytes")])
def test_a_block_size_out_of_range(tmp_path: Path, given: str, shown: str) -> None:
    proc = thinblock("pool", "create", str(tmp_path / "p"), "--size", "64M", "--block-size", given, check=False)
    assert one_error(proc) == f"invalid block size {shown}: must be a power of two from 4K to 16M"
    assert not (tmp_path / "p").exists()


def test_an_nbd_target_smaller_than_the_export(tmp_path: Path, pool_dir: str) -> None:
    target = str(tmp_path / "target")
    thinblock("pool", "create", target, "--size", "64M")
    thinblock("volume", "create", target, "small", "--size", "1M")
    server = Server(target, workdir=tmp_path)
    try:
        proc = thinblock("export", pool_dir, "v", server.unix_uri("small"), "--no-progress", check=False)
    finally:
        server.stop()
    assert one_error(proc) == f"NBD export {server.unix_uri('small')} is 1M, smaller than the 2M to export"


def test_pool_create_without_size_is_a_usage_error(tmp_path: Path) -> None:
    proc = thinblock("pool", "create", str(tmp_path / "p"), check=False)
    said = one_error(proc, code=2)
    assert said == "pool create needs --size (only a pool over a device or file given with --data takes its size)"
    assert not (tmp_path / "p").exists()


def test_no_pool_at_a_missing_directory(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    assert one_error(thinblock("pool", "status", missing, check=False)) == f"no pool at {missing}: no such directory"
    (tmp_path / "file").write_text("")
    said = one_error(thinblock("pool", "status", str(tmp_path / "file"), check=False))
    assert said == f"no pool at {tmp_path / 'file'}: it is not a directory"


def _long_dir(tmp_path: Path, length: int) -> Path:
    """A directory whose absolute path is `length` bytes long."""
    stem = tmp_path / "long"
    room = length - len(str(stem)) - 1
    assert room > 0
    return stem / ("d" * room)


def test_a_pool_whose_sockets_would_not_fit_is_refused_at_create(tmp_path: Path) -> None:
    # "/control.sock" is 13 bytes: a pool directory of 94 bytes has room, 95 has not
    # (sockaddr_un holds 107 bytes and the NUL).
    fits = _long_dir(tmp_path, 94)
    thinblock("pool", "create", str(fits), "--size", "64M")
    thinblock("volume", "create", str(fits), "v", "--size", "1M")
    server = Server(str(fits), "--socket", str(tmp_path / "s.sock"), workdir=tmp_path)
    server.stop()
    beyond = _long_dir(tmp_path, 95)
    said = one_error(thinblock("pool", "create", str(beyond), "--size", "64M", check=False))
    assert said == (
        f"the pool could not be served: its control socket {beyond}/control.sock would be 108 bytes long, beyond"
        " the 107 a unix socket path can have; a pool's sockets live in its directory: give the pool a shorter path"
    )
    assert not beyond.exists()


def test_serve_says_in_one_sentence_that_a_socket_path_is_too_long(tmp_path: Path) -> None:
    pool = tmp_path / "p"
    thinblock("pool", "create", str(pool), "--size", "64M")
    moved = _long_dir(tmp_path, 100)  # a pool made elsewhere, moved to a path too long for its sockets
    moved.parent.mkdir()
    pool.rename(moved)
    said = one_error(thinblock("serve", str(moved), "--socket", str(tmp_path / "s.sock"), check=False))
    assert said.startswith(f"the pool could not be served: its control socket {moved}/control.sock would be 113 bytes")
    long_socket = str(_long_dir(tmp_path, 108))
    said = one_error(thinblock("serve", str(moved), "--socket", long_socket, check=False))
    assert said == (
        f"cannot serve on the unix socket {long_socket}: it is 108 bytes long, beyond the 107 a unix socket path"
        " can have; give --socket a shorter path"
    )


def _piped(*args: str, take: str) -> subprocess.CompletedProcess[str]:
    """`thinblock ARGS | head -c TAKE`, reporting thinblock's own exit status last on stderr."""
    cmd = " ".join([sys.executable, "-m", "thinblock", *args])
    return subprocess.run(
        ["bash", "-c", f"{cmd} | head -c {take} >/dev/null; echo status ${{PIPESTATUS[0]}} >&2"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=120,
    )


@pytest.mark.parametrize("served", [False, True], ids=["in-the-command", "in-a-server"])
def test_a_closed_pipe_ends_export_quietly_with_141(tmp_path: Path, served: bool) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    data = tmp_path / "data"
    data.write_bytes(bytes(range(256)) * (32 << 12))  # 8M of data, more than a pipe holds
    thinblock("import", str(data), pool, "d", "--no-progress")
    server = Server(pool, workdir=tmp_path) if served else None
    try:
        for args, take in ((("export", pool, "d", "-", "--no-progress"), "1M"), (("export-diff", pool, "d", "-"), "1")):
            proc = _piped(*args, take=take)
            assert proc.stderr == "status 141\n", proc.stderr
    finally:
        if server is not None:
            server.stop()
    if server is not None:  # the server says no more than the request it was given
        # (the pool's path names this test, so its open and close lines mention "export" too)
        lines = [line for line in server.log.read_text().splitlines() if " control: " in line]
        assert len(lines) == 2 and all("control: export" in line for line in lines), lines
        assert "Traceback" not in server.log.read_text() and "Broken pipe" not in server.log.read_text()


def test_a_qemu_nbd_failure_is_one_sentence_with_its_cause(tmp_path: Path, pool_dir: str) -> None:
    image = tmp_path / "in.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(image), "8M"], check=True)
    holder_sock = tmp_path / "holder.sock"
    # Another qemu-nbd serves the image writable: it holds qemu's write lock on it,
    # so the import's own (read-only) qemu-nbd cannot open it.
    holder = subprocess.Popen(["qemu-nbd", "-f", "qcow2", f"--socket={holder_sock}", str(image)])
    try:
        deadline = time.monotonic() + 30
        while not holder_sock.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "qemu-nbd did not start"
            time.sleep(0.05)
        proc = thinblock("import", str(image), pool_dir, "q", "--no-progress", check=False)
    finally:
        holder.terminate()
        holder.wait(30)
    assert one_error(proc) == (
        f'qemu-nbd cannot serve {image}: Failed to get shared "write" lock: Is another process using the image'
        f" [{image}]?"
    )
    assert "socket_activation" not in proc.stderr and "qemu-nbd: " not in proc.stderr
    assert volumes(pool_dir) == ["v"]


def test_a_rados_pool_larger_than_its_ceph_pool_is_warned_about(request: pytest.FixtureRequest) -> None:
    big = new_rados_locator(request, "big")
    proc = thinblock("pool", "create", big, "--size", "1T")  # far beyond the test cluster's 8G
    warning = proc.stderr.strip()
    assert warning.startswith(f"thinblock: warning: pool {big} (1T) is larger than Ceph pool "), proc.stderr
    assert "can hold (the cluster has room for " in warning and "before the pool is full" in warning
    grown = thinblock("pool", "grow", big, "--size", "2T").stderr
    assert f"thinblock: warning: pool {big} (2T) is larger than Ceph pool" in grown
    small = new_rados_locator(request, "small")
    assert thinblock("pool", "create", small, "--size", "64M").stderr == ""


def test_runtime_folders_go_with_their_last_user(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rados: pool's runtime folder lives while a server or a job's control socket
    uses it, and goes when the last of them stops; the shared levels above stay."""
    run = Path(tempfile.mkdtemp(prefix="tbrt-", dir="/tmp"))  # short: a pytest tmp_path leaves no room for sockets
    request.addfinalizer(lambda: shutil.rmtree(run, ignore_errors=True))
    monkeypatch.setenv("THINBLOCK_RUNTIME_DIR", str(run))
    locator = new_rados_locator(request, "rt")
    ceph_pool, name = locator.removeprefix("rados:").split("/")
    folder = run / "rados" / ceph_pool / name
    thinblock("pool", "create", locator, "--size", "64M")
    thinblock("volume", "create", locator, "v", "--size", "1M")
    server = Server(locator, workdir=tmp_path)
    try:
        assert sorted(p.name for p in folder.iterdir()) == ["control.sock"]  # (its NBD socket is in tmp_path)
        assert "v" in thinblock("volume", "list", locator).stdout  # a client of the control socket
        assert folder.is_dir()
    finally:
        server.stop()
    assert not folder.exists() and (run / "rados" / ceph_pool).is_dir()
    data = tmp_path / "data"
    data.write_bytes(b"x" * (1 << 20))
    thinblock("import", str(data), locator, "v", "--force", "--no-progress")  # a job: its own control socket
    assert not folder.exists()


def test_a_server_hosting_attached_devices_leaves_no_runtime_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from thinblock.backends import locate
    from thinblock.frontends.fuse.attach import runtime_dir_for

    monkeypatch.setenv("THINBLOCK_RUNTIME_DIR", str(tmp_path / "run"))
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "v", "--size", "1M")
    server = Server(pool)
    try:
        device = thinblock("attach", pool, "v").stdout.strip()
        assert device.startswith("/dev/loop")
        monkeypatch.setattr("thinblock.frontends.fuse.attach.RUNTIME_DIR", tmp_path / "run")
        folder = runtime_dir_for(locate(pool).key())
        assert (folder / "mnt").is_dir() and (folder / "daemon.json").exists()
    finally:
        server.stop()
    assert not folder.exists(), sorted(p.name for p in folder.rglob("*"))
    assert (tmp_path / "run").is_dir()
