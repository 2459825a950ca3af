"""A real single-node Ceph cluster for the tests: 1 mon, 1 mgr, 1 bluestore OSD on
a sparse file, no systemd, loopback only, everything under one directory. The mgr
is there because pool quotas and `ceph df` need its statistics.

    python -m tests.ceph_cluster start DIR   # prints the ceph.conf path once a write succeeded
    python -m tests.ceph_cluster stop DIR    # OSD first, then the mon; waits on the pids

scripts/test starts one for the whole suite and exports CEPH_CONF and
THINBLOCK_TEST_CEPH_POOL; tests/conftest.py starts its own when they are unset.
The pitfalls it avoids are in docs/ceph.md (slow paxos, health warning on a
full disk, OSD key setup, wildcard listening, pid files that vanish early).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

TEST_POOL = "thinblock-test"
TIMEOUT = 60  # every ceph command is bounded (without a mgr some hang forever), generously: a loaded machine is slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_IN: list[str] = []  # the command prefix of the cluster being started: `ip netns exec NS`, or nothing


def _run(*args: str, input: str | None = None) -> str:
    args = (*_IN, *args)
    proc = subprocess.run(args, capture_output=True, text=True, input=input, timeout=TIMEOUT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def _conf(d: Path, fsid: str, port: int, block_bytes: int, addr: str, network: str) -> str:
    return f"""[global]
fsid = {fsid}
mon host = v2:{addr}:{port}
ms bind msgr1 = false
public addr = {addr}
cluster addr = {addr}
public network = {network}
cluster network = {network}
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = {d}/keyring
log file = {d}/$name.log
admin socket = {d}/$name.asok
pid file = {d}/$name.pid
run dir = {d}
osd pool default size = 1
osd pool default min size = 1
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon data avail warn = 1
mon data avail crit = 0
paxos propose interval = 0.05
mon warn on pool no redundancy = false
osd objectstore = bluestore
osd data = {d}/osd.$id
bluestore block create = true
bluestore block size = {block_bytes}
osd memory target = 939524096
rados osd op timeout = 30
rados mon op timeout = 30
mgr stats period = 1
mon mgr digest period = 1
osd pool default pg autoscale mode = off
auth allow insecure global id reclaim = false

[client]
# Each client process its own admin socket. With the daemons' $name.asok a new
# client waits about 10 s on the socket of a client that is stopped (a SIGSTOPped
# server being taken over), which never answers.
admin socket = {d}/$name.$pid.$cctid.asok

