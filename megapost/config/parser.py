"""An ArgumentParser whose errors are one line naming the flag and the nearest known one (no usage dump)."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Sequence
from typing import NoReturn

from megapost.config.errors import ConfigError, Errors, FlagError


def nearest_flag(flag: str, known: list[str]) -> str | None:
    """The known option string closest to ``flag`` (difflib), or None when nothing is close."""
    name = flag.split("=", 1)[0]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return close[0] if close else None


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors become a ``ConfigError``: ``error: --flg: unknown flag (nearest: --flag)``."""

    def known_flags(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def unknown_error(self, tokens: Sequence[str]) -> ConfigError:
        """One line per unknown flag of ``tokens`` (argparse's leftovers: flags and their values)."""
        flags = [a for a in tokens if a.startswith("-")] or list(tokens[:1])
        errors = Errors()
        for flag in flags:
            near = nearest_flag(flag, self.known_flags())
            errors.add(ConfigError(f"{flag}: unknown flag" + (f" (nearest: {near})" if near else "") +
                                   "; `megapost-pretrain --help` lists every flag"))
        error = errors.error()
        assert error is not None
        return error

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            raise self.unknown_error(unknown.group(1).split())
        argument = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
        if argument:
            flag, what = argument.groups()
            near = nearest_flag(flag, self.known_flags()) if "ambiguous" in what else None
            raise FlagError(flag, f"{flag}: {what}" + (f" (nearest: {near})" if near else ""))
        raise ConfigError(message)


def _without(parser: argparse.ArgumentParser, argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` (any of its spellings) and the values typed after it."""
    action = parser._option_string_actions.get(flag)
    names = set(action.option_strings) if action else {flag}
    out, skipping = [], False
    for token in argv:
        if token.split("=", 1)[0] in names:
            skipping = "=" not in token and (action is None or action.nargs != 0)
            continue
        if skipping and not token.startswith("--"):
            continue
        skipping = False
        out.append(token)
    return out


def parse_collecting(parser: OneLineParser, argv: Sequence[str], errors: Errors
                     ) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``argv``, keeping every flag error in ``errors`` (each unknown flag, each refused value)
    instead of stopping at the first; returns the namespace of the rest and the argv it was parsed from."""
    argv = list(argv)
    while True:
        try:
            args, unknown = parser.parse_known_args(argv)
        except FlagError as e:  # a value argparse refused: noted, the flag dropped, parsed again
            errors.add(e)
            shorter = _without(parser, argv, e.flag)
            if len(shorter) == len(argv):
                errors.raise_all()
            argv = shorter
            continue
        if unknown:
            errors.add(parser.unknown_error(unknown))
            argv = [a for a in argv if a not in unknown]
        return args, argv
