"""Files written by export and export-diff: 0600 whatever the umask unless --mode,
never written through a symlink or into a file that is linked elsewhere (a file
replaced with --force is replaced by rename), and the old file kept when the
export fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli import ROOT, thinblock
from tests.nbd_server import Server

MiB = 1 << 20


@pytest.fixture
def pool(tmp_path: Path) -> str:
    path = str(tmp_path / "pool")
    thinblock("pool", "create", path, "--size", "64M")
    thinblock("volume", "create", path, "v", "--size", "1M")
    thinblock("snapshot", "create", path, "v@s")
    return path


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)  # the worst umask: the files must come out private anyway
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o7777


def _refused(proc_args: list[str], says: str, rc: int = 1) -> None:
    proc = thinblock(*proc_args, check=False)
    assert proc.returncode == rc and says in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.usefixtures("open_umask")
def test_exports_are_private_unless_a_mode_is_given(pool: str, tmp_path: Path) -> None:
    thinblock("export", pool, "v", str(tmp_path / "a.raw"))
    thinblock("export-diff", pool, "v@s", str(tmp_path / "a.diff"))
    thinblock("export", pool, "v", str(tmp_path / "a.rbd"), "--format", "rbd")
    assert [_mode(tmp_path / n) for n in ("a.raw", "a.diff", "a.rbd")] == [0o600] * 3
    thinblock("export", pool, "v", str(tmp_path / "b.raw"), "--mode", "0640")
    thinblock("export-diff", pool, "v@s", str(tmp_path / "b.diff"), "--mode", "644")
    assert _mode(tmp_path / "b.raw") == 0o640 and _mode(tmp_path / "b.diff") == 0o644
    for bad in ("8", "4755", "rw", "-1"):  # argparse's usage lines, then the one sentence
        proc = thinblock("export", pool, "v", str(tmp_path / "c.raw"), "--mode", bad, check=False)
        assert proc.returncode == 2 and "invalid mode" in proc.stderr.splitlines()[-1], proc.stderr
    _refused(["export", pool, "v", "-", "--mode", "600"], "--mode applies to a file", rc=2)
    assert not (tmp_path / "c.raw").exists()
    # --force replaces the file: the new one is private again.
    thinblock("export", pool, "v", str(tmp_path / "b.raw"), "--force")
    assert _mode(tmp_path / "b.raw") == 0o600


def test_a_planted_symlink_is_never_followed(pool: str, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    for dest, command in ((tmp_path / "out.raw", "export"), (tmp_path / "out.diff", "export-diff")):
        dest.symlink_to(victim)
        for extra in ([], ["--force"]):
            _refused([command, pool, "v", str(dest), *extra], "is a symbolic link", rc=2)
        assert dest.is_symlink() and victim.read_bytes() == b"keep me"
    dangling = tmp_path / "dangling.raw"
    dangling.symlink_to(tmp_path / "made-by-the-link")
    _refused(["export", pool, "v", str(dangling), "--force"], "is a symbolic link", rc=2)
    assert not (tmp_path / "made-by-the-link").exists()


def test_force_replaces_the_file_and_never_writes_into_it(pool: str, tmp_path: Path) -> None:
    """A hard link to someone's file: --force replaces our name, their bytes stay."""
    theirs = tmp_path / "theirs"
    theirs.write_bytes(b"their bytes")
    dest = tmp_path / "out.raw"
    os.link(theirs, dest)
    thinblock("export", pool, "v", str(dest), "--force")
    assert theirs.read_bytes() == b"their bytes"
    assert dest.read_bytes() == bytes(MiB) and os.stat(dest).st_nlink == 1
    # A failed export leaves the old file as it was and no temporary file behind.
    dest.write_bytes(b"old export")
    _refused(["export", pool, "nosuch", str(dest), "--force"], "nosuch")
    assert dest.read_bytes() == b"old export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.raw", "pool", "theirs"]


@pytest.mark.parametrize("command", ["export", "export-diff"])
def test_a_killed_export_leaves_no_file_at_its_name(pool: str, tmp_path: Path, command: str) -> None:
    """A new file was made at DEST itself (a raw one its full size at once), so an export
    killed half way (SIGKILL, OOM, a power cut) left a file there that looked whole,
    its missing blocks reading as zeros. It is written beside DEST and linked there
    once complete: a kill leaves only the hidden temporary file. The server is stopped
    (SIGSTOP) while the command waits on it with its file open."""
    server = Server(pool, workdir=tmp_path)
    dest = tmp_path / "out" / "backup.raw"
    dest.parent.mkdir()
    try:
        os.kill(server.proc.pid, signal.SIGSTOP)
        proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", command, pool, "v@s", str(dest), "--no-progress"],
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not any(dest.parent.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill()
        proc.wait()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        server.stop()
    left = [p.name for p in dest.parent.iterdir()]
    assert len(left) == 1 and left[0].startswith(".backup.raw.thinblock-"), left
    thinblock(command, pool, "v@s", str(dest))  # the name is free: no --force needed
    assert [p.name for p in dest.parent.iterdir() if not p.name.startswith(".")] == ["backup.raw"]
    if command == "export":
        assert dest.read_bytes() == bytes(MiB)
