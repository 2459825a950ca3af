"""A dump is untrusted input: `pool restore` checks every field against the pool
before it writes anything, takes no host path from it, switches the new metadata
in at once (the old one kept as metadata.sqlite.before-restore), and a failure at
any step leaves the pool as it was. Names that reach host paths are checked again
where the path is built (`thinblock attach`). All through the real command line."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli import thinblock
from tests.conftest import new_rados_locator, rados_objects
from thinblock.errors import ThinblockError
from thinblock.frontends.cli.main import main as cli_main
from thinblock.meta.sqlite import SqliteMetadata
from thinblock.paths import child_path

BS = 64 << 10
Dump = dict[str, Any]


def make_pool(tmp_path: Path, size: str = "32M", scratch: Path | None = None) -> str:
    """A pool with an 8 MiB volume a (2 MiB of data), its snapshot a@s1, and a clone c."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", size)
    data = (scratch or tmp_path) / "source.raw"
    data.write_bytes(bytes(range(256)) * (2 << 12) + bytes(6 << 20))  # 2 MiB of data, then zeros
    thinblock("import", str(data), pool, "a")
    thinblock("snapshot", "create", pool, "a@s1")
    thinblock("volume", "clone", pool, "a@s1", "c")
    return pool


def dump_of(pool: str) -> Dump:
    loaded: Dump = json.loads(thinblock("pool", "dump", pool, "--json").stdout)
    return loaded


def db_rows(pool: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the pool's metadata, read without changing it."""
    conn = sqlite3.connect(f"file:{pool}/metadata.sqlite?mode=ro", uri=True)
    try:
        tables = [t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall()) for t in tables}
    finally:
        conn.close()


def superblock(pool: str) -> dict[str, Any]:
    return {k: json.loads(v) for k, v in db_rows(pool)["superblock"]}


def files(pool: str) -> set[str]:
    return {n for n in os.listdir(pool) if not n.endswith(("-wal", "-shm"))}


def fingerprint(pool: str) -> tuple[Any, ...]:
    """The pool's metadata rows, its files, and its data file's bytes."""
    data = hashlib.sha256(Path(pool, "data").read_bytes()).hexdigest()
    return db_rows(pool), files(pool), data


