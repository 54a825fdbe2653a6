"""One rank of a range's capture from a target split over several devices (`DFLASH_TARGET_TP` > 1), as
torch.distributed's launcher starts it: `python -m dflash_assets.extraction.rank JOB.json`.

Rank 0 extracts the range exactly as one device does (`extract_range`: the same listing, staging,
uploads and fingerprint), sending each batch to the other ranks before its forward; they run the same
forward on their shards, through the same last layer, and keep nothing (no capture buffer: only rank 0
fills one). Only rank 0 writes objects. A batch that runs out of memory on any rank is not halved: every
rank stops, naming the token budget to lower (`target/tensor_parallel.py`). The shards leave out the LM
head. The rank's life (lease, process group, shard, reports to the step) is `target/ranks.py`'s.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from dflash_assets.extraction.capture import HiddenStateCapture, final_hidden_state
from dflash_assets.settings import MAX_TOKENS_PER_BATCH
from dflash_assets.target.devices import current_device
from dflash_assets.target.layer_ids import resolve_target_layer_ids
from dflash_assets.target.model import find_decoder
from dflash_assets.target.ranks import StepLink, TargetRankJob, rank_main
from dflash_assets.target.tensor_parallel import fail_fast_on_out_of_memory, full_tensor

CAPTURE = "capture"
LOWER = f"{MAX_TOKENS_PER_BATCH.name} (run config `max_tokens_per_batch`)"


def _batch(input_ids: torch.Tensor) -> str:
    return f"a batch of {input_ids.shape[0]} samples x {input_ids.shape[1]:,} tokens"


class LeaderCapture(HiddenStateCapture):
    """Rank 0's capture: each batch goes to the other ranks first, then through this rank's shard."""

    def __init__(
        self, model: torch.nn.Module, target_layer_ids: list[int], group: Any, *, final_state: bool = False
    ) -> None:
        super().__init__(model, target_layer_ids, final_state=final_state)
        self.group = group

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.group.send(CAPTURE, input_ids.cpu(), attention_mask.cpu())
        group = self.group
        with fail_fast_on_out_of_memory(group.rank, group.size, group.device, _batch(input_ids), LOWER):
            return super().__call__(input_ids, attention_mask)


class _StopForward(Exception):
    pass


class FollowerForward:
    """A follower's part of a capture: the forward over its shard through the last captured layer, each
    captured layer's output made whole as rank 0 makes it (a plan that leaves it sharded gathers it, a
    collective rank 0 joins too), and nothing kept."""

    def __init__(
        self, model: torch.nn.Module, target_layer_ids: list[int], *, final_state: bool = False
    ) -> None:
        self.base_model, self.layers = find_decoder(model)
        self.target_layer_ids = resolve_target_layer_ids(
            {"num_hidden_layers": len(self.layers)}, list(target_layer_ids)
        )
        self.final_state = final_state  # then the forward runs to the final norm, as rank 0's does

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        last = None if self.final_state else self.target_layer_ids[-1]

        def make_hook(layer_id: int):
            def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
                full_tensor(output[0] if isinstance(output, tuple | list) else output)
                if layer_id == last:
                    raise _StopForward

            return hook

        handles = [self.layers[i].register_forward_hook(make_hook(i)) for i in self.target_layer_ids]
        device = next(self.base_model.parameters()).device
        try:
            with current_device(device), torch.inference_mode():
                output = self.base_model(
                    input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
                )
                if self.final_state:
                    full_tensor(final_hidden_state(output))
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()


def lead(job: TargetRankJob) -> Any:
    """Rank 0's work: the range's extraction; its outcome is what the step reports."""

    def run(group: Any, model: torch.nn.Module, devices: list[str], link: StepLink) -> dict[str, Any]:
        from dflash_assets.conversations.shard import load_shard
        from dflash_assets.extraction.extract import extract_range
        from dflash_assets.storage.manifest import StoredPartition
        from dflash_assets.storage.open_store import open_store
        from dflash_assets.storage.s3_store import S3Settings
        from dflash_assets.storage.uploader import Uploader

        work = job.work
        store = open_store(work["store_url"], S3Settings(**work["s3"]) if work.get("s3") else None)
        tokenized = StoredPartition(store, work["tokenized_prefix"], work["tokenized_manifest"])
        samples = load_shard(tokenized, Path(work["read_cache_dir"]))
        layer_ids = [int(i) for i in work["target_layer_ids"]]
        progress = lambda snapshot: link.event("progress", _snapshot(snapshot))  # noqa: E731
        with Uploader(store, **work["upload"]) as uploader:
            result = extract_range(
                model=model,
                capture=LeaderCapture(model, layer_ids, group, final_state=bool(work.get("final_state"))),
                target_model_name=work["target_model_name"],
                samples=samples,
                target_layer_ids=layer_ids,
                store=store,
                prefix=work["prefix"],
                staging_dir=Path(work["staging_dir"]),
                uploader=uploader,
                device=",".join(devices),
                max_tokens_per_batch=int(work["max_tokens_per_batch"]),
                max_batch_size=int(work["max_batch_size"]),
                log=link.log,
                warn=link.warn,
                progress_every_s=float(work["progress_every_s"]),
                on_progress=progress,
                hidden_state_dtype=work["hidden_state_dtype"],
                source=work["source"],
                final_state=bool(work.get("final_state")),
            )
        return {
            "objects": result.objects,
            "tokens": result.tokens,
            "metadata": result.metadata(),
            "summary": result.summary(),
        }

    return run


def _snapshot(progress: Any) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(progress)


def handlers(job: TargetRankJob):
    layer_ids = [int(i) for i in job.work["target_layer_ids"]]

    def make(model: torch.nn.Module) -> dict[str, Any]:
        forward = FollowerForward(model, layer_ids, final_state=bool(job.work.get("final_state")))
        rank, size = int(os.environ["RANK"]), job.tp
        device = next(model.parameters()).device

        def run(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
            with fail_fast_on_out_of_memory(rank, size, device, _batch(input_ids), LOWER):
                forward(input_ids, attention_mask)  # the collectives inside meet rank 0's

        return {CAPTURE: run}

    return make


def main(argv: list[str] | None = None) -> int:
    return rank_main(
        argv,
        prog="dflash_assets.extraction.rank",
        description=__doc__,
        what="capture",
        lead=lead,
        handlers=handlers,
        lm_head=False,
    )


if __name__ == "__main__":
    sys.exit(main())
