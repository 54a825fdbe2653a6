"""The drafter's training step at a real shape: flex attention vs the materialised scores, side by side.

One step = forward, backward and AdamW update of a DFlash drafter under bf16 autocast, on random
weights and random target hidden states (nothing downloaded): 512 anchors of a 16-token block per
sequence of 3072 tokens, as the recipe trains. Reports seconds per step, tokens/s, peak memory above the
weights and optimiser state (on a CPU from torch's profiler: its allocation events), the planner's estimate
of it (`estimate_step_bytes` for the backend, plus the gradients) as a ratio to the measured peak, and MFU
from an analytic FLOP count. On a CPU (tiny shapes) only the materialised path runs: flex attention has no
CPU backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from dflash_assets.bench.capture_ways import synchronize
from dflash_assets.drafter.config import DrafterConfig, dflash2_shape, drafter_shape
from dflash_assets.drafter.model import (
    DFlashDrafter,
    dflash2_parameter_counts,
    drafter_class,
    drafter_parameter_count,
)
from dflash_assets.drafter.objective import (
    DrafterBatch,
    anchor_generator,
    block_labels,
    estimate_step_bytes,
    sample_anchors,
)


@dataclass(frozen=True)
class DrafterShapeCase:
    name: str
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    sequence_length: int
    num_anchors: int


QWEN3_8B = DrafterShapeCase("Qwen3-8B drafter", 4096, 12288, 151936, 36, 3072, 512)
TINY = DrafterShapeCase("tiny drafter", 64, 176, 1536, 12, 256, 32)


def build_drafter(
    case: DrafterShapeCase, device: torch.device, arch: str = "dflash", block_size: int | None = None
) -> DFlashDrafter:
    """The `dflash` preset for a target of this width, with random shared embedding and LM head; `arch`
    `dflash2` adds DFlash2's convolutions and selector at their published shape; `block_size` another
    block than the config's default."""
    from dflash_assets.target.layer_ids import dflash_target_layer_ids

    target = {"hidden_size": case.hidden_size, "intermediate_size": case.intermediate_size}
    config = DrafterConfig(
        hidden_size=case.hidden_size,
        vocab_size=case.vocab_size,
        mask_token_id=case.vocab_size - 1,
        target_layer_ids=dflash_target_layer_ids(case.num_target_layers, 5),
        target_num_hidden_layers=case.num_target_layers,
        arch=arch,
        **drafter_shape(target, "dflash", 5),
        **(dflash2_shape(case.hidden_size) if arch == "dflash2" else {}),
        **({"block_size": block_size} if block_size else {}),
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    embedding = torch.randn(case.vocab_size, case.hidden_size, device=device, dtype=dtype) * 0.02
    lm_head = torch.randn(case.vocab_size, case.hidden_size, device=device, dtype=dtype) * 0.02
    torch.manual_seed(0)
    with torch.device(device):
        return drafter_class(config)(config, embedding, lm_head)


def random_batch(
    case: DrafterShapeCase, batch_size: int, device: torch.device, final_state: bool = False
) -> DrafterBatch:
    """Random states of the 5 captured layers (and the target's final state after them, `final_state`)."""
    length, layers = case.sequence_length, 5 + int(final_state)
    input_ids = torch.randint(0, case.vocab_size - 1, (batch_size, length))
    loss_mask = torch.ones(batch_size, length, dtype=torch.bool)
    loss_mask[:, :64] = False  # a prompt, as real samples have
    hidden = torch.randn(batch_size, length, layers, case.hidden_size, device=device, dtype=torch.bfloat16)
    lengths = torch.full((batch_size,), length)
    return DrafterBatch(
        input_ids, loss_mask, hidden, lengths, list(range(batch_size)), final_state=final_state
    )


def step_flops(model: DFlashDrafter, batch: DrafterBatch, num_blocks: int, labels: int) -> float:
    """Matmul FLOPs of one forward + backward (x3): linear layers over every block slot, the context
    projection and k/v over the context, attention over the visible context (on average half of it,
    anchors being uniform) plus the block, and the LM head over the labelled slots."""
    config = model.config
    batch_size, length = batch.input_ids.shape
    slots = batch_size * num_blocks * config.block_size
    params = drafter_parameter_count(config)
    context_params = config.num_context_layers * config.hidden_size * config.hidden_size
    kv = 2 * config.hidden_size * config.num_kv_heads * config.head_dim * config.num_layers
    width = config.num_heads * config.head_dim
    attention = 2 * 2 * slots * (length / 2 + config.block_size) * width * config.num_layers
    _, selector_params = dflash2_parameter_counts(config)
    labelled_share = labels * config.selector_rank * (config.hidden_size + config.selector_top_k)
    forward = (
        2 * slots * (params - context_params - selector_params)
        + (2 * labelled_share if config.has_selector else 0)
        + 2 * batch_size * length * (context_params + kv)
        + attention
        + 2 * labels * config.vocab_size * config.hidden_size
    )
    return 3 * forward


def cpu_peak_bytes(step: Callable[[], object]) -> int:
    """The most CPU tensor memory `step` holds at once above what was allocated when it began, from the
    allocation events of torch's profiler (what `torch.cuda.max_memory_allocated` tells on CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    events = profiler.profiler.kineto_results.events()
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in changes:
        live += nbytes
        peak = max(peak, live)
    return peak


def planned_peak_bytes(model: DFlashDrafter, batch: DrafterBatch, num_anchors: int, backend: str) -> int:
    """What the planner expects a step to hold above the weights and optimiser state: the activations
    (`estimate_step_bytes`, as the trainer plans micro-batches) and the float32 gradients."""
    batch_size, length = batch.input_ids.shape
    blocks = min(num_anchors, max(length - 1, 1))
    activations = estimate_step_bytes(model.config, batch_size, length, blocks, attention=backend)
    return activations + 4 * drafter_parameter_count(model.config)


def time_steps(
    model: DFlashDrafter,
    batch: DrafterBatch,
    num_anchors: int,
    backend: str,
    steps: int,
    device: torch.device,
    objective: Any = 7.0,
) -> dict[str, Any]:
    """Seconds per step (median of `steps` after a warm-up step), peak memory above the idle state.
    `objective`: the loss's (`drafter.objective.Objective`; a number is the paper's decay)."""
    from dflash_assets.drafter.objective import dflash_loss

    model.set_attention_backend(backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    anchors = sample_anchors(
        batch.loss_mask, num_anchors, [anchor_generator(0, 0, i) for i in batch.sample_indices]
    )
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    def one_step() -> float:
        with autocast:
            output = dflash_loss(model, batch, anchors, objective)
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(output.loss.detach())

    one_step()  # compile, allocate optimiser state
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        idle = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        loss = one_step()
        synchronize(device)
        times.append(time.perf_counter() - started)
    peak = (
        torch.cuda.max_memory_allocated(device) - idle if device.type == "cuda" else cpu_peak_bytes(one_step)
    )
    _, _, labels = block_labels(batch, anchors, model.config.block_size)
    seconds = sorted(times)[len(times) // 2]
    return {
        "seconds": seconds,
        "tokens_per_s": batch.num_tokens / seconds,
        "peak_bytes": peak,
        "planned_bytes": planned_peak_bytes(model, batch, num_anchors, backend),
        "flops": step_flops(model, batch, anchors.positions.shape[1], int(labels.sum())),
        "loss": loss,
    }


def drafter_step_lines(
    device: torch.device,
    *,
    tiny: bool,
    peak_flops: Callable[[torch.device], float | None],
    steps: int = 3,
    record: dict[str, Any] | None = None,
) -> list[str]:
    """The section's lines: per backend and batch size, step time, tokens/s, peak memory, MFU, and the
    flex ÷ materialised ratios the issue's goals name (>= 1.5x speed, <= 0.5x memory at 1 x 3072).
    `record` receives what the plan reads back (`planning/gpu_result.py`'s `drafter_step`): the fastest
    batch size of the backend training uses on this device."""
    case = TINY if tiny or device.type != "cuda" else QWEN3_8B
    backends = ["materialised", "flex"] if device.type == "cuda" else ["materialised"]
    peak = peak_flops(device)
    lines = [
        f"\ndrafter training step, {case.name}: hidden {case.hidden_size}, vocab {case.vocab_size:,}, "
        f"{case.num_anchors} anchors x 16 per sequence of {case.sequence_length} tokens, on {device}"
        + (", bf16 autocast" if device.type == "cuda" else " in float32 (flex needs CUDA: materialised only)")
    ]
    model = build_drafter(case, device)
    lines.append(f"  drafter parameters: {drafter_parameter_count(model.config) / 1e6:,.1f} M")
    results: dict[tuple[str, int], dict[str, Any]] = {}
    for batch_size in (1, 2):
        batch = random_batch(case, batch_size, device)
        for backend in backends:
            try:
                result = time_steps(model, batch, case.num_anchors, backend, steps, device)
            except torch.OutOfMemoryError:
                lines.append(f"  {backend:12s} {batch_size} x {case.sequence_length}: out of memory")
                torch.cuda.empty_cache()
                continue
            results[(backend, batch_size)] = result
            mfu = result["flops"] / result["seconds"] / peak if peak else None
            peak_bytes, planned = result["peak_bytes"], result["planned_bytes"]
            lines.append(
                f"  {backend:12s} {batch_size} x {case.sequence_length}: {result['seconds']:7.3f} s/step "
                f"{result['tokens_per_s']:9,.0f} tok/s  peak {peak_bytes / 2**30:6.2f} GiB (planned "
                f"{planned / 2**30:.2f}, {planned / peak_bytes:.2f}x)  MFU "
                + (f"{mfu:.0%}" if mfu is not None else "n/a")
                + f"  loss {result['loss']:.3f}"
            )
    trained_with = "flex" if device.type == "cuda" and ("flex", 1) in results else "materialised"
    measured = [(b, r) for (backend, b), r in results.items() if backend == trained_with]
    if record is not None and measured:
        from dflash_assets.planning.training_split import drafter_flops_per_token

        batch_size, best = max(measured, key=lambda item: item[1]["tokens_per_s"])
        length = case.sequence_length
        flops = drafter_flops_per_token(model.config, [length], case.num_anchors, length)
        record.update(
            shape=case.name,
            backend=trained_with,
            batch_size=batch_size,
            sequence_length=length,
            num_anchors=case.num_anchors,
            tokens_per_s=best["tokens_per_s"],
            flops_per_token=flops,
            mfu=best["tokens_per_s"] * flops / peak if peak else None,
        )
    lines += dflash2_lines(case, device, trained_with, results.get((trained_with, 1)), steps, record)
    lines += distillation_lines(case, device, trained_with, steps, record)
    for batch_size in (1, 2):
        flex, dense = results.get(("flex", batch_size)), results.get(("materialised", batch_size))
        if flex and dense:
            memory = (
                f", memory {flex['peak_bytes'] / dense['peak_bytes']:.2f}x (target <= 0.5)"
                if dense["peak_bytes"]
                else ""
            )
            lines.append(
                f"  flex / materialised at {batch_size} x {case.sequence_length}: speed "
                f"{dense['seconds'] / flex['seconds']:.2f}x (target >= 1.5){memory}"
            )
    return lines


def dflash2_lines(
    case: DrafterShapeCase,
    device: torch.device,
    backend: str,
    dflash: dict[str, Any] | None,
    steps: int,
    record: dict[str, Any] | None,
) -> list[str]:
    """DFlash2's step beside DFlash's (one sequence, the backend training uses): its whole step, and the
    share of it its two additions take, each timed by leaving it out (the selector alone: DFlash2 without
    its convolutions). The three are timed in the same phase, DFlash again beside them, interleaved over
    rounds on a CPU (a shared machine's noise is larger than the shares at small shapes), each its
    fastest round. Parameters are counted the same way."""
    if dflash is None:
        return []
    full = build_drafter(case, device, "dflash2")
    without_convolutions = build_drafter(case, device, "dflash2")
    for layer in without_convolutions.layers:
        layer.attention_conv = layer.mlp_conv = None
    models = {"dflash": build_drafter(case, device), "dflash2": full, "selector only": without_convolutions}
    batch = random_batch(case, 1, device)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in models}
    for _ in range(1 if device.type == "cuda" else 3):
        for name, model in models.items():
            rounds[name].append(time_steps(model, batch, case.num_anchors, backend, steps, device))
    timed = {name: min(runs, key=lambda run: run["seconds"]) for name, runs in rounds.items()}
    del models
    total, selector_only = timed["dflash2"]["seconds"], timed["selector only"]["seconds"]
    base = timed["dflash"]["seconds"]
    convolutions, selector = dflash2_parameter_counts(full.config)
    parameters = drafter_parameter_count(full.config)
    lines = [
        f"  dflash2      1 x {case.sequence_length}: {total:7.3f} s/step "
        f"{timed['dflash2']['tokens_per_s']:9,.0f} tok/s, {total / base:.2f}x DFlash's step; of it the "
        f"selector {(selector_only - base) / total:.0%} and the convolutions "
        f"{(total - selector_only) / total:.0%}",
        f"  dflash2 parameters: {parameters / 1e6:,.1f} M, of which the selector {selector / 1e6:,.1f} M "
        f"(two {full.config.vocab_size:,} x {full.config.selector_rank} codebooks) and the convolutions "
        f"{convolutions / 1e6:,.1f} M",
    ]
    if record is not None:
        record["dflash2"] = {
            "seconds": total,
            "tokens_per_s": timed["dflash2"]["tokens_per_s"],
            "dflash_seconds": base,
            "selector_share": (selector_only - base) / total,
            "convolution_share": (total - selector_only) / total,
            "parameters": parameters,
            "selector_parameters": selector,
            "convolution_parameters": convolutions,
        }
    return lines


def distillation_lines(
    case: DrafterShapeCase, device: torch.device, backend: str, steps: int, record: dict[str, Any] | None
) -> list[str]:
    """The step with distillation (`DFLASH_DISTILL_WEIGHT` 0.5: the target's head on its final state, a
    chunk of rows at a time) beside the same step without it (D-PACE, one sequence), interleaved over
    rounds on a CPU, each its fastest round; and the peak memory of each."""
    from dflash_assets.drafter.objective import Objective

    model = build_drafter(case, device)
    batch = random_batch(case, 1, device, final_state=True)
    ways = {"without": Objective(loss="dpace"), "distilling": Objective(loss="dpace", distill_weight=0.5)}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in ways}
    for _ in range(1 if device.type == "cuda" else 3):
        for name, objective in ways.items():
            rounds[name].append(time_steps(model, batch, case.num_anchors, backend, steps, device, objective))
    timed = {name: min(runs, key=lambda run: run["seconds"]) for name, runs in rounds.items()}
    without, distilling = timed["without"], timed["distilling"]
    memory = distilling["peak_bytes"] / without["peak_bytes"] if without["peak_bytes"] else None
    if record is not None:
        record["distillation"] = {
            "seconds": distilling["seconds"],
            "without_seconds": without["seconds"],
            "peak_bytes": distilling["peak_bytes"],
            "without_peak_bytes": without["peak_bytes"],
        }
    return [
        f"  distilling   1 x {case.sequence_length}: {distilling['seconds']:7.3f} s/step, "
        f"{distilling['seconds'] / without['seconds']:.2f}x the step without it (weight 0.5: the target's "
        f"head over {case.vocab_size:,} tokens beside the drafter's)"
        + (f", peak memory {memory:.2f}x" if memory is not None else "")
    ]
