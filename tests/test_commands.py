"""The everyday commands lvm2 and rbd have, as real `thinblock` processes: volume and
snapshot rename, pool remove, detach POOL VOLUME, the --help examples, the man page
and shell completion."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli import thinblock
from tests.nbd_server import Server, connect
from thinblock import Pool

DEADLINE_S = 30


def tb(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    return thinblock(*args, check=ok)


def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for condition (generously); fail naming what never happened."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def listing(pool: str) -> dict[str, dict[str, object]]:
    return {v["name"]: v for v in json.loads(tb("volume", "list", pool, "--json").stdout)}


@pytest.fixture
def pool_dir(tmp_path: Path) -> str:
    path = str(tmp_path / "pool")
    tb("pool", "create", path, "--size", "64M")
    return path


# ----- rename ------------------------------------------------------------------------


def test_rename_keeps_contents_settings_and_lineage(pool_dir: str) -> None:
    tb("volume", "create", pool_dir, "vm", "--size", "4M", "--detect-zeroes", "unmap")
    with Pool.open(pool_dir) as pool:
        pool.volume("vm").write(0, b"first" * 1000)
    tb("snapshot", "create", pool_dir, "vm", "s1")
    tb("volume", "clone", pool_dir, "s1", "c1")
    done = tb("volume", "rename", pool_dir, "vm", "web")
    assert done.stdout.strip() == "renamed volume vm to web"
    out = json.loads(tb("snapshot", "rename", pool_dir, "s1", "web@monday", "--json").stdout)
    assert out == {"kind": "snapshot", "old_name": "s1", "name": "web@monday"}
    vols = listing(pool_dir)
    assert sorted(vols) == ["c1", "web", "web@monday"]
    assert vols["web"]["detect_zeroes"] == "unmap" and vols["web"]["data_bytes"] == 64 << 10
    assert vols["web@monday"]["origin"] == "web" and vols["c1"]["origin"] == "web@monday"
    # Lineage goes on under the new names: a snapshot of the renamed volume, a clone
    # of the renamed snapshot, and the old name is free for a new volume.
    tb("snapshot", "create", pool_dir, "web", "s2")
    tb("volume", "clone", pool_dir, "web@monday", "c2")
    tb("volume", "create", pool_dir, "vm", "--size", "1M")
    vols = listing(pool_dir)
    assert vols["s2"]["origin"] == "web" and vols["c2"]["origin"] == "web@monday" and vols["vm"]["data_bytes"] == 0
    with Pool.open(pool_dir) as pool:
        assert pool.volume("c2").read(0, 5000) == b"first" * 1000
    tb("pool", "check", pool_dir)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["volume", "rename", "{pool}", "vm", "bad name"], "invalid volume name 'bad name'"),
        (["volume", "rename", "{pool}", "vm", "vm@s"], "invalid volume name 'vm@s'"),
        (["volume", "rename", "{pool}", "vm", "+x"], "invalid volume name '+x'"),
        (["volume", "rename", "{pool}", "vm", "snap"], "a volume or snapshot named 'snap' already exists"),
        (["volume", "rename", "{pool}", "vm", "vm"], "volume vm is already called vm"),
        (["volume", "rename", "{pool}", "missing", "x"], "no volume 'missing' in pool"),
        (["volume", "rename", "{pool}", "snap", "x"], "'snap' is a snapshot, not a volume"),
        (["snapshot", "rename", "{pool}", "vm", "x"], "'vm' is a volume, not a snapshot"),
        # Too long: the control schema's sentence (its wording is the messages slice's).
        (["snapshot", "rename", "{pool}", "snap", "x" * 129], "128"),
    ],
)
def test_rename_refusals_change_nothing(pool_dir: str, args: list[str], message: str) -> None:
    tb("volume", "create", pool_dir, "vm", "--size", "1M")
    tb("snapshot", "create", pool_dir, "vm", "snap")
    before = listing(pool_dir)
    proc = tb(*[a.replace("{pool}", pool_dir) for a in args], ok=False)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1  # one sentence
    assert listing(pool_dir) == before


def _exports(server: Server) -> list[str]:
    out = subprocess.run(
        ["nbdinfo", "--list", "--json", f"nbd+unix:///?socket={server.socket}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return sorted(e["export-name"] for e in json.loads(out)["exports"])


def test_rename_through_a_server_moves_the_export_and_waits_for_clients(pool_dir: str, tmp_path: Path) -> None:
    tb("volume", "create", pool_dir, "vm", "--size", "1M")
    tb("snapshot", "create", pool_dir, "vm", "s1")
    server = Server(pool_dir, workdir=tmp_path)
    try:
        assert _exports(server) == ["s1", "vm"]
        h = connect(server, "vm")
        h.pwrite(b"kept" * 1024, 0)
        h.flush()
        busy = tb("volume", "rename", pool_dir, "vm", "web", ok=False)
        assert busy.returncode == 1
        assert busy.stderr == (
            "thinblock: error: cannot rename volume vm: it is open by 1 client(s)"
            " (NBD connections or an attached loop device)\n"
        )
        assert _exports(server) == ["s1", "vm"]
        h.shutdown()
        until(lambda: listing(pool_dir)["vm"]["open_clients"] == 0, "the NBD client to go")
        tb("volume", "rename", pool_dir, "vm", "web")
        tb("snapshot", "rename", pool_dir, "s1", "web@s1")
        assert _exports(server) == ["web", "web@s1"]  # at once, no restart
        h = connect(server, "web")
        assert h.pread(4, 0) == b"kept"
        h.shutdown()
        refused = subprocess.run(
            ["nbdinfo", "--size", f"nbd+unix:///vm?socket={server.socket}"], capture_output=True, text=True
        )
        assert refused.returncode != 0
    finally:
        server.stop()
    # Committed before the command returned: the stopped server's pool says the same.
    assert sorted(listing(pool_dir)) == ["web", "web@s1"]
    tb("pool", "check", pool_dir)


def test_rename_on_a_rados_pool(request: pytest.FixtureRequest) -> None:
    from tests.conftest import new_rados_locator

    pool = new_rados_locator(request, "rename")
    tb("pool", "create", pool, "--size", "16M")
    tb("volume", "create", pool, "vm", "--size", "1M")
    tb("snapshot", "create", pool, "vm", "s1")
    tb("volume", "rename", pool, "vm", "web")
    tb("snapshot", "rename", pool, "s1", "web@s1")
    vols = listing(pool)
    assert sorted(vols) == ["web", "web@s1"] and vols["web@s1"]["origin"] == "web"
    tb("pool", "check", pool)
