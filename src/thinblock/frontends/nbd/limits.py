"""Who may hold an NBD connection slot: the admission rules, in one place.

Before a client has authenticated, a connection costs the server a slot, a
thread and memory, so whoever can reach the socket could otherwise hold every
slot by connecting and saying nothing (issue 21: 300 silent TCP sockets let 2 of
30 real clients in). The rules:

- at most `max_connections` connections in all (the existing cap);
- per source address, at most `max_connections_per_address` connections, and at
  most `max_negotiating_per_address` still negotiating (not yet in transmission);
- per TLS client certificate (its whole subject), at most
  `max_connections_per_identity` connections, counted once the TLS handshake
  has shown the certificate;
- a connection that has not sent a single byte may be displaced: a newcomer
  that would pass a limit takes the slot of the oldest silent connection within
  that limit's scope (the same address for the per-address limits, any for the
  global one). So silent sockets only ever displace each other, and a client that
  speaks at once (every real client sends its flags right after the greeting)
  keeps its slot; only when no silent connection is there is the newcomer refused.

"Silent" is decided race-free: a session waits for its first byte with a peek
(the byte stays in the kernel) and then calls `heard`, and a connection is
displaced only if it has not been heard and its socket has nothing to read.

Unix-socket peers have no address: they count towards `max_connections` (and may
be displaced while silent) but not per address. That socket is the pool owner's
(0600, or a group the owner chose), and whoever may connect to it may already use
every volume; a per-uid limit would only get in the way of a host serving many
VMs as one user.

This module does no I/O itself: occupants say whether their socket is readable
and hang up when told (the socket shell's Session).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

SILENT, TALKING, SERVING = 0, 1, 2  # a slot's stage: no byte yet, negotiating, transmission


class Refusal(str):
    """Why a connection is refused (a sentence for the client), and which limit it
    met (the option's name without dashes, e.g. max-connections: a metrics label)."""

    limit: str

    def __new__(cls, message: str, limit: str) -> Refusal:
        self = super().__new__(cls, message)
        self.limit = limit
        return self


@dataclass(frozen=True)
class AdmissionLimits:
    max_connections: int = 256
    max_negotiating_per_address: int = 16
    max_connections_per_address: int = 64
    max_connections_per_identity: int = 64


class Occupant(Protocol):
    """What a slot's holder must do for the rules: say whether its peer has sent
    bytes not yet read, and hang up (from another thread) when displaced."""

    def readable(self) -> bool: ...

    def displace(self) -> None: ...


class Slot:
    """One admitted connection's place; its stage only moves forward."""

    __slots__ = ("address", "displaced", "identity", "occupant", "stage")

    def __init__(self, address: str | None, occupant: Occupant) -> None:
        self.address = address
        self.occupant = occupant
        self.identity: str | None = None
        self.stage = SILENT
        self.displaced = False


class Admission:
    """The slots of one server; every method is thread-safe."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._slots: OrderedDict[Slot, None] = OrderedDict()  # oldest first
        self._by_address: dict[str, OrderedDict[Slot, None]] = {}
        self._by_identity: dict[str, int] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def admit(self, address: str | None, occupant: Occupant) -> Slot | Refusal:
        """A slot for a new connection, or why it is refused (a sentence for the client).
        May displace the oldest silent connection within the limit that is reached."""
        lim = self.limits
        victim = None
        with self._lock:
            mine = self._by_address.get(address) if address is not None else None
            reason = limit = None
            scope: OrderedDict[Slot, None] | None = None
            if mine is not None and len(mine) >= lim.max_connections_per_address:
                reason = (
                    f"this address already holds {lim.max_connections_per_address} connections,"
                    " the limit (--max-connections-per-address)"
                )
                limit = "max-connections-per-address"
                scope = mine
            elif mine is not None and sum(s.stage < SERVING for s in mine) >= lim.max_negotiating_per_address:
                reason = (
                    f"this address already has {lim.max_negotiating_per_address} connections negotiating,"
                    " the limit (--max-negotiating-per-address)"
                )
                limit = "max-negotiating-per-address"
                scope = mine
            elif len(self._slots) >= lim.max_connections:
                reason = f"the server holds {lim.max_connections} connections, the limit (--max-connections)"
                limit = "max-connections"
                scope = self._slots
            if scope is not None:
                victim = next((s for s in scope if s.stage == SILENT and not s.occupant.readable()), None)
                if victim is None:
                    return Refusal(f"{reason}; try again later", limit or "")
                victim.displaced = True
                self._remove(victim)
            slot = Slot(address, occupant)
            self._slots[slot] = None
            if address is not None:
                self._by_address.setdefault(address, OrderedDict())[slot] = None
        if victim is not None:
            victim.occupant.displace()
        return slot

    def heard(self, slot: Slot) -> bool:
        """The connection's first byte arrived (and is still unread): it can no longer be
        displaced. False if it was displaced first: then it must close."""
        with self._lock:
            if slot.displaced:
                return False
            slot.stage = max(slot.stage, TALKING)
            return True

    def serving(self, slot: Slot) -> None:
        """Negotiation is over: the connection no longer counts as negotiating."""
        with self._lock:
            slot.stage = SERVING

    def claim_identity(self, slot: Slot, identity: str) -> Refusal | None:
        """Count the connection against its client certificate; why not, if that
        certificate already holds its limit (the connection is then refused)."""
        limit = self.limits.max_connections_per_identity
        with self._lock:
            if slot.identity is not None or slot.displaced:
                return None
            held = self._by_identity.get(identity, 0)
            if held >= limit:
                return Refusal(
                    f"this client certificate already holds {limit} connections,"
                    " the limit (--max-connections-per-identity); try again later",
                    "max-connections-per-identity",
                )
            self._by_identity[identity] = held + 1
            slot.identity = identity
            return None

    def release(self, slot: Slot) -> None:
        """The connection is gone (idempotent; a displaced slot was released already)."""
        with self._lock:
            if slot in self._slots:
                self._remove(slot)

    def _remove(self, slot: Slot) -> None:
        del self._slots[slot]
        if slot.address is not None:
            mine = self._by_address[slot.address]
            del mine[slot]
            if not mine:
                del self._by_address[slot.address]
        if slot.identity is not None:
            left = self._by_identity[slot.identity] - 1
            if left:
                self._by_identity[slot.identity] = left
            else:
                del self._by_identity[slot.identity]


def certificate_identity(cert: object) -> str | None:
    """A client certificate's identity for the per-certificate limit: its whole subject
    (every attribute, in order), or None without a certificate."""
    if not isinstance(cert, dict) or not cert.get("subject"):
        return None
    return ",".join(f"{key}={value}" for rdn in cert["subject"] for key, value in rdn)
