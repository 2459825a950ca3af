"""Several `thinblock serve POOL --volume NAME` processes on one directory pool
(ownership per volume: core/owner.py, docs/architecture.md#backends-and-ownership).

Real servers, real libnbd and qemu clients, real SIGKILL. Every read is checked
against a model of what was written; afterwards `pool check` audits the
refcounts, which is what catches a block mapped by two owners without a
snapshot or clone sharing it (its count would be one short of its references).
Seeded writers, so every run does the same requests.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nbd
import pytest

from tests.cli import ROOT, thinblock
from tests.conftest import new_rados_locator
from tests.hosts import other_host, thinblock_on
from tests.nbd_server import Server, listed_exports
from tests.test_commands import listing, until

MiB = 1 << 20


def _serve(pool: str, tmp: Path, *names: str) -> Server:
    work = tmp / f"serve-{'-'.join(names)}"
    work.mkdir(exist_ok=True)
    args: list[str] = []
    for name in names:
        args += ["--volume", name]
    return Server(pool, *args, "--socket", str(work / "nbd.sock"), workdir=work)


def _serve_once_free(pool: str, tmp: Path, name: str) -> Server:
    """_serve, tried again while the volume is still held by a lease that has not
    lapsed yet (RADOS; a minute at most)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return _serve(pool, tmp, name)
        except RuntimeError as exc:
            if "is served by" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _stop(server: Server) -> None:
    server.stop()
    assert "Traceback" not in server.log.read_text(), server.log.read_text()


@contextmanager
def owners(pool: str, tmp: Path, *names: str) -> Iterator[list[Server]]:
    """One `serve --volume NAME` per name, stopped (no traceback) when the block ends;
    then the pool must pass `pool check`."""
    servers: list[Server] = []
    try:
        for name in names:
            servers.append(_serve(pool, tmp, name))
        yield servers
    finally:
        for server in servers:
            _stop(server)
    thinblock("pool", "check", pool)


def _handle(server: Server, name: str) -> nbd.NBD:
    h = nbd.NBD()
    h.connect_uri(server.unix_uri(name))
    return h


