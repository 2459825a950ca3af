"""Kernel block device benchmark: thinblock attach vs a loop device on a plain sparse file.

    .venv/bin/python bench/bench_attach.py [--json] [--io-only] [--runtime SECONDS]

mke2fs on 10 GiB and 200 GiB with and without -E assume_storage_prezeroed=1
(time and space), sequential 1 MiB direct-I/O write and read through the loop
device, 4 KiB random direct-I/O write and read with fio (one job, and four
jobs, iodepth 16 each) over the GiB just written, and 1 GiB of zeros written
with dd oflag=direct to a fresh device.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
MiB = 1 << 20
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def tb(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "thinblock", *args], check=True, capture_output=True, text=True, env=ENV
    ).stdout


def progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


@contextmanager
def sparse_device(scratch: Path, size: int) -> Iterator[tuple[str, Callable[[], int]]]:
    img = scratch / "sparse.img"
    with open(img, "wb") as f:
        f.truncate(size)
    dev = subprocess.run(
        ["losetup", "--find", "--show", "--direct-io=on", str(img)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        yield dev, lambda: os.stat(img).st_blocks * 512
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)
        img.unlink()


@contextmanager
def thin_device(scratch: Path, size: int) -> Iterator[tuple[str, Callable[[], int]]]:
    pool = scratch / "pool"
    tb("pool", "create", str(pool), "--size", "16G")
    tb("volume", "create", str(pool), "v", "--size", str(size))
    dev = tb("attach", str(pool), "v").strip()
    mnt = next(Path(os.environ.get("THINBLOCK_RUNTIME_DIR", "/run/thinblock")).glob("*/mnt/v"))

    def used() -> int:
        fd = os.open(mnt, os.O_RDONLY)
        os.fsync(fd)  # the daemon commits: status is current
        os.close(fd)
        return int(json.loads(tb("pool", "status", str(pool), "--json"))["used_bytes"])

    try:
        yield dev, used
    finally:
        tb("detach", dev)
        shutil.rmtree(pool)


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - start


def dd_rate(cmd: list[str], nbytes: int) -> float:
    return nbytes / MiB / timed(cmd)


def fio_iops(dev: str, rw: str, jobs: int, runtime: int) -> float:
    """4 KiB random direct I/O (libaio, iodepth 16 per job) over the device's first GiB."""
    cmd = [
        "fio", "--name=bench", f"--filename={dev}", "--ioengine=libaio", "--direct=1", f"--rw={rw}",
        "--bs=4k", "--iodepth=16", "--size=1G", f"--numjobs={jobs}", "--group_reporting",
        f"--runtime={runtime}", "--time_based", "--output-format=json",
    ]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return float(job["write" if "write" in rw else "read"]["iops"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--io-only", action="store_true", help="skip the mke2fs runs")
    parser.add_argument("--runtime", type=int, default=10, help="seconds per fio run")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="tb-attach-bench-", dir=args.dir))
    r: dict[str, Any] = {}
    try:
        for size_name, size in () if args.io_only else (("10G", 10 * GiB), ("200G", 200 * GiB)):
            for hint in (False, True):
                for peer, device in (("sparse", sparse_device), ("thinblock", thin_device)):
                    progress(f"mke2fs {size_name} on {peer}{' with the hint' if hint else ''}")
                    with device(scratch, size) as (dev, used):
                        base = used()
                        cmd = [
                            "mke2fs",
                            "-q",
                            "-t",
                            "ext4",
                            "-F",
                            *(["-E", "assume_storage_prezeroed=1"] if hint else []),
                            dev,
                        ]
                        key = f"mke2fs_{size_name}_{'hint' if hint else 'plain'}_{peer}"
                        r[key + "_s"] = timed(cmd)
                        r[key + "_bytes"] = used() - base
        source = scratch / "random.bin"  # the same incompressible, non-zero data for both
        with open(source, "wb") as f:
            for _ in range(1024):
                f.write(os.urandom(MiB))
        for peer, device in (("sparse", sparse_device), ("thinblock", thin_device)):
            progress(f"direct I/O through {peer}")
            with device(scratch, 16 * GiB) as (dev, used):
                write = ["dd", f"if={source}", f"of={dev}", "bs=1M", "count=1024", "oflag=direct", "status=none"]
                r[f"seq_write_{peer}_MiBps"] = dd_rate(write, GiB)
                r[f"seq_read_{peer}_MiBps"] = dd_rate(
                    ["dd", f"if={dev}", "of=/dev/null", "bs=1M", "count=1024", "iflag=direct", "status=none"], GiB
                )
                for rw in ("randwrite", "randread"):
                    for jobs in (1, 4):
                        progress(f"fio {rw} 4k, {jobs} job(s), on {peer}")
                        r[f"{rw}_4k_{jobs}job_{peer}_iops"] = fio_iops(dev, rw, jobs, args.runtime)
                base = used()
                r[f"zero_write_1GiB_{peer}_s"] = timed(
                    [
                        "dd",
                        "if=/dev/zero",
                        f"of={dev}",
                        "bs=1M",
                        "count=1024",
                        "seek=2048",
                        "oflag=direct",
                        "status=none",
                    ]
                )
                r[f"zero_write_1GiB_{peer}_bytes"] = used() - base
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    r["ratio_seq_write"] = r["seq_write_thinblock_MiBps"] / r["seq_write_sparse_MiBps"]
    r["ratio_seq_read"] = r["seq_read_thinblock_MiBps"] / r["seq_read_sparse_MiBps"]
    for rw in ("randwrite", "randread"):
        for jobs in (1, 4):
            key = f"{rw}_4k_{jobs}job"
            r[f"ratio_{key}"] = r[f"{key}_thinblock_iops"] / r[f"{key}_sparse_iops"]
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        for key, value in r.items():
            print(f"{key:45} {value:16.3f}")


if __name__ == "__main__":
    main()
