"""check, dump, restore and delta at scale, through the real command line: the
vectorised fast paths (tools/check.py, tools/dump.py, core/delta.py) must find one
bad entry among 10^5 mapped ones and name it as the detailed walk does, a dump of
10^5 spread blocks restores to the same dump, and a delta equals a plain model's."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from array import array
from pathlib import Path
from typing import Any

import pytest

from tests.cli import thinblock
from thinblock import Pool
from thinblock.core.delta import changed_extents, changed_ranges
from thinblock.core.mapping import PAGE_ENTRIES, Page
from thinblock.core.snapshot import create_snapshot

BS = 4096
MAPPED = 100_000
SPREAD = 512


def restored_pool(path: Path, volumes: dict[str, list[list[Any]]], vol_blocks: int, pool_blocks: int) -> None:
    """A 4 KiB-block pool holding the given volumes' mappings, by `pool restore` of a
    generated dump (the fast way to 10^5 mapped blocks). A name starting with 's' is
    a snapshot of the first volume."""
    thinblock("pool", "create", "--block-size", "4K", "--size", str(pool_blocks * BS), str(path))
    thinblock("volume", "create", "--size", str(vol_blocks * BS), str(path), "base")
    dump = json.loads(thinblock("pool", "dump", "--json", str(path)).stdout)
    base = dump["volumes"][0]
    dump["volumes"] = []
    for i, (name, mappings) in enumerate(volumes.items(), 1):
        snap = name.startswith("s")
        kind, origin = ("snapshot", 1) if snap else ("volume", None)
        dump["volumes"].append({**base, "id": i, "name": name, "kind": kind, "origin_id": origin, "mappings": mappings})
    dump_path = path.parent / f"{path.name}.json"
    dump_path.write_text(json.dumps(dump))
    thinblock("pool", "restore", "--no-progress", str(path), str(dump_path))


def check(pool: Path) -> list[str]:
    proc = thinblock("pool", "check", "--json", str(pool), check=False)
    problems: list[str] = json.loads(proc.stdout)["problems"]
    assert proc.returncode == (1 if problems else 0), proc.stderr
    return problems


@pytest.fixture(scope="module")
def dense_pool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """v: 10^5 dense mapped blocks (every 7th zeroed, every 11th pinned), s: its snapshot."""
    runs = [[i, i, 1, "zeroed" if i % 7 == 0 else "data", i % 11 == 0] for i in range(MAPPED)]
    path = tmp_path_factory.mktemp("dense") / "pool"
    restored_pool(path, {"v": runs, "s": runs}, MAPPED + 1024, MAPPED + 1024)
    assert check(path) == []
    return path


@pytest.fixture
def pool(dense_pool: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "pool"
    subprocess.run(["cp", "-a", "--sparse=always", str(dense_pool), str(copy)], check=True)
    return copy


def edit(pool: Path, sql: str, *args: Any) -> None:
    conn = sqlite3.connect(pool / "metadata.sqlite")
    conn.execute(sql, args)
    conn.commit()
    conn.close()


def page_of(pool: Path, volume: str, page_index: int) -> tuple[int, array[int]]:
    """The id and entries of a volume's page (decoded by the one codec)."""
    conn = sqlite3.connect(pool / "metadata.sqlite")
    (page_id, refcount, blob) = conn.execute(
        "SELECT p.id, p.refcount, p.entries FROM pages p JOIN roots r ON r.page_id = p.id"
        " JOIN volumes v ON v.id = r.volume_id WHERE v.name = ? AND r.page_index = ?",
        (volume, page_index),
    ).fetchone()
    conn.close()
    return page_id, Page.from_blob(page_id, refcount, blob).entries


def put_entry(pool: Path, page_id: int, entries: array[int], slot: int, entry: int) -> None:
    """One entry changed, the page written back whole (the dense form every codec reads)."""
    changed = array("Q", entries)
    changed[slot] = entry
    edit(pool, "UPDATE pages SET entries = ? WHERE id = ?", changed.tobytes(), page_id)


def test_check_finds_a_refcount_off_by_one(pool: Path) -> None:
    dblock = 54_321
    conn = sqlite3.connect(pool / "metadata.sqlite")
    index, slot = divmod(dblock, 1024)
    blob = bytearray(conn.execute("SELECT counts FROM refcount_pages WHERE idx = ?", (index,)).fetchone()[0])
    conn.close()
    blob[4 * slot : 4 * slot + 4] = (2).to_bytes(4, "little")
    edit(pool, "UPDATE refcount_pages SET counts = ? WHERE idx = ?", bytes(blob), index)
    assert check(pool) == [f"dblock {dblock}: refcount 2 recorded, 1 references found"]


def test_check_finds_a_dblock_beyond_the_pool(pool: Path) -> None:
    page_id, entries = page_of(pool, "v", 100)
    slot = 37
    old = entries[slot] >> 3
    beyond = MAPPED + 1024 + 5
    put_entry(pool, page_id, entries, slot, beyond << 3 | 2)
    assert check(pool) == [
        f"mapping page {page_id} slot {slot}: dblock {beyond} is beyond the data store ({MAPPED + 1024} blocks)",
        f"dblock {old}: refcount 1 recorded but nothing maps it (leaked space)",
        f"superblock records {MAPPED} used blocks, {MAPPED - 1} are referenced",
    ]


