"""Pools in a real Ceph cluster: what only the RADOS backend has. Objects and zeros,
takeover and fencing between two real `thinblock serve` processes, a pool quota,
the commit journal and omap paging, and bad configurations. The contract suites,
the model test, the block contract, the crash test and the NBD client tests run
on RADOS too (through the registries and fixtures)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import nbd
import pytest
import rados

from tests.conftest import new_rados_locator, rados_objects, remove_rados_pool
from tests.nbd_server import Server, thinblock
from thinblock import Pool
from thinblock.backends import locate
from thinblock.backends.rados import RadosLocation
from thinblock.ceph.cluster import connect
from thinblock.errors import PoolBusyError, ThinblockError
from thinblock.meta import rados as meta_rados
from thinblock.meta.base import Transaction, VolumeRow
from thinblock.store.owned import RADOS_TAIL_OFFSET
from thinblock.tools.check import check_metadata

MiB = 1 << 20
LEASE = "3"  # seconds, for the servers these tests start


def _rados_location(locator: str) -> RadosLocation:
    location = locate(locator)
    assert isinstance(location, RadosLocation)
    return location


def _data_objects(locator: str) -> list[str]:
    """The objects holding blocks (not the owner header and birth table above them)."""
    location = _rados_location(locator)
    sb = location.open_meta(readonly=True).superblock()
    tail = RADOS_TAIL_OFFSET // int(sb["object_size"])
    return [o for o in rados_objects(location.data_prefix(sb) + ".") if int(o.rsplit(".", 1)[1], 16) < tail]


def _server(locator: str, work: Path, name: str, *extra: str) -> Server:
    os.environ["THINBLOCK_RADOS_LEASE_S"] = LEASE
    try:
        work.mkdir(exist_ok=True)
        return Server(locator, "--socket", str(work / f"{name}.sock"), *extra, workdir=work)
    finally:
        del os.environ["THINBLOCK_RADOS_LEASE_S"]


def _server_once_the_lease_lapses(locator: str, work: Path, name: str) -> Server:
    deadline = time.monotonic() + float(LEASE) + 15
    while True:
        try:
            return _server(locator, work, name)
        except RuntimeError as exc:
            assert "already held" in str(exc) and time.monotonic() < deadline, exc
            time.sleep(0.5)


def _handle(server: Server, export: str = "v") -> nbd.NBD:
    h = nbd.NBD()
    h.connect_uri(f"nbd+unix:///{export}?socket={server.socket}")
    return h


def test_cli_on_a_rados_pool(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Every pool command takes rados:CEPHPOOL/NAME; status shows the Ceph pool's figures."""
    locator = new_rados_locator(request, "cli")
    out = thinblock("pool", "create", locator, "--size", "1G", "--object-size", "1M").stdout
    assert locator in out
    sb = _rados_location(locator).open_meta(readonly=True).superblock()
    assert sb["object_size"] == MiB and sb["format_version"] == 3
    thinblock("volume", "create", locator, "v", "--size", "256M")
    status = json.loads(thinblock("pool", "status", locator, "--json").stdout)
    assert status["ceph_pool"] == os.environ["THINBLOCK_TEST_CEPH_POOL"]
    assert {"ceph_pool_stored_bytes", "ceph_pool_objects", "ceph_cluster_bytes"} <= set(status), status
    assert "Ceph pool" in thinblock("pool", "status", locator).stdout
    with Pool.open(locator) as pool:
        pool.volume("v").write(3 * MiB, b"\xab" * MiB)
    thinblock("snapshot", "create", locator, "v", "s1")
    thinblock("volume", "clone", locator, "s1", "c")
    assert json.loads(thinblock("delta", locator, "s1", "v", "--json").stdout)["ranges"] == []
    assert "v" in thinblock("volume", "list", locator).stdout
    # --ceph-conf before the command or after it
    assert "v" in thinblock("--ceph-conf", os.environ["CEPH_CONF"], "volume", "list", locator).stdout
    assert "v" in thinblock("volume", "list", locator, "--ceph-conf", os.environ["CEPH_CONF"]).stdout
    thinblock("pool", "check", locator)
    dump = tmp_path / "dump.txt"
    thinblock("pool", "dump", locator, "-o", str(dump))
    thinblock("pool", "restore", locator, str(dump))
    thinblock("pool", "repair", locator)
    thinblock("pool", "check", locator)
    with Pool.open(locator) as pool:
        assert pool.volume("c").read(3 * MiB, MiB) == b"\xab" * MiB
    refused = thinblock("pool", "create", locator, "--size", "1G", check=False)
    assert refused.returncode == 1 and "already exists" in refused.stderr
    bad = thinblock("pool", "create", f"{locator}x", "--size", "1G", "--object-size", "3M", check=False)
    assert bad.returncode == 1 and "object size" in bad.stderr


