"""Scale on cores (issue 22): two volumes served by one process vs by two, and nbdkit.

    .venv/bin/python bench/bench_cores.py [--quick] [--json] [--owners] [--workers] [--cases A,W,C]

A `thinblock serve` of a whole pool serves every volume of it from one
interpreter (one core, whatever the number of connections).
Owners per volume (issue 22) let each volume have its own process. The
cases, side by side in one run:

  A  one process: `thinblock serve POOL --workers 1` serving two 4 GiB volumes v1 and v2;
  B  two processes: two `thinblock serve`, each on its own pool holding one
     4 GiB volume (the best that per-volume owners of one pool could reach);
  O  (--owners) two `thinblock serve POOL --volume v1` / `--volume v2` on
     one pool: owners per volume (a thinblock whose serve has no --volume
     skips the row with a one-line message);
  W  (--workers) one `thinblock serve POOL --workers 2`: two worker processes
     behind one socket, each owning one volume (connections accepted by the
     other worker are handed over to the owner);
  C  peer: one nbdkit `file` plugin process serving two 4 GiB files (dir=,
     export names are the file names).

fio --ioengine=nbd over unix sockets: the exports are first written
sequentially (1 MiB, so that reads find data), then 4 KiB random read and
random write with two jobs, one connection to each volume (iodepth 16 each,
time-based, 15 s over the first 4 GiB, --region to change that; --quick 5 s
over 1 GiB); the prefill is synced to disk before the random phases. With 4 GiB
per volume the random writes dirty more of the page cache than the kernel lets
stay dirty (a 4 KiB write into a page-cache folio the 1 MiB prefill made large
counts the whole folio as dirty), so every case's writes wait for the disk's
writeback; with --region 1G they stay within it and measure the servers' CPU.
On A's v1 alone: the same with one
job and one connection. Each comparison runs twice, the order reversed the
second time (run 1: A, B, [O, W,] C; run 2: C, [W, O,] B, A). Ratios B/A,
A/C, B/C (and O/A, O/C, W/A, W/C). --cases picks some of them. fio shares the machine's cores with the servers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_nbd import _stop, fio, make_bench_pool, progress, wait_for

GiB = 1 << 30
VOLUME = "4G"
VOLUMES = ("v1", "v2")
CASES = {
    "A": "one process",
    "B": "two processes",
    "O": "two owners",
    "W": "--workers 2",
    "C": "nbdkit file",
}
WORKLOADS = ("randread", "randwrite")
RATIOS = (("B", "A"), ("A", "C"), ("B", "C"), ("O", "A"), ("O", "C"), ("W", "A"), ("W", "C"))


class Unavailable(Exception):
    """The case cannot run with this thinblock (its serve command refused the arguments)."""


def make_pool(pool: Path, volumes: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """bench_nbd's pool (20 GiB) with its 16 GiB "disk" replaced by 4 GiB `volumes`."""
    tb, env = make_bench_pool(pool)
    subprocess.run([*tb, "volume", "remove", str(pool), "disk"], check=True, env=env, capture_output=True)
    for name in volumes:
        subprocess.run(
            [*tb, "volume", "create", str(pool), name, "--size", VOLUME], check=True, env=env, capture_output=True
        )
    return tb, env


