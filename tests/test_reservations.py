"""Reservations in the library: the guarantee under copy-on-write, refusals
that change nothing, and exact figures after sharing changes hands; and through
the command line, imports into a reserved volume (their staging volume draws on
that volume's set-aside, never another's)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.cli import thinblock, volume_names
from thinblock import NoSpaceError, Pool
from thinblock.core.snapshot import clone, create_snapshot, rollback, stage_empty
from thinblock.meta.base import RESERVE_FULL
from thinblock.tools.check import check_metadata

BS = 64 << 10


def fill(pool: Pool, name: str) -> int:
    vol = pool.create_volume(name, 64 << 20)
    n = 0
    while True:
        try:
            vol.write(n * BS, random.randbytes(BS))
        except NoSpaceError:
            return n
        n += 1


def test_reserved_volume_never_hits_enospc_after_snapshots(tmp_path: Path) -> None:
    with Pool.create(str(tmp_path / "p"), 64 * BS) as pool:
        vol = pool.create_volume("db", 16 * BS)
        for i in range(16):
            vol.write(i * BS, random.randbytes(BS))
        pool.set_reserve("db", RESERVE_FULL)
        assert pool.status()["reserved_bytes"] == 0  # it owns all 16 blocks already
        create_snapshot(pool, "db", "s1")
        assert pool.status()["reserved_bytes"] == 16 * BS  # every block may need a copy now
        fill(pool, "other")
        for i in range(16):  # copy-on-write of every block draws on the reservation
            vol.write(i * BS + 5, b"x")
        assert pool.status()["reserved_bytes"] == 0
        # A second snapshot would need 16 more blocks set aside: refused, nothing changed.
        before = pool.status()
        with pytest.raises(NoSpaceError, match="reservation needs 1M more set aside"):
            create_snapshot(pool, "db", "s2")
        assert {**pool.status(), "host_free_bytes": 0} == {**before, "host_free_bytes": 0}
        # Other volumes cannot take the set-aside space; the reserved volume can.
        pool.remove_volume("s1")
        pool.commit()
        assert pool.status()["reserved_bytes"] == 0


def test_setting_a_reservation_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    with Pool.create(str(tmp_path / "p"), 32 * BS) as pool:
        pool.create_volume("big", 64 * BS)
        with pytest.raises(NoSpaceError, match="unreserved free"):
            pool.set_reserve("big", RESERVE_FULL)
        assert pool.volume("big").row.reserve_bytes == 0
        pool.set_reserve("big", 20 * BS)
        other = pool.create_volume("other", 64 * BS)
        with pytest.raises(NoSpaceError, match="reserved by other volumes"):
            other.write(0, random.randbytes(13 * BS))  # 12 blocks are left unreserved
        other.write(0, random.randbytes(12 * BS))
        with pytest.raises(NoSpaceError):  # growing a 'full' reservation needs room as well
            pool.set_reserve("big", RESERVE_FULL)


def test_set_aside_follows_sharing_changing_hands(tmp_path: Path) -> None:
    with Pool.create(str(tmp_path / "p"), 64 * BS) as pool:
        vol = pool.create_volume("v", 8 * BS)
        for i in range(8):
            vol.write(i * BS, random.randbytes(BS))
        create_snapshot(pool, "v", "s")
        c = clone(pool, "s", "c")
        pool.set_reserve("c", RESERVE_FULL)
        pool.remove_volume("s")  # v and c now share every block directly
        assert pool.status()["reserved_bytes"] == 8 * BS
        vol.write(0, random.randbytes(BS))  # block 0 is c's alone now: one less to set aside
        assert pool.status()["reserved_bytes"] == 7 * BS
        assert pool.volume_info(c)["exclusive_bytes"] == BS
        rollback_target = create_snapshot(pool, "c", "c-snap")
        assert pool.status()["reserved_bytes"] == 8 * BS
        c.write(0, b"y")
        rollback(pool, "c", rollback_target.name)
        assert pool.status()["reserved_bytes"] == 8 * BS


# ----- import into a reserved volume: its staging volume stands in for it ------------


def _status(pool: str) -> dict[str, object]:
    return {**json.loads(thinblock("pool", "status", pool, "--json").stdout), "host_free_bytes": 0}


def _read_all(pool: str, name: str) -> bytes:
    # Not `export`: an export of a live volume stages a snapshot, which a full
    # reservation in a full pool refuses (the volume would need all of it set aside again).
    with Pool.open(pool) as p:
        vol = p.volume(name)
        return vol.read(0, vol.size_bytes)


def test_import_into_a_reserved_volume_fits_its_reservation(tmp_path: Path) -> None:
    """The reviewer's case: a 6M volume reserved in full in an 8M pool. Its import is
    built in a staging volume, which may allocate from the volume's own set-aside (and
    before the fix got ENOSPC naming that set-aside as "reserved by other volumes")."""
    pool = str(tmp_path / "pV")
    thinblock("pool", "create", pool, "--size", "8M")
    thinblock("volume", "create", pool, "r", "--size", "6M")
    thinblock("volume", "set", pool, "r", "--reserve", "full")
    image = random.randbytes(6 << 20)
    (tmp_path / "r6M").write_bytes(image)
    thinblock("import", str(tmp_path / "r6M"), pool, "r", "--force")
    assert _read_all(pool, "r") == image
    status = _status(pool)
    assert (status["used_bytes"], status["reserved_bytes"]) == (6 << 20, 0)  # it holds its R blocks now
    assert json.loads(thinblock("volume", "info", pool, "r", "--json").stdout)["exclusive_bytes"] == 6 << 20
    thinblock("pool", "check", pool)
    # Another import keeps the old 6M until it is done: the 2M left cannot hold the new
    # copy. ENOSPC, saying so, blaming no other volume, and nothing changed.
    proc = thinblock("import", str(tmp_path / "r6M"), pool, "r", "--force", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "out of space" in proc.stderr and "keeps its old contents (6M mapped)" in proc.stderr, proc.stderr
    assert "other volumes" not in proc.stderr, proc.stderr
    assert _status(pool) == status
    assert volume_names(pool) == ["r"]
    assert _read_all(pool, "r") == image
    thinblock("pool", "check", pool)


def test_import_diff_into_a_reserved_volume_fits_its_reservation(tmp_path: Path) -> None:
    src, pool = str(tmp_path / "src"), str(tmp_path / "dst")
    thinblock("pool", "create", src, "--size", "16M")
    image = random.randbytes(6 << 20)
    (tmp_path / "img").write_bytes(image)
    thinblock("import", str(tmp_path / "img"), src, "r")
    thinblock("export-diff", src, "r", str(tmp_path / "r.diff"))
    thinblock("pool", "create", pool, "--size", "8M")
    thinblock("volume", "create", pool, "r", "--size", "6M")
    thinblock("volume", "set", pool, "r", "--reserve", "full")
    thinblock("import-diff", str(tmp_path / "r.diff"), pool, "r")
    assert _read_all(pool, "r") == image
    assert _status(pool)["reserved_bytes"] == 0
    thinblock("pool", "check", pool)


def test_import_cannot_take_another_volumes_reservation(tmp_path: Path) -> None:
    """An import into a may use a's set-aside and the unreserved free space, never b's:
    ENOSPC naming only b's set-aside, nothing changed, and b still gets all of it."""
    pool = str(tmp_path / "p")
    thinblock("pool", "create", pool, "--size", "8M")  # 128 blocks
    thinblock("volume", "create", pool, "a", "--size", "6M")
    thinblock("volume", "create", pool, "b", "--size", "3M")
    thinblock("volume", "set", pool, "b", "--reserve", "full")
    b_head = random.randbytes(1 << 20)
    (tmp_path / "b").write_bytes(b_head + bytes(2 << 20))
    thinblock("import", str(tmp_path / "b"), pool, "b", "--force")  # b holds 16 blocks: 32 set aside
    thinblock("volume", "set", pool, "a", "--reserve", "2M")  # 32 set aside for a
    (tmp_path / "a").write_bytes(random.randbytes(6 << 20))  # 96 blocks; a may use 112 - 32 = 80
    before, names = _status(pool), volume_names(pool)
    proc = thinblock("import", str(tmp_path / "a"), pool, "a", "--force", check=False)
    assert proc.returncode == 1, proc.stderr
    assert "is out of space" in proc.stderr, proc.stderr
    assert "(32 reserved by other volumes)" in proc.stderr, proc.stderr  # b's alone, not a's too
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert _status(pool) == before
    assert volume_names(pool) == names
    assert json.loads(thinblock("volume", "info", pool, "a", "--json").stdout)["mapped_bytes"] == 0
    thinblock("pool", "check", pool)
    # b's reservation held: with the pool as full as the import could make it, every
    # block of b can still be written.
    with Pool.open(pool) as p:
        fill(p, "filler")
        tail = random.randbytes(2 << 20)
        p.volume("b").write(1 << 20, tail)
    assert _read_all(pool, "b") == b_head + tail
    thinblock("pool", "check", pool)


