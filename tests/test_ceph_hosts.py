"""Servers per volume on two hosts of one Ceph pool (issue 23): hosts are network
namespaces made here, with host names of their own, reaching a Ceph cluster
that runs in a namespace of its own over veth links (tests/netns.py); the test
talks to the servers through their unix sockets. Real servers, real libnbd
clients, a real cut link. Every read is checked against a model of what was
written and flushed; `pool check` runs afterwards.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nbd
import pytest

from tests import ceph_cluster
from tests.hosts import thinblock_on
from tests.nbd_server import Server
from tests.netns import CLUSTER_ADDR, Hosts
from tests.test_commands import until
from tests.test_owners import Writer, _handle, _in_threads

MiB = 1 << 20
LEASE_S = 3


@dataclass
class Site:
    hosts: Hosts
    env: dict[str, str]  # what every thinblock process here is given: the cluster, a short lease
    work: Path

    def thinblock(self, host: str, *args: str, check: bool = True) -> str:
        return thinblock_on(self.hosts.prefix(host), *args, check=check, env=self.env).stdout

    def serve(self, host: str, pool: str, *args: str, label: str) -> Server:
        work = self.work / label
        work.mkdir(exist_ok=True)
        return Server(
            pool, *args, "--socket", str(work / "nbd.sock"), workdir=work, host=self.hosts.prefix(host), env=self.env
        )


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root (CI runs as root)")
    work = Path(tempfile.mkdtemp(prefix="thinblock-hosts."))
    hosts = Hosts()
    cluster = str(work / "ceph")
    try:
        hosts.add("a")
        hosts.add("b")
        conf = ceph_cluster.start(cluster, 2 << 30, netns=hosts.cluster, addr=CLUSTER_ADDR)
        yield Site(hosts, {"CEPH_CONF": conf, "THINBLOCK_RADOS_LEASE_S": str(LEASE_S)}, work)
    finally:
        ceph_cluster.stop(cluster)
        hosts.close()
        shutil.rmtree(work, ignore_errors=True)


def _stop(server: Server) -> None:
    server.stop()
    assert "Traceback" not in server.log.read_text(), server.log.read_text()


def _pool(site: Site, name: str, volumes: dict[str, str]) -> str:
    pool = f"rados:{ceph_cluster.TEST_POOL}/{name}"
    site.thinblock("b", "pool", "create", pool, "--size", "256M")
    for vol, size in volumes.items():
        site.thinblock("b", "volume", "create", pool, vol, "--size", size)
    return pool


def test_two_hosts_own_volumes_of_one_pool_and_reach_each_other_by_notify(site: Site) -> None:
    """A server on each host, each with its own Ceph clients, owns its volumes; both
    write with flushes. A snapshot of a's volume is taken from host b's command line
    (it reaches the owner on host a by notify), and its clone is served on host b."""
    pool = _pool(site, "two-hosts", {"va": "32M", "vb": "32M"})
    sa = site.serve("a", pool, "--volume", "va", label="two-a")
    sb = site.serve("b", pool, "--volume", "vb", label="two-b")
    servers = [sa, sb]
    try:
        wa, wb = Writer(sa, "va", 32 * MiB, 41), Writer(sb, "vb", 32 * MiB, 42)
        _in_threads((wa, 80), (wb, 80))
        site.thinblock("b", "snapshot", "create", pool, "va", "s1")
        assert 'control: snapshot_create {"volume": "va", "name": "s1"}' in sa.log.read_text()
        at_s1 = bytes(wa.model)
        site.thinblock("b", "volume", "clone", pool, "s1", "c")
        sc = site.serve("b", pool, "--volume", "c", label="two-c")
        servers.append(sc)
        wc = Writer(sc, "c", 32 * MiB, 43)
        wc.model[:] = at_s1
        wc.check()
        _in_threads((wa, 60), (wb, 60), (wc, 60))
        for w in (wa, wb, wc):
            w.check()
        snap = _handle(sa, "s1")
        assert snap.pread(32 * MiB, 0) == at_s1
        snap.shutdown()
    finally:
        for server in servers:
            _stop(server)
    assert "metadata is consistent" in site.thinblock("b", "pool", "check", pool)


def test_a_host_cut_off_stops_serving_once_its_leases_run_out_and_the_other_takes_over(site: Site) -> None:
    """Host a serves va and wa; its link to the cluster is cut. Its workers stop
    serving once their leases could not be renewed for a whole lease (they may have
    been taken by then). Host b takes va over: its owner does not answer the notify,
    so it is fenced. b serves every byte a flushed; a's late write fails. Once the
    link is back, nothing a does lands: va reads what b holds."""
    pool = _pool(site, "cut", {"va": "32M", "wa": "32M"})
    sa = site.serve("a", pool, "--volume", "va", "--volume", "wa", label="cut-a")
    sb: Server | None = None
    try:
        wv, ww = Writer(sa, "va", 32 * MiB, 51), Writer(sa, "wa", 32 * MiB, 52)
        _in_threads((wv, 60), (ww, 60))  # each ends with a flush
        site.hosts.cut("a")
        cut_at = time.monotonic()
        until(
            lambda: sa.log.read_text().count("its lease is lost") >= 2, what="host a's workers to give their leases up"
        )
        stopped_after = time.monotonic() - cut_at
        assert "could not be renewed for its whole" in sa.log.read_text()
        assert stopped_after >= LEASE_S - 1, f"a stopped serving {stopped_after:.1f} s after the cut, within its lease"
        with pytest.raises(nbd.Error):  # a's worker serves va no more
            wv.h.pwrite(b"L" * (64 << 10), 0)
            wv.h.flush()
        sb = site.serve("b", pool, "--volume", "va", "--takeover", label="cut-b")
        log = sb.log.read_text()
        assert "fenc" in log, log
        wv.check(sb)  # every flushed byte
        site.hosts.heal("a")
        until(lambda: not sa.alive(), what="host a's server to stop, its volumes gone")
        text = sa.log.read_text()
        assert "Traceback" not in text and "not restarting it" in text, text
        wv.check(sb)  # nothing of a's landed
        wv2 = Writer(sb, "va", 32 * MiB, 53)
        wv2.model[:] = wv.model
        wv2.run(40)
        wv2.check()
    finally:
        site.hosts.heal("a")
        if sb is not None:
            _stop(sb)
        with contextlib.suppress(AssertionError):
            _stop(sa)
    assert "metadata is consistent" in site.thinblock("b", "pool", "check", pool)
