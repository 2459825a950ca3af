"""Import, export-diff and sparsify benchmark, each beside a peer in the same run.

    .venv/bin/python bench/bench_transfer.py [--dir DIR] [--runs 2] [--json]

1. Import of a 16 GiB sparse raw file holding 1 GiB of data scattered in 1 MiB
   pieces, into a running `thinblock serve` whose pool is 1 GiB (exactly the
   data): `thinblock import` vs `qemu-img convert -n -W` into a volume of the same
   server over NBD, after one untimed round of each. Ratio = qemu-img's time /
   ours (above 1: we are faster).
2. export-diff between two snapshots of that 16 GiB volume that differ in 1% of it
   (164 MiB in 1 MiB pieces), to stdout (/dev/null), vs reading just those bytes
   (pread of the changed ranges from a raw copy of the volume), and vs
   `thinblock export` of the whole snapshot (as a sparse rbd stream, to /dev/null).
   The page cache is dropped before each, so each reads from the disk; the
   command's start (about 0.25 s of Python) is in its time. export-diff to a
   file, synced, is shown too.
3. Sparsify of a 4 GiB volume of which half the 64 KiB blocks hold zeros written
   as data: time and space freed. Peer: `fallocate --dig-holes` on a raw file of
   the same bytes (what one does to a sparse image file).

Each comparison runs --runs times, the order of the peers alternating; all runs
are reported (the machine is noisy).
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

GiB = 1 << 30
MiB = 1 << 20
BS = 64 << 10
ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


def tb(*args: str, stdout: Any = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "thinblock", *args], stdout=stdout, stderr=subprocess.PIPE, text=True, env=ENV
    )
    if proc.returncode:
        raise SystemExit(f"thinblock {' '.join(args)} failed: {proc.stderr}")
    return proc


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def sparse_image(path: Path, size: int, data: int, seed: int) -> list[int]:
    """A sparse raw file holding `data` bytes in 1 MiB pieces at random 1 MiB offsets."""
    rng = random.Random(seed)
    offsets = sorted(rng.sample(range(size // MiB), data // MiB))
    with open(path, "wb") as f:
        f.truncate(size)
        for off in offsets:
            f.seek(off * MiB)
            f.write(rng.randbytes(MiB))
    return offsets


class Served:
    def __init__(self, pool: str, work: Path) -> None:
        self.socket = str(work / "nbd.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "serve", pool, "--socket", self.socket],
            stdout=subprocess.PIPE,
            stderr=open(work / "serve.log", "w"),  # noqa: SIM115
            text=True,
            env=ENV,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("ready"):
                break

    def uri(self, name: str) -> str:
        return f"nbd+unix:///{name}?socket={self.socket}"

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def bench_import(work: Path, runs: int) -> dict[str, Any]:
    src = work / "src.raw"
    progress("writing the 16 GiB sparse source with 1 GiB of data")
    sparse_image(src, 16 * GiB, GiB, 1)
    pool = str(work / "pool-import")
    tb("pool", "create", pool, "--size", "1G")
    server = Served(pool, work)
    results = []
    try:
        # One untimed round of each first: the fresh pool's data file gets its first
        # blocks from the filesystem, and the source's pages come into the cache.
        tb("import", str(src), pool, "a", "--no-progress")
        tb("volume", "remove", pool, "a")
        tb("volume", "create", pool, "b", "--size", "16G")
        subprocess.run(
            ["qemu-img", "convert", "-n", "-W", "-f", "raw", "-O", "raw", str(src), server.uri("b")], check=True
        )
        tb("volume", "remove", pool, "b")
        for run in range(runs):
            order = ["thinblock", "qemu-img"] if run % 2 == 0 else ["qemu-img", "thinblock"]
            times: dict[str, float] = {}
            for who in order:
                if who == "thinblock":
                    times[who] = timed(lambda: tb("import", str(src), pool, "a", "--no-progress"))
                    tb("volume", "remove", pool, "a")
                else:
                    tb("volume", "create", pool, "b", "--size", "16G")
                    times[who] = timed(
                        lambda: subprocess.run(
                            ["qemu-img", "convert", "-n", "-W", "-f", "raw", "-O", "raw", str(src), server.uri("b")],
                            check=True,
                        )
                    )
                    tb("volume", "remove", pool, "b")
                progress(f"import run {run + 1}: {who} {times[who]:.2f} s")
            results.append(
                {
                    "order": order,
                    "thinblock_s": round(times["thinblock"], 3),
                    "qemu_img_convert_s": round(times["qemu-img"], 3),
                    "ratio_qemu_over_thinblock": round(times["qemu-img"] / times["thinblock"], 2),
                }
            )
    finally:
        server.stop()
    shutil.rmtree(pool)
    return {"source": "16 GiB sparse raw, 1 GiB of data in 1 MiB pieces", "pool_bytes": GiB, "runs": results}


def bench_export_diff(work: Path, runs: int) -> dict[str, Any]:
    src = work / "src.raw"
    pool = str(work / "pool-diff")
    tb("pool", "create", pool, "--size", "3G")
    tb("import", str(src), pool, "v", "--no-progress")
    tb("snapshot", "create", pool, "v@s1")
    rng = random.Random(2)
    changed = sorted(rng.sample(range(16 * GiB // MiB), 164))  # 1% of 16 GiB
    import nbd

    server = Served(pool, work)
    try:
        h = nbd.NBD()
        h.connect_uri(server.uri("v"))
        with open(src, "r+b") as raw:
            for off in changed:
                piece = rng.randbytes(MiB)
                h.pwrite(piece, off * MiB)
                raw.seek(off * MiB)
                raw.write(piece)
        h.flush()
        h.shutdown()
    finally:
        server.stop()
    tb("snapshot", "create", pool, "v@s2")
    ranges = [
        (r["offset"], r["length"]) for r in json.loads(tb("delta", pool, "v@s1", "v@s2", "--json").stdout)["ranges"]
    ]
    changed_bytes = sum(n for _, n in ranges)

    def read_changed() -> None:
        fd = os.open(src, os.O_RDONLY)
        try:
            for off, n in ranges:
                os.pread(fd, n, off)
        finally:
            os.close(fd)

    def to_devnull(*args: str) -> None:
        with open(os.devnull, "w") as null:
            tb(*args, stdout=null)

    out = work / "s1-s2.diff"
    results = []
    for run in range(runs):
        order = ["export-diff", "read", "export"] if run % 2 == 0 else ["export", "read", "export-diff"]
        times: dict[str, float] = {}
        for who in order:
            drop_caches()  # every contender reads from the disk, not from memory
            if who == "export-diff":
                times[who] = timed(lambda: to_devnull("export-diff", pool, "--from-snap", "s1", "v@s2", "-"))
            elif who == "read":
                times[who] = timed(read_changed)
            else:
                times[who] = timed(lambda: to_devnull("export", pool, "v@s2", "-", "--format", "rbd"))
            progress(f"export-diff run {run + 1}: {who} {times[who]:.2f} s")
        drop_caches()
        times["export-diff to a file"] = timed(
            lambda: tb("export-diff", pool, "--from-snap", "s1", "v@s2", str(out), "--force", "--no-progress")
        )
        results.append(
            {
                "order": order,
                "export_diff_s": round(times["export-diff"], 3),
                "read_changed_bytes_s": round(times["read"], 3),
                "full_export_s": round(times["export"], 3),
                "export_diff_to_a_synced_file_s": round(times["export-diff to a file"], 3),
                "ratio_diff_over_read": round(times["export-diff"] / times["read"], 2),
                "ratio_full_over_diff": round(times["export"] / times["export-diff"], 2),
            }
        )
    size = out.stat().st_size
    shutil.rmtree(pool)
    return {"changed_bytes": changed_bytes, "diff_bytes": size, "runs": results}


def bench_sparsify(work: Path, runs: int) -> dict[str, Any]:
    raw = work / "half-zero.raw"
    progress("writing a 4 GiB file, every other 64 KiB block zero")
    with open(raw, "wb") as f:
        block = os.urandom(BS)
        zero = bytes(BS)
        chunk = b"".join(block if i % 2 else zero for i in range(256))
        for _ in range(4 * GiB // len(chunk)):
            f.write(chunk)
    results = []
    for run in range(runs):
        order = ["thinblock", "fallocate"] if run % 2 == 0 else ["fallocate", "thinblock"]
        out: dict[str, Any] = {"order": order}
        for who in order:
            if who == "thinblock":
                pool = str(work / "pool-sparsify")
                tb("pool", "create", pool, "--size", "5G")
                tb("volume", "create", pool, "v", "--size", "4G", "--detect-zeroes", "off")
                server = Served(pool, work)
                try:
                    subprocess.run(
                        ["qemu-img", "convert", "-n", "-S", "0", "-f", "raw", "-O", "raw", str(raw), server.uri("v")],
                        check=True,
                    )
                finally:
                    server.stop()
                start = time.perf_counter()
                result = json.loads(tb("volume", "sparsify", pool, "v", "--json", "--no-progress").stdout)
                out["thinblock_s"] = round(time.perf_counter() - start, 3)
                out["thinblock_freed_bytes"] = result["freed_bytes"]
                shutil.rmtree(pool)
            else:
                copy = work / "copy.raw"
                shutil.copyfile(raw, copy)
                before = copy.stat().st_blocks * 512
                start = time.perf_counter()
                subprocess.run(["fallocate", "--dig-holes", str(copy)], check=True)
                out["fallocate_dig_holes_s"] = round(time.perf_counter() - start, 3)
                out["fallocate_freed_bytes"] = before - copy.stat().st_blocks * 512
                copy.unlink()
            progress(f"sparsify run {run + 1}: {who} done")
        out["ratio_fallocate_over_thinblock"] = round(out["fallocate_dig_holes_s"] / out["thinblock_s"], 2)
        results.append(out)
    raw.unlink()
    return {"volume_bytes": 4 * GiB, "zero_bytes": 2 * GiB, "runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", help="scratch directory (default: a new one in /var/tmp)")
    parser.add_argument("--runs", type=int, default=2, help="runs of each comparison, peers alternating")
    parser.add_argument("--only", choices=("import", "export-diff", "sparsify"), help="one part only")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args()
    work = Path(args.dir or tempfile.mkdtemp(prefix="tb-bench-transfer-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    try:
        if args.only in (None, "import", "export-diff"):
            report["import"] = bench_import(work, args.runs) if args.only in (None, "import") else None
        if args.only in (None, "export-diff"):
            if not (work / "src.raw").exists():
                sparse_image(work / "src.raw", 16 * GiB, GiB, 1)
            report["export_diff"] = bench_export_diff(work, args.runs)
        if args.only in (None, "sparsify"):
            report["sparsify"] = bench_sparsify(work, args.runs)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for part, figures in report.items():
        if figures is None:
            continue
        print(f"{part}:")
        for key, value in figures.items():
            if key != "runs":
                print(f"  {key}: {value}")
        for i, run in enumerate(figures["runs"], 1):
            print(f"  run {i}: " + ", ".join(f"{k} {v}" for k, v in run.items()))


if __name__ == "__main__":
    main()
