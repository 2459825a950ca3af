"""`thinblock serve POOL --workers N`: one socket, N worker processes owning the
volumes between them, connections handed to the owner once an option names an
export. Real servers, real clients (libnbd, nbdinfo, qemu-img), real TLS.

Which worker accepts a connection is the kernel's choice, so every test that
needs a hand-over forces one: a libnbd handle in option mode first asks about an
export of one worker (NBD_OPT_INFO), then goes to an export of the other. Each
connection is then handed over at least once, whoever accepted it.

- one socket serves every volume; writes and reads through hand-overs match a
  model; a snapshot taken through the CLI is served through the one socket;
- TLS with --tls-authz: the grant holds through the hand-over (the accepting
  worker relays the TLS bytes), and a SIGHUP that withdraws it ends the
  connection at the owner;
- a worker killed with SIGKILL is restarted on its volumes, flushed bytes
  intact, while the other worker's client never sees an error;
- a hand-over from a process that is not a worker of the group is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import nbd
import pytest

from tests.cli import export_bytes, thinblock
from tests.nbd_server import Server
from tests.nbd_tls_client import PKI
from tests.test_commands import until
from tests.test_nbd_protocol import Catalog, opt, replies
from thinblock.backends import locate
from thinblock.core.owner import owner_pid
from thinblock.frontends.nbd import constants as c
from thinblock.frontends.nbd.protocol import NEED_DATA, ExportInfo, ExportRouted, Route, ServerConnection
from thinblock.frontends.nbd.server import MAX_HOPS, Handed, next_hops
from thinblock.frontends.nbd.workers import handoff_address, parent_pid

MiB = 1 << 20
VOLUMES = ("a", "b", "c", "d")  # dealt out in order: worker 0 owns a and c, worker 1 b and d


def _pool(tmp_path: Path) -> str:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    for name in VOLUMES:
        thinblock("volume", "create", pool, name, "--size", "16M")
    return pool


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Server]:
    pool = _pool(tmp_path)
    server = Server(pool, "--workers", "2")
    try:
        yield server
    finally:
        server.stop()
        log = server.log.read_text()
        assert "Traceback" not in log, log
        thinblock("pool", "check", pool)


def holders(pool: str) -> dict[str, int | None]:
    """The pid owning each volume, from the store's leases."""
    return holders_of(pool, VOLUMES)


def holders_of(pool: str, names: Iterable[str]) -> dict[str, int | None]:
    """The pid owning each of these volumes, from the store's leases."""
    meta = locate(pool).open_meta(readonly=False)  # the leases are read through a writable opening
    try:
        rows = {row.name: row.id for row in meta.volumes()}
        out: dict[str, int | None] = {}
        for name in names:
            holder = meta.volume_holder(rows[name])
            out[name] = owner_pid(holder) if holder else None
        return out
    finally:
        meta.close()


def routed(uri_of: str, first: str | tuple[str, ...], export: str, tls_dir: Path | None = None) -> nbd.NBD:
    """A handle on export that first asked about `first` (another worker's export, or
    several in turn): its connection is handed over on the way, whichever worker
    accepted it; asking about export, the other's, then export again hands it over
    twice at least, once as a connection that came handed over already."""
    h = nbd.NBD()
    if tls_dir is not None:
        h.set_tls(nbd.TLS_REQUIRE)
        h.set_tls_certificates(str(tls_dir))
    h.set_opt_mode(True)
    h.connect_uri(uri_of)
    for name in (first,) if isinstance(first, str) else first:
        h.set_export_name(name)
        h.opt_info()
    h.set_export_name(export)
    h.opt_go()
    return h


