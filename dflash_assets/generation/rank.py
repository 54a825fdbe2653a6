"""One rank of a target split over several devices (`DFLASH_TARGET_TP` > 1) answering a regeneration's
batches, as torch.distributed's launcher starts it: `python -m dflash_assets.generation.rank JOB.json`.

The step runs the range (`regenerate_range`: batches, journal, chunks, uploads) with a
`SplitTargetEngine`, which sends each batch's prompts here. Rank 0 takes the step's requests from the
step's store and hands each batch to the other ranks before its own `generate` (they run the same
`generate` on their shards, the same seed included, and keep nothing); it replies with the new tokens.
The rank's life (lease, process group, shard, reports) is `target/ranks.py`'s.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from dflash_assets.generation.in_process import generate_rows
from dflash_assets.target.ranks import StepLink, TargetRankJob, rank_main
from dflash_assets.target.tensor_parallel import fail_fast_on_out_of_memory

GENERATE = "generate"
LOWER = "the run config's `max_tokens_per_batch` or `max_batch_size`, or DFLASH_GENERATE_MAX_NEW_TOKENS"


def _generate(
    model: Any, tp: int, prompts: list[list[int]], pad_id: int, config: dict, seed: int | None
) -> list[list[int]]:
    """One batch's `generate` on this rank's shard; out of memory ends every rank (no halving alone)."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    what = f"a batch of {len(prompts)} prompts of up to {max(map(len, prompts)):,} tokens"
    with fail_fast_on_out_of_memory(int(os.environ["RANK"]), tp, device, what, LOWER):
        return generate_rows(model, prompts, pad_id, GenerationConfig.from_dict(config), seed, device)


def lead(job: TargetRankJob):
    """Rank 0: answer the step's requests until it says stop (or says nothing for the job's timeout)."""

    def run(group: Any, model: Any, devices: list[str], link: StepLink) -> dict[str, Any]:
        batches = 0
        while True:
            request = link.next_request(wait_s=job.timeout_s)
            if request is None:
                raise TimeoutError(
                    f"the step sent no request for {job.timeout_s:.0f} s "
                    "(DFLASH_TARGET_TP_TIMEOUT_S): stopping"
                )
            kind = request.get("kind", GENERATE)
            if kind == "stop":
                return {"batches": batches}
            if kind == "ready":
                link.reply({"ready": True, "devices": devices})
                continue
            payload = (request["prompts"], int(request["pad_id"]), request["config"], request["seed"])
            group.send(GENERATE, *payload)
            link.reply({"rows": _generate(model, job.tp, *payload)})
            batches += 1

    return run


def handlers(job: TargetRankJob):
    return lambda model: {GENERATE: lambda *payload: _generate(model, job.tp, *payload)}


def main(argv: list[str] | None = None) -> int:
    return rank_main(
        argv,
        prog="dflash_assets.generation.rank",
        description=__doc__,
        what="regeneration",
        lead=lead,
        handlers=handlers,
        lm_head=True,  # `generate` reads the logits
    )


if __name__ == "__main__":
    sys.exit(main())
