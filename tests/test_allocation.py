"""What "allocated" means to clients, through a real server and real clients.

base:allocation reports every mapped block as allocated, shared with a snapshot
or not (qemu-img compare/map, nbdinfo --map, nbdcopy and qemu-img convert must
see the data as data and still copy sparsely); thinblock:guaranteed says where
a write can never fail with ENOSPC, and keeps saying the truth while snapshots
are taken concurrently on a full pool."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nbd
import pytest

from tests.nbd_server import Server, connect, offered_contexts, served_pool, thinblock
from tests.test_snapshots_nbd import extents
from thinblock.admin.access import open_admin

BS = 64 << 10
MiB = 1 << 20
GUARANTEED = "thinblock:guaranteed"


def run(*cmd: str, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode in ok, f"{cmd}: {proc.returncode}\n{proc.stdout}{proc.stderr}"
    return proc


def _image(path: Path, size: int, seed: int) -> list[tuple[int, int]]:
    """A sparse raw image with scattered data (some of it in partial blocks); its data ranges."""
    rng = random.Random(seed)
    ranges = [(o * BS + rng.choice([0, 512, 4096]), rng.choice([BS // 2, BS, 3 * BS])) for o in range(0, 200, 9)]
    with open(path, "wb") as f:
        f.truncate(size)
        for off, n in ranges:
            f.seek(off)
            f.write(rng.randbytes(n))
    return ranges


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Server]:
    with served_pool(tmp_path, "64M", {"vm": "16M"}) as server:
        yield server


def _same(server: Server, src: Path, export: str) -> None:
    proc = run("qemu-img", "compare", "-f", "raw", "-F", "raw", str(src), server.unix_uri(export), ok=(0, 1))
    assert proc.returncode == 0, f"{export}: {proc.stdout}{proc.stderr}"


def _data_is_present(server: Server, export: str, ranges: list[tuple[int, int]]) -> None:
    """qemu-img map and nbdinfo --map put every written byte in an allocated extent."""
    mapping = json.loads(run("qemu-img", "map", "--output=json", "-f", "raw", server.unix_uri(export)).stdout)
    nbdinfo = json.loads(run("nbdinfo", "--map", "--json", server.unix_uri(export)).stdout)
    for off, n in ranges:
        for m in mapping:
            if m["start"] < off + n and off < m["start"] + m["length"]:
                assert m["present"] and m["data"], f"{export}: qemu-img map says {m} over data at {off}"
        for e in nbdinfo:
            if e["offset"] < off + n and off < e["offset"] + e["length"]:
                assert not e["type"] & 1, f"{export}: nbdinfo --map says hole {e} over data at {off}"


def _sparse_copies(server: Server, tmp: Path, export: str, src: Path, ranges: list[tuple[int, int]]) -> None:
    """nbdcopy and qemu-img convert copy the bytes and leave the holes holes."""
    data_bytes = sum(n for _o, n in ranges)
    for tool, out in (("nbdcopy", tmp / f"{export}.nbdcopy"), ("convert", tmp / f"{export}.convert")):
        out.unlink(missing_ok=True)
        if tool == "nbdcopy":
            run("nbdcopy", server.unix_uri(export), str(out))
        else:
            run("qemu-img", "convert", "-f", "raw", "-O", "raw", server.unix_uri(export), str(out))
        assert out.read_bytes() == src.read_bytes(), tool
        # Whole blocks at most around each range: the 14 MiB of holes are not written.
        assert os.stat(out).st_blocks * 512 <= data_bytes + len(ranges) * 2 * BS, tool


def test_snapshot_data_stays_allocated_for_qemu(served: Server, tmp_path: Path) -> None:
    src = tmp_path / "src.raw"
    ranges = _image(src, 16 * MiB, 1)
    run("qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", str(src), served.unix_uri("vm"))
    _same(served, src, "vm")
    thinblock("snapshot", "create", served.pool, "vm", "s1")
    # Every block of vm is now shared with s1: still data, to every client.
    for export in ("vm", "s1"):
        _same(served, src, export)
        _data_is_present(served, export, ranges)
    _sparse_copies(served, tmp_path, "vm", src, ranges)
    thinblock("volume", "clone", served.pool, "s1", "c1")
    _same(served, src, "c1")
    _data_is_present(served, "c1", ranges)
    _sparse_copies(served, tmp_path, "c1", src, ranges)
    # Overwrite vm, roll it back: shared with s1 again.
    h = connect(served, "vm")
    h.pwrite(b"x" * BS, 0)
    h.flush()
    h.shutdown()
    thinblock("volume", "rollback", served.pool, "vm", "s1")
    _same(served, src, "vm")
    _data_is_present(served, "vm", ranges)
    # Removing the snapshot hands its blocks back to vm and c1 alone.
    thinblock("snapshot", "remove", served.pool, "s1")
    for export in ("vm", "c1"):
        _same(served, src, export)
        _data_is_present(served, export, ranges)
    _sparse_copies(served, tmp_path, "vm", src, ranges)


def test_base_allocation_flags(served: Server) -> None:
    h = connect(served, "vm", ("base:allocation", GUARANTEED))
    h.pwrite(b"d" * BS, 0)
    h.zero(BS, BS, nbd.CMD_FLAG_NO_HOLE)  # ZEROED
    h.flush()
    thinblock("snapshot", "create", served.pool, "vm", "s1")
    flags = extents(h, "base:allocation", 3 * BS)
    assert [(o, n, f) for o, n, f in flags] == [
        (0, BS, 0),  # shared DATA: allocated, not zero
        (BS, BS, nbd.STATE_ZERO),  # ZEROED: allocated, reads zero
        (2 * BS, BS, nbd.STATE_HOLE | nbd.STATE_ZERO),  # UNMAPPED
    ]
    # Without a reservation nothing is guaranteed, shared or not.
    assert extents(h, GUARANTEED, 16 * MiB) == [(0, 16 * MiB, 0)]


def test_guaranteed_context_is_offered_and_follows_the_reservation(served: Server) -> None:
    offered = offered_contexts(served, "vm")
    assert GUARANTEED in offered and "base:allocation" in offered

    h = connect(served, "vm", (GUARANTEED,))
    assert h.can_meta_context(GUARANTEED)
    h.pwrite(b"d" * 2 * BS, 0)
    h.zero(BS, 4 * BS, nbd.CMD_FLAG_NO_HOLE)
    h.flush()
    assert extents(h, GUARANTEED, 16 * MiB) == [(0, 16 * MiB, 0)]
    thinblock("volume", "set", served.pool, "vm", "--reserve", "8M")  # half the volume: ranges unknown
    assert extents(h, GUARANTEED, 16 * MiB) == [(0, 16 * MiB, 0)]
    thinblock("volume", "set", served.pool, "vm", "--reserve", "full")
    want = [(0, 2 * BS, 1), (2 * BS, 2 * BS, 0), (4 * BS, BS, 1), (5 * BS, 16 * MiB - 5 * BS, 0)]
    assert extents(h, GUARANTEED, 16 * MiB) == want
    thinblock("snapshot", "create", served.pool, "vm", "s1")
    assert extents(h, GUARANTEED, 16 * MiB) == want  # shared now, and still covered
    s = connect(served, "s1", (GUARANTEED,))
    assert extents(s, GUARANTEED, 16 * MiB) == [(0, 16 * MiB, 0)]  # read-only: no writes to promise


def test_no_enospc_where_guaranteed_under_concurrent_snapshots(tmp_path: Path) -> None:
    """Two volumes, one fully reserved and one thin, are rewritten by clients that
    trust thinblock:guaranteed, while snapshots of both are taken and removed every
    0.2 s and a filler keeps the pool full. Any ENOSPC on a range reported
    guaranteed fails the test; a snapshot may instead be refused with ENOSPC."""
    with served_pool(tmp_path, "8M", {"resv": "2M", "thin": "2M", "fill": "64M"}) as server:  # 128 blocks
        thinblock("volume", "set", server.pool, "resv", "--reserve", "full")
        for name in ("resv", "thin"):
            h = connect(server, name)
            h.pwrite(random.randbytes(2 * MiB), 0)
            h.flush()
            h.shutdown()
        stop = threading.Event()
        counts = {"guaranteed_writes": 0, "other_enospc": 0, "snapshots": 0, "refused": 0}
        violations: list[str] = []
        errors: list[BaseException] = []
        lock = threading.Lock()

        def writer(name: str, rng: random.Random) -> None:
            h = connect(server, name, (GUARANTEED,))
            size = h.get_size()
            while not stop.is_set():
                sure = [(o, n) for o, n, f in extents(h, GUARANTEED, size) if f & 1]
                # Write every guaranteed block reported, one by one: the longer the
                # time since the report, the likelier a snapshot came between.
                for o, n in sure:
                    for pos in range(o, o + n, BS):
                        try:
                            h.pwrite(rng.randbytes(min(BS, o + n - pos)), pos)
                            with lock:
                                counts["guaranteed_writes"] += 1
                        except nbd.Error as exc:
                            violations.append(f"{name} @{pos}: errno {exc.errnum}: {exc}")
                pos = rng.randrange(size // BS) * BS
                if not any(o <= pos < o + n for o, n in sure):
                    try:
                        h.pwrite(rng.randbytes(BS), pos)
                    except nbd.Error as exc:
                        assert exc.errnum == errno.ENOSPC
                        with lock:
                            counts["other_enospc"] += 1
            h.shutdown()

        def filler() -> None:
            h = connect(server, "fill")
            rng = random.Random(7)
            while not stop.is_set():
                try:
                    h.pwrite(rng.randbytes(BS), rng.randrange(1024) * BS)
                except nbd.Error as exc:
                    assert exc.errnum == errno.ENOSPC
                    h.trim(16 * BS, rng.randrange(1008) * BS) if rng.random() < 0.3 else time.sleep(0.01)
            h.shutdown()

        def snapshotter() -> None:
            n = 0
            with open_admin(server.pool) as admin:
                while not stop.is_set():
                    for name in ("resv", "thin"):
                        n += 1
                        try:
                            admin.call("snapshot_create", volume=name, name=f"{name}-s{n}")
                            counts["snapshots"] += 1
                        except OSError as exc:
                            assert exc.errno == errno.ENOSPC and "reservation" in str(exc), exc
                            counts["refused"] += 1
                        old = [v["name"] for v in admin.call("volume_list", kind="snapshot")]
                        for victim in old[:-2]:
                            admin.call("volume_remove", name=victim, kind="snapshot")
                    time.sleep(0.2)

        def guarded(fn: Callable[..., None], *args: object) -> threading.Thread:
            def body() -> None:
                try:
                    fn(*args)
                except BaseException as exc:  # reported by the test thread
                    errors.append(exc)
                    stop.set()

            t = threading.Thread(target=body)
            t.start()
            return t

        threads = [guarded(filler), guarded(snapshotter)]
        for i, name in enumerate(("resv", "resv", "thin", "thin")):
            threads.append(guarded(writer, name, random.Random(i)))
        # At least the given seconds, and on until enough happened (a slow machine does
        # less in a second; the claims below need the counts, not the time).
        least = time.monotonic() + float(os.environ.get("THINBLOCK_GUARANTEE_SECONDS", "8"))
        deadline = least + 120
        while not stop.is_set() and time.monotonic() < deadline:
            enough = counts["guaranteed_writes"] > 200 and counts["snapshots"] > 5 and counts["other_enospc"] > 0
            if enough and time.monotonic() >= least:
                break
            time.sleep(0.2)
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert not violations, f"{len(violations)} ENOSPC on guaranteed ranges: {violations[:5]}"
        assert counts["guaranteed_writes"] > 200, counts
        assert counts["snapshots"] > 5, counts
        assert counts["other_enospc"] > 0, counts  # the pool really was full


def test_rbd_style_snapshot_names_and_descriptions(served: Server) -> None:
    h = connect(served, "vm")
    h.pwrite(b"s" * BS, 0)
    h.flush()
    before = time.time()
    out = thinblock("snapshot", "create", served.pool, "vm@s1").stdout
    assert "created snapshot vm@s1 of vm" in out
    thinblock("snapshot", "create", served.pool, "vm@s1", "flat")  # flat names work as before
    listing = {v["name"]: v for v in json.loads(thinblock("snapshot", "list", served.pool, "--json").stdout)}
    assert listing["vm@s1"]["origin"] == "vm" and listing["flat"]["origin"] == "vm@s1"
    got = run("qemu-io", "-f", "raw", "-r", "-c", "read -P 0x73 0 64k", served.unix_uri("vm@s1")).stdout
    assert "read 65536/65536" in got
    exports = {
        e["export-name"]: e
        for e in json.loads(run("nbdinfo", "--list", "--json", served.unix_uri("")).stdout)["exports"]
    }
    assert exports["vm"]["description"] == "thinblock volume vm"
    desc = exports["vm@s1"]["description"]
    assert desc.startswith("thinblock snapshot vm@s1 of vm, taken ") and desc.endswith(" UTC"), desc
    taken = time.mktime(time.strptime(desc.split("taken ")[1], "%Y-%m-%d %H:%M:%S UTC")) - time.timezone
    assert before - 2 <= taken <= time.time() + 1
    bad = thinblock("volume", "create", served.pool, "vm@x", "--size", "1M", check=False)
    assert bad.returncode == 1 and "invalid volume name 'vm@x'" in bad.stderr
    usage = thinblock("snapshot", "create", served.pool, "vm", check=False)
    assert usage.returncode == 2 and "VOLUME@SNAP" in usage.stderr
    thinblock("snapshot", "remove", served.pool, "flat")
    thinblock("snapshot", "remove", served.pool, "vm@s1")
