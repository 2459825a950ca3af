"""`export --format rbd` carries a volume's snapshots, as `rbd export --export-format 2`
does: thinblock's own import and a real `rbd import --export-format 2` on the test
Ceph cluster both recreate the image with every snapshot, byte for byte; and a real
rbd image with snapshots, exported by rbd, comes back into thinblock with them.

The history is written by real clients (the CLI's import, libnbd over the served
pool's socket); the export runs in the server (live) and in the command (unserved).
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import uuid
from pathlib import Path

from tests.cli import ROOT, export_bytes, volume_names
from tests.nbd_server import Server, apply_steps, served_pool, thinblock
from thinblock.formats import rbd

MiB = 1 << 20
BS = 64 << 10
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def _history(server: Server, tmp_path: Path) -> dict[str, bytes]:
    """Volume v of the served pool with snapshots v@s1, v@s2, v@s3 and more changes
    after the last: a raw import, NBD writes, trims and zeroing, and a grow. Returns
    the bytes of each state, by the name the rbd stream gives it ("" for the head)."""
    pool, rng = server.pool, random.Random(24)
    states: dict[str, bytes] = {}
    first = bytearray(8 * MiB)
    for off, n in ((0, 3 * BS), (2 * MiB + 100, 70_000), (5 * MiB, BS), (8 * MiB - 4096, 4096)):
        first[off : off + n] = rng.randbytes(n)
    raw = tmp_path / "first.raw"
    raw.write_bytes(first)
    thinblock("import", str(raw), pool, "v", "--no-progress")  # through the server's control socket
    model = first
    thinblock("snapshot", "create", pool, "v@s1")
    states["s1"] = bytes(model)
    apply_steps(
        server,
        "v",
        model,
        [("w", BS, rng.randbytes(BS)), ("t", 2 * MiB, MiB), ("z", 0, 512), ("w", 6 * MiB, rng.randbytes(4096))],
    )
    thinblock("snapshot", "create", pool, "v@s2")
    states["s2"] = bytes(model)
    thinblock("volume", "resize", pool, "v", "--size", "12M")
    model += bytes(4 * MiB)
    apply_steps(server, "v", model, [("w", 10 * MiB, rng.randbytes(2 * BS)), ("t", 0, BS), ("w", 5 * MiB, bytes(BS))])
    thinblock("snapshot", "create", pool, "v@s3")
    states["s3"] = bytes(model)
    apply_steps(server, "v", model, [("w", 3 * MiB, rng.randbytes(BS)), ("z", 10 * MiB, BS), ("w", 11 * MiB, b"tail")])
    states[""] = bytes(model)
    assert len(set(states.values())) == 4  # four different states
    return states


def _diffs(stream: bytes) -> list[list[rbd.Event]]:
    """The events of an rbd image stream, one list per diff it holds."""
    dec = rbd.ImageDecoder()
    dec.feed(stream)
    diffs: list[list[rbd.Event]] = [[]]
    while not dec.done:
        event = dec.next_event()
        assert not isinstance(event, rbd.NeedData)
        diffs[-1].append(event)
        if isinstance(event, rbd.End) and not dec.done:
            diffs.append([])
    assert dec.rest() == b""
    return diffs


def _check_zeros_are_records(stream: bytes) -> None:
    """Zeros travel as 'z' records: no 'w' record carries a whole block of zero bytes."""
    for events in _diffs(stream):
        at = 0
        for event in events:
            if isinstance(event, rbd.Data):
                at = event.offset
            elif isinstance(event, rbd.Payload):
                for i in range(-(-at // BS) * BS - at, len(event.data) - BS + 1, BS):
                    assert any(event.data[i : i + BS]), f"a block of zeros sent as data at {at + i}"
                at += len(event.data)


def _import_and_compare(pool: str, stream: Path, name: str, states: dict[str, bytes]) -> None:
    """thinblock's import of stream makes volume `name` with one snapshot per state."""
    result = json.loads(thinblock("import", str(stream), pool, name, "--json", "--no-progress").stdout)
    snaps = [s for s in states if s]
    assert result["snapshots"] == [f"{name}@{s}" for s in snaps]
    for snap in snaps:
        assert export_bytes(pool, f"{name}@{snap}") == states[snap], snap
    assert export_bytes(pool, name) == states[""]


