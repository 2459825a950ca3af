"""`volume info`, `volume map` and the `pool status` bar, through the real command line.

Data goes in through a real `thinblock serve` and qemu-io over NBD; the pictures
are read back (Pillow for the PNG, an XML parser for the SVG) and checked against
`volume info --json`, which counts from the volume's own counters and page walk.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, PngImagePlugin

from tests.cli import ROOT, thinblock
from tests.conftest import new_rados_locator
from tests.nbd_server import Server, connect
from thinblock.core.allocation_map import DATA, UNMAPPED, ZEROED, fold_cells
from thinblock.frontends.cli.pictures import PALETTE

BS = 64 << 10
COLOURS = {rgb: code for code, (rgb, _, _) in PALETTE.items()}
SVG_CODES = {cls: code for code, (_, _, cls) in PALETTE.items()}


def info(pool: str, name: str) -> dict[str, Any]:
    return json.loads(thinblock("volume", "info", pool, name, "--json").stdout)


def vmap(pool: str, name: str, *extra: str) -> dict[str, Any]:
    return json.loads(thinblock("volume", "map", pool, name, "--json", *extra).stdout)


def qemu_io(server: Server, name: str, *commands: str) -> None:
    args = ["qemu-io", "-f", "raw"]
    for command in commands:
        args += ["-c", command]
    proc = subprocess.run([*args, server.unix_uri(name)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "failed" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def png_cells(path: Path) -> str:
    """The cell codes as the PNG shows them: each cell's centre pixel, row after row."""
    with Image.open(path) as png:
        assert isinstance(png, PngImagePlugin.PngImageFile)
        layout = json.loads(png.text["thinblock-map"])
        image = png.convert("RGB")
    px, left, top = layout["cell_pixels"], layout["left"], layout["top"]
    out: list[str] = []
    for r in range(layout["rows"]):
        for c in range(layout["columns"]):
            x, y = left + c * px + px // 2, top + r * px + px // 2
            if x >= image.width:
                break
            rgb = image.getpixel((x, y))
            if rgb not in COLOURS:  # past the volume's end (background)
                return "".join(out)
            out.append(COLOURS[rgb])
    return "".join(out)


def svg_cells(path: Path) -> str:
    """The cell codes as the SVG's map rects say: each rect covers data-cells cells."""
    root = ET.parse(path).getroot()
    ns = {"s": "http://www.w3.org/2000/svg"}
    group = root.find("s:g[@id='map']", ns)
    assert group is not None
    out = ""
    for rect in group.findall("s:rect", ns):
        assert int(rect.get("data-first-cell", -1)) == len(out)
        out += SVG_CODES[rect.get("class", "")] * int(rect.get("data-cells", 0))
    return out


def counts(codes: str, info: dict[str, Any]) -> None:
    """At one block per cell, the cells add up to volume info's figures."""
    assert (codes.count("D") + codes.count("d")) * BS == info["data_bytes"]
    assert (codes.count("Z") + codes.count("z")) * BS == info["zeroed_bytes"]
    assert (codes.count("d") + codes.count("z")) * BS == info["shared_bytes"]
    assert (codes.count("D") + codes.count("Z")) * BS == info["exclusive_bytes"]
    assert codes.count(".") * BS == info["size_bytes"] - info["mapped_bytes"]


def test_fold_cells_shows_the_most_allocated_state_and_a_shared_majority() -> None:
    runs = [(3, UNMAPPED, False), (1, DATA, True), (4, ZEROED, False), (2, ZEROED, True), (1, ZEROED, False)]
    # cell 0: 3 unmapped + 1 shared data -> d; cell 1: zeroed; cell 2: 2 shared, 1 not -> z
    assert fold_cells(runs, 11, 4) == "dZz"
    assert fold_cells(runs, 11, 1) == "...dZZZZzzZ"
    assert fold_cells([(1 << 34, UNMAPPED, False)], 1 << 34, 1 << 18) == "." * (1 << 16)
    # DATA over ZEROED; shared when at least half of that state's blocks are
    mixed = [(1, ZEROED, True), (1, DATA, True), (2, DATA, False), (2, DATA, True), (2, DATA, False)]
    assert fold_cells(mixed, 8, 4) == "Dd"


