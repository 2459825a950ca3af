"""Listing many exports: NBD_OPT_LIST and nbdinfo --list over thousands of exports,
the descriptions they carry, the contexts an export offers, and the registry's id
index and dependents index under every change of the registry.

The listing tests never time anything: the server's own negotiation limit (30 s
from connect to the first request, Limits.handshake_s) is the bound. nbdinfo --list
lists every export, then asks each for its information and its metadata contexts,
all on one connection: a listing that costs O(exports) per export (as it did, with
every snapshot of the pool offered by every export) runs past the limit at this
scale, and the server hangs up.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
from bench.scale_pools import export_names, make_many_exports
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.nbd_server import Server, connect, listed_exports, offered_contexts
from thinblock import Pool
from thinblock.core.snapshot import clone, create_snapshot, publish_staged, stage, stage_empty
from thinblock.errors import ThinblockError

EXPORTS = 4000
BS = 64 << 10
_TAKEN = r"taken \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pool = tmp_path_factory.mktemp("listing") / "pool"
    make_many_exports(pool, EXPORTS)
    server = Server(str(pool))
    try:
        yield server
    finally:
        server.stop()
        assert "Traceback" not in server.log.read_text(), server.log.read_text()


def expected_description(name: str) -> str:
    """The description of an export make_many_exports made, as a pattern: a snapshot
    names itself and its volume, a volume itself, and nothing names any other export."""
    if "@" in name:
        return re.escape(f"thinblock snapshot {name} of {name.removesuffix('@s')}, ") + _TAKEN
    return re.escape(f"thinblock volume {name}")


def check_listing(listed: list[tuple[str, str]]) -> None:
    volumes, snapshots = export_names(EXPORTS)
    assert [name for name, _ in listed] == sorted(volumes + snapshots)
    for name, description in listed:
        assert re.fullmatch(expected_description(name), description), (name, description)


def test_nbdinfo_lists_every_export_with_its_description_and_contexts(many: Server) -> None:
    done = subprocess.run(
        ["nbdinfo", "--list", "--json", f"nbd+unix://?socket={many.socket}"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    exports = json.loads(done.stdout)["exports"]
    check_listing([(e["export-name"], e["description"]) for e in exports])
    snapshots = set(export_names(EXPORTS)[1])
    for e in exports:
        name = e["export-name"]
        # A volume offers its own snapshot's changes; no export lists another's.
        changed = [ctx for ctx in e["contexts"] if ctx.startswith("thinblock:changed:")]
        assert changed == ([f"thinblock:changed:{name}@s"] if f"{name}@s" in snapshots else []), (name, e["contexts"])
        assert {"base:allocation", "thinblock:guaranteed"} <= set(e["contexts"])


def test_libnbd_opt_list_lists_every_export(many: Server) -> None:
    listed = listed_exports(many)
    assert len(listed) == EXPORTS
    check_listing(listed)


def test_contexts_of_a_volume_and_any_snapshot_by_name(many: Server) -> None:
    assert offered_contexts(many, "v000001") == [
        "base:allocation",
        "thinblock:guaranteed",
        "thinblock:changed:v000001@s",
    ]
    assert offered_contexts(many, "v000001@s") == ["base:allocation", "thinblock:guaranteed"]
    # Not listed on another export, a snapshot can still be asked for there by name.
    h = connect(many, "v000002", ("thinblock:changed:v000001@s", "thinblock:changed:nosuch"))
    assert h.can_meta_context("thinblock:changed:v000001@s")
    assert not h.can_meta_context("thinblock:changed:nosuch")
    h.shutdown()


# ----- the registry's indexes --------------------------------------------------------


def check_registry(pool: Pool) -> None:
    """The id index and the dependents index say what a scan of the registry says."""
    volumes = pool.volumes
    assert len(volumes.by_id) == len(volumes)
    for vol in volumes.values():
        assert pool.volume_by_id(vol.row.id) is vol
        scan = sorted((v for v in volumes.values() if v.row.origin_id == vol.row.id), key=lambda v: v.name)
        assert volumes.dependents(vol.row.id, pool.lock) == scan, vol.name
    assert pool.volume_by_id(None) is None


class RegistryMachine(RuleBasedStateMachine):
    """Every verb that changes the registry, then a reopen (lazy root tables): the
    indexes stay exact, removed volumes are gone from them, and data reads back."""

    def __init__(self) -> None:
        super().__init__()
        self.dir: Path | None = None
        self.pool: Pool | None = None
        self.data: dict[str, bytes] = {}  # name -> the first block's first bytes
        self.removed: list[int] = []
        self.n = 0

    @initialize()
    def create(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tb-registry-"))
        self.pool = Pool.create(str(self.dir / "pool"), 64 << 20)
        self.pool.create_volume("base", 4 * BS)
        self.data["base"] = bytes(16)

    def teardown(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    @property
    def p(self) -> Pool:
        assert self.pool is not None
        return self.pool

    def names(self, kind: str | None = None) -> list[str]:
        return sorted(n for n, v in self.p.visible().items() if kind is None or v.row.kind == kind)

    @precondition(lambda self: self.pool is not None and bool(self.names("volume")))
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.names("volume")))
        payload = bytes([self.n % 251 + 1]) * 16
        self.n += 1
        self.p.volume(name).write(0, payload)
        self.data[name] = payload

    @rule(data=st.data())
    def snapshot(self, data: st.DataObject) -> None:
        source = data.draw(st.sampled_from(self.names()))
        name = self.fresh("s")
        create_snapshot(self.p, source, name)
        self.data[name] = self.data[source]

    @precondition(lambda self: self.pool is not None and bool(self.names("snapshot")))
    @rule(data=st.data())
    def clone_one(self, data: st.DataObject) -> None:
        source = data.draw(st.sampled_from(self.names("snapshot")))
        name = self.fresh("c")
        clone(self.p, source, name)
        self.data[name] = self.data[source]

    @rule(data=st.data())
    def rename(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.names()))
        kind = self.p.volume(name).row.kind
        new = self.fresh("r")
        self.p.rename_volume(name, new, kind=kind)
        self.data[new] = self.data.pop(name)

    @precondition(lambda self: self.pool is not None and len(self.names()) > 1)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.names()))
        self.removed.append(self.p.volume(name).row.id)
        self.p.remove_volume(name)
        del self.data[name]

    @precondition(lambda self: self.pool is not None and bool(self.names("volume")))
    @rule(data=st.data(), publish=st.booleans())
    def staged(self, data: st.DataObject, publish: bool) -> None:
        source = self.p.volume(data.draw(st.sampled_from(self.names("volume"))))
        copy = stage(self.p, source, "test")
        empty = stage_empty(self.p, "test", 4 * BS, "on")
        if publish:
            a, b = self.fresh("p"), self.fresh("e")
            publish_staged(self.p, [(copy, a), (empty, b)])
            self.data[a], self.data[b] = self.data[source.name], bytes(16)
        else:
            for vol in (copy, empty):
                self.removed.append(vol.row.id)
                self.p.remove_volume(vol.name)

    @rule()
    def taken_name(self) -> None:
        first, last = self.names()[0], self.names()[-1]
        with pytest.raises(ThinblockError):
            self.p.rename_volume(first, last, kind=self.p.volume(first).row.kind)

    @rule()
    def reopen(self) -> None:
        self.p.close()
        assert self.dir is not None
        self.pool = Pool.open(str(self.dir / "pool"))
        self.removed = []  # a reopened pool may give a removed volume's id to the next one

    @invariant()
    def indexes_hold(self) -> None:
        if self.pool is None:
            return
        check_registry(self.p)
        for vid in self.removed:
            assert self.p.volume_by_id(vid) is None
        assert set(self.names()) == set(self.data)
        for name, first in self.data.items():
            assert self.p.volume(name).read(0, 16) == first, name


RegistryMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRegistry = RegistryMachine.TestCase


def test_registry_refuses_changes_that_bypass_the_id_index(tmp_path: Path) -> None:
    with Pool.create(str(tmp_path / "pool"), 16 << 20) as pool:
        pool.create_volume("a", BS)
        for change in (lambda: pool.volumes.update({}), lambda: pool.volumes.pop("a"), pool.volumes.clear):
            with pytest.raises(TypeError):
                change()
        check_registry(pool)
