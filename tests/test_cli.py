"""The `thinblock` command line, run as a real process."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli import thinblock
from thinblock import Pool
from thinblock.sizes import format_size

ROOT = Path(__file__).resolve().parent.parent


def tb(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """The CLI; with ok=False it must fail cleanly: exit 1 (failed) or 2 (usage) and a message."""
    proc = thinblock(*args, check=ok)
    if not ok:
        assert proc.returncode in (1, 2), (proc.returncode, proc.stdout, proc.stderr)
        assert "error" in proc.stderr
    return proc


@pytest.fixture
def pool_dir(tmp_path: Path) -> str:
    path = str(tmp_path / "pool")
    tb("pool", "create", path, "--size", "64M")
    return path


def test_pool_lifecycle(pool_dir: str) -> None:
    status = json.loads(tb("pool", "status", pool_dir, "--json").stdout)
    assert status["size_bytes"] == 64 << 20
    assert status["block_size"] == 64 << 10
    assert status["used_bytes"] == 0 and status["free_bytes"] == 64 << 20
    assert status["volume_count"] == status["snapshot_count"] == status["mapped_bytes"] == 0
    assert "volumes" not in status  # O(1) in the number of volumes: volume list lists them
    tb("volume", "create", pool_dir, "vm1", "--size", "1T")  # overcommit
    tb("volume", "create", pool_dir, "vm2", "--size", "10G", "--detect-zeroes", "unmap")
    with Pool.open(pool_dir) as pool:
        pool.volume("vm1").write(0, b"\x01" * (1 << 20))
        pool.volume("vm1").provision(1 << 30, 1 << 20)
    vols = {v["name"]: v for v in json.loads(tb("volume", "list", pool_dir, "--json").stdout)}
    assert vols["vm1"]["size_bytes"] == 1 << 40
    assert vols["vm1"]["mapped_bytes"] == 2 << 20
    assert vols["vm1"]["provisioned_bytes"] == 1 << 20
    assert vols["vm2"]["detect_zeroes"] == "unmap"
    human = tb("pool", "status", pool_dir).stdout
    assert "used 2M" in human and "2 volume(s) and 0 snapshot(s) map 2M" in human and "volume list" in human
    tb("pool", "grow", pool_dir, "--size", "128M")
    assert json.loads(tb("pool", "status", pool_dir, "--json").stdout)["size_bytes"] == 128 << 20
    tb("volume", "resize", pool_dir, "vm1", "--size", "512K", "--allow-shrink")
    vols = {v["name"]: v for v in json.loads(tb("volume", "list", pool_dir, "--json").stdout)}
    assert vols["vm1"]["size_bytes"] == 512 << 10 and vols["vm1"]["mapped_bytes"] == 512 << 10
    tb("volume", "set", pool_dir, "vm1", "--detect-zeroes", "off")
    tb("volume", "remove", pool_dir, "vm1")
    status = json.loads(tb("pool", "status", pool_dir, "--json").stdout)
    assert status["volume_count"] == 1 and status["virtual_bytes"] == 10 << 30 and status["used_bytes"] == 0
    assert [v["name"] for v in json.loads(tb("volume", "list", pool_dir, "--json").stdout)] == ["vm2"]
    assert "consistent" in tb("pool", "check", pool_dir).stdout


@pytest.mark.parametrize(
    "args",
    [
        ["pool", "status", "/nonexistent/pool"],
        ["pool", "check", "/nonexistent/pool"],
        ["volume", "create", "/nonexistent/pool", "v", "--size", "1G"],
        ["pool", "create", "{tmp}/p2", "--size", "10Q"],
        ["pool", "create", "{tmp}/p2", "--size", "100K"],
        ["pool", "create", "{tmp}/p2", "--size", "64M", "--block-size", "48K"],
        ["pool", "create", "{tmp}/p2", "--size", "64M", "--block-size", "32M"],
        ["pool", "create", "{pool}", "--size", "64M"],
        ["volume", "create", "{pool}", "v", "--size", "16E"],
        ["volume", "create", "{pool}", "v", "--size", "1000"],
        ["volume", "create", "{pool}", "v", "--size", "0"],
        ["volume", "create", "{pool}", "-v", "--size", "1G"],
        ["volume", "create", "{pool}", "a/b", "--size", "1G"],
        ["volume", "create", "{pool}", "dup", "--size", "1G"],
        ["volume", "remove", "{pool}", "missing"],
        ["volume", "resize", "{pool}", "missing", "--size", "1G"],
        ["volume", "resize", "{pool}", "dup", "--size", "1X"],
        ["pool", "grow", "{pool}", "--size", "32M"],
        ["pool", "grow", "{pool}", "--size", "65M+1"],
        ["volume", "set", "{pool}", "dup", "--detect-zeroes", "maybe"],
        ["volume", "set", "{pool}", "dup", "--low-water", "abc"],
        ["volume", "set", "{pool}", "dup", "--low-water", "100"],
        ["volume", "set", "{pool}", "dup", "--reserve", "lots"],
        ["pool", "set", "{pool}", "--low-water", "-5"],
        ["pool", "set", "{pool}", "--autogrow", "1M"],
        ["pool", "set", "{pool}", "--when-full", "wait:0"],
        ["pool", "frobnicate"],
        [],
    ],
)
def test_bad_input_is_a_clear_error_and_changes_nothing(pool_dir: str, tmp_path: Path, args: list[str]) -> None:
    tb("volume", "create", pool_dir, "dup", "--size", "1G")
    before = _pool_figures(pool_dir)
    proc = tb(*[a.format(tmp=tmp_path, pool=pool_dir) for a in args], ok=False)
    assert proc.stderr.strip()
    assert _pool_figures(pool_dir) == before
    assert not (tmp_path / "p2" / "metadata.sqlite").exists()


def _pool_figures(pool: str) -> dict[str, object]:
    """`pool status --json` without the host's free space, which other processes change."""
    status = json.loads(tb("pool", "status", pool, "--json").stdout)
    status.pop("host_free_bytes")
    return dict(status)


