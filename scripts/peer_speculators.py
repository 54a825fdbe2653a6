"""A peer trainer on the same data: vLLM's `speculators` (PyPI 0.9.0) trains its DFlash2 drafter on the
product's committed hidden-state objects, and the result is decoded by z-lab's `dflash_generate` beside
ours. A benchmark driver, never a dependency of the product.

    python scripts/peer_speculators.py prepare --run RUN --out DATA        # the project's .venv
    python scripts/peer_speculators.py train DATA --save CKPT --steps 96   # runs itself in speculators' venv
    python scripts/peer_speculators.py convert CKPT --out DRAFTER          # the project's .venv
    python scripts/peer_speculators.py evaluate DRAFTER --prompts P.jsonl --out tau.json

Two environments. `prepare`, `convert` and `evaluate` run in the project's .venv (the store, z-lab's `dflash`
package, transformers 5.25). `train` runs in speculators' own venv (speculators needs transformers <= 5.19):
started from any other interpreter it runs itself again there (`$SPECULATORS_PYTHON`, default
/work/speculators-venv/bin/python). That venv, made with nothing but PyPI's packages and this machine's
CPU torch wheel (pip's find-links):

    python3 -m venv /work/speculators-venv
    /work/speculators-venv/bin/pip install torch==2.13.0           # the local CPU build
    echo torch==2.13.0 > /tmp/torch-pin.txt                        # never let pip pull a CUDA torch
    /work/speculators-venv/bin/pip install -c /tmp/torch-pin.txt speculators==0.9.0 "transformers<=5.19"
    /work/speculators-venv/bin/pip uninstall -y torchvision torchaudio   # CUDA builds (see below)

(speculators lists torchvision and torchaudio but never imports them; PyPI's wheels link libtorch_cuda, and
transformers fails to import with them beside a CPU torch: `operator torchvision::nms does not exist`.)

`prepare` (project .venv) writes speculators' offline data from a store's committed hidden-state ranges
(`--store`, default DFLASH_STORE_URL; `--ranges`, default the run's `trained_partitions` or every committed
range), leaving out the held-out samples: `--run RUN` reads them from `checkpoints/<RUN>/_manifest.json`
(`eval_sample_indices`), `--held-out 5,9,120-127` names them. For each training sample, row r of the data:
- `hidden_states/hs_<r>.safetensors`: `token_ids` int64 [T] and `hidden_states` [T, K + 1, H] (float32 by
  default, `--dtype bfloat16` halves it): slots 0..K-1 the stored layers, the last slot the state whose
  final norm is the stored `final_hidden_states`. speculators' last slot is the target's last layer BEFORE
  its final norm, and all it does with it is `verifier_lm_head(verifier_norm(slot))`, the teacher of its KL
  and selector losses (`models/dflash/core.py`, `_backbone_forward`). The store holds the state AFTER the
  norm, f = g ⊙ x / rms(x) (g = w, or 1 + w for Gemma and Qwen3.5, as speculators' `verifier_norm`); the
  slot gets y = f / g, and speculators' norm gives g ⊙ y / rms(y) = f up to eps (`train` checks this on
  row 0 with speculators' own norm and head before any step);
- the Arrow dataset speculators reads (`input_ids`, `loss_mask`, `seq_len`; `datasets.save_to_disk`,
  written by the speculators venv), with one more row, a copy of the last training sample: speculators
  always splits off a validation set (`--train-data-ratio` < 1), and `train` sets the ratio so that set is
  that copy alone and every training sample is trained on; its validation is never run;
- `peer_data.json`: where it came from (store, ranges, held-out indices, the sample index of each row), the
  target's directory, layer ids in both conventions (ours i is Hugging Face `hidden_states[i + 1]`;
  speculators' L is `hidden_states[L]`, so L = i + 1), the norm's gain, the product's mask token;
  `final_state_probe.safetensors` (sample 0's stored final state, for `train`'s check);
  `held_out.prompts.jsonl` (each held-out sample's prompt, as the product's trainer makes them).

`train` (speculators venv) runs `speculators.train.cli.main` at speculators' own defaults for DFlash2: block
8, five draft layers, KL to the target with the fixed decay (γ 4) plus the selector's CE, lr 1e-3, Muon for
the 2-D weights and AdamW for the rest, linear schedule with 1 % warm-up, every layer sliding-window (2,048,
non-causal inside the block), 512 anchors a packed batch of 8,192 tokens. What it is given: the data's layer
ids and the product's mask token (speculators falls back to the pad, eos or unk token for a tokenizer that
names every row, as SmolLM2's does), `--on-missing raise` (never ask a vLLM server), no dataloader workers,
and what a CPU needs: `--draft-attn-impl sdpa --loss-implementation eager --hidden-states-dtype float32`.
Anything after `--` is passed on to speculators. A budget of `--steps` (the LR schedule ends there) and/or
`--seconds` (the schedule is the one of `--epochs`, cut short). Three things are patched at run time, in
this process only (site-packages is never edited):
1. the trainer moves the model and each batch to `get_local_rank()`, the integer 0, i.e. `cuda:0`: it
   gets "cpu";
2. its step timer calls `torch.accelerator.synchronize()`, which raises without an accelerator: a no-op
   when there is none;
3. `Trainer.run_training` loops over epochs until `--epochs`, ignoring `--max-steps` between epochs (each
   later epoch runs one more step) and saving and validating every epoch: here it stops at the budget,
   saves one checkpoint at the end, and first runs the final-state check. Its `train_epoch`, optimiser,
   schedule and checkpointer are speculators' own.
One thread by default (`--threads 1`: OMP/MKL and torch's intra- and inter-op pools). It writes
`<save>/peer_train.json`: steps, seconds, the check, and speculators' metrics at every step.

`convert` (project .venv) turns speculators' checkpoint (`<save>/<epoch>/`, the last by default) into
z-lab's layout: `config.json` is speculators' `transformer_layer_config` (a Qwen3 config) flattened, with
`architectures: ["DFlash2DraftModel"]`, `block_size`, `num_target_layers` (the target's depth) and
`dflash_config` (`target_layer_ids` in z-lab's convention, L - 1; `mask_token_id`; the convolution and
selector sizes), and `is_causal: false` where speculators trained its sliding-window layers non-causal
(z-lab makes sliding layers causal unless told); `model.safetensors` holds the draft weights only (the
embedding, LM head and verifier norm are the target's). It then loads the directory with
`dflash.DFlash2DraftModel.from_pretrained` and fails on any missing, unexpected or mismatched weight.

`evaluate` (project .venv) decodes each prompt of a JSONL of `{"prompt_token_ids": [...]}` (`--prompts`:
`prepare`'s `held_out.prompts.jsonl`, or any such file) or of the prompt set the product's
`drafter_evaluations` measured one of its runs on (`--run RUN [--set held_out]`: the same prompts, order and
new-token count, read as `scripts/yardstick.py --zlab` reads them, with the product's τ printed beside) with
z-lab's `dflash_generate` (greedy, `--new-tokens` each, the target's end-of-turn ids stopping it) and
with the target alone, and reports τ (tokens produced per verification round, every round of every prompt:
what `yardstick.py --zlab` prints), how many outputs equal the target's greedy output, and the
training-free prompt-lookup floor on the same prompts by the product's loop.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPECULATORS_PYTHON = os.environ.get("SPECULATORS_PYTHON", "/work/speculators-venv/bin/python")
DATA_METADATA = "peer_data.json"
TRAIN_SUMMARY = "peer_train.json"
PROBE_FILE = "final_state_probe.safetensors"
PROMPTS_FILE = "held_out.prompts.jsonl"
# speculators' `GEMMA_STYLE_FINAL_NORM_MODEL_TYPES` (models/utils.py): final norms whose gain is 1 + w.
ONE_PLUS_W_MODEL_TYPES = frozenset(
    {"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_5", "qwen3_5_text", "recurrent_gemma"}
)
# Relative error of speculators' norm of the last slot against the stored final state past which `train`
# refuses to start: bf16 storage alone is ~3e-3; a wrong gain convention is ~1.
FINAL_STATE_TOLERANCE = 2e-2


# ---------------------------------------------------------------------------------------------------------
# The pure parts: conventions and layouts (tested in dflash_assets_tests/bench/test_peer_speculators.py)
# ---------------------------------------------------------------------------------------------------------


def speculators_layer_ids(target_layer_ids: Sequence[int]) -> list[int]:
    """Ours: layer i is Hugging Face `hidden_states[i + 1]`; speculators' L is `hidden_states[L]`."""
    return [int(i) + 1 for i in target_layer_ids]