def test_one_socket_serves_the_volumes_of_every_worker(served: Server) -> None:
    pool = served.pool
    owners = holders(pool)
    workers = {pid for pid in owners.values() if pid is not None}
    assert len(workers) == 2, owners
    assert all(parent_pid(pid) == served.proc.pid for pid in workers)
    assert owners["a"] == owners["c"] != owners["b"] == owners["d"]
    uri = served.unix_uri("")
    models = {name: bytearray(16 * MiB) for name in VOLUMES}
    for i, name in enumerate(VOLUMES):
        other = VOLUMES[(i + 1) % 4]  # always the other worker's
        h = routed(uri, other, name)
        for j in range(8):
            data = bytes([i * 16 + j + 1]) * (64 << 10)
            off = (j * 3 + i) * (256 << 10)
            h.pwrite(data, off)
            models[name][off : off + len(data)] = data
        h.flush()
        assert h.pread(1 * MiB, 0) == bytes(models[name][: 1 * MiB])
        h.shutdown()
    log = served.log.read_text()
    assert log.count("handed over to worker") >= 4, log

    # The default export "" is refused, as by one process serving these four volumes,
    # whichever worker accepts (each owns two, and one of them alone would not say so).
    for _ in range(4):
        refused = subprocess.run(["qemu-img", "info", uri], capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0, refused.stdout

    # The listing names every worker's exports; qemu-img reads each through the socket.
    listing = subprocess.run(["nbdinfo", "--list", "--json", uri], capture_output=True, text=True, check=True)
    assert sorted(e["export-name"] for e in json.loads(listing.stdout)["exports"]) == list(VOLUMES)
    copy = Path(pool).parent / "copy.raw"
    for name in VOLUMES:
        subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "raw", served.unix_uri(name), str(copy)], check=True)
        assert copy.read_bytes() == bytes(models[name]), name

    # A snapshot through the CLI goes to a's worker; the other worker, which has never
    # heard of it, hands a client asking for it over to a's.
    thinblock("snapshot", "create", pool, "a@s1")
    h = routed(uri, "b", "a@s1")
    assert h.is_read_only()
    assert h.pread(16 * MiB, 0) == bytes(models["a"])
    h.shutdown()
    h = routed(uri, "a", "b")
    h.pwrite(b"\xee" * 4096, 0)
    h.flush()
    h.shutdown()
    models["b"][:4096] = b"\xee" * 4096
    listing = subprocess.run(["nbdinfo", "--list", "--json", uri], capture_output=True, text=True, check=True)
    assert "a@s1" in [e["export-name"] for e in json.loads(listing.stdout)["exports"]]

    # Jobs go to the worker owning their volume.
    assert export_bytes(pool, "b") == bytes(models["b"])
    assert export_bytes(pool, "a@s1") == bytes(models["a"])

    # Pool-level commands work while the workers own every volume; the open clients
    # listed are the workers' own counts, whichever worker a connection went to.
    held = [routed(uri, "b", "a"), routed(uri, "a", "b"), routed(uri, "a", "b")]
    try:
        status = json.loads(thinblock("volume", "list", pool, "--json").stdout)
        assert {v["name"] for v in status} >= {*VOLUMES, "a@s1"}
        clients = {v["name"]: v["open_clients"] for v in status}
        assert clients == {"a": 1, "b": 2, "c": 0, "d": 0, "a@s1": 0}, clients
    finally:
        for h in held:
            h.shutdown()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return PKI(tmp_path_factory.mktemp("workers") / "pki")


def test_tls_and_authz_hold_through_the_handover(tmp_path: Path, pki: PKI) -> None:
    pool = _pool(tmp_path)
    authz = tmp_path / "authz"
    authz.write_text("admin rw *\nbackup ro b,c\n")
    authz.chmod(0o600)
    admin, backup = pki.client("admin", "/CN=admin"), pki.client("backup", "/CN=backup")
    server = Server(pool, "--workers", "2", *pki.serve_args(authz))
    try:
        port = int(server.tcp_uri("a").rsplit(":", 1)[1].split("/")[0])
        uri = f"nbds://localhost:{port}/"
        h = routed(uri, "a", "b", admin)  # a and b: different workers
        h.pwrite(b"\x5a" * 65536, 0)
        h.flush()
        assert h.pread(65536, 0) == b"\x5a" * 65536
        h.shutdown()

        # backup may read b and c (different workers) and nothing else, also when its
        # connection, relayed by the worker holding its TLS, is handed over again.
        h = routed(uri, ("b", "c"), "b", backup)
        assert h.is_read_only()
        assert h.pread(65536, 0) == b"\x5a" * 65536
        with pytest.raises(nbd.Error):
            h.pwrite(b"x" * 512, 0)
        refused = nbd.NBD()
        refused.set_tls(nbd.TLS_REQUIRE)
        refused.set_tls_certificates(str(backup))
        with pytest.raises(nbd.Error):
            refused.connect_uri(uri + "a")

        # The grant goes (SIGHUP to the supervisor, forwarded): the owner ends the
        # connection, and the worker relaying its TLS closes it.
        authz.write_text("admin rw *\n")
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        ended = False
        while time.monotonic() < deadline and not ended:
            try:
                h.pread(512, 0)
                time.sleep(0.1)
            except nbd.Error:
                ended = True
        assert ended, server.log.read_text()
        # Logged by the owner before it hangs up (the "closed (grant withdrawn)" line
        # comes after the socket closes, so the client may see the end before it).
        assert "closing: client certificate backup" in server.log.read_text()
        assert "relaying its TLS" in server.log.read_text()
    finally:
        server.stop()
        assert "Traceback" not in server.log.read_text(), server.log.read_text()
    thinblock("pool", "check", pool)


