"""Loop devices follow their volume's size: after a resize, each one on the volume's
file is told (LOOP_SET_CAPACITY, what `losetup -c` does), as `rbd resize` grows a
mapped image and `lvextend` a logical volume, so resize2fs can grow a mounted
filesystem at once.

The loop driver takes the new size from the kernel's idea of the file's size, which
FUSE caches (attr_timeout): `refresh` (fuse/fs.py) makes that right first. A device
that still shows another size after a few tries is a warning naming `losetup -c DEV`;
it never fails the resize, whose metadata change is done by then.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

from thinblock.sizes import format_size

LOOP_SET_CAPACITY = 0x4C07  # linux/loop.h
BLKGETSIZE64 = 0x80081272  # linux/fs.h: _IOR(0x12, 114, size_t)
SYS_BLOCK = Path("/sys/block")
TRIES = 20  # over about 2 s: more than FUSE's default attr_timeout (1 s), were invalidation to fail
PAUSE_S = 0.1


def loops_on(path: str) -> list[str]:
    """The loop devices whose backing file is path, as the kernel has them."""
    target = os.path.realpath(path)
    found = []
    for backing in sorted(SYS_BLOCK.glob("loop*/loop/backing_file")):
        try:
            if backing.read_text().rstrip("\n") == target:
                found.append(f"/dev/{backing.parent.parent.name}")
        except OSError:
            continue  # detached meanwhile
    return found


def device_size(device: str) -> int:
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return int(struct.unpack("Q", fcntl.ioctl(fd, BLKGETSIZE64, b"\0" * 8))[0])
    finally:
        os.close(fd)


def set_capacity(device: str) -> None:
    """LOOP_SET_CAPACITY: the device takes its backing file's current size. It needs
    CAP_SYS_ADMIN or the device open for writing: a read-only open is tried first (a
    write open makes udev rescan the device when it closes)."""
    for flags in (os.O_RDONLY, os.O_RDWR):
        fd = os.open(device, flags | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, LOOP_SET_CAPACITY, 0)
            return
        except PermissionError:
            if flags == os.O_RDWR:
                raise
        finally:
            os.close(fd)


def follow_size(path: str, size_bytes: int, refresh: Callable[[], None] = lambda: None) -> list[str]:
    """Make every loop device on the file at path show size_bytes (rounded down to whole
    512-byte sectors, as the loop driver does); warnings for those that could not be made
    to. refresh makes the kernel see the file's new size (called before each try)."""
    warnings = []
    for device in loops_on(path):
        problem = _follow(path, device, size_bytes // 512 * 512, refresh)
        if problem:
            warnings.append(
                f"{device} (volume {os.path.basename(path)}) does not show its new size {format_size(size_bytes)}"
                f" ({problem}): run 'losetup -c {device}' to make it"
            )
    return warnings


def _follow(path: str, device: str, want: int, refresh: Callable[[], None]) -> str:
    """Why device does not show want bytes after a few tries; "" once it does."""
    problem = ""
    for attempt in range(TRIES):
        if attempt:
            time.sleep(PAUSE_S)
        try:
            refresh()
            set_capacity(device)
            shown = device_size(device)
        except PermissionError as exc:
            return f"LOOP_SET_CAPACITY: {exc.strerror or exc}"  # trying again changes nothing
        except OSError as exc:
            if device not in loops_on(path):
                return ""  # detached meanwhile: nothing left to grow
            problem = f"LOOP_SET_CAPACITY: {exc.strerror or exc}"
            continue
        if shown == want:
            return ""
        problem = f"it shows {format_size(shown)}"
    return problem
