"""A benchmark's result saved for the plan: one JSON file a kind, tagged with its format and when it was
measured, written atomically; read back only when the format is the one expected."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any


def save_result(path: str | Path, result_format: str, result: dict[str, Any]) -> Path:
    """Write `result` with `format` and `measured_at` added, atomically, to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "format": result_format,
        "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **result,
    }
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(body, indent=1))
    partial.replace(path)
    return path


def load_result(path: str | Path, result_format: str) -> dict[str, Any] | None:
    """The saved result, or None when there is none (or it is not of `result_format`)."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and result.get("format") == result_format else None