def restore_refused(tmp_path: Path, pool: str, dump: Dump | str | bytes, *words: str) -> str:
    """Restore of dump is refused with one sentence (containing words) and changes nothing."""
    before = fingerprint(pool)
    path = tmp_path / "hostile.dump"
    if isinstance(dump, bytes):
        path.write_bytes(dump)
    else:
        path.write_text(dump if isinstance(dump, str) else json.dumps(dump))
    proc = thinblock("pool", "restore", pool, str(path), check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("thinblock: error:") and proc.stderr.count("\n") == 1, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert fingerprint(pool) == before  # nothing changed, no leftovers
    thinblock("pool", "check", pool)
    return proc.stderr


def volume(dump: Dump, name: str) -> Dump:
    found: Dump = next(v for v in dump["volumes"] if v["name"] == name)
    return found


# Each one edits a good dump of make_pool's pool into a hostile one.
def _name(name: object) -> Callable[[Dump], None]:
    def edit(d: Dump) -> None:
        volume(d, "c")["name"] = name

    return edit


def _set(where: str, key: str, value: object) -> Callable[[Dump], None]:
    def edit(d: Dump) -> None:
        (d["pool"] if where == "pool" else volume(d, where))[key] = value

    return edit


def _self_origin(d: Dump) -> None:
    volume(d, "c")["origin_id"] = volume(d, "c")["id"]


def _origin_cycle(d: Dump) -> None:
    volume(d, "a")["origin_id"] = volume(d, "c")["id"]  # a -> c -> a@s1 -> a


def _dangling_origin(d: Dump) -> None:
    volume(d, "c")["origin_id"] = 999


def _two_owners(d: Dump) -> None:
    # c maps a's first dblock at another vblock: no snapshot explains that.
    _vblock, dblock, _count, state, pinned = volume(d, "a")["mappings"][0]
    volume(d, "c")["mappings"].append([100, dblock, 1, state, pinned])


def _beyond_pool(d: Dump) -> None:
    volume(d, "c")["mappings"].append([100, 512, 1, "data", False])  # the pool has 512 blocks


HOSTILE: dict[str, tuple[Callable[[Dump], None], str]] = {
    "absolute host path": (_name("/srv/images/victim.img"), "invalid volume name"),
    "parent path": (_name("../../victim.img"), "invalid volume name"),
    "leading dot": (_name(".hidden"), "invalid volume name"),
    "trailing newline": (_name("a\n"), "invalid volume name"),
    "control character": (_name("a\x1bb"), "invalid volume name"),
    "name not text": (_name(7), "name must be"),
    "block size of another pool": (_set("pool", "block_size", 4096), "another pool's dump"),
    "block size 3": (_set("pool", "block_size", 3), "block_size must be"),
    "block size 0": (_set("pool", "block_size", 0), "block_size must be"),
    "negative reserve": (_set("c", "reserve_bytes", -7), "reserve_bytes must be"),
    "when_full explode": (_set("pool", "when_full", "explode"), "when-full"),
    "autogrow not a pair": (_set("pool", "autogrow", {"a": [1]}), "autogrow must be"),
    "autogrow step not blocks": (_set("pool", "autogrow", [1000, 1 << 30]), "autogrow step"),
    "low water 500": (_set("pool", "low_water", 500), "low-water"),
    "detect_zeroes bogus": (_set("c", "detect_zeroes", "sometimes"), "detect_zeroes must be"),
    "kind bogus": (_set("c", "kind", "folder"), "kind must be"),
    "volume of 2^70 bytes": (_set("c", "size_bytes", 1 << 70), "size_bytes 1024E is beyond"),
    "pool of 2^50 bytes": (_set("pool", "size_bytes", 1 << 50), "another pool's dump"),
    "pool of 2^70 bytes": (_set("pool", "size_bytes", 1 << 70), "size_bytes 1024E is beyond"),
    "self origin": (_self_origin, "its own origin"),
    "origin cycle": (_origin_cycle, "its own origin"),
    "dangling origin": (_dangling_origin, "not in the dump"),
    "two owners of one block": (_two_owners, "only snapshots and clones share"),
    "block beyond the pool": (_beyond_pool, "beyond"),
    "another pool's uuid": (_set("pool", "pool_uuid", "0" * 32), "another pool"),
    "unknown pool field": (_set("pool", "pool_id", "0" * 32), "unknown"),
}


@pytest.fixture
def pool(tmp_path: Path) -> str:
    return make_pool(tmp_path)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_dump_is_refused_and_changes_nothing(tmp_path: Path, pool: str, case: str) -> None:
    edit, words = HOSTILE[case]
    dump = dump_of(pool)
    edit(dump)
    restore_refused(tmp_path, pool, dump, words)


def test_hostile_text_dump_is_refused(tmp_path: Path, pool: str) -> None:
    text = thinblock("pool", "dump", pool).stdout
    assert 'name="c"' in text
    restore_refused(tmp_path, pool, text.replace('name="c"', 'name="/srv/images/victim.img"'), "invalid volume name")
    restore_refused(tmp_path, pool, text.replace('name="c"', 'name="c\\n"'), "invalid volume name")


def test_names_with_a_trailing_newline_are_refused_everywhere(pool: str) -> None:
    proc = thinblock("volume", "create", pool, "a\n", "--size", "1M", check=False)
    assert proc.returncode == 1 and "invalid volume name" in proc.stderr
    proc = thinblock("snapshot", "create", pool, "a@s2\n", check=False)
    assert proc.returncode == 1 and "invalid snapshot name" in proc.stderr


@pytest.mark.parametrize(
    ("label", "content", "words"),
    [
        ("binary", bytes(range(256)) * 4, "binary"),
        ("utf-8 with NUL", b"thinblock-dump 1\n\0\n", "binary"),
        ("empty", b"", "not a thinblock dump"),
        ("truncated JSON", b'{"format": "thinblock-dump", "version": 1, "pool": {"block_s', "not valid JSON"),
        ("JSON list", b"[1, 2, 3]", "not a thinblock dump"),
        ("JSON of another format", b'{"format": "qcow2", "version": 1}', "not a thinblock dump"),
        ("wrong version", b'{"format": "thinblock-dump", "version": 9}', "version 9 is not supported"),
        ("no volumes", b'{"format": "thinblock-dump", "version": 1, "pool": {}}', "not a thinblock dump"),
        ("text", b"hello\n", "first line"),
        ("deep JSON", b'{"a": ' * 100000 + b"1" + b"}" * 100000, "nests too deep"),
    ],
)
def test_a_file_that_is_not_a_dump_gets_one_sentence(
    tmp_path: Path, pool: str, label: str, content: bytes, words: str
) -> None:
    restore_refused(tmp_path, pool, content, words)


def test_wrong_dump_leaves_the_pool_working_and_unchanged(tmp_path: Path) -> None:
    """A 2G pool's dump given to a 1G pool (the issue's 20G/1G case, cheaper)."""
    small = str(tmp_path / "small")
    thinblock("pool", "create", small, "--size", "1G")
    thinblock("volume", "create", small, "v", "--size", "4M")
    big = str(tmp_path / "big")
    thinblock("pool", "create", big, "--size", "2G")
    thinblock("volume", "create", big, "w", "--size", "4M")
    restore_refused(tmp_path, small, dump_of(big), "pool of 2G", "holds 1G", "nothing was changed")
    # Every command still works.
    names = [v["name"] for v in json.loads(thinblock("volume", "list", small, "--json").stdout)]
    assert names == ["v"]
    thinblock("volume", "create", small, "v2", "--size", "1M")
    assert not list(Path(small).glob("metadata.sqlite.*"))  # no copy needed: nothing was replaced


def test_data_path_is_never_taken_from_a_dump(tmp_path: Path, pool: str) -> None:
    victim = tmp_path / "victim.img"
    victim.write_bytes(b"\xab" * (32 << 20))
    dump = dump_of(pool)
    dump["pool"]["data_path"] = str(victim)
    path = tmp_path / "evil.json"
    path.write_text(json.dumps(dump))
    before = db_rows(pool)["volumes"]
    thinblock("pool", "restore", pool, str(path))
    assert victim.read_bytes() == b"\xab" * (32 << 20)  # not one block punched
    assert superblock(pool)["data_path"] is None  # the pool's own file, as before
    assert db_rows(pool)["volumes"] == before
    thinblock("pool", "check", pool)


def test_a_good_restore_switches_at_once_and_keeps_the_old(tmp_path: Path, pool: str) -> None:
    """The old metadata is kept as metadata.sqlite.before-restore; the pool's identity
    (any key a dump may not set) comes from the pool; the transaction id is above both."""
    uuid = superblock(pool)["pool_uuid"]
    before = db_rows(pool)
    dump = dump_of(pool)  # the pool's own commit raises its transaction id beyond 500
    current_tid = superblock(pool)["transaction_id"]
    dump["pool"]["transaction_id"] = current_tid + 1000
    volume(dump, "c")["name"] = "c2"
    path = tmp_path / "d.json"
    path.write_text(json.dumps(dump))
    out = thinblock("pool", "restore", pool, str(path)).stdout
    assert "metadata.sqlite.before-restore" in out
    sb = superblock(pool)
    assert sb["pool_uuid"] == uuid
    assert sb["transaction_id"] > current_tid + 1000
    kept = Path(pool, "metadata.sqlite.before-restore")
    old = sqlite3.connect(f"file:{kept}?mode=ro", uri=True)
    assert [n for (n,) in old.execute("SELECT name FROM volumes ORDER BY name")] == ["a", "a@s1", "c"]
    old.close()
    assert before["volumes"] != db_rows(pool)["volumes"]
    assert not list(Path(pool).glob("*.restore*"))
    names = [v["name"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout)]
    assert sorted(names) == ["a", "a@s1", "c2"]
    thinblock("pool", "check", pool)


def test_restore_onto_a_full_disk_changes_nothing(tmp_path: Path) -> None:
    """A real full filesystem under the pool: the new database cannot be written."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16M", "tmpfs", str(disk)], check=True)
    try:
        pool = make_pool(disk, scratch=tmp_path)
        dump = dump_of(pool)
        for i in range(300):  # a big dump: its database does not fit in what is left
            dump["volumes"].append({**volume(dump, "a"), "id": 100 + i, "name": f"x{i}", "origin_id": None})
        path = tmp_path / "big.json"
        path.write_text(json.dumps(dump))
        before = fingerprint(pool)
        filler = disk / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\1" * (64 << 10))
                    f.flush()
            except OSError:
                pass
        proc = thinblock("pool", "restore", pool, str(path), check=False)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
        assert "nothing was changed" in proc.stderr and "full" in proc.stderr, proc.stderr
        filler.unlink()
        assert fingerprint(pool) == before  # and no metadata.sqlite.restore left
        thinblock("pool", "check", pool)
        thinblock("volume", "create", pool, "after", "--size", "1M")
    finally:
        subprocess.run(["umount", str(disk)], check=True)


# Where an in-process restore is made to fail: each step of writing and switching.
FAIL_AT = {
    "create": ("thinblock.meta.sqlite.SqliteMetadata.create", OSError(28, "No space left on device")),
    "commit": ("thinblock.meta.sqlite.SqliteMetadata.commit", OSError(5, "Input/output error")),
    "checkpoint": ("thinblock.meta.sqlite.SqliteMetadata.checkpoint", sqlite3.OperationalError("disk I/O error")),
    "fold": ("thinblock.meta.sqlite.SqliteMetadata.fold_wal", RuntimeError("mid-write")),
    "keep": ("thinblock.backends.directory.DirLocation._keep_old", OSError(5, "Input/output error")),
}


@pytest.mark.parametrize("step", sorted(FAIL_AT))
def test_a_restore_failing_at_any_step_leaves_the_pool_as_before(
    tmp_path: Path, pool: str, step: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    target, error = FAIL_AT[step]
    dump = dump_of(pool)
    volume(dump, "c")["name"] = "c2"
    path = tmp_path / "d.json"
    path.write_text(json.dumps(dump))
    before = fingerprint(pool)
    calls: list[str] = []

    def fail(*args: object, **kwargs: object) -> None:
        calls.append(step)
        raise error

    monkeypatch.setattr(target, fail)
    if isinstance(error, RuntimeError):  # not an error restore words: it escapes, changing nothing
        with pytest.raises(RuntimeError):
            cli_main(["pool", "restore", pool, str(path)])
    else:
        assert cli_main(["pool", "restore", pool, str(path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("thinblock: error:") and err.count("\n") == 1 and "Traceback" not in err, err
    assert calls == [step]
    monkeypatch.undo()
    assert fingerprint(pool) == before
    thinblock("pool", "check", pool)
    thinblock("pool", "restore", pool, str(path))  # and the same restore then works
    assert "c2" in thinblock("volume", "list", pool).stdout


def test_repair_words_a_failing_metadata_write_in_one_sentence(
    pool: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite's own error (an EIO below it) while repair writes: one sentence, the pool as before."""

    def eio(self: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    before = db_rows(pool)
    monkeypatch.setattr(SqliteMetadata, "checkpoint", eio)
    assert cli_main(["pool", "repair", pool]) == 1
    err = capsys.readouterr().err
    assert err.startswith("thinblock: error:") and "disk I/O error" in err and err.count("\n") == 1, err
    assert "Traceback" not in err
    monkeypatch.undo()
    assert db_rows(pool) == before
    assert not list(Path(pool).glob("*.restore*"))
    thinblock("pool", "check", pool)


# ----- names that reach host paths ----------------------------------------------------


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private runtime dir; afterwards loop devices on this test's files and the FUSE
    daemon this test may have started (by the pid it recorded) are gone."""
    run = tmp_path / "run"
    monkeypatch.setenv("THINBLOCK_RUNTIME_DIR", str(run))
    yield run
    out = subprocess.run(["losetup", "--json", "--list"], capture_output=True, text=True).stdout
    for dev in json.loads(out)["loopdevices"] if out.strip() else []:
        if str(tmp_path) in (dev.get("back-file") or ""):
            subprocess.run(["losetup", "-d", dev["name"]], check=False)
    for info in run.glob("*/daemon.json"):
        with open("/proc/mounts") as f:
            if str(info.parent / "mnt") in f.read():
                subprocess.run(["umount", "-l", str(info.parent / "mnt")], check=False)
        pid = int(json.loads(info.read_text())["pid"])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


@pytest.mark.parametrize("name", ["HOST", "../../victim.img", ".hidden"])
def test_attach_never_binds_a_host_file(tmp_path: Path, runtime: Path, name: str) -> None:
    """Metadata edited behind thinblock's back (or restored by an older one) names a
    volume with a host path: attach and mkfs refuse it before any path is used."""
    victim = tmp_path / "victim.img"
    victim.write_bytes(b"\xcd" * (4 << 20))
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "32M")
    thinblock("volume", "create", pool, "v", "--size", "4M")
    hostile = str(victim) if name == "HOST" else name
    conn = sqlite3.connect(Path(pool) / "metadata.sqlite")
    with conn:
        conn.execute("UPDATE volumes SET name = ? WHERE name = 'v'", (hostile,))
    conn.close()
    for command in ("attach", "mkfs"):
        proc = thinblock(command, pool, hostile, check=False)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "refusing the name" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    out = subprocess.run(["losetup", "--json", "--list"], capture_output=True, text=True).stdout
    assert str(victim) not in out
    assert victim.read_bytes() == b"\xcd" * (4 << 20)
    assert not list(runtime.glob("*/daemon.json"))  # refused before a daemon was started


def test_a_restored_host_path_name_never_reaches_attach(tmp_path: Path, runtime: Path, pool: str) -> None:
    """The issue's path: a dump naming a volume /srv/... is refused, so attach finds no such volume."""
    victim = tmp_path / "victim.img"
    victim.write_bytes(b"\xcd" * (4 << 20))
    dump = dump_of(pool)
    volume(dump, "c")["name"] = str(victim)
    restore_refused(tmp_path, pool, copy.deepcopy(dump), "invalid volume name")
    proc = thinblock("attach", pool, str(victim), check=False)
    assert proc.returncode == 1 and "no volume" in proc.stderr
    assert victim.read_bytes() == b"\xcd" * (4 << 20)


# ----- pools in Ceph --------------------------------------------------------------------


def test_rados_restore_checks_first_and_keeps_a_copy(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The same rules on RADOS: a wrong dump (another pool's size, a host-path name)
    changes nothing; a good one keeps the old metadata as thinblock.NAME.before-restore."""
    locator = new_rados_locator(request, "dumps")
    thinblock("pool", "create", locator, "--size", "64M")
    thinblock("volume", "create", locator, "v", "--size", "4M")
    dump = dump_of(locator)
    listing = thinblock("volume", "list", locator, "--json").stdout
    for edit, words in (
        (_set("pool", "size_bytes", 1 << 30), "another pool's dump"),
        (_set("pool", "block_size", 4096), "another pool's dump"),
        (_set("v", "name", "/srv/images/victim.img"), "invalid volume name"),
    ):
        bad = copy.deepcopy(dump)
        edit(bad)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        proc = thinblock("pool", "restore", locator, str(path), check=False)
        assert proc.returncode == 1 and words in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
        assert thinblock("volume", "list", locator, "--json").stdout == listing
    name = locator.split("/", 1)[1]
    assert rados_objects(f"thinblock.{name}.before-restore") == []
    volume(dump, "v")["name"] = "w"
    path = tmp_path / "good.json"
    path.write_text(json.dumps(dump))
    assert "before-restore" in thinblock("pool", "restore", locator, str(path)).stdout
    assert rados_objects(f"thinblock.{name}.before-restore") == [f"thinblock.{name}.before-restore"]
    assert "w" in thinblock("volume", "list", locator).stdout
    thinblock("pool", "check", locator)


def test_repair_drops_a_staging_volume_left_by_a_killed_job(pool: str) -> None:
    """Repair rebuilds through the same checks as restore: the '.…' staging volume of an
    interrupted job is dropped (as the next open would), not refused by the names rule."""
    conn = sqlite3.connect(Path(pool) / "metadata.sqlite")
    with conn:
        conn.execute("UPDATE volumes SET name = '.import.9' WHERE name = 'c'")
    conn.close()
    thinblock("pool", "repair", pool)
    thinblock("pool", "check", pool)
    names = [v["name"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout)]
    assert sorted(names) == ["a", "a@s1"]


@pytest.mark.parametrize("name", ["/srv/x.img", "../x", "a/b", ".hidden", "..", "", "a\0b", "a\nb", "x" * 256])
def test_child_path_refuses_names_that_leave_their_directory(tmp_path: Path, name: str) -> None:
    with pytest.raises(ThinblockError, match="refusing the name"):
        child_path(tmp_path, name)


def test_child_path_joins_a_tame_name(tmp_path: Path) -> None:
    assert child_path(tmp_path, "vm1@s1") == tmp_path / "vm1@s1"
    assert child_path(str(tmp_path), "a.b-c+d_e") == tmp_path / "a.b-c+d_e"
