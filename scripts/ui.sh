#!/usr/bin/env bash
# The Dagster UI (http://127.0.0.1:3000) and its daemon (sensor, run queue, retries) on the local instance.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export DAGSTER_HOME="${DAGSTER_HOME:-$PWD/.dagster_home}"
exec dagster dev -w workspace.yaml -h "${DFLASH_UI_HOST:-127.0.0.1}" -p "${DFLASH_UI_PORT:-3000}"