def zlab_layer_ids(aux_hidden_state_layer_ids: Sequence[int]) -> list[int]:
    return [int(i) - 1 for i in aux_hidden_state_layer_ids]


def final_norm_gain(target_config: dict) -> str:
    """`"1+w"` for the families whose final RMSNorm scales by 1 + w (speculators' rule, by model type),
    else `"w"`."""
    text = target_config.get("text_config") or {}
    model_type = text.get("model_type") or target_config.get("model_type")
    return "1+w" if model_type in ONE_PLUS_W_MODEL_TYPES else "w"


def pre_norm_state(final_state, norm_weight, gain: str):
    """y with RMSNorm_g(y) = `final_state` up to eps: the stored state (after the norm) divided by the
    norm's gain g. RMSNorm's output is scale-free in its input, so y need not be the layer's own output,
    only point the same way; where g is 0 the channel carries nothing either way, and y gets 0."""
    import torch

    g = norm_weight.float() + (1.0 if gain == "1+w" else 0.0)
    return torch.where(g == 0, torch.zeros_like(final_state, dtype=torch.float32), final_state.float() / g)


def validation_ratio(train_rows: int) -> float:
    """speculators' `--train-data-ratio` that keeps the first `train_rows` rows of `train_rows + 1` for
    training (it splits at `int(rows * ratio)`, and the ratio must be < 1)."""
    return (train_rows + 0.5) / (train_rows + 1)