@pytest.fixture(params=["directory", "rados"])
def place(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the pool of a test run on both backends lives: a directory, or a Ceph pool
    (a lease of 3 s there: an owner killed loses its volumes once it lapses)."""
    if request.param == "directory":
        return str(tmp_path / "pool")
    monkeypatch.setenv("THINBLOCK_RADOS_LEASE_S", "3")
    return new_rados_locator(request, "owners")


def _pool(tmp: Path, size: str, volumes: dict[str, str], place: str | None = None) -> str:
    pool = place or str(tmp / "pool")
    thinblock("pool", "create", pool, "--size", size)
    for name, vsize in volumes.items():
        thinblock("volume", "create", pool, name, "--size", vsize)
    return pool


class Writer:
    """Seeded writes, trims and zeroes of 64 KiB-aligned extents on one export, a
    flush every few steps; the model keeps what every byte must read. Each write
    carries its step number, so a read of a wrong block says whose it was."""

    def __init__(self, server: Server, name: str, size: int, seed: int) -> None:
        self.h = _handle(server, name)
        self.name = name
        self.model = bytearray(size)
        self.rng = random.Random(seed)
        self.seed = seed
        self.steps = 0

    def step(self) -> None:
        rng = self.rng
        unit = 64 << 10
        off = rng.randrange(len(self.model) // unit) * unit
        length = min(rng.choice((1, 1, 2, 8)) * unit, len(self.model) - off)
        kind = rng.choice("wwwwtz")
        self.steps += 1
        if kind == "w":
            data = f"{self.name}:{self.seed}:{self.steps}:".encode().ljust(512, b".") * (length // 512)
            self.h.pwrite(data, off)
            self.model[off : off + length] = data
        elif kind == "t":
            self.h.trim(length, off)
            self.model[off : off + length] = bytes(length)
        else:
            self.h.zero(length, off)
            self.model[off : off + length] = bytes(length)
        if self.steps % 8 == 0:
            self.h.flush()

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()
        self.h.flush()

    def check(self, server: Server | None = None) -> None:
        h = _handle(server, self.name) if server is not None else self.h
        for off in range(0, len(self.model), 4 * MiB):
            got = h.pread(min(4 * MiB, len(self.model) - off), off)
            want = bytes(self.model[off : off + len(got)])
            if got != want:
                at = next(i for i in range(len(got)) if got[i] != want[i])
                raise AssertionError(
                    f"{self.name} at {off + at}: read {got[at : at + 40]!r}, wrote {want[at : at + 40]!r}"
                )
        if server is not None:
            h.shutdown()


def _in_threads(*jobs: tuple[Writer, int]) -> None:
    errors: list[BaseException] = []

    def run(w: Writer, n: int) -> None:
        try:
            w.run(n)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_two_owners_write_snapshot_through_the_owner_and_a_third_serves_the_clone(tmp_path: Path, place: str) -> None:
    pool = _pool(tmp_path, "256M", {"a": "48M", "b": "48M"}, place)
    sa, sb = _serve(pool, tmp_path, "a"), _serve(pool, tmp_path, "b")
    servers = [sa, sb]
    try:
        wa, wb = Writer(sa, "a", 48 * MiB, 1), Writer(sb, "b", 48 * MiB, 2)
        _in_threads((wa, 150), (wb, 150))
        # A snapshot of a, taken through the CLI: a is another process's, so the
        # command sends it to that server, which takes it between a's requests.
        thinblock("snapshot", "create", pool, "a", "s1")
        at_s1 = bytes(wa.model)
        thinblock("volume", "clone", pool, "s1", "c")
        sc = _serve(pool, tmp_path, "c")
        servers.append(sc)
        wc = Writer(sc, "c", 48 * MiB, 3)
        wc.model[:] = at_s1
        wc.check()
        # All three write at once: a and c copy the blocks they share with s1.
        _in_threads((wa, 150), (wb, 100), (wc, 150))
        for w in (wa, wb, wc):
            w.check()
        # The snapshot still reads what a held when it was taken (served by a's owner).
        snap = _handle(sa, "s1")
        assert snap.pread(48 * MiB, 0) == at_s1
        snap.shutdown()
        listed = {v["name"]: v for v in json.loads(thinblock("volume", "list", pool, "--json").stdout)}
        assert set(listed) == {"a", "b", "c", "s1"} and listed["c"]["origin"] == "s1"
        status = json.loads(thinblock("pool", "status", pool, "--json").stdout)
        assert status["granted_bytes"] > 0
    finally:
        for s in servers:
            _stop(s)
    thinblock("pool", "check", pool)
    # Every grant was given back, and the whole pool's owner reads the same bytes.
    assert json.loads(thinblock("pool", "status", pool, "--json").stdout)["granted_bytes"] == 0
    whole = Server(pool, workdir=tmp_path)
    try:
        for w in (wa, wb, wc):
            w.check(whole)
    finally:
        _stop(whole)
    thinblock("pool", "check", pool)


def test_a_volume_is_served_by_one_owner_and_others_are_told_who(tmp_path: Path, place: str) -> None:
    pool = _pool(tmp_path, "64M", {"a": "16M", "b": "16M"}, place)
    sa = _serve(pool, tmp_path, "a")
    try:
        again = thinblock("serve", pool, "--volume", "a", "--socket", str(tmp_path / "x.sock"), check=False)
        assert again.returncode != 0 and "volume a is served by thinblock serve (pid" in again.stderr
        # An NBD client asking this server for b: the spec's "not available", with who serves it.
        sb = _serve(pool, tmp_path, "b")
        try:
            info = subprocess.run(
                ["qemu-img", "info", "-f", "raw", sa.unix_uri("b")], capture_output=True, text=True, check=False
            )
            assert info.returncode != 0
            assert "Requested export not available" in info.stderr
            assert f"pid {sb.proc.pid}" in info.stderr, info.stderr
            assert [n for n, *_ in listed_exports(sa)] == ["a"]
        finally:
            _stop(sb)
        info = subprocess.run(
            ["qemu-img", "info", "-f", "raw", sa.unix_uri("b")], capture_output=True, text=True, check=False
        )
        assert "no server holds it now" in info.stderr, info.stderr
        # Pool-level commands work beside the owners (pool grow too: tests/test_owner_admin.py).
        thinblock("volume", "create", pool, "n", "--size", "8M")
        thinblock("pool", "grow", pool, "--size", "128M")
        assert json.loads(thinblock("pool", "status", pool, "--json").stdout)["size_bytes"] == 128 << 20
        dup = thinblock("snapshot", "create", pool, "a", "n", check=False)
        assert dup.returncode != 0 and "already exists" in dup.stderr
    finally:
        _stop(sa)
    thinblock("pool", "check", pool)


def test_sigkill_of_one_owner_leaves_the_others_serving_and_its_flushed_bytes_intact(
    tmp_path: Path, place: str
) -> None:
    pool = _pool(tmp_path, "128M", {"a": "32M", "b": "32M"}, place)
    sa, sb = _serve(pool, tmp_path, "a"), _serve(pool, tmp_path, "b")
    wa, wb = Writer(sa, "a", 32 * MiB, 11), Writer(sb, "b", 32 * MiB, 12)
    try:
        _in_threads((wa, 100), (wb, 100))  # each ends with a flush
        flushed = bytes(wb.model)
        # Unflushed writes in flight when it dies: they may or may not survive.
        unflushed = {off for off in range(0, 4 * MiB, 64 << 10)}
        for off in sorted(unflushed):
            wb.h.aio_pwrite(b"U" * (64 << 10), off)
        os.kill(sb.proc.pid, signal.SIGKILL)
        sb.proc.wait()
        # a's owner never notices.
        wa.run(60)
        wa.check()
        # The next server of b takes its lease (at once on a directory, once the lease
        # lapsed on Ceph, fencing the dead owner's client), and serves every flushed byte.
        sb2 = _serve_once_free(pool, tmp_path, "b")
        try:
            h = _handle(sb2, "b")
            got = h.pread(32 * MiB, 0)
            for off in range(0, 32 * MiB, 64 << 10):
                block = got[off : off + (64 << 10)]
                if off in unflushed and block == b"U" * (64 << 10):
                    continue
                assert block == flushed[off : off + (64 << 10)], f"b at {off} lost flushed bytes"
            h.shutdown()
            wb2 = Writer(sb2, "b", 32 * MiB, 13)
            wb2.model[:] = got
            _in_threads((wa, 60), (wb2, 60))
            wa.check()
            wb2.check()
        finally:
            _stop(sb2)
    finally:
        _stop(sa)
        if sb.alive():
            sb.proc.kill()
    thinblock("pool", "check", pool)


def test_a_nearly_full_pool_gives_space_trimmed_by_one_owner_to_another(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "32M", {"a": "32M", "b": "32M"})
    with owners(pool, tmp_path, "a", "b") as (sa, sb):
        ha, hb = _handle(sa, "a"), _handle(sb, "b")
        ha.pwrite(b"a" * (24 * MiB), 0)
        ha.flush()
        # b fits what is left, and no more: ENOSPC, and a keeps every byte.
        with pytest.raises(nbd.Error) as full:
            for off in range(0, 16 * MiB, MiB):
                hb.pwrite(b"b" * MiB, off)
        assert full.value.errno == "ENOSPC"
        assert ha.pread(24 * MiB, 0) == b"a" * (24 * MiB)
        # ENOSPC only once the pool is full: what a's owner kept granted but unused went
        # back to the pool when b's owner found none left outside the grants.
        hb.flush()
        status = json.loads(thinblock("pool", "status", pool, "--json").stdout)
        assert status["size_bytes"] - status["used_bytes"] < MiB, status
        # a trims most of it: once committed its owner gives the space back, and b gets it.
        ha.trim(20 * MiB, 0)
        ha.flush()
        written = _write_until_it_fits(hb, 16 * MiB)
        hb.flush()
        assert hb.pread(written, 0) == b"b" * written
        assert ha.pread(4 * MiB, 20 * MiB) == b"a" * (4 * MiB)
        ha.shutdown()
        hb.shutdown()


def _write_until_enospc(h: nbd.NBD, byte: bytes, size: int) -> int:
    """Write 64 KiB extents of byte from the start until the pool answers ENOSPC (it
    must, within size); how many bytes were written before it."""
    written = 0
    with pytest.raises(nbd.Error) as full:
        while written < size:
            h.pwrite(byte * (64 << 10), written)
            written += 64 << 10
    assert full.value.errno == "ENOSPC"
    return written


def test_enospc_comes_only_once_the_pool_is_full_whoever_holds_the_grants(tmp_path: Path) -> None:
    """The pool-wide ENOSPC rule across owners: a's owner keeps idle granted space
    after a small write; b's owner, finding nothing left outside the grants, has the
    others give their idle grants back before it answers ENOSPC, so b fills the pool."""
    pool = _pool(tmp_path, "32M", {"a": "32M", "b": "32M"})
    with owners(pool, tmp_path, "a", "b") as (sa, sb):
        _b_fills_the_pool_a_kept_idle_grants_of(pool, sa, sb)


def _b_fills_the_pool_a_kept_idle_grants_of(pool: str, sa: Server, sb: Server) -> None:
    """a's owner writes a little and keeps idle grants; b writes until ENOSPC, which
    comes only once the pool is full (a gave its idle grants back when asked)."""
    ha, hb = _handle(sa, "a"), _handle(sb, "b")
    ha.pwrite(b"a" * MiB, 0)
    ha.flush()
    before = json.loads(thinblock("pool", "status", pool, "--json").stdout)
    assert before["granted_unused_bytes"] > 0, before  # a's owner keeps some for its next writes
    written = _write_until_enospc(hb, b"b", 32 * MiB)
    hb.flush()
    after = json.loads(thinblock("pool", "status", pool, "--json").stdout)
    assert after["used_bytes"] == after["size_bytes"], after
    assert written == after["size_bytes"] - MiB
    assert "control: grants_idle_back" in sa.log.read_text()
    assert ha.pread(MiB, 0) == b"a" * MiB and hb.pread(written, 0) == b"b" * written
    ha.pwrite(b"c" * MiB, 0)  # a's allocated blocks still take writes
    ha.shutdown()
    hb.shutdown()


def test_an_owner_on_another_host_gives_its_idle_grants_back_by_notify(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The same rule across hosts on a Ceph pool: b's owner runs on another host
    (tests/hosts.py), where a's control socket is out of reach; it asks a's owner by
    watch/notify for its idle grants before it answers ENOSPC, so b fills the pool."""
    pool = _pool(tmp_path, "32M", {"a": "32M", "b": "32M"}, new_rados_locator(request, "idle"))
    sa = _serve(pool, tmp_path, "a")
    work = tmp_path / "other"
    work.mkdir()
    sb: Server | None = None
    try:
        sb = Server(pool, "--volume", "b", "--socket", str(work / "nbd.sock"), workdir=work, host=other_host("other"))
        _b_fills_the_pool_a_kept_idle_grants_of(pool, sa, sb)
    finally:
        if sb is not None:
            _stop(sb)
        _stop(sa)
    thinblock("pool", "check", pool)


def test_an_owner_that_does_not_answer_keeps_its_idle_grants_and_the_asker_says_enospc(tmp_path: Path) -> None:
    """The ask for idle grants is bounded: with a's owner stopped, b's write that finds
    the pool full outside the grants waits for a's answer a few seconds at most, then
    gets ENOSPC; b's server and its other requests go on. Once a runs again, b's next
    write gets the space a kept."""
    pool = _pool(tmp_path, "32M", {"a": "32M", "b": "32M"})
    with owners(pool, tmp_path, "a", "b") as (sa, sb):
        ha, hb = _handle(sa, "a"), _handle(sb, "b")
        ha.pwrite(b"a" * MiB, 0)
        ha.flush()
        kept = json.loads(thinblock("pool", "status", pool, "--json").stdout)["granted_unused_bytes"]
        assert kept > 0
        os.kill(sa.proc.pid, signal.SIGSTOP)
        try:
            written = _write_until_enospc(hb, b"b", 32 * MiB)
            assert written < 31 * MiB  # what a's owner kept was not b's
            assert hb.pread(written, 0) == b"b" * written  # b's server is fine
            assert "did not give its idle grants back" in sb.log.read_text()
        finally:
            os.kill(sa.proc.pid, signal.SIGCONT)
        hb.pwrite(b"b" * (64 << 10), written)  # a answers now: its idle grant comes back
        hb.flush()
        assert ha.pread(MiB, 0) == b"a" * MiB
        ha.shutdown()
        hb.shutdown()


def test_an_import_running_beside_an_owner_answers_for_its_idle_grants(tmp_path: Path) -> None:
    """A job (an import from a stream, still reading) owns its staging volume and takes
    grants like any owner: it answers an owner asking for its idle grants back (which
    it gives back whole), as a server does, instead of "unknown verb"."""
    from thinblock.admin.control import ControlClient, owner_socket_name
    from thinblock.backends import locate

    pool = _pool(tmp_path, "32M", {"a": "32M"})
    with owners(pool, tmp_path, "a"):
        job = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "import", "-", pool, "n", "--size", "8M", "--no-progress"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        )
        try:
            assert job.stdin is not None
            job.stdin.write(b"i" * MiB)
            job.stdin.flush()
            until(
                lambda: json.loads(thinblock("pool", "status", pool, "--json").stdout)["granted_bytes"] > 0,
                "the import to take a grant",
            )
            client = ControlClient(os.path.join(locate(pool).runtime_dir(), owner_socket_name(job.pid)), 30)
            try:
                answer = client.call("grants_idle_back")
            finally:
                client.close()
            assert set(answer) == {"granted_unused_bytes"}, answer
        finally:
            if job.stdin is not None:
                job.stdin.close()  # short of its 8M: the import fails and drops what it made
            job.wait(120)
        assert job.stderr is not None
        err = job.stderr.read().decode()
        assert "Traceback" not in err, err
    assert "n" not in listing(pool)


