"""Jobs (import, export, export-diff, import-diff, sparsify) on a pool served per
volume: real `thinblock serve POOL --volume NAME` processes, the real command line.

A job on a volume a server owns goes to that server's control socket (its log
says so); one on a volume nobody holds, or a new one, runs in the command, which
holds the volume's lease meanwhile and gives it up at the end. Bytes are checked
against what libnbd wrote; `pool check` runs after each test. A job killed with
SIGKILL on a volume nobody holds leaves nothing half-made and the volume servable.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from tests.cli import thinblock
from tests.nbd_server import Server
from tests.test_job_deaths import _die, _feed, _start, _stream
from tests.test_owners import _handle, _pool, _serve, _stop, owners
from thinblock.backends import locate

MiB = 1 << 20


def _pattern(tag: bytes, size: int) -> bytes:
    """Data whose every 64 KiB block differs (its offset in it), with holes of zeros."""
    unit = 64 << 10
    return b"".join(
        (tag + b":%d:" % off).ljust(unit, b".") if (off // unit) % 3 else bytes(unit) for off in range(0, size, unit)
    )


def _export(pool: str, name: str, tmp: Path) -> bytes:
    out = tmp / f"{name}.out"
    out.unlink(missing_ok=True)
    thinblock("export", pool, name, str(out))
    return out.read_bytes()


def _names(pool: str) -> list[str]:
    return sorted(v["name"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout))


def _stored_names(pool: str) -> list[str]:
    """Every volume row in the store, staging ones (named '.…') included."""
    meta = locate(pool).open_meta(readonly=True)
    try:
        return sorted(row.name for row in meta.volumes())
    finally:
        meta.close()


def _ran_at(server: Server, verb: str) -> int:
    return server.log.read_text().count(f"control: {verb} ")


def test_jobs_go_to_the_owner_or_run_in_the_command(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "256M", {"a": "16M", "b": "16M", "c": "16M"})
    with owners(pool, tmp_path, "a", "b") as (sa, sb):
        data_a = _pattern(b"a", 16 * MiB)
        ha = _handle(sa, "a")
        ha.pwrite(data_a, 0)
        ha.flush()
        # export of an owned volume: a's server runs it (its bytes are its own, unflushed or not).
        assert _export(pool, "a", tmp_path) == data_a
        assert _ran_at(sa, "export") == 1
        # import into b, which b's server owns: b's server runs it, and serves the result.
        image = tmp_path / "image.raw"
        image.write_bytes(_pattern(b"i", 16 * MiB))
        thinblock("import", str(image), pool, "b")
        assert _ran_at(sb, "import") == 1
        hb = _handle(sb, "b")
        assert hb.pread(16 * MiB, 0) == image.read_bytes()
        # export-diff of a (routed), applied to b (routed) and to c (nobody holds it: here).
        diff = tmp_path / "a.diff"
        thinblock("export-diff", pool, "a", str(diff))
        assert _ran_at(sa, "export_diff") == 1
        hb.shutdown()  # a volume open by a client is not imported into (the rule stays)
        thinblock("import-diff", str(diff), pool, "b", "--force")
        assert _ran_at(sb, "import_diff") == 1
        hb = _handle(sb, "b")
        assert hb.pread(16 * MiB, 0) == data_a
        thinblock("import-diff", str(diff), pool, "c")
        assert _export(pool, "c", tmp_path) == data_a
        # sparsify of a, after zeros were written over its data (DATA blocks of zeros).
        thinblock("volume", "set", pool, "a", "--detect-zeroes", "off")
        ha.pwrite(bytes(MiB), 4 * MiB)
        ha.flush()
        freed = json.loads(thinblock("volume", "sparsify", pool, "a", "--json").stdout)
        assert _ran_at(sa, "volume_sparsify") == 1 and freed["freed_bytes"] >= MiB, freed
        want = data_a[: 4 * MiB] + bytes(MiB) + data_a[5 * MiB :]
        assert ha.pread(16 * MiB, 0) == want
        # A snapshot of a is exported by a's server too.
        thinblock("snapshot", "create", pool, "a", "s1")
        assert _export(pool, "s1", tmp_path) == want
        assert _ran_at(sa, "export") == 2
        # A new volume, and sparsify of one nobody holds: here, and the lease is given up.
        thinblock("import", str(image), pool, "n")
        thinblock("volume", "sparsify", pool, "c")
        assert _names(pool) == ["a", "b", "c", "n", "s1"]
        assert all(_ran_at(s, "import") + _ran_at(s, "volume_sparsify") <= 2 for s in (sa, sb))
        sn = _serve(pool, tmp_path, "n")
        try:
            hn = _handle(sn, "n")
            assert hn.pread(16 * MiB, 0) == image.read_bytes()
            hn.shutdown()
        finally:
            _stop(sn)
        ha.shutdown()
        hb.shutdown()
    assert json.loads(thinblock("pool", "status", pool, "--json").stdout)["granted_bytes"] == 0


def test_a_job_killed_on_a_volume_nobody_holds_leaves_it_whole_and_servable(tmp_path: Path) -> None:
    pool = _pool(tmp_path, "256M", {"a": "16M"})
    old = tmp_path / "old.raw"
    old.write_bytes(_pattern(b"old", 32 * MiB))
    thinblock("import", str(old), pool, "c")
    sa = _serve(pool, tmp_path, "a")
    try:
        # A forced import into c, then a new volume n: each killed mid-stream.
        for name, extra in (("c", ["--force"]), ("n", ["--size", "32M"])):
            proc, writer = _start(["import", "-", pool, name, "--no-progress", *extra])
            _feed(writer, _stream(24 * MiB), 7 * MiB)
            if name == "c":  # the command holds c while its job runs: a server is told who
                again = thinblock("serve", pool, "--volume", "c", "--socket", str(tmp_path / "x.sock"), check=False)
                assert again.returncode != 0, again.stderr
                assert f"volume c is served by thinblock import (pid {proc.pid}" in again.stderr, again.stderr
            _die(proc, writer, signal.SIGKILL)
            assert _names(pool) == ["a", "c"]  # this command removed what the job left
            assert _stored_names(pool) == ["a", "c"], "a staging volume of the killed job is left"
            thinblock("pool", "check", pool)
        assert _export(pool, "c", tmp_path) == old.read_bytes()
        sc = _serve(pool, tmp_path, "c")
        try:
            hc = _handle(sc, "c")
            assert hc.pread(32 * MiB, 0) == old.read_bytes()
            hc.pwrite(b"x" * MiB, 0)
            hc.flush()
            hc.shutdown()
        finally:
            _stop(sc)
    finally:
        _stop(sa)
    thinblock("pool", "check", pool)
    listed = json.loads(thinblock("volume", "list", pool, "--json").stdout)
    assert sorted(v["name"] for v in listed) == ["a", "c"]
