"""The test suite's own helpers stop only what they started: by pid, never by a
pattern over every process on the machine (which would end other people's Ceph
daemons or thinblock servers on a shared host)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import ceph_cluster

SLEEPER = "import time; time.sleep(120)"


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def _wait_for_exec(proc: subprocess.Popen[bytes], word: str) -> None:
    deadline = time.monotonic() + 30
    while word.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_ceph_cluster_stop_ends_its_recorded_daemons_only(
    tmp_path: Path, sleepers: list[subprocess.Popen[bytes]]
) -> None:
    conf = str(tmp_path / "ceph.conf")

    def start(*args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-c", SLEEPER, *args])
        sleepers.append(proc)
        _wait_for_exec(proc, args[-1] if args else "sleep")
        return proc

    ours = start("-c", conf, "-i", "a")  # recorded at start: stopped
    mgr_pidfile_only = start("-c", conf, "-i", "x")  # only its pid file left: stopped
    stranger = start("-c", conf, "-i", "b")  # names the same conf, never recorded: left alone
    reused = start("unrelated")  # a recorded pid now held by another process: left alone
    (tmp_path / ceph_cluster.PIDS).write_text(f"mon.a {ours.pid}\nosd.0 {reused.pid}\n")
    (tmp_path / "mgr.x.pid").write_text(f"{mgr_pidfile_only.pid}\n")
    ceph_cluster.stop(str(tmp_path))
    assert ours.wait(timeout=30) == -signal.SIGTERM
    assert mgr_pidfile_only.wait(timeout=30) == -signal.SIGTERM
    assert stranger.poll() is None and reused.poll() is None
