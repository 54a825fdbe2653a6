"""Named crash points for crash-consistency tests.

`DFLASH_FAULT_POINTS=before_manifest` (comma-separated names, optionally `name@N` for the N-th time
the point is reached) makes the process SIGKILL itself there: the same death as a lost node or an
OOM kill, at a moment a test chooses. Unset in production, where a fault point is one dict lookup.
"""

from __future__ import annotations

import os
import signal

_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get("DFLASH_FAULT_POINTS")
    if not spec:
        return
    for entry in spec.split(","):
        point, _, nth = entry.strip().partition("@")
        if point != name:
            continue
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] >= int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)
