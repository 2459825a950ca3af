"""Who may use which export over TLS: an authorisation list of client certificates.

`serve --tls-ca CA --tls-authz FILE` (like qemu-nbd's tls-authz objects): a
client certificate signed by the CA gets in only if its subject's common name
has a rule, and then only to the exports the rule names, read-write or
read-only. The file, one rule per line (`#` starts a comment):

    NAME  rw|ro  EXPORT[,EXPORT...]|*

Anything not granted is refused with NBD_REP_ERR_POLICY and a log line.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from thinblock.errors import ThinblockError
from thinblock.frontends.nbd.protocol import ExportCatalog, ExportInfo, ExportRefused

log = logging.getLogger("thinblock.nbd")


@dataclass(frozen=True)
class Grant:
    exports: frozenset[str] | None  # None: every export
    read_only: bool

    def allows(self, export: str) -> bool:
        return self.exports is None or export in self.exports


@dataclass(frozen=True)
class Authz:
    rules: dict[str, Grant]
    path: str

    @classmethod
    def load(cls, path: str) -> Authz:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise ThinblockError(f"cannot read --tls-authz {path}: {exc.strerror}") from None
        rules: dict[str, Grant] = {}
        for number, line in enumerate(lines, 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 3 or words[1] not in ("rw", "ro"):
                raise ThinblockError(f"{path} line {number}: a rule is NAME rw|ro EXPORT[,EXPORT...]|*, not {line!r}")
            name, access, exports = words
            if name in rules:
                raise ThinblockError(f"{path} line {number}: a second rule for {name!r}")
            chosen = None if exports == "*" else frozenset(e for e in exports.split(",") if e)
            rules[name] = Grant(chosen, access == "ro")
        return cls(rules, path)

    def client(self, cert: Mapping[str, Any] | None) -> tuple[str, Grant | None]:
        """The client's name (its certificate subject's common name) and its grant."""
        name = _common_name(cert)
        return name, self.rules.get(name)


def _common_name(cert: Mapping[str, Any] | None) -> str:
    subject = cert.get("subject", ()) if cert else ()
    for rdn in subject if isinstance(subject, tuple) else ():
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


class GrantedCatalog:
    """One TLS client's view of the exports: what its grant allows, read-only if so."""

    def __init__(self, catalog: ExportCatalog, who: str, grant: Grant | None, session: str) -> None:
        self.catalog = catalog
        self.who = who or "(no common name)"
        self.grant = grant
        self.session = session

    def list_exports(self) -> list[ExportInfo]:
        return [self._view(e) for e in self.catalog.list_exports() if self.grant and self.grant.allows(e.name)]

    def lookup(self, name: str) -> ExportInfo | None:
        export = self.catalog.lookup(name)
        if export is None:
            return None
        if self.grant is None or not self.grant.allows(export.name):
            why = "is not in the authorisation list" if self.grant is None else f"may not use export {export.name!r}"
            log.warning("%s: refused: client certificate %s %s", self.session, self.who, why)
            raise ExportRefused(f"client certificate {self.who} {why}")
        return self._view(export)

    def _view(self, export: ExportInfo) -> ExportInfo:
        if self.grant is not None and self.grant.read_only:
            return dataclasses.replace(export, read_only=True)
        return export
