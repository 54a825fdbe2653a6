"""The loss's cross-entropy, fused against plain, in one SmolLM2-shaped DFlash2 training step on this machine.

`cross_entropy_and_gather` (drafter/objective.py) reads the head's bf16 logits in float32 a few rows at a time
and writes their `[rows, vocabulary]` gradient once; `F.cross_entropy` and `gather` on the logits cast to
float32 allocate, zero and sum one each, and the casts make two more passes. This times the whole step of the
default drafter for SmolLM2-135M (hidden 576, vocabulary 49,152, block 8, 4 sequences of 450 tokens, 64
anchors each, bf16 autocast, forward + backward + AdamW; random weights and states, nothing downloaded)
with each, alternated in one process so a noisy machine slows both alike, and prints the medians' ratio.

    OMP_NUM_THREADS=1 python scripts/bench_loss_gradient.py [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch

import dflash_assets.drafter.objective as objective
from dflash_assets.bench.drafter_step import DrafterShapeCase, build_drafter, random_batch

SMOLLM2 = DrafterShapeCase("SmolLM2-135M drafter", 576, 1536, 49152, 30, 450, 64)


def plain(
    logits: torch.Tensor, labels: torch.Tensor, columns: torch.Tensor, lse: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    logits = logits.float()
    return torch.nn.functional.cross_entropy(logits, labels, reduction="none"), logits.gather(1, columns)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_drafter(SMOLLM2, torch.device("cpu"), arch="dflash2", block_size=8)
    batch = random_batch(SMOLLM2, 4, torch.device("cpu"))
    generators = [objective.anchor_generator(0, 0, i) for i in batch.sample_indices]
    anchors = objective.sample_anchors(batch.loss_mask, SMOLLM2.num_anchors, generators)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = objective.dflash_loss(model, batch, anchors, objective.Objective())
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    fused = objective.cross_entropy_and_gather
    step()  # optimiser state, first-call allocations
    times: dict[str, list[float]] = {"fused": [], "plain": []}
    for _ in range(args.rounds):
        for name, function in (("fused", fused), ("plain", plain)):
            objective.cross_entropy_and_gather = function
            times[name].append(step())
    objective.cross_entropy_and_gather = fused
    median = {name: sorted(values)[len(values) // 2] for name, values in times.items()}
    print(
        f"{SMOLLM2.name}, block 8, 4 x {SMOLLM2.sequence_length} tokens, {SMOLLM2.num_anchors} anchors, "
        f"bf16 autocast, {args.threads} thread(s), median of {args.rounds}: fused {median['fused']:.3f} s "
        f"a step, plain {median['plain']:.3f} s, plain / fused {median['plain'] / median['fused']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
