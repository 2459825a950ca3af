"""Snapshots through a live server: read-only snapshot exports, the
thinblock:changed: meta context against `thinblock delta` and a model, the NBD
thinblock:guaranteed context after the pool is full, and live administration over the control
socket (all with libnbd and the real command line)."""

from __future__ import annotations

import errno
import json
import random
from collections.abc import Iterator
from pathlib import Path

import nbd
import pytest

from tests.nbd_server import Server, connect, offered_contexts, served_pool, thinblock

BS = 64 << 10
MiB = 1 << 20


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Server]:
    with served_pool(tmp_path, "8M", {"disk": "16M", "other": "64M"}) as server:  # 128 blocks
        yield server


def extents(h: nbd.NBD, context: str, length: int, offset: int = 0) -> list[tuple[int, int, int]]:
    """(offset, length, flags) for one context, following the server until length is covered."""
    out: list[tuple[int, int, int]] = []
    pos = offset
    got: list[tuple[int, int]] = []

    def cb(metacontext: str, off: int, entries: list[int], err: int) -> int:
        if metacontext == context:
            got.extend(zip(entries[0::2], entries[1::2], strict=True))
        return 0

    while pos < offset + length:
        got.clear()
        h.block_status(offset + length - pos, pos, cb)
        assert got
        for n, flags in got:
            out.append((pos, n, flags))
            pos += n
    return out


def test_snapshot_export_is_read_only(served: Server) -> None:
    h = connect(served, "disk")
    h.pwrite(b"a" * BS, 0)
    h.flush()
    thinblock("snapshot", "create", served.pool, "disk", "snap")
    s = connect(served, "snap")
    assert s.is_read_only()
    assert s.pread(BS, 0) == b"a" * BS
    s.set_strict_mode(0)  # let the writes reach the server: it must refuse them itself
    for attempt in (
        lambda: s.pwrite(b"b" * 512, 0),
        lambda: s.trim(BS, 0),
        lambda: s.zero(BS, 0),
    ):
        with pytest.raises(nbd.Error) as exc:
            attempt()
        assert exc.value.errnum == errno.EPERM
    assert s.pread(BS, 0) == b"a" * BS
    h.pwrite(b"c" * BS, 0)  # the volume stays writable, the snapshot unchanged
    assert s.pread(BS, 0) == b"a" * BS


