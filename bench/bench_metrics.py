"""What `serve --metrics` costs on the request path: 4 KiB random I/O with and without it.

    .venv/bin/python bench/bench_metrics.py [--runtime S] [--rounds N] [--scrape FILE] [--json]

fio --ioengine=nbd over the unix socket, 4 KiB randwrite then randread (iodepth
16, one connection) over a 1 GiB region of a fresh 16 GiB volume, one server
per round; rounds alternate off, on, off, on, ... so that drift of the machine
falls on both sides alike. With --scrape, the last server with metrics is
scraped once its fio runs are done, and the text is saved there.

Then, in this process and without sockets (so that a busy machine's noise does
not hide it), the cost of the counting itself: microseconds per 4 KiB write and
read through the export handle of a memory: pool, counting off and on, alternated.
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
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: bench is a package

from bench.bench_nbd import _stop, fio, make_bench_pool, progress


def serve_round(scratch: Path, metrics: bool, runtime: int, scrape_to: Path | None) -> dict[str, float]:
    pool = scratch / "pool"
    shutil.rmtree(pool, ignore_errors=True)
    tb, env = make_bench_pool(pool)
    sock = str(pool / "nbd.sock")
    extra = ["--metrics", "127.0.0.1:0"] if metrics else []
    proc = subprocess.Popen(
        [*tb, "serve", str(pool), "--socket", sock, *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    url = None
    assert proc.stdout is not None
    for line in proc.stdout:  # the server prints its addresses, then "ready"
        if line.startswith("metrics "):
            url = line.split()[1]
        if line.startswith("ready"):
            break
    uri = f"nbd+unix:///disk?socket={sock}"
    try:
        r = {
            "randwrite_4k_iops": fio(uri, "randwrite", "4k", 16, "1G", runtime)["iops"],
            "randread_4k_iops": fio(uri, "randread", "4k", 16, "1G", runtime)["iops"],
        }
        if scrape_to is not None and url is not None:
            with urllib.request.urlopen(url, timeout=30) as reply:
                scrape_to.write_bytes(reply.read())
        return r
    finally:
        _stop(proc)  # type: ignore[arg-type]
        shutil.rmtree(pool, ignore_errors=True)


def in_process(n: int = 20000, rounds: int = 3) -> dict[str, dict[str, float]]:
    """Microseconds per 4 KiB Export.write / Export.read, counting off and on (best of rounds)."""
    from thinblock.core.pool import Pool
    from thinblock.frontends.export import Export

    pool = Pool.create(f"memory:bench-{os.getpid()}", 1 << 30)
    try:
        pool.create_volume("disk", 1 << 30)
        data = b"\x5a" * 4096
        best: dict[str, dict[str, float]] = {"write_4k_us": {}, "read_4k_us": {}}
        for _ in range(rounds):
            for side in ("off", "on"):
                if side == "on":
                    pool.stats.enable_exports()
                export = Export(pool, pool.volume("disk"))
                if side == "off":
                    export.stats = None
                for key, op in (("write_4k_us", export.write), ("read_4k_us", export.read)):
                    started = time.perf_counter()
                    for i in range(n):
                        offset = (i * 4096 * 7) % (64 << 20)
                        if op == export.write:
                            export.write(offset, data)
                        else:
                            export.read(offset, 4096)
                    us = (time.perf_counter() - started) / n * 1e6
                    best[key][side] = min(best[key].get(side, us), us)
                export.close()
        return best
    finally:
        pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp", help="scratch directory")
    parser.add_argument("--runtime", type=int, default=5, help="seconds per fio run (default 5)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per side (default 2)")
    parser.add_argument("--scrape", type=Path, help="save the last metrics scrape here")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--in-process-only", action="store_true", help="skip the fio rounds")
    args = parser.parse_args()
    if args.in_process_only:
        args.rounds = 0
    scratch = Path(tempfile.mkdtemp(prefix="tb-metrics-bench-", dir=args.dir))
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    try:
        for i in range(args.rounds):
            for side in ("off", "on"):
                progress(f"round {i + 1}: metrics {side}")
                last = i == args.rounds - 1 and side == "on"
                runs[side].append(serve_round(scratch, side == "on", args.runtime, args.scrape if last else None))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    progress("in process: the export handle's counting alone")
    result: dict[str, Any] = {"runs": runs, "mean": {}, "ratio_on_to_off": {}, "in_process": in_process()}
    for key in runs["off"][0] if runs["off"] else []:
        off = statistics.mean(r[key] for r in runs["off"])
        on = statistics.mean(r[key] for r in runs["on"])
        result["mean"][key] = {"off": off, "on": on}
        result["ratio_on_to_off"][key] = on / off
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'metric':24}{'off':>12}{'on':>12}{'on/off':>9}   runs (off | on)")
    for key, m in result["mean"].items():
        each = " ".join(f"{r[key]:.0f}" for r in runs["off"]) + " | " + " ".join(f"{r[key]:.0f}" for r in runs["on"])
        print(f"{key:24}{m['off']:>12.0f}{m['on']:>12.0f}{result['ratio_on_to_off'][key]:>9.3f}   {each}")
    for key, m in result["in_process"].items():
        print(f"{key:24}{m['off']:>12.2f}{m['on']:>12.2f}{m['on'] / m['off']:>9.3f}   (best of 3, in process)")


if __name__ == "__main__":
    main()