def _write_until_it_fits(h: nbd.NBD, length: int) -> int:
    """Write length bytes of b's, retrying a write refused for space until the trimmed
    space has come back (at most a few commits: never timed, bounded by count)."""
    for _attempt in range(400):
        try:
            for off in range(0, length, MiB):
                h.pwrite(b"b" * MiB, off)
            return length
        except nbd.Error as exc:
            if exc.errno != "ENOSPC":
                raise
            threading.Event().wait(0.05)
    raise AssertionError("the space a trimmed never reached the other owner")


def test_takeover_hands_one_volume_over_with_a_client_connected(tmp_path: Path, place: str) -> None:
    pool = _pool(tmp_path, "128M", {"a": "32M", "b": "32M"}, place)
    first = _serve(pool, tmp_path, "a", "b")
    second: Server | None = None
    try:
        ha, hb = _handle(first, "a"), _handle(first, "b")
        acked = random.Random(5).randbytes(4 * MiB)
        ha.pwrite(acked, 0)  # acknowledged, never flushed: the handover must keep it
        hb.pwrite(b"b" * MiB, 0)
        work = tmp_path / "taker"
        work.mkdir()
        second = Server(pool, "--volume", "a", "--takeover", "--socket", str(work / "nbd.sock"), workdir=work)
        log = second.log.read_text()
        assert "takeover of volume a: handed over in" in log, log
        h2 = _handle(second, "a")
        assert h2.pread(4 * MiB, 0) == acked
        h2.pwrite(b"2" * MiB, 8 * MiB)
        h2.flush()
        # The old server closed a's client, and keeps serving b on its connection.
        with pytest.raises(nbd.Error):
            ha.pread(4096, 0)
        assert "closed (its volume was handed over to another server" in first.log.read_text()
        hb.pwrite(b"B" * MiB, MiB)
        hb.flush()
        assert hb.pread(2 * MiB, 0) == b"b" * MiB + b"B" * MiB
        info = subprocess.run(
            ["qemu-img", "info", "-f", "raw", first.unix_uri("a")], capture_output=True, text=True, check=False
        )
        assert f"pid {second.proc.pid}" in info.stderr, info.stderr
        h2.shutdown()
        hb.shutdown()
    finally:
        if second is not None:
            _stop(second)
        _stop(first)
    thinblock("pool", "check", pool)


