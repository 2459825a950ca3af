"""NBD benchmark: thinblock serve vs nbdkit file vs qemu-nbd (qcow2), same run.

    .venv/bin/python bench/bench_nbd.py [--quick] [--json]
    .venv/bin/python bench/bench_nbd.py --concurrency [--order nbdkit,thinblock] [--quick]

fio --ioengine=nbd over a unix socket and over TCP for sequential 1 MiB
write/read (iodepth 16) and 4 KiB random write (iodepth 32); then the zero
workloads through libnbd: 4 GiB of zero WRITEs to fresh space, WRITE_ZEROES
of 8 GiB with and without NO_HOLE, and reading a 16 GiB empty export
(bytes of data on the wire). Every peer gets a fresh 16 GiB export.

--concurrency: 4 KiB random write and read with one job and with four jobs on
four connections (iodepth 16 each), sequential 1 MiB on four connections, and
the 4 KiB read latency on one connection during a 30 s sequential write on
another (p99 and maximum), for thinblock and nbdkit file side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import nbd

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
MiB = 1 << 20
EXPORT_BYTES = 16 * GiB


def make_bench_pool(pool: Path) -> tuple[list[str], dict[str, str]]:
    """A fresh 20G pool with a 16G volume "disk"; returns the thinblock command and its env."""
    tb = [sys.executable, "-m", "thinblock"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([*tb, "pool", "create", str(pool), "--size", "20G"], check=True, env=env, capture_output=True)
    subprocess.run(
        [*tb, "volume", "create", str(pool), "disk", "--size", "16G"], check=True, env=env, capture_output=True
    )
    return tb, env


def progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(path_or_port: str | int, proc: subprocess.Popen[bytes], *, limit: float = 30, poll: float = 0.05) -> None:
    """Until the server accepts a connection (a unix socket path or a local port)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        if isinstance(path_or_port, str):
            if os.path.exists(path_or_port):
                try:
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(path_or_port)
                    return
                except OSError:
                    pass
        else:
            try:
                with socket.create_connection(("127.0.0.1", path_or_port), timeout=1):
                    return
            except OSError:
                pass
        time.sleep(poll)
    raise RuntimeError("server did not start")