def test_changed_context_matches_delta_and_model(served: Server) -> None:
    rng = random.Random(7)
    n_blocks = 16 * MiB // BS
    h = connect(served, "disk")
    model = bytearray(16 * MiB)
    for vblock in rng.sample(range(n_blocks), 40):
        data = rng.randbytes(BS)
        h.pwrite(data, vblock * BS)
        model[vblock * BS : (vblock + 1) * BS] = data
    thinblock("snapshot", "create", served.pool, "disk", "base")
    before = bytes(model)
    # After the snapshot: whole-block writes, partial writes, zeroing, trims.
    touched: set[int] = set()
    for vblock in rng.sample(range(n_blocks), 25):
        kind = rng.choice(["write", "partial", "zero", "trim"])
        off = vblock * BS
        if kind == "write":
            data = rng.randbytes(BS)
            h.pwrite(data, off)
            model[off : off + BS] = data
        elif kind == "partial":
            data = rng.randbytes(100)
            h.pwrite(data, off + 1000)
            model[off + 1000 : off + 1100] = data
        elif kind == "zero":
            h.zero(BS, off)
            model[off : off + BS] = bytes(BS)
        else:
            h.trim(BS, off)
            model[off : off + BS] = bytes(BS)
        touched.add(vblock)
    h.flush()
    ctx = "thinblock:changed:base"
    b = connect(served, "disk", ("base:allocation", ctx))
    assert b.can_meta_context(ctx)
    changed = {(o, n) for o, n, flags in extents(b, ctx, 16 * MiB) if flags & 1}
    delta = json.loads(thinblock("delta", served.pool, "base", "disk", "--json").stdout)
    # delta splits ranges by what they now hold (data or zero); the context does not.
    merged: list[list[int]] = []
    for r in delta["ranges"]:
        if merged and merged[-1][0] + merged[-1][1] == r["offset"]:
            merged[-1][1] += r["length"]
        else:
            merged.append([r["offset"], r["length"]])
    assert changed == {(o, n) for o, n in merged}
    # The zero flag is true exactly where the disk now reads zeros.
    for r in delta["ranges"]:
        piece = model[r["offset"] : r["offset"] + r["length"]]
        if r["zero"]:
            assert piece == bytes(len(piece)), r
    changed_blocks = {o // BS + i for o, n in changed for i in range(n // BS)}
    # The model: every block whose bytes differ is reported; nothing untouched is.
    differ = {v for v in range(n_blocks) if before[v * BS : (v + 1) * BS] != model[v * BS : (v + 1) * BS]}
    assert differ <= changed_blocks <= touched
    # A backup client copies only the changed ranges onto the snapshot's bytes and gets the volume.
    s = connect(served, "base")
    rebuilt = bytearray(b"".join(s.pread(MiB, i * MiB) for i in range(16)))
    for o, n in changed:
        rebuilt[o : o + n] = b.pread(n, o)
    assert bytes(rebuilt) == bytes(model)
    # Unknown snapshots are not offered.
    offered = offered_contexts(served, "disk")
    assert ctx in offered and "thinblock:changed:disk" not in offered


def test_changed_context_keeps_the_snapshot_it_negotiated(served: Server) -> None:
    """thinblock:changed:SNAP compares with the snapshot of that name at negotiation,
    for the connection's life. Rotating backup names (remove disk@backup, take a new
    disk@backup) while an incremental backup client is connected must not make it
    compare with the new snapshot: blocks written since the old one were reported
    unchanged, and a backup built from the context lost them."""
    h = connect(served, "disk")
    h.pwrite(b"a" * BS, 0)
    h.flush()
    thinblock("snapshot", "create", served.pool, "disk@backup")
    ctx = "thinblock:changed:disk@backup"
    b = connect(served, "disk", (ctx,))
    h.pwrite(b"b" * BS, 5 * BS)
    h.flush()
    assert [(o, n) for o, n, f in extents(b, ctx, 16 * MiB) if f & 1] == [(5 * BS, BS)]
    thinblock("snapshot", "remove", served.pool, "disk@backup")
    # Removed: everything counts as changed (a backup copies too much, never too little).
    assert [(o, n) for o, n, f in extents(b, ctx, 16 * MiB) if f & 1] == [(0, 16 * MiB)]
    thinblock("snapshot", "create", served.pool, "disk@backup")  # the same name, a new snapshot
    assert [(o, n) for o, n, f in extents(b, ctx, 16 * MiB) if f & 1] == [(0, 16 * MiB)]
    # Renaming another snapshot to that name does not redirect the context either.
    thinblock("snapshot", "remove", served.pool, "disk@backup")
    thinblock("snapshot", "create", served.pool, "disk@later")
    b2 = connect(served, "disk", ("thinblock:changed:disk@later",))
    h.pwrite(b"c" * BS, 7 * BS)
    h.flush()
    thinblock("snapshot", "rename", served.pool, "disk@later", "disk@backup")
    assert [(o, n) for o, n, f in extents(b, ctx, 16 * MiB) if f & 1] == [(0, 16 * MiB)]
    # ...and a context follows its own snapshot through a rename.
    assert [(o, n) for o, n, f in extents(b2, "thinblock:changed:disk@later", 16 * MiB) if f & 1] == [(7 * BS, BS)]
    # A new connection compares with the snapshot the name now has.
    b3 = connect(served, "disk", (ctx,))
    assert [(o, n) for o, n, f in extents(b3, ctx, 16 * MiB) if f & 1] == [(7 * BS, BS)]
    for handle in (h, b, b2, b3):
        handle.shutdown()


def _fill(server: Server) -> None:
    """Write distinct data into `other` until the pool is full."""
    o = connect(server, "other")
    off = 0
    while True:
        try:
            o.pwrite(random.randbytes(BS), off)
        except nbd.Error as exc:
            assert exc.errnum == errno.ENOSPC
            break
        off += BS
    o.flush()


def test_no_enospc_where_guaranteed(served: Server) -> None:
    thinblock("volume", "create", served.pool, "resv", "--size", "4M")
    h, r = connect(served, "disk"), connect(served, "resv")
    for vblock in range(0, 40, 2):
        h.pwrite(random.randbytes(BS), vblock * BS)
    for vblock in range(20):
        r.pwrite(random.randbytes(BS), vblock * BS)
    h.zero(4 * BS, 60 * BS, nbd.CMD_FLAG_NO_HOLE)
    h.flush()
    thinblock("volume", "set", served.pool, "resv", "--reserve", "full")
    thinblock("snapshot", "create", served.pool, "disk", "disk-snap")
    thinblock("snapshot", "create", served.pool, "resv", "resv-snap")
    h.pwrite(random.randbytes(BS), 50 * BS)  # a later write of disk's own
    _fill(served)
    for name in ("disk", "resv"):
        fresh = connect(served, name, ("base:allocation", "thinblock:guaranteed"))
        size = fresh.get_size()
        # base:allocation: every mapped block is allocated, shared or not.
        holes = [(o, n) for o, n, f in extents(fresh, "base:allocation", size) if f & nbd.STATE_HOLE]
        assert (50 * BS, BS) not in holes and not any(o <= 0 < o + n for o, n in holes), name
        sure = [(o, n) for o, n, f in extents(fresh, "thinblock:guaranteed", size) if f & 1]
        if name == "disk":
            assert sure == []  # no reservation: a snapshot may share any block at any time
            continue
        assert sure == [(0, 20 * BS)]
        for o, n in sure:
            for pos in range(o, o + n, BS):
                r.pwrite(random.randbytes(BS), pos)  # never ENOSPC on the full pool
        r.flush()
    listing = json.loads(thinblock("volume", "list", served.pool, "--json").stdout)
    resv = next(v for v in listing if v["name"] == "resv")
    assert resv["exclusive_bytes"] == 20 * BS  # every shared block was copied from the set-aside


def test_live_administration(served: Server) -> None:
    h = connect(served, "disk")
    h.pwrite(b"A" * BS, 0)  # acknowledged before the snapshot
    thinblock("snapshot", "create", served.pool, "disk", "s1")
    h.pwrite(b"B" * BS, 0)
    assert connect(served, "s1").pread(BS, 0) == b"A" * BS  # a point between two requests
    # A new volume is an export at once; a resize is seen by new connections.
    thinblock("volume", "create", served.pool, "late", "--size", "1M")
    assert connect(served, "late").get_size() == MiB
    thinblock("volume", "resize", served.pool, "late", "--size", "3M")
    assert connect(served, "late").get_size() == 3 * MiB
    # Clones are writable exports sharing the snapshot's blocks.
    thinblock("volume", "clone", served.pool, "s1", "c1")
    c = connect(served, "c1")
    assert not c.is_read_only() and c.pread(BS, 0) == b"A" * BS
    listing = {v["name"]: v for v in json.loads(thinblock("volume", "list", served.pool, "--json").stdout)}
    assert listing["s1"]["kind"] == "snapshot" and listing["s1"]["origin"] == "disk"
    assert listing["c1"]["origin"] == "s1" and listing["c1"]["shared_bytes"] == BS
    assert listing["disk"]["open_clients"] >= 1
    # An open volume is not removed or rolled back behind its clients.
    busy = thinblock("volume", "remove", served.pool, "disk", check=False)
    assert busy.returncode == 1 and "open by" in busy.stderr
    busy = thinblock("volume", "rollback", served.pool, "disk", "s1", check=False)
    assert busy.returncode == 1 and "open by" in busy.stderr
    h.shutdown()
    c.shutdown()
    thinblock("volume", "rollback", served.pool, "disk", "s1")
    assert connect(served, "disk").pread(BS, 0) == b"A" * BS
    # Wrong kinds and names are clear errors that change nothing.
    for args, words in (
        (("snapshot", "remove", served.pool, "disk"), "is a volume"),
        (("volume", "clone", served.pool, "disk", "x"), "is a volume"),
        (("snapshot", "create", served.pool, "nope", "x"), "no volume"),
        (("snapshot", "create", served.pool, "disk", "s1"), "already exists"),
        (("volume", "rollback", served.pool, "other", "s1"), "not in the lineage"),
    ):
        proc = thinblock(*args, check=False)
        assert proc.returncode == 1 and words in proc.stderr, proc.stderr
    listed = json.loads(thinblock("volume", "list", served.pool, "--json").stdout)
    assert {v["name"] for v in listed} == {"disk", "other", "late", "s1", "c1"}
    status = json.loads(thinblock("pool", "status", served.pool, "--json").stdout)
    assert (status["volume_count"], status["snapshot_count"]) == (4, 1)  # c1 is a volume
    thinblock("snapshot", "remove", served.pool, "s1")
    assert connect(served, "c1").pread(BS, 0) == b"A" * BS  # blocks live on in the clone


def test_control_socket_survives_bad_requests(served: Server) -> None:
    import socket

    path = str(Path(served.pool) / "control.sock")
    assert oct(Path(path).stat().st_mode & 0o777) == "0o600"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        f = sock.makefile("rwb")
        for line in (
            b"not json\n",
            b"[1, 2]\n",
            b'{"verb": "no_such_verb"}\n',
            b'{"verb": "volume_create", "args": {"bogus": 1}}\n',
            b'{"verb": "volume_create", "args": {"name": "x", "size_bytes": 7}}\n',
            b'{"verb": "volume_resize", "args": {"name": "disk", "size_bytes": -1}}\n',
            b'{"verb": "volume_set", "args": {"name": "disk", "reserve": "lots"}}\n',
            b"\xff\xfe\n",
        ):
            f.write(line)
            f.flush()
            reply = json.loads(f.readline())
            assert reply.get("error"), (line, reply)
            assert not reply["error"].startswith("internal error"), (line, reply)
        f.write(b'{"verb": "volume_list"}\n')
        f.flush()
        assert {v["name"] for v in json.loads(f.readline())["ok"]} == {"disk", "other"}
    assert connect(served, "disk").get_size() == 16 * MiB