def test_a_killed_worker_is_restarted_and_the_others_keep_serving(served: Server) -> None:
    pool = served.pool
    owners = holders(pool)
    victim = owners["b"]
    assert victim is not None
    uri = served.unix_uri("")
    h = routed(uri, "a", "b")
    flushed = bytes(range(256)) * 256
    h.pwrite(flushed, 1 * MiB)
    h.flush()

    # A client of the other worker writes and reads all along.
    survivor = routed(uri, "b", "a")
    errors: list[BaseException] = []
    done = threading.Event()
    writes = 0

    def keep_writing() -> None:
        nonlocal writes
        try:
            while not done.is_set():
                data = bytes([writes % 251 + 1]) * 4096
                survivor.pwrite(data, (writes % 1024) * 4096)
                assert survivor.pread(4096, (writes % 1024) * 4096) == data
                writes += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=keep_writing)
    thread.start()
    try:
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(nbd.Error):  # its client's connection is gone
            for _ in range(100):
                h.pread(4096, 0)
                time.sleep(0.05)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = holders(pool)["b"]
            if now is not None and now != victim:
                break
            time.sleep(0.1)
        restarted = holders(pool)
        assert restarted["b"] not in (None, victim), restarted
        assert restarted["a"] == owners["a"]
        h2 = routed(uri, "a", "b")
        assert h2.pread(len(flushed), 1 * MiB) == flushed
        h2.pwrite(b"\x01" * 4096, 0)
        h2.flush()
        h2.shutdown()
        time.sleep(0.2)  # the survivor goes on writing across the restart
    finally:
        done.set()
        thread.join()
    assert not errors, errors
    assert writes > 0
    survivor.flush()
    survivor.shutdown()
    log = served.log.read_text()
    assert "killed by SIGKILL): restarting it for b, d" in log, log


def _handoff_dir(server: Server) -> str:
    found = re.search(r"hand connections to each other through sockets in (\S+)", server.log.read_text())
    assert found, server.log.read_text()
    return found.group(1)


def _wait_for_log(server: Server, text: str) -> None:
    deadline = time.monotonic() + 30
    while text not in server.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert text in server.log.read_text(), server.log.read_text()


def test_a_handover_from_outside_the_group_is_refused(served: Server) -> None:
    worker = holders(served.pool)["a"]
    assert worker is not None
    directory = _handoff_dir(served)
    assert os.stat(directory).st_mode & 0o077 == 0  # nobody else may even look in
    victim_end, kept = socket.socketpair()
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as ctl:
        ctl.connect(handoff_address(directory, worker))
        forged: dict[str, object] = {"state": {}, "peer": "x", "address": None, "tls": True, "peercert": {}}
        with contextlib.suppress(OSError):  # closed unread: the send may or may not get in first
            socket.send_fds(ctl, [json.dumps({**forged, "via": "me", "hops": 1}).encode()], [victim_end.fileno()])
        ctl.settimeout(5)
        try:
            answer = ctl.recv(4096)
        except ConnectionResetError:  # closed with what was sent unread
            answer = b""
        assert answer == b""  # nothing is answered to a stranger
    victim_end.close()
    kept.settimeout(5)
    assert kept.recv(1) == b""  # what it sent was closed unread
    kept.close()
    _wait_for_log(served, "refused a hand-over from pid")


def test_a_worker_stopped_gracefully_leaves_the_socket_to_the_others(served: Server) -> None:
    pool = served.pool
    victim = holders(pool)["b"]
    assert victim is not None
    os.kill(victim, signal.SIGTERM)  # it drains and commits: its listener is the group's, not shut
    assert _new_holder(pool, "b", victim) is not None
    for name in ("a", "b", "c", "d", "a", "c"):  # every worker still accepts on the one socket
        h = nbd.NBD()
        h.connect_uri(served.unix_uri(name))
        h.pwrite(b"\x03" * 512, 0)
        h.flush()
        h.shutdown()