def test_every_command_has_help() -> None:
    for args in (
        [],
        ["pool"],
        ["pool", "create"],
        ["pool", "status"],
        ["pool", "grow"],
        ["pool", "check"],
        ["volume"],
        ["volume", "create"],
        ["volume", "list"],
        ["volume", "remove"],
        ["volume", "resize"],
        ["volume", "set"],
        ["quickstart"],
    ):
        out = tb(*args, "--help").stdout
        assert "usage: thinblock" in out


def test_pool_held_without_control_socket_is_refused_clearly(pool_dir: str) -> None:
    # A library user holding the pool offers no control socket: commands say who holds it.
    with Pool.open(pool_dir) as pool:
        pool.create_volume("live", 1 << 30).write(0, b"x" * 4096)
        pool.commit()
        proc = tb("volume", "create", pool_dir, "other", "--size", "1G", "--wait", "0.5", ok=False)
        assert "already held" in proc.stderr and str(os.getpid()) in proc.stderr
        assert "no control socket" in proc.stderr
        assert tb("pool", "check", pool_dir).returncode == 0  # check reads the last commit, lock-free
    listed = json.loads(tb("volume", "list", pool_dir, "--json").stdout)
    assert [v["name"] for v in listed] == ["live"]


def test_check_reports_corrupted_file(pool_dir: str) -> None:
    tb("volume", "create", pool_dir, "v", "--size", "1G")
    db = Path(pool_dir) / "metadata.sqlite"
    data = bytearray(db.read_bytes())
    data[100:4000] = os.urandom(3900)
    db.write_bytes(bytes(data))
    for name in ("metadata.sqlite-wal", "metadata.sqlite-shm"):
        (Path(pool_dir) / name).unlink(missing_ok=True)
    proc = tb("pool", "check", pool_dir, ok=False)
    assert "unreadable" in proc.stderr or "problem" in proc.stdout or "corrupt" in proc.stderr


