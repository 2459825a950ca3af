"""Shared fixtures: pools over every backend (borgstore style)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from thinblock import Pool
from thinblock.backends.memory import MemoryLocation
from thinblock.store.fallback import FallbackStore
from thinblock.store.file import FileStore

BACKENDS = ["sparse", "loop", "emulated", "memory"]


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
    if kind == "loop":
        dev, _ = request.getfixturevalue("loop_file")
        pool = Pool.create(path, size, block_size=block_size, data_path=dev)
    else:
        pool = Pool.create(path, size, block_size=block_size)
    if kind == "emulated":
        inner = pool.store.inner if isinstance(pool.store, FallbackStore) else None
        assert isinstance(inner, FileStore)
        inner.disable_native("punch", "zero", "preallocate")
    return pool


@pytest.fixture(params=BACKENDS)
def pool(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Pool]:
    p = open_pool(request.param, tmp_path, request, size=16 << 20, block_size=64 << 10)
    try:
        yield p
    finally:
        p.close()
