"""Metadata bytes per mapped block: thinblock's page encodings vs qcow2, same run.

    .venv/bin/python bench/bench_pages.py [--counts 10000,100000] [--rados] [--json]

For each count N and each layout, N blocks of 4 KiB are written through the
Pool API into a pool of 4 KiB blocks:
- dense: blocks 0..N-1, one after the other (each mapping page is one run);
- spread: one block per 512-block stretch (block 512k), as a filesystem
  scatters its metadata (each mapping page maps one block).
Rows:
- thinblock, SQLite: the metadata database's bytes after the pool is closed (its
  WAL folded in) divided by N; once with the pages in their smallest encoding
  (today) and once with every page stored dense (4096 bytes, the only form
  before);
- thinblock, RADOS omap (--rados, with CEPH_CONF set): the key and
  value bytes of the metadata object's omap divided by N;
- qcow2 with 4 KiB clusters: a sparse raw file written the same way, converted
  by `qemu-img convert -O qcow2 -o cluster_size=4096` (it skips holes, so it maps
  exactly the written clusters); its file size less the N data clusters, over N.
Figures are bytes and ratios, never pass/fail.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # tests/, for the RADOS clean-up

from thinblock import Pool
from thinblock.core import mapping
from thinblock.meta.sqlite import DB_NAME

BLOCK = 4096
STRIDE = 512  # one mapping page's worth of blocks


def progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


def offsets(layout: str, count: int) -> list[int]:
    step = STRIDE if layout == "spread" else 1
    return [i * step * BLOCK for i in range(count)]


@contextlib.contextmanager
def dense_pages_only() -> Iterator[None]:
    """Every page stored in its 4096-byte dense form, as before the compact encodings."""
    saved = mapping.Page.to_blob
    mapping.Page.to_blob = lambda self: self.entries.tobytes()  # type: ignore[method-assign]
    try:
        yield
    finally:
        mapping.Page.to_blob = saved  # type: ignore[method-assign]


def fill(locator: str, layout: str, count: int) -> None:
    """A pool at locator with `count` blocks written in `layout`, committed and closed."""
    where = offsets(layout, count)
    size = where[-1] + BLOCK
    pool = Pool.create(locator, count * BLOCK + (64 << 20), block_size=BLOCK)
    try:
        vol = pool.create_volume("v", size)
        payload = b"\x5a" * BLOCK
        for n, off in enumerate(where, 1):
            vol.write(off, payload)
            if n % 20000 == 0:
                pool.commit()
    finally:
        pool.close()


def sqlite_bytes(scratch: Path, layout: str, count: int, *, dense: bool) -> int:
    path = scratch / f"tb-{layout}-{count}-{'dense' if dense else 'compact'}"
    with dense_pages_only() if dense else contextlib.nullcontext():
        fill(str(path), layout, count)
    size = (path / DB_NAME).stat().st_size
    wal = path / (DB_NAME + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0, "the WAL was not folded in at close"
    shutil.rmtree(path)
    return size


def rados_bytes(layout: str, count: int) -> int:
    from tests.conftest import remove_rados_pool

    from thinblock.backends import locate
    from thinblock.backends.rados import RadosLocation
    from thinblock.meta.rados import RadosMetadata

    locator = f"rados:{os.environ.get('THINBLOCK_TEST_CEPH_POOL', 'thinblock-test')}/bench-pages-{uuid.uuid4().hex[:8]}"
    try:
        fill(locator, layout, count)
        location = locate(locator)
        assert isinstance(location, RadosLocation)
        meta = location.open_meta(readonly=True)
        assert isinstance(meta, RadosMetadata)
        return sum(len(k) + len(v) for k, v in meta.items(""))
    finally:
        remove_rados_pool(locator)


def qcow2_bytes(scratch: Path, layout: str, count: int) -> int:
    raw, qcow = scratch / "peer.raw", scratch / "peer.qcow2"
    where = offsets(layout, count)
    with open(raw, "wb") as f:
        f.truncate(where[-1] + BLOCK)
        for off in where:
            os.pwrite(f.fileno(), b"\x5a" * BLOCK, off)
    subprocess.run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", "-o", "cluster_size=4096", str(raw), str(qcow)],
        check=True,
        capture_output=True,
    )
    meta = qcow.stat().st_size - count * BLOCK
    raw.unlink()
    qcow.unlink()
    return meta


def measure(scratch: Path, counts: list[int], rados: bool) -> list[dict[str, Any]]:
    rows = []
    for count in counts:
        for layout in ("dense", "spread"):
            progress(f"{count} blocks, {layout}")
            row: dict[str, Any] = {"blocks": count, "layout": layout}
            steps: list[tuple[str, Callable[[], int]]] = [
                ("sqlite", functools.partial(sqlite_bytes, scratch, layout, count, dense=False)),
                ("sqlite_dense_pages", functools.partial(sqlite_bytes, scratch, layout, count, dense=True)),
                ("qcow2", functools.partial(qcow2_bytes, scratch, layout, count)),
            ]
            if rados:
                steps.append(("rados_omap", functools.partial(rados_bytes, layout, count)))
            for name, step in steps:
                row[name] = round(step() / count, 2)
            rows.append(row)
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    cols = [c for c in ("sqlite", "sqlite_dense_pages", "rados_omap", "qcow2") if c in rows[0]]
    print(f"{'blocks':>8} {'layout':<7} " + " ".join(f"{c:>19}" for c in cols) + "  (bytes per mapped block)")
    for row in rows:
        print(f"{row['blocks']:>8} {row['layout']:<7} " + " ".join(f"{row[c]:>19}" for c in cols))
    print("ratios: thinblock SQLite / qcow2 4K, thinblock SQLite / the same pool with dense pages")
    for row in rows:
        print(
            f"{row['blocks']:>8} {row['layout']:<7} {row['sqlite'] / row['qcow2']:8.3f}"
            f" {row['sqlite'] / row['sqlite_dense_pages']:8.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="10000,100000", help="mapped blocks, comma-separated")
    parser.add_argument("--rados", action="store_true", help="also the RADOS omap (needs CEPH_CONF)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /var/tmp)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="tb-bench-pages-", dir=args.dir or "/var/tmp"))
    try:
        rows = measure(scratch, [int(c) for c in args.counts.split(",")], args.rados)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        report(rows)


if __name__ == "__main__":
    main()