def parse_indices(text: str) -> set[int]:
    """`5,9,120-127` -> {5, 9, 120, ..., 127}."""
    indices: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        start, _, end = part.partition("-")
        indices.update(range(int(start), int(end or start) + 1))
    return indices


def zlab_config(checkpoint_config: dict, num_target_layers: int) -> dict:
    """z-lab's `config.json` from speculators' DFlash2 checkpoint config: the draft's Qwen3 config with the
    DFlash fields beside it."""
    layers = dict(checkpoint_config["transformer_layer_config"])
    for key in ("architectures", "auto_map", "_attn_implementation", "transformers_version", "dtype"):
        layers.pop(key, None)
    block_size = int(checkpoint_config["block_size"])
    config = {
        **layers,
        "architectures": ["DFlash2DraftModel"],
        "model_type": "qwen3",
        "dtype": "bfloat16",
        "block_size": block_size,
        "num_target_layers": int(num_target_layers),
        "dflash_config": {
            "target_layer_ids": zlab_layer_ids(checkpoint_config["aux_hidden_state_layer_ids"]),
            "mask_token_id": int(checkpoint_config["mask_token_id"]),
            "block_size": block_size,
            **{
                key: int(checkpoint_config[key])
                for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
            },
        },
    }
    if checkpoint_config.get("sample_from_anchor"):
        raise ValueError("the checkpoint drafts from the anchor (sample_from_anchor): z-lab's loop does not")
    if "sliding_attention" in (layers.get("layer_types") or []):
        # z-lab's attention is causal on sliding layers unless `is_causal` says otherwise; speculators'
        # DFlash2 trains them non-causal inside the block (its `sliding_window_non_causal`).
        config["is_causal"] = not checkpoint_config.get("sliding_window_non_causal", True)
    return config


VERIFIER_WEIGHTS = ("embed_tokens.", "lm_head.", "verifier_norm.", "verifier_lm_head.")


def zlab_weights(state_dict: dict) -> dict:
    """The draft's own weights: what speculators' checkpoint holds less the target's (embedding, heads,
    final norm) and the vocabulary maps, which z-lab's model takes from the target."""
    return {
        name: tensor
        for name, tensor in state_dict.items()
        if not name.startswith(VERIFIER_WEIGHTS) and name not in ("t2d", "d2t")
    }


# ---------------------------------------------------------------------------------------------------------
# prepare (project .venv)
# ---------------------------------------------------------------------------------------------------------


