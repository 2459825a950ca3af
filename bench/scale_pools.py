"""Pools with many exports, made fast, and the time an NBD listing of them takes.

    .venv/bin/python bench/scale_pools.py [--counts 1000,10000,100000] [--runs 3] [--json]

`make_many_exports(pool_dir, n)` creates a pool at pool_dir holding n exports:
ceil(n/2) empty volumes v000000, v000001, ... and one snapshot of each of the
first n//2 of them (v000000@s, ...), in one metadata commit through the Pool API
(a pool opened without autocommit, every row added under the pool lock, then one
commit): 100,000 exports take seconds, not the hours the CLI would. The snapshots
share their volume's (empty) contents and name it as their origin, as
`thinblock snapshot create` makes them.

The main program times NBD_OPT_LIST (greeting to the last reply, a raw client on
the unix socket) and `nbdinfo --list` against `thinblock serve` on such pools.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, BinaryIO

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from thinblock.core.pool import Pool  # noqa: E402
from thinblock.core.snapshot import share_into  # noqa: E402
from thinblock.sizes import parse_size  # noqa: E402

VOLUME_BYTES = 1 << 30
IHAVEOPT = 0x49484156454F5054
OPT_ABORT, OPT_LIST = 2, 3
REP_ACK, REP_SERVER = 1, 2
FIXED_NEWSTYLE_NO_ZEROES = 3


def export_names(n: int) -> tuple[list[str], list[str]]:
    """(volume names, snapshot names) make_many_exports(pool_dir, n) creates."""
    volumes = [f"v{i:06d}" for i in range((n + 1) // 2)]
    return volumes, [f"{v}@s" for v in volumes[: n // 2]]


def make_many_exports(pool_dir: str | Path, n: int, *, pool_size: str | int = 1 << 30) -> list[str]:
    """A new pool at pool_dir with n exports (volumes and snapshots of them, see the
    module docstring), in one commit; returns the export names, sorted."""
    size = pool_size if isinstance(pool_size, int) else parse_size(pool_size)
    Pool.create(str(pool_dir), size).close()
    volumes, snapshots = export_names(n)
    pool = Pool.open(str(pool_dir), autocommit=False, purpose="make_many_exports")
    try:
        with pool.lock:
            made = {name: pool.add_volume(name, VOLUME_BYTES, "on") for name in volumes}
            for snap in snapshots:
                share_into(pool, made[snap.removesuffix("@s")], snap, "snapshot")  # as snapshot create does
        pool.commit()
    finally:
        pool.close()
    return sorted(volumes + snapshots)


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) < n:
        raise ConnectionError("server closed the connection")
    return data


def opt_list(socket_path: str, timeout_s: float = 600) -> tuple[float, list[tuple[str, str]]]:
    """(seconds from the option sent to the ACK received, [(name, description)]) of
    one NBD_OPT_LIST over the unix socket."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout_s)
        sock.connect(socket_path)
        stream = sock.makefile("rb")
        _read_exact(stream, 18)  # NBDMAGIC, IHAVEOPT, handshake flags
        sock.sendall(struct.pack(">I", FIXED_NEWSTYLE_NO_ZEROES))
        start = time.perf_counter()
        sock.sendall(struct.pack(">QII", IHAVEOPT, OPT_LIST, 0))
        exports: list[tuple[str, str]] = []
        while True:
            _magic, _option, reply, length = struct.unpack(">QIII", _read_exact(stream, 20))
            payload = _read_exact(stream, length) if length else b""
            if reply == REP_ACK:
                break
            if reply != REP_SERVER:
                raise RuntimeError(f"NBD_OPT_LIST answered with reply type {reply:#x}: {payload!r}")
            (name_len,) = struct.unpack_from(">I", payload)
            exports.append((payload[4 : 4 + name_len].decode(), payload[4 + name_len :].decode()))
        elapsed = time.perf_counter() - start
        with contextlib.suppress(OSError):  # a server past its handshake limit has hung up
            sock.sendall(struct.pack(">QII", IHAVEOPT, OPT_ABORT, 0))
        stream.close()
    return elapsed, exports


def nbdinfo_list(socket_path: str) -> tuple[float, bool]:
    """(seconds, succeeded) of `nbdinfo --list` on the unix socket."""
    start = time.perf_counter()
    done = subprocess.run(
        ["nbdinfo", "--list", f"nbd+unix://?socket={socket_path}"], capture_output=True, text=True, check=False
    )
    return time.perf_counter() - start, done.returncode == 0


class Served:
    """`thinblock serve POOL` on a private socket until closed."""

    def __init__(self, pool_dir: Path) -> None:
        self.socket = str(pool_dir / "list.sock")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "serve", str(pool_dir), "--socket", self.socket],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("ready"):
                return
        raise RuntimeError("thinblock serve exited before it was ready")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1000,10000,100000", help="export counts, comma-separated")
    parser.add_argument("--runs", type=int, default=3, help="listings per count (the median is reported)")
    parser.add_argument("--no-nbdinfo", action="store_true", help="time the raw NBD_OPT_LIST only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for n in (int(x) for x in args.counts.split(",")):
        with tempfile.TemporaryDirectory(prefix="tb-scale-") as scratch:
            pool_dir = Path(scratch) / "pool"
            start = time.perf_counter()
            make_many_exports(pool_dir, n)
            made_s = time.perf_counter() - start
            progress(f"{n} exports made in {made_s:.1f} s")
            served = Served(pool_dir)
            try:
                lists = []
                for _ in range(args.runs):
                    seconds, exports = opt_list(served.socket)
                    assert len(exports) == n, (len(exports), n)
                    lists.append(seconds)
                row: dict[str, Any] = {"make_s": made_s, "opt_list_s": sorted(lists)[len(lists) // 2]}
                if not args.no_nbdinfo:
                    infos = [nbdinfo_list(served.socket) for _ in range(args.runs)]
                    row["nbdinfo_list_s"] = sorted(s for s, _ in infos)[len(infos) // 2]
                    row["nbdinfo_ok"] = all(ok for _, ok in infos)
            finally:
                served.close()
        results[str(n)] = row
        progress(f"{n}: {row}")
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'exports':>8} {'NBD_OPT_LIST':>13} {'nbdinfo --list':>15}")
    for count, row in results.items():
        info = "-"
        if "nbdinfo_list_s" in row:
            info = f"{row['nbdinfo_list_s']:.3f} s" + ("" if row["nbdinfo_ok"] else " (failed)")
        print(f"{count:>8} {row['opt_list_s']:>11.3f} s {info:>15}")


if __name__ == "__main__":
    main()
