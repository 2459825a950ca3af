"""Where thinblock's log goes and what a line looks like: one place for the long-
running commands (`serve`, the FUSE daemon `attach` starts) to set it up from
their --log-level, --log-file and --log-format options.

Every logger is a child of `thinblock` (thinblock.nbd, thinblock.pool, ...), so
one handler on that logger takes them all; other libraries' loggers are left
alone. A line is either text (time, logger, level, message) or one JSON object
(time in ISO 8601 UTC, level, logger, message, and the extra fields a call gave,
such as a long step's elapsed_s). Whatever a message holds, it stays one line:
text lines escape control characters (logtext.shown), JSON escapes them itself,
and a traceback goes in its own field (JSON) or below its line (text, indented).
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import logging
import logging.handlers
import os
import sys
from typing import Any

from thinblock.errors import ThinblockError
from thinblock.logtext import shown
from thinblock.privacy import PRIVATE_FILE

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FORMATS = ("text", "json")
ROOT_LOGGER = "thinblock"

# Attributes every LogRecord has; anything else on a record came from extra={...}.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def add_log_options(parser: argparse.ArgumentParser) -> None:
    """--log-level, --log-file and --log-format, for a command that runs for long."""
    parser.add_argument(
        "--log-level", choices=tuple(LEVELS), default="info", help="least important lines logged (default info)"
    )
    parser.add_argument("--log-file", metavar="PATH", help="append the log to PATH (mode 0600) instead of stderr")
    parser.add_argument(
        "--log-format", choices=FORMATS, default="text", help="text lines, or one JSON object a line (default text)"
    )


def log_arguments(args: argparse.Namespace) -> list[str]:
    """The log options of args again, as command-line words (for a child process, such
    as the FUSE daemon attach starts, whose log goes the same way)."""
    words = ["--log-level", args.log_level, "--log-format", args.log_format]
    if args.log_file:
        words += ["--log-file", os.path.abspath(args.log_file)]
    return words


class TextFormatter(logging.Formatter):
    """`2026-01-02 03:04:05,678 thinblock.nbd warning: message`, one line whatever
    the message holds (a traceback follows, each of its lines indented)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(name)s %(levelname_lower)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.levelname_lower = record.levelname.lower()
        message = record.getMessage()
        if (worker := getattr(record, "worker", None)) is not None:  # serve --workers: which one said it
            message = f"[worker {worker}] {message}"
        safe = logging.makeLogRecord({**vars(record), "msg": _one_line(message), "args": None})
        safe.exc_info, safe.exc_text, safe.stack_info = None, None, None
        line = super().format(safe)
        if record.exc_info:
            line += "\n" + "\n".join(
                "    " + shown(part) for part in self.formatException(record.exc_info).splitlines()
            )
        return line


class JSONFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, the
    record's extra fields, and exception (the traceback) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        entry: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry and key != "levelname_lower":
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def _one_line(text: str) -> str:
    """text unchanged if printable, else escaped whole (so nothing in it starts a line)."""
    return text if text.isprintable() else shown(text)


class _PrivateFileHandler(logging.handlers.WatchedFileHandler):
    """A log file created 0600 (log lines name exports and clients), reopened when
    logrotate moves it away."""

    def _open(self) -> io.TextIOWrapper:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE)
        return open(fd, "a", encoding="utf-8", errors="backslashreplace")


def configure(level: str = "info", path: str | None = None, fmt: str = "text") -> logging.Handler:
    """Send every thinblock logger's lines at level or above to path (or stderr), in
    fmt; replaces what an earlier call set up. Raises ThinblockError when the file
    cannot be opened."""
    if path:
        try:
            handler: logging.Handler = _PrivateFileHandler(path, encoding="utf-8")
        except OSError as exc:
            raise ThinblockError(f"cannot write the log file {path}: {exc.strerror or exc}") from None
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger(ROOT_LOGGER)
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
    root.propagate = False  # the lines go here once, not again through the root logger
    return handler


class WorkerTag(logging.Filter):
    """Marks every line of one worker of serve --workers with its index (`[worker 1]`
    in text, "worker": 1 in JSON), since the workers share the log."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.index
        return True


def configure_from(args: argparse.Namespace) -> logging.Handler:
    """configure() from the options add_log_options added."""
    return configure(args.log_level, args.log_file, args.log_format)
