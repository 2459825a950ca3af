"""Real NBD clients (nbdinfo, qemu-img, qemu-io, nbdcopy, fio) against a real `thinblock serve`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import new_rados_locator
from tests.nbd_server import Server, served_pool, thinblock

MiB = 1 << 20
GiB = 1 << 30


def run(*cmd: str, timeout: float = 600) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[0]} failed: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


def status(pool: str) -> dict[str, Any]:
    return json.loads(thinblock("pool", "status", pool, "--json").stdout)


def volume_status(pool: str, name: str) -> dict[str, Any]:
    return dict(json.loads(thinblock("volume", "info", pool, name, "--json").stdout))


@pytest.fixture(params=["directory", "rados"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    locator = new_rados_locator(request, "nbd") if request.param == "rados" else None
    with served_pool(
        tmp_path, "20G", {"disk": "1G", "big": "16G"}, "--listen", "0", "--insecure", locator=locator
    ) as server:
        yield server


def test_nbdinfo_list_and_json(served: Server) -> None:
    listing = run("nbdinfo", "--list", "--json", served.unix_uri(""))
    exports = {e["export-name"]: e for e in json.loads(listing)["exports"]}
    assert set(exports) == {"disk", "big"}
    disk = exports["disk"]
    assert disk["export-size"] == GiB
    for flag in (
        "can_flush",
        "can_fua",
        "can_trim",
        "can_zero",
        "can_fast_zero",
        "can_multi_conn",
        "can_cache",
        "can_df",
    ):
        assert disk[flag] is True, flag
    assert disk["is_read_only"] is False
    assert "base:allocation" in disk["contexts"]
    assert disk["block_size_maximum"] == 64 * MiB
    one = json.loads(run("nbdinfo", "--json", served.tcp_uri("disk")))
    assert one["exports"][0]["export-size"] == GiB


def test_qemu_io_and_map(served: Server) -> None:
    uri = served.unix_uri("disk")
    run(
        "qemu-io", "-f", "raw",
        "-c", "write -P 0xab 0 1M",
        "-c", "write -z 2M 1M",        # NO_HOLE: reserved zeros
        "-c", "write -z -u 4M 1M",     # may unmap
        "-c", "write -P 0 6M 1M",      # zero payload to unmapped space: elided
        "-c", "discard 0 64k",
        "-c", "read -P 0 0 64k",
        "-c", "read -P 0xab 64k 960k",
        "-c", "read -P 0 1M 7M",
        uri,
    )  # fmt: skip
    # qemu-io's map reports the raw format layer (all allocated); holes show in nbdinfo/qemu-img map.
    assert "1 GiB (0x40000000) bytes" in run("qemu-io", "-f", "raw", "-c", "map", uri)
    extents = json.loads(run("nbdinfo", "--map", "--json", uri))
    by_offset = {e["offset"]: (e["length"], e["type"]) for e in extents}
    assert by_offset[0] == (64 << 10, 3)  # hole,zero
    assert by_offset[64 << 10] == (960 << 10, 0)  # data
    assert by_offset[1 * MiB] == (1 * MiB, 3)
    assert by_offset[2 * MiB] == (1 * MiB, 2)  # zero, allocated
    assert by_offset[3 * MiB][1] == 3  # the rest, including the zero write, is a hole
    time.sleep(1.5)  # status reads the last commit (at most a second old)
    vol = volume_status(served.pool, "disk")
    assert vol["data_bytes"] == 960 << 10 and vol["zeroed_bytes"] == MiB
    qmap = json.loads(run("qemu-img", "map", "--output=json", "-f", "raw", uri))
    assert any(e["data"] and not e["zero"] for e in qmap)


def test_qemu_img_convert_sparse_16g(served: Server, tmp_path: Path) -> None:
    """16 GiB sparse raw image with 1 GiB of scattered data: copied, identical, ~1 GiB used."""
    src = tmp_path / "src.raw"
    rng = random.Random(7)
    with open(src, "wb") as f:
        f.truncate(16 * GiB)
        chunk = os.urandom(4 * MiB)
        for slot in rng.sample(range(16 * GiB // (4 * MiB)), 256):  # 256 x 4 MiB = 1 GiB
            f.seek(slot * 4 * MiB)
            f.write(chunk)
    uri = served.unix_uri("big")
    run("qemu-img", "convert", "-n", "-f", "raw", "-O", "raw", "-W", str(src), uri)
    run("qemu-img", "compare", "-f", "raw", "-F", "raw", str(src), uri)
    time.sleep(1.5)
    used = status(served.pool)["used_bytes"]
    assert GiB <= used <= GiB + 64 * MiB, used


def test_nbdcopy_both_ways_sparse(served: Server, tmp_path: Path) -> None:
    src = tmp_path / "src.raw"
    with open(src, "wb") as f:
        f.truncate(GiB)
        for off in (0, 100 * MiB, 700 * MiB):
            f.seek(off)
            f.write(os.urandom(3 * MiB + 12345))
    uri = served.unix_uri("disk")
    run("nbdcopy", str(src), uri)
    back = tmp_path / "back.raw"
    run("nbdcopy", uri, str(back))
    assert back.read_bytes() == src.read_bytes()
    # sparse destination: nbdcopy saw holes, wrote none of them
    assert os.stat(back).st_blocks * 512 < 32 * MiB
    time.sleep(1.5)
    assert volume_status(served.pool, "disk")["mapped_bytes"] < 16 * MiB


def test_fio_nbd_verify(served: Server) -> None:
    out = run(
        "fio", "--name=verify", "--ioengine=nbd", f"--uri={served.unix_uri('disk')}",
        "--rw=randwrite", "--bs=64k", "--size=64M", "--iodepth=16",
        "--verify=crc32c", "--do_verify=1", "--verify_state_save=0", "--output-format=json",
    )  # fmt: skip
    result = json.loads(out[out.index("{") :])
    job = result["jobs"][0]
    assert job["error"] == 0
    assert job["write"]["io_bytes"] == 64 * MiB


def test_status_while_served_and_clean_stop(served: Server) -> None:
    run("qemu-io", "-f", "raw", "-c", "write -P 1 0 2M", served.unix_uri("disk"))
    time.sleep(1.5)
    assert volume_status(served.pool, "disk")["data_bytes"] == 2 * MiB
    assert "disk" in thinblock("volume", "list", served.pool).stdout
    # a second server on the same pool is refused with a clear message
    second = thinblock("serve", served.pool, "--socket", str(Path(served.socket).parent / "other.sock"), check=False)
    assert second.returncode == 1 and "already held" in second.stderr and "thinblock serve" in second.stderr
    out = served.stop()
    assert "stopped" in out
    assert "connected" in served.log.read_text()