def test_zero_writes_create_no_objects(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Written zeros, WRITE_ZEROES with and without NO_HOLE, and trim create no RADOS
    object (NO_HOLE sets the space aside in the pool only); data does; trimming
    frees the objects."""
    locator = new_rados_locator(request, "zeros")
    thinblock("pool", "create", locator, "--size", "2G", "--object-size", "1M")
    thinblock("volume", "create", locator, "v", "--size", "1G")
    server = _server(locator, tmp_path, "a")
    try:
        h = _handle(server)
        h.pwrite(bytes(64 * MiB), 0)  # literal zeros (detect_zeroes on)
        h.zero(256 * MiB, 64 * MiB)
        h.zero(64 * MiB, 768 * MiB, nbd.CMD_FLAG_NO_HOLE)  # provisioned in the pool, nothing in RADOS
        h.trim(64 * MiB, 128 * MiB)
        h.flush()
        assert _data_objects(locator) == []
        status = json.loads(thinblock("pool", "status", locator, "--json").stdout)
        assert status["used_bytes"] >= 64 * MiB and status["below_reserves_space"] is False
        h.pwrite(b"\x01" * (4 * MiB), 512 * MiB)
        h.flush()
        assert len(_data_objects(locator)) == 4
        assert h.pread(MiB, 512 * MiB - MiB // 2)[: MiB // 2] == bytes(MiB // 2)
        h.trim(4 * MiB, 512 * MiB)
        h.flush()
        time.sleep(1.5)  # freed blocks are punched after the commit that freed them
        assert _data_objects(locator) == []
        h.shutdown()
    finally:
        server.stop()


def test_takeover_after_sigkill_serves_every_flushed_byte(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    locator = new_rados_locator(request, "kill")
    thinblock("pool", "create", locator, "--size", "1G")
    thinblock("volume", "create", locator, "v", "--size", "256M")
    first = _server(locator, tmp_path, "a")
    payload = os.urandom(3 * MiB + 4097)
    h = _handle(first)
    h.pwrite(payload, 5 * MiB)
    h.flush()
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    # While its lease lives, a second server is refused, and told who holds the pool.
    refused = thinblock("serve", locator, "--socket", str(tmp_path / "b.sock"), check=False)
    assert refused.returncode == 1 and "already held by thinblock serve" in refused.stderr
    assert "--takeover" in refused.stderr
    # An admin command finds the dead server's socket silent, and is told who holds the pool.
    status = thinblock("pool", "status", locator, check=False)
    assert status.returncode == 1 and "already held by thinblock serve" in status.stderr
    assert "does not answer" in status.stderr
    second = _server_once_the_lease_lapses(locator, tmp_path, "b")  # it fences the dead holder
    try:
        assert "fencing its previous holder" in second.log.read_text()
        h2 = _handle(second)
        assert h2.pread(len(payload), 5 * MiB) == payload
        h2.shutdown()
    finally:
        second.stop()


def test_a_stalled_holder_is_fenced_off(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """SIGSTOP the holder, take over with --takeover, SIGCONT it: its writes and
    flushes fail, the new holder's view does not change, and the fenced server stops
    by itself with a sentence (its lease is lost), no traceback."""
    locator = new_rados_locator(request, "stall")
    thinblock("pool", "create", locator, "--size", "1G")
    thinblock("volume", "create", locator, "v", "--size", "256M")
    first = _server(locator, tmp_path, "a")
    old = _handle(first)
    old.pwrite(b"A" * MiB, 0)
    old.flush()
    first.proc.send_signal(signal.SIGSTOP)
    second = _server(locator, tmp_path, "b", "--takeover")
    try:
        new = _handle(second)
        assert new.pread(MiB, 0) == b"A" * MiB
        new.pwrite(b"B" * MiB, 0)
        new.flush()
        first.proc.send_signal(signal.SIGCONT)
        with pytest.raises(nbd.Error):  # EIO, or the connection closed as the fenced server stops
            old.pwrite(b"C" * MiB, 0)
            old.pwrite(b"D" * 4096, 64 * MiB)
            old.flush()
        first.proc.wait(timeout=120)  # it stops by itself: its lease is lost
        assert first.proc.returncode == 1
        log = first.log.read_text()
        assert "its lease is lost" in log and "stopped serving every volume" in log and "Traceback" not in log, log
        assert new.pread(MiB, 0) == b"B" * MiB and new.pread(4096, 64 * MiB) == bytes(4096)
        new.flush()
        new.shutdown()
    finally:
        second.stop()
        first.proc.send_signal(signal.SIGCONT)
        first.stop()
    assert "fenced off" in first.log.read_text() or "taken over" in first.log.read_text()
    with Pool.open(locator) as pool:
        assert pool.volume("v").read(0, MiB) == b"B" * MiB


def test_a_pool_of_an_older_format_checks_clean_then_is_upgraded(request: pytest.FixtureRequest) -> None:
    """A format-2 omap is read as it is (check and dump write nothing), and the first
    writable open upgrades it."""
    locator = new_rados_locator(request, "oldformat")
    with Pool.create(locator, 64 * MiB, block_size=64 << 10) as pool:
        pool.create_volume("v", MiB).write(0, b"\x5a" * 4096)
        pool.commit()
        pool.meta.commit(Transaction(superblock={"format_version": 2}))  # as a format-2 thinblock left it
    thinblock("pool", "check", locator)
    assert _rados_location(locator).open_meta(readonly=True).superblock()["format_version"] == 2
    with Pool.open(locator) as pool:
        assert pool.volume("v").read(0, 4096) == b"\x5a" * 4096
    assert _rados_location(locator).open_meta(readonly=True).superblock()["format_version"] == 3
    thinblock("pool", "check", locator)


def test_a_stale_epoch_cannot_commit(request: pytest.FixtureRequest) -> None:
    """The epoch compare alone (no blocklist: same client) stops an old holder's commit."""
    locator = new_rados_locator(request, "epoch")
    Pool.create(locator, 64 * MiB, block_size=64 << 10).close()
    old = Pool.open(locator, autocommit=False)
    try:
        old.create_volume("before", MiB)
        taker = Pool.open(locator, autocommit=False, takeover=True)
        try:
            with pytest.raises(OSError, match="another host took the pool over"):
                old.meta.commit(Transaction(superblock={"transaction_id": 999}))
            assert taker.meta.superblock()["transaction_id"] != 999
            taker.create_volume("after", MiB)
        finally:
            taker.close()
    finally:
        old._ownership.release()
    with pytest.raises(PoolBusyError):
        # The lock of a live holder is refused without --takeover.
        holder = Pool.open(locator, autocommit=False)
        try:
            Pool.open(locator, autocommit=False)
        finally:
            holder.close()
    with Pool.open(locator) as pool:
        assert set(pool.volumes) == {"before", "after"}


def test_large_commits_go_through_the_journal(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit bigger than one operation is journalled; one interrupted after its
    commit point is finished by the next holder; omap listings page past 1024."""
    locator = new_rados_locator(request, "journal")
    location = _rados_location(locator)
    location.create({"block_size": 4096, "size_bytes": MiB, "clean": True}, MiB, None)
    monkeypatch.setattr(meta_rados, "MAX_OP_KEYS", 500)
    roots = {(1, i): 10 + i for i in range(3000)}
    pages = {10 + i: (1, bytes([i % 256]) * 4096) for i in range(3000)}
    txn = Transaction(volumes=[VolumeRow(1, "a", MiB, "on", 1.0)], roots=dict(roots), pages=pages)  # type: ignore[arg-type]
    meta = location.open_meta(readonly=False)
    owner = location.own("journal test")
    meta.commit(txn)
    assert meta.roots(1) == {i: 10 + i for i in range(3000)}
    assert len(list(meta.all_pages())) == 3000 and meta.max_page_id() == 3009
    assert rados_objects(location.meta_object + ".journal") == []

    # Interrupted after the commit point: the journal is recorded, not applied.
    finish = meta_rados.RadosMetadata.finish_journal

    def crash(self: meta_rados.RadosMetadata) -> None:
        if self.journal_pending():  # past the commit point, before anything of it is applied
            raise OSError(errno.EIO, "power cut")
        finish(self)

    monkeypatch.setattr(meta_rados.RadosMetadata, "finish_journal", crash)
    big = {20000 + i: (1, bytes(4096)) for i in range(1000)}
    with pytest.raises(OSError, match="power cut"):
        meta.commit(Transaction(deleted_volumes=[1], volumes=[VolumeRow(2, "b", MiB, "on", 1.0)], pages=big))  # type: ignore[arg-type]
    assert len(rados_objects(location.meta_object + ".journal")) > 1
    owner.release()
    monkeypatch.undo()
    monkeypatch.setattr(meta_rados, "MAX_OP_KEYS", 500)
    with pytest.raises(ThinblockError, match="not yet applied"):
        location.open_meta(readonly=True)
    with Pool.open(locator, autocommit=False) as pool:  # the next holder applies it
        assert set(pool.volumes) == {"b"}
    fresh = location.open_meta(readonly=True)
    assert [v.name for v in fresh.volumes()] == ["b"] and fresh.roots(1) == {}
    assert rados_objects(location.meta_object + ".journal") == []


class _FailingJournalWrites:
    """An I/O context whose journal object writes fail (EIO), the rest passed through."""

    def __init__(self, io: object) -> None:
        self._io = io

    def write_full(self, name: str, data: bytes) -> None:
        raise rados.Error("injected", errno=errno.EIO)

    def __getattr__(self, name: str) -> object:
        return getattr(self._io, name)


def test_a_journal_that_cannot_be_written_changes_nothing(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large commit whose journal write fails, before its commit point, leaves the
    metadata exactly as it was; the same transaction commits afterwards."""
    locator = new_rados_locator(request, "journalfail")
    location = _rados_location(locator)
    location.create({"block_size": 4096, "size_bytes": MiB, "clean": True}, MiB, None)
    monkeypatch.setattr(meta_rados, "MAX_OP_KEYS", 100)
    meta = location.open_meta(readonly=False)
    owner = location.own("journal failure test")
    try:
        meta.commit(
            Transaction(volumes=[VolumeRow(1, "a", MiB, "on", 1.0)], roots={(1, 0): 10}, pages={10: (1, bytes(4096))})
        )
        before = (meta.superblock(), meta.volumes(), sorted(meta.all_roots()), sorted(meta.all_pages()))
        big = Transaction(
            superblock={"transaction_id": 7},
            volumes=[VolumeRow(2, "b", MiB, "on", 1.0)],
            roots={(2, i): 100 + i for i in range(500)},
            pages={100 + i: (1, bytes([i % 256]) * 4096) for i in range(500)},
        )
        real_io = meta.io
        meta.io = _FailingJournalWrites(real_io)
        with pytest.raises(OSError) as info:
            meta.commit(big)
        assert info.value.errno == errno.EIO
        meta.io = real_io
        assert (meta.superblock(), meta.volumes(), sorted(meta.all_roots()), sorted(meta.all_pages())) == before
        assert not meta.journal_pending()
        meta.commit(big)
        assert [v.name for v in meta.volumes()] == ["a", "b"] and len(meta.roots(2)) == 500
    finally:
        owner.release()


def test_quota_gives_enospc_and_writes_resume(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A Ceph pool quota: writes fail with ENOSPC, what was flushed stays, and after
    the quota is raised writes and flushes work again."""
    request.getfixturevalue("ceph")
    cluster = connect()
    ceph_pool = f"quota-{os.getpid()}"
    for cmd in (
        {"prefix": "osd pool create", "pool": ceph_pool, "pg_num": 4},
        {"prefix": "osd pool set", "pool": ceph_pool, "var": "size", "val": "1", "yes_i_really_mean_it": True},
        {"prefix": "osd pool set-quota", "pool": ceph_pool, "field": "max_bytes", "val": str(24 * MiB)},
    ):
        cluster.mon_command(cmd)
    locator = f"rados:{ceph_pool}/q"

    def drop() -> None:
        remove_rados_pool(locator)
        cluster.mon_command(
            {"prefix": "osd pool rm", "pool": ceph_pool, "pool2": ceph_pool, "yes_i_really_really_mean_it": True}
        )

    request.addfinalizer(drop)
    thinblock("pool", "create", locator, "--size", "8G")
    thinblock("volume", "create", locator, "v", "--size", "6G")
    server = _server(locator, tmp_path, "q")
    try:
        h = _handle(server)
        kept = os.urandom(4 * MiB)
        h.pwrite(kept, 0)
        h.flush()
        failed = None
        deadline = time.monotonic() + 90
        offset = 8 * MiB
        # Fresh space only: RADOS lets overwrites of existing objects through a full quota.
        # The quota bites once the mgr's statistics reach the monitor, a second or more late.
        while failed is None and time.monotonic() < deadline and offset < 5 * 1024 * MiB:
            try:
                h.pwrite(os.urandom(MiB), offset)
                offset += MiB
            except nbd.Error as exc:
                failed = exc
        assert failed is not None and failed.errno == "ENOSPC", (failed, offset)
        assert h.pread(len(kept), 0) == kept
        cluster.mon_command({"prefix": "osd pool set-quota", "pool": ceph_pool, "field": "max_bytes", "val": "0"})
        deadline = time.monotonic() + 60
        while True:
            try:
                h.pwrite(b"\x07" * MiB, 5500 * MiB)
                h.flush()
                break
            except nbd.Error:
                assert time.monotonic() < deadline, "writes never resumed after the quota was lifted"
                time.sleep(1)
        assert h.pread(len(kept), 0) == kept and h.pread(MiB, 5500 * MiB) == b"\x07" * MiB
        h.shutdown()
    finally:
        server.stop()
    with Pool.open(locator) as pool:
        assert pool.volume("v").read(0, len(kept)) == kept
        meta = pool.meta
        assert check_metadata(meta) == []


def _bounded(args: list[str], env: dict[str, str], limit: float) -> subprocess.CompletedProcess[str]:
    start = time.monotonic()
    proc = _run_env(args, env)
    assert time.monotonic() - start < limit, f"{args} took too long"
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    return proc


def _run_env(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    old = dict(os.environ)
    os.environ.update(env)
    try:
        return thinblock(*args, check=False)
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_bad_configurations_get_one_sentence_in_bounded_time(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    ceph_pool = request.getfixturevalue("ceph")
    conf = Path(os.environ["CEPH_CONF"]).read_text()
    # An unreachable cluster: a monitor address nothing listens on.
    dead = tmp_path / "dead.conf"
    dead.write_text(
        "\n".join("mon host = v2:127.0.0.1:9" if ln.startswith("mon host") else ln for ln in conf.splitlines()) + "\n"
    )
    out = _bounded(["pool", "status", f"rados:{ceph_pool}/x", "--ceph-conf", str(dead)], {}, 40)
    assert "cannot connect to the Ceph cluster" in out.stderr
    # Wrong credentials: a key the cluster does not know.
    keyring = tmp_path / "bad.keyring"
    keyring.write_text("[client.admin]\n\tkey = AQBJx+5kAAAAABAAg1V1Mhpxr0J4X2SRSDsKoA==\n")
    out = _bounded(["pool", "status", f"rados:{ceph_pool}/x"], {"CEPH_ARGS": f"--keyring {keyring}"}, 40)
    assert "cannot connect to the Ceph cluster" in out.stderr
    # A missing Ceph pool, and a missing thinblock pool in an existing one.
    out = _bounded(["pool", "status", f"rados:{ceph_pool}/x", "--ceph-conf", str(tmp_path / "missing.conf")], {}, 40)
    assert "cannot read the Ceph configuration" in out.stderr and "no such file" in out.stderr
    out = _bounded(["pool", "status", "rados:no-such-ceph-pool/x"], {}, 40)
    assert "no Ceph pool 'no-such-ceph-pool'" in out.stderr
    out = _bounded(["volume", "list", f"rados:{ceph_pool}/never-made"], {}, 40)
    assert "no pool at rados:" in out.stderr
    out = _bounded(["pool", "create", f"rados:{ceph_pool}", "--size", "1G"], {}, 40)
    assert "expected rados:CEPHPOOL/NAME" in out.stderr


def test_a_lost_connection_fails_writes_cleanly(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Blocklisting the serving client (as a lost, fenced connection): the server keeps
    answering, reads of what it need not fetch work, writes and flushes fail with EIO."""
    locator = new_rados_locator(request, "lost")
    thinblock("pool", "create", locator, "--size", "1G")
    thinblock("volume", "create", locator, "v", "--size", "64M")
    server = _server(locator, tmp_path, "a")
    try:
        h = _handle(server)
        h.pwrite(b"x" * MiB, 0)
        h.flush()
        log = server.log.read_text()
        addr = json.loads(_owner_record(locator))["addr"]
        connect().blocklist(addr, 600)
        # The OSDs learn of the blocklist from their next OSD map: on a loaded machine a
        # write may still land just before it does. Wait for the fence, not for a time.
        deadline = time.monotonic() + 60
        while True:
            try:
                h.pwrite(b"y" * MiB, 0)
            except nbd.Error as exc:
                assert exc.errno == "EIO", exc
                break
            assert time.monotonic() < deadline, "the blocklist never reached the OSDs"
            time.sleep(0.1)
        assert h.pread(4096, 32 * MiB) == bytes(4096)  # unmapped: answered from metadata
        with pytest.raises(nbd.Error) as info:
            h.pread(4096, 0)  # mapped: RADOS refuses the fenced client
        assert info.value.errno == "EIO"
        with pytest.raises(nbd.Error) as info:
            h.pwrite(b"z" * (4 * MiB), 8 * MiB)  # over two objects: the aio batch path fails the same way
        assert info.value.errno == "EIO"
        h.trim(MiB, 0)  # a metadata change, which can never be committed now
        with pytest.raises(nbd.Error):
            h.flush()
        assert server.alive()
        h.shutdown()
        assert "Traceback" not in log
    finally:
        server.stop()
        addr_rm = connect()
        addr_rm.mon_command({"prefix": "osd blocklist", "blocklistop": "rm", "addr": addr})


def _owner_record(locator: str) -> str:
    location = _rados_location(locator)
    io = connect().ioctx(location.ceph_pool)
    with rados.ReadOpCtx() as op:
        it, _ = io.get_omap_vals_by_keys(op, (meta_rados.OWNER_KEY,))
        io.operate_read_op(op, location.meta_object)
        return dict(it)[meta_rados.OWNER_KEY].decode()


def test_mkfs_attach_and_mount_on_a_rados_pool(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """`thinblock mkfs` and `attach` (FUSE + loop) on a pool in Ceph: a real ext4 that
    mounts, keeps a file and passes e2fsck; zeroing was skipped."""
    locator = new_rados_locator(request, "fs")
    thinblock("pool", "create", locator, "--size", "4G")
    thinblock("volume", "create", locator, "v", "--size", "2G")
    result = json.loads(thinblock("mkfs", locator, "v", "-t", "ext4", "--json").stdout)
    assert result["prezeroed_hint"] and result["pool_bytes_used"] < 64 * MiB
    device = thinblock("attach", locator, "v").stdout.strip()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        subprocess.run(["mount", device, str(mnt)], check=True)
        try:
            (mnt / "hello").write_bytes(b"from ceph\n" * 1000)
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
        subprocess.run(["e2fsck", "-fn", device], check=True, capture_output=True)
    finally:
        thinblock("detach", device)
    device = thinblock("attach", locator, "v").stdout.strip()
    try:
        subprocess.run(["mount", "-o", "ro", device, str(mnt)], check=True)
        try:
            assert (mnt / "hello").read_bytes() == b"from ceph\n" * 1000
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    finally:
        thinblock("detach", device)


def test_pools_share_a_ceph_pool(request: pytest.FixtureRequest) -> None:
    one, two = new_rados_locator(request, "share"), new_rados_locator(request, "share")
    for locator, byte in ((one, b"\x01"), (two, b"\x02")):
        with Pool.create(locator, 64 * MiB, block_size=64 << 10) as pool:
            pool.create_volume("v", 8 * MiB).write(0, byte * MiB)
    for locator, byte in ((one, b"\x01"), (two, b"\x02")):
        with Pool.open(locator) as pool:
            assert pool.volume("v").read(0, MiB) == byte * MiB
    assert _data_objects(one) and _data_objects(one) != _data_objects(two)
    remove_rados_pool(one)
    with Pool.open(two) as pool:
        assert pool.volume("v").read(0, MiB) == b"\x02" * MiB


def test_an_answer_later_than_its_askers_patience_leaves_no_reply_object(request: pytest.FixtureRequest) -> None:
    """A request by notify (admin/notify.py) whose owner answers after the asker gave
    up: the asker says "no answer", and the owner's late answer creates nothing (the
    asker's reply object is gone, and the answer lands only while it is there)."""
    import threading

    from thinblock.admin.control import NoAnswer
    from thinblock.admin.notify import NotifyClient, answer_if_asked, watch_object

    locator = new_rados_locator(request, "late")
    with Pool.create(locator, 64 * MiB, block_size=64 << 10) as pool:
        pool.create_volume("v", 8 * MiB)
    location = _rados_location(locator)
    sb = location.open_meta(readonly=True).superblock()
    io = location.cluster().ioctx(location.ceph_pool)
    obj = watch_object(location, sb, 1)
    io.write_full(obj, b"")
    gave_up, late = threading.Event(), []
    requests: list[str] = []

    def owner(_notify_id: int, _notifier_id: int, _cookie: int, data: bytes) -> None:
        reply = json.loads(data)["reply"]
        requests.append(reply)
        assert gave_up.wait(60)  # the asker's patience ends first, whatever the clocks
        late.append(answer_if_asked(io, reply, b'{"ok": "late"}'))

    watch = io.watch(obj, owner)
    try:
        with pytest.raises(NoAnswer, match="did not answer within 1 s"):
            NotifyClient(location, sb, 1, 0.2).call("status")  # 1 s: whole seconds
        gave_up.set()
        deadline = time.monotonic() + 60
        while not late:
            assert time.monotonic() < deadline, "the watch callback never ran"
            time.sleep(0.05)
    finally:
        gave_up.set()
        watch.close()
    assert late == ["its asker gave up waiting"]
    assert requests and not rados_objects(f"{location.data_prefix(sb)}.reply.")