def test_pictures_match_volume_info_after_writes_trim_and_a_snapshot(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "v", "--size", "4M")  # 64 blocks: one block per cell
    server = Server(pool, workdir=tmp_path)
    try:
        qemu_io(
            server,
            "v",
            "write -P 0x61 0 192k",  # blocks 0-2: DATA
            "write -P 0x62 640k 64k",  # block 10: DATA
            "write -z 1280k 256k",  # blocks 20-23: ZEROED (write zeroes, no hole)
            "discard 64k 64k",  # block 1: trimmed, UNMAPPED again
            "write -P 0 2560k 64k",  # block 40: zeros over a hole: nothing
        )
        before = "D.D.......D.........ZZZZ" + "." * 40
        assert vmap(pool, "v", "--width", "16")["cells"] == before
        thinblock("volume", "map", pool, "v", "-o", str(tmp_path / "before.png"))
        thinblock("volume", "map", pool, "v", "-o", str(tmp_path / "before.svg"))
        assert png_cells(tmp_path / "before.png") == svg_cells(tmp_path / "before.svg") == before
        counts(before, info(pool, "v"))  # and no shared colour before a snapshot

        thinblock("snapshot", "create", pool, "v", "s1")
        shared = "d.d.......d.........zzzz" + "." * 40  # every mapped block, through the shared page
        assert vmap(pool, "v")["cells"] == vmap(pool, "s1")["cells"] == shared
        thinblock("volume", "map", pool, "v", "-o", str(tmp_path / "shared.png"))
        assert png_cells(tmp_path / "shared.png") == shared
        counts(shared, info(pool, "v"))
        qemu_io(server, "v", "write -P 0x63 0 64k")  # block 0 is the volume's own again
        after = "D.d.......d.........zzzz" + "." * 40
        for width in ("16", "64"):  # the layout changes, the cells do not
            thinblock("volume", "map", pool, "v", "-o", str(tmp_path / "after.png"), "--width", width)
            thinblock("volume", "map", pool, "v", "-o", str(tmp_path / "after.svg"), "--width", width)
            assert png_cells(tmp_path / "after.png") == svg_cells(tmp_path / "after.svg") == after
        served_info = info(pool, "v")
        counts(after, served_info)
        # s1 alone holds block 0's old data now: the volume's write copied it away
        assert vmap(pool, "s1")["cells"] == "D.d.......d.........zzzz" + "." * 40
        served_map = vmap(pool, "v", "--width", "16")

        h = connect(server, "v")  # an open client shows in volume info
        try:
            assert info(pool, "v")["open_clients"] == 1
        finally:
            h.shutdown()
        assert info(pool, "v")["open_clients"] == 0
    finally:
        server.stop()
    # At rest, the pool gives the same answers as its server did.
    assert info(pool, "v") == served_info
    assert vmap(pool, "v", "--width", "16") == served_map
    thinblock("pool", "check", pool)


def test_info_lists_origin_snapshots_and_clones(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "16M")
    thinblock("volume", "create", pool, "v", "--size", "1M")
    thinblock("snapshot", "create", pool, "v", "s1")
    thinblock("snapshot", "create", pool, "v@s2")
    thinblock("volume", "clone", pool, "s1", "c1")
    v, s1, c1 = info(pool, "v"), info(pool, "s1"), info(pool, "c1")
    assert (v["kind"], v["origin"], v["snapshots"], v["clones"]) == ("volume", None, ["s1", "v@s2"], [])
    assert (s1["kind"], s1["origin"], s1["snapshots"], s1["clones"]) == ("snapshot", "v", [], ["c1"])
    assert (c1["kind"], c1["origin"], c1["snapshots"], c1["clones"]) == ("volume", "s1", [], [])
    listed = {x["name"]: x for x in json.loads(thinblock("volume", "list", pool, "--json").stdout)}
    assert {k: v[k] for k in listed["v"]} == listed["v"]  # everything volume list knows, and more
    lines = thinblock("volume", "info", pool, "v").stdout.splitlines()
    human = {key: value.strip() for key, value in (line.split(":", 1) for line in lines)}
    assert len({len(line) - len(line.split(":", 1)[1].lstrip()) for line in lines}) == 1  # values aligned
    assert (human["snapshots"], human["size"], human["block size"], human["open clients"]) == (
        "s1, v@s2",
        "1M",
        "64K",
        "0",
    )
    assert "origin:         v\n" in thinblock("volume", "info", pool, "s1").stdout


