"""thinblock as a service: a real `thinblock serve` under the systemd protocols
(readiness to a NOTIFY_SOCKET the test binds, listening sockets passed in
LISTEN_FDS), the unit files checked by the real `systemd-analyze verify`, serve
--config, and the log: its levels, file and JSON lines, and the timed steps of
recovery and of a RADOS takeover."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cli import ROOT, thinblock
from tests.conftest import new_rados_locator
from tests.test_attach import env  # noqa: F401 (a fixture: a private runtime directory, cleaned up)

UNITS = ROOT / "contrib" / "systemd"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
SERVE = [sys.executable, "-m", "thinblock", "serve"]


def _pool(tmp_path: Path, *volumes: str) -> str:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    for name in volumes:
        thinblock("volume", "create", pool, name, "--size", "64M")
    return pool


def _start(argv: list[str], *, environ: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ or ENV, **kw)


def _until_ready(proc: subprocess.Popen[str]) -> list[str]:
    """The lines serve printed up to its ready line (it fails if serve exits first)."""
    assert proc.stdout is not None
    lines = []
    while True:
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            raise AssertionError(f"serve exited ({proc.returncode}) before ready: {proc.stderr and proc.stderr.read()}")
        lines.append(line.strip())
        if line.startswith("ready"):
            return lines


def _stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    return out, err


def _ended(proc: subprocess.Popen[str]) -> tuple[str, str]:
    """The output of a serve that must end by itself (a refusal); killed if it does
    not, so a broken refusal fails the test instead of leaving a server behind."""
    try:
        return proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("serve kept running instead of refusing") from None


def _nbd_size(uri: str) -> int:
    return int(
        subprocess.run(["nbdinfo", "--size", uri], capture_output=True, text=True, check=True, timeout=60).stdout
    )


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of text as a JSON log entry with the fields every entry has."""
    entries = []
    for line in text.splitlines():
        entry = json.loads(line)
        assert {"time", "level", "logger", "message"} <= set(entry), line
        assert entry["time"].endswith("Z") and datetime.datetime.fromisoformat(entry["time"]).utcoffset() == (
            datetime.timedelta(0)
        )
        assert entry["level"] in ("debug", "info", "warning", "error") and entry["logger"].startswith("thinblock")
        entries.append(entry)
    return entries


# ----- readiness ------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(60)
    yield sock, path
    sock.close()


def _states(sock: socket.socket, wanted: str) -> dict[str, str]:
    """The next datagram holding wanted (READY=1, STOPPING=1), as its key=value lines."""
    while True:
        message = sock.recv(4096).decode()
        states = dict(line.split("=", 1) for line in message.splitlines())
        key, value = wanted.split("=", 1)
        if states.get(key) == value:
            return states


def test_ready_once_it_accepts_then_stopping_on_sigterm(
    tmp_path: Path, notify_socket: tuple[socket.socket, str]
) -> None:
    sock, path = notify_socket
    pool = _pool(tmp_path, "v")
    nbd_sock = str(tmp_path / "nbd.sock")
    proc = _start([*SERVE, pool, "--socket", nbd_sock], environ={**ENV, "NOTIFY_SOCKET": path})
    try:
        ready = _states(sock, "READY=1")
        assert ready["MAINPID"] == str(proc.pid)
        assert ready["STATUS"] == f"serving 1 volume(s) of {pool}"
        # Ready means clients are served now, not a moment later.
        assert _nbd_size(f"nbd+unix:///v?socket={nbd_sock}") == 64 << 20
        proc.send_signal(signal.SIGTERM)
        stopping = _states(sock, "STOPPING=1")
        assert "committing" in stopping["STATUS"]
    finally:
        out, _err = _stop(proc)
    assert proc.returncode == 0 and out.rstrip().endswith("stopped")


def test_ready_to_an_abstract_notify_socket(tmp_path: Path) -> None:
    name = f"thinblock-test-notify-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(60)
    pool = _pool(tmp_path, "v")
    proc = _start([*SERVE, pool], environ={**ENV, "NOTIFY_SOCKET": "@" + name})
    try:
        assert _states(sock, "READY=1")["MAINPID"] == str(proc.pid)
    finally:
        _stop(proc)
        sock.close()


# ----- socket activation -----------------------------------------------------------


