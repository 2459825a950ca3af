"""The one place where a data store's missing operation is emulated.

punch -> zero-range -> written zeros; zero-range -> written zeros; allocate ->
written zeros. What the inner store declares NONE is emulated without asking
it; a NATIVE operation that the layer below refuses after all (NotSupportedError)
is emulated too, and the inner store declares it NONE from then on.
"""

from __future__ import annotations

from thinblock.errors import NotSupportedError
from thinblock.store.base import OPTIONAL_VERBS, FilterStore, Support
from thinblock.zeros import ZERO_CHUNK_BYTES, zero_bytes


class FallbackStore(FilterStore):
    """A filter over another store that emulates what it lacks."""

    def _native(self, verb: str) -> bool:
        return self.inner.capabilities().get(verb) is Support.NATIVE

    def _write_zeros(self, offset: int, length: int) -> None:
        end = offset + length
        while offset < end:
            n = min(ZERO_CHUNK_BYTES, end - offset)
            self.inner.pwritev(offset, [zero_bytes(n)])
            offset += n

    def punch(self, offset: int, length: int) -> None:
        if self._native("punch"):
            try:
                self.inner.punch(offset, length)
                return
            except NotSupportedError:
                pass
        self.zero(offset, length)

    def zero(self, offset: int, length: int) -> None:
        if self._native("zero"):
            try:
                self.inner.zero(offset, length)
                return
            except NotSupportedError:
                pass
        self._write_zeros(offset, length)

    def allocate(self, offset: int, length: int) -> None:
        if self._native("allocate"):
            try:
                self.inner.allocate(offset, length)
                return
            except NotSupportedError:
                pass
        # Callers allocate only space whose contents do not matter yet.
        self._write_zeros(offset, length)

    def capabilities(self) -> dict[str, Support]:
        inner = self.inner.capabilities()
        return {
            verb: Support.NATIVE if inner.get(verb) is Support.NATIVE else Support.EMULATE for verb in OPTIONAL_VERBS
        }
