"""NBD over TLS: thinblock serve vs nbdkit file, same run, same certificate.

    .venv/bin/python bench/bench_tls.py [--size 256M] [--rounds 2] [--json]

A volume (and, for nbdkit, a raw file) full of random bytes is read whole by
nbdcopy over TLS on TCP (127.0.0.1), with one connection and with four. Each
round runs both peers, alternating which goes first; every figure is reported,
with the ratio thinblock / nbdkit of the throughputs (higher is better).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_nbd import _stop, free_port, make_bench_pool, progress, wait_for
from thinblock.sizes import format_size, parse_size


def _certs(d: Path) -> None:
    """A self-signed server certificate for localhost, laid out as nbdkit and libnbd want."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-keyout", str(d / "server-key.pem"), "-out", str(d / "server-cert.pem"),
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    shutil.copy(d / "server-cert.pem", d / "ca-cert.pem")


@contextmanager
def _thinblock(scratch: Path, image: Path, certs: Path) -> Iterator[str]:
    pool = scratch / "tb-pool"
    shutil.rmtree(pool, ignore_errors=True)
    tb, env = make_bench_pool(pool)
    subprocess.run([*tb, "volume", "remove", str(pool), "disk"], check=True, env=env, capture_output=True)
    subprocess.run([*tb, "import", str(image), str(pool), "disk", "--no-progress"], check=True, env=env)
    port = free_port()
    tls = ["--tls-cert", str(certs / "server-cert.pem"), "--tls-key", str(certs / "server-key.pem")]
    proc = subprocess.Popen(
        [*tb, "serve", str(pool), "--listen", f"127.0.0.1:{port}", *tls],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(port, proc)
        yield f"nbds://localhost:{port}/disk?tls-certificates={certs}"
    finally:
        _stop(proc)
        shutil.rmtree(pool, ignore_errors=True)


@contextmanager
def _nbdkit(image: Path, certs: Path) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        ["nbdkit", "-f", "-p", str(port), "-i", "127.0.0.1", "--tls=require", f"--tls-certificates={certs}",
         "file", str(image)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for(port, proc)
        yield f"nbds://localhost:{port}/?tls-certificates={certs}"
    finally:
        _stop(proc)


def _read_all(uri: str, connections: int) -> float:
    start = time.monotonic()
    subprocess.run(["nbdcopy", f"--connections={connections}", uri, "null:"], check=True)
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp", help="scratch directory")
    parser.add_argument("--size", type=parse_size, default=parse_size("256M"), help="bytes read per run (256M)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, alternating which peer goes first (2)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    results: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        scratch = Path(tmp)
        certs = scratch / "pki"
        certs.mkdir()
        _certs(certs)
        image = scratch / "image.raw"
        with open(image, "wb") as f, open("/dev/urandom", "rb") as rnd:
            for _ in range(args.size // (1 << 20)):
                f.write(rnd.read(1 << 20))
        peers = {"thinblock": lambda: _thinblock(scratch, image, certs), "nbdkit": lambda: _nbdkit(image, certs)}
        for round_no in range(args.rounds):
            order = list(peers) if round_no % 2 == 0 else list(reversed(peers))
            row: dict[str, object] = {"round": round_no + 1, "order": order}
            for name in order:
                progress(f"round {round_no + 1}: {name}")
                with peers[name]() as uri:
                    for connections in (1, 4):
                        seconds = _read_all(uri, connections)
                        row[f"{name}_{connections}conn_MiBps"] = round(args.size / seconds / (1 << 20), 1)
            for connections in (1, 4):
                tb, kit = row[f"thinblock_{connections}conn_MiBps"], row[f"nbdkit_{connections}conn_MiBps"]
                assert isinstance(tb, float) and isinstance(kit, float)
                row[f"ratio_{connections}conn"] = round(tb / kit, 2)
            results.append(row)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"nbdcopy read of {format_size(args.size)} over TLS (TCP, 127.0.0.1), MiB/s")
    for row in results:
        cells = ", ".join(
            f"{c} conn: thinblock {row[f'thinblock_{c}conn_MiBps']}, nbdkit {row[f'nbdkit_{c}conn_MiBps']}"
            f" ({row[f'ratio_{c}conn']}x)"
            for c in (1, 4)
        )
        print(f"round {row['round']} ({' first, '.join(row['order'])} second): {cells}")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