def _activated(listener: socket.socket | _FdHolder, *serve_args: str) -> subprocess.Popen[str]:
    """serve with listener as its descriptor 3, LISTEN_FDS=1 and LISTEN_PID its own pid,
    set by a small Python wrapper that then execs it (so the pid is the same)."""
    fd = listener.fileno()
    wrapper = (
        "import os, sys\n"
        f"if {fd} != 3:\n    os.dup2({fd}, 3)\n    os.close({fd})\n"
        "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1', LISTEN_FDNAMES='nbd')\n"
        "os.execv(sys.argv[1], sys.argv[1:])\n"
    )
    return _start([sys.executable, "-c", wrapper, *SERVE, *serve_args], pass_fds=(fd,))


def test_socket_activation_serves_the_unix_socket_passed_in(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "v")
    path = str(tmp_path / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    proc = _activated(listener, pool)
    listener.close()  # the server's copy is the only one left
    try:
        lines = _until_ready(proc)
        assert f"export nbd+unix:///v?socket={path}" in lines
        assert _nbd_size(f"nbd+unix:///v?socket={path}") == 64 << 20
        subprocess.run(
            [
                "qemu-io",
                "-f",
                "raw",
                "-c",
                "write -P 0x5a 0 1M",
                "-c",
                "read -P 0x5a 0 1M",
                f"nbd+unix:///v?socket={path}",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        assert not (Path(pool) / "nbd.sock").exists()  # nothing bound of its own
    finally:
        _out, err = _stop(proc)
    assert proc.returncode == 0
    assert f"serving unix socket {path} passed by socket activation (nbd)" in err
    assert os.path.exists(path)  # the service manager's socket is not removed


def test_socket_activation_of_tcp_needs_tls_or_insecure(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "v")
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    refused = _activated(listener, pool)
    _out, err = _ended(refused)
    assert refused.returncode == 2, err
    assert f"TCP 127.0.0.1:{port} passed by socket activation has no TLS" in err and "--insecure" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    proc = _activated(listener, pool, "--insecure")
    listener.close()
    try:
        assert f"export nbd://127.0.0.1:{port}/v" in _until_ready(proc)
        assert _nbd_size(f"nbd://127.0.0.1:{port}/v") == 64 << 20
    finally:
        _stop(proc)
    assert proc.returncode == 0


@pytest.mark.parametrize("kind", ["datagram", "not-listening", "pipe"])
def test_socket_activation_refuses_what_is_not_a_listening_stream_socket(tmp_path: Path, kind: str) -> None:
    pool = _pool(tmp_path)
    if kind == "datagram":
        passed: Any = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    elif kind == "not-listening":
        passed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        passed.bind(str(tmp_path / "idle.sock"))
    else:
        read, write = os.pipe()
        os.close(write)
        passed = _FdHolder(read)
    proc = _activated(passed, pool)
    out, err = _ended(proc)
    passed.close()
    assert proc.returncode == 1 and out == ""
    assert err.strip() == (
        "thinblock: error: descriptor 3 passed by socket activation (LISTEN_FDS) is not a listening stream socket"
    )


class _FdHolder:
    """A plain descriptor standing where a socket is expected."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        os.close(self.fd)


def test_socket_activation_is_refused_with_socket_or_listen(tmp_path: Path) -> None:
    pool = _pool(tmp_path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "a.sock"))
    listener.listen(1)
    proc = _activated(listener, pool, "--socket", str(tmp_path / "own.sock"))
    _out, err = _ended(proc)
    listener.close()
    assert proc.returncode == 2 and "without --socket or --listen" in err


def test_sockets_meant_for_another_process_are_left_alone(tmp_path: Path) -> None:
    """LISTEN_PID of another process: serve binds its own socket, as without them."""
    pool = _pool(tmp_path, "v")
    own = str(tmp_path / "own.sock")
    proc = _start([*SERVE, pool, "--socket", own], environ={**ENV, "LISTEN_FDS": "1", "LISTEN_PID": "1"})
    try:
        assert f"export nbd+unix:///v?socket={own}" in _until_ready(proc)
    finally:
        _stop(proc)


# ----- unit files ------------------------------------------------------------------


def test_unit_files_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """The units as shipped, but with ExecStart's /usr/local/bin/thinblock pointed at
    this environment's thinblock (verify checks that the program exists), for an
    instance pool1: no error and no warning."""
    program = shutil.which("thinblock", path=str(Path(sys.executable).parent)) or shutil.which("thinblock")
    assert program, "the thinblock program is installed (pip install -e .)"
    for unit in ("thinblock-serve@.service", "thinblock-serve@.socket"):
        text = (UNITS / unit).read_text()
        assert unit.endswith(".socket") or "ExecStart=/usr/local/bin/thinblock serve " in text
        (tmp_path / unit).write_text(text.replace("/usr/local/bin/thinblock", program))
    service = (UNITS / "thinblock-serve@.service").read_text()
    assert "Type=notify" in service and "ExecReload=/bin/kill -HUP $MAINPID" in service
    assert "ListenStream=/run/thinblock/%i.sock" in (UNITS / "thinblock-serve@.socket").read_text()
    verify = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            str(tmp_path / "thinblock-serve@pool1.service"),
            str(tmp_path / "thinblock-serve@pool1.socket"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 0 and verify.stderr == "", verify.stderr


# ----- configuration ---------------------------------------------------------------


def test_config_file_with_the_command_line_overriding_it(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "v")
    from_file, from_cli = str(tmp_path / "file.sock"), str(tmp_path / "cli.sock")
    config = tmp_path / "serve.toml"
    config.write_text(
        f'pool = "{pool}"\nsocket = "{from_file}"\nread-only = true\nmax_connections = 1\n'
        'log-format = "json"\nlog-level = "warning"\n'
    )
    proc = _start([*SERVE, "--config", str(config), "--socket", from_cli, "--log-level", "info"])
    try:
        lines = _until_ready(proc)
        assert f"export nbd+unix:///v?socket={from_cli}" in lines and not os.path.exists(from_file)
        info = subprocess.run(
            ["nbdinfo", "--json", f"nbd+unix:///v?socket={from_cli}"], capture_output=True, text=True, check=True
        )
        assert json.loads(info.stdout)["exports"][0]["is_read_only"] is True  # read-only from the file
    finally:
        _out, err = _stop(proc)
    entries = _json_lines(err)  # log-format from the file
    assert any(e["level"] == "info" for e in entries)  # log-level from the command line


def test_config_max_connections_from_the_file_applies(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "v")
    sock = str(tmp_path / "s.sock")
    config = tmp_path / "serve.toml"
    config.write_text(f'socket = "{sock}"\nmax-connections = 1\n')
    proc = _start([*SERVE, pool, "--config", str(config)])
    try:
        _until_ready(proc)
        held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        held.connect(sock)
        greeting = b""
        while len(greeting) < 18:  # NBDMAGIC, IHAVEOPT, the handshake flags
            greeting += held.recv(18 - len(greeting))
        held.sendall(b"\0\0\0\3")  # client flags: negotiating, so it holds the only slot
        second = subprocess.run(["nbdinfo", "--size", f"nbd+unix:///v?socket={sock}"], capture_output=True, text=True)
        held.close()
        assert second.returncode != 0
    finally:
        _out, err = _stop(proc)
    assert "refused a connection" in err


@pytest.mark.parametrize(
    ("content", "sentence"),
    [
        ("max-connections = 8\nbogus = 1\n", "unknown setting 'bogus'"),
        ('max-connections = "many"\n', "max-connections must be a whole number, not 'many'"),
        ("insecure = 1\n", "insecure must be true or false, not 1"),
        ('log-level = "loud"\n', "log-level must be one of 'debug', 'info', 'warning', 'error', not 'loud'"),
        ("socket = [1, 2]\n", "socket must be a string, not [1, 2]"),
        # TOML's 0o620 is the number 400, which would be taken as the octal mode 0400.
        ("socket-mode = 0o620\n", 'socket-mode must be a string such as "0660" (an octal mode), not 400'),
        ("max-connections = \n", "is not valid TOML"),
        ('config = "other.toml"\n', "unknown setting 'config'"),
        (None, "does not exist"),
    ],
)
def test_a_bad_config_file_is_one_sentence(tmp_path: Path, content: str | None, sentence: str) -> None:
    # No pool there: were the file taken, serve would end at once saying so (exit 1).
    pool = str(tmp_path / "no-pool")
    config = tmp_path / "serve.toml"
    if content is not None:
        config.write_text(content)
    proc = thinblock("serve", pool, "--config", str(config), check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("thinblock: error: ") and sentence in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# ----- logs ------------------------------------------------------------------------


def test_json_log_to_a_file_with_a_hostile_export_name(tmp_path: Path) -> None:
    """--log-file gets the lines (mode 0600), stderr none; each is one JSON object,
    even for a name a client chose to forge lines with."""
    pool = _pool(tmp_path, "v")
    log = tmp_path / "logs" / "serve.log"
    log.parent.mkdir()
    sock = str(tmp_path / "s.sock")
    proc = _start([*SERVE, pool, "--socket", sock, "--log-format", "json", "--log-file", str(log)])
    try:
        _until_ready(proc)
        forged = 'x\n{"time": "forged", "level": "error"}\r\x1b[2J'
        subprocess.run(["nbdinfo", "--size", f"nbd+unix:///{forged}?socket={sock}"], capture_output=True, timeout=60)
        assert _nbd_size(f"nbd+unix:///v?socket={sock}") == 64 << 20
    finally:
        _out, err = _stop(proc)
    assert err == ""
    assert log.stat().st_mode & 0o777 == 0o600
    entries = _json_lines(log.read_text())
    messages = [e["message"] for e in entries]
    assert any("ready after" in m for m in messages) and any("export 'v'" in m for m in messages)
    assert not any(e["time"] == "forged" for e in entries)
    steps = [e for e in entries if e.get("step", "").startswith("stopping on SIGTERM")]
    assert steps[0]["message"].endswith(": started") and ": done in " in steps[-1]["message"]
    assert "final commit done" in " ".join(s["message"] for s in steps) and steps[-1]["elapsed_s"] >= 0


def test_log_level_and_text_lines(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "v")
    proc = _start([*SERVE, pool, "--log-level", "warning"])
    try:
        _until_ready(proc)
    finally:
        _out, quiet = _stop(proc)
    assert quiet == ""  # nothing at warning or above in a clean start and stop
    proc = _start([*SERVE, pool, "--log-level", "debug"])
    try:
        _until_ready(proc)
    finally:
        _out, text = _stop(proc)
    assert " thinblock.serve info: ready after " in text
    assert " thinblock.pool info: pool " in text and ": opening: done in " in text


def test_recovery_after_sigkill_is_timed(tmp_path: Path) -> None:
    """SIGKILL a server with writes in flight: the next open recovers the pool, and
    the log shows the recovery's start, each part and its end with their times."""
    pool = _pool(tmp_path, "v")
    sock = str(tmp_path / "s.sock")
    proc = _start([*SERVE, pool, "--socket", sock])
    _until_ready(proc)
    writer = subprocess.Popen(
        ["qemu-io", "-f", "raw", "-c", "write -P 0x11 0 32M", f"nbd+unix:///v?socket={sock}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while "#1 unix: export 'v'" not in _read_stderr_so_far(proc) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "#1 unix: export 'v'" in _read_stderr_so_far(proc), "the writer never connected"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    writer.wait(timeout=60)
    again = _start([*SERVE, pool, "--socket", sock, "--log-format", "json"])
    try:
        _until_ready(again)
    finally:
        _out, err = _stop(again)
    steps = [e for e in _json_lines(err) if e.get("step", "").endswith("recovery after an unclean close")]
    parts = [e["message"].split(": ")[-1] for e in steps]
    assert parts[0] == "started" and parts[-1].startswith("done in "), parts
    assert any(p.startswith("punched ") for p in parts) and any(p.startswith("re-zeroed ") for p in parts)
    elapsed = [e["elapsed_s"] for e in steps]
    assert elapsed == sorted(elapsed)


_STDERR: dict[int, list[str]] = {}


def _read_stderr_so_far(proc: subprocess.Popen[str]) -> str:
    """What proc wrote to stderr until now, read without blocking."""
    import selectors

    assert proc.stderr is not None
    got = _STDERR.setdefault(proc.pid, [])
    selector = selectors.DefaultSelector()
    selector.register(proc.stderr, selectors.EVENT_READ)
    while selector.select(timeout=0):
        chunk = os.read(proc.stderr.fileno(), 65536).decode(errors="replace")
        if not chunk:
            break
        got.append(chunk)
    selector.close()
    return "".join(got)


def test_rados_takeover_logs_every_step_with_its_time(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """SIGSTOP a rados: pool's server and take over: each step of the takeover (the
    busy lock, breaking it, fencing, the new OSD map, the epoch) is a line with the
    seconds since the takeover began."""
    locator = new_rados_locator(request, "svc")
    thinblock("pool", "create", locator, "--size", "256M")
    thinblock("volume", "create", locator, "v", "--size", "64M")
    first = _start([*SERVE, locator, "--socket", str(tmp_path / "a.sock")])
    _until_ready(first)
    first.send_signal(signal.SIGSTOP)
    second = _start([*SERVE, locator, "--socket", str(tmp_path / "b.sock"), "--takeover", "--log-format", "json"])
    try:
        _until_ready(second)
    finally:
        _out, err = _stop(second)
        first.send_signal(signal.SIGCONT)
        first.kill()
        first.communicate(timeout=60)
    steps = [e for e in _json_lines(err) if e.get("step", "").endswith("taking ownership (--takeover)")]
    parts = [e["message"].split("(--takeover): ", 1)[1] for e in steps]
    expected = [
        "started",
        "the lock is held by thinblock serve",
        "broke the lock of thinblock serve",
        "took the lock",
        "fencing its previous holder thinblock serve",
        "the monitors blocklisted ",
        "got the OSD map with the blocklist",
        "took epoch ",
        "metadata journal finished",
        "done in ",
    ]
    assert len(parts) == len(expected) and all(p.startswith(e) for p, e in zip(parts, expected, strict=True)), parts
    elapsed = [e["elapsed_s"] for e in steps]
    assert elapsed == sorted(elapsed)
    assert any(e.get("step") == "connecting to the Ceph cluster" for e in _json_lines(err))


@pytest.mark.usefixtures("env")  # test_attach's private runtime directory, and its cleanup
def test_attach_passes_its_log_options_to_the_fuse_daemon(tmp_path: Path) -> None:
    """attach --log-format json --log-file F: the FUSE daemon it starts logs there."""
    pool = _pool(tmp_path, "v")
    log = tmp_path / "fuse.log"
    device = thinblock("attach", pool, "v", "--log-format", "json", "--log-file", str(log)).stdout.strip()
    # The runtime folder (and its daemon.log) goes with the last detach: read it before.
    daemon_log = next((tmp_path / "run").glob("*/daemon.log")).read_text()
    thinblock("detach", device)
    deadline = time.monotonic() + 60
    while "unmounted" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    entries = _json_lines(log.read_text())
    assert any(e["logger"] == "thinblock.fuse" and e["message"].startswith(f"serving {pool} at") for e in entries)
    assert any(e["message"] == "unmounted; pool committed and closed" for e in entries)
    assert "thinblock.fuse" not in daemon_log  # not there: in the log file asked for


def test_a_log_line_stays_one_line_whatever_its_message_holds() -> None:
    """Unit test of the two formats (in addition to the real processes above): a
    message with control characters is escaped in text and in JSON, and a
    traceback is indented below its text line or in its own JSON field."""
    import logging

    from thinblock.logsetup import JSONFormatter, TextFormatter

    try:
        raise ValueError("boom\nforged line")
    except ValueError:
        import sys as _sys

        exc_info = _sys.exc_info()
    record = logging.LogRecord("thinblock.nbd", logging.WARNING, __file__, 1, "name %s", ("a\nb\x1b[2J",), exc_info)
    text = TextFormatter().format(record)
    first, *rest = text.split("\n")
    assert first.endswith(" thinblock.nbd warning: name a\\nb\\x1b[2J")
    # Indented, every continuation line: none can pass for a line of its own.
    assert rest and all(line.startswith("    ") for line in rest) and "    forged line" in rest
    entry = json.loads(JSONFormatter().format(record))
    assert "\n" not in JSONFormatter().format(record)
    assert entry["message"] == "name a\nb\x1b[2J" and "ValueError: boom" in entry["exception"]


def test_stopping_with_stdout_gone_still_closes_everything(tmp_path: Path) -> None:
    """`serve ... | head -1` style: stdout's reader has gone when SIGTERM comes, so the
    "stopping" line cannot be printed; the stop still closes the sockets, drains the
    connections and commits before the pool closes (and ends quietly, 141)."""
    pool = _pool(tmp_path, "disk")
    proc = _start([*SERVE, pool])
    try:
        _until_ready(proc)
        assert proc.stdout is not None
        proc.stdout.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.stderr is not None
        err = proc.stderr.read()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in err, err
    assert proc.returncode == 141, err
    assert "final commit done, pool closed" in err, err
    left = sorted(set(os.listdir(pool)) & {"nbd.sock", "control.sock"})
    assert not left, f"serve left {left} behind"
    thinblock("pool", "check", pool)
