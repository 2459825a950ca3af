"""Scale benchmark: the costs that must not grow with the pool (issue 25), three scales each.

    .venv/bin/python bench/bench_scale.py [--only SECTION,...] [--quick] [--json]
    .venv/bin/python bench/bench_scale.py --exports 1K,10K,100K --dense 10K,100K,1M ...

Every figure is measured at three scales, 10x apart, and reported with its
growth per 10x (time at the larger scale / time at the smaller; 10 is linear,
1 is flat); where a peer exists it is measured in the same run, alternating
which goes first, and the ratio is shown. Two runs of each; the lower is
used. Command-line figures are the command's time minus `python -c pass`.
Sections (--only):

  exports   NBD_OPT_LIST and `nbdinfo --list` over M exports (volumes and
            their snapshots, nine snapshots per volume), a client timeout each
  listings  `volume list --json` and `pool status --json` over N objects, and
            over N snapshots of one volume
  spread    snapshot create, pool check, pool status, pool dump with N blocks
            written one per 512 (one per mapping page)
  dense     pool check with N mapped blocks, alone and with one snapshot; peers
            qemu-img check (qcow2, 4 KiB clusters, as many mapped) and
            thin_check / thin_dump (dm-thin metadata thin_restore'd with as
            many mappings); then snapshot remove after 1% of the volume
            changed, CLI snapshot create, server start, commit latency
  stream    full sequential 1 MiB read of a volume and fill of the pool, N
            blocks of 4 KiB, vs a plain sparse file read and written the same
            way; with CPU seconds and blocks read from disk, to tell Python's
            cost from the kernel's (see docs/benchmarks.md)
  depth     4 KiB read and write latency against snapshot-chain depth
  pages     metadata bytes per mapped block: runs bench/bench_pages.py if present

The dense and stream pools use 4 KiB blocks, so that 10^6 blocks are 4 GiB.
Nothing is asserted: this prints what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_nbd import _stop as stop_server
from bench.bench_nbd import wait_for
from bench.scale_pools import make_many_exports
from thinblock import Pool
from thinblock.core.snapshot import create_snapshot, share_into

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30
BS = 4096  # dense, spread and stream pools: 10^6 blocks are 4 GiB
TB = [sys.executable, "-m", "thinblock"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
SECTIONS = ("exports", "listings", "spread", "dense", "stream", "depth", "pages")


def progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


def count(text: str) -> int:
    """10K, 1M, 100000: a count (K and M are powers of ten here, not of two)."""
    text = text.strip().upper()
    factor = {"K": 1000, "M": 1000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if factor > 1 else text) * factor)


def counts(text: str) -> list[int]:
    return [count(part) for part in text.split(",")]


def growth(scales: list[int], values: list[float]) -> list[float | None]:
    """Growth per 10x between neighbouring scales: (b / a) ** (1 / log10(scale ratio)),
    so 10 is linear and 1 flat whatever the scales (10x apart by default)."""
    out: list[float | None] = []
    for (s1, a), (s2, b) in zip(
        zip(scales, values, strict=True), zip(scales[1:], values[1:], strict=True), strict=False
    ):
        out.append((b / a) ** (1 / math.log10(s2 / s1)) if a > 0 and b > 0 and s2 > s1 else None)
    return out


# ----- pool makers --------------------------------------------------------------


def make_dense(pool_dir: str, n: int, *, spare: float = 0.03) -> None:
    """A pool of 4 KiB blocks with one volume "disk" of n blocks, all mapped (provisioned:
    each has its own dblock, pre-allocated below, no data written), and room for 3% and 1,024 more."""
    Pool.create(pool_dir, int(n * (1 + spare) + 1024) * BS, block_size=BS).close()
    pool = Pool.open(pool_dir, autocommit=False)
    try:
        vol = pool.create_volume("disk", n * BS)
        vol.provision(0, n * BS)
        pool.commit()
    finally:
        pool.close()


def make_spread(pool_dir: str, n: int) -> None:
    """One volume with n blocks written one per 512 (one per mapping page)."""
    Pool.create(pool_dir, (n + 64) * BS, block_size=BS).close()
    pool = Pool.open(pool_dir, autocommit=False)
    try:
        vol = pool.create_volume("disk", n * 512 * BS)
        payload = b"\x5a" * 512
        for i in range(n):
            vol.write(i * 512 * BS, payload)
        pool.commit()
    finally:
        pool.close()


def make_snapshots_of_one(pool_dir: str, n: int, mapped: int = 4096) -> None:
    """One volume with `mapped` blocks of data and n snapshots of it, in one commit."""
    Pool.create(pool_dir, (mapped + 64) * BS, block_size=BS).close()
    pool = Pool.open(pool_dir, autocommit=False)
    try:
        vol = pool.create_volume("disk", 4 * mapped * BS)
        chunk = os.urandom(MiB)
        for off in range(0, mapped * BS, MiB):
            vol.write(off, chunk)
        with pool.lock:
            for j in range(n):
                share_into(pool, vol, f"s{j}", "snapshot")  # as snapshot create does, without a commit each
        pool.commit()
    finally:
        pool.close()


# ----- measuring ----------------------------------------------------------------


def run_s(cmd: list[str], *, timeout: float | None = None) -> tuple[float, int, str]:
    """(seconds, exit status, last line of stderr); -1 and the timeout when it ran out."""
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return time.perf_counter() - start, -1, f"timed out after {timeout:.0f} s"
    tail = (done.stderr.strip().splitlines() or [""])[-1]
    return time.perf_counter() - start, done.returncode, tail


_STARTUP: list[float] = []


def python_start() -> float:
    """`python -c pass`: subtracted from every command-line figure (measured once, best of 5)."""
    if not _STARTUP:
        _STARTUP.append(min(run_s([sys.executable, "-c", "pass"])[0] for _ in range(5)))
    return _STARTUP[0]


def cli(*args: str, runs: int = 2) -> float:
    """Best of `runs` of a thinblock command, minus Python's start; it must succeed."""
    best = float("inf")
    for _ in range(runs):
        seconds, status, tail = run_s([*TB, *args])
        if status != 0:
            raise RuntimeError(f"thinblock {' '.join(args)} failed ({status}): {tail}")
        best = min(best, seconds)
    return best - python_start()


