"""Runtime directories belong to their user alone, and a second, real, unprivileged
user gets sentences, not tracebacks: it cannot pre-create or swap another user's
runtime tree, attach or mkfs without loop devices, or read a pool it may not read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy
import pytest

from tests.cli import ROOT, thinblock
from thinblock import runtime
from thinblock.backends import locate
from thinblock.errors import ThinblockError
from thinblock.frontends.fuse.attach import runtime_dir_for


@pytest.fixture(scope="module")
def other() -> Iterator[str]:
    """A real unprivileged user, made for these tests and removed after."""
    user = f"tbr{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/false", user], check=True)
    try:
        yield user
    finally:
        subprocess.run(["userdel", user], check=False)


@pytest.fixture(scope="module")
def code() -> Iterator[str]:
    """A copy of thinblock the other user can read (the checkout may sit where it cannot)."""
    where = tempfile.mkdtemp(prefix="tb-code-", dir="/tmp")
    shutil.copytree(ROOT / "src" / "thinblock", os.path.join(where, "thinblock"))
    # And numpy, which the core imports (the user runs Debian's python3, outside the venv;
    # the venv is built on it, so the same compiled modules load). A wheel keeps the
    # libraries numpy links against beside it, in numpy.libs.
    site = Path(numpy.__file__).parent.parent
    for name in ("numpy", "numpy.libs"):
        if (site / name).is_dir():
            shutil.copytree(site / name, os.path.join(where, name))
    subprocess.run(["chmod", "-R", "a+rX", where], check=True)
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory like /tmp: everyone may create in it, no one may remove another's."""
    path = Path(tempfile.mkdtemp(prefix="tb-sticky-", dir="/tmp"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_user(user: str, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """thinblock ARGS as user, with a login's environment (no runtime-dir override)."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",  # an ordinary user's: no sbin
        "HOME": "/tmp",
        "PYTHONPATH": code,
        "THINBLOCK_TEST_SESSION": os.environ["THINBLOCK_TEST_SESSION"],
    }
    cmd = ["runuser", "-u", user, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items())]
    return subprocess.run(
        [*cmd, "/usr/bin/python3", "-m", "thinblock", *args], capture_output=True, text=True, timeout=60
    )


def one_sentence(proc: subprocess.CompletedProcess[str], says: str) -> None:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert says in proc.stderr, proc.stderr


def root_runs(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "THINBLOCK_RUNTIME_DIR": str(run_dir)}
    # Bounded: a serve that (wrongly) starts is ended by the timeout, and fails the test.
    return subprocess.run(
        [sys.executable, "-m", "thinblock", *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_a_runtime_dir_another_user_made_or_swapped_is_refused(other: str, shared: Path, tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "disk", "--size", "16M")
    # The other user makes the directory first, open to all, as /tmp/thinblock-UID could be.
    planted = shared / "run"
    subprocess.run(["runuser", "-u", other, "--", "mkdir", "-m", "0777", str(planted)], check=True)
    one_sentence(root_runs(planted, "attach", pool, "disk"), "another user made it")
    assert list(planted.iterdir()) == []  # nothing of ours went in
    # A symlink swapped in for the tree, pointing at a directory of our own (so the
    # owner check alone would pass it): refused, never followed.
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    swapped = shared / "swapped"
    subprocess.run(["runuser", "-u", other, "--", "ln", "-s", str(ours), str(swapped)], check=True)
    one_sentence(root_runs(swapped, "attach", pool, "disk"), "is a symbolic link")
    assert list(ours.iterdir()) == []
    # One level down: a pool's directory swapped for a link inside a tree of ours.
    base = shared / "mine"
    base.mkdir(mode=0o700)
    os.symlink(str(ours), base / runtime_dir_for(locate(pool).key()).name)
    one_sentence(root_runs(base, "attach", pool, "disk"), "is a symbolic link")
    assert json.loads(root_runs(base, "attach", "--list", "--json").stdout) == []


def test_a_rados_pool_runtime_dir_another_user_made_is_refused(
    other: str, shared: Path, request: pytest.FixtureRequest
) -> None:
    from tests.conftest import new_rados_locator

    locator = new_rados_locator(request, "rt")
    thinblock("pool", "create", locator, "--size", "1G")
    planted = shared / "run"
    subprocess.run(["runuser", "-u", other, "--", "mkdir", "-m", "0777", str(planted)], check=True)
    one_sentence(root_runs(planted, "serve", locator), "another user made it")
    assert list(planted.iterdir()) == []


def test_runtime_base_and_modes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where the tree is, and that one of ours with a wider mode is narrowed to 0700."""
    monkeypatch.delenv("THINBLOCK_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert runtime.runtime_base() == "/run/user/1000/thinblock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime.runtime_base() == "/tmp/thinblock-1000"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/0")
    assert runtime.runtime_base() == "/run/thinblock"  # one place for every root shell
    monkeypatch.undo()
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o755)
    os.chmod(wide, 0o755)
    monkeypatch.setenv("THINBLOCK_RUNTIME_DIR", str(wide))
    made = runtime.private_runtime_dir("rados", "p", "n")
    assert made == str(wide / "rados" / "p" / "n")
    for path in (wide, wide / "rados", wide / "rados" / "p", Path(made)):
        assert os.stat(path).st_mode & 0o777 == 0o700, path
    with pytest.raises(ThinblockError, match="cannot name a directory"):
        runtime.private_runtime_dir("..")


def test_attach_and_mkfs_as_an_ordinary_user_say_why(other: str, code: str, shared: Path) -> None:
    pool = str(shared / "pool")
    assert as_user(other, code, "pool", "create", pool, "--size", "64M").returncode == 0
    assert as_user(other, code, "volume", "create", pool, "v", "--size", "16M").returncode == 0
    for command in (["attach", pool, "v"], ["mkfs", pool, "v"]):
        one_sentence(as_user(other, code, *command), "needs root (or access to /dev/loop-control)")


def test_a_pool_another_user_may_not_read_says_so(other: str, code: str, shared: Path) -> None:
    pool = shared / "pool"
    thinblock("pool", "create", str(pool), "--size", "64M")
    one_sentence(as_user(other, code, "pool", "status", str(pool)), "cannot read pool")  # the directory is 0700
    os.chmod(pool, 0o755)  # the directory opened, the metadata still the owner's alone
    one_sentence(as_user(other, code, "pool", "status", str(pool)), "permission denied on metadata.sqlite")
    os.chmod(pool / "metadata.sqlite", 0o000)
    one_sentence(as_user(other, code, "pool", "status", str(pool)), "cannot read pool")
