"""`thinblock mkfs`: format a volume using what the pool knows about its zeros.

If no block of the volume holds data (all UNMAPPED or ZEROED), the storage is
known to read zero and mke2fs gets `-E assume_storage_prezeroed=1` (it then
skips zeroing inode tables and the journal). mkfs.xfs has no such hint; the
pool makes its discards and zeroing cheap anyway. The hint is never passed
when any block holds data, and then the volume is formatted only with --force:
the same guard for both filesystems, naming what blkid found (or how many
bytes of data), instead of mke2fs's and mkfs.xfs's different ones.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

from thinblock.core.pool import read_status
from thinblock.errors import ThinblockError
from thinblock.frontends.fuse.attach import attach, backing_file, detach, list_attached, require_loop_devices
from thinblock.sizes import format_size


def _volume_status(pool: str, volume: str, device: str) -> tuple[dict[str, Any], int]:
    """The volume's figures and the pool's used bytes, after making the daemon commit
    (through the file under the device: the pool's mount, or the volume's own)."""
    fd = os.open(backing_file(device), os.O_RDONLY)
    try:
        os.fsync(fd)  # FUSE fsync -> Volume.flush -> a pool commit
    finally:
        os.close(fd)
    status = read_status(pool)
    vol = next(v for v in status["volumes"] if v["name"] == volume)
    return vol, int(status["used_bytes"])


def _signature(device: str) -> str | None:
    """What blkid's low-level probe finds on the device (a filesystem, a partition table...)."""
    proc = subprocess.run(
        ["blkid", "-p", "-o", "export", device], capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL
    )
    fields = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    if "TYPE" in fields:
        label = f" labelled {fields['LABEL']!r}" if fields.get("LABEL") else ""
        return f"a {fields.get('USAGE', 'filesystem')} signature: {fields['TYPE']}{label}"
    if "PTTYPE" in fields:
        return f"a partition table: {fields['PTTYPE']}"
    return None


def _refuse_data(volume: str, device: str, data_bytes: int) -> None:
    found = _signature(device) or f"{data_bytes} bytes of data ({format_size(data_bytes)})"
    raise ThinblockError(
        f"volume {volume} holds {found} (blkid): formatting would destroy it; use --force to format it anyway"
    )


def format_volume(pool: str, volume: str, fstype: str, extra: list[str], *, force: bool = False) -> dict[str, Any]:
    """Format a volume; one that holds any data is refused unless force (both filesystems alike)."""
    if fstype not in ("ext4", "xfs"):
        raise ThinblockError(f"unsupported filesystem type {fstype!r}: use ext4 or xfs")
    require_loop_devices()
    kind = next((v["kind"] for v in read_status(pool)["volumes"] if v["name"] == volume), None)
    if kind == "snapshot":  # read-only: refused before anything is attached
        raise ThinblockError(
            f"cannot format {volume}: it is a snapshot, read-only; clone it"
            f" ('thinblock volume clone POOL {volume} NEWVOLUME') and format the clone"
        )
    real = os.path.realpath(pool)
    was_attached = any(a.pool == real and a.volume == volume for a in list_attached())
    device = attach(pool, volume)
    try:
        vol, used_before = _volume_status(pool, volume, device)
        prezeroed = vol["data_bytes"] == 0
        if not prezeroed and not force:
            _refuse_data(volume, device, int(vol["data_bytes"]))
        # The check above is the guard; the formatters' own (which differ) are then overridden.
        if fstype == "ext4":
            cmd = ["mke2fs", "-t", "ext4", *(["-F"] if force else [])]
            if prezeroed:
                cmd += ["-E", "assume_storage_prezeroed=1"]
            cmd += [*extra, device]
        else:
            cmd = ["mkfs.xfs", *(["-f"] if force else []), *extra, device]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise ThinblockError(f"{cmd[0]} failed: {proc.stderr.strip() or proc.stdout.strip()}")
        vol_after, used_after = _volume_status(pool, volume, device)
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
