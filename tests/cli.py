"""Run the real `thinblock` command line from tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def thinblock(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`python -m thinblock ARGS` as a process; never a traceback, exit 0 when check."""
    proc = subprocess.run(
        [sys.executable, "-m", "thinblock", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=300,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    if check:
        assert proc.returncode == 0, f"thinblock {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc


def export_bytes(pool: str, name: str) -> bytes:
    """Every byte of a volume or snapshot, through `thinblock export POOL NAME -`."""
    proc = subprocess.run(
        [sys.executable, "-m", "thinblock", "export", pool, name, "-"],
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def volume_names(pool: str) -> list[str]:
    """The names `volume list` shows, sorted."""
    return sorted(v["name"] for v in json.loads(thinblock("volume", "list", pool, "--json").stdout))


def fuse_daemon_pids(runtime_dir: Path) -> list[int]:
    """Pids of the FUSE daemons attach started under runtime_dir (its daemon.json
    records; a mount hosted by `thinblock serve` has no daemon of its own)."""
    pids = []
    for info_file in sorted(runtime_dir.glob("*/daemon.json")):
        try:
            info = json.loads(info_file.read_text())
        except (OSError, ValueError):
            continue
        if not info.get("hosted"):
            pids.append(int(info["pid"]))
    return pids


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False  # gone (a zombie still answers kill -0, so /proc decides)


def stop_pid(pid: int, word: str, grace_s: float = 30) -> None:
    """End process pid, and only if its command line still holds `word` (a pid
    reused by another process is left alone): SIGTERM, wait, then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            if word.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes() or not _running(pid):
                return
            os.kill(pid, sig)
        except (OSError, ProcessLookupError):
            return
        deadline = time.monotonic() + grace_s
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
