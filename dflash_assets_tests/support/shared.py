"""What several xdist workers of one test run would otherwise each build: built once, by whichever
worker asks first, under a lock file; the others wait for it and read the recorded result.

A module-scoped fixture runs once per worker that runs a test of its module; with four workers an
expensive one (materialising ranges through the CLI) would run up to four times. `build_once` makes
such a fixture's work happen once per test run. What it builds is read-only to the tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(root: Path, build: Callable[[Path], dict]) -> dict:
    """`build(root)` unless another worker of this run already built it; returns what it returned
    (JSON), as recorded in `root/done.json`. A build that failed part-way is started again."""
    with exclusive(root.with_suffix(".lock")):
        done = root / "done.json"
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            done.write_text(json.dumps(build(root)))
        return json.loads(done.read_text())
