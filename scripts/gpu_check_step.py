"""The training-step stage of `scripts/gpu-check.sh`: the drafter's step at the real shape, watched for
host-device syncs and recompiles.

For each drafter shape (`dflash-swa`, the public Qwen3.6-27B drafter's sliding-window layers beside a full
one, and `dflash`), at the Qwen3.6-27B target's width (hidden 5,120, vocabulary 248,320), with flex
attention on CUDA, it runs the micro-batches training and evaluation meet, through the product's own
loss (`drafter/objective.py`): optimiser steps of 1 and 2 sequences of 3,072 tokens at 512 anchors under
bf16 autocast, a teacher-forced evaluation batch without gradients, and a speculative draft. The first
pass compiles; the second runs the same again under `torch.cuda.set_sync_debug_mode("warn")`, counting
every host-device sync it warns of (by source line) and the graphs dynamo compiled in it (0 when the
first pass compiled everything). Dynamo's recompile limit fails the stage when hit
(`fail_on_recompile_limit_hit`): past it, flex attention would run uncompiled, the full score matrix.

`--tiny`: the tiny shape (any device; on a CPU the materialised path, nothing compiled, no syncs to
count), which is what `gpu-check.sh --cpu` and its test run. Writes one JSON object to `--out`.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from dflash_assets.bench.drafter_step import DrafterShapeCase, random_batch
from dflash_assets.drafter.config import DrafterConfig, drafter_shape
from dflash_assets.drafter.model import DFlashDrafter, drafter_parameter_count
from dflash_assets.drafter.objective import Objective, anchor_generator, dflash_loss, sample_anchors
from dflash_assets.target.layer_ids import dflash_target_layer_ids

QWEN36_27B = DrafterShapeCase("Qwen3.6-27B drafter", 5120, 17408, 248320, 64, 3072, 512)
TINY = DrafterShapeCase("tiny drafter", 64, 176, 1536, 12, 256, 32)
SHAPES = ("dflash-swa", "dflash")


def build(case: DrafterShapeCase, shape: str, device: torch.device) -> DFlashDrafter:
    target = {"hidden_size": case.hidden_size, "intermediate_size": case.intermediate_size}
    config = DrafterConfig(
        hidden_size=case.hidden_size,
        vocab_size=case.vocab_size,
        mask_token_id=case.vocab_size - 1,
        target_layer_ids=dflash_target_layer_ids(case.num_target_layers, 5),
        target_num_hidden_layers=case.num_target_layers,
        **drafter_shape(target, shape, 5),
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    embedding = torch.randn(case.vocab_size, case.hidden_size, device=device, dtype=dtype) * 0.02
    lm_head = torch.randn(case.vocab_size, case.hidden_size, device=device, dtype=dtype) * 0.02
    with torch.device(device):
        return DFlashDrafter(config, embedding, lm_head)


def run_pass(model: DFlashDrafter, case: DrafterShapeCase, device: torch.device) -> dict[str, float]:
    """Seconds of each micro-batch kind, as training and evaluation run them."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    seconds: dict[str, float] = {}

    def timed(name: str, work) -> None:  # noqa: ANN001
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds[name] = round(time.perf_counter() - started, 3)

    def loss_of(batch_size: int):  # noqa: ANN202
        batch = random_batch(case, batch_size, device)
        anchors = sample_anchors(
            batch.loss_mask, case.num_anchors, [anchor_generator(0, 0, i) for i in batch.sample_indices]
        )
        with autocast:
            return dflash_loss(model, batch, anchors, Objective())

    def train_step(batch_size: int) -> None:
        model.train()
        loss_of(batch_size).weighted_ce.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def evaluate() -> None:
        model.eval()
        with torch.no_grad():
            loss_of(2)

    def draft() -> None:
        model.eval()
        context = torch.randn(
            case.sequence_length // 2, 5, case.hidden_size, device=device, dtype=torch.bfloat16
        )
        with autocast:
            model.draft_block(context, anchor_token=5)

    timed(f"train 1 x {case.sequence_length}", lambda: train_step(1))
    timed(f"train 2 x {case.sequence_length}", lambda: train_step(2))
    timed(f"evaluate 2 x {case.sequence_length}", evaluate)
    timed("draft one block", draft)
    model.train()
    return seconds


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def check_shape(case: DrafterShapeCase, shape: str, device: torch.device) -> dict[str, Any]:
    model = build(case, shape, device)
    backend = model.attention_backend
    before = graphs()
    first = run_pass(model, case, device)
    compiled = graphs() - before
    syncs: collections.Counter[str] = collections.Counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
            torch.cuda.reset_peak_memory_stats(device)
        try:
            second = run_pass(model, case, device)
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message):
            syncs[f"{Path(warning.filename).name}:{warning.lineno}"] += 1
    return {
        "shape": shape,
        "layer_types": list(model.config.layer_types),
        "parameters": drafter_parameter_count(model.config),
        "attention": backend,
        "graphs_compiled_in_first_pass": compiled,
        "graphs_compiled_in_second_pass": graphs() - before - compiled,
        "host_device_syncs_in_second_pass": sum(syncs.values()),
        "syncs_by_line": dict(syncs.most_common()),
        "seconds_first_pass": first,
        "seconds_second_pass": second,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the figures (JSON)")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape (any device)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"drafter shapes (default {SHAPES})")
    args = parser.parse_args()
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    case = TINY if args.tiny or device.type != "cuda" else QWEN36_27B
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # loud, not a silent uncompiled fallback
    limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
    figures: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "case": case.name,
        "hidden_size": case.hidden_size,
        "vocab_size": case.vocab_size,
        "sequence_length": case.sequence_length,
        "num_anchors": case.num_anchors,
        "recompile_limit": limit,
        "shapes": [],
    }
    for shape in args.shapes.split(","):
        result = check_shape(case, shape.strip(), device)
        figures["shapes"].append(result)
        print(
            f"{shape}: {result['attention']} attention, {result['graphs_compiled_in_first_pass']} graphs "
            f"compiled, {result['graphs_compiled_in_second_pass']} more in the second pass, "
            f"{result['host_device_syncs_in_second_pass']} host-device syncs in it; "
            f"seconds {result['seconds_second_pass']}",
            flush=True,
        )
        del result
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(figures, indent=1))
    print(f"figures: {args.out}")


if __name__ == "__main__":
    main()
