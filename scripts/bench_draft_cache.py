"""The drafter's draft a round with its context keys and values kept (`DraftCache`) against projecting the
whole context again, for the default SmolLM2-135M drafter (DFlash2, block 8, hidden 576, vocabulary 49,152,
five context layers; random weights and states, nothing downloaded) on this machine.

A decoding's rounds grow the context by what each commits; this drafts one round at each context length,
the cache having seen the context up to two positions before (a round that accepted one draft), and the
uncached path from scratch, alternated in one process so a noisy machine slows both alike. It prints each
path's median milliseconds a round and their ratio.

    OMP_NUM_THREADS=1 python scripts/bench_draft_cache.py [--threads 1] [--contexts 300,1500] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dflash_assets.bench.drafter_step import DrafterShapeCase, build_drafter

SMOLLM2 = DrafterShapeCase("SmolLM2-135M drafter", 576, 1536, 49152, 30, 450, 64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="300,1500", help="context lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    drafter = build_drafter(SMOLLM2, torch.device("cpu"), arch="dflash2", block_size=8).eval()
    layers, width = drafter.config.num_context_layers, drafter.config.target_hidden_size
    print(f"{SMOLLM2.name}: DFlash2, block 8, {args.threads} thread(s), median of {args.rounds} rounds")
    for length in (int(part) for part in args.contexts.split(",")):
        context = torch.randn(length, layers, width).to(torch.bfloat16)
        kept_ms, whole_ms = [], []
        for _ in range(args.rounds):
            cache = drafter.new_draft_cache()
            drafter.draft_block(context[: length - 2], 5, cache=cache)  # the rounds before
            started = time.perf_counter()
            kept = drafter.draft_block(context, 5, cache=cache)
            kept_ms.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            whole = drafter.draft_block(context, 5)
            whole_ms.append((time.perf_counter() - started) * 1000)
        kept_median, whole_median = statistics.median(kept_ms), statistics.median(whole_ms)
        same = "the same drafts" if torch.equal(kept, whole) else "DIFFERENT drafts"
        print(
            f"  context {length:>6,}: kept {kept_median:7.1f} ms a round, "
            f"whole context {whole_median:7.1f} ms "
            f"({whole_median / kept_median:.1f}x); {same}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