def final_norm_weight(model_dir: Path):
    """The target's final norm weight, read from its safetensors without loading the model."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(model_dir / "model.safetensors"), "pt") as handle:
            weight_map = dict.fromkeys(handle.keys(), "model.safetensors")
    for key in ("model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight"):
        if key in weight_map:
            with safe_open(str(model_dir / weight_map[key]), "pt") as handle:
                return handle.get_tensor(key)
    raise SystemExit(f"{model_dir}: no final norm weight (model.norm.weight or a language model's) found")


def committed_ranges(store) -> list[str]:
    from dflash_assets.storage.layout import HIDDEN_STATES_PREFIX, MANIFEST_NAME

    return sorted(
        {
            info.key.split("/")[1]
            for info in store.list(f"{HIDDEN_STATES_PREFIX}/")
            if info.key.endswith(f"/{MANIFEST_NAME}")
        }
    )


def prepare(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO))
    from dflash_assets import settings
    from dflash_assets.drafter.config import resolve_mask_token
    from dflash_assets.evaluation.prompt_sets import held_out_prompt_set
    from dflash_assets.evaluation.runs import run_manifest
    from dflash_assets.extraction.sample_format import read_sample, sample_object_name
    from dflash_assets.orchestration.resources import TargetModelResource
    from dflash_assets.storage.layout import HIDDEN_STATES_PREFIX
    from dflash_assets.storage.manifest import changed_since_commit, read_manifest
    from dflash_assets.storage.open_store import open_store

    store_url = args.store or settings.store_url()
    store = open_store(store_url)
    held_out: set[int] = parse_indices(args.held_out) if args.held_out else set()
    ranges = [r for r in (args.ranges or "").split(",") if r]
    if args.run:
        manifest = run_manifest(store, args.run)
        held_out |= {int(i) for i in manifest.get("eval_sample_indices") or []}
        ranges = ranges or list(manifest.get("trained_partitions") or [])
    ranges = ranges or committed_ranges(store)
    if not ranges:
        raise SystemExit(f"no committed hidden-state ranges in {store_url}")
    target_dir = Path(args.target) if args.target else TargetModelResource().model_dir()
    target_config = json.loads((target_dir / "config.json").read_text())
    text_config = target_config.get("text_config") or target_config
    gain = final_norm_gain(target_config)
    norm_weight = final_norm_weight(target_dir)
    mask_token_id, mask_reason = resolve_mask_token(target_dir, args.mask_token_id, text_config["vocab_size"])

    out = Path(args.out)
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    held_out_rows: list[tuple[list[int], list[int]]] = []
    layer_ids: list[int] | None = None
    started = time.monotonic()
    for key in ranges:
        prefix = f"{HIDDEN_STATES_PREFIX}/{key}"
        manifest = read_manifest(store, prefix)
        if manifest is None:
            raise SystemExit(
                f"hidden-state range {key} is not committed in {store_url}: materialise it first"
            )
        if changed := changed_since_commit(store, prefix, manifest):
            raise SystemExit(
                f"hidden-state range {key} changed since its commit: {next(iter(changed.values()))}"
            )
        for index in manifest["sample_indices"]:
            sample = read_sample(store.get_bytes(f"{prefix}/{sample_object_name(int(index))}"))
            if index in held_out:
                held_out_rows.append((int(index), sample.input_ids.tolist(), sample.loss_mask.tolist()))
                continue
            if layer_ids is None:
                layer_ids = sample.target_layer_ids
            if sample.target_layer_ids != layer_ids:
                raise SystemExit(
                    f"sample {index} of {key} holds layers {sample.target_layer_ids}, not {layer_ids}"
                )
            if not sample.has_final_state:
                raise SystemExit(
                    f"hidden-state range {key} holds no final hidden state (sample {index}): speculators' "
                    "teacher is the target's head on it; materialise the range with "
                    "DFLASH_CAPTURE_FINAL_STATE=1"
                )
            final = sample.final_dequantized(torch.float32)
            last = pre_norm_state(final, norm_weight, gain)
            states = torch.cat([sample.dequantized(torch.float32), last[:, None]], dim=1)
            row = len(rows)
            save_file(
                {
                    "hidden_states": states.to(getattr(torch, args.dtype)).contiguous(),
                    "token_ids": sample.input_ids.long().contiguous(),
                },
                str(out / "hidden_states" / f"hs_{row}.safetensors"),
            )
            if row == 0:
                save_file({"final_hidden_states": final.contiguous()}, str(out / PROBE_FILE))
            rows.append(
                {"sample_index": int(index), "range": key, "input_ids": sample.input_ids.tolist(),
                 "loss_mask": [int(m) for m in sample.loss_mask.tolist()]}
            )  # fmt: skip
            if args.limit and len(rows) >= args.limit:
                break
        if args.limit and len(rows) >= args.limit:
            break
    if not rows:
        raise SystemExit("no training samples: every sample is held out")
    # speculators always holds out a validation split: a copy of the last training sample is that split.
    validation_copy = len(rows)
    (out / "hidden_states" / f"hs_{validation_copy}.safetensors").write_bytes(
        (out / "hidden_states" / f"hs_{validation_copy - 1}.safetensors").read_bytes()
    )
    (out / "rows.jsonl").write_text(
        "".join(json.dumps(r | {"row": i}) + "\n" for i, r in enumerate([*rows, rows[-1]]))
    )
    # The held-out rule the product's evaluations use: every held-out row, a prompt too long skipped, not cut.
    prompts = [
        prompt.token_ids
        for prompt in held_out_prompt_set(
            held_out_rows, count=len(held_out_rows), max_prompt_tokens=args.max_prompt_tokens
        ).prompts
    ]
    (out / PROMPTS_FILE).write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    metadata = {
        "store": store_url,
        "run": args.run,
        "ranges": ranges,
        "held_out_sample_indices": sorted(held_out),
        "held_out_prompts": len(prompts),
        "training_rows": len(rows),
        "training_tokens": sum(len(r["input_ids"]) for r in rows),
        "validation_row": validation_copy,
        "train_data_ratio": validation_ratio(len(rows)),
        "row_sample_indices": [r["sample_index"] for r in rows],
        "target_dir": str(target_dir.resolve()),
        "target_num_hidden_layers": int(text_config["num_hidden_layers"]),
        "hidden_size": int(text_config["hidden_size"]),
        "target_layer_ids": layer_ids,
        "speculators_target_layer_ids": speculators_layer_ids(layer_ids or []),
        "final_norm_gain": gain,
        "mask_token_id": mask_token_id,
        "mask_token_reason": mask_reason,
        "dtype": args.dtype,
        "seconds": round(time.monotonic() - started, 1),
    }
    (out / DATA_METADATA).write_text(json.dumps(metadata, indent=1) + "\n")
    print(
        f"{len(rows)} training samples ({metadata['training_tokens']} tokens) from {', '.join(ranges)}; "
        f"{len(held_out_rows)} held out ({len(prompts)} prompts in {out / PROMPTS_FILE})",
        flush=True,
    )
    write_dataset_in_speculators_venv(out)


def write_dataset_in_speculators_venv(out: Path) -> None:
    """The Arrow dataset needs `datasets`, which lives in the speculators venv."""
    import subprocess

    if importlib.util.find_spec("datasets") is not None:
        write_dataset(out)
        return
    if not Path(SPECULATORS_PYTHON).exists():
        raise SystemExit(
            f"{SPECULATORS_PYTHON} is missing (SPECULATORS_PYTHON): make the speculators venv (this file's "
            f"docstring), then run `{SPECULATORS_PYTHON} {__file__} write-dataset {out}`"
        )
    subprocess.run([SPECULATORS_PYTHON, __file__, "write-dataset", str(out)], check=True)


def write_dataset(out: Path) -> None:
    from datasets import Dataset

    rows = [json.loads(line) for line in (Path(out) / "rows.jsonl").read_text().splitlines()]
    dataset = Dataset.from_dict(
        {
            "input_ids": [r["input_ids"] for r in rows],
            "loss_mask": [r["loss_mask"] for r in rows],
            "seq_len": [len(r["input_ids"]) for r in rows],
        }
    )
    dataset.set_format(type="torch")  # as speculators' prepare_data leaves it: token ids come back int64
    dataset.save_to_disk(str(out))
    print(f"speculators dataset: {len(rows)} rows in {out}", flush=True)


# ---------------------------------------------------------------------------------------------------------
# train (speculators venv)
# ---------------------------------------------------------------------------------------------------------


def run_in_speculators_venv(argv: Sequence[str], threads: int) -> None:
    """Run this file again under the speculators venv's Python, with its thread pools capped."""
    env = os.environ | {
        name: str(threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    }
    if not Path(SPECULATORS_PYTHON).exists():
        raise SystemExit(
            f"{SPECULATORS_PYTHON} is missing (SPECULATORS_PYTHON): make it as this file's docstring says"
        )
    os.execve(SPECULATORS_PYTHON, [SPECULATORS_PYTHON, __file__, *argv], env)


def speculators_argv(data: Path, metadata: dict, args: argparse.Namespace) -> list[str]:
    argv = [
        "--speculator-type", "dflash2",
        "--verifier-name-or-path", args.verifier or metadata["target_dir"],
        "--data-path", str(data),
        "--save-path", str(args.save),
        "--log-dir", str(Path(args.save) / "logs"),
        "--target-layer-ids", *map(str, metadata["speculators_target_layer_ids"]),
        "--mask-token-id", str(metadata["mask_token_id"]),
        "--train-data-ratio", repr(metadata["train_data_ratio"]),
        "--on-missing", "raise",
        "--num-workers", "0",
        "--seed", str(args.seed),
        # What a CPU needs: no flex attention, no fused (Triton) loss, float32 compute.
        "--draft-attn-impl", "sdpa",
        "--loss-implementation", "eager",
        "--hidden-states-dtype", "float32",
    ]  # fmt: skip
    if args.steps:
        argv += ["--max-steps", str(args.steps)]
    return argv + list(args.speculators_args)


def final_state_check(model, data: Path) -> dict:
    """speculators' own teacher on row 0's last slot against the stored final state: the norm's output
    (relative L2 error, worst row) and the head's argmax."""
    import torch
    from safetensors.torch import load_file

    stored = load_file(str(data / PROBE_FILE))["final_hidden_states"].float()
    slot = load_file(str(data / "hidden_states" / "hs_0.safetensors"))["hidden_states"][:, -1].float()
    with torch.no_grad():
        normed = model.verifier_norm(slot).float()
        error = ((normed - stored).norm(dim=-1) / stored.norm(dim=-1)).max().item()
        teacher = model.verifier_lm_head(normed.to(model.verifier_lm_head.weight.dtype)).argmax(-1)
        head = model.verifier_lm_head(stored.to(model.verifier_lm_head.weight.dtype)).argmax(-1)
    return {
        "tokens": int(stored.shape[0]),
        "max_relative_error": error,
        "argmax_agrees": int((teacher == head).sum()),
        "norm_class": type(model.verifier_norm).__name__,
    }


class MetricsRecorder:
    """speculators' metric records (`speculators.metrics` logger): one dict a logged step."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def attach(self) -> None:
        import logging

        handler = logging.Handler()
        handler.emit = self._emit  # type: ignore[method-assign]
        logging.getLogger("speculators.metrics").addHandler(handler)

    def _emit(self, record) -> None:
        if isinstance(record.msg, dict) and "train" in record.msg:
            self.steps.append(
                {"step": record.msg.get("global_step"), **record.msg["train"],
                 "step_ms": (record.msg.get("profile") or {}).get("step_ms")}
            )  # fmt: skip


def patch_speculators_for_cpu(
    budget_s: float | None, summary: dict, data: Path, recorder: MetricsRecorder
) -> None:
    """The three run-time patches of the docstring, on speculators' modules in this process only."""
    import torch
    from speculators.train import trainer as trainer_module
    from speculators.train.graceful_shutdown import with_graceful_shutdown

    # 1. The model and batches go to get_local_rank(): the integer 0 means cuda:0.
    trainer_module.get_local_rank = lambda: "cpu"

    # 2. The step timer synchronises an accelerator that is not there.
    synchronize = torch.accelerator.synchronize

    def synchronize_if_any(*args, **kwargs):
        if torch.accelerator.is_available():
            synchronize(*args, **kwargs)

    torch.accelerator.synchronize = synchronize_if_any

    # 3. The epoch loop: stop at the budget, one checkpoint at the end, the final-state check first.
    @with_graceful_shutdown()
    def run_training(self) -> None:
        recorder.attach()  # after speculators configured its metric logger (which drops other handlers)
        check = final_state_check(self.model, data)
        summary["final_state_check"] = check
        print(f"final-state check (speculators' own norm and head, row 0): {json.dumps(check)}", flush=True)
        if check["max_relative_error"] > FINAL_STATE_TOLERANCE:
            raise SystemExit(
                f"speculators' norm of the last slot is {check['max_relative_error']:.3g} from the stored "
                "final state: the norm's gain convention differs from prepare's (peer_data.json "
                "final_norm_gain)"
            )
        started = time.monotonic()
        deadline = started + budget_s if budget_s else None

        def stop_at_deadline() -> None:
            if deadline is not None and time.monotonic() >= deadline:
                self.config = self.config._replace(max_steps=self.global_step)

        epoch = self.current_epoch
        for epoch in range(self.current_epoch, self.config.num_epochs):
            self.train_epoch(epoch, step_callback=stop_at_deadline)
            if self.config.max_steps is not None and self.global_step >= self.config.max_steps:
                break
        summary["train_seconds"] = time.monotonic() - started
        summary["steps"] = self.global_step
        summary["epochs_started"] = epoch + 1
        self.maybe_save_checkpoint(epoch)
        summary["checkpoint"] = str(self.checkpointer.path / str(epoch))

    trainer_module.Trainer.run_training = run_training


def train(args: argparse.Namespace) -> None:
    if importlib.util.find_spec("speculators") is None:
        run_in_speculators_venv(sys.argv[1:], args.threads)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(args.threads)
    from speculators.train.cli import main as speculators_main
    from speculators.train.config import TrainConfig

    data = Path(args.data)
    metadata = json.loads((data / DATA_METADATA).read_text())
    if not args.steps and not args.seconds:
        raise SystemExit("give a budget: --steps N and/or --seconds S")
    save = Path(args.save)
    if any(save.glob("*/model.safetensors")) and not args.resume:
        raise SystemExit(f"{save} already holds checkpoints: another --save, or --resume to go on from them")
    argv = speculators_argv(data, metadata, args)
    summary: dict = {"data": str(data), "speculators_argv": argv, "threads": args.threads,
                     "budget": {"steps": args.steps, "seconds": args.seconds}}  # fmt: skip
    recorder = MetricsRecorder()
    patch_speculators_for_cpu(args.seconds, summary, data, recorder)
    started = time.monotonic()
    speculators_main(TrainConfig.resolve(argv))
    summary["wall_seconds"] = time.monotonic() - started
    summary["metrics"] = recorder.steps
    (save / TRAIN_SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    last = recorder.steps[-1] if recorder.steps else {}
    print(
        f"trained {summary.get('steps')} steps in {summary.get('train_seconds', 0):.0f} s "
        f"({args.threads} thread(s)); last step: {json.dumps(last)}; checkpoint {summary.get('checkpoint')}",
        flush=True,
    )


# ---------------------------------------------------------------------------------------------------------
# convert and evaluate (project .venv)
# ---------------------------------------------------------------------------------------------------------


def latest_checkpoint(path: Path) -> Path:
    if (path / "config.json").is_file():
        return path
    epochs = sorted((p for p in path.iterdir() if p.name.isdigit() and (p / "model.safetensors").is_file()),
                    key=lambda p: int(p.name))  # fmt: skip
    if not epochs:
        raise SystemExit(f"{path} holds no speculators checkpoint (<epoch>/model.safetensors)")
    return epochs[-1]


def convert(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    checkpoint = latest_checkpoint(Path(args.checkpoint))
    source = json.loads((checkpoint / "config.json").read_text())
    verifier = args.target or source["speculators_config"]["verifier"]["name_or_path"]
    verifier_config = json.loads((Path(verifier) / "config.json").read_text())
    depth = (verifier_config.get("text_config") or verifier_config)["num_hidden_layers"]
    config = zlab_config(source, depth)
    sys.path.insert(0, str(REPO))
    from dflash_assets.drafter.config import mask_token_text

    if (text := mask_token_text(verifier, config["dflash_config"]["mask_token_id"])) is not None:
        config["dflash_config"]["mask_token"] = text  # what SGLang looks the id up by, as our exports carry
    weights = {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in zlab_weights(load_file(str(checkpoint / "model.safetensors"))).items()
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    from dflash_assets.bench.zlab import load_zlab_drafter

    model, info = load_zlab_drafter(out)
    problems = {key: sorted(map(str, names)) for key, names in info.items() if names}
    attention = model.layers[0].self_attn
    print(
        f"{checkpoint} -> {out}: {len(weights)} tensors, "
        f"{sum(t.numel() for t in weights.values()) / 1e6:.1f} M parameters; z-lab's "
        f"{type(model).__name__} loads it with {problems or 'no missing, unexpected or mismatched weights'}; "
        f"layer ids {model.target_layer_ids}, block {model.block_size}, mask {model.mask_token_id}, "
        f"sliding window {attention.sliding_window}, causal {attention.is_causal}",
        flush=True,
    )
    if problems:
        raise SystemExit(1)


def read_prompts(path: Path, limit: int | None) -> list[list[int]]:
    prompts = [json.loads(line)["prompt_token_ids"] for line in path.read_text().splitlines() if line.strip()]
    return prompts[:limit] if limit else prompts


def run_prompts(store_url: str, run: str, prompt_set: str, target_dir: Path) -> tuple[list[list[int]], dict]:
    """The prompts the product's `drafter_evaluations` measured run `run` on for `prompt_set`, and its record
    (`evaluations/<run>/<set>/evaluation.json`): the same prompts, new-token count and order."""
    from dflash_assets import settings
    from dflash_assets.evaluation.loaders import load_prompt_set
    from dflash_assets.evaluation.runs import read_evaluation, run_manifest
    from dflash_assets.storage.open_store import open_store

    store = open_store(store_url)
    record = read_evaluation(store, run, prompt_set)
    if record is None:
        raise SystemExit(
            f"{run}: no {prompt_set} evaluation is committed in {store_url}: materialise drafter_evaluations "
            f"for it (partition {prompt_set}) first"
        )
    found = load_prompt_set(
        prompt_set, settings.EVAL_SETS.get(), object_store=store, run_manifest=run_manifest(store, run),
        target_dir=target_dir, count=record["prompts"], new_tokens=record["max_new_tokens"],
        cache_dir=settings.cache_dir() / "peer-speculators",
    ).prompts  # fmt: skip
    if [prompt.location for prompt in found] != record["prompt_locations"]:
        raise SystemExit(
            f"{run}: the {prompt_set} prompts found now are not the ones its evaluation measured"
        )
    return [list(prompt.token_ids) for prompt in found], record


def evaluate(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    from dflash_assets import settings
    from dflash_assets.bench.zlab import load_zlab_drafter, zlab_generate
    from dflash_assets.drafter.speculative import PromptLookup, TargetVerifier, stop_token_ids_of
    from dflash_assets.evaluation.measure import greedy_reference, measure
    from dflash_assets.evaluation.prompt_sets import Prompt
    from dflash_assets.orchestration.resources import TargetModelResource
    from dflash_assets.target.model import load_target_model

    drafter, info = load_zlab_drafter(args.drafter)
    target_dir = Path(args.target) if args.target else TargetModelResource().model_dir()
    target = load_target_model(target_dir, "cpu")
    product: dict = {}
    if args.run:
        prompts, record = run_prompts(args.store or settings.store_url(), args.run, args.set, target_dir)
        prompts, args.new_tokens = prompts[: args.limit] if args.limit else prompts, record["max_new_tokens"]
        product = {key: record.get(key) for key in ("tau", "lossless_prompts", "prompts")}
        product |= {"run": args.run, "set": args.set}
    elif args.prompts:
        prompts = read_prompts(Path(args.prompts), args.limit)
    else:
        raise SystemExit("name the prompts: --prompts FILE.jsonl, or --run RUN (its evaluation's prompt set)")
    stop = stop_token_ids_of(str(target_dir))
    verifier = TargetVerifier(target, drafter.target_layer_ids)
    started = time.monotonic()
    numbered = [Prompt(f"prompt {i}", prompt) for i, prompt in enumerate(prompts)]
    greedy_outputs = greedy_reference(verifier, numbered, max_new_tokens=args.new_tokens, stop_token_ids=stop)
    floor = measure(
        PromptLookup(block_size=drafter.block_size), verifier, numbered, greedy_outputs,
        max_new_tokens=args.new_tokens, stop_token_ids=stop, block_size=drafter.block_size,
    )  # fmt: skip
    per_prompt, same = [], 0
    for prompt, greedy in zip(prompts, greedy_outputs, strict=True):
        tokens, rounds = zlab_generate(drafter, target, prompt, args.new_tokens, sorted(stop))
        same += tokens == greedy
        per_prompt.append({"prompt_tokens": len(prompt), "tokens": len(tokens), "rounds": rounds,
                           "matches_target_greedy": tokens == greedy})  # fmt: skip
    lengths = [n for p in per_prompt for n in p["rounds"]]
    report = {
        "drafter": str(args.drafter),
        "target": str(target_dir),
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "tau_zlab": sum(lengths) / len(lengths) if lengths else None,
        "rounds": len(lengths),
        "zlab_matches_greedy": same,
        "prompt_lookup_tau": floor.tau,
        "prompt_lookup_matches_greedy": floor.lossless_prompts == floor.prompts,
        "zlab_loading": {key: sorted(map(str, names)) for key, names in info.items() if names},
        "product": product or None,
        "seconds": round(time.monotonic() - started, 1),
        "per_prompt": per_prompt,
    }
    print(
        f"τ {report['tau_zlab']:.3f} (z-lab dflash_generate, {len(lengths)} rounds, {len(prompts)} prompts); "
        f"{same}/{len(prompts)} outputs equal the target's greedy output; prompt lookup τ "
        f"{report['prompt_lookup_tau']:.3f} on the same prompts"
        + (
            f"; the product's drafter of run {args.run}: τ {product['tau']:.3f}, "
            f"{product['lossless_prompts']}/{product['prompts']} (its own loop)"
            if product.get("tau") is not None
            else ""
        ),
        flush=True,
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


# ---------------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = top.add_subparsers(dest="command", required=True)

    p = commands.add_parser("prepare", help="speculators' offline data from a store's hidden-state objects")
    p.add_argument("--out", required=True, help="the data directory to write (speculators' --data-path)")
    p.add_argument("--store", default=None, help="store URL or path (default DFLASH_STORE_URL)")
    p.add_argument(
        "--run", default=None, help="leave out this training run's held-out samples (its manifest)"
    )
    p.add_argument("--held-out", default=None, help="sample indices to leave out: 5,9,120-127")
    p.add_argument(
        "--ranges", default=None, help="hidden-state ranges, comma-separated (default: the run's, or all)"
    )
    p.add_argument(
        "--target", default=None, help="the target's model directory (default DFLASH_TARGET_MODEL)"
    )
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="of the written states"
    )
    p.add_argument("--mask-token-id", type=int, default=None, help="default: the product's rule")
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=960,
        help="held-out prompts longer than this are skipped (the product's held-out rule)",
    )
    p.add_argument("--limit", type=int, default=None, help="at most N training samples (a smoke test)")

    w = commands.add_parser("write-dataset", help="(prepare's last step, in the speculators venv)")
    w.add_argument("out")

    t = commands.add_parser("train", help="speculators' trainer on prepared data, on the CPU")
    t.add_argument("data", help="prepare's --out")
    t.add_argument("--save", required=True, help="speculators' --save-path")
    t.add_argument("--steps", type=int, default=None, help="optimiser steps (the LR schedule ends there)")
    t.add_argument("--seconds", type=float, default=None, help="stop after the step that passes S seconds")
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--verifier", default=None, help="the target's directory (default: peer_data.json's)")
    t.add_argument("--resume", action="store_true", help="go on from checkpoints already in --save")
    t.add_argument("speculators_args", nargs="*", help="after --: passed on to speculators' trainer")

    c = commands.add_parser("convert", help="a speculators checkpoint into z-lab's layout")
    c.add_argument("checkpoint", help="train's --save (its last epoch) or one <save>/<epoch> directory")
    c.add_argument("--out", required=True)
    c.add_argument(
        "--target", default=None, help="the target's directory (default: the checkpoint's verifier)"
    )

    e = commands.add_parser(
        "evaluate", help="z-lab's dflash_generate on held-out prompts: τ and losslessness"
    )
    e.add_argument("drafter", help="convert's --out")
    e.add_argument("--prompts", default=None, help='JSONL of {"prompt_token_ids": [...]}')
    e.add_argument("--run", default=None, help="instead: the prompts the product measured this run on")
    e.add_argument("--set", default="held_out", help="with --run: which of its prompt sets (held_out)")
    e.add_argument("--store", default=None, help="with --run: store URL or path (default DFLASH_STORE_URL)")
    e.add_argument("--target", default=None, help="the target's directory (default DFLASH_TARGET_MODEL)")
    e.add_argument("--new-tokens", type=int, default=64)
    e.add_argument("--limit", type=int, default=None, help="the first N prompts")
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--out", default=None, help="write the report as JSON here")
    return top


def main(argv: Iterable[str] | None = None) -> None:
    args = parser().parse_args(list(argv) if argv is not None else None)
    {"prepare": prepare, "write-dataset": lambda a: write_dataset(Path(a.out)), "train": train,
     "convert": convert, "evaluate": evaluate}[args.command](args)  # fmt: skip


if __name__ == "__main__":
    main()
