"""`serve --config FILE`: a TOML file holding what `serve` otherwise takes on its
command line, read with the standard library's tomllib.

The keys are the command's own options, read from its argparse parser, so an
option added to `serve` is a key at once: `max-connections = 64` (or
`max_connections`), `insecure = true`, `pool = "/var/lib/thinblock/pool1"` for
the POOL argument. A value becomes the option's default, so the command line
overrides the file. Each value is checked as the option checks it (its type
and choices); an unknown key, a wrong type or an unreadable file is one
sentence (a usage error).
"""

from __future__ import annotations

import argparse
import tomllib
from typing import Any

from thinblock.frontends.cli.common import UsageError

# Options that make no sense in a file (--config itself, --help).
_NOT_IN_FILE = {"config", "help", "func"}


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's options and arguments by key (dest, and dest with '-')."""
    found: dict[str, argparse.Action] = {}
    for action in parser._actions:  # argparse keeps its actions only here
        if action.dest in _NOT_IN_FILE or action.dest == argparse.SUPPRESS:
            continue
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        found[action.dest] = action
        found[action.dest.replace("_", "-")] = action
    return found


def _key_name(action: argparse.Action) -> str:
    return action.dest.replace("_", "-")


def _value(path: str, action: argparse.Action, value: Any) -> Any:
    """value checked and converted as the command line would (raises UsageError)."""
    key = _key_name(action)
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise UsageError(f"{path}: {key} must be true or false, not {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list):
            raise UsageError(f'{path}: {key} must be a list, such as ["a", "b"]')
        return [_one(path, action, item) for item in value]
    if not isinstance(action, argparse._StoreAction) or action.nargs not in (None, "?"):
        raise UsageError(f"{path}: {key} cannot be set in a configuration file")
    return _one(path, action, value)


OCTAL_MODES = ("socket_mode", "mode")  # options read as octal text: a TOML number is refused


def _one(path: str, action: argparse.Action, value: Any) -> Any:
    key = _key_name(action)
    kind = action.type
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise UsageError(f"{path}: {key} must be {_wanted(action)}, not {value!r}")
    if kind is int and not isinstance(value, int):
        raise UsageError(f"{path}: {key} must be a whole number, not {value!r}")
    if kind is float:
        converted: Any = float(value) if not isinstance(value, str) else None
        if converted is None:
            raise UsageError(f"{path}: {key} must be a number, not {value!r}")
    elif kind is None or kind is str:
        if isinstance(value, float):
            raise UsageError(f"{path}: {key} must be a string, not {value!r}")
        if action.dest in OCTAL_MODES and not isinstance(value, str):
            # TOML reads 0o620 as the number 400, which would then be taken as octal 400.
            raise UsageError(f'{path}: {key} must be a string such as "0660" (an octal mode), not {value!r}')
        converted = str(value)
    elif callable(kind) and kind is not int:
        try:
            converted = kind(str(value))
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise UsageError(f"{path}: {key}: {exc}") from None
    else:
        converted = value
    if action.choices is not None and converted not in action.choices:
        choices = ", ".join(repr(c) for c in action.choices)
        raise UsageError(f"{path}: {key} must be one of {choices}, not {value!r}")
    return converted


def _wanted(action: argparse.Action) -> str:
    if action.type is int:
        return "a whole number"
    return "a number" if action.type is float else "a string"


def load(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The file's settings for parser's command, by dest (raises UsageError)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"configuration file {path} does not exist") from None
    except OSError as exc:
        raise UsageError(f"cannot read the configuration file {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"configuration file {path} is not valid TOML: {exc}") from None
    actions = _actions(parser)
    settings: dict[str, Any] = {}
    for key, value in data.items():
        action = actions.get(key)
        if action is None:
            known = ", ".join(sorted({_key_name(a) for a in actions.values()}))
            raise UsageError(f"{path}: unknown setting {key!r} (the settings are {known})")
        if action.dest in settings:
            raise UsageError(f"{path}: {_key_name(action)} is set twice")
        settings[action.dest] = _value(path, action, value)
    return settings


def apply(top: argparse.ArgumentParser, command: argparse.ArgumentParser, path: str) -> None:
    """Make the file's settings the defaults of command (a subparser of top), so
    that parsing the command line again lets each option given there win. An
    option command shares with top (--wait before or after the command) becomes
    top's default, since command leaves it unset unless it is given there."""
    settings = load(path, command)
    top_dests = {a.dest for a in top._actions}
    own: dict[str, Any] = {}
    shared: dict[str, Any] = {}
    for dest, value in settings.items():
        action = _actions(command)[dest]
        (shared if action.default is argparse.SUPPRESS and dest in top_dests else own)[dest] = value
    command.set_defaults(**own)
    top.set_defaults(**shared)


def subparser(top: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of command `name` under top."""
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(name)
            if isinstance(chosen, argparse.ArgumentParser):
                return chosen
    raise KeyError(name)