@pytest.mark.parametrize(
    ("args", "status", "words"),
    [
        (["volume", "info", "{pool}", "nope"], 1, "no volume or snapshot 'nope' in pool"),
        (["volume", "map", "{pool}", "nope"], 1, "no volume or snapshot 'nope' in pool"),
        (["volume", "map", "{pool}", "v", "-o", "{tmp}/x.jpg"], 2, "name it FILE.png or FILE.svg"),
        (["volume", "map", "{pool}", "v", "--width", "0"], 2, "invalid number of cells '0'"),
        (["volume", "map", "{pool}", "v", "-o", "{tmp}/no/x.png"], 1, "cannot write the map to {tmp}/no/x.png"),
        (["volume", "map", "{pool}", "v", "-o", "{tmp}/no/x.svg"], 1, "cannot write the map to {tmp}/no/x.svg"),
        (["volume", "map", "{pool}", "v", "-o", "{tmp}"], 2, "name it FILE.png or FILE.svg"),
        (["volume", "map", "{pool}", "v", "--width", "4096", "--height", "4096"], 2, "more than the 262144 cells"),
    ],
)
def test_bad_input_is_one_sentence(tmp_path: Path, args: list[str], status: int, words: str) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "16M")
    thinblock("volume", "create", pool, "v", "--size", "1M")
    proc = thinblock(*[a.format(pool=pool, tmp=tmp_path) for a in args], check=False)
    assert proc.returncode == status, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("thinblock: error:")]
    assert len(errors) == 1 and words.format(tmp=tmp_path) in errors[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool"]  # nothing written, not even half


def test_a_petabyte_volume_maps_fast(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "64M")
    thinblock("volume", "create", pool, "big", "--size", "1P")
    server = Server(pool, workdir=tmp_path)
    try:
        qemu_io(server, "big", "write -P 0x61 0 64k", "write -P 0x62 512T 128k", "write -P 0x63 1125899906777088 64k")
    finally:
        server.stop()
    start = time.monotonic()
    thinblock("volume", "map", pool, "big", "-o", str(tmp_path / "big.png"))
    seconds = time.monotonic() - start
    print(f"volume map of a 1P volume with 4 blocks written, to PNG: {seconds:.2f} s (the whole command)")
    assert seconds < 5
    codes = png_cells(tmp_path / "big.png")
    assert len(codes) == 256 * 256  # 16G a cell
    assert [i for i, c in enumerate(codes) if c != "."] == [0, 32768, 65535]
    assert all(codes[i] == "D" for i in (0, 32768, 65535))
    assert info(pool, "big")["data_bytes"] == 4 * BS


def _on_a_terminal(*args: str, env: dict[str, str] | None = None) -> str:
    """The output of `thinblock ARGS` with its stdout on a pseudo-terminal."""
    main, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "thinblock", *args],
        stdout=child,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})},
    )
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    return out.decode()


