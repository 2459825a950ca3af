"""Who may read and write a pool: private files, access control on every way in,
authorisation per export, and no denial of service. Attacks come from a real
unprivileged user the test creates (and removes), through real clients."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import nbd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cli import ROOT, thinblock
from tests.nbd_server import Server, connect
from tests.profiles import examples
from thinblock.frontends.nbd import constants as c

MiB = 1 << 20


def run(*cmd: str, user: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A command, as root or (user) as that unprivileged user."""
    full = ["runuser", "-u", user, "--", *cmd] if user else list(cmd)
    return subprocess.run(full, capture_output=True, text=True, timeout=timeout, env={**os.environ, "HOME": "/tmp"})


@pytest.fixture(scope="module")
def intruder() -> Iterator[tuple[str, str]]:
    """A real unprivileged user and a group it belongs to, made for these tests and removed after."""
    user, group = f"tbx{uuid.uuid4().hex[:6]}", f"tbg{uuid.uuid4().hex[:6]}"
    subprocess.run(["groupadd", group], check=True)
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/false", "-G", group, user], check=True)
    try:
        yield user, group
    finally:
        subprocess.run(["userdel", user], check=False)
        subprocess.run(["groupdel", group], check=False)


@pytest.fixture
def tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory every user can traverse (pytest's own are the owner's alone), so that
    nothing but the pool's own modes stands between the intruder and the pool."""
    path = Path(tempfile.mkdtemp(prefix="tb-access-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def pool(tmp_path: Path) -> str:
    path = str(tmp_path / "pool")
    old = os.umask(0)  # the worst umask: files must come out private anyway
    try:
        thinblock("pool", "create", path, "--size", "64M")
        thinblock("volume", "create", path, "disk", "--size", "16M")
    finally:
        os.umask(old)
    with open(os.path.join(path, "data"), "r+b") as f:
        f.write(b"SECRET" * 100)  # what an intruder would be after
    return path


# The intruder runs the system's Python: the project's .venv may sit in a directory it
# cannot enter (a CI checkout), which must not be what stops it.
INTRUDER_PYTHON = "/usr/bin/python3"


def _try_read(user: str, path: str) -> str:
    """'READ', or the errno the intruder got opening path."""
    code = f"import sys\ntry:\n open({path!r},'rb').read(1); print('READ')\nexcept OSError as e: print(e.errno)"
    got = run(INTRUDER_PYTHON, "-c", code, user=user)
    assert got.stdout.strip(), f"the intruder's probe did not run: {got.stderr}"
    return got.stdout.strip()


def test_pool_files_and_runtime_dirs_are_private(intruder: tuple[str, str], pool: str, tmp_path: Path) -> None:
    user, _group = intruder
    modes = {name: os.stat(os.path.join(pool, name)).st_mode & 0o777 for name in os.listdir(pool)}
    assert os.stat(pool).st_mode & 0o777 == 0o700
    assert modes and all(mode == 0o600 for mode in modes.values()), modes
    for name in ("data", "metadata.sqlite", "lock"):
        assert _try_read(user, os.path.join(pool, name)) == str(errno.EACCES), name
    # An attached pool: the runtime directory and the FUSE files are the owner's alone.
    env = {**os.environ, "THINBLOCK_RUNTIME_DIR": str(tmp_path / "run")}
    dev = subprocess.run(
        [sys.executable, "-m", "thinblock", "attach", pool, "disk"], capture_output=True, text=True, env=env, check=True
    ).stdout.strip()
    try:
        (pdir,) = (tmp_path / "run").iterdir()
        assert os.stat(tmp_path / "run").st_mode & 0o777 == 0o700 and os.stat(pdir).st_mode & 0o777 == 0o700
        assert all(os.stat(p).st_mode & 0o077 == 0 for p in pdir.iterdir() if p.name != "mnt")
        assert _try_read(user, str(pdir / "mnt" / "disk")) == str(errno.EACCES)
        assert _try_read(user, str(pdir / "daemon.log")) == str(errno.EACCES)
    finally:
        subprocess.run([sys.executable, "-m", "thinblock", "detach", dev], env=env, check=True, capture_output=True)
    # pool check warns about files others can read, and still passes.
    os.chmod(os.path.join(pool, "data"), 0o644)
    checked = thinblock("pool", "check", pool)
    assert f"{pool}/data is readable by other users (mode 0644): chmod 600 {pool}/data" in checked.stderr
    assert json.loads(thinblock("pool", "check", pool, "--json").stdout)["warnings"]


def _nbd_reach(user: str, uri: str) -> subprocess.CompletedProcess[str]:
    return run("nbdinfo", "--size", uri, user=user)


def test_unix_sockets_follow_mode_and_group(intruder: tuple[str, str], pool: str, tmp_path: Path) -> None:
    user, group = intruder
    server = Server(pool)
    try:
        assert os.stat(server.socket).st_mode & 0o777 == 0o600
        refused = _nbd_reach(user, server.unix_uri("disk"))
        assert refused.returncode != 0 and "Permission denied" in refused.stderr
        control = os.path.join(pool, "control.sock")
        assert os.stat(control).st_mode & 0o777 == 0o600
        probe = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({control!r}); print('IN')"
        got = run(INTRUDER_PYTHON, "-c", probe, user=user)
        assert "IN" not in got.stdout and "PermissionError" in got.stderr, got.stderr
    finally:
        server.stop()
    # Shared with a group: members get in; the socket is never wider than asked.
    os.chmod(pool, 0o755)  # the pool's owner opens the directory on purpose
    shared = str(tmp_path / "shared.sock")
    server = Server(pool, "--socket", shared, "--socket-mode", "0660", "--socket-group", group)
    try:
        st = os.stat(shared)
        assert st.st_mode & 0o777 == 0o660 and st.st_gid == int(run("getent", "group", group).stdout.split(":")[2])
        got = _nbd_reach(user, server.unix_uri("disk"))
        assert got.returncode == 0 and got.stdout.strip() == str(16 * MiB), got.stderr
    finally:
        server.stop()
    bad = thinblock("serve", pool, "--socket", shared, "--socket-mode", "0666", check=False)
    assert bad.returncode == 2 and "every local user" in bad.stderr


def test_tcp_needs_tls_or_insecure(pool: str) -> None:
    refused = thinblock("serve", pool, "--listen", "0", check=False)
    assert refused.returncode == 2 and "--insecure" in refused.stderr
    server = Server(pool, "--listen", "0", "--insecure")
    try:
        assert nbd_size(server.tcp_uri("disk")) == 16 * MiB
    finally:
        server.stop()
    assert "without TLS (--insecure)" in server.log.read_text()


def nbd_size(uri: str, tls_dir: Path | None = None) -> int:
    h = nbd.NBD()
    if tls_dir is not None:
        h.set_tls(nbd.TLS_REQUIRE)
        h.set_tls_certificates(str(tls_dir))
    h.connect_uri(uri)
    size = int(h.get_size())
    h.shutdown()
    return size


def _pki(root: Path) -> tuple[Path, dict[str, Path]]:
    """A CA, a server certificate for localhost, and client certificate dirs for three names."""

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    root.mkdir()
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", str(root / "ca-key.pem"),
        "-out", str(root / "ca-cert.pem"), "-subj", "/CN=thinblock test CA")  # fmt: skip

    def signed(stem: Path, cn: str, ext: str) -> None:
        ssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{stem}-key.pem",
            "-out",
            f"{stem}.csr",
            "-subj",
            f"/CN={cn}",
        )
        (root / "ext.cnf").write_text(ext)
        ssl("x509", "-req", "-in", f"{stem}.csr", "-CA", str(root / "ca-cert.pem"), "-CAkey", str(root / "ca-key.pem"),
            "-CAcreateserial", "-days", "2", "-out", f"{stem}-cert.pem", "-extfile", str(root / "ext.cnf"))  # fmt: skip

    signed(root / "server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    clients = {}
    for name in ("admin", "backup", "stranger"):
        d = root / name
        d.mkdir()
        signed(d / "client", name, "extendedKeyUsage=clientAuth\n")
        shutil.copy(root / "ca-cert.pem", d / "ca-cert.pem")
        clients[name] = d
    return root, clients


def test_tls_authorisation_list(pool: str, tmp_path: Path) -> None:
    thinblock("volume", "create", pool, "other", "--size", "1M")
    pki, clients = _pki(tmp_path / "pki")
    authz = tmp_path / "authz"
    authz.write_text("# who    access  exports\nadmin    rw      *\nbackup   ro      disk\n")
    server = Server(
        pool, "--listen", "0", "--tls-cert", str(pki / "server-cert.pem"), "--tls-key", str(pki / "server-key.pem"),
        "--tls-ca", str(pki / "ca-cert.pem"), "--tls-authz", str(authz),
    )  # fmt: skip
    try:
        port = server.tcp_uri("disk").rsplit(":", 1)[1].split("/")[0]

        def uri(export: str) -> str:
            return f"nbds://localhost:{port}/{export}"

        def handle(name: str, export: str) -> nbd.NBD:
            h = nbd.NBD()
            h.set_tls(nbd.TLS_REQUIRE)
            h.set_tls_certificates(str(clients[name]))
            h.connect_uri(uri(export))
            return h

        admin = handle("admin", "other")
        admin.pwrite(b"a" * 512, 0)
        admin.shutdown()
        backup = handle("backup", "disk")
        assert backup.is_read_only()
        backup.set_strict_mode(0)
        with pytest.raises(nbd.Error) as info:
            backup.pwrite(b"b" * 512, 0)
        assert info.value.errnum == errno.EPERM
        backup.shutdown()
        # A client with no rule is refused (NBD_REP_ERR_POLICY); an export outside a
        # grant is answered as one that does not exist (NBD_REP_ERR_UNKNOWN).
        for name, export, answer in (
            ("stranger", "disk", "server policy prevents"),
            ("backup", "other", "server has no export named 'other'"),
        ):
            with pytest.raises(nbd.Error) as refused:
                handle(name, export)
            assert answer in str(refused.value), refused.value
        # A listing shows a client only what it may use.
        listing = subprocess.run(
            ["nbdinfo", "--list", "--json", f"nbds://localhost:{port}/?tls-certificates={clients['backup']}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert [e["export-name"] for e in json.loads(listing.stdout)["exports"]] == ["disk"]
    finally:
        server.stop()
    log = server.log.read_text()
    assert "refused: client certificate stranger is not in the authorisation list" in log
    assert "refused: client certificate backup may not use export 'other'" in log


def test_psk_is_refused_with_a_reason(pool: str) -> None:
    got = thinblock("serve", pool, "--tls-psk", "/nonexistent", check=False)
    assert got.returncode == 1 and "no TLS-PSK support" in got.stderr


def test_lock_cannot_be_taken_hostage(intruder: tuple[str, str], pool: str) -> None:
    user, _group = intruder
    lock = os.path.join(pool, "lock")
    assert _try_read(user, lock) == str(errno.EACCES)  # the intruder cannot even open it
    # flock() by anyone who can open it no longer blocks the pool.
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        thinblock("volume", "create", pool, "v2", "--size", "1M")
        assert "v2" in thinblock("volume", "list", pool).stdout
    finally:
        os.close(fd)
    # A lock held by something that is not a live thinblock process is named as such.
    with open(lock, "r+b") as f:
        f.write(b"999999 thinblock serve\n")
        f.truncate()
        f.flush()
        fcntl.fcntl(f.fileno(), fcntl.F_OFD_SETLK, struct.pack("hh4xqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))
        refused = thinblock("volume", "create", pool, "v3", "--size", "1M", "--wait", "0.5", check=False)
    assert refused.returncode == 1
    assert "locked, but not by a live thinblock process: pid 999999 (thinblock serve)" in refused.stderr
    assert "has exited" in refused.stderr and "fuser" in refused.stderr


def test_commands_on_an_idle_pool_wait_their_turn(pool: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    commands = [["volume", "create", pool, f"p{i}", "--size", "1M"] for i in range(6)]
    commands.append(["snapshot", "create", pool, "disk@s"])
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "thinblock", *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for cmd in commands
    ]
    results = [(p.wait(120), p.stderr.read() if p.stderr else "") for p in procs]
    assert all(code == 0 for code, _err in results), results
    names = {v["name"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout)}
    assert names >= {f"p{i}" for i in range(6)} | {"disk@s"}


def test_socket_paths_are_checked(pool: str, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.write_text("keep")
    link = tmp_path / "link.sock"
    link.symlink_to(precious)
    for path, words in ((precious, "not a socket"), (link, "symlink")):
        got = thinblock("serve", pool, "--socket", str(path), check=False)
        assert got.returncode == 1 and words in got.stderr.replace("something other than a socket", "not a socket")
    assert precious.read_text() == "keep" and link.is_symlink()
    # A live server's socket is not taken over; a dead one's is replaced.
    first = Server(pool)
    try:
        other = str(tmp_path / "p2")
        thinblock("pool", "create", other, "--size", "64M")
        got = thinblock("serve", other, "--socket", first.socket, check=False)
        assert got.returncode == 1 and "a live server is listening" in got.stderr
    finally:
        first.stop()
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(tmp_path / "dead.sock"))
    dead.close()
    second = Server(pool, "--socket", str(tmp_path / "dead.sock"))
    try:
        assert connect(second, "disk").get_size() == 16 * MiB
    finally:
        second.stop()


def _raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(path)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    s.settimeout(seconds)
    try:
        while s.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


def test_handshake_timeout_and_connection_cap(pool: str, tmp_path: Path) -> None:
    server = Server(pool, "--max-connections", "3", "--handshake-timeout", "3", "--idle-timeout", "1")
    try:
        silent = _raw(server.socket)
        assert silent.recv(18)  # the greeting, then nothing from us
        start = time.monotonic()
        # (Bounds far above the timeouts: a loaded machine is slow, and what they tell
        # apart is being cut off at all from never being cut.)
        assert _closed_within(silent, 30) and time.monotonic() - start < 20
        # A client that trickles bytes still runs into the whole-handshake limit (3 s),
        # long before its 60 bytes are out (30 s).
        slow = _raw(server.socket)
        slow.recv(18)
        start = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(60):
                slow.send(b"\0")
                time.sleep(0.5)
        assert time.monotonic() - start < 20
        slow.close()
        held = [_raw(server.socket) for _ in range(3)]
        for s in held:
            assert s.recv(18)
            s.sendall(struct.pack(">I", c.FLAG_C_FIXED_NEWSTYLE))  # not silent: a newcomer cannot displace it
        with pytest.raises(nbd.Error, match="server policy prevents"):  # told why: NBD_REP_ERR_POLICY
            connect(server, "disk")
        extra = _raw(server.socket)
        assert _closed_within(extra, 30)  # and let go within seconds
        for s in held:
            s.close()
        deadline = time.monotonic() + 30  # the server frees their slots as it sees them close
        while True:
            try:
                h = connect(server, "disk")
                break
            except nbd.Error as exc:
                assert "server policy prevents" in str(exc) and time.monotonic() < deadline, exc
                time.sleep(0.1)
        assert h.get_size() == 16 * MiB
    finally:
        server.stop()
    log = server.log.read_text()
    assert "negotiation timed out" in log and "the limit (--max-connections)" in log


def test_stalled_starttls_clients_are_let_go(pool: str, tmp_path: Path) -> None:
    pki, _clients = _pki(tmp_path / "pki")
    server = Server(
        pool, "--tls-cert", str(pki / "server-cert.pem"), "--tls-key", str(pki / "server-key.pem"),
        "--handshake-timeout", "2", "--idle-timeout", "1",
    )  # fmt: skip
    try:
        stalled = []
        for _ in range(20):
            s = _raw(server.socket)
            s.recv(18)
            s.sendall(struct.pack(">I", c.FLAG_C_FIXED_NEWSTYLE) + struct.pack(">QII", c.IHAVEOPT, c.OPT_STARTTLS, 0))
            s.recv(20)  # the ACK; then the TLS handshake never comes
            stalled.append(s)
        time.sleep(3)
        assert all(_closed_within(s, 3) for s in stalled)
    finally:
        server.stop()


def test_listeners_survive_running_out_of_descriptors(pool: str, tmp_path: Path) -> None:
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, 96))

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "thinblock", "serve", pool, "--socket", str(tmp_path / "nbd.sock")],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "serve.log", "w"), text=True, env=env, preexec_fn=low_limit,  # noqa: SIM115
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        while not proc.stdout.readline().startswith("ready"):
            pass
        flood = []
        for _ in range(150):  # non-blocking: a listener that stopped accepting must not hang the test
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            with contextlib.suppress(OSError):
                s.connect(str(tmp_path / "nbd.sock"))
            flood.append(s)
        # Held open until the server has run out of descriptors (it says so), however slow
        # it is to accept them.
        deadline = time.monotonic() + 60
        while "cannot accept connections" not in (tmp_path / "serve.log").read_text():
            assert time.monotonic() < deadline, "the server never ran out of descriptors"
            time.sleep(0.1)
        for s in flood:
            s.close()
        deadline = time.monotonic() + 30
        uri = f"nbd+unix:///disk?socket={tmp_path / 'nbd.sock'}"
        while True:
            probe = subprocess.run(["timeout", "5", "nbdinfo", "--size", uri], capture_output=True, text=True)
            if probe.returncode == 0:
                assert probe.stdout.strip() == str(16 * MiB)
                break
            assert time.monotonic() < deadline, f"the NBD listener never came back: {probe.stderr}"
            time.sleep(0.5)
        listing = thinblock("volume", "list", pool, "--json")
        assert "disk" in listing.stdout  # through the control socket, which survived too
    finally:
        proc.terminate()
        proc.wait(30)
    assert "cannot accept connections" in (tmp_path / "serve.log").read_text()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("fuzz")
    pool = str(root / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "disk", "--size", "16M")
    server = Server(pool)
    try:
        yield server
    finally:
        server.stop()
        assert "Traceback" not in server.log.read_text()


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
_verbs = st.sampled_from(
    ["status", "volume_create", "volume_resize", "volume_set", "volume_remove", "snapshot_create", "pool_set",
     "pool_grow", "delta", "volume_clone", "fuse_mount", "nope"]
)  # fmt: skip
_arg_names = st.sampled_from(
    ["name", "size_bytes", "kind", "detect_zeroes", "reserve", "low_water", "volume", "mountpoint", "snapshot",
     "when_full", "autogrow", "allow_shrink", "source", "target", "x"]
)  # fmt: skip


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(verb=_verbs, args=st.dictionaries(_arg_names, _json, max_size=4))
def test_control_requests_are_validated(fuzz_server: Server, verb: str, args: dict[str, object]) -> None:
    """Random arguments to every verb: a clear error or a result, never an internal error."""
    control = os.path.join(fuzz_server.pool, "control.sock")
    s = _raw(control)
    try:
        s.sendall(json.dumps({"verb": verb, "args": args}).encode() + b"\n")
        reply = json.loads(s.makefile("rb").readline())
    finally:
        s.close()
    assert "internal error" not in reply.get("error", ""), (verb, args, reply)
    if verb == "fuse_mount" and "ok" in reply:
        pytest.fail(f"fuse_mount accepted {args}")


def test_control_request_corner_cases(fuzz_server: Server) -> None:
    control = os.path.join(fuzz_server.pool, "control.sock")
    for line, words in (
        ({"verb": "volume_create", "args": {"name": "f", "size_bytes": 1048576.0}}, "whole number of bytes"),
        ({"verb": "volume_create", "args": {"name": "f", "size_bytes": "1G"}}, "whole number of bytes"),
        ({"verb": "volume_create", "args": {"name": "f", "size_bytes": True}}, "whole number of bytes"),
        ({"verb": "fuse_mount", "args": {"mountpoint": "/tmp"}}, "only at"),
        ({"verb": "volume_create", "args": {"name": "f", "size_bytes": 1 << 20, "extra": 1}}, "unknown argument"),
    ):
        s = _raw(control)
        s.sendall(json.dumps(line).encode() + b"\n")
        reply = json.loads(s.makefile("rb").readline())
        s.close()
        assert words in reply["error"], reply
    s = _raw(control)
    s.sendall(b"[" * 100000 + b"\n")
    reply = json.loads(s.makefile("rb").readline())
    s.close()
    assert "internal error" not in reply["error"]
    # The export of a volume created through the control socket works at once.
    s = _raw(control)
    s.sendall(json.dumps({"verb": "volume_create", "args": {"name": "ok1", "size_bytes": 1 << 20}}).encode() + b"\n")
    assert "ok" in json.loads(s.makefile("rb").readline())
    s.close()
    assert connect(fuzz_server, "ok1").get_size() == 1 << 20


def test_the_control_client_gives_up_on_a_server_that_does_not_answer(tmp_path: Path) -> None:
    from thinblock.admin.control import ControlClient
    from thinblock.errors import ThinblockError

    path = str(tmp_path / "mute.sock")
    mute = socket.socket(socket.AF_UNIX)
    mute.bind(path)
    mute.listen(1)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(mute.accept()[0]), daemon=True).start()
    client = ControlClient(path, timeout_s=1)
    start = time.monotonic()
    with pytest.raises(ThinblockError, match="did not answer status"):
        client.call("status")
    assert time.monotonic() - start < 5
    client.close()
    mute.close()


def test_pool_files_are_never_opened_through_a_symlink(pool: str, tmp_path: Path) -> None:
    """A data file or database swapped for a symlink is refused, in one sentence, with
    nothing written through it; the real pool opens again once it is put back."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"x" * 4096)
    for name, words in (
        ("data", "it is a symlink, refused"),
        ("metadata.sqlite", "is a symlink; refusing to follow it"),
    ):
        real = os.path.join(pool, name)
        os.rename(real, real + ".real")
        os.symlink(elsewhere, real)
        try:
            got = thinblock("volume", "create", pool, "v", "--size", "1M", "--wait", "0", check=False)
            assert got.returncode == 1 and words in got.stderr, got.stderr
            assert elsewhere.read_bytes() == b"x" * 4096
        finally:
            os.unlink(real)
            os.rename(real + ".real", real)
    thinblock("volume", "create", pool, "v", "--size", "1M")
    thinblock("pool", "check", pool)