def test_serve_without_volume_beside_owners_serves_the_volumes_nobody_holds(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "64M", {"a": "16M", "b": "16M", "c": "16M"})
    sa = _serve(pool, tmp_path, "a")
    rest = Server(pool, "--socket", str(tmp_path / "rest.sock"), workdir=tmp_path)
    try:
        assert [n for n, *_ in listed_exports(rest)] == ["b", "c"]
        h = _handle(rest, "c")
        h.pwrite(b"c" * MiB, 0)
        h.flush()
        h.shutdown()
        late = thinblock("serve", pool, "--volume", "b", "--socket", str(tmp_path / "b.sock"), check=False)
        assert late.returncode != 0 and "volume b is served by" in late.stderr
        # A volume made since, or let go by a server that stopped, is listed at once and
        # claimed by the first client asking for it (the docs' "an export at once").
        thinblock("volume", "create", pool, "new", "--size", "8M")
        _stop(sa)
        assert [n for n, *_ in listed_exports(rest)] == ["a", "b", "c", "new"]
        for name in ("new", "a"):
            h = _handle(rest, name)
            h.pwrite(name.encode() * 4096, 0)
            h.flush()
            assert h.pread(4096 * len(name), 0) == name.encode() * 4096
            h.shutdown()
    finally:
        _stop(rest)
        _stop(sa)
    thinblock("pool", "check", pool)


def test_a_reservation_on_one_owners_volume_holds_while_another_owner_fills_the_pool(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "32M", {"a": "8M", "b": "32M"})
    with owners(pool, tmp_path, "a", "b") as (sa, sb):
        # Sent to a's server (it owns a), weighed and committed in its pool-level step.
        thinblock("volume", "set", pool, "a", "--reserve", "full")
        status = json.loads(thinblock("pool", "status", pool, "--json").stdout)
        assert status["reserved_bytes"] == 8 * MiB, status
        ha, hb = _handle(sa, "a"), _handle(sb, "b")
        # b fills everything the reservation leaves, and gets ENOSPC.
        written = 0
        with pytest.raises(nbd.Error) as full:
            for off in range(0, 32 * MiB, MiB):
                hb.pwrite(b"b" * MiB, off)
                written += MiB
        assert full.value.errno == "ENOSPC"
        assert written >= 16 * MiB, written
        hb.flush()
        # Every byte of a's reservation is written without one ENOSPC, b's data kept.
        for off in range(0, 8 * MiB, MiB):
            ha.pwrite(b"a" * MiB, off)
        ha.flush()
        assert ha.pread(8 * MiB, 0) == b"a" * (8 * MiB)
        assert hb.pread(written, 0) == b"b" * written
        ha.shutdown()
        hb.shutdown()


