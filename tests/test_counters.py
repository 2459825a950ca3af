"""Kept counters (core/exclusive.py, core/totals.py): pool check catches one that
drifted, old pools are upgraded to format 3, newer ones are refused, and a
reservation decision sees blocks that became exclusive by someone else's removal."""

from __future__ import annotations

import json
import random
import sqlite3
import uuid
from pathlib import Path

import pytest

from tests.cli import thinblock
from thinblock import NoSpaceError, Pool, ThinblockError
from thinblock.backends import locate
from thinblock.backends.memory import MemoryLocation
from thinblock.core.snapshot import create_snapshot
from thinblock.meta.base import FORMAT_VERSION, RESERVE_FULL
from thinblock.tools.check import check_metadata

BS = 64 << 10


def _pool_with_sharing(locator: str) -> None:
    """v with 4 blocks, a snapshot s, then 1 block of v rewritten: v holds 1 alone."""
    with Pool.create(locator, 64 * BS) as pool:
        vol = pool.create_volume("v", 16 * BS)
        vol.write(0, random.randbytes(4 * BS))
        create_snapshot(pool, "v", "s")
        vol.write(0, random.randbytes(BS))
        assert pool.volume_info(vol)["exclusive_bytes"] == BS  # recounted, committed at close


def test_check_catches_a_drifted_counter_in_sqlite(tmp_path: Path) -> None:
    path = str(tmp_path / "p")
    _pool_with_sharing(path)
    assert "consistent" in thinblock("pool", "check", path).stdout
    with sqlite3.connect(Path(path) / "metadata.sqlite") as db:
        db.execute("UPDATE volumes SET exclusive_blocks = 3 WHERE name = 'v'")
    db.close()
    proc = thinblock("pool", "check", path, check=False)
    assert proc.returncode == 1
    assert "volume v: 3 exclusive blocks recorded as exact, 1 found" in proc.stdout
    # A count kept only as a lower bound (an old stamp) may be low, never high.
    with sqlite3.connect(Path(path) / "metadata.sqlite") as db:
        db.execute("UPDATE volumes SET exclusive_blocks = 0, exclusive_epoch = -1 WHERE name = 'v'")
    db.close()
    assert "consistent" in thinblock("pool", "check", path).stdout
    with sqlite3.connect(Path(path) / "metadata.sqlite") as db:
        db.execute("UPDATE volumes SET exclusive_blocks = 2, exclusive_epoch = -1 WHERE name = 'v'")
    db.close()
    proc = thinblock("pool", "check", path, check=False)
    assert "volume v: at least 2 exclusive blocks recorded, 1 found" in proc.stdout


def test_check_catches_a_drifted_counter_in_memory() -> None:
    locator = f"memory:counters-{uuid.uuid4().hex}"
    location = locate(locator)
    try:
        _pool_with_sharing(locator)
        assert isinstance(location, MemoryLocation)
        meta = location.open_meta(readonly=True)
        assert check_metadata(meta) == []
        (row,) = [row for row in meta.state.volumes.values() if row.name == "v"]
        row.exclusive_blocks = 2
        assert check_metadata(meta) == ["volume v: 2 exclusive blocks recorded as exact, 1 found"]
    finally:
        location.remove_created()


