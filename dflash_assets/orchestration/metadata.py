"""The core's results describe themselves as plain values (numbers, text, lists, mappings); this turns
them into Dagster metadata: numbers the UI plots across partitions, text, and JSON for the rest."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagster import MetadataValue


def dagster_metadata(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` as metadata entries; a value that already is a `MetadataValue` is kept as it is."""
    return {name: _entry(value) for name, value in values.items()}


def _entry(value: Any) -> Any:
    if isinstance(value, MetadataValue):
        return value
    if value is None:
        return MetadataValue.null()
    if isinstance(value, bool):
        return MetadataValue.bool(value)
    if isinstance(value, int):
        return MetadataValue.int(value)
    if isinstance(value, float):
        return MetadataValue.float(value)
    if isinstance(value, str):
        return MetadataValue.text(value)
    if isinstance(value, Mapping | list | tuple):
        return MetadataValue.json(value if isinstance(value, Mapping) else list(value))
    return MetadataValue.text(str(value))
