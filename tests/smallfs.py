"""A small real filesystem for tests that need the host disk to fill up: ext4 in a
sparse file, loop-mounted, removed afterwards."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def small_ext4(where: Path, size_mib: int) -> Iterator[Path]:
    """ext4 of size_mib MiB mounted at where/mnt (no blocks reserved for root, so a
    root process sees it full when a user would)."""
    image, mnt = where / "fs.img", where / "mnt"
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, capture_output=True)
    mnt.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], check=False, capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


def remount(mnt: Path, *, read_only: bool) -> None:
    subprocess.run(["mount", "-o", f"remount,{'ro' if read_only else 'rw'}", str(mnt)], check=True)


def host_free(path: Path | str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
