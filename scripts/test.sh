#!/usr/bin/env bash
# The second command: install what the tests need, lint, and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
ruff check dflash_assets dflash_assets_tests
exec python -m pytest -q "$@"
