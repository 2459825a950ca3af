"""Hosts as network namespaces, for the Ceph tests of servers on several hosts.

`Hosts` makes one namespace for a Ceph cluster (its daemons listen on
CLUSTER_ADDR, on that namespace's loopback) and one per host, each linked to the
cluster's by a veth pair of its own and routed to CLUSTER_ADDR through it. Only
namespaces made here get addresses or routes; the machine's own network is never
touched. `cut(host)` takes that host's link down (a partition) and `heal(host)`
brings it back. Processes run in a host with `prefix(host)`, which also gives them
the host's name (a UTS namespace), so thinblock takes each for another machine.
Unix sockets are files: the test reaches the servers through them from here.
"""

from __future__ import annotations

import subprocess
import uuid

CLUSTER_ADDR = "10.213.0.1"


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")


class Hosts:
    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.cluster = f"tb{self.tag}c"
        self.hosts: dict[str, int] = {}  # host name -> its link's number
        self.made: list[str] = []
        try:
            self._add_ns(self.cluster)
            _ip("-n", self.cluster, "addr", "add", f"{CLUSTER_ADDR}/32", "dev", "lo")
        except BaseException:
            self.close()
            raise

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def ns(self, host: str) -> str:
        return f"tb{self.tag}{host}"

    def _link(self, host: str) -> str:
        return f"v{self.tag}{host}"

    def add(self, host: str) -> None:
        """A host named `host` (a letter or two), linked to the cluster."""
        n = len(self.hosts) + 1
        self.hosts[host] = n
        ns, link = self.ns(host), self._link(host)
        self._add_ns(ns)
        _ip("-n", ns, "link", "add", link, "type", "veth", "peer", "name", f"{link}c", "netns", self.cluster)
        _ip("-n", self.cluster, "addr", "add", f"10.213.{n}.1/24", "dev", f"{link}c")
        _ip("-n", self.cluster, "link", "set", f"{link}c", "up")
        _ip("-n", ns, "addr", "add", f"10.213.{n}.2/24", "dev", link)
        self.heal(host)

    def cut(self, host: str) -> None:
        _ip("-n", self.ns(host), "link", "set", self._link(host), "down")

    def heal(self, host: str) -> None:
        n = self.hosts[host]
        _ip("-n", self.ns(host), "link", "set", self._link(host), "up")
        _ip("-n", self.ns(host), "route", "replace", f"{CLUSTER_ADDR}/32", "via", f"10.213.{n}.1")

    def prefix(self, host: str) -> list[str]:
        """Run a command on that host: its network namespace, and its own host name."""
        name = f"host-{host}"
        return [
            "ip",
            "netns",
            "exec",
            self.ns(host),
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            f'hostname {name} && exec "$@"',
            "sh",
        ]

    def close(self) -> None:
        """Delete the namespaces made here (their links go with them)."""
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        self.made.clear()