@contextmanager
def server(cmd: list[str], sock: str, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    """Run one server until the block ends; its output goes to `log`.

    A server that exits at once with argparse's usage error (status 2) raises Unavailable."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        try:
            wait_for(sock, proc)
        except RuntimeError:
            text = log.read_text(errors="replace")
            if proc.returncode == 2 and "usage:" in text:
                last = text.strip().splitlines()[-1] if text.strip() else ""
                raise Unavailable(last) from None
            raise RuntimeError(f"{cmd[0:5]} did not start: {text.strip()[-500:]}") from None
        yield
    finally:
        if proc.poll() is None:
            _stop(proc)


def unix_uri(export: str, sock: str) -> str:
    return f"nbd+unix:///{export}?socket={sock}"


@contextmanager
def one_process(scratch: Path) -> Iterator[list[str]]:
    """A: one `thinblock serve` for one pool with both volumes."""
    pool = scratch / "a-pool"
    tb, env = make_pool(pool, VOLUMES)
    sock = str(scratch / "a.sock")
    with server([*tb, "serve", str(pool), "--workers", "1", "--socket", sock], sock, scratch / "a.log", env):
        yield [unix_uri(v, sock) for v in VOLUMES]


@contextmanager
def two_processes(scratch: Path) -> Iterator[list[str]]:
    """B: two `thinblock serve`, each for its own pool with one volume."""
    with ExitStack() as stack:
        uris = []
        for v in VOLUMES:
            pool = scratch / f"b-pool-{v}"
            tb, env = make_pool(pool, (v,))
            sock = str(scratch / f"b-{v}.sock")
            stack.enter_context(server([*tb, "serve", str(pool), "--socket", sock], sock, scratch / f"b-{v}.log", env))
            uris.append(unix_uri(v, sock))
        yield uris


@contextmanager
def two_owners(scratch: Path) -> Iterator[list[str]]:
    """O: two `thinblock serve POOL --volume V` on one pool (owners per volume)."""
    pool = scratch / "o-pool"
    tb, env = make_pool(pool, VOLUMES)
    with ExitStack() as stack:
        uris = []
        for v in VOLUMES:
            sock = str(scratch / f"o-{v}.sock")
            cmd = [*tb, "serve", str(pool), "--volume", v, "--socket", sock]
            stack.enter_context(server(cmd, sock, scratch / f"o-{v}.log", env))
            uris.append(unix_uri(v, sock))
        yield uris


@contextmanager
def workers(scratch: Path) -> Iterator[list[str]]:
    """W: one `thinblock serve POOL --workers 2`: one socket, a worker per volume."""
    pool = scratch / "w-pool"
    tb, env = make_pool(pool, VOLUMES)
    sock = str(scratch / "w.sock")
    with server([*tb, "serve", str(pool), "--workers", "2", "--socket", sock], sock, scratch / "w.log", env):
        yield [unix_uri(v, sock) for v in VOLUMES]


@contextmanager
def nbdkit_dir(scratch: Path) -> Iterator[list[str]]:
    """C: one nbdkit process, file plugin with dir=, one sparse 4 GiB file per export."""
    files = scratch / "c-files"
    files.mkdir()
    for v in VOLUMES:
        with open(files / v, "wb") as f:
            f.truncate(4 * GiB)
    sock = str(scratch / "c.sock")
    with server(["nbdkit", "-f", "-U", sock, "file", f"dir={files}"], sock, scratch / "c.log"):
        yield [unix_uri(v, sock) for v in VOLUMES]


STARTERS = {"A": one_process, "B": two_processes, "O": two_owners, "W": workers, "C": nbdkit_dir}


def fio_volumes(uris: list[str], rw: str, bs: str, iodepth: int, size: str, runtime: int | None) -> dict[str, Any]:
    """One fio process with one job (one connection) per export, started together; IOPS summed."""
    cmd = [
        "fio", "--ioengine=nbd", "--output-format=json", f"--rw={rw}", f"--bs={bs}",
        f"--iodepth={iodepth}", f"--size={size}",
    ]  # fmt: skip
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    for n, uri in enumerate(uris):
        cmd += [f"--name=job{n}", f"--uri={uri}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    jobs = json.loads(out[out.index("{") :])["jobs"]
    side = "write" if "write" in rw else "read"
    per_job = [job[side]["iops"] for job in jobs]
    mibps = sum(job[side]["bw_bytes"] for job in jobs) / (1 << 20)
    return {"iops": sum(per_job), "per_job_iops": per_job, "MiBps": mibps}


def run_case(key: str, scratch: Path, region: str, runtime: int) -> dict[str, Any]:
    """Start the case's servers, prefill, and run its workloads; the servers stop after."""
    work = scratch / key
    work.mkdir()
    r: dict[str, Any] = {}
    try:
        with STARTERS[key](work) as uris:
            progress(f"{key} ({CASES[key]}): sequential prefill of {region} on each of {len(uris)} exports")
            fio_volumes(uris, "write", "1M", 16, region, None)
            os.sync()  # every case's random phase starts with the prefill on disk, none behind
            for rw in WORKLOADS:
                progress(f"{key} ({CASES[key]}): 4k {rw}, {len(uris)} jobs, {runtime} s")
                res = fio_volumes(uris, rw, "4k", 16, region, runtime)
                r[f"2vol_{rw}_4k_iops"] = res["iops"]
                r[f"2vol_{rw}_4k_per_job_iops"] = res["per_job_iops"]
            if key == "A":
                for rw in WORKLOADS:
                    progress(f"{key} ({CASES[key]}): 4k {rw}, v1 only, 1 job, {runtime} s")
                    r[f"1vol_{rw}_4k_iops"] = fio(uris[0], rw, "4k", 16, region, runtime)["iops"]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return r


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for rw in WORKLOADS:
        key = f"2vol_{rw}_4k_iops"
        row = {}
        for top, bottom in RATIOS:
            if top in results and bottom in results and results[bottom][key]:
                row[f"{top}/{bottom}"] = results[top][key] / results[bottom][key]
        if "A" in results and results["A"].get(f"1vol_{rw}_4k_iops"):
            row["A 2vol/1vol"] = results["A"][key] / results["A"][f"1vol_{rw}_4k_iops"]
        out[key] = row
    return out


def report(runs: list[dict[str, Any]], skipped: dict[str, str]) -> None:
    cases = [k for k in CASES if any(k in run["results"] for run in runs)]
    names = [f"{k} {CASES[k]}" for k in cases]
    ratio_names = [f"{t}/{b}" for t, b in RATIOS if t in cases and b in cases] + ["A 2vol/1vol"]
    head = f"{'workload (IOPS)':28}{'run':>4}" + "".join(f"{n:>18}" for n in names)
    print(head + "".join(f"{n:>12}" for n in ratio_names))
    rows = [(f"2 vols: 4k {rw}", f"2vol_{rw}_4k_iops") for rw in WORKLOADS]
    rows += [(f"1 vol, 1 conn: 4k {rw}", f"1vol_{rw}_4k_iops") for rw in WORKLOADS]
    for label, key in rows:
        for n, run in enumerate(runs, 1):
            res, rat = run["results"], run["ratios"].get(key, {})
            line = f"{label:28}{n:>4}"
            line += "".join(f"{res[k][key]:>18,.0f}" if key in res.get(k, {}) else f"{'':>18}" for k in cases)
            line += "".join(f"{rat[r]:>12.2f}" if r in rat else f"{'':>12}" for r in ratio_names)
            print(line)
    for n, run in enumerate(runs, 1):
        print(f"run {n} order: {', '.join(run['order'])}")
    for key, why in skipped.items():
        print(f"{key} ({CASES[key]}) skipped: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp", help="scratch directory (default /var/tmp)")
    parser.add_argument("--quick", action="store_true", help="5 s runs over 1 GiB of each volume (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument(
        "--owners",
        action="store_true",
        help="also two `serve POOL --volume V` on one pool (issue 22; skipped while serve has no --volume)",
    )
    parser.add_argument("--workers", action="store_true", help="also one `serve POOL --workers 2` (W)")
    parser.add_argument("--cases", metavar="A,W,C", help="run only these cases, in this order (then reversed)")
    parser.add_argument(
        "--region",
        metavar="SIZE",
        help="the part of each volume written and then read at random (default 4G; --quick 1G)",
    )
    args = parser.parse_args()
    region, runtime = ("1G", 5) if args.quick else (VOLUME, 15)
    region = args.region or region
    order = ["A", "B", *(["O"] if args.owners else []), *(["W"] if args.workers else []), "C"]
    if args.cases:
        order = [k for k in args.cases.split(",") if k in CASES]
    scratch = Path(tempfile.mkdtemp(prefix="tb-cores-bench-", dir=args.dir))
    runs: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    try:
        for n in range(2):
            this_order = order if n == 0 else order[::-1]
            results: dict[str, dict[str, Any]] = {}
            for key in this_order:
                if key in skipped:
                    continue
                progress(f"run {n + 1}: {key} ({CASES[key]})")
                try:
                    results[key] = run_case(key, scratch, region, runtime)
                except Unavailable as e:
                    skipped[key] = f"this thinblock's serve refused the arguments (usage error: {e})"
                    print(f"{key} ({CASES[key]}): {skipped[key]}; row skipped", file=sys.stderr, flush=True)
            runs.append(
                {"order": [k for k in this_order if k in results], "results": results, "ratios": ratios(results)}
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        settings = {"volume": VOLUME, "region": region, "runtime_s": runtime, "iodepth": 16, "bs": "4k"}
        print(json.dumps({"settings": settings, "cases": CASES, "runs": runs, "skipped": skipped}, indent=2))
        return
    report(runs, skipped)


if __name__ == "__main__":
    main()
