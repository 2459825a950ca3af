"""RADOS benchmark: thinblock serving a pool in Ceph vs qemu-nbd serving an RBD image
on the same single-node cluster, side by side in one run.

    .venv/bin/python bench/bench_rados.py [--rounds 2] [--quick] [--json] [--owners]

It starts its own cluster (tests/ceph_cluster.py, 1 mon, 1 mgr, 1 bluestore OSD
on a sparse file) and stops it at the end. Each round runs both peers, and the
second round runs them in the other order (the machine is noisy). Rows:
- fio --ioengine=nbd over a unix socket: sequential 1 MiB write and read at
  iodepth 16, 4 KiB random write at iodepth 32, on one connection and on four;
- 1 GiB of literal zero WRITEs to fresh space (then flush): time, and the RADOS
  objects and bytes the peer's image holds afterwards;
- WRITE_ZEROES with NO_HOLE over 8 GiB (both allocate: the OSD writes the zeros);
- with --owners, instead (issue 23): two volumes of one pool, each served by its
  own `serve --volume` process, against two RBD images each served by its own
  qemu-nbd: fio with a job per export (sequential 1 MiB write at iodepth 16,
  4 KiB random write at iodepth 32), summed; then the same on one volume. The
  sequential rows also give the CPU seconds per GiB written spent in the servers
  and in the OSD (/proc of their pids, workers included): on this 2-core machine
  they share the cores, so these bound what either peer can reach;
- thinblock only: `thinblock mkfs` of 10 GiB and 100 GiB volumes, ext4 and xfs,
  through attach (FUSE + loop) on the RADOS pool. There is no rbd or nbd kernel
  module here, so the peer figures for mkfs are the seed's (mkfs on an rbd image:
  ext4 10 GiB 3.7 s writing zeros, 0.6 s with WRITE_ZEROES; xfs 100 GiB 5.2 s, 1.5 s).
"""

from __future__ import annotations

import argparse
import contextlib
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

import nbd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: bench and tests are packages

from tests import ceph_cluster
from tests.cli import stop_pid

from bench.bench_cores import fio_volumes
from bench.bench_nbd import _stop, fio, progress, wait_for
from thinblock.backends import locate
from thinblock.sizes import parse_size

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
MiB = 1 << 20
CEPH_POOL = "bench"
EXPORT = "16G"


def ceph(*args: str) -> str:
    return subprocess.run(
        ["ceph", "-c", os.environ["CEPH_CONF"], *args], check=True, capture_output=True, text=True, timeout=60
    ).stdout


def objects(prefix: str) -> tuple[int, int]:
    """(count, bytes) of the objects in the bench pool whose names start with prefix."""
    import rados

    cluster = rados.Rados(conffile=os.environ["CEPH_CONF"])
    cluster.connect(timeout=10)
    try:
        io = cluster.open_ioctx(CEPH_POOL)
        names = [o.key for o in io.list_objects() if o.key.startswith(prefix)]
        return len(names), sum(io.stat(n)[0] for n in names)
    finally:
        cluster.shutdown()


def tb(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-m", "thinblock", *args], check=True, capture_output=True, text=True, env=env
    ).stdout


class Peer:
    """A server under test; each start() gives a fresh 16 GiB export."""

    name = ""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.n = 0


class ThinblockRados(Peer):
    name = "thinblock-rados"

    @contextmanager
    def start(self) -> Iterator[tuple[str, Callable[[], tuple[int, int]]]]:
        self.n += 1
        locator = f"rados:{CEPH_POOL}/tb{self.n}"
        tb("pool", "create", locator, "--size", "20G")
        tb("volume", "create", locator, "disk", "--size", EXPORT)
        sock = str(self.scratch / f"tb{self.n}.sock")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "serve", locator, "--socket", sock],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(sock, proc)
        prefix = "thinblock_data."  # the only thinblock pool in the bench pool while it runs
        try:
            yield f"nbd+unix:///disk?socket={sock}", lambda: objects(prefix)
        finally:
            _stop(proc)
            self.remove_all()

    @staticmethod
    def remove_all() -> None:
        """Remove every thinblock object from the bench pool (it holds one pool at a time)."""
        import rados

        cluster = rados.Rados(conffile=os.environ["CEPH_CONF"])
        cluster.connect(timeout=10)
        try:
            io = cluster.open_ioctx(CEPH_POOL)
            for o in list(io.list_objects()):
                if o.key.startswith("thinblock"):
                    io.remove_object(o.key)
        finally:
            cluster.shutdown()


