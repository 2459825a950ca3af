"""A plain in-memory model of volumes: their bytes and the expected block states.

It is written from docs/architecture.md's block contract directly, block by block, with
no knowledge of pages, dblocks or the implementation's planning code.

Snapshots are byte copies. Sharing is modelled by a token per mapped block:
a snapshot copies the tokens, a block needs a fresh token (a new data block)
when it has none or another volume holds the same token, and the pool's used
space is the number of distinct tokens. Reservations follow the ZFS rule: a
volume with R reserved blocks has R minus the blocks it holds alone set aside.
"""

from __future__ import annotations

import copy
import errno
import itertools
from collections import Counter
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
    tokens: list[int | None] = field(default_factory=list)
    kind: str = "volume"
    origin: str | None = None
    reserve: int = 0  # bytes; -1 = the whole size

    def __post_init__(self) -> None:
        self.data = bytearray(self.size)
        n = -(-self.size // self.block_size)
        self.states = [UNMAPPED] * n
        self.pinned = [False] * n
        self.tokens = [None] * n

    def reserve_blocks(self) -> int:
        r = self.size if self.reserve == -1 else self.reserve
        return -(-r // self.block_size)

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
        self._tokens = itertools.count(1)

    # ----- sharing and space ------------------------------------------------------

    def holders(self) -> Counter[int]:
        return Counter(t for v in self.volumes.values() for t in v.tokens if t is not None)

    def used(self) -> int:
        return len(self.holders())

    def free(self) -> int:
        return self.pool_blocks - self.used()

    def exclusive(self, name: str) -> int:
        held = self.holders()
        return sum(1 for t in self.volumes[name].tokens if t is not None and held[t] == 1)

    def shared(self, name: str) -> int:
        return self.volumes[name].mapped() - self.exclusive(name)

    def set_aside(self, name: str) -> int:
        v = self.volumes[name]
        return max(0, v.reserve_blocks() - self.exclusive(name)) if v.reserve else 0

    def reserved(self) -> int:
        return sum(self.set_aside(n) for n in self.volumes)

    def _needs_token(self, v: ModelVolume, b: int) -> bool:
        t = v.tokens[b]
        return t is None or self.holders()[t] > 1

    def _need(self, n: int, name: str | None = None) -> None:
        others = self.reserved() - (self.set_aside(name) if name else 0)
        if n > self.free() - others:
            raise ModelError(errno.ENOSPC)

    def _check_reservable(self, name: str, new_set_aside: int, freed: int = 0) -> None:
        if new_set_aside - self.set_aside(name) > self.free() + freed - self.reserved():
            raise ModelError(errno.ENOSPC)

    def _fresh(self, v: ModelVolume, blocks: list[int]) -> None:
        for b in blocks:
            v.tokens[b] = next(self._tokens)

    # ----- lineage ----------------------------------------------------------------

    def snapshot(self, source: str, name: str) -> None:
        v = self.volumes[source]
        if v.reserve:
            self._check_reservable(source, v.reserve_blocks())
        snap = copy.deepcopy(v)
        snap.kind, snap.reserve, snap.origin = "snapshot", 0, source
        self.volumes[name] = snap

    def clone(self, snapshot: str, name: str) -> None:
        c = copy.deepcopy(self.volumes[snapshot])
        c.kind, c.origin = "volume", snapshot
        self.volumes[name] = c

    def remove(self, name: str) -> None:
        del self.volumes[name]
        for v in self.volumes.values():
            if v.origin == name:
                v.origin = None

    def ancestors(self, name: str) -> set[str]:
        seen = {name}
        origin = self.volumes[name].origin
        while origin is not None and origin not in seen:
            seen.add(origin)
            origin = self.volumes[origin].origin
        return seen

    def related(self, name: str, snapshot: str) -> bool:
        return name in self.ancestors(snapshot) or snapshot in self.ancestors(name)

    def rollback(self, name: str, snapshot: str) -> None:
        v, s = self.volumes[name], self.volumes[snapshot]
        if v.reserve:
            r = s.size if v.reserve == -1 else v.reserve
            self._check_reservable(name, -(-r // self.block_size), freed=self.exclusive(name))
        for attr in ("size", "data", "states", "pinned", "tokens"):
            setattr(v, attr, copy.deepcopy(getattr(s, attr)))

    def set_reserve(self, name: str, reserve: int) -> None:
        v = self.volumes[name]
        old, v.reserve = v.reserve, reserve
        target = self.set_aside(name)
        v.reserve = old
        self._check_reservable(name, target)
        v.reserve = reserve

    # ----- the block contract -----------------------------------------------------

    def write(self, name: str, offset: int, payload: bytes) -> None:
        v = self.volumes[name]
        actions = []
        need = 0
        for b, s, e in v.segments(offset, len(payload)):
            piece = payload[b * v.block_size + s - offset : b * v.block_size + e - offset]
            zero = v.detect != "off" and not any(piece)
            if zero and v.states[b] != DATA:
                continue
            if zero and v.full(b, s, e) and v.detect == "unmap" and not v.pinned[b]:
                actions.append((b, "unmap", False))
                continue
            fresh = self._needs_token(v, b)
            need += fresh
            actions.append((b, "zeroed" if zero and v.full(b, s, e) else "data", fresh))
        self._need(need, name)
        v.data[offset : offset + len(payload)] = payload
        self._fresh(v, [b for b, _a, fresh in actions if fresh])
        for b, action, _fresh in actions:
            if action == "unmap":
                v.states[b], v.pinned[b], v.tokens[b] = UNMAPPED, False, None
            elif action == "zeroed":
                v.states[b] = ZEROED
            else:
                v.states[b] = DATA

    def zero_or_trim(self, name: str, offset: int, length: int, no_hole: bool, fast: bool) -> None:
        v = self.volumes[name]
        segs = v.segments(offset, length)
        if fast and any(v.states[b] == DATA and not v.full(b, s, e) for b, s, e in segs):
            raise ModelError(errno.ENOTSUP)
        fresh = [
            b for b, s, e in segs if (v.states[b] == DATA and not v.full(b, s, e)) or no_hole if self._needs_token(v, b)
        ]
        self._need(len(fresh), name)
        self._fresh(v, fresh)
        for b, s, e in segs:
            if v.states[b] == DATA and not v.full(b, s, e):
                pass  # zeroed (in place, or in a copy when shared), stays DATA
            elif no_hole:
                v.states[b], v.pinned[b] = ZEROED, True
            elif v.full(b, s, e):
                v.states[b], v.pinned[b], v.tokens[b] = UNMAPPED, False, None
        v.data[offset : offset + length] = bytes(length)

    def provision(self, name: str, offset: int, length: int) -> None:
        v = self.volumes[name]
        segs = v.segments(offset, length)
        fresh = [b for b, _s, _e in segs if self._needs_token(v, b)]
        self._need(len(fresh), name)
        self._fresh(v, fresh)
        for b, _s, _e in segs:
            if v.states[b] == UNMAPPED:
                v.states[b] = ZEROED
            v.pinned[b] = True

    def sparsify(self, name: str, offset: int, length: int) -> None:
        """Whole DATA blocks reading all zero that the volume holds alone stop holding
        data: ZEROED if provisioned, else UNMAPPED. Shared ones stay. Bytes unchanged."""
        v = self.volumes[name]
        held = self.holders()
        for b, s, e in v.segments(offset, length):
            block = v.data[b * v.block_size : min((b + 1) * v.block_size, v.size)]
            if v.states[b] != DATA or not v.full(b, s, e) or any(block):
                continue
            t = v.tokens[b]
            if t is None or held[t] > 1:
                continue
            if v.pinned[b]:
                v.states[b] = ZEROED
            else:
                v.states[b], v.tokens[b] = UNMAPPED, None

    def resize(self, name: str, size: int) -> None:
        v = self.volumes[name]
        if v.reserve == -1 and size > v.size:
            extra = -(-size // self.block_size) - -(-v.size // self.block_size)
            self._check_reservable(name, self.set_aside(name) + extra)
        if size < v.size:
            self.zero_or_trim(name, size, v.size - size, no_hole=False, fast=False)
            del v.data[size:]
        else:
            v.data.extend(bytes(size - v.size))
        n = -(-size // v.block_size)
        v.states = (v.states + [UNMAPPED] * n)[:n]
        v.pinned = (v.pinned + [False] * n)[:n]
        v.tokens = (v.tokens + [None] * n)[:n]
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

    def guaranteed(self, name: str, offset: int, length: int) -> list[tuple[int, bool]]:
        """Writes never fail for space: mapped blocks of a writable volume whose
        reservation covers its whole size."""
        v = self.volumes[name]
        covered = v.kind == "volume" and v.reserve != 0 and v.reserve_blocks() >= len(v.states)
        runs: list[list[int | bool]] = []
        for b, s, e in v.segments(offset, length):
            sure = covered and v.states[b] != UNMAPPED
            if runs and runs[-1][1] == sure:
                runs[-1][0] += e - s
            else:
                runs.append([e - s, sure])
        return [(int(n), bool(g)) for n, g in runs]