def test_format_2_pool_is_upgraded_serves_its_data_and_checks_clean(tmp_path: Path) -> None:
    path = str(tmp_path / "p")
    data = random.randbytes(4 * BS)
    with Pool.create(path, 64 * BS) as pool:
        vol = pool.create_volume("v", 16 * BS)
        vol.write(0, data)
        create_snapshot(pool, "v", "s")
        vol.write(0, bytes(BS))  # block 0 becomes ZEROED on a fresh dblock: v holds it alone
    with sqlite3.connect(Path(path) / "metadata.sqlite") as db:  # as a format-2 thinblock wrote it
        db.execute("ALTER TABLE volumes DROP COLUMN exclusive_blocks")
        db.execute("ALTER TABLE volumes DROP COLUMN exclusive_epoch")
        db.execute("DELETE FROM superblock WHERE key = 'sharing_epoch'")
        db.execute("UPDATE superblock SET value = '2' WHERE key = 'format_version'")
    db.close()
    assert "consistent" in thinblock("pool", "check", path).stdout  # read as it is, not upgraded
    listing = {v["name"]: v for v in json.loads(thinblock("volume", "list", path, "--json").stdout)}
    assert (listing["v"]["exclusive_bytes"], listing["v"]["shared_bytes"]) == (BS, 3 * BS)
    assert (listing["s"]["exclusive_bytes"], listing["s"]["shared_bytes"]) == (BS, 3 * BS)
    with sqlite3.connect(Path(path) / "metadata.sqlite") as db:
        version = db.execute("SELECT value FROM superblock WHERE key = 'format_version'").fetchone()[0]
        rows = dict(db.execute("SELECT name, exclusive_blocks FROM volumes").fetchall())
    db.close()
    assert int(version) == FORMAT_VERSION == 3 and rows == {"v": 1, "s": 1}
    with Pool.open(path) as pool:
        assert pool.volume("s").read(0, 4 * BS) == data
        assert pool.volume("v").read(0, 4 * BS) == bytes(BS) + data[BS:]
        status = pool.status()
        assert (status["volume_count"], status["snapshot_count"], status["mapped_bytes"]) == (1, 1, 8 * BS)
    assert "consistent" in thinblock("pool", "check", path).stdout


def test_a_newer_format_is_refused_in_one_sentence(tmp_path: Path) -> None:
    path = str(tmp_path / "p")
    Pool.create(path, 64 * BS).close()
    with sqlite3.connect(Path(path) / "metadata.sqlite") as db:
        db.execute("UPDATE superblock SET value = '4' WHERE key = 'format_version'")
    db.close()
    for args in (("pool", "status", path), ("pool", "check", path), ("volume", "create", path, "v", "--size", "1M")):
        proc = thinblock(*args, check=False)
        assert proc.returncode == 1, proc
        assert proc.stderr.strip().endswith(
            "has metadata format 4, newer than this thinblock's 3: open it with the thinblock that made it, or a newer one"
        ), proc.stderr
        assert proc.stderr.count("\n") == 1
    with sqlite3.connect(Path(path) / "metadata.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM volumes").fetchone()[0] == 0
    db.close()


def test_a_newer_format_is_refused_on_the_memory_backend() -> None:
    locator = f"memory:counters-{uuid.uuid4().hex}"
    location = locate(locator)
    try:
        Pool.create(locator, 64 * BS).close()
        assert isinstance(location, MemoryLocation)
        state = location.open_meta(readonly=True).state
        state.superblock["format_version"] = FORMAT_VERSION + 1
        with pytest.raises(ThinblockError, match="has metadata format 4, newer than this thinblock's 3"):
            Pool.open(locator)
        state.superblock["format_version"] = 2  # an older one is upgraded by the first commit
        Pool.open(locator).close()
        assert state.superblock["format_version"] == FORMAT_VERSION
    finally:
        location.remove_created()


def test_a_snapshot_removal_frees_set_aside_space_for_a_reservation_decision(tmp_path: Path) -> None:
    with Pool.create(str(tmp_path / "p"), 32 * BS) as pool:
        vol = pool.create_volume("db", 8 * BS)
        vol.write(0, random.randbytes(8 * BS))
        pool.set_reserve("db", RESERVE_FULL)  # it holds all 8 blocks alone: nothing set aside
        create_snapshot(pool, "db", "s1")  # now every block may need a copy: 8 set aside
        other = pool.create_volume("other", 64 * BS)
        other.write(0, random.randbytes(16 * BS))  # 32 - 8 used - 8 set aside
        with pytest.raises(NoSpaceError, match="reserved by other volumes"):
            other.write(16 * BS, random.randbytes(BS))
        pool.remove_volume("s1")  # db holds its blocks alone again: its kept count is stale
        assert vol.row.exclusive_blocks == 0 and not vol.exclusive_fresh()
        other.write(16 * BS, random.randbytes(8 * BS))  # the allocation gate recounts db and sees it
        assert vol.row.exclusive_blocks == 8 and pool.status()["reserved_bytes"] == 0
        with pytest.raises(NoSpaceError):
            other.write(24 * BS, random.randbytes(BS))