@contextmanager
def served(pool_dir: str) -> Iterator[tuple[str, float]]:
    """A running `thinblock serve` on its default socket: (socket path, seconds to start)."""
    sock = os.path.join(pool_dir, "nbd.sock")
    start = time.perf_counter()
    proc = subprocess.Popen([*TB, "serve", pool_dir], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(sock, proc, limit=600, poll=0.01)  # fine-grained: server start is measured
        yield sock, time.perf_counter() - start
    finally:
        stop_server(proc)


# A client in its own process, so that a listing that never ends can be stopped.
_LIST_CLIENT = """
import json, sys, time, nbd
h = nbd.NBD()
h.set_opt_mode(True)
h.connect_uri(sys.argv[1])
names = []
start = time.perf_counter()
h.opt_list(lambda name, description: names.append(name) or 0)
print(json.dumps({"seconds": time.perf_counter() - start, "exports": len(names)}))
"""


def section_exports(scratch: Path, scales: list[int], timeout: float, r: dict[str, Any]) -> None:
    rows = []
    for n in scales:
        pool_dir = str(scratch / f"exports-{n}")
        progress(f"exports: building a pool with {n} volumes and snapshots")
        make_many_exports(pool_dir, n)
        row: dict[str, Any] = {"exports": n}
        with served(pool_dir) as (sock, started):
            row["server_start_s"] = started
            uri = f"nbd+unix:///?socket={sock}"
            lists, infos = [], []
            for _ in range(2):
                progress(f"exports: NBD_OPT_LIST over {n}")
                try:
                    out = subprocess.run(
                        [sys.executable, "-c", _LIST_CLIENT, uri],
                        capture_output=True,
                        text=True,
                        timeout=timeout,
                    )
                    got = json.loads(out.stdout) if out.returncode == 0 else None
                    if got is None:
                        row["opt_list_error"] = (out.stderr.strip().splitlines() or ["failed"])[-1]
                    else:
                        lists.append(got["seconds"])
                        row["opt_list_exports"] = got["exports"]
                except subprocess.TimeoutExpired:
                    row["opt_list_error"] = f"no answer within {timeout:.0f} s"
                    break
                seconds, status, tail = run_s(["nbdinfo", "--list", uri], timeout=timeout)
                if status == 0:
                    infos.append(seconds)
                else:
                    row["nbdinfo_error"] = tail
                    break
            row["opt_list_s"] = min(lists) if lists else None
            row["nbdinfo_list_s"] = min(infos) if infos else None
        rows.append(row)
        shutil.rmtree(pool_dir, ignore_errors=True)
    r["exports"] = {
        "rows": rows,
        "growth_opt_list": growth(scales, [x["opt_list_s"] or 0.0 for x in rows]),
        "growth_nbdinfo": growth(scales, [x["nbdinfo_list_s"] or 0.0 for x in rows]),
    }


def section_listings(scratch: Path, objects: list[int], snaps: list[int], r: dict[str, Any]) -> None:
    # The floor under every command: importing thinblock and parsing arguments.
    out: dict[str, Any] = {"python_start_s": python_start(), "thinblock_help_s": cli("--help")}
    for label, scales, maker in (("objects", objects, make_many_exports), ("snapshots", snaps, make_snapshots_of_one)):
        rows = []
        for n in scales:
            pool_dir = str(scratch / f"list-{label}-{n}")
            progress(f"listings: {n} {label}")
            maker(pool_dir, n)
            rows.append(
                {
                    label: n,
                    "volume_list_s": cli("volume", "list", pool_dir, "--json"),
                    "pool_status_s": cli("pool", "status", pool_dir, "--json"),
                }
            )
            shutil.rmtree(pool_dir, ignore_errors=True)
        out[label] = {
            "rows": rows,
            "growth_volume_list": growth(scales, [x["volume_list_s"] for x in rows]),
            "growth_pool_status": growth(scales, [x["pool_status_s"] for x in rows]),
        }
    r["listings"] = out


def section_spread(scratch: Path, scales: list[int], r: dict[str, Any]) -> None:
    rows = []
    for n in scales:
        pool_dir = str(scratch / f"spread-{n}")
        progress(f"spread: {n} blocks one per 512")
        make_spread(pool_dir, n)
        snap_s = []
        for i in range(2):
            snap_s.append(cli("snapshot", "create", pool_dir, "disk", f"s{i}", runs=1))
        rows.append(
            {
                "blocks": n,
                "snapshot_create_s": min(snap_s),
                "pool_check_s": cli("pool", "check", pool_dir),
                "pool_status_s": cli("pool", "status", pool_dir, "--json"),
                "pool_dump_s": cli("pool", "dump", pool_dir, "-o", os.devnull),
            }
        )
        shutil.rmtree(pool_dir, ignore_errors=True)
    keys = ("snapshot_create_s", "pool_check_s", "pool_status_s", "pool_dump_s")
    r["spread"] = {"rows": rows, **{f"growth_{k}": growth(scales, [x[k] for x in rows]) for k in keys}}


def thin_metadata(path: Path, n: int, snapshot: bool) -> None:
    """dm-thin metadata with n mappings in one device (and its snapshot, sharing them)."""
    xml = path.with_suffix(".xml")
    devices = 2 if snapshot else 1
    with open(xml, "w") as f:
        f.write(
            f'<superblock uuid="" time="1" transaction="1" flags="0" version="2"'
            f' data_block_size="128" nr_data_blocks="{n + 64}">\n'
        )
        for dev in range(devices):
            f.write(
                f'  <device dev_id="{dev}" mapped_blocks="{n}" transaction="0" creation_time="{dev}" snap_time="1">\n'
            )
            # One mapping a line, as a device written block by block holds them (a
            # range_mapping is only the dump's shorthand; the btree holds each).
            for vblock in range(n):
                f.write(f'    <single_mapping origin_block="{vblock}" data_block="{vblock}" time="0"/>\n')
            f.write("  </device>\n")
        f.write("</superblock>\n")
    with open(path, "wb") as f:
        f.truncate(max(64 * MiB, n * 64 * devices))
    subprocess.run(["thin_restore", "-i", str(xml), "-o", str(path)], check=True, capture_output=True)
    xml.unlink()


QCOW2_CREATE = ["qemu-img", "create", "-q", "-f", "qcow2", "-o", "cluster_size=4096,preallocation=metadata"]


def qcow2_mapped(path: Path, n: int) -> None:
    subprocess.run(
        [*QCOW2_CREATE, str(path), str(n * BS)],
        check=True,
    )


def best_of(cmd: list[str], runs: int = 2) -> float:
    best = float("inf")
    for _ in range(runs):
        seconds, status, tail = run_s(cmd)
        if status != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({status}): {tail}")
        best = min(best, seconds)
    return best


def alternate(row: dict[str, Any], jobs: list[tuple[str, list[str]]], *, reverse: bool) -> None:
    """Best of two runs of each command, the order reversed from scale to scale; thinblock's
    own commands lose Python's start (the peers are C programs)."""
    for key, cmd in jobs[::-1] if reverse else jobs:
        row[key] = best_of(cmd) - (python_start() if cmd[:2] == TB[:2] else 0.0)


def commit_latency(pool_dir: str, n: int, ops: int = 200) -> tuple[float, float]:
    """Median seconds of a 4 KiB write plus commit: to a new block, and overwriting one."""
    pool = Pool.open(pool_dir, autocommit=False)
    try:
        vol = pool.volume("disk")
        pool.resize_volume("disk", vol.size_bytes + ops * BS)
        data = os.urandom(BS)
        fresh, over = [], []
        for i in range(ops):
            start = time.perf_counter()
            vol.write((n + i) * BS, data)
            pool.commit()
            fresh.append(time.perf_counter() - start)
        for i in range(ops):
            start = time.perf_counter()
            vol.write((n + i) * BS, data)
            pool.commit()
            over.append(time.perf_counter() - start)
        return statistics.median(fresh), statistics.median(over)
    finally:
        pool.close()


def change_percent(pool_dir: str, n: int) -> None:
    """Overwrite 1% of the volume's blocks (spread evenly) after a snapshot took them all."""
    pool = Pool.open(pool_dir, autocommit=False)
    try:
        vol = pool.volume("disk")
        data = os.urandom(BS)
        for vblock in range(0, n, 100):
            vol.write(vblock * BS, data)
        pool.commit()
    finally:
        pool.close()


def section_dense(scratch: Path, scales: list[int], r: dict[str, Any]) -> None:
    rows = []
    for index, n in enumerate(scales):
        pool_dir = str(scratch / f"dense-{n}")
        progress(f"dense: {n} mapped blocks")
        make_dense(pool_dir, n)
        qcow = scratch / f"peer-{n}.qcow2"
        qcow2_mapped(qcow, n)
        thin1, thin2 = scratch / f"thin1-{n}.bin", scratch / f"thin2-{n}.bin"
        thin_metadata(thin1, n, snapshot=False)
        thin_metadata(thin2, n, snapshot=True)
        row: dict[str, Any] = {"blocks": n}

        check = [*TB, "pool", "check", pool_dir]
        alternate(
            row,
            [
                ("pool_check_s", check),
                ("qemu_img_check_s", ["qemu-img", "check", "-q", str(qcow)]),
                ("thin_check_s", ["thin_check", "-q", str(thin1)]),
                ("thin_dump_s", ["thin_dump", "-o", os.devnull, str(thin1)]),
            ],
            reverse=index % 2 == 1,
        )
        row["snapshot_create_cli_s"] = cli("snapshot", "create", pool_dir, "disk", "snap", runs=1)
        alternate(
            row,
            [
                ("pool_check_with_snapshot_s", check),
                ("thin_check_with_snapshot_s", ["thin_check", "-q", str(thin2)]),
                ("thin_dump_with_snapshot_s", ["thin_dump", "-o", os.devnull, str(thin2)]),
            ],
            reverse=index % 2 == 1,
        )
        progress(f"dense: changing 1% of {n} blocks, then removing the snapshot")
        change_percent(pool_dir, n)
        row["snapshot_remove_1pct_s"] = cli("snapshot", "remove", pool_dir, "snap", runs=1)
        starts = []
        for _ in range(2):
            with served(pool_dir) as (_sock, started):
                starts.append(started)
        row["server_start_s"] = min(starts)
        row["commit_new_block_s"], row["commit_overwrite_s"] = commit_latency(pool_dir, n)
        row["ratio_check_vs_thin_check"] = row["pool_check_s"] / row["thin_check_s"]
        row["ratio_check_vs_qemu_img"] = row["pool_check_s"] / row["qemu_img_check_s"]
        row["ratio_check_snapshot_vs_thin_check"] = (
            row["pool_check_with_snapshot_s"] / row["thin_check_with_snapshot_s"]
        )
        rows.append(row)
        shutil.rmtree(pool_dir, ignore_errors=True)
        for p in (qcow, thin1, thin2):
            p.unlink()
    keys = [k for k in rows[0] if k.endswith("_s")]
    r["dense"] = {"rows": rows, **{f"growth_{k}": growth(scales, [x[k] for x in rows]) for k in keys}}


def _usage() -> tuple[float, int]:
    """(CPU seconds of this process, blocks it read from disk so far)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_inblock


def _measure(fn: Callable[[], None], nbytes: int) -> dict[str, float]:
    cpu0, in0 = _usage()
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    cpu1, in1 = _usage()
    return {"GBps": nbytes / wall / 1e9, "wall_s": wall, "cpu_s": cpu1 - cpu0, "disk_read_MiB": (in1 - in0) * 512 / MiB}


def stream_thinblock(scratch: Path, n: int) -> dict[str, dict[str, float]]:
    size = n * BS
    pool_dir = str(scratch / f"stream-{n}")
    Pool.create(pool_dir, size, block_size=BS).close()
    pool = Pool.open(pool_dir)  # autocommit, as a server runs it
    try:
        vol = pool.create_volume("disk", size)
        chunk = os.urandom(MiB)

        def fill() -> None:
            for off in range(0, size, MiB):
                vol.write(off, chunk[: min(MiB, size - off)])
            pool.flush()

        def read() -> None:
            for off in range(0, size, MiB):
                vol.read(off, min(MiB, size - off))

        return {"fill": _measure(fill, size), "read": _measure(read, size)}
    finally:
        pool.close()
        shutil.rmtree(pool_dir, ignore_errors=True)


def stream_plain(scratch: Path, n: int) -> dict[str, dict[str, float]]:
    size = n * BS
    path = scratch / f"stream-{n}.img"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, size)
        chunk = os.urandom(MiB)

        def fill() -> None:
            for off in range(0, size, MiB):
                os.pwrite(fd, chunk[: min(MiB, size - off)], off)
            os.fdatasync(fd)

        def read() -> None:
            for off in range(0, size, MiB):
                os.pread(fd, min(MiB, size - off), off)

        return {"fill": _measure(fill, size), "read": _measure(read, size)}
    finally:
        os.close(fd)
        path.unlink()


def section_stream(scratch: Path, scales: list[int], r: dict[str, Any]) -> None:
    rows = []
    for n in scales:
        runs: dict[str, list[dict[str, dict[str, float]]]] = {"thinblock": [], "plain": []}
        for run in range(2):
            order = [("thinblock", stream_thinblock), ("plain", stream_plain)]
            for name, fn in order if run == 0 else order[::-1]:
                progress(f"stream: {name}, {n} blocks of 4 KiB, run {run + 1}")
                runs[name].append(fn(scratch, n))
        row: dict[str, Any] = {"blocks": n, "runs": runs}
        for name, got in runs.items():
            for phase in ("fill", "read"):
                best = max(got, key=lambda x: x[phase]["GBps"])[phase]
                row[f"{name}_{phase}_GBps"] = best["GBps"]
                row[f"{name}_{phase}_cpu_us_per_block"] = best["cpu_s"] / n * 1e6
                row[f"{name}_{phase}_disk_read_MiB"] = best["disk_read_MiB"]
        for phase in ("fill", "read"):
            row[f"ratio_{phase}"] = row[f"thinblock_{phase}_GBps"] / row[f"plain_{phase}_GBps"]
        rows.append(row)
    keys = [k for k in rows[0] if k.endswith(("_GBps", "_per_block"))]
    r["stream"] = {"rows": rows, **{f"growth_{k}": growth(scales, [x[k] for x in rows]) for k in keys}}


def section_depth(scratch: Path, depths: list[int], r: dict[str, Any], ops: int = 500) -> None:
    """A volume of 4,096 blocks with a chain of d snapshots, one block changed between each:
    median latency of 4 KiB reads at random, and of 4 KiB writes to blocks no snapshot
    since the last one shares (overwrites) and to shared ones (first write, copied)."""
    rows = []
    rng = random.Random(25)
    for d in depths:
        pool_dir = str(scratch / f"depth-{d}")
        Pool.create(pool_dir, 64 * MiB, block_size=BS).close()
        pool = Pool.open(pool_dir, autocommit=False)
        try:
            vol = pool.create_volume("disk", 16 * MiB)
            vol.write(0, os.urandom(16 * MiB))
            progress(f"depth: a chain of {d} snapshots")
            for i in range(d):
                create_snapshot(pool, "disk", f"s{i}")
                vol.write((i % 4096) * BS, b"chain")
            data = os.urandom(BS)
            offsets = [rng.randrange(4096) * BS for _ in range(ops)]
            reads, writes = [], []
            for off in offsets:
                start = time.perf_counter()
                vol.read(off, BS)
                reads.append(time.perf_counter() - start)
            for off in offsets:
                start = time.perf_counter()
                vol.write(off, data)
                writes.append(time.perf_counter() - start)
            pool.commit()
        finally:
            pool.close()
            shutil.rmtree(pool_dir, ignore_errors=True)
        rows.append(
            {"depth": d, "read_us": statistics.median(reads) * 1e6, "write_us": statistics.median(writes) * 1e6}
        )
    r["depth"] = {
        "rows": rows,
        "growth_read": growth(depths, [x["read_us"] for x in rows]),
        "growth_write": growth(depths, [x["write_us"] for x in rows]),
    }


def section_pages(r: dict[str, Any]) -> None:
    script = ROOT / "bench" / "bench_pages.py"
    if not script.exists():
        r["pages"] = {"skipped": "bench/bench_pages.py is not on this branch"}
        return
    progress("pages: bench/bench_pages.py --json")
    done = subprocess.run([sys.executable, str(script), "--json"], env=ENV, capture_output=True, text=True)
    try:
        r["pages"] = json.loads(done.stdout)
    except json.JSONDecodeError:
        r["pages"] = {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}


# ----- report -------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    return str(value)


def _gf(values: list[float | None]) -> str:
    return " ".join("-" if v is None else f"x{v:.1f}" for v in values)


def _table(title: str, rows: list[dict[str, Any]], keys: list[str], growths: dict[str, list[float | None]]) -> None:
    print(title)
    first = next(iter(rows[0]))
    print(f"  {first:>10}" + "".join(f"{k:>28}" for k in keys))
    for row in rows:
        print(f"  {row[first]:>10}" + "".join(f"{_fmt(row.get(k)):>28}" for k in keys))
    print(f"  {'per 10x':>10}" + "".join(f"{_gf(growths.get(k, [])):>28}" for k in keys))


def report(r: dict[str, Any]) -> None:
    if "exports" in r:
        e = r["exports"]
        _table(
            "export listing (unix socket):",
            e["rows"],
            ["opt_list_s", "nbdinfo_list_s", "server_start_s"],
            {"opt_list_s": e["growth_opt_list"], "nbdinfo_list_s": e["growth_nbdinfo"]},
        )
        for row in e["rows"]:
            for key in ("opt_list_error", "nbdinfo_error"):
                if key in row:
                    print(f"  {row['exports']}: {key}: {row[key]}")
    if "listings" in r:
        lst = r["listings"]
        print(
            f"(command-line figures: minus python -c pass, {lst['python_start_s'] * 1e3:.0f} ms;"
            f" thinblock --help takes {lst['thinblock_help_s'] * 1e3:.0f} ms beyond it)"
        )
        for label in ("objects", "snapshots"):
            part = lst[label]
            _table(
                f"listings over {label}:",
                part["rows"],
                ["volume_list_s", "pool_status_s"],
                {"volume_list_s": part["growth_volume_list"], "pool_status_s": part["growth_pool_status"]},
            )
    if "spread" in r:
        sp = r["spread"]
        keys = ["snapshot_create_s", "pool_check_s", "pool_status_s", "pool_dump_s"]
        _table("blocks written one per 512:", sp["rows"], keys, {k: sp[f"growth_{k}"] for k in keys})
    if "dense" in r:
        de = r["dense"]
        keys1 = ["pool_check_s", "qemu_img_check_s", "thin_check_s", "thin_dump_s"]
        keys2 = ["pool_check_with_snapshot_s", "thin_check_with_snapshot_s", "thin_dump_with_snapshot_s"]
        keys3 = ["snapshot_create_cli_s", "snapshot_remove_1pct_s", "server_start_s"]
        keys4 = ["commit_new_block_s", "commit_overwrite_s"]
        g = {k: de.get(f"growth_{k}", []) for k in keys1 + keys2 + keys3 + keys4}
        _table("dense mapped blocks (4 KiB), pool check and peers:", de["rows"], keys1, g)
        _table("  with one snapshot:", de["rows"], keys2, g)
        _table("  snapshot commands (1% changed before remove) and server start:", de["rows"], keys3, g)
        _table("  commit latency (4 KiB write + commit, median):", de["rows"], keys4, g)
        for row in de["rows"]:
            print(
                f"  {row['blocks']}: pool check / thin_check {row['ratio_check_vs_thin_check']:.2f}, / qemu-img check"
                f" {row['ratio_check_vs_qemu_img']:.2f}; with a snapshot / thin_check"
                f" {row['ratio_check_snapshot_vs_thin_check']:.2f}"
            )
    if "stream" in r:
        st = r["stream"]
        print("full sequential 1 MiB fill of the pool and read of the volume (4 KiB blocks) vs a plain sparse file:")
        print(f"  {'blocks':>10} {'phase':>5} {'thinblock':>10} {'plain':>10} {'ratio':>6} {'tb CPU us/blk':>14}"
              f" {'plain CPU us/blk':>17} {'tb disk MiB read':>17}")  # fmt: skip
        for row in st["rows"]:
            for phase in ("fill", "read"):
                print(
                    f"  {row['blocks']:>10} {phase:>5} {row[f'thinblock_{phase}_GBps']:>6.2f} GB/s"
                    f" {row[f'plain_{phase}_GBps']:>5.2f} GB/s {row[f'ratio_{phase}']:>6.2f}"
                    f" {row[f'thinblock_{phase}_cpu_us_per_block']:>14.2f}"
                    f" {row[f'plain_{phase}_cpu_us_per_block']:>17.2f} {row[f'thinblock_{phase}_disk_read_MiB']:>17.0f}"
                )
        for phase in ("fill", "read"):
            print(
                f"  per 10x, {phase}: thinblock GB/s {_gf(st[f'growth_thinblock_{phase}_GBps'])},"
                f" plain GB/s {_gf(st[f'growth_plain_{phase}_GBps'])},"
                f" thinblock CPU per block {_gf(st[f'growth_thinblock_{phase}_cpu_us_per_block'])}"
            )
    if "depth" in r:
        dp = r["depth"]
        print("4 KiB latency against snapshot-chain depth (median):")
        for row in dp["rows"]:
            print(f"  depth {row['depth']:>5}: read {row['read_us']:8.1f} us, write {row['write_us']:8.1f} us")
        print(f"  per 10x: read {_gf(dp['growth_read'])}, write {_gf(dp['growth_write'])}")
    if "pages" in r:
        print("metadata bytes per mapped block (bench/bench_pages.py):")
        print("  " + json.dumps(r["pages"])[:2000])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /var/tmp)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"sections to run ({', '.join(SECTIONS)})")
    parser.add_argument("--exports", type=counts, default=counts("1K,10K,100K"), help="exports per pool (1K,10K,100K)")
    parser.add_argument("--objects", type=counts, default=counts("100,1K,10K"), help="objects for listings")
    parser.add_argument("--snapshots", type=counts, default=counts("10,100,1K"), help="snapshots of one volume")
    parser.add_argument("--spread", type=counts, default=counts("1K,10K,100K"), help="blocks one per 512")
    parser.add_argument("--dense", type=counts, default=counts("10K,100K,1M"), help="dense mapped blocks")
    parser.add_argument("--stream", type=counts, default=counts("10K,100K,1M"), help="blocks read and filled")
    parser.add_argument("--depths", type=counts, default=counts("10,100,1K"), help="snapshot-chain depths")
    parser.add_argument("--timeout", type=float, default=35, help="seconds a listing client waits (default 35)")
    parser.add_argument("--quick", action="store_true", help="small scales (a smoke run of every section)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    if args.quick:
        args.exports = args.objects = args.spread = [10, 100, 1000]
        args.snapshots = args.depths = [2, 5, 10]
        args.dense = args.stream = [1000, 3000, 10000]
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}: use {', '.join(SECTIONS)}")
    scratch = Path(tempfile.mkdtemp(prefix="tb-bench-scale-", dir=args.dir or "/var/tmp"))
    results: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        if "exports" in only:
            section_exports(scratch, args.exports, args.timeout, results)
        if "listings" in only:
            section_listings(scratch, args.objects, args.snapshots, results)
        if "spread" in only:
            section_spread(scratch, args.spread, results)
        if "dense" in only:
            section_dense(scratch, args.dense, results)
        if "stream" in only:
            section_stream(scratch, args.stream, results)
        if "depth" in only:
            section_depth(scratch, args.depths, results)
        if "pages" in only:
            section_pages(results)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["elapsed_s"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        report(results)
        print(f"(whole run: {results['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
