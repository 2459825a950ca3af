"""thinblock as pip installs it: a fresh virtualenv WITHOUT the system's site packages
(so without Debian's libnbd and librados bindings), `pip install` of this source
tree, and the installed `thinblock` script. What needs no Debian binding works; each
feature that needs one says, in one sentence and with exit status 1, which package
to install."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli import ROOT

NO_NBD = "need libnbd's Python binding: apt-get install python3-libnbd (and use a virtualenv made with --system-site-packages)"
NO_RADOS = "need librados's Python binding: apt-get install python3-rados (and use a virtualenv made with --system-site-packages)"


def _clean_env() -> dict[str, str]:
    """The environment without PYTHONPATH: the venv's own install must be what runs."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """bin/ of a fresh virtualenv holding thinblock installed from a copy of this tree
    (a copy, so that pip's in-tree build leaves nothing in the worktree)."""
    work = tmp_path_factory.mktemp("packaging")
    tree = work / "tree"
    tree.mkdir()
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    env = _clean_env()
    started = time.monotonic()
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(work / "venv")], check=True, env=env, timeout=120)
    bin_dir = work / "venv" / "bin"
    done = subprocess.run(
        [str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(tree)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"fresh virtualenv and pip install: {time.monotonic() - started:.1f} s")
    yield bin_dir


def run(bin_dir: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    env = _clean_env()
    proc = subprocess.run([str(bin_dir / "thinblock"), *args], capture_output=True, text=True, env=env, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr
    if ok:
        assert proc.returncode == 0, f"thinblock {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc


def test_the_venv_sees_no_debian_binding(venv: Path) -> None:
    """The premise: the installed thinblock comes from the venv, and neither binding is there."""
    probe = "import importlib.util as u, thinblock; print(thinblock.__file__, u.find_spec('nbd'), u.find_spec('rados'))"
    out = subprocess.run(
        [str(venv / "python"), "-c", probe], capture_output=True, text=True, check=True, cwd="/", env=_clean_env()
    )
    where, nbd_spec, rados_spec = out.stdout.split()
    assert where.startswith(str(venv.parent)) and nbd_spec == rados_spec == "None"


def test_everything_without_a_debian_binding_works(venv: Path, tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    run(venv, "pool", "create", pool, "--size", "64M")
    run(venv, "volume", "create", pool, "v", "--size", "8M")
    image = tmp_path / "in.raw"
    payload = bytes(range(256)) * 4096  # 1 MiB of data, then 3 MiB of hole
    with open(image, "wb") as f:
        f.write(payload)
        f.truncate(4 << 20)
    run(venv, "import", str(image), pool, "w", "--no-progress")
    run(venv, "export", pool, "w", str(tmp_path / "out.raw"), "--no-progress")
    assert (tmp_path / "out.raw").read_bytes() == image.read_bytes()
    assert "v" in run(venv, "volume", "list", pool).stdout

    sock = tmp_path / "nbd.sock"
    env = _clean_env()
    server = subprocess.Popen(
        [str(venv / "thinblock"), "serve", pool, "--socket", str(sock)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert server.stdout is not None
        for line in server.stdout:
            if line.startswith("ready"):
                break
        else:
            raise AssertionError(f"serve exited before it was ready: {server.stderr.read() if server.stderr else ''}")
        info = subprocess.run(
            ["nbdinfo", "--size", f"nbd+unix:///w?socket={sock}"], capture_output=True, text=True, timeout=60
        )
        assert info.returncode == 0 and int(info.stdout) == 4 << 20, info.stdout + info.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=60)
    assert server.returncode == 0 and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("args", "feature", "sentence"),
    [
        (["import", "{tmp}/in.qcow2", "{pool}", "q"], "qcow2 imports", NO_NBD),
        (["import", "nbd+unix:///x?socket={tmp}/none.sock", "{pool}", "n"], "NBD sources and targets", NO_NBD),
        (["export", "{pool}", "v", "nbd+unix:///x?socket={tmp}/none.sock"], "NBD sources and targets", NO_NBD),
        (["pool", "create", "rados:x/y", "--size", "1G"], "rados: pools", NO_RADOS),
        (["pool", "status", "rados:x/y"], "rados: pools", NO_RADOS),
    ],
)
def test_a_missing_binding_names_its_package(
    venv: Path, tmp_path: Path, args: list[str], feature: str, sentence: str
) -> None:
    pool = str(tmp_path / "pool")
    run(venv, "pool", "create", pool, "--size", "64M")
    run(venv, "volume", "create", pool, "v", "--size", "8M")
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(tmp_path / "in.qcow2"), "8M"], check=True)
    proc = run(venv, *[a.format(tmp=tmp_path, pool=pool) for a in args], ok=False)
    assert proc.returncode == 1
    assert proc.stderr == f"thinblock: error: {feature} {sentence}\n"
    assert [v["name"] for v in json.loads(run(venv, "volume", "list", pool, "--json").stdout)] == ["v"]  # nothing made


def test_the_install_holds_every_module_and_the_command(venv: Path) -> None:
    """Nothing of the source tree is left out of the package, and the entry point is the CLI."""
    from thinblock import __version__

    site = next((venv.parent / "lib").glob("python3*/site-packages/thinblock"))
    src = ROOT / "src" / "thinblock"
    wanted = sorted(str(p.relative_to(src)) for p in src.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    have = sorted(str(p.relative_to(site)) for p in site.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert have == wanted
    assert run(venv, "--version").stdout.strip() == f"thinblock {__version__}"
