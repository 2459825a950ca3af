"""Two ways a command used to end in a traceback: a duration in the environment
that is not one (inf overflowed the control socket's timeout), and a RADOS server
stopped with SIGINT after another host fenced it off. Each is one sentence now."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import nbd
import pytest

from tests.cli import ROOT, thinblock
from tests.conftest import new_rados_locator
from tests.nbd_server import Server

MiB = 1 << 20


def _with_env(name: str, value: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), name: value}
    return subprocess.run(
        [sys.executable, "-m", "thinblock", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_durations_from_the_environment_are_bounded(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    server = Server(pool)  # a served pool: commands go through its control socket
    try:
        for value in ("inf", "-inf", "nan", "1e400", "-5", "0", "soon", "1e9"):
            proc = _with_env("THINBLOCK_CONTROL_TIMEOUT_S", value, "pool", "status", pool)
            assert proc.returncode == 1 and "Traceback" not in proc.stderr, (value, proc.stderr)
            assert proc.stderr.count("\n") == 1 and "THINBLOCK_CONTROL_TIMEOUT_S" in proc.stderr, proc.stderr
        assert _with_env("THINBLOCK_CONTROL_TIMEOUT_S", "30", "pool", "status", pool).returncode == 0
        proc = _with_env("THINBLOCK_WAIT_S", "inf", "pool", "status", pool)
        assert proc.returncode == 1 and "THINBLOCK_WAIT_S='inf'" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        server.stop()


def test_a_bad_lease_is_refused(request: pytest.FixtureRequest) -> None:
    locator = new_rados_locator(request, "lease")
    for value in ("inf", "abc", "0", "1e6"):
        proc = _with_env("THINBLOCK_RADOS_LEASE_S", value, "pool", "create", locator, "--size", "1G")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (value, proc.stderr)
        assert "THINBLOCK_RADOS_LEASE_S" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_sigint_of_a_fenced_rados_server_is_one_sentence(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Stop the holder, take the pool over, let it run on (its writes now fail), then
    SIGINT it: it exits 1 with one sentence for the commit it could not make."""
    locator = new_rados_locator(request, "fenced")
    thinblock("pool", "create", locator, "--size", "1G")
    thinblock("volume", "create", locator, "v", "--size", "64M")
    os.environ["THINBLOCK_RADOS_LEASE_S"] = "3"
    try:
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        first = Server(locator, "--socket", str(tmp_path / "a" / "nbd.sock"), workdir=tmp_path / "a")
        old = nbd.NBD()
        old.connect_uri(first.unix_uri("v"))
        old.pwrite(b"A" * MiB, 0)
        old.flush()
        first.proc.send_signal(signal.SIGSTOP)
        second = Server(locator, "--socket", str(tmp_path / "b" / "nbd.sock"), "--takeover", workdir=tmp_path / "b")
    finally:
        del os.environ["THINBLOCK_RADOS_LEASE_S"]
    try:
        first.proc.send_signal(signal.SIGCONT)
        with pytest.raises(nbd.Error):  # fenced: its writes fail (RADOS refuses them)
            old.pwrite(b"C" * MiB, 0)
            old.flush()
        first.proc.send_signal(signal.SIGINT)
        assert first.proc.wait(60) == 1
        log = first.log.read_text()
        assert "Traceback" not in log, log
        last = log.strip().splitlines()[-1]
        assert last.startswith("thinblock: error: pool ") and "closed without its final commit" in last, log
        assert "fenced off" in last
    finally:
        second.stop()
        first.stop()
