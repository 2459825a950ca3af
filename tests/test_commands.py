"""The everyday commands lvm2 and rbd have, as real `thinblock` processes: volume and
snapshot rename, pool remove, detach POOL VOLUME, the --help examples, the man page
and shell completion."""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests import test_attach, test_cli
from tests.cli import _running, fuse_daemon_pids
from tests.nbd_server import Server, connect
from thinblock import Pool
from thinblock.core.pool import read_status
from thinblock.frontends.cli.examples import EXAMPLES
from thinblock.frontends.cli.main import build_parser

DEADLINE_S = 30
env = test_attach.env  # a private runtime dir; every mount, loop device and daemon cleaned up after
pool_dir = test_cli.pool_dir  # a 64M pool
tb = test_cli.tb  # the CLI; with ok=False it must fail cleanly, with a message


def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for condition (generously); fail naming what never happened."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def listing(pool: str) -> dict[str, dict[str, object]]:
    return {v["name"]: v for v in json.loads(tb("volume", "list", pool, "--json").stdout)}


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


def test_a_volume_rename_carries_its_snapshots_named_after_it(pool_dir: str) -> None:
    """rbd renames an image with its snapshots: vm@s1 becomes web@s1 (only snapshots taken
    of vm and named vm@...); one whose new name is taken refuses the whole rename."""
    tb("volume", "create", pool_dir, "vm", "--size", "1M")
    tb("volume", "create", pool_dir, "other", "--size", "1M")
    tb("snapshot", "create", pool_dir, "vm@s1")
    tb("snapshot", "create", pool_dir, "vm", "plain")
    tb("snapshot", "create", pool_dir, "other", "vm@x")  # named like vm's, taken of other: stays
    tb("snapshot", "create", pool_dir, "other", "web@s1")
    proc = tb("volume", "rename", pool_dir, "vm", "web", ok=False)
    assert "'web@s1' already exists" in proc.stderr
    assert sorted(listing(pool_dir)) == ["other", "plain", "vm", "vm@s1", "vm@x", "web@s1"]
    tb("snapshot", "remove", pool_dir, "web@s1")
    out = json.loads(tb("volume", "rename", pool_dir, "vm", "web", "--json").stdout)
    assert out["snapshots"] == [{"old_name": "vm@s1", "name": "web@s1"}]
    vols = listing(pool_dir)
    assert sorted(vols) == ["other", "plain", "vm@x", "web", "web@s1"]
    assert vols["web@s1"]["origin"] == "web" and vols["vm@x"]["origin"] == "other"
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
        # Named, as the server's log names the connection.
        assert re.fullmatch(
            r"thinblock: error: cannot rename volume vm: it is open by 1 client\(s\): NBD connection #\d+ unix\n",
            busy.stderr,
        ), busy.stderr
        assert re.search(r"#\d+ unix", server.log.read_text())
        assert _exports(server) == ["s1", "vm"]
        h.shutdown()
        until(lambda: listing(pool_dir)["vm"]["open_clients"] == 0, "the NBD client to go")
        tb("volume", "rename", pool_dir, "vm", "web")
        tb("snapshot", "rename", pool_dir, "s1", "web@s1")
        assert _exports(server) == ["web", "web@s1"]  # at once, no restart
        # Committed before the command returned: the metadata on disk says so already.
        assert sorted(v["name"] for v in read_status(pool_dir)["volumes"]) == ["web", "web@s1"]
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


# ----- pool remove -------------------------------------------------------------------


def _tree(path: str) -> dict[str, bytes]:
    """Every file under path with its bytes (the data file only as its size), but for
    what merely opening a pool rewrites (its lock's holder, SQLite's WAL and index)."""
    out = {}
    for root, _dirs, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            if name.endswith((".sock", "-wal", "-shm")) or name == "lock":
                continue
            out[full] = str(os.path.getsize(full)).encode() if name == "data" else Path(full).read_bytes()
    return out


def _write(pool: str, name: str, data: bytes, offset: int = 0) -> None:
    with Pool.open(pool) as p:
        p.volume(name).write(offset, data)


def test_an_empty_pool_goes_without_yes(pool_dir: str) -> None:
    tb("volume", "create", pool_dir, "empty", "--size", "1G")  # a volume without data is no reason to ask
    out = tb("pool", "remove", pool_dir)
    assert out.stdout.startswith(f"removed pool {pool_dir} (64M) with 1 volume(s):\n  volume empty: 1G, 0B of data\n")
    assert f"file {pool_dir}/metadata.sqlite" in out.stdout and f"directory {os.path.realpath(pool_dir)}" in out.stdout
    assert not os.path.exists(pool_dir)
    gone = tb("pool", "remove", pool_dir, ok=False)
    assert gone.returncode == 1 and gone.stderr == f"thinblock: error: no pool at {pool_dir}: no such directory\n"


