"""Pool-level commands on a pool served per volume by real `serve --volume` servers:
`pool grow` and `pool set` (pool-level steps every owner follows, core/pool_settings.py)
and `attach` (hosted by the volume's server, or by a daemon owning just that volume).
`pool check` after each.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import nbd
import pytest

from tests import test_attach
from tests.cli import fuse_daemon_pids, thinblock
from tests.nbd_server import Server
from tests.test_attach import sh
from tests.test_owners import _handle, _pool, _serve, _stop, owners

MiB = 1 << 20


def _status(pool: str) -> dict[str, object]:
    return dict(json.loads(thinblock("pool", "status", pool, "--json").stdout))


def _wait_until(what: str, done: object, timeout_s: float = 60) -> None:
    """Poll done() (bounded) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not done():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.05)


def _fill(server: Server, name: str, length: int) -> tuple[threading.Thread, list[BaseException]]:
    """Write length bytes of name's letter in 1 MiB writes, on a thread; errors kept."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            h = _handle(server, name)
            for off in range(0, length, MiB):
                h.pwrite(name.encode() * MiB, off)
            h.flush()
            h.shutdown()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def test_pool_grow_wakes_a_writer_held_by_the_wait_policy_in_another_owner(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "16M", {"a": "64M", "b": "64M"})
    thinblock("pool", "set", pool, "--when-full", "wait:90")
    with owners(pool, tmp_path, "a", "b") as (sa, sb):
        # a needs 24M of a 16M pool: once every block is committed used, it is held.
        writer, errors = _fill(sa, "a", 24 * MiB)
        _wait_until("the pool full", lambda: _status(pool)["used_bytes"] == 16 * MiB)
        assert writer.is_alive() and not errors
        thinblock("pool", "grow", pool, "--size", "64M")  # a pool-level step in the command
        writer.join(60)  # well before wait:90 gives up: the grow woke it
        assert not writer.is_alive() and not errors, errors
        ha, hb = _handle(sa, "a"), _handle(sb, "b")
        assert ha.pread(24 * MiB, 0) == b"a" * (24 * MiB)
        hb.pwrite(b"b" * (16 * MiB), 0)  # the other owner is granted the new space too
        hb.flush()
        assert hb.pread(16 * MiB, 0) == b"b" * (16 * MiB)
        status = _status(pool)
        assert status["size_bytes"] == 64 * MiB and status["when_full"] == "wait:90"
        ha.shutdown()
        hb.shutdown()


def test_pool_set_is_followed_by_every_owner(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "16M", {"a": "64M", "b": "64M"})
    thinblock("pool", "set", pool, "--when-full", "wait:45")
    with owners(pool, tmp_path, "a", "b") as (sa, sb):
        ha, hb = _handle(sa, "a"), _handle(sb, "b")
        ha.pwrite(b"a" * (8 * MiB), 0)
        hb.pwrite(b"b" * (4 * MiB), 0)
        ha.flush()
        hb.flush()
        # Both owners started under wait:45; the command changes it to error.
        thinblock("pool", "set", pool, "--when-full", "error", "--low-water", "10")
        status = _status(pool)
        assert status["when_full"] == "error" and status["low_water_percent"] == 10
        for h, name in ((ha, "a"), (hb, "b")):
            # Whatever is left goes to the first owner to ask; then each fails at once
            # (under the old wait:45 it would be held 45 s).
            started = time.monotonic()
            with pytest.raises(nbd.Error) as full:
                for off in range(16 * MiB, 64 * MiB, MiB):
                    h.pwrite(name.encode() * MiB, off)
            assert full.value.errno == "ENOSPC"
            assert time.monotonic() - started < 30, f"owner of {name} still waited"
        assert ha.pread(8 * MiB, 0) == b"a" * (8 * MiB)
        assert hb.pread(4 * MiB, 0) == b"b" * (4 * MiB)
        ha.shutdown()
        hb.shutdown()


def test_autogrow_across_owners_grows_once_per_shortage_up_to_max(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "16M", {"a": "64M", "b": "64M"})
    with owners(pool, tmp_path, "a", "b") as (sa, sb):
        thinblock("pool", "set", pool, "--autogrow", "16M:40M")
        wa, ea = _fill(sa, "a", 12 * MiB)
        wb, eb = _fill(sb, "b", 12 * MiB)
        wa.join(60)
        wb.join(60)
        assert not ea and not eb, (ea, eb)
        # 24M written: the pool grew by one STEP (no shortage grown for twice), MAX kept.
        size = _status(pool)["size_bytes"]
        assert isinstance(size, int) and 24 * MiB < size <= 40 * MiB
        # More than MAX allows: ENOSPC, and the pool stops at MAX.
        with pytest.raises(nbd.Error) as full:
            h = _handle(sa, "a")
            for off in range(12 * MiB, 64 * MiB, MiB):
                h.pwrite(b"a" * MiB, off)
        assert full.value.errno == "ENOSPC"
        assert _status(pool)["size_bytes"] == 40 * MiB


env = test_attach.env  # a private runtime dir; every mount, loop device and daemon of the test gone after


def _attached(dev_volume: str) -> list[dict[str, object]]:
    return [a for a in json.loads(thinblock("attach", "--list", "--json").stdout) if a["volume"] == dev_volume]


def _refused_serve(pool: str, work: Path, *args: str) -> str:
    """A `serve` that must be refused: its one sentence."""
    proc = thinblock("serve", pool, *args, "--socket", str(work / "refused.sock"), check=False)
    assert proc.returncode != 0, proc.stdout
    return proc.stderr


def test_attach_of_an_owned_volume_is_hosted_by_its_server(env: Path) -> None:
    pool = _pool(env, "256M", {"a": "64M", "b": "64M"})
    sa, sb = _serve(pool, env, "a"), _serve(pool, env, "b")
    try:
        result = json.loads(thinblock("mkfs", pool, "a", "--json").stdout)  # attaches, formats, detaches
        assert result["prezeroed_hint"]
        dev = thinblock("attach", pool, "a").stdout.strip()
        [attached] = _attached("a")
        assert attached["daemon_pid"] == sa.proc.pid  # the owner hosts it: no daemon of its own
        assert not fuse_daemon_pids(env / "run")
        # While attached, the owner will not hand the volume over.
        refused = _refused_serve(pool, env, "--volume", "a", "--takeover")
        assert "volume a is attached through this server" in refused and "detach it first" in refused
        mnt = env / "mnt"
        mnt.mkdir()
        sh("mount", dev, str(mnt))
        payload = b"owned by a, written through its server's mount\n" * 4096
        (mnt / "file").write_bytes(payload)
        sh("umount", str(mnt))
        assert thinblock("detach", pool, "a").returncode == 0
        assert not _attached("a")
        # The bytes, read back over NBD from the owner, hold the file.
        ha = _handle(sa, "a")
        image = env / "a.img"
        image.write_bytes(ha.pread(64 * MiB, 0))
        ha.shutdown()
        assert sh("debugfs", "-R", "cat /file", str(image)).stdout.encode() == payload
        hb = _handle(sb, "b")  # b's server was never touched
        hb.pwrite(b"b" * MiB, 0)
        assert hb.pread(MiB, 0) == b"b" * MiB
        hb.shutdown()
    finally:
        _stop(sa)
        _stop(sb)
    thinblock("pool", "check", pool)


def test_attach_of_a_volume_nobody_holds_owns_just_that_volume(env: Path) -> None:
    pool = _pool(env, "256M", {"a": "64M", "b": "64M", "c": "64M"})
    sa, sb = _serve(pool, env, "a"), _serve(pool, env, "b")
    try:
        dev = thinblock("attach", pool, "c").stdout.strip()
        [daemon] = fuse_daemon_pids(env / "run")
        [attached] = _attached("c")
        assert attached["daemon_pid"] == daemon
        payload = bytes(range(256)) * 4096  # 1 MiB
        with open(dev, "r+b", buffering=0) as f:
            f.seek(3 * MiB)
            f.write(payload)
            os.fsync(f.fileno())
        # The daemon holds c's lease: a server for c is told who holds it.
        refused = _refused_serve(pool, env, "--volume", "c")
        assert "volume c is served by thinblock fuse-daemon (attach)" in refused and "detach" in refused
        assert thinblock("detach", pool, "c").returncode == 0
        _wait_until("the daemon gone", lambda: not fuse_daemon_pids(env / "run"))
        sc = _serve(pool, env, "c")  # now it may be served
        try:
            hc = _handle(sc, "c")
            assert hc.pread(MiB, 3 * MiB) == payload
            assert hc.pread(MiB, 0) == bytes(MiB)
            hc.shutdown()
        finally:
            _stop(sc)
    finally:
        _stop(sa)
        _stop(sb)
    thinblock("pool", "check", pool)
