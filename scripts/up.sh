#!/usr/bin/env bash
# The first command: set everything up, run every asset end to end on the embedded defaults (no
# credentials, GPU or network), then start the Dagster UI and daemon (skip with --no-ui).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export DAGSTER_HOME="${DAGSTER_HOME:-$PWD/.dagster_home}"
dflash-assets demo
if [ "${1:-}" != "--no-ui" ]; then
  exec bash scripts/ui.sh
fi