def test_export_format_rbd_carries_the_snapshots_into_thinblock_import(tmp_path: Path) -> None:
    other = str(tmp_path / "other")
    thinblock("pool", "create", other, "--size", "256M")
    with served_pool(tmp_path / "a", "256M", {}) as server:
        states = _history(server, tmp_path)
        # Live: the export runs in the server, which holds the pool.
        live = tmp_path / "live.rbd"
        result = json.loads(thinblock("export", server.pool, "v", str(live), "--format", "rbd", "--json").stdout)
        assert result["snapshots"] == ["s1", "s2", "s3"] and result["diffs"] == 4 and result["left_out"] == []
        assert result["zeroed_bytes"] > 0  # the trims and zeroing are 'z' records
        pool = server.pool
    stream = live.read_bytes()
    diffs = _diffs(stream)
    assert [[(type(e).__name__, getattr(e, "name", None)) for e in d if isinstance(e, rbd.FromSnap | rbd.ToSnap)]
            for d in diffs] == [
        [("ToSnap", "s1")],
        [("FromSnap", "s1"), ("ToSnap", "s2")],
        [("FromSnap", "s2"), ("ToSnap", "s3")],
        [("FromSnap", "s3")],
    ]  # fmt: skip
    assert [e.size_bytes for d in diffs for e in d if isinstance(e, rbd.Size)] == [8 * MiB, 8 * MiB, 12 * MiB, 12 * MiB]
    # Only what changed is in each diff: the whole stream holds far less than four volumes.
    assert len(stream) < 2 * MiB
    _check_zeros_are_records(stream)
    _import_and_compare(other, live, "c", states)

    # Unserved, the command opens the pool itself; a snapshot carries its predecessors
    # and is the image's head.
    upto = tmp_path / "s2.rbd"
    result = json.loads(thinblock("export", pool, "v@s2", str(upto), "--format", "rbd", "--json").stdout)
    assert result["snapshots"] == ["s1", "s2"] and result["diffs"] == 2
    _import_and_compare(other, upto, "d", {"s1": states["s1"], "s2": states["s2"], "": states["s2"]})

    # --no-snapshots: the volume alone, and stderr says what was left out.
    bare = tmp_path / "bare.rbd"
    proc = thinblock("export", pool, "v", str(bare), "--format", "rbd", "--no-snapshots")
    assert "left out of the rbd stream: v@s1, v@s2, v@s3 (--no-snapshots)" in proc.stderr, proc.stderr
    _import_and_compare(other, bare, "e", {"": states[""]})
    proc = thinblock("export", pool, "v", str(tmp_path / "x.raw"), "--no-snapshots", check=False)
    assert proc.returncode == 2 and "--no-snapshots is for --format rbd" in proc.stderr
    thinblock("pool", "check", other)


def test_snapshots_removed_while_the_export_runs_are_still_in_the_stream(tmp_path: Path) -> None:
    """The export reads hidden copies taken at its start: snapshots removed while it waits
    on a full pipe (its stdout, which this test stops reading) are written whole."""
    other = str(tmp_path / "other")
    thinblock("pool", "create", other, "--size", "256M")
    with served_pool(tmp_path / "a", "256M", {}) as server:
        states = _history(server, tmp_path)
        proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "export", server.pool, "v", "-", "--format", "rbd", "--no-progress"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=ENV,
        )
        assert proc.stdout is not None and proc.stderr is not None
        try:
            got = proc.stdout.read(len(rbd.IMAGE_V2))  # written after the copies were taken
            assert got == rbd.IMAGE_V2
            # The stream is far larger than a pipe holds: the export now waits for this reader.
            for snap in ("v@s1", "v@s2", "v@s3"):
                thinblock("snapshot", "remove", server.pool, snap)
            assert volume_names(server.pool) == ["v"]
            got += proc.stdout.read()
            assert proc.wait(120) == 0, proc.stderr.read()
        finally:
            if proc.poll() is None:  # a failure above: the export waits on its pipe
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        assert volume_names(server.pool) == ["v"]  # and no hidden copy is left behind (pool check, at the end)
    stream = tmp_path / "v.rbd"
    stream.write_bytes(got)
    _import_and_compare(other, stream, "c", states)


