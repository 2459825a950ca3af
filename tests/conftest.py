"""Shared fixtures: pools over every backend (borgstore style)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import ceph_cluster, profiles
from thinblock import Pool
from thinblock.backends import locate
from thinblock.backends.memory import MemoryLocation
from thinblock.store.base import DataStore, FilterStore
from thinblock.store.file import FileStore

# Hypothesis runs derandomized unless a fuzz run asks otherwise (tests/profiles.py).
profiles.register()

BACKENDS = ["sparse", "loop", "emulated", "memory", "rados"]


# Every process this run starts inherits this marker: the leak check below counts
# (and ends) only those, never another run's or anyone else's on the machine.
SESSION_MARKER = "THINBLOCK_TEST_SESSION"
os.environ.setdefault(SESSION_MARKER, uuid.uuid4().hex)


def _ours(pid: str) -> bool:
    """Whether process pid carries this run's marker in its environment."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{SESSION_MARKER}={os.environ[SESSION_MARKER]}".encode() in environ


def _kernel_and_daemons(base: str) -> set[str]:
    """Loop devices and thinblock FUSE mounts over files below base (this run's
    temporary directory), and thinblock server/daemon processes this run started."""
    found = set()
    out = subprocess.run(["losetup", "--list", "--noheadings", "-O", "NAME,BACK-FILE"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        fields = line.split(None, 1)
        if len(fields) == 2 and fields[1].strip().startswith(base):
            found.add(f"loop device {line.strip()}")
    with open("/proc/mounts") as f:
        found |= {
            f"FUSE mount {line.split()[1]}"
            for line in f
            if line.split()[2] == "fuse.thinblock" and line.split()[1].startswith(base)
        }
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in args if a]
        if state != "Z" and "thinblock" in words and ({"serve", "fuse-daemon"} & set(words)) and _ours(pid):
            found.add(f"process {pid}: {' '.join(words)}")
    return found


@pytest.fixture(scope="session", autouse=True)
def nothing_leaks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The whole run leaves no loop device, FUSE mount or thinblock process behind,
    whether its tests passed or failed; a leak fails the run (and is cleaned up).
    Only what this run made counts: parallel runs on one machine stay apart."""
    base = os.path.realpath(tmp_path_factory.getbasetemp())
    before = _kernel_and_daemons(base)
    yield
    deadline = time.monotonic() + 10  # daemons told to stop may still be committing
    while (leaked := _kernel_and_daemons(base) - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    for item in sorted(leaked):
        if item.startswith("loop device "):
            subprocess.run(["losetup", "-d", item.split()[2]], check=False)
        elif item.startswith("FUSE mount "):
            subprocess.run(["umount", "-l", item.split()[2]], check=False)
        else:
            with contextlib.suppress(OSError):
                os.kill(int(item.split()[1].rstrip(":")), 9)
    assert not leaked, "the test run leaked: " + "; ".join(sorted(leaked))


@pytest.fixture(scope="session")
def ceph() -> Iterator[str]:
    """A real Ceph cluster; returns the Ceph pool tests may use. scripts/test starts
    one for the whole run (CEPH_CONF, THINBLOCK_TEST_CEPH_POOL); otherwise this
    starts one for the session and stops it at the end, whatever happened."""
    if os.environ.get("CEPH_CONF") and os.environ.get("THINBLOCK_TEST_CEPH_POOL"):
        yield os.environ["THINBLOCK_TEST_CEPH_POOL"]
        return
    directory = tempfile.mkdtemp(prefix="tb-ceph-")
    try:
        os.environ["CEPH_CONF"] = ceph_cluster.start(directory)
        os.environ["THINBLOCK_TEST_CEPH_POOL"] = ceph_cluster.TEST_POOL
        yield ceph_cluster.TEST_POOL
    finally:
        ceph_cluster.stop(directory)
        os.environ.pop("CEPH_CONF", None)
        os.environ.pop("THINBLOCK_TEST_CEPH_POOL", None)
        shutil.rmtree(directory, ignore_errors=True)


def rados_objects(prefix: str) -> list[str]:
    """Names of the objects in the test Ceph pool that start with prefix."""
    from thinblock.ceph.cluster import connect

    io = connect().ioctx(os.environ["THINBLOCK_TEST_CEPH_POOL"])
    return sorted(o.key for o in io.list_objects() if o.key.startswith(prefix))


def remove_rados_pool(locator: str) -> None:
    """Remove everything a thinblock pool in the test Ceph pool left there."""
    from thinblock.backends.rados import RadosLocation
    from thinblock.ceph.cluster import connect

    location = locate(locator)
    assert isinstance(location, RadosLocation)
    io = connect().ioctx(location.ceph_pool)
    prefixes = [location.meta_object + "."]
    with contextlib.suppress(Exception):  # cleaning up whatever is there
        prefixes.append(location.data_prefix(location.open_meta(readonly=True).superblock()) + ".")
    for o in list(io.list_objects()):
        if o.key == location.meta_object or o.key.startswith(tuple(prefixes)):
            io.remove_object(o.key)


def new_rados_locator(request: pytest.FixtureRequest, label: str = "t") -> str:
    """A fresh rados: locator in the test cluster, removed after the test."""
    ceph_pool = request.getfixturevalue("ceph")
    locator = f"rados:{ceph_pool}/{label}-{uuid.uuid4().hex[:12]}"
    request.addfinalizer(lambda: remove_rados_pool(locator))
    return locator


def make_loop(path: Path, size: int) -> str:
    with open(path, "wb") as f:
        f.truncate(size)
    return subprocess.check_output(["losetup", "--find", "--show", str(path)], text=True).strip()


@pytest.fixture
def loop_file(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A loop device over a sparse file: a real raw block device for the pool."""
    if os.geteuid() != 0:
        pytest.fail("the loop-device backend needs root (CI runs as root)")
    backing = tmp_path / "backing.img"
    dev = make_loop(backing, 64 << 20)
    try:
        yield dev, backing
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def open_pool(kind: str, tmp_path: Path, request: pytest.FixtureRequest, *, size: int, block_size: int) -> Pool:
    path = str(tmp_path / "pool")
    if kind == "memory":
        locator = f"memory:{uuid.uuid4().hex}"
        request.addfinalizer(lambda: MemoryLocation(locator.partition(":")[2]).remove_created())
        return Pool.create(locator, size, block_size=block_size)
    if kind == "rados":
        # One block per object, so that what the cluster holds is exact per block.
        return Pool.create(new_rados_locator(request), size, block_size=block_size, object_size=block_size)
    if kind == "loop":
        dev, _ = request.getfixturevalue("loop_file")
        pool = Pool.create(path, size, block_size=block_size, data_path=dev)
    else:
        pool = Pool.create(path, size, block_size=block_size)
    if kind == "emulated":
        inner = raw_store(pool)
        assert isinstance(inner, FileStore)
        inner.disable_native("punch", "zero", "preallocate")
    return pool


def raw_store(pool: Pool) -> DataStore:
    """The backend's own store under the pool's layers (fallback, owner header)."""
    store = pool.store
    while isinstance(store, FilterStore):
        store = store.inner
    return store


@pytest.fixture(params=BACKENDS)
def pool(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pool]:
    p = open_pool(request.param, tmp_path, request, size=16 << 20, block_size=64 << 10)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(autouse=True)
def fixed_random_seed() -> None:
    """Payloads drawn from `random` are the same bytes on every run (no random seed in CI)."""
    random.seed(0x7B10C)
