"""Snapshot benchmark: creation cost, copy-on-write cost, delta cost, each beside a peer.

    .venv/bin/python bench/bench_snapshots.py [--dir DIR] [--json]

1. Snapshot creation of a 16 GiB volume with 65,536 and with 262,144 mapped
   blocks (64 KiB blocks, each holding data), and with 512 mapped blocks spread
   one per mapping page (as many pages as 262,144 dense blocks): the cost follows
   pages, not blocks. Peer: `qemu-img snapshot -c` on a qcow2 image with the
   same number of 64 KiB clusters mapped (an internal qcow2 snapshot raises the
   refcount of every cluster; its process start is included, and shown apart).
2. 4 KiB random writes on a fully written 2 GiB volume right after a snapshot
   (each first touch copies its 64 KiB block) vs the same writes without one.
3. `thinblock delta` between two snapshots of the 16 GiB volume that differ in
   1% of its blocks, library call and command line. Peer: finding the same
   ranges by comparing two sparse 16 GiB files of the same layout, byte by byte.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from thinblock import Pool
from thinblock.core.delta import changed_ranges
from thinblock.core.snapshot import create_snapshot

GiB = 1 << 30
MiB = 1 << 20
BS = 64 << 10
VOLUME_BYTES = 16 * GiB
ROOT = Path(__file__).resolve().parent.parent


def progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


def timed_snapshot(pool: Pool, volume: str, name: str) -> float:
    start = time.perf_counter()
    create_snapshot(pool, volume, name)
    return time.perf_counter() - start


def map_blocks(pool: Pool, name: str, vblocks: range | list[int]) -> None:
    """Give each vblock a data block holding 512 bytes of data (the rest reads zero)."""
    vol = pool.volume(name)
    payload = os.urandom(512)
    for i, vblock in enumerate(vblocks):
        vol.write(vblock * BS, payload)
        if i % 65536 == 65535:
            progress(f"{name}: {i + 1} blocks mapped")
    pool.commit()


def qemu_snapshot(scratch: Path, clusters: int) -> tuple[float, float]:
    """(seconds for `qemu-img snapshot -c`, seconds for `qemu-img snapshot -l`: process start)."""
    img = scratch / f"peer-{clusters}.qcow2"
    subprocess.run(
        [
            "qemu-img",
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            "cluster_size=64k,preallocation=metadata",
            str(img),
            str(clusters * BS),
        ],
        check=True,
    )
    start = time.perf_counter()
    subprocess.run(["qemu-img", "snapshot", "-c", "s1", str(img)], check=True)
    create = time.perf_counter() - start
    start = time.perf_counter()
    subprocess.run(["qemu-img", "snapshot", "-l", str(img)], check=True, capture_output=True)
    baseline = time.perf_counter() - start
    img.unlink()
    return create, baseline


def run(scratch: Path, args: argparse.Namespace, r: dict[str, Any]) -> None:
    path = str(scratch / "pool")
    pool = Pool.create(path, 48 * GiB)  # sparse: only what is written takes disk space
    try:
        # 1. creation cost
        for count in (65536, 262144):
            name = f"dense{count}"
            pool.create_volume(name, VOLUME_BYTES)
            progress(f"mapping {count} blocks")
            map_blocks(pool, name, range(count))
            r[f"snapshot_{count}_blocks_ms"] = min(timed_snapshot(pool, name, f"{name}-s{i}") for i in range(3)) * 1e3
            peer, baseline = qemu_snapshot(scratch, count)
            r[f"qemu_img_snapshot_{count}_clusters_ms"] = peer * 1e3
            r[f"qemu_img_start_ms_{count}"] = baseline * 1e3
        pool.create_volume("spread", VOLUME_BYTES)
        map_blocks(pool, "spread", range(0, 262144, 512))  # one block in each of 512 pages
        r["snapshot_512_pages_512_blocks_ms"] = (
            min(timed_snapshot(pool, "spread", f"spread-s{i}") for i in range(3)) * 1e3
        )
        r["snapshot_512_pages_262144_blocks_ms"] = r["snapshot_262144_blocks_ms"]
        r["ratio_snapshot_262144_vs_65536"] = r["snapshot_262144_blocks_ms"] / r["snapshot_65536_blocks_ms"]
        r["ratio_snapshot_dense_vs_spread_same_pages"] = (
            r["snapshot_262144_blocks_ms"] / r["snapshot_512_pages_512_blocks_ms"]
        )
        r["ratio_vs_qemu_img_262144"] = r["snapshot_262144_blocks_ms"] / r["qemu_img_snapshot_262144_clusters_ms"]

        # 2. copy-on-write cost
        rng = random.Random(1)
        offsets = [rng.randrange(2 * GiB // 4096) * 4096 for _ in range(args.random_writes)]
        buf = os.urandom(4096)
        iops = {}
        for label, snap in (("plain", False), ("after_snapshot", True)):
            name = f"cow-{label}"
            vol = pool.create_volume(name, 2 * GiB)
            progress(f"{name}: writing 2 GiB")
            chunk = os.urandom(MiB)
            for off in range(0, 2 * GiB, MiB):
                vol.write(off, chunk)
            pool.commit()
            if snap:
                create_snapshot(pool, name, f"{name}-snap")
            start = time.perf_counter()
            for off in offsets:
                vol.write(off, buf)
            pool.commit()
            iops[label] = len(offsets) / (time.perf_counter() - start)
        r["randwrite_4k_iops_plain"] = iops["plain"]
        r["randwrite_4k_iops_after_snapshot"] = iops["after_snapshot"]
        r["ratio_cow_randwrite"] = iops["after_snapshot"] / iops["plain"]

        # 3. delta between two snapshots 1% apart
        n_blocks = VOLUME_BYTES // BS
        changed = sorted(rng.sample(range(n_blocks), n_blocks // 100))
        vol = pool.volume("dense262144")
        create_snapshot(pool, "dense262144", "d1")
        for vblock in changed:
            vol.write(vblock * BS + 1024, b"changed")
        create_snapshot(pool, "dense262144", "d2")
        start = time.perf_counter()
        ranges = changed_ranges(pool.volume("d1"), pool.volume("d2"))
        r["delta_library_ms"] = (time.perf_counter() - start) * 1e3
        assert sum(n for _, n in ranges) == len(changed) * BS
        r["delta_changed_blocks"] = len(changed)
    finally:
        pool.close()
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "thinblock", "delta", path, "d1", "d2", "--json"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    ).stdout
    r["delta_cli_ms"] = (time.perf_counter() - start) * 1e3
    assert len(json.loads(out)["ranges"]) <= len(changed)
    r["delta_peer_compare_ms"] = compare_peer(scratch, changed) * 1e3
    r["ratio_delta_cli_vs_compare"] = r["delta_cli_ms"] / r["delta_peer_compare_ms"]


def compare_peer(scratch: Path, changed: list[int]) -> float:
    """Two sparse 16 GiB files with 512 bytes in every block, 1% of blocks differing:
    the time to find the differing blocks by reading and comparing both."""
    payload = os.urandom(512)
    paths = [scratch / "a.img", scratch / "b.img"]
    for p in paths:
        with open(p, "wb") as f:
            f.truncate(VOLUME_BYTES)
    fds = [os.open(p, os.O_RDWR) for p in paths]
    try:
        for vblock in range(VOLUME_BYTES // BS):
            for fd in fds:
                os.pwrite(fd, payload, vblock * BS)
        for vblock in changed:
            os.pwrite(fds[1], b"changed", vblock * BS + 1024)
        os.sync()
        progress("peer: comparing two 16 GiB files")
        start = time.perf_counter()
        found: list[int] = []
        step = 4 * MiB
        for off in range(0, VOLUME_BYTES, step):
            a, b = os.pread(fds[0], step, off), os.pread(fds[1], step, off)
            if a != b:
                found.extend(
                    off // BS + i for i in range(step // BS) if a[i * BS : (i + 1) * BS] != b[i * BS : (i + 1) * BS]
                )
        elapsed = time.perf_counter() - start
        assert found == changed
        return elapsed
    finally:
        for fd in fds:
            os.close(fd)
        for p in paths:
            p.unlink()


def report(r: dict[str, Any]) -> None:
    print("snapshot creation (16 GiB volume, 64 KiB blocks):")
    for count in (65536, 262144):
        print(
            f"  {count:>7} mapped blocks: {r[f'snapshot_{count}_blocks_ms']:7.1f} ms"
            f"   qemu-img snapshot -c, {count} clusters: {r[f'qemu_img_snapshot_{count}_clusters_ms']:7.1f} ms"
            f" (of which process start ~{r[f'qemu_img_start_ms_{count}']:.0f} ms)"
        )
    print(
        f"  512 pages holding 512 blocks: {r['snapshot_512_pages_512_blocks_ms']:.1f} ms; holding 262,144 blocks:"
        f" {r['snapshot_512_pages_262144_blocks_ms']:.1f} ms (ratio {r['ratio_snapshot_dense_vs_spread_same_pages']:.2f})"
    )
    print(
        f"  262,144 vs 65,536 blocks: {r['ratio_snapshot_262144_vs_65536']:.2f}x (4x the pages);"
        f" vs qemu-img: {r['ratio_vs_qemu_img_262144']:.2f}"
    )
    print(
        f"4 KiB random writes: {r['randwrite_4k_iops_plain']:.0f} IOPS without a snapshot,"
        f" {r['randwrite_4k_iops_after_snapshot']:.0f} right after one (ratio {r['ratio_cow_randwrite']:.2f})"
    )
    print(
        f"delta, 16 GiB, {r['delta_changed_blocks']} of 262,144 blocks changed: library {r['delta_library_ms']:.1f} ms,"
        f" command line {r['delta_cli_ms']:.0f} ms; comparing two sparse files: {r['delta_peer_compare_ms']:.0f} ms"
        f" (ratio {r['ratio_delta_cli_vs_compare']:.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /var/tmp)")
    parser.add_argument("--random-writes", type=int, default=20000, help="4 KiB random writes per phase")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="tb-bench-snap-", dir=args.dir or "/var/tmp"))
    results: dict[str, Any] = {}
    try:
        run(scratch, args, results)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(results, indent=2) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        report(results)


if __name__ == "__main__":
    main()
