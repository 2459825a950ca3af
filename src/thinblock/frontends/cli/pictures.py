"""Drawing a volume's allocation map (core/allocation_map.py) and a pool's space bar.

Only drawing lives here: the cells and figures come from the pool, through the
`volume_map` verb, whoever holds it. Three ways out, one palette:
a PNG (Pillow), an SVG written by hand, and text for a terminal (ANSI colours on
a terminal, plain characters when piped or NO_COLOR is set).

The picture's cells are laid row after row, `columns` wide: each row of cells is
one run of consecutive blocks, left to right, top to bottom. Where the cells are
is recorded in the files themselves (the PNG's "thinblock-map" text chunk, the
SVG's data- attributes), so that a script can read a cell back.
"""

from __future__ import annotations

import json
import os
from html import escape
from typing import Any

from thinblock.core.allocation_map import CELL_NAMES
from thinblock.errors import ThinblockError
from thinblock.sizes import format_size

# code -> (RGB, 256-colour ANSI index, SVG class)
PALETTE: dict[str, tuple[tuple[int, int, int], int, str]] = {
    "D": ((43, 108, 176), 25, "data"),
    "d": ((221, 107, 32), 208, "data-shared"),
    "Z": ((72, 187, 120), 35, "zeroed"),
    "z": ((236, 201, 75), 220, "zeroed-shared"),
    ".": ((226, 232, 240), 252, "unmapped"),
}
BACKGROUND = (255, 255, 255)
INK = (26, 32, 44)
MARGIN = 12
FONT_PX = 14
LINE_PX = 20
LABEL_PX = 56  # room for the rows' offsets left of the map


def colour_wanted(stream: Any) -> bool:
    """ANSI colours: on a terminal, unless NO_COLOR is set (no-color.org)."""
    return bool(stream.isatty()) and not os.environ.get("NO_COLOR")


