"""Snapshot create and remove against mapped blocks spread one per mapping page.

    .venv/bin/python bench/bench_snapshot_scale.py [--scales 10000,100000] [--src DIR] [--dir DIR] [--json]

For each scale N: a pool with one 64 KiB block written per 512-block stretch of
a volume (N blocks, N mapping pages). Then, by the command line:
- `thinblock snapshot create` with the pool not served (the command opens it)
  and served (`thinblock serve`; the command's admin call goes to the server);
- `thinblock snapshot remove` after 1% of the volume's pages changed (a write
  to each: copy-on-write of the page), not served and served;
- the same two commands on a volume with as many blocks mapped densely (N/512
  pages): these must stay flat.
The library calls under the commands are timed apart too (pool open, the
snapshot itself, the figures the command prints, the removal). Times are
wall-clock medians of --runs, with Python's start-up (`python -c
pass`) shown apart and subtracted ("own"); the growth factor between scales is
printed. --src runs another tree's code (say /work/main/src) for a before/after
comparison on the same machine. No asserts: the machine may be loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BS = 64 << 10
PAGE_BLOCKS = 512

_MAKE = """
import os, sys
from thinblock import Pool
path, n, spread = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "spread"
bs = 64 << 10
step = 512 if spread else 1
with Pool.create(path, (n + 8192) * bs) as pool:
    vol = pool.create_volume("v", max(n * step, 512) * bs)
    payload = os.urandom(512)
    for i in range(n):
        vol.write(i * step * bs, payload)
    pool.commit()
"""

_CHANGE = """
import os, sys
from thinblock import Pool
path, n, spread = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "spread"
step = 512 if spread else 1
bs = 64 << 10
with Pool.open(path) as pool:
    vol = pool.volume("v")
    payload = os.urandom(512)
    for i in range(0, n, 100):  # 1% of the mapped blocks (spread: 1% of the pages)
        vol.write(i * step * bs, payload)
"""

# The library calls the commands make, timed apart: opening the pool, the snapshot
# itself (share and commit), the figures the command prints (volume_info), the removal.
_LIB = """
import json, sys, time
from thinblock import Pool
from thinblock.core.snapshot import create_snapshot
path, step = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
pool = Pool.open(path)
t1 = time.perf_counter()
if step == "create":
    snap = create_snapshot(pool, "v", "lib")
    t2 = time.perf_counter()
    pool.volume_info(snap)
else:
    pool.remove_volume("lib")
    t2 = time.perf_counter()
