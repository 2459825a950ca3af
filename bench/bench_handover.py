"""The handover gap (issue 22): `serve POOL --volume v --takeover` with a client writing.

    .venv/bin/python bench/bench_handover.py [--runs N] [--json]

One server owns volumes v and w of a directory pool; a libnbd client writes
4 KiB to v in a loop (each write acknowledged before the next), another client
writes to w. Then `thinblock serve POOL --volume v --takeover` starts. The v
client, once its connection is closed, connects again to the new server's socket
every 5 ms (what a retrying client does). Measured from the moment the takeover
command starts:

- handover: what the taker's log says the owner took (hang up, commit, grants
  back, lease released);
- gap: until the v client's first acknowledged write on the new server;
- w's writes during it: they go on, on the old server, never failing.

Afterwards every acknowledged write to v is read back from the new server.
Each run is one handover; two runs by default (there is no peer: the figure is
absolute, against the issue's target of 2 s).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import nbd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_nbd import _stop, progress, wait_for

KiB = 1 << 10


def _connect(sock: str, name: str) -> nbd.NBD:
    h = nbd.NBD()
    h.connect_uri(f"nbd+unix:///{name}?socket={sock}")
    return h


def one_run(work: Path, tb: list[str], env: dict[str, str]) -> dict[str, Any]:
    pool = work / "pool"
    subprocess.run([*tb, "pool", "create", str(pool), "--size", "2G"], check=True, env=env, capture_output=True)
    for name in ("v", "w"):
        subprocess.run(
            [*tb, "volume", "create", str(pool), name, "--size", "1G"], check=True, env=env, capture_output=True
        )
    old_sock, new_sock = str(work / "old.sock"), str(work / "new.sock")
    old_log, new_log = open(work / "old.log", "wb"), open(work / "new.log", "wb")  # noqa: SIM115
    old = subprocess.Popen(
        [*tb, "serve", str(pool), "--volume", "v", "--volume", "w", "--workers", "1", "--socket", old_sock],
        env=env,
        stdout=old_log,
        stderr=subprocess.STDOUT,
    )
    new: subprocess.Popen[bytes] | None = None
    try:
        wait_for(old_sock, old)
        acked: dict[int, bytes] = {}
        stop = threading.Event()
        w_errors: list[str] = []
        w_writes = [0]
        first_new = [0.0]

        def write_v() -> None:
            h = _connect(old_sock, "v")
            n = 0
            sock = old_sock
            while not stop.is_set():
                data = n.to_bytes(8, "little") * 512
                try:
                    h.pwrite(data, (n % 4096) * 4 * KiB)
                except nbd.Error:
                    while not stop.is_set():  # the old server hung up: connect to the new one
                        try:
                            h = _connect(new_sock, "v")
                            sock = new_sock
                            break
                        except nbd.Error:
                            time.sleep(0.005)
                    continue
                if sock == new_sock and not first_new[0]:
                    first_new[0] = time.monotonic()
                acked[(n % 4096) * 4 * KiB] = data
                n += 1
            h.flush()
            h.shutdown()

        def write_w() -> None:
            h = _connect(old_sock, "w")
            n = 0
            while not stop.is_set():
                try:
                    h.pwrite(b"w" * 4096, (n % 4096) * 4 * KiB)
                    w_writes[0] += 1
                except nbd.Error as exc:
                    w_errors.append(str(exc))
                n += 1
            h.shutdown()

        threads = [threading.Thread(target=write_v), threading.Thread(target=write_w)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        started = time.monotonic()
        new = subprocess.Popen(
            [*tb, "serve", str(pool), "--volume", "v", "--takeover", "--socket", new_sock],
            env=env,
            stdout=new_log,
            stderr=subprocess.STDOUT,
        )
        while not first_new[0] and new.poll() is None and time.monotonic() - started < 30:
            time.sleep(0.005)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join()
        if not first_new[0]:
            raise RuntimeError(f"the client never reached the new server: {(work / 'new.log').read_text()}")
        log = (work / "new.log").read_text()
        found = re.search(r"handed over in ([0-9.]+) s", log)
        h = _connect(new_sock, "v")
        lost = sum(1 for off, data in acked.items() if h.pread(len(data), off) != data)
        h.shutdown()
        return {
            "handover_s": float(found.group(1)) if found else None,
            "gap_s": first_new[0] - started,
            "acked_writes_to_v": len(acked),  # distinct 4 KiB blocks, each read back
            "acked_writes_lost": lost,
            "writes_to_w": w_writes[0],
            "w_errors": len(w_errors),
        }
    finally:
        for proc in (new, old):
            if proc is not None:
                _stop(proc)
        old_log.close()
        new_log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tb = [sys.executable, "-m", "thinblock"]
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src"), "PATH": "/usr/bin:/bin"}
    results = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="thinblock-handover-") as tmp:
            progress(f"run {run + 1}")
            results.append(one_run(Path(tmp), tb, env))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for i, r in enumerate(results, 1):
        print(
            f"run {i}: handover {r['handover_s']:.3f} s, gap to the first write on the new server {r['gap_s']:.3f} s;"
            f" {r['acked_writes_to_v']} blocks of v acknowledged, {r['acked_writes_lost']} lost;"
            f" {r['writes_to_w']} writes to w meanwhile, {r['w_errors']} failed"
        )


if __name__ == "__main__":
    main()
