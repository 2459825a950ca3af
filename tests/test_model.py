"""Property test: random operation sequences against the plain model in tests/model.py."""

from __future__ import annotations

import copy
import errno
import os
import random
import shutil
import tempfile
import uuid

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.conftest import remove_rados_pool
from tests.faults import KINDS, STORE_VERBS, Fault, FaultyMeta, FaultyStore, install
from tests.model import Model, ModelError, ModelVolume
from tests.profiles import examples
from thinblock import BlockState, OpError, Pool, ReadOnlyError, ThinblockError
from thinblock.backends import locate
from thinblock.backends.memory import MemoryLocation
from thinblock.core.delta import changed_ranges
from thinblock.core.snapshot import clone, create_snapshot, rollback
from thinblock.core.totals import Totals
from thinblock.errors import CommitError
from thinblock.tools.check import check_metadata, exclusive_problems

BS = 4096
POOL_BLOCKS = 12


def sizes() -> st.SearchStrategy[int]:
    # multiples of 512, often not of the block size, so the last block is partial
    return st.integers(min_value=1, max_value=6 * BS // 512).map(lambda n: n * 512)


def payloads(length: int) -> st.SearchStrategy[bytes]:
    """Zeros, seeded random bytes, or a block-by-block mix of both.

    Built from a few small draws (a seed, a kind per block) so that hypothesis's
    per-example entropy budget goes to the operation sequence, not to bytes.
    """
    kinds = st.lists(st.sampled_from(["zero", "rand"]), min_size=length // BS + 2, max_size=length // BS + 2)
    return st.one_of(
        st.just(bytes(length)),
        st.integers(0, 2**32).map(lambda seed: random.Random(seed).randbytes(length)),
        st.tuples(kinds, st.integers(0, 2**32)).map(lambda ks: _mixed(ks[0], ks[1], length)),
    )


def _mixed(kinds: list[str], seed: int, length: int) -> bytes:
    rng = random.Random(seed)
    out = bytearray()
    for kind in kinds:
        out += bytes(BS) if kind == "zero" else rng.randbytes(BS)
    return bytes(out[:length])


class PoolMachine(RuleBasedStateMachine):
    """The model test on the embedded default backend (a directory: file + SQLite)."""

    def locator(self) -> str:
        return os.path.join(self.dir, "pool")

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="tb-model-")
        self.path = self.locator()
        self.pool = Pool.create(self.path, POOL_BLOCKS * BS, block_size=BS)
        self._wrap()
        self.model = Model(POOL_BLOCKS, BS)
        self.counter = 0
        self._fault: Fault | None = None  # armed for the next _both only
        self.faults_fired = 0

    def _wrap(self) -> None:
        """Put fault injection under the pool: its data store and its metadata store."""
        self.store = FaultyStore(self.pool.store)
        self.meta = FaultyMeta(self.pool.meta)
        install(self.pool, store=self.store)
        install(self.pool, meta=self.meta)

    def teardown(self) -> None:
        self.pool.close()
        meta = locate(self.path).open_meta(readonly=True)
        try:
            assert check_metadata(meta) == []
        finally:
            meta.close()
        shutil.rmtree(self.dir)
        location = locate(self.path)
        if isinstance(location, MemoryLocation):
            location.remove_created()

    # ----- helpers ----------------------------------------------------------------

    def _both(self, name: str, impl, model, touched: tuple[str, int, int] | None = None) -> int | None:
        """Run an operation on both; they must agree on success or on the errno.

        With a fault armed (rule `with_fault`), the layer below may fail during the
        operation. Then: a failed commit (CommitError) leaves the change in memory,
        pending, so the model keeps it; any other failure changed nothing, so the
        model goes back to before. Only bytes overwritten in place in blocks that
        were DATA may hold the old or the new value (a disk write that failed half
        way). The next commit must succeed and `pool check` must pass."""
        fault, self._fault = self._fault, None
        before = copy.deepcopy(self.model) if fault else None
        try:
            model()
            expected = None
        except ModelError as exc:
            expected = exc.code
        target = self.meta if fault is not None and fault.verbs == ("commit",) else self.store
        target.arm(fault)
        try:
            impl()
            got, error = None, None
        except OSError as exc:  # OpError, CommitError, or a raw error of the layer below
            got, error = exc.errno, exc
        finally:
            self.store.arm(None)
            self.meta.arm(None)
        if fault is not None and fault.fired and error is not None:
            assert before is not None
            self._after_fault(name, error, before, touched)
            return None  # the layer below failed: no promise covers that
        assert error is None or isinstance(error, OpError), f"{name}: {error!r}"
        assert got == expected, f"{name}: implementation errno {got}, model errno {expected}"
        return got

    def _after_fault(self, name: str, error: OSError, before: Model, touched: tuple[str, int, int] | None) -> None:
        self.faults_fired += 1
        if not isinstance(error, CommitError):
            after, self.model = self.model, before
            if touched is not None:
                vname, offset, length = touched
                was, now = before.volumes[vname], after.volumes[vname]
                got = self.pool.volume(vname).read(offset, length)
                for i in range(length):
                    pos = offset + i
                    if got[i] == was.data[pos]:
                        continue
                    in_place = was.states[pos // BS] == BlockState.DATA
                    assert in_place and got[i] == now.data[pos], f"{name} failed ({error}) but changed byte {pos}"
                    was.data[pos] = got[i]
        self.pool.commit()  # the next commit succeeds and writes whatever was pending
        assert self.pool.commit_failure is None
        meta = locate(self.path).open_meta(readonly=True)
        try:
            assert check_metadata(meta) == [], f"pool check after a fault in {name}"
        finally:
            meta.close()

    def _pick(self, data: st.DataObject, kind: str | None = None) -> str:
        names = sorted(n for n, v in self.model.volumes.items() if kind is None or v.kind == kind)
        return data.draw(st.sampled_from(names))

    def _range(self, data: st.DataObject, name: str) -> tuple[int, int]:
        # Block-aligned ranges are where whole-block rules apply; mix them with
        # sector-aligned and arbitrary ones.
        size = self.model.volumes[name].size
        unit = data.draw(st.sampled_from([BS, BS, 512, 1]))
        offset = data.draw(st.integers(0, (size - 1) // unit)) * unit
        length = data.draw(st.integers(0, min(size - offset, 3 * BS) // unit)) * unit
        if data.draw(st.booleans()):
            length = size - offset if unit == 1 else min(size - offset, length)
        return offset, length

    def _mutate(self, what: str, name: str, impl, model, touched: tuple[str, int, int] | None = None) -> None:
        """A write-type verb: snapshots refuse it with EPERM and change nothing. One into
        a range the pool reports guaranteed must never fail with ENOSPC."""
        if self.model.volumes[name].kind == "snapshot":
            self._fault = None
            with pytest.raises(ReadOnlyError):
                impl()
            return
        guaranteed = False
        if touched is not None and touched[2]:
            runs = self.pool.volume(name).guaranteed_status(touched[1], touched[2])
            assert runs == self.model.guaranteed(name, touched[1], touched[2]), f"{name}: guaranteed ranges"
            guaranteed = all(sure for _n, sure in runs)
        got = self._both(what, impl, model, touched)
        assert not (guaranteed and got == errno.ENOSPC), f"{what} {touched}: reported guaranteed, got ENOSPC"

    def _maybe_fault(self, data: st.DataObject) -> None:
        """A third of the data operations run with the layer below failing at one of its calls."""
        if self._fault is None and data.draw(st.integers(0, 2), label="fault?") == 0:
            where = data.draw(
                st.sampled_from(["pwritev", "pwritev", "preallocate", "zero", "pread", "flush", "commit"])
            )
            after = data.draw(st.integers(0, 2))
            self._fault = Fault((where,), after, data.draw(st.sampled_from(KINDS)))

    def _has(self, kind: str) -> bool:
        return any(v.kind == kind for v in self.model.volumes.values())

    def _fresh_name(self) -> str:
        self.counter += 1
        return f"v{self.counter}"

    # ----- rules ------------------------------------------------------------------

    @initialize(size=sizes(), detect=st.sampled_from(["on", "on", "off", "unmap"]))
    def first_volume(self, size: int, detect: str) -> None:
        self._new_volume(size, detect)

    @precondition(lambda self: len(self.model.volumes) < 5)
    @rule(size=sizes(), detect=st.sampled_from(["on", "on", "off", "unmap"]))
    def create_volume(self, size: int, detect: str) -> None:
        self._new_volume(size, detect)

    def _new_volume(self, size: int, detect: str) -> None:
        name = self._fresh_name()

        def model() -> None:
            self.model.volumes[name] = ModelVolume(size, BS, detect)

        self._both("create_volume", lambda: self.pool.create_volume(name, size, detect_zeroes=detect), model)

    @precondition(lambda self: len(self.model.volumes) >= 2)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        name = self._pick(data)
        self._both("remove", lambda: self.pool.remove_volume(name), lambda: self.model.remove(name))

    @precondition(lambda self: self.model.volumes and len(self.model.volumes) < 6)
    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        source, name = self._pick(data), self._fresh_name()
        self._both(
            "snapshot",
            lambda: create_snapshot(self.pool, source, name),
            lambda: self.model.snapshot(source, name),
        )

    @precondition(lambda self: self.model.volumes)
    @rule(data=st.data())
    def duplicate_name_is_refused(self, data: st.DataObject) -> None:
        # Refused before any page reference is taken (teardown's pool check would see a leak).
        source, existing = self._pick(data), self._pick(data)
        with pytest.raises(ThinblockError, match="already exists"):
            create_snapshot(self.pool, source, existing)
        if self.model.volumes[source].kind == "snapshot":
            with pytest.raises(ThinblockError, match="already exists"):
                clone(self.pool, source, existing)

    @precondition(lambda self: self._has("snapshot") and len(self.model.volumes) < 6)
    @rule(data=st.data())
    def clone(self, data: st.DataObject) -> None:
        snap, name = self._pick(data, "snapshot"), self._fresh_name()
        self._both("clone", lambda: clone(self.pool, snap, name), lambda: self.model.clone(snap, name))

    @precondition(lambda self: self._has("snapshot") and self._has("volume"))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        name, snap = self._pick(data, "volume"), self._pick(data, "snapshot")
        if not self.model.related(name, snap):
            with pytest.raises(ThinblockError, match="not in the lineage"):
                rollback(self.pool, name, snap)
            return
        self._both("rollback", lambda: rollback(self.pool, name, snap), lambda: self.model.rollback(name, snap))

    @precondition(lambda self: self._has("volume"))
    @rule(data=st.data(), reserve=st.sampled_from([0, -1, BS, 3 * BS, 2 * BS + 1]))
    def set_reserve(self, data: st.DataObject, reserve: int) -> None:
        name = self._pick(data, "volume")
        self._both(
            "set_reserve", lambda: self.pool.set_reserve(name, reserve), lambda: self.model.set_reserve(name, reserve)
        )

    @precondition(lambda self: self.model.volumes)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        name = self._pick(data)
        offset, length = self._range(data, name)
        payload = data.draw(payloads(length))
        self._maybe_fault(data)
        fua = data.draw(st.booleans())
        vol = self.pool.volume(name)
        self._mutate(
            "write",
            name,
            lambda: vol.write(offset, payload, fua=fua),
            lambda: self.model.write(name, offset, payload),
            (name, offset, length),
        )

    # Writes matter most: a second rule doubles their share of the steps.
    @precondition(lambda self: self.model.volumes)
    @rule(data=st.data())
    def write_more(self, data: st.DataObject) -> None:
        self.write(data)

    @precondition(lambda self: self.model.volumes)
    @rule(data=st.data(), no_hole=st.booleans(), fast=st.booleans())
    def write_zeroes(self, data: st.DataObject, no_hole: bool, fast: bool) -> None:
        name = self._pick(data)
        offset, length = self._range(data, name)
        self._maybe_fault(data)
        vol = self.pool.volume(name)
        self._mutate(
            "write_zeroes",
            name,
            lambda: vol.write_zeroes(offset, length, no_hole=no_hole, fast=fast),
            lambda: self.model.zero_or_trim(name, offset, length, no_hole, fast),
            (name, offset, length),
        )

    @precondition(lambda self: self.model.volumes)
    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        name = self._pick(data)
        offset, length = self._range(data, name)
        self._maybe_fault(data)
        vol = self.pool.volume(name)
        self._mutate(
            "trim",
            name,
            lambda: vol.trim(offset, length),
            lambda: self.model.zero_or_trim(name, offset, length, False, False),
            (name, offset, length),
        )

    @precondition(lambda self: self.model.volumes)
    @rule(data=st.data())
    def provision(self, data: st.DataObject) -> None:
        name = self._pick(data)
        offset, length = self._range(data, name)
        self._maybe_fault(data)
        vol = self.pool.volume(name)
        self._mutate(
            "provision",
            name,
            lambda: vol.provision(offset, length),
            lambda: self.model.provision(name, offset, length),
            (name, offset, length),
        )

    @precondition(lambda self: self.model.volumes)
    @rule(data=st.data())
    def sparsify(self, data: st.DataObject) -> None:
        name = self._pick(data)
        offset, length = self._range(data, name)
        self._maybe_fault(data)
        vol = self.pool.volume(name)
        self._mutate(
            "sparsify",
            name,
            lambda: vol.sparsify(offset, length),
            lambda: self.model.sparsify(name, offset, length),
            (name, offset, length),
        )

    @precondition(lambda self: self._has("volume"))
    @rule(data=st.data(), size=sizes())
    def resize(self, data: st.DataObject, size: int) -> None:
        name = self._pick(data, "volume")
        self._both(
            "resize",
            lambda: self.pool.resize_volume(name, size, allow_shrink=True),
            lambda: self.model.resize(name, size),
        )

    @precondition(lambda self: self._has("volume"))
    @rule(data=st.data(), detect=st.sampled_from(["off", "on", "unmap"]))
    def set_detect_zeroes(self, data: st.DataObject, detect: str) -> None:
        name = self._pick(data, "volume")
        self.pool.set_detect_zeroes(name, detect)
        self.model.volumes[name].detect = detect

    @rule()
    def flush(self) -> None:
        self._both("flush", self.pool.flush, lambda: None)

    @rule()
    def reopen(self) -> None:
        self.pool.close()
        self.pool = Pool.open(self.path)
        self._wrap()

    @precondition(lambda self: self.model.volumes)
    @rule(
        data=st.data(),
        where=st.sampled_from([*STORE_VERBS, "commit"]),
        after=st.integers(0, 3),
        kind=st.sampled_from(KINDS),
        op=st.sampled_from(
            ["write", "write", "write_zeroes", "trim", "provision", "flush", "snapshot", "remove", "create_volume"]
        ),
    )
    def with_fault(self, data: st.DataObject, where: str, after: int, kind: str, op: str) -> None:
        """One operation with the layer below failing at one of its calls."""
        if op == "remove" and len(self.model.volumes) < 2:
            op = "write"
        self._fault = Fault((where,), after, kind)
        if op == "create_volume":
            self._new_volume(data.draw(sizes()), "on")
        elif op == "flush":
            self.flush()
        elif op == "write_zeroes":
            self.write_zeroes(data, data.draw(st.booleans()), data.draw(st.booleans()))
        else:
            getattr(self, op)(data)
        self._fault = None

    @precondition(lambda self: self.model.pool_blocks < 2 * POOL_BLOCKS)
    @rule(extra=st.integers(1, 8))
    def grow_pool(self, extra: int) -> None:
        self.model.pool_blocks += extra
        self.pool.grow(self.model.pool_blocks * BS)

    @precondition(lambda self: self.model.volumes)
    @rule(data=st.data())
    def read_range(self, data: st.DataObject) -> None:
        name = self._pick(data)
        offset, length = self._range(data, name)
        assert self.pool.volume(name).read(offset, length) == bytes(
            self.model.volumes[name].data[offset : offset + length]
        )

    @precondition(lambda self: len(self.model.volumes) >= 2)
    @rule(data=st.data())
    def delta_matches_bytes(self, data: st.DataObject) -> None:
        # Metadata-only delta: every range whose bytes differ is reported (it may also
        # report blocks rewritten with identical bytes, never miss a difference).
        a, b = self._pick(data), self._pick(data)
        ma, mb = self.model.volumes[a], self.model.volumes[b]
        end = max(ma.size, mb.size)
        da, db = bytes(ma.data).ljust(end, b"\0"), bytes(mb.data).ljust(end, b"\0")
        covered = bytearray(end)
        for off, n in changed_ranges(self.pool.volume(a), self.pool.volume(b)):
            covered[off : off + n] = b"\1" * n
        for i in range(0, end, 512):
            if da[i : i + 512] != db[i : i + 512]:
                assert covered[i], f"delta {a}->{b} misses a difference at {i}"
        if a == b:
            assert not any(covered)

    # ----- invariants -------------------------------------------------------------

    @invariant()
    def contents_and_states_match(self) -> None:
        for name, mv in self.model.volumes.items():
            vol = self.pool.volume(name)
            assert vol.size_bytes == mv.size
            assert vol.read(0, mv.size) == bytes(mv.data), f"{name}: bytes differ from the model"
            got = [(n, int(s)) for n, s in vol.block_status(0, mv.size)]
            assert got == self.model.block_status(name, 0, mv.size), f"{name}: block states differ"

    def kept_counters_match(self) -> None:
        """The kept counters against a full recount, before anything asks for figures
        (which would recount the stale ones): an exclusive count claiming to be exact is
        exact, every other is a lower bound; totals and set-asides are the sums they
        stand for; and the committed counters check clean."""
        pool = self.pool
        with pool.lock:
            for vol in pool.volumes.values():
                kept, actual = vol.row.exclusive_blocks, vol.recount_exclusive()
                if vol.exclusive_fresh():
                    assert kept == actual, f"{vol.name}: exclusive {kept} kept as exact, {actual} counted"
                else:
                    assert kept <= actual, f"{vol.name}: exclusive {kept} kept as a lower bound, {actual} counted"
            assert pool.volumes.totals == Totals.of(v.row for v in pool.visible().values())
            assert pool.accounts.reserved_total == sum(pool.accounts.set_aside(v) for v in pool.volumes.values())
            assert pool.accounts.reserved_volumes == {v for v in pool.volumes.values() if v.row.reserve_bytes}
            assert all(v.set_aside_counted == pool.accounts.set_aside(v) for v in pool.volumes.values())
        assert pool.between_commits(exclusive_problems) == []

    @invariant()
    def accounting_matches(self) -> None:
        self.kept_counters_match()  # first: the figures below recount stale counts
        status = self.pool.status()
        assert status["size_bytes"] == self.model.pool_blocks * BS
        assert status["used_bytes"] == self.model.used() * BS
        assert status["free_bytes"] == self.model.free() * BS
        assert status["reserved_bytes"] == self.model.reserved() * BS
        kinds = [mv.kind for mv in self.model.volumes.values()]
        assert (status["volume_count"], status["snapshot_count"]) == (kinds.count("volume"), kinds.count("snapshot"))
        assert status["virtual_bytes"] == sum(mv.size for mv in self.model.volumes.values() if mv.kind == "volume")
        assert status["mapped_bytes"] == sum(mv.mapped() for mv in self.model.volumes.values()) * BS
        assert status["data_bytes"] == sum(mv.states.count(2) for mv in self.model.volumes.values()) * BS
        by_name = {v["name"]: v for v in self.pool.volume_list()}
        assert set(by_name) == set(self.model.volumes)
        for name, mv in self.model.volumes.items():
            v = by_name[name]
            assert v["kind"] == mv.kind and v["origin"] == mv.origin
            assert v["mapped_bytes"] == mv.mapped() * BS
            assert v["data_bytes"] == mv.states.count(2) * BS
            assert v["zeroed_bytes"] == mv.states.count(1) * BS
            assert v["provisioned_bytes"] == sum(mv.pinned) * BS
            assert v["exclusive_bytes"] == self.model.exclusive(name) * BS, f"{name}: exclusive"
            assert v["shared_bytes"] == self.model.shared(name) * BS, f"{name}: shared"
            assert v["reserved_bytes"] == self.model.set_aside(name) * BS, f"{name}: set aside"


def _settings(examples_variable: str, default: int) -> settings:
    return settings(
        max_examples=examples(int(os.environ.get(examples_variable, str(default)))),
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


PoolMachine.TestCase.settings = _settings("THINBLOCK_MODEL_EXAMPLES", 150)
TestPoolModel = PoolMachine.TestCase


class MemoryPoolMachine(PoolMachine):
    """The same model test on the memory backends (metadata and data); the data store
    has no native preallocate, so the fallback layer's emulation runs under the model."""

    def locator(self) -> str:
        return f"memory:model-{uuid.uuid4().hex}?native=punch,zero"


MemoryPoolMachine.TestCase.settings = _settings("THINBLOCK_MODEL_EXAMPLES_MEMORY", 80)
TestPoolModelMemory = MemoryPoolMachine.TestCase


class RadosPoolMachine(PoolMachine):
    """The same model test on a pool in the real Ceph cluster: omap metadata with
    epoch-guarded commits, data in RADOS objects (several blocks to an object, so
    partial punches zero inside objects)."""

    def locator(self) -> str:
        return f"rados:{os.environ['THINBLOCK_TEST_CEPH_POOL']}/model-{uuid.uuid4().hex[:12]}"

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            remove_rados_pool(self.path)


RadosPoolMachine.TestCase.settings = _settings("THINBLOCK_MODEL_EXAMPLES_RADOS", 40)
TestPoolModelRados = pytest.mark.usefixtures("ceph")(RadosPoolMachine.TestCase)


def test_block_state_values() -> None:
    # The model's numbering is the implementation's.
    assert (BlockState.UNMAPPED, BlockState.ZEROED, BlockState.DATA) == (0, 1, 2)