def cell_pixels(m: dict[str, Any]) -> int:
    """The side of one cell in pixels: the map about 1024 pixels wide, cells 1 to 32."""
    shown: int = min(m["columns"], len(m["cells"]))
    return max(1, min(32, 1024 // shown))


def _rows(m: dict[str, Any]) -> list[str]:
    cells, columns = m["cells"], m["columns"]
    return [cells[i : i + columns] for i in range(0, len(cells), columns)]


def headline(pool: str, m: dict[str, Any]) -> str:
    per_cell = "one block" if m["blocks_per_cell"] == 1 else format_size(m["cell_bytes"])
    per_row = f", each row {format_size(m['cell_bytes'] * m['columns'])}" if m["rows"] > 1 else ""
    return (
        f"{pool} {m['kind']} {m['name']}: {format_size(m['size_bytes'])} in {format_size(m['block_size'])} blocks;"
        f" each cell {per_cell}{per_row}"
    )


def row_labels(m: dict[str, Any]) -> list[tuple[int, str]]:
    """(row, offset) labels down the left side: the first row and about every quarter."""
    if m["rows"] < 2:
        return []
    step = max(1, m["rows"] // 4)
    return [(r, format_size(r * m["columns"] * m["cell_bytes"]) if r else "0") for r in range(0, m["rows"], step)]


def figures_line(m: dict[str, Any]) -> str:
    keys = ("size", "data", "zeroed", "unmapped", "shared", "exclusive")
    return "  ".join(f"{k} {format_size(m[f'{k}_bytes'])}" for k in keys)


# ----- terminal -------------------------------------------------------------------------


def _ansi(code: str, text: str) -> str:
    return f"\x1b[38;5;{PALETTE[code][1]}m{text}\x1b[0m"


def text_map(pool: str, m: dict[str, Any], colour: bool) -> str:
    """A few lines: headline, the cells, a legend, the figures."""
    lines = [headline(pool, m)]
    for row in _rows(m):
        if colour:  # runs of one colour in one escape: short output, quick to draw
            out, i = [], 0
            while i < len(row):
                j = i
                while j < len(row) and row[j] == row[i]:
                    j += 1
                out.append(_ansi(row[i], ("·" if row[i] == "." else "█") * (j - i)))
                i = j
            lines.append("".join(out))
        else:
            lines.append(row)
    if colour:
        lines.append("  ".join(_ansi(c, "·" if c == "." else "█") + f" {name}" for c, name in CELL_NAMES.items()))
    else:
        lines.append("  ".join(f"{c} {name}" for c, name in CELL_NAMES.items()))
    lines.append(figures_line(m))
    return "\n".join(lines)


# ----- pictures -------------------------------------------------------------------------


def layout(m: dict[str, Any]) -> dict[str, int]:
    """Where the cells are in the picture: cell (c, r) is the square at
    left + c * cell_pixels, top + r * cell_pixels."""
    px = cell_pixels(m)
    left = MARGIN + (LABEL_PX if m["rows"] > 1 else 0)
    return {"left": left, "top": MARGIN + 2 * LINE_PX, "cell_pixels": px, "columns": m["columns"], "rows": m["rows"]}


def _legend(m: dict[str, Any]) -> list[tuple[str, str]]:
    return [(code, name) for code, name in CELL_NAMES.items()]


def write_svg(path: str, pool: str, m: dict[str, Any]) -> dict[str, int]:
    """An SVG of the map: one <rect> per run of equal cells in a row (data-first-cell
    and data-cells say which), a legend and the figures. Returns the layout."""
    box = layout(m)
    px, left, top = box["cell_pixels"], box["left"], box["top"]
    shown = min(m["columns"], len(m["cells"]))
    map_h = m["rows"] * px
    legend_y = top + map_h + LINE_PX
    width = max(left + shown * px + MARGIN, 760)
    height = legend_y + 2 * LINE_PX + MARGIN
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}"'
        f' font-family="sans-serif" font-size="{FONT_PX}" data-layout=\'{json.dumps(box)}\'>',
        f"<title>{escape(headline(pool, m))}</title>",
        f'<rect class="background" width="{width}" height="{height}" fill="rgb{BACKGROUND}"/>',
        f'<text x="{left}" y="{MARGIN + FONT_PX}" fill="rgb{INK}">{escape(headline(pool, m))}</text>',
        f'<text x="{left}" y="{MARGIN + LINE_PX + FONT_PX}" fill="rgb{INK}">{escape(figures_line(m))}</text>',
        '<g id="map" shape-rendering="crispEdges">',
    ]
    for r, row in enumerate(_rows(m)):
        c = 0
        while c < len(row):
            end = c
            while end < len(row) and row[end] == row[c]:
                end += 1
            rgb, _, cls = PALETTE[row[c]]
            out.append(
                f'<rect class="{cls}" x="{left + c * px}" y="{top + r * px}" width="{(end - c) * px}" height="{px}"'
                f' fill="rgb{rgb}" data-first-cell="{r * m["columns"] + c}" data-cells="{end - c}"/>'
            )
            c = end
    out.append("</g>")
    for r, label in row_labels(m):
        out.append(
            f'<text class="offset" x="{left - 6}" y="{top + r * px + FONT_PX - 3}" text-anchor="end"'
            f' fill="rgb{INK}">{label}</text>'
        )
    out.append('<g id="legend">')
    x = left
    for code, name in _legend(m):
        rgb, _, cls = PALETTE[code]
        out.append(
            f'<rect class="legend {cls}" x="{x}" y="{legend_y}" width="{FONT_PX}" height="{FONT_PX}" fill="rgb{rgb}"'
            ' stroke="#718096"/>'
        )
        out.append(f'<text x="{x + FONT_PX + 4}" y="{legend_y + FONT_PX - 2}" fill="rgb{INK}">{escape(name)}</text>')
        x += FONT_PX + 12 + 8 * len(name)
    out.append("</g></svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    return box


def write_png(path: str, pool: str, m: dict[str, Any]) -> dict[str, int]:
    """A PNG of the map (Pillow), laid out as the SVG; the layout goes in its
    "thinblock-map" text chunk too. Returns the layout."""
    try:
        from PIL import Image, ImageDraw, ImageFont, PngImagePlugin
    except ImportError:
        raise ThinblockError(
            "a PNG map needs Pillow (pip install pillow, or apt-get install python3-pil); an .svg map needs nothing"
        ) from None
    box = layout(m)
    px, left, top = box["cell_pixels"], box["left"], box["top"]
    font = ImageFont.load_default(size=FONT_PX)
    title, figs = headline(pool, m), figures_line(m)
    shown = min(m["columns"], len(m["cells"]))
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    legend_w = sum(FONT_PX + 20 + probe.textlength(name, font=font) for _, name in _legend(m))
    text_w = max(probe.textlength(title, font=font), probe.textlength(figs, font=font), legend_w)
    width = int(max(left + shown * px, left + text_w) + MARGIN)
    legend_y = top + m["rows"] * px + LINE_PX // 2
    height = legend_y + LINE_PX + MARGIN
    # The cells first, one pixel each, then scaled up by whole pixels: no blur, and fast.
    cells = Image.new("RGB", (shown, m["rows"]), PALETTE["."][0])
    cells.putdata([PALETTE[code][0] for code in m["cells"]])
    image = Image.new("RGB", (width, height), BACKGROUND)
    image.paste(cells.resize((shown * px, m["rows"] * px), Image.Resampling.NEAREST), (left, top))
    if len(m["cells"]) % shown:  # the last row's cells after the volume's end: background
        end = len(m["cells"]) % shown
        r = m["rows"] - 1
        ImageDraw.Draw(image).rectangle(
            (left + end * px, top + r * px, left + shown * px - 1, top + (r + 1) * px - 1), fill=BACKGROUND
        )
    draw = ImageDraw.Draw(image)
    for r, label in row_labels(m):
        draw.text((left - 6, top + r * px), label, fill=INK, font=font, anchor="ra")
    draw.text((left, MARGIN), title, fill=INK, font=font)
    draw.text((left, MARGIN + LINE_PX), figs, fill=INK, font=font)
    x = float(left)
    for code, name in _legend(m):
        draw.rectangle((x, legend_y, x + FONT_PX, legend_y + FONT_PX), fill=PALETTE[code][0], outline=(113, 128, 150))
        draw.text((x + FONT_PX + 4, legend_y), name, fill=INK, font=font)
        x += FONT_PX + 20 + draw.textlength(name, font=font)
    info = PngImagePlugin.PngInfo()
    info.add_text("thinblock-map", json.dumps(box))
    info.add_text("Title", title)
    image.save(path, "PNG", pnginfo=info)
    return box


# ----- the pool's space bar -----------------------------------------------------------


def space_bar(status: dict[str, Any], width: int, colour: bool) -> str:
    """One line: used, reserved (set aside, not yet used) and free space of the pool."""
    size = max(1, status["size_bytes"])
    used = status["used_bytes"]
    reserved = min(status["reserved_bytes"], max(0, size - used))
    free = max(0, size - used - reserved)
    n_used = round(width * used / size)
    n_reserved = min(width - n_used, round(width * reserved / size))
    if used and not n_used:
        n_used = 1  # a little used space still shows
    n_free = max(0, width - n_used - n_reserved)
    # (plain, on a terminal, its colour): the shapes differ too, for eyes that miss the colours
    parts = [("#", "█", 160, n_used), ("+", "▒", 214, n_reserved), ("-", "░", 250, n_free)]
    if colour:
        bar = "".join(f"\x1b[38;5;{ansi}m{shape * n}\x1b[0m" for _, shape, ansi, n in parts if n)
    else:
        bar = "".join(plain * n for plain, _, _, n in parts)
    return (
        f"[{bar}] used {format_size(used)} ({100 * used / size:.0f}%), reserved {format_size(reserved)},"
        f" free {format_size(free)}"
    )
