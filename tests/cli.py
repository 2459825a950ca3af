"""Run the real `thinblock` command line from tests."""

from __future__ import annotations

import os
import subprocess
import sys
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
