"""The errors a dataset raises as a whole, below every module that reads one (datasets.py, sharegpt.py)."""

from __future__ import annotations


class DatasetError(ValueError):
    """The dataset as a whole cannot be used (wrong format, missing column, too many bad rows)."""


class DatasetNotFound(DatasetError, FileNotFoundError):
    pass
