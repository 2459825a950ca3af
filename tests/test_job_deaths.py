"""Jobs against death: real `thinblock` processes killed (SIGKILL, SIGTERM, SIGHUP)
or cut off by a power cut at fixed points of import, import-diff and sparsify.

A point is a fixed number of bytes the job has taken from a pipe the test writes
(the pipe holds at most 64 KiB, so when the test's write returns the job has
read all but that), or, for sparsify, which reads no stream, a fixed delay.
After each death: `pool check` accepts the metadata, nothing half-made shows
(no volume that looks whole, the old contents of an overwritten volume intact),
the runtime files of a cleanly cancelled job are gone, and rerunning the job
works. Plus the root cause of the leaked-space bug shown in process, and the
sources that used to hang (a FIFO with no writer, a socket that is not NBD).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.cli import ROOT, thinblock
from tests.faults import install
from tests.nbd_server import Server
from tests.test_power_cut import PowerCutRig
from thinblock import Pool
from thinblock.backends import locate
from thinblock.sizes import parse_size
from thinblock.store.base import FilterStore
from thinblock.tools.check import check_metadata

MiB = 1 << 20
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
STREAM_BYTES = 24 * MiB
VOLUME = "32M"
POINTS = (0, 2 * MiB, 7 * MiB, 19 * MiB)  # bytes the job has taken from the pipe when it dies
F_SETPIPE_SZ = 1031


def _chunk(index: int) -> bytes:
    """The index-th MiB of a stream: never zero, different from its neighbours."""
    return bytes([index % 251 + 1]) * MiB


def _stream(n_bytes: int) -> Iterator[bytes]:
    for i in range(n_bytes // MiB):
        yield _chunk(i)


def _digest(chunks: Iterator[bytes], total: int) -> str:
    h = hashlib.sha256()
    n = 0
    for c in chunks:
        h.update(c)
        n += len(c)
    h.update(bytes(total - n))
    return h.hexdigest()


def _names(pool: str) -> list[str]:
    return sorted(v["name"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout))


def _contents(pool: str, name: str, tmp: Path) -> str:
    out = tmp / f"{name}.raw"
    out.unlink(missing_ok=True)
    thinblock("export", pool, name, str(out))
    h = hashlib.sha256(out.read_bytes()).hexdigest()
    out.unlink()
    return h


def _check(pool: str) -> None:
    out = thinblock("pool", "check", pool, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def _start(args: Sequence[str]) -> tuple[subprocess.Popen[str], int]:
    """A thinblock job reading stdin from a pipe this test writes; (process, write end)."""
    reader, writer = os.pipe()
    fcntl.fcntl(writer, F_SETPIPE_SZ, 64 << 10)
    proc = subprocess.Popen(
        [sys.executable, "-m", "thinblock", *args],
        stdin=reader,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    os.close(reader)
    return proc, writer


def _feed(writer: int, chunks: Iterator[bytes], n_bytes: int) -> None:
    """Write the first n_bytes of chunks into the pipe (returns once the job took them)."""
    left = n_bytes
    for c in chunks:
        if left <= 0:
            break
        view = memoryview(c)[:left]
        while view:
            view = view[os.write(writer, view) :]
        left -= len(c)


def _die(proc: subprocess.Popen[str], writer: int, sig: int) -> tuple[int, str]:
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=120)
    os.close(writer)
    assert "Traceback" not in err, err
    return proc.returncode, err


def _inode(path: Path) -> tuple[int, int] | None:
    """Which file path is (inode and change time: an inode number alone may be reused)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


def _wait_for(path: Path, proc: subprocess.Popen[str], stale: tuple[int, int] | None) -> None:
    """Wait until the job's process made path (not the one a killed run left: stale)."""
    deadline = time.monotonic() + 60
    while _inode(path) in (None, stale):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.02)


def _import_stream(pool: str, name: str, *extra: str) -> None:
    proc, writer = _start(["import", "-", pool, name, "--size", VOLUME, "--no-progress", *extra])
    # The stream holds the whole volume (a short one is refused): its data, then zeros.
    whole = parse_size(VOLUME)
    _feed(writer, iter([*_stream(STREAM_BYTES), bytes(whole - STREAM_BYTES)]), whole)
    os.close(writer)
    _out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "Traceback" not in err, err


