"""Authorisation over TLS against a real `thinblock serve` on 127.0.0.1: certificates
made with openssl, real clients (libnbd, nbdinfo) and a bare TLS client for exact
option replies.

- a certificate with more than one common name is refused;
- metadata contexts follow the grant (LIST, SET and BLOCK_STATUS);
- hidden names and missing names get the same answer;
- SIGHUP re-reads the authorisation file and ends connections that lost their grant;
- the file is split at "\\n" only, bad encodings and loose permissions are reported;
- client-supplied names are logged with control characters escaped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nbd
import pytest

from tests.nbd_server import Server, thinblock
from tests.nbd_tls_client import PKI, TLSClient, client_context, name_request, wait_for_log
from thinblock.errors import ThinblockError
from thinblock.frontends.nbd import constants as c
from thinblock.frontends.nbd.authz import Grant, identity, parse_rules
from thinblock.logtext import shown

MiB = 1 << 20
RULES = "# who  access  exports\nadmin  rw  *\nbackup  ro  disk\n"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return PKI(tmp_path_factory.mktemp("authz") / "pki")


@pytest.fixture(scope="module")
def clients(pki: PKI) -> dict[str, Path]:
    return {
        "admin": pki.client("admin", "/CN=admin"),
        "backup": pki.client("backup", "/CN=backup"),
        "two-rdns": pki.client("two-rdns", "/CN=backup/CN=admin"),
        "multi-valued": pki.client("multi-valued", "/CN=backup+CN=admin", multivalue=True),
        "newline": pki.client("newline", "/CN=evil\n2026-01-01 00:00:00,000 thinblock.nbd: forged"),
    }


@pytest.fixture
def pool(tmp_path: Path) -> str:
    path = str(tmp_path / "pool")
    thinblock("pool", "create", path, "--size", "64M")
    thinblock("volume", "create", path, "disk", "--size", "16M")
    thinblock("volume", "create", path, "other", "--size", "16M")
    return path


@pytest.fixture
def authz(tmp_path: Path) -> Path:
    path = tmp_path / "authz"
    path.write_text(RULES)
    path.chmod(0o600)
    return path


@pytest.fixture
def server(pool: str, pki: PKI, authz: Path) -> Iterator[Server]:
    srv = Server(pool, *pki.serve_args(authz))
    try:
        yield srv
    finally:
        srv.stop()
        assert "Traceback" not in srv.log.read_text(), srv.log.read_text()


def port_of(server: Server) -> int:
    return int(server.tcp_uri("disk").rsplit(":", 1)[1].split("/")[0])


def handle(server: Server, client: Path, export: str, contexts: tuple[str, ...] = ()) -> nbd.NBD:
    h = nbd.NBD()
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_certificates(str(client))
    for ctx in contexts:
        h.add_meta_context(ctx)
    h.connect_uri(f"nbds://localhost:{port_of(server)}/{export}")
    return h


# ----- identity ------------------------------------------------------------------------


@pytest.mark.parametrize("label", ["two-rdns", "multi-valued"])
def test_a_certificate_with_several_common_names_is_refused(
    server: Server, clients: dict[str, Path], label: str
) -> None:
    # Either name alone may use disk (backup read-only, admin read-write): the
    # certificate naming both gets nothing.
    with pytest.raises(nbd.Error) as refused:
        handle(server, clients[label], "disk")
    assert "server policy prevents" in str(refused.value), refused.value  # NBD_REP_ERR_POLICY
    listing = subprocess.run(
        ["nbdinfo", "--list", "--json", f"nbds://localhost:{port_of(server)}/?tls-certificates={clients[label]}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listing.returncode != 0 and "disk" not in listing.stdout
    # openssl orders a multi-valued RDN's members itself (by their encoding)
    names = "'backup', 'admin'" if label == "two-rdns" else "'admin', 'backup'"
    wait_for_log(server.log, f"has 2 common names ({names}): an ambiguous identity is refused")
    # The single-name certificates still get in.
    h = handle(server, clients["backup"], "disk")
    assert h.is_read_only()
    h.shutdown()
    assert server.alive()


# ----- what a grant reveals --------------------------------------------------------------


def _list_contexts(server: Server, client: Path, export: str) -> list[str]:
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.set_tls(nbd.TLS_REQUIRE)
    h.set_tls_certificates(str(client))
    h.connect_uri(f"nbds://localhost:{port_of(server)}/{export}")
    offered: list[str] = []

    def offer(context: str) -> int:
        offered.append(context)
        return 0

    h.opt_list_meta_context(offer)
    h.opt_abort()
    return sorted(offered)


def _changed_map(h: nbd.NBD, context: str, length: int) -> list[int]:
    entries: list[int] = []

    def extents(meta: str, _offset: int, got: list[int], _err: int) -> int:
        if meta == context:
            entries.extend(got)
        return 0

    h.block_status(length, 0, extents)
    return entries


def test_meta_contexts_follow_the_grant(server: Server, clients: dict[str, Path]) -> None:
    admin = handle(server, clients["admin"], "other")
    admin.pwrite(b"o" * MiB, 0)  # where other@s1 holds data (and disk does not)
    admin.flush()
    admin.shutdown()
    thinblock("snapshot", "create", server.pool, "other@s1")
    thinblock("snapshot", "create", server.pool, "disk@s1")

    # backup may use disk: its snapshot's changes, not other's.
    offered = _list_contexts(server, clients["backup"], "disk")
    assert offered == ["base:allocation", "thinblock:changed:disk@s1", "thinblock:guaranteed"], offered
    assert "thinblock:changed:other@s1" in _list_contexts(server, clients["admin"], "other")
    # Asked for by name (SET_META_CONTEXT), it is not granted either.
    h = handle(server, clients["backup"], "disk", ("thinblock:changed:other@s1", "thinblock:changed:disk@s1"))
    assert not h.can_meta_context("thinblock:changed:other@s1")
    assert h.can_meta_context("thinblock:changed:disk@s1")
    assert _changed_map(h, "thinblock:changed:disk@s1", MiB) == [MiB, 0]
    # A context negotiated while allowed stops working when its name comes to mean a
    # snapshot of a volume backup may not use.
    thinblock("snapshot", "remove", server.pool, "disk@s1")
    thinblock("snapshot", "create", server.pool, "other", "disk@s1")
    with pytest.raises(nbd.Error) as refused:
        _changed_map(h, "thinblock:changed:disk@s1", MiB)
    assert refused.value.errnum == 1  # EPERM
    assert h.pread(512, 0) == bytes(512)  # the connection itself goes on
    h.shutdown()


def _answer(server: Server, pki: PKI, client: Path, option_code: int, data: bytes) -> tuple[int, bytes]:
    tls = TLSClient(port_of(server), client_context(pki.ca, client))
    try:
        tls.ask(c.OPT_STRUCTURED_REPLY)
        replies = tls.ask(option_code, data)
    finally:
        tls.close()
    return replies[-1]


@pytest.mark.parametrize(
    "option_code", [c.OPT_INFO, c.OPT_GO, c.OPT_LIST_META_CONTEXT, c.OPT_SET_META_CONTEXT], ids=lambda o: str(o)
)
def test_hidden_names_answer_as_missing_names(
    server: Server, pki: PKI, clients: dict[str, Path], option_code: int
) -> None:
    meta = option_code in (c.OPT_LIST_META_CONTEXT, c.OPT_SET_META_CONTEXT)
    trailer = struct.pack(">I", 0) if meta else struct.pack(">H", 0)
    # "other" exists and is hidden from backup; "otheR" does not exist: one answer,
    # word for word once the name asked for is taken out.
    hidden = _answer(server, pki, clients["backup"], option_code, name_request("other", trailer))
    missing = _answer(server, pki, clients["backup"], option_code, name_request("otheR", trailer))
    assert hidden[0] == missing[0] == c.REP_ERR_UNKNOWN
    assert hidden[1].replace(b"'other'", b"'NAME'") == missing[1].replace(b"'otheR'", b"'NAME'")
    # The export backup may use answers; admin sees other.
    assert _answer(server, pki, clients["backup"], option_code, name_request("disk", trailer))[0] == c.REP_ACK
    assert _answer(server, pki, clients["admin"], option_code, name_request("other", trailer))[0] == c.REP_ACK
    # LIST shows what may be used, nothing more.
    names = subprocess.run(
        ["nbdinfo", "--list", "--json", f"nbds://localhost:{port_of(server)}/?tls-certificates={clients['backup']}"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert [e["export-name"] for e in json.loads(names)["exports"]] == ["disk"]


# ----- reload ----------------------------------------------------------------------------


def test_sighup_reloads_the_authorisation_list(server: Server, clients: dict[str, Path], authz: Path) -> None:
    backup = handle(server, clients["backup"], "disk")
    admin = handle(server, clients["admin"], "other")
    admin.pwrite(b"a" * 4096, 0)
    writer = handle(server, clients["admin"], "disk")
    assert backup.pread(4096, 0) == bytes(4096)

    # backup loses its rule; admin keeps everything but may only read disk.
    authz.write_text("admin  rw  other\n")
    server.proc.send_signal(signal.SIGHUP)
    log = wait_for_log(server.log, "reloaded --tls-authz")
    log = wait_for_log(server.log, "closed (grant withdrawn: its certificate is no longer in the authorisation list)")
    log = wait_for_log(server.log, "closed (grant withdrawn: it may no longer use export 'disk')")
    with pytest.raises(nbd.Error):
        backup.pread(4096, 0)
    with pytest.raises(nbd.Error):
        writer.pread(4096, 0)
    assert admin.pread(4096, 0) == b"a" * 4096  # a connection the new rules still cover goes on
    with pytest.raises(nbd.Error) as refused:
        handle(server, clients["backup"], "disk")
    assert "server policy prevents" in str(refused.value)

    # A file that does not load changes nothing, with one sentence in the log.
    authz.write_bytes(b"admin rw *\nbackup ro \xff\n")
    server.proc.send_signal(signal.SIGHUP)
    log = wait_for_log(server.log, "reloading --tls-authz failed, the previous rules stay in force:")
    assert f"--tls-authz {authz} is not UTF-8 text (byte 0xff at offset 21)" in log
    assert admin.pread(4096, 0) == b"a" * 4096
    # A FIFO put in its place: refused at once, not waited on (SIGTERM would wait too).
    authz.unlink()
    os.mkfifo(authz)
    server.proc.send_signal(signal.SIGHUP)
    log = wait_for_log(server.log, f"--tls-authz {authz} is not a regular file")
    assert admin.pread(4096, 0) == b"a" * 4096
    authz.unlink()
    with pytest.raises(nbd.Error):
        handle(server, clients["backup"], "disk")

    # Read-write becomes read-only: the read-write connection ends, a new one is read-only.
    authz.write_text("admin  ro  other\nbackup  ro  disk\n")
    server.proc.send_signal(signal.SIGHUP)
    wait_for_log(server.log, "closed (grant withdrawn: it may now only read export 'other')")
    with pytest.raises(nbd.Error):
        admin.pread(4096, 0)
    again = handle(server, clients["admin"], "other")
    assert again.is_read_only() and again.pread(4096, 0) == b"a" * 4096
    again.shutdown()
    back = handle(server, clients["backup"], "disk")
    back.shutdown()
    assert server.alive()
    del backup, writer, admin  # libnbd closes a handle when it goes


def test_requests_in_flight_are_answered_when_a_grant_goes(
    server: Server, pki: PKI, clients: dict[str, Path], authz: Path
) -> None:
    """64 reads of 1 MiB sent and not read: most replies still wait in the server when
    the grant goes. Each arrives whole, over TLS, before the connection ends."""
    tls = TLSClient(port_of(server), client_context(pki.ca, clients["backup"]))
    assert tls.ask(c.OPT_GO, name_request("disk"))[-1][0] == c.REP_ACK
    count, size = 64, MiB
    tls.sock.sendall(
        b"".join(struct.pack(">IHHQQI", c.REQUEST_MAGIC, 0, c.CMD_READ, n, n % 16 * size, size) for n in range(count))
    )
    authz.write_text("admin  rw  *\n")
    server.proc.send_signal(signal.SIGHUP)
    wait_for_log(
        server.log, "closing: client certificate backup: its certificate is no longer in the authorisation list"
    )
    cookies = []
    while header := tls.sock.recv(16):  # ends at EOF, and only at a reply's end
        while len(header) < 16:
            header += tls.sock.recv(16 - len(header))
        magic, error, cookie = struct.unpack(">IIQ", header)
        assert (magic, error) == (c.SIMPLE_REPLY_MAGIC, 0), header
        data = bytearray()
        while len(data) < size:
            chunk = tls.sock.recv(size - len(data))
            assert chunk, f"the connection ended inside reply {cookie}"
            data += chunk
        assert data == bytes(size)
        cookies.append(cookie)
    tls.close()
    assert cookies and len(set(cookies)) == len(cookies) and set(cookies) <= set(range(count))  # any order
    wait_for_log(server.log, "closed (grant withdrawn: its certificate is no longer in the authorisation list)")
    assert server.alive()


# ----- the file itself -------------------------------------------------------------------


def _refused_at_start(pool: str, pki: PKI, authz: Path) -> str:
    """The log of a `serve` that must exit 1 over its --tls-authz file; one that comes
    up instead fails the test at once (and is stopped)."""
    try:
        srv = Server(pool, *pki.serve_args(authz))
    except RuntimeError as exc:  # exited before it was ready
        assert "Traceback" not in str(exc), exc
        return str(exc)
    srv.stop()
    pytest.fail(f"serve accepted {authz}: {authz.read_bytes()!r}")


@pytest.mark.parametrize("separator", ["\u2028", "\x85", "\x0c", "\x1e"], ids=["U+2028", "NEL", "FF", "RS"])
def test_rules_end_at_newlines_only(pool: str, pki: PKI, tmp_path: Path, separator: str) -> None:
    authz = tmp_path / "authz"
    authz.write_text(f"backup ro disk{separator}admin rw *\n")
    log = _refused_at_start(pool, pki, authz)
    assert f"{authz} line 1: a rule may not hold the control character U+{ord(separator):04X}" in log, log
    got = thinblock("serve", pool, "--socket", str(tmp_path / "s"), *pki.serve_args(authz), check=False)
    assert got.returncode == 1, got.stderr


def test_a_file_that_is_not_utf8_is_one_sentence(pool: str, pki: PKI, tmp_path: Path) -> None:
    authz = tmp_path / "authz"
    authz.write_bytes(b"admin rw *\nb\xe9ckup ro disk\n")
    got = thinblock("serve", pool, "--socket", str(tmp_path / "s"), *pki.serve_args(authz), check=False)
    assert got.returncode == 1
    assert got.stderr.strip().endswith(f"--tls-authz {authz} is not UTF-8 text (byte 0xe9 at offset 12)"), got.stderr


def test_a_file_others_can_write_is_reported(pool: str, pki: PKI, authz: Path, clients: dict[str, Path]) -> None:
    authz.chmod(0o666)
    srv = Server(pool, *pki.serve_args(authz))
    try:
        log = wait_for_log(srv.log, f"--tls-authz {authz} can be written by everyone (mode 0666)")
        authz.chmod(0o620)
        srv.proc.send_signal(signal.SIGHUP)
        log = wait_for_log(srv.log, f"--tls-authz {authz} can be written by its group (mode 0620)")
        handle(srv, clients["backup"], "disk").shutdown()  # a warning, not a refusal
        authz.chmod(0o600)
        os.chown(authz, 54321, -1)  # a uid no user of this machine has
        srv.proc.send_signal(signal.SIGHUP)
        log = wait_for_log(srv.log, f"--tls-authz {authz} is owned by another user (uid 54321)")
    finally:
        srv.stop()
    assert "Traceback" not in log


# ----- logs ------------------------------------------------------------------------------


def test_client_names_cannot_forge_log_lines(server: Server, pki: PKI, clients: dict[str, Path]) -> None:
    with pytest.raises(nbd.Error):
        handle(server, clients["newline"], "disk")
    forged = "\x1b[2J\n2026-01-01 00:00:00,000 thinblock.nbd: forged\u2028"
    _answer(server, pki, clients["backup"], c.OPT_GO, name_request(forged))  # a name outside the grant
    _answer(server, pki, clients["admin"], c.OPT_GO, name_request(forged))  # a name that does not exist
    server.stop()
    log = server.log.read_text()
    assert (
        "client certificate evil\\n2026-01-01 00:00:00,000 thinblock.nbd: forged is not in the authorisation list"
        in (log)
    )
    assert "may not use export '\\x1b[2J\\n2026-01-01 00:00:00,000 thinblock.nbd: forged\\u2028'" in log
    assert not any(line.startswith("2026-01-01") for line in log.splitlines()), log
    assert "\x1b" not in log and "\u2028" not in log


# ----- the pieces alone (unit tests, in addition to the above) ---------------------------


def test_shown_escapes_what_is_not_printable() -> None:
    assert shown("vm1@monday é") == "vm1@monday é"
    assert shown("a\nb\r\t\x1b[2J\x85\u2028\\") == "a\\nb\\r\\t\\x1b[2J\\x85\\u2028\\\\"
    assert shown("\U000e0001") == "\\U000e0001"  # a format character


def test_identity_needs_exactly_one_common_name() -> None:
    one = identity({"subject": ((("organizationName", "x"),), (("commonName", "backup"),))})
    assert (one.name, one.problem) == ("backup", None)
    assert identity({"subject": ()}).shown == "(no common name)"
    for subject in (
        ((("commonName", "backup"),), (("commonName", "admin"),)),
        ((("commonName", "backup"), ("commonName", "admin")),),
    ):
        assert "has 2 common names ('backup', 'admin')" in (identity({"subject": subject}).problem or "")


def test_parse_rules() -> None:
    rules = parse_rules("# c\r\nadmin\trw *\r\n\nbackup ro a,b  # note\n", "F")
    assert rules == {"admin": Grant(None, False), "backup": Grant(frozenset({"a", "b"}), True)}
    for text, message in (
        ("admin rw", "F line 1: a rule is NAME rw|ro"),
        ("admin rx *", "F line 1: a rule is NAME rw|ro"),
        ("a ro x\na rw *", "F line 2: a second rule for 'a'"),
        ("a ro x\u2029b rw *", "F line 1: a rule may not hold the control character U+2029"),
    ):
        with pytest.raises(ThinblockError, match=re.escape(message)):
            parse_rules(text, "F")