def test_check_finds_an_invalid_state(pool: Path) -> None:
    page_id, entries = page_of(pool, "v", 150)
    slot = 300
    assert entries[slot] & 3 == 2  # a data block: it is counted, then not
    put_entry(pool, page_id, entries, slot, entries[slot] | 3)
    problems = check(pool)
    # Whichever codec decodes it, the sentence names the page.
    assert problems and problems[0].startswith(f"mapping page {page_id}"), problems
    assert f"mapping page {page_id} slot {slot}: invalid entry state 3" in problems


def test_check_finds_a_page_refcount_and_a_counter_off_by_one(pool: Path) -> None:
    page_id, _entries = page_of(pool, "s", 42)
    edit(pool, "UPDATE page_refs SET refcount = 3 WHERE id = ?", page_id)  # the authority (meta/sqlite.py)
    edit(pool, "UPDATE volumes SET zeroed_blocks = zeroed_blocks + 1 WHERE name = 'v'")
    zeroed = len(range(0, MAPPED, 7))
    assert check(pool) == [
        f"mapping page {page_id}: refcount 3 stored, 2 root tables use it",
        f"volume v: {zeroed + 1} zeroed blocks recorded, {zeroed} mapped",
    ]


def test_dump_restore_round_trip_of_spread_blocks(tmp_path: Path) -> None:
    """10^5 blocks one per 512-block stretch, in runs of every kind, and a snapshot
    that shares some pages and differs in others: the dump is the model's mappings;
    restored from its text and dumped again, the same volumes and mappings."""
    v = [[i * SPREAD + i % 5, i, 1, "zeroed" if i % 3 == 0 else "data", i % 4 == 0] for i in range(MAPPED)]
    # s maps 1 in 10 of those vblocks elsewhere: those pages differ, the others are shared.
    s = [run if i % 10 else [run[0], MAPPED + i // 10, 1, run[3], run[4]] for i, run in enumerate(v)]
    # w: dense runs of 3, each differing from its neighbours in state or pin (never merged).
    base = MAPPED + MAPPED // 10
    w = [[3 * k, base + 3 * k, 3, "data" if k % 2 else "zeroed", k % 4 == 0] for k in range(1000)]
    vol_blocks, pool_blocks = MAPPED * SPREAD, base + 3000 + 64
    first = tmp_path / "first"
    restored_pool(first, {"v": v, "s": s, "w": w}, vol_blocks, pool_blocks)
    text = thinblock("pool", "dump", str(first)).stdout
    dumped = json.loads(thinblock("pool", "dump", "--json", str(first)).stdout)
    assert [vol["mappings"] for vol in dumped["volumes"]] == [v, s, w]  # by id
    assert check(first) == []
    (tmp_path / "dump.txt").write_text(text)
    thinblock("pool", "restore", "--no-progress", str(first), str(tmp_path / "dump.txt"))  # every table rebuilt
    again = thinblock("pool", "dump", str(first)).stdout
    assert again.splitlines()[2:] == text.splitlines()[2:]  # all but the header and the pool's line (its generation)
    assert check(first) == []


def model_extents(snap: list[str | None], vol: list[str | None], lo: int, hi: int) -> list[tuple[int, int, bool]]:
    """The plain answer: block by block, a token per block (None reads zeros)."""
    out: list[list[Any]] = []
    for b in range(lo // BS, -(-hi // BS)):
        if snap[b] == vol[b] or (snap[b] is None and vol[b] is None):
            continue
        start, stop, zero = max(lo, b * BS), min(hi, b * BS + BS), vol[b] is None
        if out and out[-1][0] + out[-1][1] == start and out[-1][2] == zero:
            out[-1][1] += stop - start
        else:
            out.append([start, stop - start, zero])
    return [(o, n, z) for o, n, z in out]


def test_delta_after_scattered_changes_equals_the_model(tmp_path: Path) -> None:
    n_blocks = 20 * PAGE_ENTRIES
    path = str(tmp_path / "pool")
    tokens: list[str | None] = [None] * n_blocks
    with Pool.create(path, 2 * n_blocks * BS, block_size=BS) as p:
        vol = p.create_volume("v", n_blocks * BS)
        for b in range(0, n_blocks, 3):  # every third block written before the snapshot
            vol.write(b * BS, b"a" * BS)
            tokens[b] = f"a{b}"
        p.commit()
        create_snapshot(p, "v", "s")
        snap = list(tokens)
        for step, b in enumerate(range(5, n_blocks, 37)):  # scattered, over most pages
            # (step // 3) % 3: each change lands on blocks written before and on empty ones.
            if step // 3 % 3 == 0:
                vol.write(b * BS, b"b" * BS)  # a new dblock, even where it held data
                tokens[b] = f"b{b}"
            elif step // 3 % 3 == 1:
                vol.trim(b * BS, BS)
                tokens[b] = None
            else:
                vol.write_zeroes(b * BS, 2 * BS)
                tokens[b] = tokens[b + 1] = None
        p.commit()
        s = p.volume("s")
        size = n_blocks * BS
        for lo, hi in ((0, size), (5 * BS + 100, 3 * PAGE_ENTRIES * BS - 7), (size - 40 * BS, size)):
            expected = model_extents(snap, tokens, lo, hi)
            assert expected, (lo, hi)
            assert changed_extents(s, vol, lo, hi - lo) == expected
            merged: list[list[int]] = []
            for o, n, _z in expected:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1][1] += n
                else:
                    merged.append([o, n])
            assert changed_ranges(s, vol, lo, hi - lo) == [(o, n) for o, n in merged]
    report = json.loads(thinblock("delta", "--json", path, "s", "v").stdout)
    whole = model_extents(snap, tokens, 0, n_blocks * BS)
    assert [(r["offset"], r["length"], r["zero"]) for r in report["ranges"]] == whole
