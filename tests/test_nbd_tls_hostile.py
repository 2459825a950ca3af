"""TLS (with real clients) and hostile clients against a real `thinblock serve`."""

from __future__ import annotations

import json
import random
import shutil
import socket
import ssl
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import nbd
import pytest

from tests.nbd_server import Server, reads_zeros_beside, thinblock
from tests.nbd_tls_client import TLSClient, client_context, name_request
from thinblock.frontends.nbd import constants as c

MiB = 1 << 20


@pytest.fixture
def pool(tmp_path: Path) -> str:
    path = str(tmp_path / "pool")
    thinblock("pool", "create", path, "--size", "64M")
    thinblock("volume", "create", path, "disk", "--size", "16M")
    return path


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """A self-signed certificate for localhost, laid out as libnbd and qemu expect (ca-cert.pem)."""
    d = tmp_path / "pki"
    d.mkdir()
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", str(d / "server-key.pem"), "-out", str(d / "server-cert.pem"),
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    shutil.copy(d / "server-cert.pem", d / "ca-cert.pem")
    return d


@pytest.fixture
def tls_server(pool: str, certs: Path) -> Iterator[Server]:
    server = Server(
        pool, "--listen", "0", "--tls-cert", str(certs / "server-cert.pem"), "--tls-key", str(certs / "server-key.pem")
    )
    try:
        yield server
    finally:
        server.stop()
        assert "Traceback" not in server.log.read_text()


