"""What every command module of the CLI shares: argument types, output, the usage error."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from thinblock.errors import ThinblockError, UsageError
from thinblock.sizes import parse_size

__all__ = ["UsageError", "emit", "size_arg"]  # UsageError lives in errors.py: the core raises it too


def size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ThinblockError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def emit(args: argparse.Namespace, data: Any, human: Callable[[Any], str]) -> None:
    print(json.dumps(data, indent=2) if getattr(args, "json", False) else human(data))