def _new_holder(pool: str, name: str, old: int | None) -> int | None:
    """Wait (bounded) until name is held by a process other than old; its pid or None."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = holders(pool)[name]
        if now is not None and now != old:
            return now
        time.sleep(0.1)
    return None


def _refusal(uri: str) -> str:
    """The error a client asking for this export gets, as qemu-img shows the server's
    message (libnbd keeps only the error code)."""
    proc = subprocess.run(["qemu-img", "info", uri], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, f"{uri} was served"
    return proc.stderr


def test_a_worker_that_keeps_dying_is_left_down_and_its_volumes_claimed_by_the_others(served: Server) -> None:
    pool = served.pool
    pid = holders(pool)["b"]
    for _ in range(3):  # three deaths are restarted ...
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        pid = _new_holder(pool, "b", pid)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # ... the fourth in a minute is not
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "not restarting it" not in served.log.read_text():
        time.sleep(0.1)
    assert "not restarting it; its volumes (b, d) are not served" in served.log.read_text()
    assert holders(pool)["b"] is None
    h = nbd.NBD()  # the other worker serves on
    h.connect_uri(served.unix_uri("a"))
    h.pwrite(b"\x01" * 4096, 0)
    h.flush()
    h.shutdown()
    # Nobody holds b now: the worker left asked for it claims it (serve POOL's promise).
    h = nbd.NBD()
    h.connect_uri(served.unix_uri("b"))
    h.pwrite(b"\x02" * 4096, 0)
    h.flush()
    h.shutdown()
    assert holders(pool)["b"] == holders(pool)["a"]


def test_a_sigterm_during_a_restart_pause_stops_the_server_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that died again is restarted after a pause; the pause is the main loop's,
    so a SIGTERM meanwhile stops the server then, without restarting the worker first
    (the pause is 30 s here: a server that slept it through would miss the bound)."""
    monkeypatch.setenv("THINBLOCK_RESTART_PAUSE_S", "30")
    pool = _pool(tmp_path)
    server = Server(pool, "--workers", "2")
    try:
        pid = holders(pool)["b"]
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the first death: restarted at once
        pid = _new_holder(pool, "b", pid)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the second: restarted after the pause
        _wait_for_log(server, "restarting in 30.00 s")
        h = nbd.NBD()  # the other worker serves on meanwhile
        h.connect_uri(server.unix_uri("a"))
        h.pwrite(b"\x03" * 4096, 0)
        h.flush()
        h.shutdown()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=20) == 0
    finally:
        server.stop()
    log = server.log.read_text()
    assert "Traceback" not in log, log
    assert "stopping on SIGTERM" in log
    assert log.count("serves b, d") == 2, log  # started, restarted once; not again
    thinblock("pool", "check", pool)


def test_a_volume_taken_over_by_another_server_leaves_the_group(served: Server, tmp_path: Path) -> None:
    pool = served.pool
    worker = holders(pool)["b"]
    other = Server(pool, "--volume", "b", "--takeover", "--socket", str(tmp_path / "other.sock"))
    try:
        assert holders(pool)["b"] == other.proc.pid
        assert f"pid {other.proc.pid}" in _refusal(served.unix_uri("b"))  # names who serves it
        assert worker is not None and parent_pid(worker) == served.proc.pid  # the worker serves on
        h = routed(served.unix_uri(""), "a", "d")  # its other volume stays
        h.pwrite(b"\x02" * 4096, 0)
        h.flush()
        h.shutdown()
    finally:
        other.stop()
    assert "restarting" not in served.log.read_text()


