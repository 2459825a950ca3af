"""Who may use which export over TLS: an authorisation list of client certificates.

`serve --tls-ca CA --tls-authz FILE` (like qemu-nbd's tls-authz objects): a
client certificate signed by the CA gets in only if its subject has exactly one
common name and that name has a rule, and then only to the exports the rule
names, read-write or read-only. The file, one rule per line (`#` starts a
comment; lines end at "\\n" only, words are split at spaces and tabs only):

    NAME  rw|ro  EXPORT[,EXPORT...]|*

The rules decide everything a client learns about exports, in one place here:
- a client with no grant (no rule, or an ambiguous certificate) is refused every
  option with NBD_REP_ERR_POLICY, whatever name it asks for;
- a name outside a client's grant is answered exactly as a name that does not
  exist (NBD_REP_ERR_UNKNOWN, same text), so nobody can probe which names exist;
- the metadata contexts `thinblock:changed:SNAP` are offered and usable only for
  a snapshot the client may use, or whose origin it may use;
- `serve` re-reads the file on SIGHUP (Authz.load again) and ends the connections
  that lost their grant (GrantedCatalog.lost).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from thinblock.errors import ThinblockError
from thinblock.frontends.nbd.protocol import ExportCatalog, ExportInfo, ExportRefused
from thinblock.logtext import shown

log = logging.getLogger("thinblock.nbd")


@dataclass(frozen=True)
class Grant:
    exports: frozenset[str] | None  # None: every export
    read_only: bool

    def allows(self, export: str) -> bool:
        return self.exports is None or export in self.exports


@dataclass(frozen=True)
class Identity:
    """Who a client certificate names: its one common name, or why it names nobody."""

    name: str
    problem: str | None = None  # set: the certificate is refused whatever the rules say

    @property
    def shown(self) -> str:
        return shown(self.name) if self.name else "(no common name)"


def identity(cert: Mapping[str, Any] | None) -> Identity:
    """The certificate subject's common name. A subject with several (as separate RDNs,
    `/CN=a/CN=b`, or one multi-valued RDN, `/CN=a+CN=b`) is ambiguous: which one
    counts would be an accident of the parser, so it names nobody."""
    subject = cert.get("subject", ()) if cert else ()
    names = [
        str(value)
        for rdn in (subject if isinstance(subject, tuple) else ())
        for key, value in rdn
        if key == "commonName"
    ]
    if len(names) > 1:
        listed = ", ".join(f"'{shown(n)}'" for n in names)
        return Identity("+".join(names), f"has {len(names)} common names ({listed}): an ambiguous identity is refused")
    return Identity(names[0] if names else "")


@dataclass(frozen=True)
class Authz:
    rules: dict[str, Grant]
    path: str

    @classmethod
    def load(cls, path: str) -> Authz:
        """Read and check the file; a warning if others could rewrite it. Any problem is
        a ThinblockError of one sentence (at start: exit 1; on reload: old rules kept)."""
        try:
            # O_NONBLOCK: a FIFO put there must not hang the open (and with it SIGHUP's
            # reload and every later signal); the S_ISREG check below refuses it.
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise ThinblockError(f"--tls-authz {path} is not a regular file")
                data = f.read()
        except OSError as exc:
            raise ThinblockError(f"cannot read --tls-authz {path}: {exc.strerror}") from None
        warn_if_writable_by_others(path, st)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ThinblockError(
                f"--tls-authz {path} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})"
            ) from None
        return cls(parse_rules(text, path), path)

    def client(self, cert: Mapping[str, Any] | None) -> tuple[Identity, Grant | None]:
        """Who the certificate names and its grant (None: refused everything)."""
        who = identity(cert)
        return who, self.grant(who)

    def grant(self, who: Identity) -> Grant | None:
        return None if who.problem else self.rules.get(who.name)


def parse_rules(text: str, path: str) -> dict[str, Grant]:
    """The rules of an authorisation file. Lines end at "\\n" only (str.splitlines would
    also end them at U+2028, NEL, form feed and others, so `backup ro disk<U+2028>admin
    rw *` would grant admin); any other control character in a rule is refused."""
    rules: dict[str, Grant] = {}
    for number, raw in enumerate(text.split("\n"), 1):
        line = raw.removesuffix("\r").split("#", 1)[0]
        odd = next((ch for ch in line if ch != "\t" and not ch.isprintable()), None)
        if odd is not None:
            raise ThinblockError(f"{path} line {number}: a rule may not hold the control character U+{ord(odd):04X}")
        words = line.replace("\t", " ").split(" ")
        words = [w for w in words if w]
        if not words:
            continue
        if len(words) != 3 or words[1] not in ("rw", "ro"):
            raise ThinblockError(
                f"{path} line {number}: a rule is NAME rw|ro EXPORT[,EXPORT...]|*, not '{shown(line.strip())}'"
            )
        name, access, exports = words
        if name in rules:
            raise ThinblockError(f"{path} line {number}: a second rule for '{shown(name)}'")
        chosen = None if exports == "*" else frozenset(e for e in exports.split(",") if e)
        rules[name] = Grant(chosen, access == "ro")
    return rules


def warn_if_writable_by_others(path: str, st: os.stat_result) -> None:
    """Whoever can rewrite the file can grant themselves every volume: say so."""
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "everyone" if st.st_mode & stat.S_IWOTH else "its group"
        log.warning(
            "--tls-authz %s can be written by %s (mode %04o): whoever changes it can grant themselves any volume",
            path,
            who,
            stat.S_IMODE(st.st_mode),
        )
    if st.st_uid not in (0, os.geteuid()):
        log.warning(
            "--tls-authz %s is owned by another user (uid %d), who can grant themselves any volume", path, st.st_uid
        )


class ContextCatalog(ExportCatalog, Protocol):
    """An ExportCatalog that also says which exports a metadata context reveals."""

    def context_owners(self, context: str) -> tuple[str, ...] | None:
        """The exports any one of which lets a client use this context (None: it
        reveals nothing beyond the export it is used on)."""
        ...


class GrantedCatalog:
    """One TLS client's view of the exports: what its grant allows, read-only if so.

    The grant can change (SIGHUP): `regrant` swaps it, and `lost` says whether a
    connection already in transmission may keep what it negotiated."""

    def __init__(
        self,
        catalog: ContextCatalog,
        who: Identity,
        grant: Grant | None,
        session: str,
        *,
        refused: Callable[[], None] | None = None,
    ) -> None:
        """refused: told of each refusal (the server counts them for its metrics)."""
        self.catalog = catalog
        self.who = who
        self.grant = grant
        self.session = session
        self._refused = refused or (lambda: None)

    def _refusal(self) -> str:
        why = f"{self.who.problem}" if self.who.problem else "is not in the authorisation list"
        return f"client certificate {self.who.shown} {why}"

    def list_names(self) -> list[tuple[str, str]]:
        grant = self.grant
        if grant is None:
            self._refused()
            raise ExportRefused(self._refusal())
        return [(name, text) for name, text in self.catalog.list_names() if grant.allows(name)]

    def lookup(self, name: str) -> ExportInfo | None:
        """The export, or None (exactly the answer for a name that does not exist) when
        the grant does not cover it; ExportRefused for a client with no grant at all
        (the same for every name)."""
        grant = self.grant
        if grant is None:
            reason = self._refusal()
            if not self.who.problem:  # an ambiguous certificate was logged once, at TLS
                log.warning("%s: refused: %s", self.session, reason)
            self._refused()
            raise ExportRefused(reason)
        # Decided on the name asked for before the catalog is consulted; the default
        # export "" is resolved first, as its name is only known then.
        export = self.catalog.lookup(name) if name == "" or grant.allows(name) else None
        if export is None and (name == "" or grant.allows(name)):
            return None  # it does not exist
        if export is not None and grant.allows(export.name):
            return self._view(export, grant)
        self._refused()
        log.warning(
            "%s: refused: client certificate %s may not use export '%s'",
            self.session,
            self.who.shown,
            shown(export.name if export is not None else name),
        )
        return None

    def _view(self, export: ExportInfo, grant: Grant) -> ExportInfo:
        def contexts() -> tuple[str, ...]:  # filtered when asked for, as they are built
            return tuple(ctx for ctx in export.meta_contexts if self.allows_context(ctx, grant))

        def offers(context: str) -> bool:
            return export.offers_context(context) and self.allows_context(context, grant)

        return dataclasses.replace(
            export, read_only=export.read_only or grant.read_only, contexts=contexts, offers=offers
        )

    def allows_context(self, context: str, grant: Grant | None = None) -> bool:
        grant = grant or self.grant
        if grant is None:
            return False
        owners = self.catalog.context_owners(context)
        return owners is None or any(grant.allows(owner) for owner in owners)

    def regrant(self, grant: Grant | None) -> None:
        self.grant = grant

    def lost(self, export: ExportInfo, contexts: list[str]) -> str | None:
        """Why a connection that negotiated export (and contexts) under an older grant
        may not keep it under the current one, or None if it may."""
        grant = self.grant
        if grant is None:
            return "its certificate is no longer in the authorisation list"
        if not grant.allows(export.name):
            return f"it may no longer use export '{shown(export.name)}'"
        if grant.read_only and not export.read_only:
            return f"it may now only read export '{shown(export.name)}'"
        for context in contexts:
            if not self.allows_context(context, grant):
                return f"it may no longer use metadata context '{shown(context)}'"
        return None
