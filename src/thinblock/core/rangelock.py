"""Shared and exclusive locks on ranges of one volume's blocks.

The pool lock is held only to plan and to publish; the data I/O of a request
runs outside it. What keeps two requests from interfering while their I/O is in
flight is this lock, taken before the pool lock and held until the request has
published: a mutating request holds its blocks exclusively, a read shares them.
So a block a read is copying from cannot be remapped, freed and reused under
it, and two writes to one block land in the order they publish.

Waiters are served in arrival order among those that conflict (a request never
overtakes an earlier one it overlaps), so a whole-volume holder such as a
snapshot is not starved by a stream of small requests.
"""

from __future__ import annotations

import contextlib
import threading

WHOLE = (0, (1 << 63) - 1)  # every block of any volume


class _Ticket:
    """One holder or waiter; also the context manager `hold` returns."""

    __slots__ = ("exclusive", "hi", "lo", "owner")

    def __init__(self, owner: RangeLock, lo: int, hi: int, exclusive: bool) -> None:
        self.owner, self.lo, self.hi, self.exclusive = owner, lo, hi, exclusive

    def conflicts(self, other: _Ticket) -> bool:
        return (self.exclusive or other.exclusive) and self.lo <= other.hi and other.lo <= self.hi

    def __enter__(self) -> None:
        self.owner._enter(self)

    def __exit__(self, *exc: object) -> None:
        self.owner._exit(self)


class RangeLock:
    """Locks on inclusive ranges [lo, hi] of block numbers."""

    def __init__(self) -> None:
        # The fast path takes the plain lock (C); the condition is used only to wait, and
        # made by the first wait: a pool opens with one RangeLock per volume, and a
        # Condition costs as much to make as the rest of a Volume.
        self._mutex = threading.Lock()
        self._cond: threading.Condition | None = None
        self._tickets: list[_Ticket] = []  # held and waiting, in arrival order
        self._waiting = 0

    def _may_go(self, ticket: _Ticket) -> bool:
        for other in self._tickets:
            if other is ticket:
                return True
            if ticket.conflicts(other):
                return False
        return True

    def hold(self, lo: int, hi: int, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        """`with lock.hold(lo, hi, exclusive=...):` the blocks lo..hi, shared or not."""
        return _Ticket(self, lo, hi, exclusive)

    def _enter(self, ticket: _Ticket) -> None:
        with self._mutex:
            self._tickets.append(ticket)
            if not self._may_go(ticket):
                self._waiting += 1
                if self._cond is None:
                    self._cond = threading.Condition(self._mutex)
                while not self._may_go(ticket):
                    self._cond.wait()
                self._waiting -= 1

    def _exit(self, ticket: _Ticket) -> None:
        with self._mutex:
            self._tickets.remove(ticket)
            if self._waiting:
                assert self._cond is not None  # made by the waiter, under the same mutex
                self._cond.notify_all()

    def hold_all(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        """The whole volume: waits for every request in flight that conflicts."""
        return self.hold(*WHOLE, exclusive=exclusive)
