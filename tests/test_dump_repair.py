"""pool dump / restore / repair, through the real command line: a round trip
reproduces `volume list --json` and every volume's bytes; repair recovers a
pool whose refcounts (and a page) were damaged on purpose."""

from __future__ import annotations

import json
import random
import re
import sqlite3
from pathlib import Path

import pytest

from tests.cli import thinblock
from thinblock import Pool
from thinblock.core.snapshot import clone, create_snapshot

BS = 64 << 10


def build(pool: str) -> dict[str, bytes]:
    """A pool with volumes, snapshots of snapshots, a clone, provisioned space and a reservation."""
    rng = random.Random(3)
    with Pool.create(pool, 32 << 20) as p:
        a = p.create_volume("a", 8 << 20)
        b = p.create_volume("b", (4 << 20) + 512, detect_zeroes="unmap")
        for i in range(0, 100, 3):
            a.write(i * BS + rng.randrange(BS - 100), rng.randbytes(100))
        b.write(0, rng.randbytes(3 * BS))
        b.provision(10 * BS, 5 * BS)
        create_snapshot(p, "a", "a1")
        a.write(0, rng.randbytes(2 * BS))
        create_snapshot(p, "a1", "a1a")
        c = clone(p, "a1", "c")
        c.write(5 * BS, rng.randbytes(BS))
        p.set_reserve("b", 2 << 20)
        p.set_policy({"when_full": "wait:5", "low_water": "20", "on_low_water": "logger 'low water'"})
        return {name: v.read(0, v.size_bytes) for name, v in p.volumes.items()}


def listing(pool: str) -> list[dict[str, object]]:
    return json.loads(thinblock("volume", "list", pool, "--json").stdout)


def contents(pool: str) -> dict[str, bytes]:
    with Pool.open(pool) as p:
        return {name: v.read(0, v.size_bytes) for name, v in p.volumes.items()}


@pytest.mark.parametrize("form", ["text", "json"])
def test_dump_restore_round_trip(tmp_path: Path, form: str) -> None:
    pool = str(tmp_path / "pool")
    data = build(pool)
    before = listing(pool)
    status_before = json.loads(thinblock("pool", "status", pool, "--json").stdout)
    dump = tmp_path / "dump"
    thinblock("pool", "dump", pool, "-o", str(dump), *(["--json"] if form == "json" else []))
    text = dump.read_text()
    if form == "text":
        assert text.startswith("thinblock-dump 1\n") and "\nvolume id=" in text and "  map " in text
    else:
        assert json.loads(text)["format"] == "thinblock-dump"
    # Lose the metadata entirely; restore rebuilds it from the dump.
    for f in Path(pool).glob("metadata.sqlite*"):
        f.unlink()
    out = thinblock("pool", "restore", pool, str(dump)).stdout
    assert "restored 5 volume(s)" in out
    thinblock("pool", "check", pool)
    assert listing(pool) == before
    status = json.loads(thinblock("pool", "status", pool, "--json").stdout)
    for key in ("used_bytes", "reserved_bytes", "when_full", "low_water_percent", "on_low_water"):
        assert status[key] == status_before[key], key
    assert contents(pool) == data
    # The dump of the restored pool is the same dump.
    again = tmp_path / "again"
    thinblock("pool", "dump", pool, "-o", str(again), *(["--json"] if form == "json" else []))
    # The same dump, but for its generation: the restore committed, so it is later.
    assert without_generation(again.read_text()) == without_generation(text)
    assert again.read_text() != text


def without_generation(text: str) -> str:
    return re.sub(r'"?transaction_id"?(=|: )\d+,? ?', "", text)


def test_restore_refuses_bad_dumps_and_live_pools(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    build(pool)
    before = listing(pool)
    dump = tmp_path / "dump"
    thinblock("pool", "dump", pool, "-o", str(dump))
    good = dump.read_text()
    cases = {
        "not a dump": "hello\n",
        "beyond the data store": good.replace("  map 0 ", "  map 0 999999", 1),
        "mapped twice": good + "  map 0 3 1 data\n",
        "version": good.replace("thinblock-dump 1", "thinblock-dump 9"),
        "bad line": good + "volume id=zz\n",
    }
    for label, text in cases.items():
        bad = tmp_path / "bad"
        bad.write_text(text)
        proc = thinblock("pool", "restore", pool, str(bad), check=False)
        assert proc.returncode == 1 and proc.stderr.startswith("thinblock: error:"), (label, proc.stderr)
        assert listing(pool) == before, label  # nothing changed
    with Pool.open(pool):  # held by another process: refused
        proc = thinblock("pool", "restore", pool, str(dump), check=False)
        assert proc.returncode == 1 and "already held" in proc.stderr


def test_repair_recovers_damaged_refcounts(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    data = build(pool)
    before = listing(pool)
    db = sqlite3.connect(Path(pool) / "metadata.sqlite")
    with db:
        db.execute("UPDATE refcount_pages SET counts = zeroblob(length(counts))")  # every block 'free'
        db.execute("UPDATE page_refs SET refcount = refcount + 3")
        db.execute("UPDATE superblock SET value = '0' WHERE key = 'used_blocks'")
    db.close()
    check = thinblock("pool", "check", pool, "--json", check=False)
    assert check.returncode == 1 and len(json.loads(check.stdout)["problems"]) > 3
    result = json.loads(thinblock("pool", "repair", pool, "--json").stdout)
    assert result["lost"] == [] and Path(result["backup"]).exists()
    thinblock("pool", "check", pool)
    assert listing(pool) == before
    assert contents(pool) == data


def test_repair_reports_what_it_cannot_save(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    data = build(pool)
    db = sqlite3.connect(Path(pool) / "metadata.sqlite")
    (b_id,) = db.execute("SELECT id FROM volumes WHERE name = 'b'").fetchone()
    (page_id,) = db.execute("SELECT page_id FROM roots WHERE volume_id = ?", (b_id,)).fetchone()
    with db:
        db.execute("UPDATE pages SET entries = x'0102' WHERE id = ?", (page_id,))  # a torn page
    db.close()
    assert thinblock("pool", "check", pool, check=False).returncode == 1
    out = thinblock("pool", "repair", pool).stdout
    assert "lost: volume b: blocks 0-511 lost" in out
    thinblock("pool", "check", pool)
    after = contents(pool)
    assert after["b"] == bytes(len(data["b"]))  # what was lost reads zeros, never stale data
    assert {k: v for k, v in after.items() if k != "b"} == {k: v for k, v in data.items() if k != "b"}


def test_dump_to_a_file_refuses_what_it_would_destroy(tmp_path: Path) -> None:
    """pool dump -o: an existing file needs --force, the pool's own files are refused
    even with it, and a bad path is one sentence; none of them changes anything."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "v", "--size", "1M")
    out = tmp_path / "dump.txt"
    out.write_text("keep me")
    for target, extra, said in (
        (out, [], "exists: pass --force"),
        (tmp_path / "nowhere" / "d", [], "No such file or directory"),
        (Path(pool) / "metadata.sqlite", ["--force"], "inside pool"),
        (Path(pool) / "new-file", [], "inside pool"),
    ):
        proc = thinblock("pool", "dump", pool, "-o", str(target), *extra, check=False)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert out.read_text() == "keep me"
    assert not (Path(pool) / "new-file").exists()
    assert "v" in thinblock("volume", "list", pool).stdout  # the pool's metadata is intact
    thinblock("pool", "dump", pool, "-o", str(out), "--force")
    assert "volume" in out.read_text() and (out.stat().st_mode & 0o777) == 0o600
