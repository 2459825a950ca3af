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
from collections.abc import Iterator

WHOLE = (0, (1 << 63) - 1)  # every block of any volume


class _Ticket:
    __slots__ = ("exclusive", "granted", "hi", "lo")

    def __init__(self, lo: int, hi: int, exclusive: bool) -> None:
        self.lo, self.hi, self.exclusive = lo, hi, exclusive
        self.granted = False

    def conflicts(self, other: _Ticket) -> bool:
        return (self.exclusive or other.exclusive) and self.lo <= other.hi and other.lo <= self.hi


class RangeLock:
    """Locks on inclusive ranges [lo, hi] of block numbers."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._tickets: list[_Ticket] = []  # held and waiting, in arrival order

    def _may_go(self, ticket: _Ticket) -> bool:
        for other in self._tickets:
            if other is ticket:
                return True
            if ticket.conflicts(other):
                return False
        return True

    @contextlib.contextmanager
    def hold(self, lo: int, hi: int, *, exclusive: bool) -> Iterator[None]:
        ticket = _Ticket(lo, hi, exclusive)
        with self._cond:
            self._tickets.append(ticket)
            while not self._may_go(ticket):
                self._cond.wait()
            ticket.granted = True
        try:
            yield
        finally:
            with self._cond:
                self._tickets.remove(ticket)
                if self._tickets:
                    self._cond.notify_all()

    def hold_all(self, *, exclusive: bool) -> contextlib.AbstractContextManager[None]:
        """The whole volume: waits for every request in flight that conflicts."""
        return self.hold(*WHOLE, exclusive=exclusive)

    def busy(self) -> bool:
        with self._cond:
            return bool(self._tickets)
