#!/usr/bin/env bash
# Write deploy/requirements.lock: every package the image (deploy/Dockerfile) installs, pinned. That is
# the project's dependencies with the extras the image installs (postgres, k8s, celery), resolved from
# PyPI for the image's Python (3.11) on Linux x86-64, under deploy/constraints.txt (torch's release).
# Run it after changing a dependency in pyproject.toml (a test checks the two agree); pins already in
# the lock are kept unless you pass --upgrade (or --upgrade-package NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
"$PYTHON" -m uv pip compile pyproject.toml --extra postgres --extra k8s --extra celery \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --constraint deploy/constraints.txt \
  --custom-compile-command "bash scripts/lock.sh" --quiet --output-file deploy/requirements.lock "$@"