WHOLE = _digest(_stream(STREAM_BYTES), 32 * MiB)


# ----- the cause: a commit while a write's data I/O is in flight ----------------------


class _HeldWrites(FilterStore):
    """Data writes wait until released: a write's I/O in flight, for as long as wanted."""

    def __init__(self, inner: FilterStore) -> None:
        super().__init__(inner)
        self.started = threading.Event()
        self.release = threading.Event()

    def pwritev(self, offset: int, buffers: Sequence[bytes | memoryview]) -> None:
        self.started.set()
        assert self.release.wait(60)
        self.inner.pwritev(offset, buffers)

    def write_many(self, writes: Sequence[tuple[int, Sequence[bytes | memoryview]]]) -> None:
        for offset, buffers in writes:
            self.pwritev(offset, buffers)


def test_a_commit_during_a_writes_io_records_nothing_of_its_fresh_blocks(tmp_path: Path) -> None:
    """What a SIGKILL right after a background commit leaves is that commit: it must
    not hold the refcount (and used count) of blocks a write took whose mapping is
    not published yet. Before the fix: 'refcount 1 recorded but nothing maps it'."""
    path = str(tmp_path / "pool")
    thinblock("pool", "create", path, "--size", "64M")
    thinblock("volume", "create", path, "v", "--size", "8M")
    with Pool.open(path, autocommit=False) as pool:
        held = _HeldWrites(pool.store)  # type: ignore[arg-type]
        install(pool, store=held)
        writer = threading.Thread(target=pool.volume("v").write, args=(0, b"\x5a" * (4 * MiB)))
        writer.start()
        assert held.started.wait(30)
        # Any commit now: here one with a change of its own (a new volume), as the
        # background committer's, once a second, has the writes published meanwhile.
        pool.create_volume("w", MiB)
        meta = locate(path).open_meta(readonly=True)
        try:
            assert check_metadata(meta) == []
        finally:
            meta.close()
        held.release.set()
        writer.join()
        pool.commit()
    _check(path)
    assert thinblock("volume", "list", path, "--json").stdout.count('"mapped_bytes": 4194304') == 1


# ----- SIGKILL, SIGTERM, SIGHUP at fixed points of an import ---------------------------


def test_sigkill_at_fixed_points_of_a_stream_import(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "512M")
    for i, point in enumerate(POINTS):
        name = f"v{i}"
        proc, writer = _start(["import", "-", pool, name, "--size", VOLUME, "--no-progress"])
        _feed(writer, _stream(STREAM_BYTES), point)
        _die(proc, writer, signal.SIGKILL)
        _check(pool)
        assert name not in _names(pool), f"a half import shows after a kill at byte {point}"
        _import_stream(pool, name)  # the rerun needs no --force: nothing was left
        assert _contents(pool, name, tmp_path) == WHOLE
    _check(pool)


def test_sigkill_of_a_forced_import_leaves_the_old_contents(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    old = tmp_path / "old.raw"
    old.write_bytes(b"\x77" * (32 * MiB))
    thinblock("import", str(old), pool, "v")
    before = _contents(pool, "v", tmp_path)
    for point in POINTS[1:]:
        proc, writer = _start(["import", "-", pool, "v", "--force", "--no-progress"])
        _feed(writer, _stream(STREAM_BYTES), point)
        _die(proc, writer, signal.SIGKILL)
        _check(pool)
        assert _names(pool) == ["v"]
        assert _contents(pool, "v", tmp_path) == before, f"v changed after a kill at byte {point}"
    _import_stream(pool, "v", "--force")
    assert _contents(pool, "v", tmp_path) == WHOLE


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_sigterm_and_sighup_cancel_an_import_like_sigint(tmp_path: Path, sig: int, status: int) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "512M")
    runtime = Path(locate(pool).runtime_dir())
    points = POINTS if sig == signal.SIGTERM else POINTS[2:3]
    for i, point in enumerate(points):
        name = f"v{i}"
        stale = _inode(runtime / "control.sock")
        proc, writer = _start(["import", "-", pool, name, "--size", VOLUME, "--no-progress"])
        _wait_for(runtime / "control.sock", proc, stale)  # the job runs (a signal before it is Python's default)
        _feed(writer, _stream(STREAM_BYTES), point)
        code, err = _die(proc, writer, sig)
        assert code == status, (code, err)
        assert "cancelled by" in err and err.count("\n") == 1, err
        assert not (runtime / "control.sock").exists(), "the control socket was left behind"
        _check(pool)
        assert name not in _names(pool)
        _import_stream(pool, name)
    _check(pool)


