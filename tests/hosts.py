"""Other hosts, for tests of servers per volume on a Ceph pool.

`other_host(name)` is a command prefix that runs a process with a host name of
its own (a UTS namespace): thinblock then takes the servers named by the leases
for servers on another host, so their control sockets are out of reach and
requests go by RADOS watch/notify, as between two machines. The network is this
host's (the test cluster listens on 127.0.0.1).
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.cli import ROOT


def other_host(name: str) -> list[str]:
    return ["unshare", "--uts", "--", "sh", "-c", f'hostname {name} && exec "$@"', "sh"]


def thinblock_on(
    host: list[str], *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m thinblock ARGS` run with that prefix (and env added to this process's
    variables); never a traceback, exit 0 when check."""
    proc = subprocess.run(
        [*host, sys.executable, "-m", "thinblock", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {}), "PYTHONPATH": str(ROOT / "src")},
        timeout=300,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    if check:
        assert proc.returncode == 0, f"thinblock {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc
