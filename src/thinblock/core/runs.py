"""The one run merger: (length, key) runs with equal neighbours joined.

Block status, allocation and data views, and the data-store ranges of a
request are all runs; they are built by appending to a `Runs` list.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Runs(Generic[K]):
    """(length, key) runs in order; `add` joins a run to the last when their keys are equal."""

    __slots__ = ("items",)

    def __init__(self, items: Iterable[tuple[int, K]] = ()) -> None:
        self.items: list[list[int | K]] = []
        for n, key in items:
            self.add(n, key)

    def add(self, length: int, key: K) -> None:
        if not length:
            return
        last = self.items[-1] if self.items else None
        if last is not None and last[1] == key:
            last[0] += length  # type: ignore[operator]
        else:
            self.items.append([length, key])

    def pairs(self) -> list[tuple[int, K]]:
        return [(n, key) for n, key in self.items]  # type: ignore[misc]


def add_range(ranges: list[list[int]], offset: int, length: int) -> None:
    """Append [offset, length] to a list of byte ranges, joined with the last when contiguous."""
    last = ranges[-1] if ranges else None
    if last is not None and last[0] + last[1] == offset:
        last[1] += length
    else:
        ranges.append([offset, length])
