"""The ``tpserve`` commands' help text: every flag's line ends with its default, spelled one way.

Shared by :mod:`tpserve.cli` and :mod:`tpserve.bench.cli` (``tpserve bench`` declares its own flags).
"""

from __future__ import annotations

import argparse
import re
from typing import NoReturn


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose own errors (an unknown flag, a value outside ``choices``, a missing
    argument) are one line, as the commands' other flag errors are: the command, argparse's message and
    where the flags are listed, exit status 2. argparse prints the whole usage first, about 55 lines for
    ``tpserve serve``, which buries the one that matters. Sub-commands' parsers are of this class too
    (``add_subparsers`` makes them of their parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists the flags)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help line ends with its default where it has one (argparse's
    ``ArgumentDefaultsHelpFormatter`` would also print "None" and "False"); a help text that
    already says its default keeps its own words. The API key's default (from
    ``$TPSERVE_API_KEY``) is never shown."""

    def _default(self, action: argparse.Action) -> object:
        return action.default

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if "default" in help_:  # one spelling for every flag: "(default: X)", "; default: X"
            return _DEFAULT_SPELLING.sub(r"\1default: ", help_)
        if not action.option_strings or action.dest in ("api_key", "operator_api_key", "help", "version"):
            return help_
        default = self._default(action)
        # `is`: a default of 0 (--node-rank) is shown, though 0 == False
        if default is None or default is False or default in ([], (), "") or default is argparse.SUPPRESS:
            return help_
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{help_} (default: {shown})".replace("%", "%%")


#: A help text's own "(default X" or "; default X", written as the formatter writes defaults.
_DEFAULT_SPELLING = re.compile(r"([(;] ?)default (?!:)")
