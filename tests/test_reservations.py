"""Reservations in the library: the guarantee under copy-on-write, refusals
that change nothing, and exact figures after sharing changes hands."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from thinblock import NoSpaceError, Pool
from thinblock.core.snapshot import clone, create_snapshot, rollback
from thinblock.meta.base import RESERVE_FULL

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
