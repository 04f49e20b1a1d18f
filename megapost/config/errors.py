"""The one exception type for bad flags, files or layouts: printed as one line, exit 1."""

from __future__ import annotations


class ConfigError(SystemExit):
    """A one-line configuration error, raised before any heavy work."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")
