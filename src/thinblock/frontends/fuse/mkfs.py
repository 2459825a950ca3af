"""`thinblock mkfs`: format a volume using what the pool knows about its zeros.

If no block of the volume holds data (all UNMAPPED or ZEROED), the storage is
known to read zero and mke2fs gets `-E assume_storage_prezeroed=1` (it then
skips zeroing inode tables and the journal). mkfs.xfs has no such hint; the
pool makes its discards and zeroing cheap anyway. The hint is never passed
when any block holds data.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from thinblock.core.pool import read_status
from thinblock.errors import ThinblockError
from thinblock.frontends.fuse.attach import _pool_dir, attach, detach, list_attached


def _volume_status(pool: str, volume: str) -> tuple[dict[str, Any], int]:
    """The volume's figures and the pool's used bytes, after making the daemon commit."""
    path = _pool_dir(pool) / "mnt" / volume
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # FUSE fsync -> Volume.flush -> a pool commit
    finally:
        os.close(fd)
    status = read_status(pool)
    vol = next(v for v in status["volumes"] if v["name"] == volume)
    return vol, int(status["used_bytes"])


def format_volume(pool: str, volume: str, fstype: str, extra: list[str]) -> dict[str, Any]:
    if fstype not in ("ext4", "xfs"):
        raise ThinblockError(f"unsupported filesystem type {fstype!r}: use ext4 or xfs")
    real = os.path.realpath(pool)
    was_attached = any(a.pool == real and a.volume == volume for a in list_attached())
    device = attach(pool, volume)
    try:
        vol, used_before = _volume_status(pool, volume)
        prezeroed = vol["data_bytes"] == 0
        if fstype == "ext4":
            cmd = ["mke2fs", "-t", "ext4", "-F"]
            if prezeroed:
                cmd += ["-E", "assume_storage_prezeroed=1"]
            cmd += [*extra, device]
        else:
            cmd = ["mkfs.xfs", *extra, device]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise ThinblockError(f"{cmd[0]} failed: {proc.stderr.strip() or proc.stdout.strip()}")
        vol_after, used_after = _volume_status(pool, volume)
    finally:
        if not was_attached:
            detach(device)
    return {
        "pool": pool,
        "volume": volume,
        "fstype": fstype,
        "device": device,
        "prezeroed_hint": prezeroed and fstype == "ext4",
        "storage_was_zero": prezeroed,
        "command": cmd,
        "seconds": elapsed,
        "pool_bytes_used": used_after - used_before,
        "volume_mapped_bytes": vol_after["mapped_bytes"],
        "volume_bytes": vol_after["size_bytes"],
        "percent_of_volume": 100.0 * vol_after["mapped_bytes"] / vol_after["size_bytes"],
    }