def test_open_clients_are_counted_by_the_owner_whoever_lists(tmp_path: Path) -> None:
    """volume list and volume info run in the command's own process beside owners per
    volume; the open clients are the owners' to tell (a listing read from the store
    said 0 for a volume with clients). A stopped owner's figure is unknown, not a hang."""
    pool = _pool(tmp_path, "64M", {"a": "16M", "b": "16M", "c": "8M"})
    thinblock("snapshot", "create", pool, "a", "a-snap")
    with owners(pool, tmp_path, "a", "b") as (sa, sb):
        ha, ha2, hb = _handle(sa, "a"), _handle(sa, "a"), _handle(sb, "b")
        try:
            listed = listing(pool)
            assert {n: r["open_clients"] for n, r in listed.items()} == {"a": 2, "a-snap": 0, "b": 1, "c": 0}
            info = json.loads(thinblock("volume", "info", pool, "a", "--json").stdout)
            assert info["open_clients"] == 2 and info["snapshots"] == ["a-snap"]
            hb.shutdown()
            hb = None
            assert listing(pool)["b"]["open_clients"] == 0
            os.kill(sb.proc.pid, signal.SIGSTOP)
            try:
                listed = listing(pool)
                assert listed["a"]["open_clients"] == 2 and listed["b"]["open_clients"] is None
            finally:
                os.kill(sb.proc.pid, signal.SIGCONT)
            # A holder killed: its record and its socket file outlive it; it has none.
            sb.proc.kill()
            sb.proc.wait()
            assert listing(pool)["b"]["open_clients"] == 0
        finally:
            for h in (ha, ha2, hb):
                if h is not None:
                    h.shutdown()


def test_an_owner_listing_the_pool_writes_nothing_of_other_owners_volumes(tmp_path: Path) -> None:
    """volume list or info sent to one owner's control socket covers volumes other
    owners write meanwhile: its view of their rows is old, and a stale exclusive
    count it recounted into one would be committed over the owner's row (pool check:
    "volume a: 256 data blocks recorded, 350 mapped")."""
    from thinblock.admin.control import ControlClient, owner_socket_name
    from thinblock.backends import locate

    pool = _pool(tmp_path, "256M", {"a": "48M"})
    with owners(pool, tmp_path, "a") as (sa,):
        wa = Writer(sa, "a", 48 * MiB, 11)
        wa.run(60)
        thinblock("snapshot", "create", pool, "a", "s1")
        thinblock("volume", "clone", pool, "s1", "c")
        sc = _serve(pool, tmp_path, "c")  # its view of a's row: as of now
        try:
            wc = Writer(sc, "c", 48 * MiB, 12)
            wc.model[:] = wa.model
            wc.run(60)  # c copies blocks it shares with s1: s1's exclusive count grows
            wa.run(80)  # a's owner maps more blocks and commits its row
            for server in (sa, sc):
                client = ControlClient(os.path.join(locate(pool).runtime_dir(), owner_socket_name(server.proc.pid)), 30)
                try:
                    assert {r["name"] for r in client.call("volume_list")} >= {"a", "s1"}
                    client.call("volume_info", name="s1")
                finally:
                    client.close()
            wc.check()
        finally:
            _stop(sc)
        wa.check()


def test_a_command_that_gave_up_on_a_stopped_owner_is_not_carried_out_later(tmp_path: Path) -> None:
    """A command sent to an owner that does not answer (stopped) times out and says it
    failed; when the owner runs again it drops the request its client gave up on,
    so what the user was told stays true (rbd's lock owner: a request whose caller
    timed out is not applied behind its back)."""
    pool = _pool(tmp_path, "64M", {"a": "16M", "b": "16M"})
    with owners(pool, tmp_path, "a", "b") as (sa, _sb):
        os.kill(sa.proc.pid, signal.SIGSTOP)
        try:
            env = {**os.environ, "THINBLOCK_CONTROL_TIMEOUT_S": "1", "PYTHONPATH": str(ROOT / "src")}
            for args in (["snapshot", "create", pool, "a", "a@late"], ["volume", "resize", pool, "a", "--size", "32M"]):
                late = subprocess.run(
                    [sys.executable, "-m", "thinblock", *args], capture_output=True, text=True, env=env, timeout=60
                )
                assert late.returncode != 0 and "did not answer" in late.stderr, late.stderr
        finally:
            os.kill(sa.proc.pid, signal.SIGCONT)
        until(lambda: sa.log.read_text().count("dropped unrun") >= 2, "both requests to be read and dropped")
        assert sa.log.read_text().count("dropped unrun") == 2, sa.log.read_text()
        listed = listing(pool)
        assert "a@late" not in listed and listed["a"]["size_bytes"] == 16 * MiB
        thinblock("snapshot", "create", pool, "a", "a@now")  # a's owner answers again


def test_takeover_of_a_stopped_owner_names_it_at_once_and_changes_nothing(tmp_path: Path) -> None:
    """A directory pool's lease lives as long as its process: a stopped owner cannot be
    fenced off. `--takeover` says so within seconds (not after the hand-over's two
    minutes), naming the pid to stop, and when the owner runs again it still serves
    its volume: the request the taker gave up on is not carried out behind its back."""
    pool = _pool(tmp_path, "64M", {"a": "16M"})
    with owners(pool, tmp_path, "a") as (sa,):
        h = _handle(sa, "a")
        h.pwrite(b"\x05" * 4096, 0)
        h.flush()
        os.kill(sa.proc.pid, signal.SIGSTOP)
        try:
            taken = thinblock(
                "serve", pool, "--volume", "a", "--takeover", "--socket", str(tmp_path / "t.sock"), check=False
            )
        finally:
            os.kill(sa.proc.pid, signal.SIGCONT)
        assert taken.returncode != 0
        assert "does not answer" in taken.stderr and f"kill {sa.proc.pid}" in taken.stderr, taken.stderr
        assert h.pread(4096, 0) == b"\x05" * 4096  # still its owner's, client and all
        h.pwrite(b"\x06" * 4096, 0)
        h.flush()
        h.shutdown()
        assert listing(pool)["a"]["open_clients"] == 0


