"""Named crash points for crash-consistency tests.

`DFLASH_FAULT_POINTS=before_manifest` (comma-separated names, optionally `name@N` for the N-th time
the point is reached) makes the process SIGKILL itself there: the same death as a lost node or an
OOM kill, at a moment a test chooses. Unset in production, where a fault point is one lookup. The
setting is read where the point is reached (it is a process's own test hook, not a value a caller could
pass down), through `settings` like every other.
"""

from __future__ import annotations

import os
import signal

from dflash_assets import settings

_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = settings.fault_points()
    if not spec:
        return
    for entry in spec.split(","):
        point, _, nth = entry.strip().partition("@")
        if point != name:
            continue
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] >= int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)
