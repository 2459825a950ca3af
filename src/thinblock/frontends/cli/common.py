"""What every command module of the CLI shares: argument types, output, the usage error."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from thinblock.admin.access import open_admin
from thinblock.errors import ThinblockError, UsageError
from thinblock.frontends.cli.progress import progress_bar
from thinblock.sizes import parse_size

__all__ = ["UsageError", "admin_call", "emit", "size_arg"]  # UsageError lives in errors.py: the core raises it too


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ThinblockError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    print(json.dumps(data, indent=2) if getattr(args, "json", False) else human(data))


def admin_call(pool: str, verb: str, **args: Any) -> Any:
    """One administration verb on the pool, directly or through its server (admin.open_admin)."""
    with progress_bar("recovering free space", sys.stderr.isatty()) as bar, open_admin(pool, progress=bar) as admin:
        return admin.call(verb, **args)
