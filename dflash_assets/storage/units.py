"""Sizes and durations in human units, for log lines, run tags and the terminal (no torch: the Dagster
layer imports it at load)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """`1536` -> `1.5 KiB`; whole bytes below 1 KiB, one decimal above, up to TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_duration(seconds: float) -> str:
    """`725` -> `12m05s`, `3725` -> `1h02m`, `42` -> `42s`."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
