"""A plain in-memory model of volumes: their bytes and the expected block states.

It is written from DESIGN.md's block contract directly, block by block, with
no knowledge of pages, dblocks or the implementation's planning code.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field

UNMAPPED, ZEROED, DATA = 0, 1, 2


class ModelError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@dataclass
class ModelVolume:
    size: int
    block_size: int
    detect: str = "on"
    data: bytearray = field(default_factory=bytearray)
    states: list[int] = field(default_factory=list)
    pinned: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.data = bytearray(self.size)
        n = -(-self.size // self.block_size)
        self.states = [UNMAPPED] * n
        self.pinned = [False] * n

    def segments(self, offset: int, length: int) -> list[tuple[int, int, int]]:
        """(block, start_in_block, end_in_block) for each touched block."""
        out = []
        pos, end = offset, offset + length
        while pos < end:
            b = pos // self.block_size
            base = b * self.block_size
            stop = min(end, base + self.block_size)
            out.append((b, pos - base, stop - base))
            pos = stop
        return out

    def full(self, b: int, start: int, end: int) -> bool:
        """Covered entirely; the last, partial block counts up to the volume's end."""
        return start == 0 and (end == self.block_size or b * self.block_size + end == self.size)

    def mapped(self) -> int:
        return sum(1 for s in self.states if s != UNMAPPED)


class Model:
    def __init__(self, pool_blocks: int, block_size: int) -> None:
        self.pool_blocks = pool_blocks
        self.block_size = block_size
        self.volumes: dict[str, ModelVolume] = {}

    def used(self) -> int:
        return sum(v.mapped() for v in self.volumes.values())

    def free(self) -> int:
        return self.pool_blocks - self.used()

    def _need(self, n: int) -> None:
        if n > self.free():
            raise ModelError(errno.ENOSPC)

    def write(self, name: str, offset: int, payload: bytes) -> None:
        v = self.volumes[name]
        actions = []
        need = 0
        for b, s, e in v.segments(offset, len(payload)):
            piece = payload[b * v.block_size + s - offset : b * v.block_size + e - offset]
            zero = v.detect != "off" and not any(piece)
            if zero and v.states[b] != DATA:
                continue
            if zero and v.full(b, s, e):
                actions.append((b, "unmap" if v.detect == "unmap" and not v.pinned[b] else "zeroed"))
                continue
            need += v.states[b] == UNMAPPED
            actions.append((b, "data"))
        self._need(need)
        v.data[offset : offset + len(payload)] = payload
        for b, action in actions:
            if action == "unmap":
                v.states[b], v.pinned[b] = UNMAPPED, False
            elif action == "zeroed":
                v.states[b] = ZEROED
            else:
                v.states[b] = DATA

    def zero_or_trim(self, name: str, offset: int, length: int, no_hole: bool, fast: bool) -> None:
        v = self.volumes[name]
        segs = v.segments(offset, length)
        if fast and any(v.states[b] == DATA and not v.full(b, s, e) for b, s, e in segs):
            raise ModelError(errno.ENOTSUP)
        if no_hole:
            self._need(sum(1 for b, _s, _e in segs if v.states[b] == UNMAPPED))
        for b, s, e in segs:
            if v.states[b] == DATA and not v.full(b, s, e):
                pass  # zeroed in place, stays DATA
            elif no_hole:
                v.states[b], v.pinned[b] = ZEROED, True
            elif v.full(b, s, e):
                v.states[b], v.pinned[b] = UNMAPPED, False
        v.data[offset : offset + length] = bytes(length)

    def provision(self, name: str, offset: int, length: int) -> None:
        v = self.volumes[name]
        segs = v.segments(offset, length)
        self._need(sum(1 for b, _s, _e in segs if v.states[b] == UNMAPPED))
        for b, _s, _e in segs:
            if v.states[b] == UNMAPPED:
                v.states[b] = ZEROED
            v.pinned[b] = True

    def resize(self, name: str, size: int) -> None:
        v = self.volumes[name]
        if size < v.size:
            self.zero_or_trim(name, size, v.size - size, no_hole=False, fast=False)
            del v.data[size:]
        else:
            v.data.extend(bytes(size - v.size))
        n = -(-size // v.block_size)
        v.states = (v.states + [UNMAPPED] * n)[:n]
        v.pinned = (v.pinned + [False] * n)[:n]
        v.size = size

    def block_status(self, name: str, offset: int, length: int) -> list[tuple[int, int]]:
        v = self.volumes[name]
        runs: list[list[int]] = []
        for b, s, e in v.segments(offset, length):
            if runs and runs[-1][1] == v.states[b]:
                runs[-1][0] += e - s
            else:
                runs.append([e - s, v.states[b]])
        return [(n, st) for n, st in runs]