def test_a_staging_volume_counts_toward_the_reservation_it_replaces(tmp_path: Path) -> None:
    """Midway through an import, committed: the staging volume's blocks count toward the
    reserved volume's set-aside in the pool's figures, in `pool check`, and for
    other volumes; a pool reopened with the staging volume left behind drops it and
    sets the whole reservation aside again."""
    path = str(tmp_path / "p")
    with Pool.create(path, 128 * BS) as pool:
        vol = pool.create_volume("r", 96 * BS)
        other = pool.create_volume("o", 96 * BS)
        pool.set_reserve("r", RESERVE_FULL)
        staged = stage_empty(pool, "import", vol.size_bytes, "on", vol)
        for i in range(90):
            staged.write(i * BS, random.randbytes(BS))
        pool.commit()
        assert pool.volume_info(vol)["reserved_bytes"] == 6 * BS
        assert pool.status()["reserved_bytes"] == 6 * BS
        assert check_metadata(pool.meta) == []
        with pytest.raises(NoSpaceError, match=r"33 blocks needed, 32 free \(6 reserved by other volumes\)"):
            other.write(0, random.randbytes(33 * BS))
        other.write(0, random.randbytes(32 * BS))
        staged.write(90 * BS, random.randbytes(6 * BS))  # the last of r's reservation
        assert pool.status()["reserved_bytes"] == 0
        pool.commit()
        assert check_metadata(pool.meta) == []
    with Pool.open(path) as pool:
        assert sorted(pool.volumes) == ["o", "r"]  # the staging volume went at the open
        assert pool.status()["reserved_bytes"] == 96 * BS
        assert pool.status()["free_bytes"] == 96 * BS
    thinblock("pool", "check", path)
