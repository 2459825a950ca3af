"""The out-of-space policy through a live server: writes held on a full pool
until another process grows it, ENOSPC at once under `error`, low-water
commands once per crossing (pool and volume), autogrow up to its maximum."""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nbd
import pytest

from tests.nbd_server import Server, connect, served_pool, thinblock
from thinblock.store.owned import tail_bytes

BS = 64 << 10
MiB = 1 << 20


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Server]:
    with served_pool(tmp_path, "4M", {"disk": "16M", "other": "16M"}) as server:  # 64 blocks
        yield server


def block(i: int) -> bytes:
    return bytes([i % 251 + 1]) * BS


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_wait_policy_holds_writes_until_the_pool_grows(served: Server) -> None:
    thinblock("pool", "set", served.pool, "--when-full", "wait:120")
    o = connect(served, "other")
    o.pwrite(block(99), 0)
    h = connect(served, "disk")
    for i in range(63):
        h.pwrite(block(i), i * BS)
    # The pool is full: the next write that needs a block is held, not failed.
    cookie = h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(block(63))), 63 * BS)

    def completed() -> bool:
        h.poll(0)
        return bool(h.aio_command_completed(cookie))

    assert not wait_for(completed, 1.5)
    # Meanwhile every volume still serves reads, and writes that need no space go on.
    assert o.pread(BS, 0) == block(99)
    o.pwrite(block(98), 0)
    r = connect(served, "disk")
    assert r.pread(BS, 5 * BS) == block(5)
    # Another process grows the pool: the held write completes, in order with the rest.
    thinblock("pool", "grow", served.pool, "--size", "8M")
    assert wait_for(completed)
    h.flush()
    assert r.pread(BS, 63 * BS) == block(63)
    assert all(r.pread(BS, i * BS) == block(i) for i in range(63))
    # A wait that runs out of time ends in ENOSPC.
    thinblock("pool", "set", served.pool, "--when-full", "wait:1")
    for i in range(64, 127):
        h.pwrite(block(i), i * BS)
    started = time.monotonic()
    with pytest.raises(nbd.Error) as exc:
        h.pwrite(block(200), 200 * BS)
    assert exc.value.errnum == errno.ENOSPC and time.monotonic() - started >= 0.9


def test_error_policy_fails_at_once(served: Server) -> None:
    status = json.loads(thinblock("pool", "set", served.pool, "--when-full", "error", "--json").stdout)
    assert status["when_full"] == "error"
    h = connect(served, "disk")
    for i in range(64):
        h.pwrite(block(i), i * BS)
    with pytest.raises(nbd.Error) as exc:
        h.pwrite(block(64), 64 * BS)
    assert exc.value.errnum == errno.ENOSPC
    h.pwrite(block(7), 0)  # overwriting mapped space needs nothing new
    bad = thinblock("pool", "set", served.pool, "--when-full", "sometimes", check=False)
    assert bad.returncode == 2 and "wait:SECONDS" in bad.stderr  # a malformed argument


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_low_water_fires_once_per_crossing(served: Server, tmp_path: Path) -> None:
    log = tmp_path / "hook.log"
    hook = f'echo "$THINBLOCK_VOLUME|$THINBLOCK_FREE_PERCENT|$THINBLOCK_AVAILABLE_BYTES" >> {log}'
    thinblock("pool", "set", served.pool, "--low-water", "50", "--on-low-water", hook)
    h = connect(served, "disk")
    for i in range(40):  # 24 of 64 blocks left: 37.5% free, under the mark
        h.pwrite(block(i), i * BS)
    assert wait_for(lambda: len(_lines(log)) == 1)
    volume, percent, available = _lines(log)[0].split("|")
    assert volume == "" and float(percent) < 50 and int(available) == 31 * BS  # figures at the crossing
    for i in range(40, 50):  # further down: no new event
        h.pwrite(block(i), i * BS)
    time.sleep(1.5)
    assert len(_lines(log)) == 1
    h.trim(50 * BS, 0)  # back above the mark: re-armed at the next commit
    h.flush()
    time.sleep(1.5)
    assert len(_lines(log)) == 1
    for i in range(40):
        h.pwrite(block(i), i * BS)
    assert wait_for(lambda: len(_lines(log)) == 2)
    # The per-volume mark: a volume's unmapped share.
    thinblock("volume", "create", served.pool, "small", "--size", "1M")  # 16 blocks
    vlog = tmp_path / "volume.log"
    thinblock(
        "volume",
        "set",
        served.pool,
        "small",
        "--low-water",
        "25",
        "--on-low-water",
        f"echo $THINBLOCK_VOLUME >> {vlog}",
    )
    s = connect(served, "small")
    for i in range(12):
        s.pwrite(block(i), i * BS)
    time.sleep(1)
    assert _lines(vlog) == []  # 4 of 16 left: exactly at 25%, not below
    s.pwrite(block(12), 12 * BS)
    assert wait_for(lambda: _lines(vlog) == ["small"])
    s.pwrite(block(13), 13 * BS)
    time.sleep(1)
    assert _lines(vlog) == ["small"]
    assert "below its low-water mark" in served.log.read_text()


def test_autogrow_up_to_max(served: Server) -> None:
    thinblock("pool", "set", served.pool, "--autogrow", "1M:6M", "--low-water", "10")
    h = connect(served, "disk")
    for i in range(96):  # 6 MiB: two steps beyond the 4 MiB the pool started with
        h.pwrite(block(i), i * BS)
    with pytest.raises(nbd.Error) as exc:
        h.pwrite(block(96), 96 * BS)
    assert exc.value.errnum == errno.ENOSPC
    status = json.loads(thinblock("pool", "status", served.pool, "--json").stdout)
    assert status["size_bytes"] == 6 * MiB and status["autogrow"] == {"step_bytes": MiB, "max_bytes": 6 * MiB}
    # The data file holds the 6 MiB of blocks, then the owner tail (store/owned.py).
    assert os.path.getsize(Path(served.pool) / "data") == 6 * MiB + tail_bytes(6 * MiB // BS)
    assert "autogrown" in served.log.read_text()
