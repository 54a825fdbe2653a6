"""Sizes in human units, for log lines and run tags (no torch: the Dagster layer imports it at load)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """`1536` -> `1.5 KiB`; whole bytes below 1 KiB, one decimal above, up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
