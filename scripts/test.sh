#!/usr/bin/env bash
# The second command: install what the tests need, lint, and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The browser test drives Debian's headless Chromium against the Dagster UI.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "chromium is not installed and cannot be installed here (needs root and apt-get):" \
      "the browser test will be skipped" >&2
  fi
fi
. .venv/bin/activate
ruff check dflash_assets dflash_assets_tests
# One worker per core; a module's tests stay on one worker (they share its fixtures).
exec python -m pytest -q -n "${DFLASH_TEST_WORKERS:-auto}" --dist loadscope "$@"
