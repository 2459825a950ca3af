"""Core engine benchmark: thinblock's Python API vs a plain sparse file, same run.

    .venv/bin/python bench/bench_core.py [--dir DIR] [--json]

Figures are ratios against the peer measured in the same run (never absolute
pass/fail). Page caches are dropped before read phases when running as root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from thinblock import Pool
from thinblock.meta.sqlite import DB_NAME
from thinblock.store.file import fallocate

GiB = 1 << 30
MiB = 1 << 20
VOLUME_BYTES = 16 * GiB


def drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /var/tmp)")
    parser.add_argument("--seq-bytes", type=int, default=2 * GiB, help="bytes for the sequential phases")
    parser.add_argument("--random-writes", type=int, default=20000, help="4 KiB random writes")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="tb-bench-", dir=args.dir or "/var/tmp"))
    results: dict[str, Any] = {"volume_bytes": VOLUME_BYTES}
    try:
        run(scratch, args, results)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        report(results)


def run(scratch: Path, args: argparse.Namespace, r: dict[str, Any]) -> None:
    seq = args.seq_bytes
    chunk = os.urandom(MiB)
    plain_path = scratch / "plain.img"
    with open(plain_path, "wb") as f:
        f.truncate(VOLUME_BYTES)
    fd = os.open(plain_path, os.O_RDWR)
    pool = Pool.create(str(scratch / "pool"), VOLUME_BYTES + 2 * GiB)
    vol = pool.create_volume("bench", VOLUME_BYTES)

    progress("sequential 1 MiB writes")

    def plain_seq_write() -> None:
        for off in range(0, seq, MiB):
            os.pwrite(fd, chunk, off)
        os.fsync(fd)

    def tb_seq_write() -> None:
        for off in range(0, seq, MiB):
            vol.write(off, chunk)
        pool.flush()

    r["seq_write_plain_MiBps"] = seq / MiB / timed(plain_seq_write)
    r["seq_write_thinblock_MiBps"] = seq / MiB / timed(tb_seq_write)

    progress("sequential 1 MiB reads")
    drop_caches()
    r["seq_read_plain_MiBps"] = seq / MiB / timed(lambda: [os.pread(fd, MiB, off) for off in range(0, seq, MiB)])
    drop_caches()
    r["seq_read_thinblock_MiBps"] = seq / MiB / timed(lambda: [vol.read(off, MiB) for off in range(0, seq, MiB)])

    progress("4 KiB random writes")
    rng = random.Random(1)
    offsets = [rng.randrange(VOLUME_BYTES // 4096) * 4096 for _ in range(args.random_writes)]
    small = os.urandom(4096)

    def plain_rand() -> None:
        for off in offsets:
            os.pwrite(fd, small, off)
        os.fsync(fd)

    def tb_rand() -> None:
        for off in offsets:
            vol.write(off, small)
        pool.flush()

    r["randwrite_plain_fresh_iops"] = len(offsets) / timed(plain_rand)
    r["randwrite_plain_overwrite_iops"] = len(offsets) / timed(plain_rand)
    r["randwrite_thinblock_fresh_iops"] = len(offsets) / timed(tb_rand)
    r["randwrite_thinblock_overwrite_iops"] = len(offsets) / timed(tb_rand)

    progress("1 GiB of zeros vs 1 GiB of data to unmapped space")
    zvol = pool.create_volume("zeros", 4 * GiB)
    zeros = bytes(MiB)
    used_before = pool.status()["used_bytes"]

    def tb_zero_write() -> None:
        for off in range(0, GiB, MiB):
            zvol.write(off, zeros)
        pool.flush()

    def tb_data_write() -> None:
        for off in range(GiB, 2 * GiB, MiB):
            zvol.write(off, chunk)
        pool.flush()

    r["zero_write_1GiB_s"] = timed(tb_zero_write)
    r["zero_write_1GiB_blocks_used"] = (pool.status()["used_bytes"] - used_before) // pool.block_size
    r["data_write_1GiB_s"] = timed(tb_data_write)
    pool.remove_volume("zeros")

    progress("provisioning 8 GiB vs writing 8 GiB of zeros / fallocate on a plain file")
    pvol = pool.create_volume("prov", 8 * GiB)

    def tb_provision() -> None:
        pvol.provision(0, 8 * GiB)
        pool.flush()

    r["provision_8GiB_s"] = timed(tb_provision)
    pool.remove_volume("prov")
    zpath = scratch / "zeros.img"
    zfd = os.open(zpath, os.O_RDWR | os.O_CREAT, 0o644)

    def plain_zero_fill() -> None:
        for off in range(0, 8 * GiB, MiB):
            os.pwrite(zfd, zeros, off)
        os.fsync(zfd)

    r["plain_zero_fill_8GiB_s"] = timed(plain_zero_fill)
    os.close(zfd)
    zpath.unlink()
    zfd = os.open(zpath, os.O_RDWR | os.O_CREAT, 0o644)

    def plain_fallocate() -> None:
        fallocate(zfd, 0, 0, 8 * GiB)
        os.fsync(zfd)

    r["plain_fallocate_8GiB_s"] = timed(plain_fallocate)
    os.close(zfd)

    mapped = pool.volume_info(pool.volume("bench"))["mapped_bytes"]
    pool.close()  # the last connection checkpoints the WAL into the database file
    db_bytes = sum(
        os.path.getsize(os.path.join(pool.path, n))
        for n in os.listdir(pool.path)
        if n.startswith(DB_NAME) and not n.endswith("-shm")
    )
    r["metadata_bytes_per_mapped_GiB"] = db_bytes / (mapped / GiB)
    os.close(fd)

    r["ratio_seq_write"] = r["seq_write_thinblock_MiBps"] / r["seq_write_plain_MiBps"]
    r["ratio_seq_read"] = r["seq_read_thinblock_MiBps"] / r["seq_read_plain_MiBps"]
    r["ratio_randwrite_fresh"] = r["randwrite_thinblock_fresh_iops"] / r["randwrite_plain_fresh_iops"]
    r["ratio_randwrite_overwrite"] = r["randwrite_thinblock_overwrite_iops"] / r["randwrite_plain_overwrite_iops"]
    r["zero_vs_data_speedup"] = r["data_write_1GiB_s"] / r["zero_write_1GiB_s"]
    r["provision_vs_zero_fill_speedup"] = r["plain_zero_fill_8GiB_s"] / r["provision_8GiB_s"]


def report(r: dict[str, Any]) -> None:
    rows = [
        (
            "seq 1 MiB write",
            f"{r['seq_write_thinblock_MiBps']:.0f} MiB/s",
            f"{r['seq_write_plain_MiBps']:.0f} MiB/s",
            f"{r['ratio_seq_write']:.2f}",
        ),
        (
            "seq 1 MiB read",
            f"{r['seq_read_thinblock_MiBps']:.0f} MiB/s",
            f"{r['seq_read_plain_MiBps']:.0f} MiB/s",
            f"{r['ratio_seq_read']:.2f}",
        ),
        (
            "4K random write, fresh",
            f"{r['randwrite_thinblock_fresh_iops']:.0f} IOPS",
            f"{r['randwrite_plain_fresh_iops']:.0f} IOPS",
            f"{r['ratio_randwrite_fresh']:.2f}",
        ),
        (
            "4K random write, overwrite",
            f"{r['randwrite_thinblock_overwrite_iops']:.0f} IOPS",
            f"{r['randwrite_plain_overwrite_iops']:.0f} IOPS",
            f"{r['ratio_randwrite_overwrite']:.2f}",
        ),
    ]
    print(f"{'workload':28} {'thinblock':>14} {'plain file':>14} {'ratio':>6}")
    for row in rows:
        print(f"{row[0]:28} {row[1]:>14} {row[2]:>14} {row[3]:>6}")
    print(
        f"1 GiB zeros to unmapped space: {r['zero_write_1GiB_s']:.3f} s, {r['zero_write_1GiB_blocks_used']} blocks used; "
        f"1 GiB data: {r['data_write_1GiB_s']:.3f} s ({r['zero_vs_data_speedup']:.0f}x)"
    )
    print(
        f"provision 8 GiB: {r['provision_8GiB_s']:.3f} s; plain file: zero-fill {r['plain_zero_fill_8GiB_s']:.2f} s "
        f"({r['provision_vs_zero_fill_speedup']:.0f}x), fallocate {r['plain_fallocate_8GiB_s']:.3f} s"
    )
    print(f"metadata per mapped GiB: {r['metadata_bytes_per_mapped_GiB'] / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