def _running(pid: int) -> bool:
    """Whether pid is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[0] != b"Z"


def test_workers_stop_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    server = Server(pool, "--workers", "2")
    workers = {pid for pid in holders(pool).values() if pid is not None}
    assert len(workers) == 2
    server.proc.kill()
    server.proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_running(pid) for pid in workers):
        time.sleep(0.1)
    assert not any(_running(pid) for pid in workers), "a worker outlived its supervisor"
    # ... killed with it, as one process's threads would be, not stopping in order
    assert "stopping on SIGTERM" not in server.log.read_text()
    assert "[worker 0]" in server.log.read_text() and "[worker 1]" in server.log.read_text()
    shutil.rmtree(_handoff_dir(server))  # a killed supervisor leaves its empty directory behind
    thinblock("pool", "check", pool)
    again = Server(pool, "--workers", "2")  # the socket left behind is a dead one: replaced
    try:
        h = routed(again.unix_uri(""), "a", "b")
        h.pwrite(b"\x07" * 512, 0)
        h.flush()
        h.shutdown()
    finally:
        again.stop()
    thinblock("pool", "check", pool)


def _serve_refused(pool: str, sock: Path) -> subprocess.CompletedProcess[str]:
    """A second `serve POOL`, which must be refused (a bounded wait if it is not)."""
    return subprocess.run(
        [sys.executable, "-m", "thinblock", "serve", pool, "--socket", str(sock)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")},
        timeout=60,
    )


def test_nbdinfo_lists_many_exports_whose_owners_alternate(tmp_path: Path) -> None:
    """nbdinfo --list asks about each export in turn on one connection; with the volumes
    dealt out to two workers in name order, each of them is a hand-over. A bound on a
    connection's hand-overs (there was one of 16) would cut the listing short; the bound
    is on hand-overs of one option nobody answers."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    names = [f"v{i:02d}" for i in range(40)]
    for name in names:
        thinblock("volume", "create", pool, name, "--size", "1M")
    server = Server(pool, "--workers", "2")
    try:
        listing = subprocess.run(
            ["nbdinfo", "--list", "--json", server.unix_uri("")], capture_output=True, text=True, timeout=120
        )
        assert listing.returncode == 0, listing.stderr
        exports = json.loads(listing.stdout)["exports"]
        assert [e["export-name"] for e in exports] == names
        assert all(e["export-size"] == 1 << 20 for e in exports)
        assert server.log.read_text().count("handed over to worker") >= 20
    finally:
        server.stop()