def test_a_signal_in_a_local_job_waits_for_its_next_safe_point() -> None:
    """A job run in the command's own process holds the pool in its main thread, so
    the handler only takes the signal; check() (each progress report, each stream
    read) raises it. Before, the handler raised at whatever bytecode the main thread
    was on: inside the pool's code too."""
    from thinblock.frontends.cli.signals import Interrupted, job_signals

    reached = []
    with pytest.raises(Interrupted) as stopped, job_signals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # the handler has run by now (a sleep runs pending handlers)
        reached.append("past the signal")
        signals.checked(lambda done, total: reached.append(f"progress {done}/{total}"))(1, 2)
        reached.append("past the check")
    assert stopped.value.signum == signal.SIGTERM
    assert reached == ["past the signal", "progress 1/2"]


def test_an_exception_right_after_a_commit_claims_its_turn_leaves_no_commit_waiting(tmp_path: Path) -> None:
    """A KeyboardInterrupt may land between any two calls of the main thread. One
    right after a commit claimed its turn (here: the clock read that follows the
    claim) used to leave the turn taken, and every later commit, the one at close
    too, waited for it forever: the import that hung in CI after SIGTERM."""
    path = str(tmp_path / "pool")
    thinblock("pool", "create", path, "--size", "64M")
    with Pool.open(path, autocommit=False) as pool:
        pool.create_volume("v", MiB)
        clock = time.perf_counter
        calls = [0]

        def interrupted_once() -> float:
            calls[0] += 1
            if calls[0] == 1:
                raise KeyboardInterrupt
            return clock()

        time.perf_counter = interrupted_once
        try:
            with pytest.raises(KeyboardInterrupt):
                pool.commit()
        finally:
            time.perf_counter = clock
        later = threading.Thread(target=pool.commit, daemon=True)
        later.start()
        later.join(60)  # a commit takes milliseconds; a turn never given back, for ever
        stuck = later.is_alive()
        if stuck:  # give the turn back by hand, so that the pool can close and the test fail
            with pool.committer.lock:
                pool.committer._committing = False
                pool.committer._commit_idle.notify_all()
        assert not stuck, "the next commit waits for a turn nobody gives back"
    assert _names(path) == ["v"]


def _rbd_image_with_a_snapshot() -> bytes:
    """An "rbd image v2" stream of two diffs, as `rbd export --export-format 2` writes
    for an image with one snapshot: the first ends at snapshot s1 (the stream's first
    half), the second adds the rest."""
    from thinblock.formats import rbd

    head = rbd.IMAGE_V2 + b"O" + (8).to_bytes(8, "little") + (22).to_bytes(8, "little") + b"E"
    out = [head + rbd.IMAGE_DIFFS_V2 + (2).to_bytes(8, "little")]
    half = STREAM_BYTES // MiB // 2
    for first, snap in ((0, "s1"), (half, None)):
        enc = rbd.DiffEncoder(2)
        out.append(enc.header() + (enc.from_snap("s1") if snap is None else enc.to_snap(snap)) + enc.size(32 * MiB))
        for i in range(first, first + half):
            out.append(enc.data(i * MiB, MiB) + _chunk(i))
        out.append(enc.end())
    return b"".join(out)


