"""The one exception type of the data pipeline."""


class DataError(ValueError):
    """A one-line, user-facing problem with data files, inputs or settings (says what to do)."""