def test_removing_a_volume_another_server_owns_leaves_a_pool_that_checks_clean(tmp_path: Path) -> None:
    """The owner of a removed volume keeps its lease and grants until it stops (its
    other volumes may use their blocks): `pool check` passes meanwhile, and once it
    stops every grant is back."""
    pool = _pool(tmp_path, "64M", {"x": "16M", "y": "16M"})
    with owners(pool, tmp_path, "x", "y") as (sx, _sy):
        h = _handle(sx, "x")
        h.pwrite(b"x" * (4 * MiB), 0)
        h.flush()
        h.shutdown()
        thinblock("volume", "remove", pool, "x")
        thinblock("pool", "check", pool)
        assert "x" not in listing(pool)
    assert json.loads(thinblock("pool", "status", pool, "--json").stdout)["granted_bytes"] == 0


def test_takeover_on_the_default_socket_as_the_readme_shows(tmp_path: Path) -> None:
    """`serve POOL --volume vm1 --takeover` with no --socket listens where vm1's clients
    connected, POOL/nbd.vm1.sock: the server it takes vm1 from served nothing else, so
    it stops once it has handed vm1 over, and a client reconnecting to the same path
    reads what it wrote. Where the owner keeps serving other volumes on that path, the
    takeover is refused before anything is taken."""
    pool = _pool(tmp_path, "64M", {"vm1": "8M", "vm2": "8M", "vm3": "8M"})
    for work in ("one", "two", "taker"):
        (tmp_path / work).mkdir()
    sock = os.path.join(pool, "nbd.vm1.sock")  # the default paths, said (the test helper gives one otherwise)
    first = Server(pool, "--volume", "vm1", "--socket", sock, workdir=tmp_path / "one")
    both = Server(
        pool,
        "--volume",
        "vm2",
        "--volume",
        "vm3",
        "--socket",
        os.path.join(pool, "nbd.vm2.sock"),
        workdir=tmp_path / "two",
    )
    taker: Server | None = None
    try:
        h = nbd.NBD()
        h.connect_uri(f"nbd+unix:///vm1?socket={sock}")
        h.pwrite(b"\x11" * 65536, 0)
        h.flush()
        h.shutdown()
        taker = Server(pool, "--volume", "vm1", "--takeover", "--socket", sock, workdir=tmp_path / "taker")
        assert first.proc.wait(30) == 0  # it served nothing more: stopped, cleanly
        assert "every volume it served was handed over: stopping" in first.log.read_text()
        h = nbd.NBD()
        h.connect_uri(f"nbd+unix:///vm1?socket={sock}")
        assert h.pread(65536, 0) == b"\x11" * 65536
        h.shutdown()
        refused = thinblock("serve", pool, "--volume", "vm2", "--takeover", check=False)
        assert refused.returncode != 0
        assert "keeps serving vm3; nothing was taken over" in refused.stderr, refused.stderr
        assert listing(pool)["vm2"]["open_clients"] == 0
        h = nbd.NBD()  # still both's
        h.connect_uri(f"nbd+unix:///vm2?socket={os.path.join(pool, 'nbd.vm2.sock')}")
        h.pwrite(b"\x22" * 4096, 0)
        h.flush()
        h.shutdown()
    finally:
        for server in (taker, both, first):
            if server is not None:
                _stop(server)
    thinblock("pool", "check", pool)


def test_a_control_client_that_half_closes_after_its_request_gets_its_answer(tmp_path: Path) -> None:
    """The control socket speaks JSON lines: a script (`socat`, `nc -N`) sends its
    request, shuts its sending side down and reads the answer. Only a client that
    closed its socket entirely has given up (its request is dropped unrun)."""
    import socket as socketlib

    from thinblock.admin.control import owner_socket_name
    from thinblock.backends import locate

    pool = _pool(tmp_path, "64M", {"a": "16M"})
    with owners(pool, tmp_path, "a") as (sa,):
        s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        s.settimeout(30)
        s.connect(os.path.join(locate(pool).runtime_dir(), owner_socket_name(sa.proc.pid)))
        s.sendall(b'{"verb": "open_clients", "args": {}}\n')
        s.shutdown(socketlib.SHUT_WR)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = s.recv(4096)
            assert chunk, f"no answer, the server closed: {reply!r}"
            reply += chunk
        s.close()
        assert json.loads(reply) == {"ok": {"a": 0}}


def test_a_takeover_of_several_volumes_checks_every_owner_before_taking_any(tmp_path: Path) -> None:
    """`--volume a --volume b --takeover` where b's owner does not answer (stopped):
    refused before a is taken, so a stays served by its owner, clients and all."""
    pool = _pool(tmp_path, "64M", {"a": "16M", "b": "16M"})
    with owners(pool, tmp_path, "a", "b") as (sa, sb):
        h = _handle(sa, "a")
        os.kill(sb.proc.pid, signal.SIGSTOP)
        try:
            taken = thinblock(
                "serve", pool, "--volume", "a", "--volume", "b", "--takeover", "--socket", str(tmp_path / "t.sock"),
                check=False,
            )  # fmt: skip
        finally:
            os.kill(sb.proc.pid, signal.SIGCONT)
        assert taken.returncode != 0
        assert f"kill {sb.proc.pid}" in taken.stderr and "nothing was taken over" in taken.stderr, taken.stderr
        h.pwrite(b"\x0a" * 4096, 0)  # a never left its owner
        h.flush()
        assert h.pread(4096, 0) == b"\x0a" * 4096
        h.shutdown()
        assert "handed over" not in sa.log.read_text()


def test_a_claiming_server_leaves_a_volume_it_handed_over_to_its_taker(tmp_path: Path) -> None:
    """`serve POOL` beside owners claims volumes nobody holds when a client asks. One it
    has just handed over (the first half of a takeover) it must not claim back for a
    client reconnecting to it, or the taker finds it held again and fails."""
    from thinblock.admin.control import ControlClient, owner_socket_name
    from thinblock.backends import locate

    pool = _pool(tmp_path, "64M", {"a": "16M", "b": "16M"})
    with owners(pool, tmp_path, "b"):
        rest = Server(pool, "--socket", str(tmp_path / "rest.sock"), workdir=tmp_path)
        try:
            h = _handle(rest, "a")
            h.pwrite(b"\x0b" * 4096, 0)
            h.flush()
            client = ControlClient(os.path.join(locate(pool).runtime_dir(), owner_socket_name(rest.proc.pid)), 30)
            try:
                assert client.call("volume_release", name="a")["clients_closed"] == 1
            finally:
                client.close()
            again = subprocess.run(
                ["qemu-img", "info", "-f", "raw", rest.unix_uri("a")], capture_output=True, text=True, timeout=60
            )
            assert again.returncode != 0 and "just handed over" in again.stderr, again.stderr
            (tmp_path / "t").mkdir()
            taker = Server(pool, "--volume", "a", "--socket", str(tmp_path / "taker.sock"), workdir=tmp_path / "t")
            try:
                ht = _handle(taker, "a")
                assert ht.pread(4096, 0) == b"\x0b" * 4096
                ht.shutdown()
            finally:
                _stop(taker)
        finally:
            _stop(rest)


# ----- Ceph: fencing one volume's owner, not the others -----------------------------------------


def _worker_pid(server: Server, name: str, how: str = "serves") -> int:
    """The pid of the worker that serves name from its start (how="claimed": since)."""
    found = re.search(rf"worker \d+ \(pid (\d+)\) {how} {name}\b", server.log.read_text())
    assert found, server.log.read_text()
    return int(found.group(1))


def test_a_stalled_ceph_owner_loses_one_volume_to_a_takeover_and_keeps_serving_the_other(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve --volume a --volume b on a Ceph pool runs a worker with a Ceph client of
    its own per volume. a's worker is stopped (SIGSTOP) and a taken over: the taker
    fences that worker's client alone. b's I/O never fails. When a's worker resumes,
    its write to a fails and changes nothing, it stops serving a with a log line and
    no traceback, and is not restarted; b is served on."""
    monkeypatch.setenv("THINBLOCK_RADOS_LEASE_S", "3")
    pool = _pool(tmp_path, "128M", {"a": "32M", "b": "32M"}, new_rados_locator(request, "stall"))
    first = _serve(pool, tmp_path, "a", "b")
    taker: Server | None = None
    stalled = _worker_pid(first, "a")
    try:
        wa, wb = Writer(first, "a", 32 * MiB, 21), Writer(first, "b", 32 * MiB, 22)
        _in_threads((wa, 60), (wb, 60))  # each ends with a flush
        os.kill(stalled, signal.SIGSTOP)
        late = wa.h.aio_pwrite(b"Z" * (64 << 10), 0)  # waits in the stopped worker's socket
        work = tmp_path / "taker"
        work.mkdir()
        taker = Server(pool, "--volume", "a", "--takeover", "--socket", str(work / "nbd.sock"), workdir=work)
        log = taker.log.read_text()
        assert "fencing it off" in log and "fenced" in log, log
        wb.run(40)  # b's worker was not fenced
        wb.check()
        wa.check(taker)  # every flushed byte of a
        os.kill(stalled, signal.SIGCONT)
        with pytest.raises(nbd.Error):
            while not wa.h.aio_command_completed(late):
                wa.h.poll(1000)
        wa.check(taker)  # the late write changed nothing
        until(lambda: "not restarting it" in first.log.read_text(), what="the fenced worker's end")
        text = first.log.read_text()
        assert "volume a: its lease is lost" in text and "Traceback" not in text, text
        wb.run(40)
        wb.check()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stalled, signal.SIGCONT)
        if taker is not None:
            _stop(taker)
        _stop(first)
    thinblock("pool", "check", pool)


def _lock_addresses(pool: str) -> dict[str, str]:
    """record key -> the Ceph client address a volume's lease record names (RADOS): the
    address a takeover blocklists."""
    import rados

    from thinblock.backends import locate
    from thinblock.backends.rados import RadosLocation
    from thinblock.meta.rados_leases import parse_record, record_key

    location = locate(pool)
    assert isinstance(location, RadosLocation)
    io = location.cluster().ioctx(location.ceph_pool)
    with rados.ReadOpCtx() as op:
        values, _ret = io.get_omap_vals_by_keys(op, tuple(record_key(vid) for vid in range(1, 32)))
        io.operate_read_op(op, location.meta_object)
        records = {key: parse_record(raw) for key, raw in values}
    return {key: str(rec["addr"]) for key, rec in records.items() if rec and rec.get("owner")}


def test_serve_without_volume_beside_a_ceph_owner_runs_a_worker_per_volume(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`serve POOL` without --volume beside a server per volume, on a Ceph pool: each
    volume nobody holds gets a worker process (a Ceph client) of its own, and a volume
    made since is claimed by a spare worker, and another asked for at the same time by
    the next spare, so no two volumes share a client. b's worker is stopped (SIGSTOP) and b taken over: the
    fence reaches b's worker alone; c and the new volumes are served on, and the
    stopped worker, once resumed, writes nothing and stops serving b."""
    monkeypatch.setenv("THINBLOCK_RADOS_LEASE_S", "3")
    pool = _pool(tmp_path, "128M", {"a": "16M", "b": "16M", "c": "16M"}, new_rados_locator(request, "beside"))
    sa = _serve(pool, tmp_path, "a")
    rest = Server(pool, "--socket", str(tmp_path / "rest.sock"), workdir=tmp_path)
    taker: Server | None = None
    stalled = 0
    try:
        assert [n for n, *_ in listed_exports(rest)] == ["b", "c"]
        pids = {name: _worker_pid(rest, name) for name in ("b", "c")}
        handles = {name: _handle(rest, name) for name in ("b", "c")}
        for name in ("new", "new2"):
            thinblock("volume", "create", pool, name, "--size", "8M")
        # Two clients at once: one is claimed by the spare, the other by the next spare.
        connecting = [
            threading.Thread(target=lambda n=n: handles.__setitem__(n, _handle(rest, n))) for n in ("new", "new2")
        ]
        for thread in connecting:
            thread.start()
        for thread in connecting:
            thread.join()
        for name in ("new", "new2"):
            claimed = rf"claimed {name}\b"  # "claimed new" is not "claimed new2"
            until(lambda: re.search(claimed, rest.log.read_text()) is not None, what=claimed)  # noqa: B023
            pids[name] = _worker_pid(rest, name, "claimed")
        assert len(set(pids.values())) == 4, pids  # a process (a Ceph client) per volume
        # ... with an address of its own: a blocklist entry names the address.
        addresses = _lock_addresses(pool)
        assert len(addresses) == 5 and len(set(addresses.values())) == 5, addresses  # a's server's too
        for name, h in handles.items():
            h.pwrite(name.encode() * 4096, 0)
            h.flush()
        stalled = pids["b"]
        os.kill(stalled, signal.SIGSTOP)
        # A write and a flush wait in the stopped worker's socket.
        late = [handles["b"].aio_pwrite(b"Z" * 4096, 0), handles["b"].aio_flush()]
        work = tmp_path / "taker"
        work.mkdir()
        taker = Server(pool, "--volume", "b", "--takeover", "--socket", str(work / "nbd.sock"), workdir=work)
        assert "fencing it off" in taker.log.read_text(), taker.log.read_text()
        for name in ("c", "new", "new2"):  # none of them was fenced
            handles[name].pwrite(name.upper().encode() * 4096, 0)
            handles[name].flush()
        os.kill(stalled, signal.SIGCONT)
        with pytest.raises(nbd.Error):  # the write, or at the latest its flush, fails
            for cookie in late:
                while not handles["b"].aio_command_completed(cookie):
                    handles["b"].poll(1000)
        hb = _handle(taker, "b")
        assert hb.pread(4096, 0) == b"b" * 4096  # the late write changed nothing
        hb.shutdown()
        until(lambda: "not restarting it" in rest.log.read_text(), what="the fenced worker's end")
        for name in ("c", "new", "new2"):
            assert handles[name].pread(4096 * len(name), 0) == name.upper().encode() * 4096
            handles[name].shutdown()
    finally:
        if stalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stalled, signal.SIGCONT)
        if taker is not None:
            _stop(taker)
        _stop(rest)
        _stop(sa)
    thinblock("pool", "check", pool)