def test_snapshots_of_snapshots_are_left_out_and_clashing_names_refused(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    raw = tmp_path / "a.raw"
    raw.write_bytes(random.Random(7).randbytes(BS) + bytes(MiB - BS))
    thinblock("import", str(raw), pool, "v", "--no-progress")
    thinblock("snapshot", "create", pool, "v@s1")
    thinblock("snapshot", "create", pool, "v@s1", "v@s1@copy")  # a snapshot of a snapshot
    out = tmp_path / "v.rbd"
    proc = thinblock("export", pool, "v", str(out), "--format", "rbd", "--json")
    assert json.loads(proc.stdout)["snapshots"] == ["s1"]
    assert "left out of the rbd stream: v@s1@copy (a snapshot of snapshot v@s1; rbd has none)" in proc.stderr
    # A diff that does not start where the one before it ended is refused, and leaves nothing.
    stream = out.read_bytes()
    from_s1 = b"f" + struct.pack("<QI", 6, 2) + b"s1"
    assert stream.count(from_s1) == 1
    bad = tmp_path / "bad.rbd"
    bad.write_bytes(stream.replace(from_s1, from_s1[:-1] + b"9"))
    proc = thinblock("import", str(bad), pool, "w", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "a diff starts from snapshot 's9', not at 's1', where the diff before it ended" in proc.stderr
    assert not [n for n in volume_names(pool) if n.startswith("w")]
    # A clone's own snapshots go with it; it is exported whole, not its origin's snapshot.
    thinblock("volume", "clone", pool, "v@s1", "c")
    thinblock("snapshot", "create", pool, "c@t1")
    clone = tmp_path / "c.rbd"
    assert json.loads(thinblock("export", pool, "c", str(clone), "--format", "rbd", "--json").stdout)["snapshots"] == [
        "t1"
    ]
    thinblock("import", str(clone), pool, "c2", "--no-progress")
    assert export_bytes(pool, "c2@t1") == export_bytes(pool, "c2") == raw.read_bytes()
    # Two snapshots of v that rbd would call alike: refused before anything is written.
    thinblock("snapshot", "create", pool, "v", "s1")
    proc = thinblock("export", pool, "v", str(tmp_path / "clash.rbd"), "--format", "rbd", check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "v@s1 and s1 of v would both be called 's1' in the rbd stream" in proc.stderr
    assert not [n for n in os.listdir(tmp_path) if "clash" in n]  # no file, no temporary one
    thinblock("pool", "check", pool)


# ----- a real Ceph cluster -------------------------------------------------------------


def _rbd(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    quiet = ("--no-progress",) if args[0] in ("import", "export") else ()  # the commands with a progress bar
    proc = subprocess.run(
        ["rbd", "-c", os.environ["CEPH_CONF"], *quiet, *args], capture_output=True, text=True, timeout=120
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def _rbd_snaps(image: str) -> list[str]:
    return [s["name"] for s in json.loads(_rbd("snap", "ls", "--format", "json", image).stdout)]


def test_rbd_import_recreates_the_snapshots_and_rbd_export_brings_them_back(tmp_path: Path, ceph: str) -> None:
    with served_pool(tmp_path / "a", "256M", {}) as server:
        states = _history(server, tmp_path)
        stream = tmp_path / "v.rbd"
        thinblock("export", server.pool, "v", str(stream), "--format", "rbd")
        pool = server.pool
    image = f"{ceph}/tb-rbdsnap-{uuid.uuid4().hex[:12]}"
    try:
        # thinblock -> rbd: rbd import makes the image and its three snapshots.
        _rbd("import", "--export-format", "2", str(stream), image)
        assert _rbd_snaps(image) == ["s1", "s2", "s3"]
        for snap, want in states.items():
            out = tmp_path / f"rbd-{snap or 'head'}.raw"
            _rbd("export", f"{image}@{snap}" if snap else image, str(out))
            assert out.read_bytes() == want, snap
        # rbd -> thinblock: rbd's own image export of it (a protected snapshot, rbd's
        # feature and striping records, one more snapshot taken by rbd) comes back whole.
        _rbd("snap", "protect", f"{image}@s2")
        _rbd("snap", "create", f"{image}@s4")
        back = tmp_path / "back.rbd"
        _rbd("export", "--export-format", "2", image, str(back))
        result = json.loads(thinblock("import", str(back), pool, "r", "--json", "--no-progress").stdout)
        assert result["snapshots"] == ["r@s1", "r@s2", "r@s3", "r@s4"]
        for snap, want in {**states, "s4": states[""]}.items():
            assert export_bytes(pool, f"r@{snap}" if snap else "r") == want, snap
    finally:
        _rbd("snap", "unprotect", f"{image}@s2", check=False)
        _rbd("snap", "purge", image, check=False)
        _rbd("rm", image, check=False)
    thinblock("pool", "check", pool)