def test_check_reports_damaged_refcounts_in_plain_words(pool_dir: str) -> None:
    with Pool.open(pool_dir) as pool:
        pool.create_volume("v", 1 << 30).write(0, b"x" * (3 << 16))
    conn = sqlite3.connect(Path(pool_dir) / "metadata.sqlite")
    blob = bytearray(conn.execute("SELECT counts FROM refcount_pages WHERE idx = 0").fetchone()[0])
    blob[4:8] = (2).to_bytes(4, "little")  # dblock 1: refcount 2, one reference
    blob[40:44] = (1).to_bytes(4, "little")  # dblock 10: leaked
    conn.execute("UPDATE refcount_pages SET counts = ? WHERE idx = 0", (bytes(blob),))
    conn.execute("UPDATE volumes SET data_blocks = 7")
    conn.commit()
    conn.close()
    proc = tb("pool", "check", pool_dir, ok=False)
    assert "dblock 1: refcount 2 recorded, 1 references found" in proc.stdout
    assert "dblock 10: refcount 1 recorded but nothing maps it" in proc.stdout
    assert "volume v: 7 data blocks recorded, 3 mapped" in proc.stdout
    report = json.loads(tb("pool", "check", pool_dir, "--json", ok=False).stdout)
    assert report["ok"] is False and len(report["problems"]) >= 3


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (
            "UPDATE superblock SET value = 'abc' WHERE key = 'block_size'",
            "superblock entry 'block_size' is not a value",
        ),
        ("UPDATE superblock SET value = '0' WHERE key = 'block_size'", "superblock block size 0 is not a positive"),
        (
            "UPDATE superblock SET value = '\"x\"' WHERE key = 'size_bytes'",
            "superblock pool size 'x' is not a positive",
        ),
        ("DROP TABLE pages", "no such table: pages"),
        ("UPDATE roots SET page_index = -1", "mapping page at index -1 lies before its start"),
        # Block 1 stays mapped past the new end: a later grow would show its old bytes.
        ("UPDATE volumes SET size_bytes = 65536", "1 block(s) are mapped past its end (the first at block 1)"),
    ],
)
def test_check_names_damaged_metadata_in_one_sentence(pool_dir: str, edit: str, said: str) -> None:
    """Damage found by a probe: each is named in plain words, never a traceback, and
    mappings a volume cannot reach (or that lie past its end) are not "consistent"."""
    with Pool.open(pool_dir) as pool:
        pool.create_volume("w", 1 << 20).write(0, b"\xcc" * (2 << 16))
    conn = sqlite3.connect(Path(pool_dir) / "metadata.sqlite")
    conn.execute(edit)
    conn.commit()
    conn.close()
    proc = thinblock("pool", "check", pool_dir, check=False)  # no traceback (tests/cli.py checks it)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert said in proc.stdout + proc.stderr
    assert proc.stdout.count(said) <= 1  # said once, not by every check that trips on it


def test_quickstart_creates_default_once(tmp_path: Path) -> None:
    path = str(tmp_path / "default")
    first = tb("quickstart", "--pool", path, "--size", "64M", "--volume-size", "1G")
    assert "created pool" in first.stdout and "disk0" in first.stdout
    second = json.loads(tb("quickstart", "--pool", path, "--json").stdout)
    assert [v["name"] for v in second["volumes"]] == ["disk0"]


def test_format_1_pool_is_upgraded_on_first_write_open(pool_dir: str) -> None:

    tb("volume", "create", pool_dir, "old", "--size", "1G")
    db = sqlite3.connect(Path(pool_dir) / "metadata.sqlite")
    with db:  # make it look like a pool written before snapshots existed
        for column in (
            "kind",
            "origin_id",
            "reserve_bytes",
            "low_water",
            "on_low_water",
            "exclusive_blocks",
            "exclusive_epoch",
        ):
            db.execute(f"ALTER TABLE volumes DROP COLUMN {column}")
        db.execute("UPDATE superblock SET value = '1' WHERE key = 'format_version'")
    db.close()
    proc = tb("pool", "check", pool_dir, ok=False)
    assert "open the pool once for writing" in proc.stderr
    listing = json.loads(tb("volume", "list", pool_dir, "--json").stdout)
    assert [(v["name"], v["kind"], v["origin"], v["reserve"]) for v in listing] == [("old", "volume", None, 0)]
    tb("pool", "check", pool_dir)


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["pool"], 2, "a command is required: thinblock pool --help"),
        ([], 2, "a command is required"),
        (["volume", "frobnicate", "{pool}"], 2, "invalid choice"),
        (["volume", "create", "{pool}", "v"], 2, "--size"),
        (["volume", "create", "{pool}", "v", "--size", "1X"], 2, "invalid size '1X'"),
        (["pool", "create", "{tmp}/p2", "--size", "1K"], 1, "invalid pool size 1K"),
        (["volume", "create", "{pool}", "v", "--size", "1000"], 1, "invalid volume size 1000B"),
        (["volume", "resize", "{pool}", "nope", "--size", "1G"], 1, "'nope'"),
        (["pool", "status", "{tmp}/missing"], 1, "no pool at {tmp}/missing"),
        (["serve", "{tmp}/missing"], 1, "no pool at {tmp}/missing"),
    ],
)
def test_exit_status_and_messages_name_the_object(
    pool_dir: str, tmp_path: Path, args: list[str], code: int, words: str
) -> None:
    """2 for a command line argparse cannot parse, 1 for a command that ran and failed."""
    proc = thinblock(*[a.format(tmp=tmp_path, pool=pool_dir) for a in args], check=False)
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert words.format(tmp=tmp_path) in proc.stderr, proc.stderr
    assert proc.stderr.count("Traceback") == 0