def test_sigkill_of_an_rbd_image_import_leaves_neither_volume_nor_snapshots(tmp_path: Path) -> None:
    """An "rbd image v2" stream brings snapshots: killed half way, neither the volume
    nor the snapshots it took so far show; the rerun brings them all."""
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "512M")
    image = tmp_path / "img.rbd"
    image.write_bytes(_rbd_image_with_a_snapshot())
    data = image.read_bytes()
    for point in (3 * MiB, len(data) // 2 + 3 * MiB, len(data) - 2 * MiB):  # in each diff, near the end
        proc, writer = _start(["import", "-", pool, "copy", "--format", "rbd", "--no-progress"])
        _feed(writer, iter([data]), point)
        _die(proc, writer, signal.SIGKILL)
        _check(pool)
        assert _names(pool) == [], f"a half rbd image import shows after a kill at byte {point}"
    thinblock("import", str(image), pool, "copy")
    assert _names(pool) == ["copy", "copy@s1"]
    assert _contents(pool, "copy", tmp_path) == WHOLE
    half = _digest(_stream(STREAM_BYTES // 2), 32 * MiB)
    assert _contents(pool, "copy@s1", tmp_path) == half


# ----- import-diff and sparsify --------------------------------------------------------


def test_sigkill_at_fixed_points_of_import_diff(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "256M")
    old = tmp_path / "old.raw"
    old.write_bytes(b"\x33" * (32 * MiB))
    thinblock("import", str(old), pool, "d")
    before = _contents(pool, "d", tmp_path)
    _import_stream(pool, "src")
    diff = tmp_path / "src.diff"
    thinblock("export-diff", pool, "src", str(diff))
    data = diff.read_bytes()
    runtime = Path(locate(pool).runtime_dir())
    for point, sig in zip(POINTS[1:], (signal.SIGKILL, signal.SIGTERM, signal.SIGKILL), strict=True):
        stale = _inode(runtime / "control.sock")  # a SIGKILLed job's socket stays
        proc, writer = _start(["import-diff", "-", pool, "d", "--force", "--no-progress"])
        _wait_for(runtime / "control.sock", proc, stale)
        _feed(writer, iter([data]), point)
        code, _err = _die(proc, writer, sig)
        assert code == (143 if sig == signal.SIGTERM else -signal.SIGKILL)
        _check(pool)
        assert _names(pool) == ["d", "src"]
        assert _contents(pool, "d", tmp_path) == before, f"d changed after a kill at byte {point}"
    thinblock("import-diff", str(diff), pool, "d", "--force")
    # The diff has the stream's data records only: d's bytes past them stay.
    after = _digest(iter([*_stream(STREAM_BYTES), b"\x33" * (32 * MiB - STREAM_BYTES)]), 32 * MiB)
    assert _contents(pool, "d", tmp_path) == after


def test_sigkill_and_sigterm_at_fixed_delays_of_sparsify(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "512M")
    thinblock("volume", "create", pool, "z", "--size", "256M")

    def fill() -> None:  # 256M of DATA blocks holding zeros, for sparsify to free
        with Pool.open(pool) as p:
            p.set_detect_zeroes("z", "off")
            vol = p.volume("z")
            for offset in range(0, 256 * MiB, 4 * MiB):
                vol.write(offset, bytes(4 * MiB))

    runtime = Path(locate(pool).runtime_dir())
    # SIGTERM first and at once: the job has its whole 256M still to do (well over the
    # moment a signal takes), so it is always cancelled, never done, when it arrives.
    for delay, sig in ((0.0, signal.SIGTERM), (0.2, signal.SIGKILL), (1.0, signal.SIGKILL)):
        fill()  # every run has all of it to do again, whatever the last one got through
        stale = _inode(runtime / "control.sock")  # a SIGKILLed job's socket stays
        proc = subprocess.Popen(
            [sys.executable, "-m", "thinblock", "volume", "sparsify", pool, "z", "--no-progress"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        _wait_for(runtime / "control.sock", proc, stale)  # the job runs
        time.sleep(delay)
        proc.send_signal(sig)
        _out, err = proc.communicate(timeout=120)
        assert "Traceback" not in err, err
        if sig == signal.SIGTERM:
            assert proc.returncode == 143 and "cancelled by SIGTERM" in err, (proc.returncode, err)
            assert not (runtime / "control.sock").exists()
        _check(pool)
        assert _names(pool) == ["z"]
    thinblock("volume", "sparsify", pool, "z")
    _check(pool)
    assert json.loads(thinblock("volume", "list", pool, "--json").stdout)[0]["mapped_bytes"] == 0


# ----- a power cut mid-import ----------------------------------------------------------


def test_power_cut_mid_import_leaves_no_volume(tmp_path: Path) -> None:
    rig = PowerCutRig(tmp_path)
    try:
        thinblock("pool", "create", rig.pool, "--size", "64M")
        for point in (3 * MiB, 11 * MiB):
            proc, writer = _start(["import", "-", rig.pool, "v", "--size", VOLUME, "--no-progress"])
            _feed(writer, _stream(STREAM_BYTES), point)
            time.sleep(1.5)  # a background commit or two: the old code's volume is durable by now
            rig.cut()
            proc.kill()
            proc.communicate(timeout=60)
            os.close(writer)
            rig.restart()  # pool check runs here
            assert "v" not in _names(rig.pool), f"a power cut at byte {point} left a volume"
        _import_stream(rig.pool, "v")
        _check(rig.pool)
        assert _contents(rig.pool, "v", tmp_path) == WHOLE
    finally:
        rig.close()


# ----- sources that used to hang --------------------------------------------------------


def test_a_fifo_with_no_writer_is_refused_in_bounded_time(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "thinblock", "import", str(fifo), pool, "v", "--size", "8M"],
        capture_output=True,
        text=True,
        env={**ENV, "THINBLOCK_WAIT_S": "1"},
        timeout=60,
    )
    assert time.monotonic() - start < 30
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "nothing writes to the named pipe" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert _names(pool) == []
    # With a writer, a FIFO is a stream like -.
    feeder = subprocess.Popen(["sh", "-c", f"head -c {4 * MiB} /dev/zero | tr '\\0' 'A' > {fifo}"])
    thinblock("import", str(fifo), pool, "v", "--size", "4M")
    feeder.wait(30)
    assert json.loads(thinblock("volume", "list", pool, "--json").stdout)[0]["data_bytes"] == 4 * MiB


def test_a_socket_that_is_not_nbd_fails_in_seconds(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    other = str(tmp_path / "other")
    thinblock("pool", "create", other, "--size", "64M")
    server = Server(other)
    try:
        control = Path(locate(other).runtime_dir()) / "control.sock"
        silent = socket.socket(socket.AF_UNIX)
        silent.bind(str(tmp_path / "silent.sock"))
        silent.listen()
        try:
            for path in (control, tmp_path / "silent.sock"):
                start = time.monotonic()
                out = thinblock("import", f"nbd+unix:///x?socket={path}", pool, "v", check=False)
                assert time.monotonic() - start < 30, "the import waited for a greeting that never comes"
                assert out.returncode == 1 and "no NBD handshake" in out.stderr, out.stderr
                assert out.stderr.count("\n") == 1, out.stderr
        finally:
            silent.close()
        assert server.alive()
    finally:
        server.stop()
    assert _names(pool) == []


# ----- a failing disk under the pool ------------------------------------------------------


def test_opening_a_pool_on_a_failing_disk_is_one_sentence(tmp_path: Path) -> None:
    """The disk under the pool fails every write and sync (EIO): each command that
    opens the pool says so in one sentence, no traceback; once the disk works
    again the pool opens and check accepts it."""
    rig = PowerCutRig(tmp_path)
    try:
        thinblock("pool", "create", rig.pool, "--size", "64M")
        _import_stream(rig.pool, "v")
        src = tmp_path / "small.raw"
        src.write_bytes(b"\x11" * MiB)
        # Every change fails, or only the syncs (then reads work and the metadata
        # commit an open makes is what fails).
        for mode in ("eio", "eio-sync"):
            with open(rig.mnt / ".powercut", "w") as f:
                f.write(mode)
            for args in (
                ("volume", "list", rig.pool),
                ("volume", "create", rig.pool, "w", "--size", "1M"),
                ("import", str(src), rig.pool, "w"),
                ("volume", "sparsify", rig.pool, "v"),
            ):
                out = thinblock(*args, check=False)  # thinblock() asserts: no traceback
                assert out.returncode == 1, (mode, args, out.stderr)
                assert out.stderr.count("\n") == 1 and "the storage under it fails" in out.stderr, (mode, out.stderr)
        with open(rig.mnt / ".powercut", "w") as f:
            f.write("ok")
        _check(rig.pool)
        assert _names(rig.pool) == ["v"]
        assert _contents(rig.pool, "v", tmp_path) == WHOLE
    finally:
        rig.close()