[mon.a]
mon data = {d}/mon.a
"""


def start(directory: str, block_bytes: int = 8 << 30, *, netns: str | None = None, addr: str = "127.0.0.1") -> str:
    """Start the cluster in directory (made if missing); returns its ceph.conf path.
    block_bytes: the OSD's sparse bluestore file (it never shrinks). netns: run it in
    that network namespace (made by the test, tests/netns.py), listening on addr
    there, which the test routes its hosts to (then block_bytes is small, and the
    pool is as here)."""
    global _IN
    _IN = ["ip", "netns", "exec", netns] if netns else []
    try:
        return _start(directory, block_bytes, addr)
    finally:
        _IN = []


def _start(directory: str, block_bytes: int, addr: str) -> str:
    d = Path(directory).resolve()
    d.mkdir(parents=True, exist_ok=True)
    if any(d.iterdir()):
        raise RuntimeError(f"{d} is not empty: a cluster starts in a fresh directory")
    fsid = str(uuid.uuid4())
    port = _free_port() if not _IN else 3300  # a namespace of its own has every port free
    network = "127.0.0.0/8" if addr == "127.0.0.1" else f"{addr}/32"
    conf = d / "ceph.conf"
    conf.write_text(_conf(d, fsid, port, block_bytes, addr, network))
    c = ["-c", str(conf)]
    keyring = str(d / "keyring")
    _run("ceph-authtool", "--create-keyring", keyring, "--gen-key", "-n", "mon.", "--cap", "mon", "allow *")
    _run(
        "ceph-authtool", keyring, "--gen-key", "-n", "client.admin",
        "--cap", "mon", "allow *", "--cap", "osd", "allow *", "--cap", "mgr", "allow *",
    )  # fmt: skip
    _run("monmaptool", "--create", "--addv", "a", f"[v2:{addr}:{port}]", "--fsid", fsid, str(d / "monmap"))
    _run("ceph-mon", *c, "--mkfs", "-i", "a", "--monmap", str(d / "monmap"), "--keyring", keyring)
    _run("ceph-mon", *c, "-i", "a")
    _record(d, "mon.a")
    osd_uuid = str(uuid.uuid4())
    secret = _run("ceph-authtool", "--gen-print-key").strip()
    osd_id = _run("ceph", *c, "osd", "new", osd_uuid, "-i", "-", input=json.dumps({"cephx_secret": secret})).strip()
    osd_dir = d / f"osd.{osd_id}"
    osd_dir.mkdir(exist_ok=True)
    (osd_dir / "keyring").write_text(f"[osd.{osd_id}]\n\tkey = {secret}\n")
    _run("ceph-osd", *c, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid, "--keyring", str(osd_dir / "keyring"))
    _run("ceph-osd", *c, "-i", osd_id, "--keyring", str(osd_dir / "keyring"))
    _record(d, f"osd.{osd_id}")
    mgr_dir = d / "mgr.x"
    mgr_dir.mkdir(exist_ok=True)
    mgr_key = _run("ceph", *c, "auth", "get-or-create", "mgr.x", "mon", "allow profile mgr", "osd", "allow *")
    (mgr_dir / "keyring").write_text(mgr_key)
    _run("ceph-mgr", *c, "-i", "x", "--mgr-data", str(mgr_dir), "--keyring", str(mgr_dir / "keyring"))
    _record(d, "mgr.x")
    _run("ceph", *c, "osd", "pool", "create", TEST_POOL, "8")
    _run("ceph", *c, "osd", "pool", "set", TEST_POOL, "size", "1", "--yes-i-really-mean-it")
    # Ready means a write was acknowledged (without a mgr, `ceph df` and friends hang).
    deadline = time.monotonic() + 60
    while True:
        try:
            _run("rados", *c, "-p", TEST_POOL, "put", "ready-probe", str(conf))
            _run("rados", *c, "-p", TEST_POOL, "rm", "ready-probe")
            break
        except (RuntimeError, subprocess.TimeoutExpired):
            if time.monotonic() > deadline:
                stop(directory)
                raise
            time.sleep(0.2)
    return str(conf)


PIDS = "daemons.pids"  # our own record, "NAME PID" a line: the daemons' pid files vanish early


def _pid(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text().strip())
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie still answers kill -0


def _of_cluster(pid: int, d: Path) -> bool:
    """Whether pid is (still) a daemon of the cluster in d: its command line names
    d's ceph.conf. A recorded pid reused by another process is left alone."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(d / "ceph.conf").encode() in args and _alive(pid)


def _record(d: Path, name: str) -> None:
    """Note the pid of daemon `name`, just started (it daemonizes, so its pid comes
    from its pid file, which it writes soon after its parent returned)."""
    deadline = time.monotonic() + 60
    while (pid := _pid(d / f"{name}.pid")) is None or not _of_cluster(pid, d):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} wrote no pid file {d / f'{name}.pid'} within 60 s")
        time.sleep(0.05)
    with open(d / PIDS, "a") as f:
        f.write(f"{name} {pid}\n")


def _daemons(d: Path) -> dict[str, int]:
    """The cluster's daemons by name: those recorded at start, and any pid file
    still there (a cluster started before the record existed)."""
    found: dict[str, int] = {}
    for f in d.glob("*.pid"):
        if (pid := _pid(f)) is not None:
            found[f.name.removesuffix(".pid")] = pid
    with contextlib.suppress(OSError):
        for line in (d / PIDS).read_text().splitlines():
            name, _, pid_text = line.partition(" ")
            with contextlib.suppress(ValueError):
                found[name] = int(pid_text)
    return found


def daemon_pids(directory: str) -> dict[str, int]:
    """The running daemons of the cluster in directory, by name (osd.0, mon.a, ...)."""
    d = Path(directory).resolve()
    return {name: pid for name, pid in _daemons(d).items() if _of_cluster(pid, d)}


def stop(directory: str) -> None:
    """Stop the mgr and the OSD, then the mon (an OSD without its mon waits for a
    timeout). Only by pid, and only pids whose command line names this cluster's
    ceph.conf: nothing else on the machine is touched. Waits on each pid (not on
    its pid file, which the daemon deletes before it exits)."""
    d = Path(directory).resolve()
    order = {"mgr": 0, "osd": 1, "mon": 2}
    daemons = sorted(_daemons(d).items(), key=lambda item: (order.get(item[0].split(".")[0], 3), item[0]))
    for _name, pid in daemons:
        if not _of_cluster(pid, d):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _of_cluster(pid, d):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] not in ("start", "stop"):
        print("usage: python -m tests.ceph_cluster start|stop DIR", file=sys.stderr)
        return 2
    if sys.argv[1] == "start":
        print(start(sys.argv[2]))
    else:
        stop(sys.argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
