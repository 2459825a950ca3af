"""FUSE mounts hosted by a process that already holds the pool.

`thinblock serve` holds its pool, so no FUSE daemon can open it. Instead,
`attach` asks the server over its control socket (verb `fuse_mount`) to mount
the pool's volumes itself, on a thread: the same VolumeFS, the same Volume
objects the NBD sessions use, the same locks. libfuse installs its signal
handlers only where the default action is set, and Python keeps its own for
SIGINT/SIGTERM, so the server's clean stop is unchanged.

A server per volume (serve --volume) hosts each of its volumes, or the snapshots
taken of them, on a mount of its own (fuse/attach.py's volume_dir_for), showing
that one name only: another server's volumes are never reachable through it. It
refuses to hand over a volume while it hosts it (`refuse_release`): the loop
device's open file cannot be hung up as an NBD client can.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from thinblock.core.pool import Pool
from thinblock.errors import ThinblockError
from thinblock.frontends.fuse.attach import (
    detach_all_under,
    is_mounted,
    release_pool_dir,
    runtime_dir_for,
    volume_dir_for,
)
from thinblock.frontends.fuse.fs import mount

log = logging.getLogger("thinblock.fuse")


class MountHost:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.threads: dict[str, threading.Thread] = {}
        self.only: dict[str, str | None] = {}  # mount point -> the one name it shows (None: all)
        self.lock = threading.Lock()

    def _shows(self, mountpoint: str) -> str | None:
        """What may be mounted at mountpoint: the whole pool (None) at the pool's runtime
        mount point, or for an owner per volume one name it serves at that name's.
        A control client names the place, but only these are allowed: never a
        directory of the client's choosing."""
        key = self.pool.location.key()
        if self.pool.owner is None:
            own = os.path.realpath(runtime_dir_for(key) / "mnt")
            if mountpoint == own:
                return None
            raise ThinblockError(f"fuse_mount mounts this pool's volumes only at {own}, not at {mountpoint}")
        for name, vol in self.pool.visible().items():
            if self.pool.serves(vol) and mountpoint == os.path.realpath(volume_dir_for(key, name) / "mnt"):
                return name
        raise ThinblockError(f"fuse_mount: {mountpoint} is not the mount point of a volume this server serves")

    def refuse_release(self, name: str) -> None:
        """ThinblockError if a mount hosted here shows volume `name` or a snapshot of it."""
        vid = self.pool.volume(name, kind="volume").row.id
        with self.lock:
            live = [(m, n) for m, n in self.only.items() if n is not None and self.threads[m].is_alive()]
        for mountpoint, shown in live:
            vol = self.pool.visible_volume(shown)
            if vol is not None and self.pool.base_volume_id(vol) == vid and is_mounted(mountpoint):
                raise ThinblockError(
                    f"volume {name} is attached through this server ({shown} is a file of its FUSE mount, under a"
                    f" loop device): detach it first ('thinblock detach POOL {shown}'), then hand it over"
                )

    def mount(self, mountpoint: str) -> dict[str, Any]:
        """Mount the pool's volumes (or the one volume of an owner per volume it names)
        at mountpoint (an existing empty directory)."""
        mountpoint = os.path.realpath(mountpoint)
        only = self._shows(mountpoint)
        with self.lock:
            thread = self.threads.get(mountpoint)
            if thread is not None and thread.is_alive() and is_mounted(mountpoint):
                return {"pid": os.getpid()}
            if not os.path.isdir(mountpoint):
                raise ThinblockError(f"mount point {mountpoint} is not a directory")
            thread = threading.Thread(
                target=self._run, args=(mountpoint, only), name="thinblock-fuse-hosted", daemon=True
            )
            self.threads[mountpoint] = thread
            self.only[mountpoint] = only
            thread.start()
            deadline = time.monotonic() + 30
            while not is_mounted(mountpoint):
                if not thread.is_alive() or time.monotonic() > deadline:
                    raise ThinblockError(f"could not mount the pool's volumes at {mountpoint}")
                time.sleep(0.05)
        log.info("serving the pool's volumes as files at %s (attach)", mountpoint)
        return {"pid": os.getpid()}

    def _run(self, mountpoint: str, only: str | None) -> None:
        try:
            mount(self.pool, mountpoint, only=only)
        except Exception:
            log.exception("hosted FUSE mount at %s failed", mountpoint)
        log.info("hosted FUSE mount at %s ended", mountpoint)

    def close(self) -> None:
        """Unmount everything hosted. Loop devices on it are detached first: the server
        is going, and a device bound to a file that no longer exists would outlive it
        (one still open, by a mounted filesystem, goes when it is closed)."""
        with self.lock:
            threads = dict(self.threads)
        for mountpoint, thread in threads.items():
            if thread.is_alive():
                for device in detach_all_under(mountpoint):
                    log.warning("detached %s: its volume's server is stopping", device)
                busy = subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True, check=False)
                if busy.returncode != 0:
                    log.warning("%s is still in use (attached loop devices): unmounting lazily", mountpoint)
                    subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True, check=False)
                thread.join(timeout=10)
        for mountpoint in threads:
            release_pool_dir(Path(mountpoint).parent, os.getpid())  # the pool's runtime folder goes with us