def test_a_pool_with_data_needs_yes_and_says_what_goes(pool_dir: str) -> None:
    tb("volume", "create", pool_dir, "vm", "--size", "1G")
    tb("volume", "create", pool_dir, "spare", "--size", "1G")
    _write(pool_dir, "vm", b"x" * (128 << 10))
    tb("snapshot", "create", pool_dir, "vm", "vm@s1")
    tb("pool", "repair", pool_dir)  # keeps metadata.sqlite.bad: the pool's file too
    before = _tree(pool_dir)
    refused = tb("pool", "remove", pool_dir, ok=False)
    assert refused.returncode == 1
    assert refused.stderr == (
        f"thinblock: error: pool {pool_dir} holds 256K of data in 2 volume(s) (vm, vm@s1):"
        " nothing was deleted; pass --yes to delete it\n"
    )
    assert refused.stdout.startswith(f"would remove pool {pool_dir} (64M) with 3 volume(s):\n")
    assert (
        "  volume vm: 1G, 128K of data\n" in refused.stdout and "  snapshot vm@s1: 1G, 128K of data\n" in refused.stdout
    )
    assert f"  file {pool_dir}/data (" in refused.stdout
    assert _tree(pool_dir) == before  # nothing deleted, nothing changed
    tb("pool", "check", pool_dir)
    # --json says the same, as data, and still deletes nothing
    plan = json.loads(tb("pool", "remove", pool_dir, "--json", ok=False).stdout)
    assert plan["removed"] is False and plan["data_bytes"] == 256 << 10
    assert {v["name"]: v["data_bytes"] for v in plan["volumes"]} == {"spare": 0, "vm": 128 << 10, "vm@s1": 128 << 10}
    assert _tree(pool_dir) == before
    # Someone's own file in the directory stays, and so does the directory then.
    Path(pool_dir, "notes.txt").write_text("mine")
    done = json.loads(tb("pool", "remove", pool_dir, "--yes", "--json").stdout)
    assert done["removed"] is True
    assert {os.path.basename(i["name"]) for i in done["deletes"]} >= {"data", "metadata.sqlite", "lock"}
    assert done["kept"] == [f"the directory {pool_dir} stays: it holds other files (notes.txt)"]
    assert os.listdir(pool_dir) == ["notes.txt"]


def test_a_served_pool_is_not_removed(pool_dir: str, tmp_path: Path) -> None:
    tb("volume", "create", pool_dir, "vm", "--size", "1M")
    server = Server(pool_dir, workdir=tmp_path)
    try:
        before = _tree(pool_dir)
        # Refused at once, however long --wait would let it wait for another command.
        refused = tb("pool", "remove", pool_dir, "--yes", "--wait", "3600", ok=False)
        assert refused.returncode == 1 and refused.stdout == ""
        assert refused.stderr == (
            f"thinblock: error: cannot remove pool {pool_dir}: it is already held by another thinblock process"
            f" (pid {server.proc.pid}, thinblock serve); stop that server (or detach the pool's devices) first."
            " Nothing was deleted\n"
        )
        assert _tree(pool_dir) == before
        assert _exports(server) == ["vm"]
    finally:
        server.stop()
    tb("pool", "remove", pool_dir)
    assert not os.path.exists(pool_dir)


def test_a_device_pool_leaves_the_device_alone(tmp_path: Path, loop_file: tuple[str, Path]) -> None:
    dev, _backing = loop_file
    pool = str(tmp_path / "devpool")
    tb("pool", "create", pool, "--data", dev, "--size", "32M")
    tb("volume", "create", pool, "vm", "--size", "1M")
    _write(pool, "vm", b"keepme" * 100)
    with open(dev, "rb") as f:
        device_before = f.read()
    done = tb("pool", "remove", pool, "--yes")
    assert f"kept: the data device {dev} is left as it is" in done.stdout
    assert not os.path.exists(pool)
    with open(dev, "rb") as f:
        assert f.read() == device_before


def test_a_rados_pool_goes_with_every_object_it_has_and_no_other(request: pytest.FixtureRequest) -> None:
    from tests.conftest import new_rados_locator, rados_objects
    from thinblock.backends import locate
    from thinblock.backends.rados import RadosLocation

    pool = new_rados_locator(request, "remove")
    # A neighbour whose name starts like the pool's kept copies: it must survive.
    neighbour = pool + ".bad.1"
    request.addfinalizer(lambda: __import__("tests.conftest").conftest.remove_rados_pool(neighbour))
    tb("pool", "create", pool, "--size", "16M", "--object-size", "64K")
    tb("pool", "create", neighbour, "--size", "16M")
    tb("volume", "create", pool, "vm", "--size", "1M")
    _write(pool, "vm", b"r" * (192 << 10))
    tb("pool", "repair", pool)  # keeps a copy of the metadata: one of the pool's objects too
    location = locate(pool)
    assert isinstance(location, RadosLocation)
    meta = location.open_meta(readonly=True)
    prefix = location.data_prefix(meta.superblock())
    meta.close()
    ours = rados_objects(location.meta_object) + rados_objects(prefix + ".")
    neighbour_object = f"thinblock.{neighbour.rpartition('/')[2]}"
    assert len(rados_objects(prefix + ".")) >= 3 and len(ours) > len(rados_objects(prefix + ".")) + 1
    refused = tb("pool", "remove", pool, ok=False)
    assert refused.returncode == 1 and "pass --yes" in refused.stderr
    assert rados_objects(location.meta_object) + rados_objects(prefix + ".") == ours
    done = json.loads(tb("pool", "remove", pool, "--yes", "--json").stdout)
    assert done["removed"] is True and done["volumes"][0]["data_bytes"] == 192 << 10
    assert rados_objects(prefix + ".") == []
    # Of the objects named like the pool's, only the neighbour's own stays (repair's
    # copy, thinblock.NAME.bad.TIME, has a name the neighbour's starts the same as).
    assert rados_objects(location.meta_object) == [neighbour_object]
    tb("pool", "check", neighbour)
    assert "no pool at" in tb("pool", "status", pool, ok=False).stderr


# ----- detach POOL VOLUME ------------------------------------------------------------


def _loops_of(root: Path) -> dict[str, str]:
    """loop device -> volume name, for loop devices over FUSE files below root."""
    out = subprocess.run(["losetup", "--json", "--list"], capture_output=True, text=True).stdout
    devices = json.loads(out)["loopdevices"] if out.strip() else []
    return {d["name"]: os.path.basename(d["back-file"]) for d in devices if str(root) in (d.get("back-file") or "")}


def test_detach_pool_volume_then_the_daemon_and_its_folder_go(env: Path) -> None:
    pool = test_attach.make_pool(env, ("a", "1G"), ("b", "1G"))
    run = env / "run"
    not_yet = tb("detach", pool, "a", ok=False)
    assert not_yet.returncode == 1
    assert not_yet.stderr == (
        f"thinblock: error: volume a of pool {pool} is not attached ('thinblock attach --list' shows what is)\n"
    )
    da = tb("attach", pool, "a").stdout.strip()
    db = tb("attach", pool, "b").stdout.strip()
    (pdir,) = [p for p in run.iterdir() if p.is_dir()]
    (pid,) = fuse_daemon_pids(run)
    busy = tb("volume", "rename", pool, "a", "z", ok=False)  # the loop device has it open
    assert (
        "cannot rename volume a: it is open by 1 client(s): a loop device on its file in the FUSE mount" in busy.stderr
    )
    assert "(attached by losetup, pid " in busy.stderr, busy.stderr
    half = tb("detach", pool, ok=False)
    assert half.returncode == 2 and f"detach {pool} needs the VOLUME too" in half.stderr
    # The FUSE daemon holds the pool: pool remove names it and deletes nothing.
    refused = tb("pool", "remove", pool, "--yes", ok=False)
    assert refused.returncode == 1
    assert (
        f"it is already held by another thinblock process (pid {pid}, thinblock fuse-daemon (attach))" in refused.stderr
    )
    assert os.path.exists(os.path.join(pool, "metadata.sqlite"))
    assert tb("detach", pool, "a").stdout == f"detached {da} ({pool} a)\n"
    assert _loops_of(env) == {db: "b"}
    assert pdir.is_dir() and fuse_daemon_pids(run) == [pid]  # b still uses them
    assert "is not attached" in tb("detach", pool, "a", ok=False).stderr
    assert "is not attached" in tb("detach", pool, "missing", ok=False).stderr
    tb("detach", pool, "b")
    assert _loops_of(env) == {}
    until(lambda: not _running(pid), "the FUSE daemon to exit")
    assert not pdir.exists()  # the last user gone, its runtime folder goes
    tb("pool", "check", pool)
    tb("pool", "remove", pool)


def test_detach_of_a_served_pools_volume_leaves_the_server(env: Path) -> None:
    pool = test_attach.make_pool(env, ("a", "1G"))
    server = Server(pool, workdir=env)
    try:
        dev = tb("attach", pool, "a").stdout.strip()
        (pdir,) = [p for p in (env / "run").iterdir() if p.is_dir()]
        tb("detach", pool, "a")
        assert dev not in _loops_of(env) and not pdir.exists()
        assert _exports(server) == ["a"]  # the server goes on
    finally:
        server.stop()


# ----- --help examples, the man page, shell completion -------------------------------

INTERNAL = {"fuse-daemon"}  # started by attach, not by people; it has examples all the same


