"""FUSE mounts hosted by a process that already holds the pool.

`thinblock serve` holds its pool, so no FUSE daemon can open it. Instead,
`attach` asks the server over its control socket (verb `fuse_mount`) to mount
the pool's volumes itself, on a thread: the same VolumeFS, the same Volume
objects the NBD sessions use, the same locks. libfuse installs its signal
handlers only where the default action is set, and Python keeps its own for
SIGINT/SIGTERM, so the server's clean stop is unchanged.
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
from thinblock.frontends.fuse.attach import detach_all_under, is_mounted, release_pool_dir, runtime_dir_for
from thinblock.frontends.fuse.fs import mount

log = logging.getLogger("thinblock.fuse")


class MountHost:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.threads: dict[str, threading.Thread] = {}
        self.lock = threading.Lock()

    def mount(self, mountpoint: str) -> dict[str, Any]:
        """Mount the pool's volumes at mountpoint (an existing empty directory)."""
        mountpoint = os.path.realpath(mountpoint)
        own = os.path.realpath(runtime_dir_for(self.pool.location.key()) / "mnt")
        if mountpoint != own:
            # A control client names the place, but only this pool's runtime mount point
            # is allowed: never a directory of the client's choosing.
            raise ThinblockError(f"fuse_mount mounts this pool's volumes only at {own}, not at {mountpoint}")
        with self.lock:
            thread = self.threads.get(mountpoint)
            if thread is not None and thread.is_alive() and is_mounted(mountpoint):
                return {"pid": os.getpid()}
            if not os.path.isdir(mountpoint):
                raise ThinblockError(f"mount point {mountpoint} is not a directory")
            thread = threading.Thread(target=self._run, args=(mountpoint,), name="thinblock-fuse-hosted", daemon=True)
            self.threads[mountpoint] = thread
            thread.start()
            deadline = time.monotonic() + 30
            while not is_mounted(mountpoint):
                if not thread.is_alive() or time.monotonic() > deadline:
                    raise ThinblockError(f"could not mount the pool's volumes at {mountpoint}")
                time.sleep(0.05)
        log.info("serving the pool's volumes as files at %s (attach)", mountpoint)
        return {"pid": os.getpid()}

    def _run(self, mountpoint: str) -> None:
        try:
            mount(self.pool, mountpoint)
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
