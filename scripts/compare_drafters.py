"""Measure several exported drafters on the same held-out prompts with the same target.

    python scripts/compare_drafters.py STORE [STORE ...]

Each STORE is a local store a `dflash-assets demo` wrote (`$DFLASH_HOME/store`). The held-out rows are
the first store's training run's; each store's tokenized ranges give the prompts (every token before a
row's last answer), so the prompts of data written by the target and of the dataset's are both
measured. Acceptance is greedy speculative decoding with the target, as the trainer measures it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from dflash_assets.conversations.shard import read_shard
from dflash_assets.drafter.export import load_drafter
from dflash_assets.drafter.speculative import (
    SpeculativeEvaluator,
    TargetVerifier,
    held_out_prompts,
    stop_token_ids_of,
)
from dflash_assets.target.model import load_target_model

MAX_NEW_TOKENS = 64


def prompts_of(store: Path, rows: list[int], limit: int) -> list[list[int]]:
    samples = {s.sample_index: s for shard in sorted(store.glob("tokenized-completions/*/shard.parquet"))
               for s in read_shard(shard)}  # fmt: skip
    chosen = [samples[i] for i in rows if i in samples]
    ids, masks = [s.input_ids for s in chosen], [s.loss_mask for s in chosen]
    return held_out_prompts(ids, masks, 3072 - MAX_NEW_TOKENS)[:limit]


def main(stores: list[Path]) -> None:
    torch.set_num_threads(1)
    first = json.loads((stores[0] / "checkpoints/drafter/_manifest.json").read_text())
    config = json.loads((stores[0] / "drafter/drafter/config.json").read_text())
    target_dir = Path(config["dflash_assets"]["target_model"])  # the target the drafter was trained for
    target = load_target_model(target_dir, "cpu")
    verifier = TargetVerifier(target, config["dflash_config"]["target_layer_ids"])
    rows = first["eval_sample_indices"]
    for prompt_store in stores:
        prompts = prompts_of(prompt_store, rows, limit=16)
        for drafter_store in stores:
            drafter = load_drafter(drafter_store / "drafter/drafter", target_model=target_dir)
            stop = stop_token_ids_of(str(target_dir))
            evaluator = SpeculativeEvaluator(
                verifier, prompts, max_new_tokens=MAX_NEW_TOKENS, stop_token_ids=stop
            )
            result = evaluator.evaluate(drafter)
            print(
                f"prompts from {prompt_store} ({len(prompts)}), drafter from {drafter_store}: "
                f"tau {result['acceptance_length_tau']:.3f} (equals the target's greedy output: "
                f"{result['matches_target_greedy']})",
                flush=True,
            )


if __name__ == "__main__":
    main([Path(arg) for arg in sys.argv[1:]])