def test_terminal_gets_colours_and_a_pipe_gets_plain_text(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "16M")
    thinblock("volume", "create", pool, "v", "--size", "1M")
    thinblock("volume", "set", pool, "v", "--reserve", "4M")
    data = tmp_path / "data"
    data.write_bytes(b"x" * (2 * BS))
    thinblock("import", str(data), pool, "v2")

    shown = _on_a_terminal("volume", "map", pool, "v2")
    assert "\x1b[38;5;" in shown and "█" in shown and "data, shared" in shown
    piped = thinblock("volume", "map", pool, "v2").stdout
    assert "\x1b" not in piped
    assert piped.splitlines()[1] == "DD"  # 2 blocks, each a cell
    assert "size 128K  data 128K  zeroed 0B  unmapped 0B  shared 0B  exclusive 128K" in piped

    bar = [line for line in _on_a_terminal("pool", "status", pool).splitlines() if "reserved 4M, free" in line]
    assert len(bar) == 1 and "\x1b[38;5;" in bar[0] and "used 128K (1%)" in bar[0]
    plain = [line for line in _on_a_terminal("pool", "status", pool, env={"NO_COLOR": "1"}).splitlines()]
    bar = [line for line in plain if line.startswith("[")]
    assert bar == ["[#++++++++++-----------------------------] used 128K (1%), reserved 4M, free 11.9M"]
    assert not any(line.startswith("[") for line in thinblock("pool", "status", pool).stdout.splitlines())
    assert "\x1b" not in _on_a_terminal("pool", "status", pool, "--json")


def test_a_pool_in_ceph_maps_alike(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    pool = new_rados_locator(request, "maps")
    thinblock("pool", "create", pool, "--size", "16M")
    data = tmp_path / "data"
    data.write_bytes(b"\0" * BS + b"x" * BS + b"\0" * (2 * BS))  # block 1 only
    thinblock("import", str(data), pool, "v")
    thinblock("snapshot", "create", pool, "v", "s")
    assert vmap(pool, "v")["cells"] == ".d.."
    thinblock("volume", "map", pool, "v", "-o", str(tmp_path / "v.svg"))
    assert svg_cells(tmp_path / "v.svg") == ".d.."
    counts(".d..", info(pool, "v"))
    assert info(pool, "v")["snapshots"] == ["s"]


def test_a_picture_that_cannot_be_put_in_place_leaves_nothing(tmp_path: Path) -> None:
    pool = str(tmp_path / "pool")
    thinblock("pool", "create", pool, "--size", "16M")
    thinblock("volume", "create", pool, "v", "--size", "1M")
    (tmp_path / "x.png").mkdir()  # the picture is drawn, then cannot replace a directory
    proc = thinblock("volume", "map", pool, "v", "-o", str(tmp_path / "x.png"), check=False)
    assert proc.returncode == 1
    assert proc.stderr == f"thinblock: error: cannot write the map to {tmp_path}/x.png: Is a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool", "x.png"]
    assert not any((tmp_path / "x.png").iterdir())


class _CountingLock:
    """The pool's lock, counting how often it is taken from outside (not re-entered)."""

    def __init__(self, lock: Any) -> None:
        self.lock, self.depth, self.taken = lock, 0, 0

    def __enter__(self) -> None:
        self.lock.acquire()
        self.taken += self.depth == 0
        self.depth += 1

    def __exit__(self, *exc: object) -> None:
        self.depth -= 1
        self.lock.release()


def test_a_map_lets_go_of_the_pool_lock_between_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mapping a volume full of data takes seconds; requests on every volume wait for
    the pool lock, so the walk holds it one mapping page at a time, never throughout."""
    from thinblock.core.allocation_map import allocation_runs
    from thinblock.core.mapping import PAGE_ENTRIES
    from thinblock.core.pool import Pool

    with Pool.create(str(tmp_path / "p"), 4 * PAGE_ENTRIES * BS, block_size=BS) as pool:
        vol = pool.create_volume("v", 4 * PAGE_ENTRIES * BS)
        for page_index in range(3):
            vol.write(page_index * PAGE_ENTRIES * BS, b"x" * BS)
        counting = _CountingLock(pool.lock)
        monkeypatch.setattr(pool, "lock", counting)
        runs = allocation_runs(vol)
        monkeypatch.undo()
        assert counting.taken >= 3, "the whole walk ran under one hold of the pool lock"
        assert [(n, state) for n, state, _ in runs] == [
            (1, DATA), (PAGE_ENTRIES - 1, UNMAPPED), (1, DATA), (PAGE_ENTRIES - 1, UNMAPPED),
            (1, DATA), (2 * PAGE_ENTRIES - 1, UNMAPPED),
        ]  # fmt: skip