def test_version() -> None:
    from thinblock import __version__

    assert tb("--version").stdout.strip() == f"thinblock {__version__}"


@pytest.mark.parametrize("args", [["volume", "list", "{pool}"], ["pool", "status", "{pool}", "--json"], ["--help"]])
def test_a_closed_stdout_ends_quietly(pool_dir: str, args: list[str]) -> None:
    # Enough output that the reader is gone before it is written (made in one open:
    # forty CLI runs would cost more than the test itself).
    with Pool.open(pool_dir) as pool:
        for i in range(40):
            pool.create_volume(f"v{i}", 1 << 30)
    cmd = " ".join([sys.executable, "-m", "thinblock", *[a.format(pool=pool_dir) for a in args]])
    proc = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {cmd} | head -c 1 >/dev/null; echo status ${{PIPESTATUS[0]}} >&2"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] in ("status 141", "status 0"), proc.stderr


def test_absent_settings_show_as_none_and_sizes_in_human_units(pool_dir: str) -> None:
    out = tb("pool", "set", pool_dir, "--low-water", "10").stdout
    assert "autogrow: none" in out and "on_low_water: none" in out and "low_water_percent: 10%" in out
    assert "None" not in out
    out = tb("pool", "set", pool_dir, "--autogrow", "64M:1G").stdout
    assert "autogrow: 64M steps up to 1G" in out