class QemuNbdRbd(Peer):
    name = "qemu-nbd-rbd"
    pid = 0  # the qemu-nbd last started

    @contextmanager
    def start(self) -> Iterator[tuple[str, Callable[[], tuple[int, int]]]]:
        self.n += 1
        image = f"img{self.n}"
        conf = os.environ["CEPH_CONF"]
        subprocess.run(["rbd", "-c", conf, "create", f"{CEPH_POOL}/{image}", "--size", EXPORT], check=True)
        image_id = subprocess.run(
            ["rbd", "-c", conf, "info", f"{CEPH_POOL}/{image}", "--format", "json"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        prefix = json.loads(image_id)["block_name_prefix"] + "."
        sock = str(self.scratch / f"q{self.n}.sock")
        proc = subprocess.Popen(
            [
                "qemu-nbd", "-f", "raw", "-x", "disk", "-t", "--shared=8", "--discard=unmap", "-k", sock,
                f"rbd:{CEPH_POOL}/{image}:conf={conf}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for(sock, proc)
        self.pid = proc.pid
        try:
            yield f"nbd+unix:///disk?socket={sock}", lambda: objects(prefix)
        finally:
            _stop(proc)
            subprocess.run(["rbd", "-c", conf, "rm", "--no-progress", f"{CEPH_POOL}/{image}"], check=True)


def zeros(uri: str, held: Callable[[], tuple[int, int]], quick: bool) -> dict[str, float]:
    r: dict[str, float] = {}
    h = nbd.NBD()
    h.connect_uri(uri)
    chunk = bytes(4 * MiB)
    total = (256 * MiB) if quick else GiB
    start = time.perf_counter()
    for off in range(0, total, len(chunk)):
        h.pwrite(chunk, off)
    h.flush()
    r["zero_write_1GiB_s"] = time.perf_counter() - start
    time.sleep(1.5)
    r["zero_write_1GiB_objects"], r["zero_write_1GiB_object_bytes"] = held()
    span = (GiB if quick else 8 * GiB) // 4
    start = time.perf_counter()
    for off in range(2 * GiB, 2 * GiB + 4 * span, span):
        h.zero(span, off, nbd.CMD_FLAG_NO_HOLE)
    h.flush()
    r["write_zeroes_no_hole_8GiB_s"] = time.perf_counter() - start
    h.shutdown()
    return r


def io_rows(uri: str, quick: bool) -> dict[str, float]:
    seq, runtime = ("256M", 3) if quick else ("2G", 10)
    r: dict[str, float] = {}
    r["seq_write_1M_qd16_MiBps"] = fio(uri, "write", "1M", 16, seq)["MiBps"]
    r["seq_read_1M_qd16_MiBps"] = fio(uri, "read", "1M", 16, seq)["MiBps"]
    r["randwrite_4k_qd32_iops"] = fio(uri, "randwrite", "4k", 32, EXPORT, runtime)["iops"]
    r["seq_write_1M_4conn_MiBps"] = fio(uri, "write", "1M", 16, seq, jobs=4)["MiBps"]
    r["randwrite_4k_4conn_iops"] = fio(uri, "randwrite", "4k", 16, EXPORT, runtime, jobs=4)["iops"]
    return r


class ThinblockOwners:
    """thinblock: one pool in Ceph, a volume per owner, each served by its own
    `serve --volume` process (its own Ceph clients), as on two hosts."""

    name = "thinblock-owners"

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.n = 0
        self.pids: list[int] = []  # the servers started, while they run

    @contextmanager
    def start(self, count: int) -> Iterator[list[str]]:
        self.n += 1
        locator = f"rados:{CEPH_POOL}/own{self.n}"
        tb("pool", "create", locator, "--size", "40G")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        procs, uris = [], []
        try:
            for v in range(count):
                tb("volume", "create", locator, f"v{v}", "--size", EXPORT)
                sock = str(self.scratch / f"own{self.n}-{v}.sock")
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "thinblock", "serve", locator, "--volume", f"v{v}", "--socket", sock],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                wait_for(sock, procs[-1])
                uris.append(f"nbd+unix:///v{v}?socket={sock}")
            self.pids = [proc.pid for proc in procs]
            yield uris
        finally:
            for proc in procs:
                _stop(proc)
            ThinblockRados.remove_all()


class QemuNbdImages:
    """qemu-nbd: an RBD image per export, each served by its own qemu-nbd."""

    name = "qemu-nbd-rbd-images"

    def __init__(self, scratch: Path) -> None:
        self.one = QemuNbdRbd(scratch)
        self.pids: list[int] = []

    @contextmanager
    def start(self, count: int) -> Iterator[list[str]]:
        with contextlib.ExitStack() as stack:
            uris = []
            self.pids = []
            for _ in range(count):
                uris.append(stack.enter_context(self.one.start())[0])
                self.pids.append(self.one.pid)
            yield uris


def cpu_seconds(pids: list[int]) -> float:
    """User and system CPU time of these processes and their descendants (those
    running now; a worker forked by a server counts with it)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stats[int(entry)] = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    total, todo = 0.0, list(pids)
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += (int(stats[pid][11]) + int(stats[pid][12])) / tick
            todo += children.get(pid, [])
    return total


def seq_write_with_cpu(uris: list[str], pids: list[int], size: str, prefix: str) -> dict[str, float]:
    """The sequential write, and the CPU it cost per GiB written: in the servers, and in
    the OSD (what a 2-core machine has to share between them)."""
    osd = [pid for name, pid in ceph_cluster.daemon_pids(OSD_DIR[0]).items() if name.startswith("osd")]
    before = cpu_seconds(pids), cpu_seconds(osd)
    res = fio_volumes(uris, "write", "1M", 16, size, None)
    after = cpu_seconds(pids), cpu_seconds(osd)
    gib = len(uris) * parse_size(size) / GiB
    return {
        f"{prefix}_seq_write_1M_qd16_MiBps": res["MiBps"],
        f"{prefix}_seq_write_server_cpu_s_per_GiB": (after[0] - before[0]) / gib,
        f"{prefix}_seq_write_osd_cpu_s_per_GiB": (after[1] - before[1]) / gib,
    }


OSD_DIR: list[str] = []  # the cluster's directory, once started


def owner_rows(peer: ThinblockOwners | QemuNbdImages, quick: bool) -> dict[str, float]:
    seq, runtime = ("256M", 3) if quick else ("2G", 10)
    r: dict[str, float] = {}
    with peer.start(2) as uris:
        r.update(seq_write_with_cpu(uris, peer.pids, seq, "two_volumes"))
        r["two_volumes_randwrite_4k_qd32_iops"] = fio_volumes(uris, "randwrite", "4k", 32, EXPORT, runtime)["iops"]
    with peer.start(1) as uris:
        r.update(seq_write_with_cpu(uris, peer.pids, seq, "one_volume"))
        r["one_volume_randwrite_4k_qd32_iops"] = fio_volumes(uris, "randwrite", "4k", 32, EXPORT, runtime)["iops"]
    return r


def mkfs_rows() -> dict[str, float]:
    """thinblock mkfs through attach on a RADOS pool (the command's own timing of mkfs)."""
    locator = f"rados:{CEPH_POOL}/mkfs"
    tb("pool", "create", locator, "--size", "20G")
    r: dict[str, float] = {}
    try:
        for fs in ("ext4", "xfs"):
            for size in ("10G", "100G"):
                name = f"{fs}{size}"
                tb("volume", "create", locator, name, "--size", size)
                start = time.perf_counter()
                out = json.loads(tb("mkfs", locator, name, "-t", fs, "--json"))
                r[f"mkfs_{fs}_{size}_s"] = out["seconds"]
                r[f"mkfs_{fs}_{size}_with_attach_s"] = time.perf_counter() - start
                r[f"mkfs_{fs}_{size}_pool_bytes"] = out["pool_bytes_used"]
    finally:
        # Any FUSE daemon mkfs left for this pool, by the pid attach recorded (never by a pattern).
        for attached in json.loads(tb("attach", "--list", "--json")):
            if attached["pool"] == locate(locator).key():
                stop_pid(int(attached["daemon_pid"]), "fuse-daemon")
        ThinblockRados.remove_all()
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp", help="scratch directory (the cluster's files go here)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each other one reverses the peer order")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument(
        "--owners",
        action="store_true",
        help="instead: servers per volume (a process per volume) against a qemu-nbd per RBD image, on two volumes and one",
    )
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="tb-rados-bench-", dir=args.dir))
    progress("starting a Ceph cluster")
    os.environ["CEPH_CONF"] = ceph_cluster.start(str(scratch / "ceph"), block_bytes=32 << 30)
    OSD_DIR.append(str(scratch / "ceph"))
    rounds: list[dict[str, dict[str, Any]]] = []
    try:
        ceph("osd", "pool", "create", CEPH_POOL, "32")
        ceph("osd", "pool", "set", CEPH_POOL, "size", "1", "--yes-i-really-mean-it")
        ceph("osd", "pool", "application", "enable", CEPH_POOL, "rbd")
        if args.owners:
            owners: list[ThinblockOwners | QemuNbdImages] = [ThinblockOwners(scratch), QemuNbdImages(scratch)]
            for n in range(args.rounds):
                pair: dict[str, dict[str, Any]] = {}
                for owner_peer in owners if n % 2 == 0 else owners[::-1]:
                    progress(f"round {n + 1}: {owner_peer.name}")
                    pair[owner_peer.name] = owner_rows(owner_peer, args.quick)
                rounds.append(
                    {"thinblock-rados": pair["thinblock-owners"], "qemu-nbd-rbd": pair["qemu-nbd-rbd-images"]}
                )
        peers: list[ThinblockRados | QemuNbdRbd] = [ThinblockRados(scratch), QemuNbdRbd(scratch)]
        for n in range(0 if args.owners else args.rounds):
            order = peers if n % 2 == 0 else peers[::-1]
            results: dict[str, dict[str, Any]] = {}
            for peer in order:
                progress(f"round {n + 1}: {peer.name}: fio")
                with peer.start() as (uri, _held):
                    r = io_rows(uri, args.quick)
                progress(f"round {n + 1}: {peer.name}: zeros")
                with peer.start() as (uri, held):
                    r.update(zeros(uri, held, args.quick))
                results[peer.name] = r
            progress(f"round {n + 1}: thinblock mkfs through attach")
            results["thinblock-rados"].update(mkfs_rows())
            rounds.append(results)
    finally:
        ceph_cluster.stop(str(scratch / "ceph"))
        shutil.rmtree(scratch, ignore_errors=True)
    report = []
    for results in rounds:
        tbr, other = results["thinblock-rados"], results["qemu-nbd-rbd"]
        ratios = {k: tbr[k] / other[k] for k in other if k.endswith(("MiBps", "iops")) and other[k]}
        ratios.update({k: other[k] / tbr[k] for k in other if k.endswith("_s") and tbr[k]})  # > 1: thinblock faster
        report.append({"results": results, "ratios_thinblock_to_qemu_nbd_rbd": ratios})
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for n, entry in enumerate(report, 1):
        print(f"round {n}")
        res = entry["results"]
        keys = sorted(set(res["thinblock-rados"]) | set(res["qemu-nbd-rbd"]))
        for key in keys:
            a, b = res["thinblock-rados"].get(key), res["qemu-nbd-rbd"].get(key)
            ratio = entry["ratios_thinblock_to_qemu_nbd_rbd"].get(key)
            fa = f"{a:,.2f}" if a is not None else "-"
            fb = f"{b:,.2f}" if b is not None else "-"
            print(
                f"  {key:42} thinblock {fa:>16}  qemu-nbd-rbd {fb:>16}  ratio {ratio:.2f}"
                if ratio
                else f"  {key:42} thinblock {fa:>16}  qemu-nbd-rbd {fb:>16}"
            )


if __name__ == "__main__":
    main()
