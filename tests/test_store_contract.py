"""The data-store contract (store/base.py), one suite run against every store.

Each backend is one line in STORE_KINDS: the registry's stores, each bare and
under the fallback layer, on a sparse file, a real loop device and in memory,
with the optional verbs native or missing.
"""

from __future__ import annotations

import os
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import rados_objects
from thinblock.errors import NotSupportedError
from thinblock.store import STORES
from thinblock.store.base import OPTIONAL_VERBS, DataStore, Support
from thinblock.store.fallback import FallbackStore
from thinblock.store.file import FileStore

SIZE = 8 << 20
BS = 64 << 10


def _file(tmp: Path, none: tuple[str, ...] = ()) -> FileStore:
    path = tmp / "data"
    with open(path, "wb") as f:
        f.truncate(SIZE)
    store = STORES["file"](str(path))
    assert isinstance(store, FileStore)
    store.disable_native(*none)
    return store


def _loop(tmp: Path) -> DataStore:
    backing = tmp / "backing"
    with open(backing, "wb") as f:
        f.truncate(SIZE)
    dev = subprocess.check_output(["losetup", "--find", "--show", str(backing)], text=True).strip()
    store = STORES["file"](dev)
    original = store.close

    def close() -> None:
        original()
        subprocess.run(["losetup", "-d", dev], check=False)

    store.close = close  # type: ignore[method-assign]
    return store


def _rados(object_size: int) -> DataStore:
    """A RADOS store under a fresh prefix in the test cluster; close removes its objects."""
    from thinblock.ceph.cluster import connect

    prefix = f"thinblock_data.contract{uuid.uuid4().hex[:12]}"
    store = STORES["rados"](connect(), os.environ["THINBLOCK_TEST_CEPH_POOL"], prefix, SIZE, object_size=object_size)
    original = store.close

    def close() -> None:
        original()
        for name in rados_objects(prefix + "."):
            connect().ioctx(os.environ["THINBLOCK_TEST_CEPH_POOL"]).remove_object(name)

    store.close = close  # type: ignore[method-assign]
    return store


STORE_KINDS: dict[str, Callable[[Path], DataStore]] = {
    "file": _file,
    "file-no-native": lambda tmp: _file(tmp, OPTIONAL_VERBS),
    "loop-device": _loop,
    "memory": lambda tmp: STORES["memory"](SIZE),
    "memory-no-native": lambda tmp: STORES["memory"](SIZE, native=()),
    "memory-punch-only": lambda tmp: STORES["memory"](SIZE, native=("punch",)),
    "rados": lambda tmp: _rados(4 << 20),
    "rados-small-objects": lambda tmp: _rados(96 << 10),  # pieces straddle objects and blocks
}


@pytest.fixture(params=list(STORE_KINDS))
def raw(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[DataStore]:
    if request.param.startswith("rados"):
        request.getfixturevalue("ceph")
    store = STORE_KINDS[request.param](tmp_path)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def store(raw: DataStore) -> DataStore:
    """The store as the pool uses it: under the one fallback layer."""
    return FallbackStore(raw)


def test_capabilities_are_declared_up_front(raw: DataStore) -> None:
    caps = raw.capabilities()
    assert set(caps) == set(OPTIONAL_VERBS)
    assert all(cap in (Support.NATIVE, Support.NONE) for cap in caps.values())
    wrapped = FallbackStore(raw).capabilities()
    for verb in OPTIONAL_VERBS:
        assert wrapped[verb] is (Support.NATIVE if caps[verb] is Support.NATIVE else Support.EMULATE)


def test_probing_at_open_leaves_no_space_behind(tmp_path: Path) -> None:
    path = tmp_path / "probed"
    with open(path, "wb") as f:
        f.truncate(SIZE)
    for _ in range(3):
        FileStore(str(path)).close()
    assert os.stat(path).st_blocks == 0 and os.stat(path).st_size == SIZE


def test_missing_verbs_refuse_and_change_nothing(raw: DataStore) -> None:
    raw.pwritev(0, [b"\x11" * BS])
    for verb, cap in raw.capabilities().items():
        if cap is Support.NONE:
            with pytest.raises(NotSupportedError):
                getattr(raw, verb)(0, BS)
            assert raw.pread(0, BS) == b"\x11" * BS, f"a refused {verb} changed bytes"


def test_writes_read_back(store: DataStore) -> None:
    data = os.urandom(3 * BS + 123)
    store.pwritev(BS - 7, [data[:1000], memoryview(data)[1000:]])
    assert store.pread(BS - 7, len(data)) == data
    assert store.pread(0, BS - 7) == bytes(BS - 7)
    assert store.size_bytes >= SIZE


def test_punch_and_zero_read_zero(store: DataStore) -> None:
    store.pwritev(0, [b"\xaa" * (4 * BS)])
    store.punch(BS, BS)
    store.zero(2 * BS + 512, 512)
    got = store.pread(0, 4 * BS)
    assert got[:BS] == b"\xaa" * BS
    assert got[BS : 2 * BS] == bytes(BS)
    assert got[2 * BS : 2 * BS + 512] == b"\xaa" * 512
    assert got[2 * BS + 512 : 2 * BS + 1024] == bytes(512)
    assert got[2 * BS + 1024 :] == b"\xaa" * (2 * BS - 1024)


def test_allocate_then_write(store: DataStore) -> None:
    store.preallocate(5 * BS, 2 * BS)  # contents unspecified afterwards; a write defines them
    store.pwritev(5 * BS, [b"\x01" * (2 * BS)])
    assert store.pread(5 * BS, 2 * BS) == b"\x01" * (2 * BS)


def test_batch_verbs(store: DataStore) -> None:
    writes = [(i * BS, [bytes([i + 1]) * 4096]) for i in range(8)]
    store.write_many(writes)
    got = store.read_many([(i * BS, 4096) for i in range(8)])
    assert got == [bytes([i + 1]) * 4096 for i in range(8)]


def test_flush_and_grow(store: DataStore, raw: DataStore) -> None:
    store.pwritev(0, [b"x" * 100])
    store.flush()
    if isinstance(raw, FileStore) and raw.is_block_device:
        return  # a device cannot grow (FileStore.grow says so)
    store.grow(SIZE + BS)
    assert store.size_bytes >= SIZE + BS
    assert store.pread(SIZE, BS) == bytes(BS)


def test_many_threads_on_disjoint_ranges(store: DataStore) -> None:
    def work(t: int) -> None:
        for i in range(40):
            off = (t * 40 + i) * 4096
            store.pwritev(off, [bytes([t + 1]) * 4096])
            if i % 3 == 0:
                store.zero(off, 4096)
                store.pwritev(off, [bytes([t + 1]) * 4096])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in range(6):
        for i in range(40):
            assert store.pread((t * 40 + i) * 4096, 4096) == bytes([t + 1]) * 4096
