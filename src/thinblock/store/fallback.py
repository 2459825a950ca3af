"""The one place where a data store's missing operation is emulated.

punch -> zero-range -> written zeros; zero-range -> written zeros; preallocate ->
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

    def _try_native(self, verb: str, offset: int, length: int) -> bool:
        """Run the inner store's verb if it declares it NATIVE; False when it cannot."""
        if not self._native(verb):
            return False
        try:
            getattr(self.inner, verb)(offset, length)
        except NotSupportedError:
            return False
        return True

    def punch(self, offset: int, length: int) -> None:
        if not self._try_native("punch", offset, length):
            self.zero(offset, length)

    def zero(self, offset: int, length: int) -> None:
        if not self._try_native("zero", offset, length):
            self._write_zeros(offset, length)

    def preallocate(self, offset: int, length: int) -> None:
        # Callers preallocate only space whose contents do not matter yet.
        if not self._try_native("preallocate", offset, length):
            self._write_zeros(offset, length)

    def capabilities(self) -> dict[str, Support]:
        inner = self.inner.capabilities()
        return {
            verb: Support.NATIVE if inner.get(verb) is Support.NATIVE else Support.EMULATE for verb in OPTIONAL_VERBS
        }