t3 = time.perf_counter()
pool.close()
print(json.dumps({"open_s": t1 - t0, step + "_s": t2 - t1, "info_s": t3 - t2}))
"""


def progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


def env(src: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src)}


def run(src: Path, *args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, env=env(src), stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def tb(src: Path, *args: str) -> float:
    return run(src, "-m", "thinblock", *args)


class Served:
    def __init__(self, src: Path, pool: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "serve", str(pool), "--socket", str(pool / "nbd.sock")],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env(src),
        )
        assert self.proc.stdout is not None
        start = time.perf_counter()
        for line in self.proc.stdout:
            if line.startswith("ready"):
                break
        else:
            raise RuntimeError("thinblock serve exited before it was ready")
        self.start_s = time.perf_counter() - start

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def measure(src: Path, scratch: Path, n: int, layout: str, runs: int, startup: float) -> dict[str, Any]:
    base = scratch / f"{layout}-{n}.base"
    if not base.exists():
        progress(f"{layout} {n}: writing the pool")
        run(src, "-c", _MAKE, str(base), str(n), layout)
    out: dict[str, Any] = {}
    pool = scratch / f"{layout}-{n}.lib"
    shutil.rmtree(pool, ignore_errors=True)
    subprocess.run(["cp", "-a", "--sparse=always", str(base), str(pool)], check=True)
    tb(src, "pool", "status", str(pool))  # a format upgrade, if any, is not timed
    for step in ("create", "remove"):
        got = subprocess.run(
            [sys.executable, "-c", _LIB, str(pool), step], check=True, env=env(src), capture_output=True, text=True
        )
        out |= {f"lib_{step}_{k}": v for k, v in json.loads(got.stdout).items()}
        if step == "create":
            run(src, "-c", _CHANGE, str(pool), str(n), layout)
    shutil.rmtree(pool)
    progress(f"{layout} {n} library: " + ", ".join(f"{k} {v:.2f}s" for k, v in out.items()))
    for served in (False, True):
        creates, removes, starts = [], [], []
        for r in range(runs):
            pool = scratch / f"{layout}-{n}.run"
            shutil.rmtree(pool, ignore_errors=True)
            subprocess.run(["cp", "-a", "--sparse=always", str(base), str(pool)], check=True)
            tb(src, "pool", "status", str(pool))  # a format upgrade, if any, is not timed
            server = Served(src, pool) if served else None
            if server is not None:
                starts.append(server.start_s)
            creates.append(tb(src, "snapshot", "create", str(pool), "v", f"s{r}"))
            if server is not None:
                server.stop()
            run(src, "-c", _CHANGE, str(pool), str(n), layout)
            server = Served(src, pool) if served else None
            removes.append(tb(src, "snapshot", "remove", str(pool), f"s{r}"))
            if server is not None:
                server.stop()
            shutil.rmtree(pool)
        key = "served" if served else "direct"
        out[f"create_{key}_s"] = statistics.median(creates)
        out[f"remove_{key}_s"] = statistics.median(removes)
        out[f"create_{key}_own_s"] = max(0.0, out[f"create_{key}_s"] - startup)
        out[f"remove_{key}_own_s"] = max(0.0, out[f"remove_{key}_s"] - startup)
        if starts:
            out["serve_start_s"] = statistics.median(starts)
        progress(f"{layout} {n} {key}: create {out[f'create_{key}_s']:.2f}s remove {out[f'remove_{key}_s']:.2f}s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", default="10000,100000", help="mapped blocks per run, comma-separated")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--src", type=Path, default=ROOT / "src", help="the thinblock tree to run (PYTHONPATH)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    scales = [int(s) for s in args.scales.split(",")]
    scratch = Path(args.dir or tempfile.mkdtemp(prefix="tb-snapscale-"))
    scratch.mkdir(parents=True, exist_ok=True)
    startup = statistics.median(run(args.src, "-c", "pass") for _ in range(5))
    cli_help = statistics.median(tb(args.src, "--help") for _ in range(3))  # importing the command line
    results: dict[str, Any] = {
        "src": str(args.src),
        "python_startup_s": startup,
        "cli_help_s": cli_help,
        "spread": {},
        "dense": {},
    }
    try:
        for n in scales:
            results["spread"][n] = measure(args.src, scratch, n, "spread", args.runs, startup)
            results["dense"][n] = measure(args.src, scratch, n, "dense", args.runs, startup)
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"tree {args.src}; python start-up {startup * 1000:.0f} ms (subtracted in 'own');"
        f" 'thinblock --help' {cli_help * 1000:.0f} ms"
    )
    for layout in ("spread", "dense"):
        prev: dict[str, Any] | None = None
        for n, r in results[layout].items():
            line = (
                f"{layout:6} {n:>7} blocks: create own {r['create_direct_own_s']:.2f}s"
                f" (served {r['create_served_own_s']:.2f}s), remove after 1% own {r['remove_direct_own_s']:.2f}s"
                f" (served {r['remove_served_own_s']:.2f}s), serve start {r.get('serve_start_s', 0):.2f}s"
            )
            if prev is not None:
                line += f"; growth create x{r['create_direct_own_s'] / max(prev['create_direct_own_s'], 1e-3):.1f}"
            print(line)
            print(
                f"{'':6} {'':>7}         library: open {r['lib_create_open_s']:.2f}s, create_snapshot"
                f" {r['lib_create_create_s']:.2f}s, volume_info {r['lib_create_info_s']:.2f}s, remove after 1%"
                f" {r['lib_remove_remove_s']:.2f}s"
            )
            prev = r


if __name__ == "__main__":
    main()