def run(*cmd: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if ok:
        assert proc.returncode == 0, f"{cmd}: {proc.stdout}\n{proc.stderr}"
    return proc


def test_tls_with_nbdinfo_and_qemu(tls_server: Server, certs: Path) -> None:
    port = tls_server.tcp_uri("disk").rsplit(":", 1)[1].split("/")[0]
    uri = f"nbds://localhost:{port}/disk?tls-certificates={certs}"
    info = json.loads(run("nbdinfo", "--json", uri).stdout)
    assert info["TLS"] is True
    assert info["exports"][0]["export-size"] == 16 * MiB
    opts = f"driver=nbd,host=localhost,port={port},export=disk,tls-creds=tls0"
    obj = f"tls-creds-x509,id=tls0,dir={certs},endpoint=client"
    run("qemu-io", "--object", obj, "--image-opts", opts, "-c", "write -P 0x5c 0 1M", "-c", "read -P 0x5c 0 1M")
    out = run("qemu-img", "info", "--object", obj, "--image-opts", opts).stdout
    assert "16 MiB" in out
    # over the unix socket too
    unix = f"nbds+unix:///disk?socket={tls_server.socket}&tls-certificates={certs}&tls-hostname=localhost"
    assert json.loads(run("nbdinfo", "--json", unix).stdout)["TLS"] is True


# Suites a client may offer, and whether the server accepts them: TLS 1.2 with forward
# secrecy (ECDHE) and an AEAD cipher, or TLS 1.3; never static RSA, CBC or TLS 1.1.
CIPHER_CASES = [
    ("AES128-SHA", ssl.TLSVersion.TLSv1_2, False),  # static RSA key exchange, CBC, SHA-1
    ("AES256-GCM-SHA384", ssl.TLSVersion.TLSv1_2, False),  # static RSA, even with GCM
    ("ECDHE-RSA-AES128-SHA256", ssl.TLSVersion.TLSv1_2, False),  # forward secret, but CBC
    ("ECDHE-RSA-AES128-SHA", ssl.TLSVersion.TLSv1_1, False),  # TLS 1.1
    ("ECDHE-RSA-AES128-GCM-SHA256", ssl.TLSVersion.TLSv1_2, True),
    ("ECDHE-RSA-CHACHA20-POLY1305", ssl.TLSVersion.TLSv1_2, True),
    (None, ssl.TLSVersion.TLSv1_3, True),
]


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1_1 is deprecated:DeprecationWarning")
@pytest.mark.parametrize(("suite", "version", "accepted"), CIPHER_CASES, ids=lambda v: str(getattr(v, "name", v)))
def test_cipher_policy(
    tls_server: Server, certs: Path, suite: str | None, version: ssl.TLSVersion, accepted: bool
) -> None:
    ctx = client_context(certs / "ca-cert.pem")
    ctx.minimum_version = ctx.maximum_version = version
    if suite is not None:
        ctx.set_ciphers(f"{suite}:@SECLEVEL=0")  # the client offers only this suite
    port = int(tls_server.tcp_uri("disk").rsplit(":", 1)[1].split("/")[0])
    if accepted:
        client = TLSClient(port, ctx)
        try:
            names = {ssl.TLSVersion.TLSv1_2: "TLSv1.2", ssl.TLSVersion.TLSv1_3: "TLSv1.3"}
            assert client.sock.version() == names[version]
            assert suite is None or (client.sock.cipher() or ("",))[0] == suite
            replies = client.ask(c.OPT_GO, name_request("disk"))
            assert replies[-1][0] == c.REP_ACK
        finally:
            client.close()
    else:
        with pytest.raises(ssl.SSLError):
            TLSClient(port, ctx)
    assert tls_server.alive()


def test_plaintext_refused_when_tls_is_on(tls_server: Server) -> None:
    for uri in (tls_server.tcp_uri("disk").replace("nbds://", "nbd://"), tls_server.unix_uri("disk")):
        proc = run("nbdinfo", uri, ok=False)
        assert proc.returncode != 0
        assert "export-size" not in proc.stdout  # nothing about the export was revealed
    assert tls_server.alive()


# ----- hostile clients -----------------------------------------------------------------


def _send(sock_path: str, payload: bytes, *, read: bool = True) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(sock_path)
        if read:
            s.recv(18)
        s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass
    except OSError:
        pass  # being hung up on is the expected answer to most of these
    finally:
        s.close()


def _opt(option: int, data: bytes = b"", length: int | None = None) -> bytes:
    return struct.pack(">QII", c.IHAVEOPT, option, len(data) if length is None else length) + data


def _go(name: bytes) -> bytes:
    return _opt(c.OPT_GO, struct.pack(">I", len(name)) + name + struct.pack(">H", 0))


FLAGS = struct.pack(">I", c.FLAG_C_FIXED_NEWSTYLE | c.FLAG_C_NO_ZEROES)
GO_DISK = FLAGS + _opt(c.OPT_STRUCTURED_REPLY) + _go(b"disk")


def _req(cmd: int, offset: int = 0, length: int = 0, flags: int = 0, magic: int = c.REQUEST_MAGIC) -> bytes:
    return struct.pack(">IHHQQI", magic, flags, cmd, 1, offset, length)


HOSTILE = [
    b"",
    b"\x00",
    struct.pack(">I", 0xFFFFFFFF),  # unknown client flags
    FLAGS + b"IHAVEOP",  # truncated option header
    FLAGS + struct.pack(">QII", 0xDEADBEEF, 1, 0),  # bad option magic
    FLAGS + _opt(c.OPT_LIST, length=1 << 31),  # absurd option length
    FLAGS + _opt(c.OPT_GO, b"\xff\xff\xff\xff"),  # name longer than the option
    FLAGS + _opt(c.OPT_GO, struct.pack(">I", 2) + b"\xc3\x28" + struct.pack(">H", 0)),  # not UTF-8
    FLAGS + _opt(c.OPT_SET_META_CONTEXT, struct.pack(">I", 4) + b"disk" + struct.pack(">I", 99)),
    FLAGS + _opt(c.OPT_EXPORT_NAME, b"no-such-export"),
    FLAGS + _opt(c.OPT_STARTTLS),
    FLAGS + _opt(999, b"x" * 100),
    struct.pack(">I", 0) + _opt(c.OPT_LIST),  # non-fixed client sending LIST
    GO_DISK + _req(c.CMD_READ, magic=0x12345678),  # bad request magic
    GO_DISK + _req(c.CMD_WRITE, 0, 1 << 31),  # absurd write payload
    GO_DISK + _req(c.CMD_WRITE, 0, 4096) + b"short",  # truncated payload
    GO_DISK + _req(c.CMD_READ, 0, 1 << 30),  # too big a read: an error reply
    GO_DISK + _req(c.CMD_READ, 1 << 60, 10) + _req(99) + _req(c.CMD_BLOCK_STATUS, 0, 10),
    GO_DISK + _req(c.CMD_FLUSH, 5, 5) + _req(c.CMD_TRIM, 0, 10, flags=0x8000) + _req(c.CMD_DISC),
    GO_DISK + _req(c.CMD_READ, 0, 1 << 20) * 200,  # many reads, never read back
]


def test_hostile_clients_do_not_hurt_the_server(pool: str) -> None:
    server = Server(pool)
    try:
        for payload in HOSTILE:
            _send(server.socket, payload)
        rng = random.Random(99)
        for _ in range(200):
            prefix = rng.choice([b"", FLAGS, GO_DISK])
            _send(server.socket, prefix + rng.randbytes(rng.randrange(1, 300)), read=rng.random() < 0.5)
        assert server.alive()
        info = subprocess.run(
            ["nbdinfo", "--json", server.unix_uri("disk")], capture_output=True, text=True, timeout=60
        )
        assert info.returncode == 0, info.stderr
        assert json.loads(info.stdout)["exports"][0]["export-size"] == 16 * MiB
        subprocess.run(
            ["qemu-io", "-f", "raw", "-c", "write -P 7 0 64k", "-c", "read -P 7 0 64k", server.unix_uri("disk")],
            check=True,
            capture_output=True,
        )
    finally:
        server.stop()
    log = server.log.read_text()
    assert "Traceback" not in log, log
    assert "protocol error" in log  # malformed bytes were logged
    thinblock("pool", "check", pool)


def test_slow_client_does_not_stall_others(pool: str) -> None:
    server = Server(pool)
    stalled = socket.socket(socket.AF_UNIX)
    try:
        stalled.connect(server.socket)
        stalled.recv(18)
        stalled.sendall(GO_DISK + _req(c.CMD_READ, 0, 1 << 20) * 64)  # 64 MiB of replies it never reads
        for _ in range(3):
            subprocess.run(
                ["qemu-io", "-f", "raw", "-c", "read 0 1M", server.unix_uri("disk")],
                check=True,
                capture_output=True,
                timeout=30,
            )
        # ...and it cannot hold up a clean stop either (the server hangs up on it after a grace period).
        assert "stopped" in server.stop()
    finally:
        stalled.close()
        server.stop()


def test_a_tls_client_that_reads_no_replies_is_cut_off_when_others_wait(tmp_path: Path, certs: Path) -> None:
    """As over a plain socket (test_nbd_memory): TLS clients that send 32 MiB READs and
    read none of the replies hold the memory large requests share; once another client's
    2 MiB reads wait, they are cut off after --payload-timeout seconds, and those reads
    go through. Before, a TLS writer blocked in sendall for good, holding the memory."""
    path = str(tmp_path / "big")
    thinblock("pool", "create", path, "--size", "1G")
    thinblock("volume", "create", path, "disk", "--size", "512M")
    tls = ("--tls-cert", str(certs / "server-cert.pem"), "--tls-key", str(certs / "server-key.pem"))
    server = Server(path, "--listen", "0", *tls, "--payload-timeout", "1")
    try:
        port = int(server.tcp_uri("disk").rsplit(":", 1)[1].split("/")[0])
        ctx = client_context(certs / "ca-cert.pem")
        silent = []
        for i in range(6):  # 6 x 32 MiB: the whole large-request budget
            client = TLSClient(port, ctx)
            replies = client.ask(c.OPT_GO, name_request("disk"))
            assert replies[-1][0] == c.REP_ACK, replies
            client.sock.sendall(struct.pack(">IHHQQI", c.REQUEST_MAGIC, 0, c.CMD_READ, 1, i * 32 * MiB, 32 * MiB))
            silent.append(client)

        def tls_handle() -> nbd.NBD:
            h = nbd.NBD()
            h.set_tls(nbd.TLS_REQUIRE)
            h.set_tls_certificates(str(certs))
            h.connect_uri(f"nbds://localhost:{port}/disk")
            return h

        assert reads_zeros_beside(tls_handle)
        for client in silent:
            client.close()
        assert "reading its replies stalled" in server.log.read_text()
    finally:
        server.stop()
        assert "Traceback" not in server.log.read_text()