class Peer:
    """One server under test; `start` yields (uri, space-used function)."""

    name = ""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch

    def start(self, transport: str) -> AbstractContextManager[tuple[str, Callable[[], int]]]:
        raise NotImplementedError


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Thinblock(Peer):
    name = "thinblock"

    @contextmanager
    def start(self, transport: str) -> Iterator[tuple[str, Callable[[], int]]]:
        pool = self.scratch / "tb-pool"
        shutil.rmtree(pool, ignore_errors=True)
        tb, env = make_bench_pool(pool)
        sock = str(pool / "nbd.sock")
        port = free_port()
        args = ["--listen", str(port), "--insecure"] if transport == "tcp" else []
        proc = subprocess.Popen(
            [*tb, "serve", str(pool), *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(port if transport == "tcp" else sock, proc)
        uri = f"nbd://127.0.0.1:{port}/disk" if transport == "tcp" else f"nbd+unix:///disk?socket={sock}"

        def used() -> int:
            out = subprocess.run([*tb, "pool", "status", str(pool), "--json"], env=env, capture_output=True, text=True)
            return int(json.loads(out.stdout)["used_bytes"])

        try:
            yield uri, used
        finally:
            _stop(proc)
            shutil.rmtree(pool, ignore_errors=True)


class Nbdkit(Peer):
    name = "nbdkit-file"

    @contextmanager
    def start(self, transport: str) -> Iterator[tuple[str, Callable[[], int]]]:
        img = self.scratch / "nbdkit.raw"
        with open(img, "wb") as f:
            f.truncate(EXPORT_BYTES)
        sock = str(self.scratch / "nbdkit.sock")
        Path(sock).unlink(missing_ok=True)
        port = free_port()
        listen = ["-p", str(port), "-i", "127.0.0.1"] if transport == "tcp" else ["-U", sock]
        proc = subprocess.Popen(
            ["nbdkit", "-f", *listen, "file", str(img)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for(port if transport == "tcp" else sock, proc)
        uri = f"nbd://127.0.0.1:{port}/" if transport == "tcp" else f"nbd+unix:///?socket={sock}"
        try:
            yield uri, lambda: os.stat(img).st_blocks * 512
        finally:
            _stop(proc)
            img.unlink()


class QemuNbd(Peer):
    name = "qemu-nbd-qcow2"

    @contextmanager
    def start(self, transport: str) -> Iterator[tuple[str, Callable[[], int]]]:
        img = self.scratch / "qemu.qcow2"
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(img), str(EXPORT_BYTES)], check=True)
        sock = str(self.scratch / "qemu.sock")
        Path(sock).unlink(missing_ok=True)
        port = free_port()
        listen = ["-b", "127.0.0.1", "-p", str(port)] if transport == "tcp" else ["-k", sock]
        proc = subprocess.Popen(
            [
                "qemu-nbd",
                "-f",
                "qcow2",
                "-x",
                "disk",
                "-t",
                "--shared=8",
                "--discard=unmap",
                "--detect-zeroes=unmap",
                *listen,
                str(img),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(port if transport == "tcp" else sock, proc)
        uri = f"nbd://127.0.0.1:{port}/disk" if transport == "tcp" else f"nbd+unix:///disk?socket={sock}"
        try:
            yield uri, lambda: os.stat(img).st_blocks * 512
        finally:
            _stop(proc)
            img.unlink()


def fio(
    uri: str,
    rw: str,
    bs: str,
    iodepth: int,
    size: str,
    runtime: int | None = None,
    extra: tuple[str, ...] = (),
    jobs: int = 1,
) -> dict[str, Any]:
    """One fio run; with jobs > 1, that many jobs on as many NBD connections, summed."""
    cmd = [
        "fio", "--name=bench", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
        f"--iodepth={iodepth}", f"--size={size}", "--output-format=json", *extra,
    ]  # fmt: skip
    if jobs > 1:
        cmd += [f"--numjobs={jobs}", "--group_reporting", "--offset_increment=0"]
    if runtime:
        cmd += [f"--runtime={runtime}", "--time_based"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    return {"MiBps": side["bw_bytes"] / MiB, "iops": side["iops"]}


def concurrency(uri: str, runtime: int) -> dict[str, float]:
    """4 KiB random I/O (iodepth 16 per job) on 1 and on 4 connections, sequential 1 MiB
    on 4 connections, over a 1 GiB region written first so that reads find data."""
    r: dict[str, float] = {}
    r["seq_write_1M_4conn_MiBps"] = fio(uri, "write", "1M", 16, "1G", jobs=4)["MiBps"]
    r["seq_read_1M_4conn_MiBps"] = fio(uri, "read", "1M", 16, "1G", jobs=4)["MiBps"]
    for rw in ("randwrite", "randread"):
        for jobs in (1, 4):
            r[f"{rw}_4k_{jobs}conn_iops"] = fio(uri, rw, "4k", 16, "1G", runtime, jobs=jobs)["iops"]
    return r


def latency_under_write(uri: str, runtime: int) -> dict[str, float]:
    """While one connection writes sequentially (1 MiB, iodepth 16), another reads 4 KiB
    at random (iodepth 1, 200 reads a second): the read latency's p99 and maximum."""
    cmd = [
        "fio", "--ioengine=nbd", f"--uri={uri}", "--output-format=json", f"--runtime={runtime}", "--time_based",
        "--name=writer", "--rw=write", "--bs=1M", "--iodepth=16", "--size=8G",
        "--name=reader", "--rw=randread", "--bs=4k", "--iodepth=1", "--size=1G", "--rate_iops=200",
    ]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    jobs = {job["jobname"]: job for job in json.loads(out[out.index("{") :])["jobs"]}
    clat = jobs["reader"]["read"]["clat_ns"]
    return {
        "read_latency_p99_ms_during_seq_write": clat["percentile"]["99.000000"] / 1e6,
        "read_latency_max_ms_during_seq_write": clat["max"] / 1e6,
        "seq_write_MiBps_beside_reads": jobs["writer"]["write"]["bw_bytes"] / MiB,
    }


def zero_workloads(uri: str, used: Callable[[], int]) -> dict[str, float]:
    r: dict[str, float] = {}
    h = nbd.NBD()
    h.connect_uri(uri)
    zeros = bytes(4 * MiB)
    base = used()
    start = time.perf_counter()
    for off in range(0, 4 * GiB, len(zeros)):
        h.pwrite(zeros, off)
    h.flush()
    r["zero_write_4GiB_s"] = time.perf_counter() - start
    time.sleep(1.2)
    r["zero_write_4GiB_used_bytes"] = used() - base
    step = 2 * GiB
    for label, flags in (("write_zeroes_8GiB_s", 0), ("write_zeroes_no_hole_8GiB_s", nbd.CMD_FLAG_NO_HOLE)):
        start = time.perf_counter()
        for off in range(4 * GiB, 12 * GiB, step):
            h.zero(step, off, flags)
        h.flush()
        r[label] = time.perf_counter() - start
    h.shutdown()
    return r


def read_empty(uri: str) -> dict[str, float]:
    """Read a whole empty 16 GiB export with structured reads; count data bytes on the wire."""
    h = nbd.NBD()
    h.connect_uri(uri)
    data_bytes = 0

    def chunk(buf: bytes, off: int, status: int, err: int) -> int:
        nonlocal data_bytes
        if status == nbd.READ_DATA:
            data_bytes += len(buf)
        return 0

    start = time.perf_counter()
    step = 32 * MiB
    for off in range(0, EXPORT_BYTES, step):
        h.pread_structured(step, off, chunk)
    elapsed = time.perf_counter() - start
    h.shutdown()
    return {"read_empty_16GiB_s": elapsed, "read_empty_16GiB_data_bytes_on_wire": data_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp", help="scratch directory")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument(
        "--concurrency",
        action="store_true",
        help="only the many-connection rows and the latency run (thinblock and nbdkit, unix socket)",
    )
    parser.add_argument("--order", default="thinblock,nbdkit", help="peer order for --concurrency (alternate runs)")
    args = parser.parse_args()
    if args.concurrency:
        return concurrency_main(args)
    scratch = Path(tempfile.mkdtemp(prefix="tb-nbd-bench-", dir=args.dir))
    seq, runtime = ("256M", 3) if args.quick else ("2G", 8)
    results: dict[str, dict[str, Any]] = {}
    try:
        for peer in (Thinblock(scratch), Nbdkit(scratch), QemuNbd(scratch)):
            r: dict[str, Any] = {}
            for transport in ("unix", "tcp"):
                progress(f"{peer.name} over {transport}: fio")
                with peer.start(transport) as (uri, _used):
                    r[f"{transport}_seq_write_MiBps"] = fio(uri, "write", "1M", 16, seq)["MiBps"]
                    r[f"{transport}_seq_read_MiBps"] = fio(uri, "read", "1M", 16, seq)["MiBps"]
                    r[f"{transport}_randwrite_4k_iops"] = fio(uri, "randwrite", "4k", 32, "16G", runtime)["iops"]
            progress(f"{peer.name}: zero workloads")
            with peer.start("unix") as (uri, used):
                r.update(zero_workloads(uri, used))
            with peer.start("unix") as (uri, used):
                r.update(read_empty(uri))
            results[peer.name] = r
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tb = results["thinblock"]
    ratios = {}
    for key, value in tb.items():
        if key.endswith(("MiBps", "iops")):
            ratios[key] = {p: value / results[p][key] for p in ("qemu-nbd-qcow2", "nbdkit-file") if results[p][key]}
    if args.json:
        print(json.dumps({"results": results, "ratios_thinblock_to_peer": ratios}, indent=2))
        return
    peers = list(results)
    print(f"{'metric':40}" + "".join(f"{p:>16}" for p in peers) + f"{'tb/qemu':>9}{'tb/nbdkit':>10}")
    for key in tb:
        row = f"{key:40}" + "".join(f"{results[p][key]:>16.3f}" for p in peers)
        if key in ratios:
            row += f"{ratios[key].get('qemu-nbd-qcow2', 0):>9.2f}{ratios[key].get('nbdkit-file', 0):>10.2f}"
        print(row)


def concurrency_main(args: argparse.Namespace) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="tb-nbd-bench-", dir=args.dir))
    runtime, latency_s = (3, 5) if args.quick else (10, 30)
    peers = {"thinblock": Thinblock(scratch), "nbdkit": Nbdkit(scratch)}
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in args.order.split(","):
            peer = peers[name]
            progress(f"{peer.name}: 1 and 4 connections")
            with peer.start("unix") as (uri, _used):
                r = concurrency(uri, runtime)
            progress(f"{peer.name}: read latency during a {latency_s} s sequential write")
            with peer.start("unix") as (uri, _used):
                r.update(latency_under_write(uri, latency_s))
            results[peer.name] = r
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tb, kit = results["thinblock"], results["nbdkit-file"]
    derived = {
        "thinblock randwrite 4 conns / 1 conn": tb["randwrite_4k_4conn_iops"] / tb["randwrite_4k_1conn_iops"],
        "thinblock randread 4 conns / 1 conn": tb["randread_4k_4conn_iops"] / tb["randread_4k_1conn_iops"],
    }
    for key in tb:
        if key.endswith(("iops", "MiBps")) and kit.get(key):
            derived[f"{key} thinblock/nbdkit"] = tb[key] / kit[key]
    if args.json:
        print(json.dumps({"results": results, "ratios": derived}, indent=2))
        return
    print(f"{'metric':44}{'thinblock':>14}{'nbdkit-file':>14}{'tb/nbdkit':>10}")
    for key in tb:
        ratio = f"{tb[key] / kit[key]:>10.2f}" if kit.get(key) else ""
        print(f"{key:44}{tb[key]:>14.2f}{kit[key]:>14.2f}{ratio}")
    for key, value in derived.items():
        if "/ 1 conn" in key:
            print(f"{key:44}{value:>14.2f}")


if __name__ == "__main__":
    main()
