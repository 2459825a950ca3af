"""A certificate authority made with real openssl, and a bare NBD client over TLS
(Python's ssl, the same OpenSSL as the server) for what libnbd does not expose:
the exact option replies, and the cipher suites a client offers."""

from __future__ import annotations

import shutil
import socket
import ssl
import struct
import subprocess
import time
from pathlib import Path

from thinblock.frontends.nbd import constants as c


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


class PKI:
    """A CA at root, a server certificate for localhost, and client certificate
    directories laid out as libnbd expects (ca-cert.pem, client-cert.pem, client-key.pem)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.ca = root / "ca-cert.pem"
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", str(root / "ca-key.pem"),
                 "-out", str(self.ca), "-subj", "/CN=thinblock test CA")  # fmt: skip
        self._sign(root / "server", "/CN=localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        self.server_cert = root / "server-cert.pem"
        self.server_key = root / "server-key.pem"

    def _sign(self, stem: Path, subject: str, ext: str, *, multivalue: bool = False) -> None:
        extra = ["-multivalue-rdn"] if multivalue else []
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{stem}-key.pem", "-out", f"{stem}.csr",
                 *extra, "-subj", subject)  # fmt: skip
        (self.root / "ext.cnf").write_text(ext)
        _openssl("x509", "-req", "-in", f"{stem}.csr", "-CA", str(self.ca), "-CAkey", str(self.root / "ca-key.pem"),
                 "-CAcreateserial", "-days", "2", "-out", f"{stem}-cert.pem", "-extfile", str(self.root / "ext.cnf"))  # fmt: skip

    def client(self, label: str, subject: str, *, multivalue: bool = False) -> Path:
        """A directory with a client certificate for this subject (openssl -subj syntax)."""
        d = self.root / label
        d.mkdir()
        self._sign(d / "client", subject, "extendedKeyUsage=clientAuth\n", multivalue=multivalue)
        shutil.copy(self.ca, d / "ca-cert.pem")
        return d

    def serve_args(self, authz: Path | None = None) -> tuple[str, ...]:
        args = ("--listen", "0", "--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key),
                "--tls-ca", str(self.ca))  # fmt: skip
        return (*args, "--tls-authz", str(authz)) if authz else args


def _exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"server closed the connection after {len(data)} of {n} bytes")
        data += chunk
    return data


def option(option_code: int, data: bytes = b"") -> bytes:
    return struct.pack(">QII", c.IHAVEOPT, option_code, len(data)) + data


def name_request(name: str, trailer: bytes = struct.pack(">H", 0)) -> bytes:
    """The data of INFO/GO (trailer: no information requests) or, with another
    trailer, of LIST/SET_META_CONTEXT."""
    raw = name.encode()
    return struct.pack(">I", len(raw)) + raw + trailer


class TLSClient:
    """NBD negotiation up to STARTTLS in plaintext, then a TLS handshake with this
    client context; afterwards `ask` sends one option and returns its replies."""

    def __init__(self, port: int, ctx: ssl.SSLContext) -> None:
        raw = socket.create_connection(("127.0.0.1", port), timeout=20)
        try:
            magic, opt_magic, _flags = struct.unpack(">QQH", _exact(raw, 18))
            assert (magic, opt_magic) == (c.NBDMAGIC, c.IHAVEOPT)
            raw.sendall(struct.pack(">I", c.FLAG_C_FIXED_NEWSTYLE | c.FLAG_C_NO_ZEROES))
            raw.sendall(option(c.OPT_STARTTLS))
            _magic, _opt, reply, length = struct.unpack(">QIII", _exact(raw, 20))
            assert reply == c.REP_ACK and length == 0
            self.sock: ssl.SSLSocket = ctx.wrap_socket(raw, server_hostname="localhost")
        except BaseException:
            raw.close()
            raise

    def ask(self, option_code: int, data: bytes = b"") -> list[tuple[int, bytes]]:
        """(reply type, payload) of every reply up to the final ACK or error."""
        self.sock.sendall(option(option_code, data))
        replies = []
        while True:
            _magic, _opt, reply, length = struct.unpack(">QIII", _exact(self.sock, 20))
            replies.append((reply, _exact(self.sock, length)))
            if reply == c.REP_ACK or reply & (1 << 31):
                return replies

    def close(self) -> None:
        self.sock.close()


def client_context(pki_ca: Path, client_dir: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(str(pki_ca))
    if client_dir is not None:
        ctx.load_cert_chain(str(client_dir / "client-cert.pem"), str(client_dir / "client-key.pem"))
    return ctx


def wait_for_log(log: Path, text: str, timeout_s: float = 30) -> str:
    """The server log once it holds text (polled: the condition, not a guessed delay)."""
    deadline = time.monotonic() + timeout_s
    while True:
        content = log.read_text()
        if text in content:
            return content
        if time.monotonic() > deadline:
            raise AssertionError(f"{text!r} never appeared in the server log:\n{content}")
        time.sleep(0.05)