def _leaf_commands() -> dict[str, argparse.ArgumentParser]:
    """Every command path that runs something ("pool create", "serve") -> its parser."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not groups:
            found[" ".join(path)] = parser
        for group in groups:
            for name, child in group.choices.items():
                walk(child, [*path, name])

    walk(build_parser(), [])
    return found


def _words(example: str) -> list[str]:
    """The thinblock command of an example line, as the shell would split it (a pipe
    or a redirection ends it; what stands before `thinblock` feeds it)."""
    lexer = shlex.shlex(example, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    start = words.index("thinblock")
    end = next((i for i, w in enumerate(words) if i > start and w in ("|", ">", "<", "&&", ";")), len(words))
    return words[start + 1 : end]


def test_every_command_has_two_or_three_examples_that_parse() -> None:
    leaves = _leaf_commands()
    assert set(EXAMPLES) == set(leaves), "commands without examples, or examples of no command"
    parser = build_parser()
    for command, lines in EXAMPLES.items():
        assert 2 <= len(lines) <= 3, command
        for line in lines:
            words = _words(line)
            assert " ".join(words).startswith(command + " ") or " ".join(words) == command, line
            argv = words[: words.index("--")] if "--" in words else words  # the rest is mkfs's (main._run)
            try:
                args = parser.parse_args(argv)
            except SystemExit:
                pytest.fail(f"example of {command!r} does not parse: {line}")
            assert args.func is leaves[command].get_default("func"), line


def test_help_ends_with_the_examples() -> None:
    out = tb("volume", "rename", "--help").stdout
    assert out.endswith(
        "examples:\n  thinblock volume rename /srv/pool vm1 web1\n"
        "  thinblock volume rename rados:rbd/vmpool old-db db --json\n"
    )
    assert "rename a volume (refused while clients have it open)\n" in out
    for command in ("pool remove", "detach", "serve"):
        out = tb(*command.split(), "--help").stdout
        assert out.rstrip().endswith(EXAMPLES[command][-1]) and "examples:\n" in out


def test_the_man_page_renders_and_names_every_command(tmp_path: Path) -> None:
    page = tmp_path / "thinblock.1"
    page.write_text(tb("manpage").stdout)
    shown = subprocess.run(
        ["man", "--warnings", "-l", "-P", "cat", str(page)],
        capture_output=True,
        text=True,
        env={**os.environ, "MANWIDTH": "100", "LC_ALL": "C.UTF-8"},  # as most users read it
        check=True,
    )
    assert shown.stderr == ""  # troff found nothing to warn about
    text = shown.stdout
    assert text.startswith("THINBLOCK(1)") and "thinblock - thin-provisioned block storage" in text
    for command in _leaf_commands():
        assert f"COMMAND 'thinblock {command}'" in text, command
        assert f"thinblock {command} " in text.split("\nEXAMPLES\n", 1)[1], command
    assert "thinblock pool remove /srv/pool --yes" in text


def test_completion_scripts_complete_commands_and_options(tmp_path: Path) -> None:
    script = tmp_path / "thinblock.bash"
    script.write_text(tb("completion", "bash").stdout)
    subprocess.run(["bash", "-n", str(script)], check=True)

    def complete(*words: str) -> list[str]:
        cmd = (
            f"source {shlex.quote(str(script))}; COMP_WORDS=(thinblock {' '.join(map(shlex.quote, words))});"
            f" COMP_CWORD={len(words)}; _shtab_thinblock; printf '%s\\n' \"${{COMPREPLY[@]}}\""
        )
        out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, check=True).stdout
        return sorted(out.split())

    assert complete("vol") == ["volume"]
    assert complete("volume", "ren") == ["rename"]
    assert complete("snapshot", "re") == ["remove", "rename"]
    assert complete("pool", "remove", "--y") == ["--yes"]
    assert complete("completion", "") == ["bash", "zsh"]
    zsh = tb("completion", "zsh").stdout
    assert zsh.startswith("#compdef thinblock") and "rename" in zsh and "--yes" in zsh
    bad = tb("completion", "fish", ok=False)
    assert bad.returncode == 2 and "invalid choice: 'fish'" in bad.stderr


def test_example_text_reaches_the_page_literally(tmp_path: Path) -> None:
    """An example line starting with a dot, or holding a backslash, shows as written."""
    from thinblock.frontends.cli.docgen import _roff

    page = tmp_path / "x.1"
    page.write_text(".TH X 1\n.SH EXAMPLES\n.nf\n" + _roff(r".hidden --flag 'a\nb'") + "\n.fi\n")
    shown = subprocess.run(
        ["man", "-l", "-P", "cat", str(page)], capture_output=True, text=True, env={**os.environ, "MANWIDTH": "100"}
    )
    assert r".hidden --flag 'a\nb'" in shown.stdout