def test_malformed_settings_are_usage_errors_and_a_maximum_below_the_pool_is_refused(pool_dir: str) -> None:
    """A malformed value is a malformed argument (exit 2, as a malformed size is); a
    well-formed one the pool cannot take is a refusal (exit 1). Nothing changes."""
    tb("volume", "create", pool_dir, "v", "--size", "1G")

    def status() -> dict[str, object]:  # the host's free space moves with the machine
        figures = json.loads(tb("pool", "status", pool_dir, "--json").stdout)
        return {k: v for k, v in figures.items() if not k.startswith("host_")}

    before = status()
    for args in (
        ("pool", "set", pool_dir, "--when-full", "wait:abc"),
        ("pool", "set", pool_dir, "--low-water", "150"),
        ("pool", "set", pool_dir, "--autogrow", "0:1G:2"),
        ("pool", "set", pool_dir, "--autogrow", "1M"),
        ("volume", "set", pool_dir, "v", "--low-water", "abc"),
    ):
        proc = tb(*args, ok=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (args, proc.stderr)
    size = format_size(int(str(before["size_bytes"])))
    low = tb("pool", "set", pool_dir, "--autogrow", f"1M:{size}", ok=False)
    assert low.returncode == 1 and f"would never grow pool {pool_dir}, which is {size} already" in low.stderr
    assert status() == before


def test_shrinking_needs_allow_shrink_and_no_clients(pool_dir: str, tmp_path: Path) -> None:
    from tests.nbd_server import Server, connect

    tb("volume", "create", pool_dir, "v", "--size", "4M")
    with Pool.open(pool_dir) as pool:
        pool.volume("v").write(3 << 20, b"keep" * 1024)
    refused = tb("volume", "resize", pool_dir, "v", "--size", "1M", ok=False)
    assert refused.returncode == 1 and "--allow-shrink" in refused.stderr and "4M to 1M" in refused.stderr
    tb("volume", "resize", pool_dir, "v", "--size", "8M")  # growing needs nothing
    server = Server(pool_dir, workdir=tmp_path)
    try:
        h = connect(server, "v")
        busy = tb("volume", "resize", pool_dir, "v", "--size", "1M", "--allow-shrink", ok=False)
        assert "cannot shrink volume v: it is open by 1 client(s)" in busy.stderr
        busy = tb("volume", "remove", pool_dir, "v", ok=False)
        assert "cannot remove volume v: it is open by 1 client(s)" in busy.stderr
        assert h.pread(4, 3 << 20) == b"keep"
        h.shutdown()
        deadline = time.monotonic() + 30  # the server closes the export once it sees the client go
        shrink = ("volume", "resize", pool_dir, "v", "--size", "1M", "--allow-shrink")
        while "open by" in (done := thinblock(*shrink, check=False)).stderr:
            assert time.monotonic() < deadline, done.stderr
            time.sleep(0.1)
        assert done.returncode == 0, done.stderr
    finally:
        server.stop()
    listing = json.loads(tb("volume", "list", pool_dir, "--json").stdout)
    assert [(v["name"], v["size_bytes"], v["mapped_bytes"]) for v in listing] == [("v", 1 << 20, 0)]


def test_removing_a_snapshot_with_dependents_says_what_happens_to_them(pool_dir: str) -> None:
    tb("volume", "create", pool_dir, "vm", "--size", "1M")
    with Pool.open(pool_dir) as pool:
        pool.volume("vm").write(0, b"a" * (64 << 10))
    tb("snapshot", "create", pool_dir, "vm", "s1")
    tb("snapshot", "create", pool_dir, "s1", "s1b")
    tb("volume", "clone", pool_dir, "s1", "c1")
    out = tb("snapshot", "remove", pool_dir, "s1").stdout
    assert "removed snapshot s1" in out
    assert "its dependents keep all their data and now have no origin: c1 (volume), s1b (snapshot)" in out
    with Pool.open(pool_dir) as pool:
        assert pool.volume("c1").read(0, 1) == b"a" and pool.volume("s1b").read(0, 1) == b"a"
    report = json.loads(tb("snapshot", "remove", pool_dir, "s1b", "--json").stdout)
    assert report == {"name": "s1b", "kind": "snapshot", "freed_bytes": 0, "dependents": []}
    report = json.loads(tb("volume", "remove", pool_dir, "c1", "--json").stdout)
    assert report["dependents"] == [] and report["freed_bytes"] == 0  # vm still holds the block
    report = json.loads(tb("volume", "remove", pool_dir, "vm", "--json").stdout)
    assert report["freed_bytes"] == 64 << 10
    listing = json.loads(tb("volume", "list", pool_dir, "--json").stdout)
    assert listing == []


def test_listen_errors_name_the_socket_and_the_port(pool_dir: str, tmp_path: Path) -> None:
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    sock = str(tmp_path / "nbd.sock")
    try:
        proc = tb("serve", pool_dir, "--socket", sock, "--listen", f"127.0.0.1:{port}", "--insecure", ok=False)
        assert f"cannot listen on TCP 127.0.0.1:{port}: Address already in use" in proc.stderr
    finally:
        busy.close()
    proc = tb("serve", pool_dir, "--socket", str(tmp_path / "no" / "dir.sock"), ok=False)
    assert f"cannot listen on unix socket {tmp_path}/no/dir.sock: No such file or directory" in proc.stderr
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    proc = tb("serve", pool_dir, "--socket", str(precious), ok=False)
    assert f"unix socket {precious}: something other than a socket is there" in proc.stderr
    assert precious.read_text() == "keep me"


def test_double_dash_ends_options_and_leftovers_are_usage_errors(pool_dir: str) -> None:
    """Only mkfs hands what follows "--" on (to mkfs.TYPE); elsewhere "--" ends the
    options as usual, and words no command takes are a usage error, with nothing done."""
    proc = thinblock("volume", "create", pool_dir, "zz", "--size", "1M", "--", "extra", check=False)
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr
    assert "zz" not in thinblock("volume", "list", pool_dir).stdout
    thinblock("volume", "create", pool_dir, "zz", "--size", "1M")
    assert json.loads(thinblock("volume", "info", pool_dir, "--json", "--", "zz").stdout)["name"] == "zz"
    proc = thinblock("volume", "list", pool_dir, "--", "--json", check=False)
    assert proc.returncode == 2 and "unrecognized arguments: --json" in proc.stderr
