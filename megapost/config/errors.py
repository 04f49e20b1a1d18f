"""The one exception type for bad flags, files or layouts: printed as one line, exit 1; and the collector
that reports every such error of a launch together, one line each."""

from __future__ import annotations

from types import TracebackType


class ConfigError(SystemExit):
    """A one-line configuration error, raised before any heavy work (several lines: several errors)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")

    @property
    def lines(self) -> list[str]:
        return str(self.code).splitlines()


class FlagError(ConfigError):
    """A ConfigError about one typed flag (``flag``: its option string), e.g. a value argparse refused."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(message)
        self.flag = flag


class Errors:
    """Collects ConfigErrors so a launch reports all of them at once: ``with errors:`` runs one check
    and keeps its error instead of raising it; ``raise_all()`` raises them together, one line each."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.errors: list[ConfigError] = []

    def __enter__(self) -> Errors:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if isinstance(error, ConfigError):
            self.add(error)
            return True
        return False

    def add(self, error: ConfigError) -> None:
        new = [line for line in error.lines if line not in self.lines]
        if new:
            self.lines += new
            self.errors.append(error)

    def error(self) -> ConfigError | None:
        """All the errors as one ConfigError (one line each; a single error as it was raised), None
        without any."""
        if len(self.errors) <= 1:
            return self.errors[0] if self.errors else None
        error = ConfigError("")
        error.code = "\n".join(self.lines)
        error.args = (error.code,)
        return error

    def raise_all(self) -> None:
        error = self.error()
        if error is not None:
            raise error
