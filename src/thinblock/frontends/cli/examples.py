"""Two or three example command lines for every command, shown at the end of its
--help (and in the man page, which is built from the same parser).

Kept apart from the parser so the examples read as a whole, and checked by
tests/test_commands.py: every command has two or three, and each one parses with
the real parser, so an example cannot go out of date with the options it shows.
Keys are command paths as typed after `thinblock` ("pool create", "serve").
"""

from __future__ import annotations

EXAMPLES: dict[str, list[str]] = {
    "pool create": [
        "thinblock pool create /srv/pool --size 100G",
        "thinblock pool create /srv/pool --data /dev/disk/by-id/nvme-spare --block-size 128K",
        "thinblock pool create rados:rbd/vmpool --size 1T --object-size 4M",
    ],
    "pool status": [
        "thinblock pool status /srv/pool",
        "thinblock pool status rados:rbd/vmpool --json",
    ],
    "pool grow": [
        "thinblock pool grow /srv/pool --size 200G",
        "thinblock pool grow rados:rbd/vmpool --size 2T",
    ],
    "pool check": [
        "thinblock pool check /srv/pool",
        "thinblock pool check /srv/pool --json",
    ],
    "pool set": [
        "thinblock pool set /srv/pool --when-full wait:60",
        "thinblock pool set /srv/pool --low-water 10 --on-low-water 'logger pool low'",
        "thinblock pool set /srv/pool --autogrow 10G:500G",
    ],
    "pool dump": [
        "thinblock pool dump /srv/pool -o pool.dump",
        "thinblock pool dump /srv/pool --json -o pool.json",
    ],
    "pool restore": [
        "thinblock pool restore /srv/pool pool.dump",
        "thinblock pool restore /srv/pool pool.json --no-progress",
    ],
    "pool repair": [
        "thinblock pool repair /srv/pool",
        "thinblock pool repair /srv/pool --accept-rollback --json",
    ],
    "pool remove": [
        "thinblock pool remove /srv/pool",
        "thinblock pool remove /srv/pool --yes",
        "thinblock pool remove rados:rbd/vmpool --yes --json",
    ],
    "volume create": [
        "thinblock volume create /srv/pool vm1 --size 100G",
        "thinblock volume create /srv/pool scratch --size 1T --detect-zeroes unmap",
    ],
    "volume info": [
        "thinblock volume info /srv/pool vm1",
        "thinblock volume info /srv/pool vm1@nightly --json",
    ],
    "volume map": [
        "thinblock volume map /srv/pool vm1",
        "thinblock volume map /srv/pool vm1 -o vm1.png",
        "thinblock volume map rados:thinblock-test/vmpool vm1 -o vm1.svg --width 128",
    ],
    "volume list": [
        "thinblock volume list /srv/pool",
        "thinblock volume list rados:rbd/vmpool --json",
    ],
    "volume remove": [
        "thinblock volume remove /srv/pool vm1",
        "thinblock volume remove /srv/pool vm1 --json",
    ],
    "volume resize": [
        "thinblock volume resize /srv/pool vm1 --size 200G",
        "thinblock volume resize /srv/pool vm1 --size 50G --allow-shrink",
    ],
    "volume rename": [
        "thinblock volume rename /srv/pool vm1 web1",
        "thinblock volume rename rados:rbd/vmpool old-db db --json",
    ],
    "volume set": [
        "thinblock volume set /srv/pool vm1 --reserve full",
        "thinblock volume set /srv/pool vm1 --detect-zeroes unmap",
        "thinblock volume set /srv/pool vm1 --low-water 20 --on-low-water 'logger vm1 low'",
    ],
    "volume clone": [
        "thinblock volume clone /srv/pool golden@v1 vm2",
        "thinblock volume clone rados:rbd/vmpool base@2024 test-vm",
    ],
    "volume rollback": [
        "thinblock volume rollback /srv/pool vm1 vm1@before-upgrade",
        "thinblock volume rollback rados:rbd/vmpool db db@nightly",
    ],
    "volume sparsify": [
        "thinblock volume sparsify /srv/pool vm1",
        "thinblock volume sparsify rados:rbd/vmpool db",
    ],
    "import": [
        "thinblock import debian.qcow2 /srv/pool vm1",
        "thinblock import nbd://backup-host/disk0 /srv/pool restored",
        "xzcat disk.raw.xz | thinblock import - /srv/pool vm2 --size 20G",
    ],
    "export": [
        "thinblock export /srv/pool vm1 vm1.raw",
        "thinblock export /srv/pool vm1 vm1.rbd --format rbd   # with vm1's snapshots, for rbd import --export-format 2",
        "thinblock export /srv/pool vm1 nbd+unix:///disk?socket=/run/other.sock",
    ],
    "export-diff": [
        "thinblock export-diff /srv/pool vm1@tuesday vm1.diff --from-snap vm1@monday",
        "thinblock export-diff /srv/pool vm1 - --export-format 2",
    ],
    "import-diff": [
        "thinblock import-diff vm1.diff /backup/pool vm1",
        "thinblock import-diff - /backup/pool vm1 --allow-resize",
    ],
    "snapshot create": [
        "thinblock snapshot create /srv/pool vm1 before-upgrade",
        "thinblock snapshot create /srv/pool vm1@monday",
    ],
    "snapshot list": [
        "thinblock snapshot list /srv/pool",
        "thinblock snapshot list rados:rbd/vmpool --json",
    ],
    "snapshot rename": [
        "thinblock snapshot rename /srv/pool before-upgrade vm1@2024-06-01",
        "thinblock snapshot rename rados:rbd/vmpool db@tmp db@kept --json",
    ],
    "snapshot remove": [
        "thinblock snapshot remove /srv/pool vm1@monday",
        "thinblock snapshot remove /srv/pool before-upgrade --json",
    ],
    "delta": [
        "thinblock delta /srv/pool vm1@monday vm1@tuesday",
        "thinblock delta /srv/pool vm1@monday vm1 --json",
    ],
    "serve": [
        "thinblock serve /srv/pool",
        "thinblock serve /srv/pool --listen 0.0.0.0:10809 --tls-cert server.pem --tls-key server.key",
        "thinblock serve /srv/pool --metrics 9750   # Prometheus text on http://127.0.0.1:9750/metrics",
    ],
    "attach": [
        "thinblock attach /srv/pool vm1",
        "thinblock attach --list --json",
    ],
    "detach": [
        "thinblock detach /dev/loop3",
        "thinblock detach /srv/pool vm1",
    ],
    "mkfs": [
        "thinblock mkfs /srv/pool vm1",
        "thinblock mkfs /srv/pool data -t xfs",
        "thinblock mkfs /srv/pool vm1 --force -- -L root",
    ],
    "fuse-daemon": [
        "thinblock fuse-daemon /srv/pool /run/thinblock/0123456789ab/mnt",
        "thinblock fuse-daemon rados:rbd/vmpool /run/thinblock/ba9876543210/mnt",
    ],
    "quickstart": [
        "thinblock quickstart",
        "thinblock quickstart --pool /srv/pool --size 100G --volume vm1 --volume-size 1T",
    ],
    "completion": [
        "thinblock completion bash > /usr/share/bash-completion/completions/thinblock",
        "thinblock completion zsh > /usr/local/share/zsh/site-functions/_thinblock",
    ],
    "manpage": [
        "thinblock manpage > /usr/local/share/man/man1/thinblock.1",
        "thinblock manpage | man -l -",
    ],
}


def epilog(command: str) -> str | None:
    """The examples section for one command's --help, or None if it has none."""
    lines = EXAMPLES.get(command)
    if not lines:
        return None
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)