def test_workers_start_while_a_command_holds_every_volume_and_claim_them_after(tmp_path: Path) -> None:
    """A volume held by a command (an import into it, still reading its stream) is
    free again when the command ends: `serve POOL --workers 2` beside the server of
    the other volume is not refused for that, and a client asking for the volume
    afterwards has a worker claim it."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "a", "--size", "8M")
    thinblock("volume", "create", pool, "b", "--size", "8M")
    owner_b = Server(pool, "--volume", "b", "--socket", str(tmp_path / "b.sock"))  # the pool is served per volume
    job = subprocess.Popen(
        [sys.executable, "-m", "thinblock", "import", "-", pool, "a", "--no-progress"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")},
    )
    server: Server | None = None
    try:
        assert job.stdin is not None
        job.stdin.write(b"\x07" * MiB)  # the import reads its first bytes before it opens the pool
        job.stdin.flush()
        until(lambda: holders_of(pool, ["a"])["a"] == job.pid, "the import to take a's lease")
        server = Server(pool, "--workers", "2")
        job.stdin.write(b"\x07" * (7 * MiB))
        job.stdin.close()
        assert job.wait(120) == 0, job.stderr.read() if job.stderr else ""
        h = nbd.NBD()
        h.connect_uri(server.unix_uri("a"))
        assert h.pread(4096, 0) == b"\x07" * 4096
        h.shutdown()
        assert parent_pid(holders_of(pool, ["a"])["a"] or 0) == server.proc.pid
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        if server is not None:
            server.stop()
        owner_b.stop()
    thinblock("pool", "check", pool)


def test_workers_auto_takes_one_per_core_and_a_second_serve_is_refused_naming_it(tmp_path: Path) -> None:
    """--workers auto: one worker per core (at most one per volume); a second `serve
    POOL` is refused naming the pid that was started, as with one process, rather
    than serving nothing (every volume is held)."""
    pool = _pool(tmp_path)
    cores = len(os.sched_getaffinity(0))
    server = Server(pool, "--workers", "auto")
    try:
        owners = holders(pool)
        pids = set(owners.values())
        assert None not in pids, owners
        assert len(pids) == min(cores, len(VOLUMES)), (cores, owners)
        if len(pids) > 1:
            assert all(parent_pid(pid) == server.proc.pid for pid in pids if pid is not None)
        second = _serve_refused(pool, tmp_path / "second.sock")
        assert second.returncode != 0, second.stdout
        assert f"pid {server.proc.pid}" in second.stderr, second.stderr
        h = routed(server.unix_uri(""), "b", "a")  # and the one socket serves them
        h.pwrite(b"\x05" * 512, 0)
        h.flush()
        h.shutdown()
    finally:
        server.stop()
    assert export_bytes(pool, "a")[:512] == b"\x05" * 512


def test_serve_is_one_process_owning_the_whole_pool_by_default(tmp_path: Path) -> None:
    """Without --workers, one process owns the whole pool, as qemu-nbd serves: a flush
    covers every volume, a kill ends everything at once, one pid holds it."""
    pool = _pool(tmp_path)
    server = Server(pool)
    try:
        location = locate(pool)
        assert location.is_owned() and not location.served_per_volume()
        assert "[worker" not in server.log.read_text()
    finally:
        server.stop()


def test_workers_are_refused_with_metrics(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "thinblock", "serve", pool, "--workers", "2", "--metrics", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")},
        timeout=60,
    )
    assert proc.returncode != 0
    assert "--metrics is not available with several worker processes" in proc.stderr
    bad = thinblock("serve", pool, "--workers", "zero", check=False)
    assert bad.returncode == 2 and "--workers" in bad.stderr


def _holder_pid(pool: str, name: str) -> int | None:
    meta = locate(pool).open_meta(readonly=False)
    try:
        row = next(row for row in meta.volumes() if row.name == name)
        holder = meta.volume_holder(row.id)
        return owner_pid(holder) if holder else None
    finally:
        meta.close()


def test_volumes_nobody_holds_are_claimed_by_the_workers(served: Server, tmp_path: Path) -> None:
    """A volume made through the CLI while the workers run, and one whose own `serve
    --volume` server stopped, are served through the one socket: the worker a client
    reaches claims it, and the other hands its clients to that one."""
    pool = served.pool
    uri = served.unix_uri("")
    thinblock("volume", "create", pool, "e", "--size", "8M")
    assert _holder_pid(pool, "e") is None
    listing = subprocess.run(["nbdinfo", "--list", "--json", uri], capture_output=True, text=True, check=True)
    assert "e" in [x["export-name"] for x in json.loads(listing.stdout)["exports"]]  # an export at once
    h = nbd.NBD()
    h.connect_uri(served.unix_uri("e"))
    model = bytearray(8 * MiB)
    for j in range(4):
        data = bytes([0x30 + j]) * (64 << 10) + b"\x01" * 512
        h.pwrite(data, j * MiB + 512)
        model[j * MiB + 512 : j * MiB + 512 + len(data)] = data
    h.flush()
    assert h.pread(8 * MiB, 0) == bytes(model)
    h.shutdown()
    claimer = _holder_pid(pool, "e")  # claimed when nbdinfo asked about it, or the client did
    assert claimer is not None and parent_pid(claimer) == served.proc.pid
    for other in ("a", "b"):  # through each worker: one serves it, the other hands over
        h = routed(uri, other, "e")
        assert h.pread(8 * MiB, 0) == bytes(model)
        h.shutdown()
    assert _holder_pid(pool, "e") == claimer

    thinblock("volume", "create", pool, "f", "--size", "8M")
    alone = Server(pool, "--volume", "f", "--socket", str(tmp_path / "f.sock"))
    try:
        h = nbd.NBD()
        h.connect_uri(alone.unix_uri("f"))
        h.pwrite(b"\xf0" * (128 << 10), 4096)
        h.flush()
        h.shutdown()
        assert f"pid {alone.proc.pid}" in _refusal(served.unix_uri("f"))  # held: named, not claimed
    finally:
        alone.stop()
    h = routed(uri, ("a", "b"), "f")
    assert h.pread(256 << 10, 0) == bytes(4096) + b"\xf0" * (128 << 10) + bytes((256 << 10) - 4096 - (128 << 10))
    h.pwrite(b"\xf1" * 4096, 0)
    h.flush()
    h.shutdown()
    holder = _holder_pid(pool, "f")
    assert holder is not None and parent_pid(holder) == served.proc.pid


class _RoutesB(Catalog):
    """A worker's view where export "b" is a sibling's (its lookups are routed)."""

    def lookup(self, name: str) -> ExportInfo | None:
        if name == "b":
            raise ExportRouted("4242", name)
        return super().lookup(name)


def _info(name: bytes) -> bytes:
    return opt(c.OPT_INFO, struct.pack(">I", len(name)) + name + struct.pack(">H", 0))


def test_hops_count_an_option_passed_on_unanswered_not_a_client_that_lists() -> None:
    """next_hops: an option a worker passes on again unanswered is one hop more (MAX_HOPS
    ends a loop between two workers that disagree on an owner); once a worker has
    answered an option, the next hand-over starts at 1 (a listing asks about many)."""
    conn = ServerConnection(_RoutesB())
    conn.data_to_send()
    conn.receive_data(struct.pack(">I", c.FLAG_C_FIXED_NEWSTYLE) + _info(b"b"))
    assert isinstance(conn.next_event(), Route)
    first = Handed(state=conn.handoff_state(), peer="unix", address=None, tls=False, peercert=None, via="w1")
    assert next_hops(None, first.state) == 1

    # The receiver also routes b (it disagrees): passed on unanswered, even with more
    # bytes from the client behind it, it is one hop more each time, up to the bound.
    there = ServerConnection.resume(_RoutesB(), first.state, tls_required=False, tls_available=False)
    there.receive_data(_info(b"a"))
    assert isinstance(there.next_event(), Route)
    assert next_hops(first, there.handoff_state()) == 2
    looping = dataclasses.replace(first, hops=MAX_HOPS)
    assert next_hops(looping, there.handoff_state()) == MAX_HOPS + 1  # refused by _route

    # A receiver that answers b, then meets the client's next option naming a
    # sibling's export, hands it on as a fresh start.
    owner = Catalog()
    owner.exports["b"] = ExportInfo("b", 4096, False)
    answered = ServerConnection.resume(owner, first.state, tls_required=False, tls_available=False)
    assert answered.next_event() is NEED_DATA  # INFO b answered here
    assert [r[1] for r in replies(answered.data_to_send())][-1] == c.REP_ACK
    answered.catalog = _RoutesB()
    answered.receive_data(_info(b"b"))
    assert isinstance(answered.next_event(), Route)
    assert next_hops(dataclasses.replace(first, hops=MAX_HOPS), answered.handoff_state()) == 1


def test_a_restart_that_is_due_already_does_not_stop_the_supervisor() -> None:
    """The supervisor waits for signals until the next restart is due; one due already
    (two workers died together) is a wait of zero, which must not make the signal
    socket non-blocking (BlockingIOError stopped every worker)."""
    code = (
        "import signal\n"
        "from thinblock.frontends.cli.main import _SignalQueue\n"
        "q = _SignalQueue(signal.SIGHUP)\n"
        "assert q.within(0.0) is None and q.within(-1.0) is None\n"
        "signal.raise_signal(signal.SIGHUP)\n"
        "assert q.within(0.0) == signal.SIGHUP\n"
        "print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")},
        timeout=60,
    )
    assert out.stdout.strip() == "ok", out.stderr


def test_a_claiming_worker_with_no_volume_is_restarted(tmp_path: Path) -> None:
    """`serve POOL --workers 2` of a pool with no volume yet: its worker serves the
    volumes made later (claimed when asked), so one that dies is restarted like any,
    and the server does not stop for want of volumes."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    server = Server(pool, "--workers", "2")
    try:
        workers = [int(p) for p in Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()]
        assert workers
        os.kill(workers[0], signal.SIGKILL)
        _wait_for_log(server, "restarting it for")
        until(lambda: server.log.read_text().count("serves no volume") >= 2, "the restarted worker to be ready")
        assert server.log.read_text().count("serves no volume") == 2, server.log.read_text()
        assert server.proc.poll() is None
        thinblock("volume", "create", pool, "late", "--size", "8M")
        h = nbd.NBD()
        h.connect_uri(server.unix_uri("late"))
        h.pwrite(b"\x09" * 4096, 0)
        h.flush()
        h.shutdown()
    finally:
        server.stop()
    assert "Traceback" not in server.log.read_text()
    thinblock("pool", "check", pool)


def test_more_workers_than_volumes_given_says_so(tmp_path: Path) -> None:
    """`--workers 3 --volume a`: one process serves a volume, so one worker runs,
    and the log says why there are fewer than asked."""
    pool = _pool(tmp_path)
    server = Server(pool, "--workers", "3", "--volume", "a")
    try:
        h = nbd.NBD()
        h.connect_uri(server.unix_uri("a"))
        h.pwrite(b"w" * 4096, 0)
        assert h.pread(4096, 0) == b"w" * 4096
        h.shutdown()
        log = server.log.read_text()
        assert "--workers 3 for 1 volume(s) given with --volume: 1 worker(s), one per volume" in log, log
    finally:
        server.stop()
    assert "Traceback" not in server.log.read_text()
