"""An ArgumentParser whose errors are one line naming the flag and the nearest known one (no usage dump)."""

from __future__ import annotations

import argparse
import difflib
import re
from typing import NoReturn

from megapost.config.errors import ConfigError


def nearest_flag(flag: str, known: list[str]) -> str | None:
    """The known option string closest to ``flag`` (difflib), or None when nothing is close."""
    name = flag.split("=", 1)[0]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return close[0] if close else None


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors become a ``ConfigError``: ``error: --flg: unknown flag (nearest: --flag)``."""

    def known_flags(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = [a for a in unknown.group(1).split() if a.startswith("-")] or unknown.group(1).split()[:1]
            parts = []
            for flag in flags:
                near = nearest_flag(flag, self.known_flags())
                parts.append(f"{flag}: unknown flag" + (f" (nearest: {near})" if near else ""))
            raise ConfigError("; ".join(parts) + "; `megapost-pretrain --help` lists every flag")
        argument = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
        if argument:
            flag, what = argument.groups()
            near = nearest_flag(flag, self.known_flags()) if "ambiguous" in what else None
            raise ConfigError(f"{flag}: {what}" + (f" (nearest: {near})" if near else ""))
        raise ConfigError(message)
