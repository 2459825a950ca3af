"""The man page and the shell completion scripts, built from the command line's own
parser (argparse-manpage and shtab), so that neither can drift from --help.

`thinblock manpage` and `thinblock completion bash|zsh` print them; scripts/setup
installs what they print. Each command's examples (cli/examples.py) close its
--help; the man page gathers them all in one EXAMPLES section.
"""

from __future__ import annotations

import argparse

from thinblock import __version__
from thinblock.frontends.cli.examples import EXAMPLES

SHELLS = ("bash", "zsh")


def _roff(text: str) -> str:
    """Text as roff shows it literally: backslashes and hyphens escaped, no line
    starting with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\\&" + text if text.startswith((".", "'")) else text


def manpage(parser: argparse.ArgumentParser) -> str:
    """thinblock(1): every command with its arguments and options, then the examples."""
    from argparse_manpage.manpage import Manpage

    page = Manpage(
        parser,
        {
            "project_name": "thinblock",
            "version": __version__,
            "manual_title": "thinblock manual",
            "manual_section": "1",
            "description": "thin-provisioned block storage that treats zeros as free",
            "url": "the docs/ directory of the thinblock repository",
        },
    )
    examples = []
    for command, lines in EXAMPLES.items():
        examples += [f".SS {_roff(command)}", ".nf", *(_roff(line) for line in lines), ".fi"]
    page.add_section("examples", "=", "\n".join(examples))
    return str(page)


def completion(parser: argparse.ArgumentParser, shell: str) -> str:
    """The completion script for shell (bash: a function _shtab_thinblock, bound to
    `thinblock` by `complete`; zsh: a #compdef file for site-functions)."""
    import shtab

    return str(shtab.complete(parser, shell=shell))