def test_a_takeover_from_another_host_asks_the_owner_by_notify_and_keeps_every_acknowledged_write(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The owner of a and b serves on this host; commands and a taker on another host
    (tests/hosts.py) reach it by RADOS watch/notify, not a control socket: a snapshot,
    a resize, a sparsify and a rollback of a go to the owner (a job with a stream is
    refused, naming where to run it), then `serve --volume a --takeover` there has the owner hand
    a over (drain, commit, release) with nothing fenced: every acknowledged write,
    never flushed, is read back from the taker, and b is served on."""
    pool = _pool(tmp_path, "128M", {"a": "32M", "b": "32M"}, new_rados_locator(request, "handover"))
    first = _serve(pool, tmp_path, "a", "b")
    taker: Server | None = None
    try:
        ha, hb = _handle(first, "a"), _handle(first, "b")
        acked = random.Random(7).randbytes(4 * MiB)
        ha.pwrite(acked, 0)  # acknowledged, never flushed
        hb.pwrite(b"b" * MiB, 0)
        other = other_host("other")
        thinblock_on(other, "snapshot", "create", pool, "a", "s1")
        assert 'control: snapshot_create {"volume": "a", "name": "s1"}' in first.log.read_text()
        # Resize, sparsify (a job, without progress lines) and rollback go the same way.
        thinblock_on(other, "volume", "resize", pool, "a", "--size", "40M")
        thinblock_on(other, "volume", "sparsify", pool, "a")
        busy = thinblock_on(other, "volume", "rollback", pool, "a", "s1", check=False)
        assert "it is open by 1 client(s): NBD connection" in busy.stderr, busy.stderr  # the owner's answer
        log = first.log.read_text()
        assert all(f"control: {verb} " in log for verb in ("volume_resize", "volume_sparsify", "volume_rollback")), log
        refused = thinblock_on(other, "export", pool, "a", str(tmp_path / "a.raw"), check=False)
        assert refused.returncode != 0 and "run it on that host" in refused.stderr, refused.stderr
        work = tmp_path / "taker"
        work.mkdir()
        started = time.monotonic()
        taker = Server(
            pool,
            "--volume",
            "a",
            "--takeover",
            "--socket",
            str(work / "nbd.sock"),
            workdir=work,
            host=other_host("other"),
        )
        h2 = _handle(taker, "a")
        assert h2.pread(4 * MiB, 0) == acked
        print(f"gap from --takeover to the first read served: {time.monotonic() - started:.3f} s")
        log = taker.log.read_text()
        assert "by notify" in log and "handed over in" in log and "fenc" not in log, log
        with pytest.raises(nbd.Error):
            ha.pread(4096, 0)
        hb.pwrite(b"B" * MiB, MiB)
        hb.flush()
        assert hb.pread(2 * MiB, 0) == b"b" * MiB + b"B" * MiB
        snap = _handle(taker, "s1")  # the snapshot went with its volume
        assert snap.pread(4 * MiB, 0) == acked
        h2.shutdown()
        hb.shutdown()
    finally:
        if taker is not None:
            _stop(taker)
        _stop(first)
    thinblock("pool", "check", pool)
