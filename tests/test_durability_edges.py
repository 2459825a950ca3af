"""Edges of the durability rules found in review, each in a real process that dies
where a power cut or a careless library caller would leave it:

- a dblock whose last sharer went in the open transaction is still shared on disk
  until that commit is durable, so its new sole owner copies it on write (rule 4);
- a pool closed with a write still in flight is left unclean, so the write's
  fresh block (committed as free) is punched before anyone else gets it;
- a grow cut between its new tail and its clearing of the old one leaves the old
  tail's bytes in no block that is handed out;
- a device pool cannot grow into the owner tail at the device's end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.cli import thinblock

BS = 64 << 10


def _run(code: str, *args: str, died: bool = False) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=120
    )
    if died:
        assert proc.returncode == 0 and not proc.stderr, proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_newly_exclusive_block_is_not_written_in_place_before_its_commit(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    _run(
        """
        import os, sys
        from thinblock import Pool
        from thinblock.core.snapshot import create_snapshot
        BS = 64 << 10
        pool = Pool.create(sys.argv[1], 16 * BS)
        a = pool.create_volume("a", 4 * BS)
        a.write(0, b"a" * BS)
        pool.commit()
        create_snapshot(pool, "a", "s")
        commit = pool.commit
        pool.commit = lambda: None      # a writer gets in before the removal's commit
        pool.remove_volume("s")
        a.write(0, b"Z" * 512)          # s's last reference went in the open transaction
        def cut(txn):
            os._exit(0)                 # power cut: the data sync ran, the metadata commit did not
        pool.meta.commit = cut
        commit()
        """,
        pool,
        died=True,
    )
    out = _run(
        """
        import sys
        from thinblock import Pool
        with Pool.open(sys.argv[1]) as pool:
            print(pool.volume("s").read(0, 512).hex())
        """,
        pool,
    )
    assert bytes.fromhex(out.strip()) == b"a" * 512, "the snapshot shows a write its volume made after removing it"


def test_closing_with_a_write_in_flight_leaves_no_block_for_another_volume(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    _run(
        """
        import sys, threading
        from thinblock import Pool
        BS = 64 << 10
        pool = Pool.create(sys.argv[1], 64 * BS)
        a = pool.create_volume("a", 16 * BS)
        pool.commit()
        store, entered, go = pool.store, threading.Event(), threading.Event()
        pwritev = store.pwritev
        def held(offset, buffers):
            pwritev(offset, buffers)    # the bytes reach the data file...
            if offset < 64 * BS:
                entered.set()
                go.wait(30)             # ...and the write is not published yet
        store.pwritev = held
        t = threading.Thread(target=lambda: a.write(0, b"X" * BS))
        t.start()
        assert entered.wait(30)
        pool.close()                    # the final commit records the fresh block as free
        go.set()
        t.join()
        """,
        pool,
    )
    out = _run(
        """
        import sys
        from thinblock import Pool
        BS = 64 << 10
        with Pool.open(sys.argv[1]) as pool:
            b = pool.create_volume("b", 16 * BS)
            b.write(0, b"y" * 512)
            print(b.read(512, BS - 512).count(b"X"))
        """,
        pool,
    )
    assert out.strip() == "0", "a new volume's block shows the bytes of a write in flight at close"


def test_a_grow_cut_before_clearing_the_old_tail_leaves_no_stale_bytes(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    _run(
        """
        import os, sys
        from thinblock import Pool
        from thinblock.store.owned import OwnedStore
        BS = 64 << 10
        pool = Pool.create(sys.argv[1], 4 * BS)
        v = pool.create_volume("v", 64 * BS)
        for i in range(4):
            v.write(i * BS, bytes([65 + i]) * BS)
        pool.commit()
        def cut(self, offset, length):
            os._exit(0)                 # the new tail is durable; the old one is not cleared
        OwnedStore._clear = cut
        pool.grow(8 * BS)
        """,
        pool,
        died=True,
    )
    out = _run(
        """
        import sys
        from thinblock import Pool
        BS = 64 << 10
        with Pool.open(sys.argv[1]) as pool:
            pool.grow(8 * BS)
            w = pool.create_volume("w", 8 * BS)
            for i in range(4):
                w.write(i * BS, b"w" * 512)
            print(sum(w.read(i * BS + 512, BS - 512).count(0) for i in range(4)))
        """,
        pool,
    )
    assert int(out) == 4 * (BS - 512), "a fresh block holds the old owner tail's bytes"
    thinblock("pool", "check", pool)


def test_a_device_pool_cannot_grow_into_its_owner_tail(tmp_path: Path, loop_file: tuple[str, Path]) -> None:
    dev, _ = loop_file
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--data", dev, "--block-size", "4K")
    size = json.loads(thinblock("pool", "status", pool, "--json").stdout)["size_bytes"]
    proc = thinblock("pool", "grow", pool, "--size", str(size + 4096), check=False)
    assert proc.returncode == 1 and "owner header" in proc.stderr, proc.stderr
    thinblock("pool", "check", pool)
    thinblock("volume", "list", pool)
