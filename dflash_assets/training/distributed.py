"""How the ranks of one training run agree: the process group, and the few collectives the trainer uses.

Data-parallel with replicated weights, DDP's arithmetic: every rank holds the whole drafter and its
AdamW state, computes the gradients of its own share of each global batch (accumulating over its
micro-batches), then one bucketed all-reduce sums them; every rank applies the same update. The sum is
made after a rank's last micro-batch rather than overlapped with its backward (DDP's hooks): ranks run
different numbers of micro-batches (length-bucketed shares), may redo a step's micro-batches after
running out of memory, or have no sample at all in a ragged last batch, and none of that may leave
another rank inside a collective.

`SingleProcess` is the same interface for one process: the trainer never asks how many ranks there are.

Every collective has a timeout (`collective_timeout_s`): a dead peer ends the job instead of hanging it.
Work between collectives that can take minutes on one rank and seconds on another (a checkpoint's
download on resume, an evaluation with the target, the first compilation) ends in a meeting on a
separate gloo group with its own, longer timeout (`long_work_s`: `long_barrier`, and the `long=True`
object collectives), so the collective timeout never has to cover it.

Why not `DistributedDataParallel`: its hooks all-reduce during the backward, which needs every rank to
run the same number of backward passes; here a rank may run more micro-batches than another, redo a step
in smaller ones after running out of memory, or have no sample in a step.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# torch.distributed's standard environment, set by torchrun for every rank.
RANK_ENV, WORLD_SIZE_ENV, LOCAL_RANK_ENV, LOCAL_WORLD_SIZE_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
)
BUCKET_ELEMENTS = 2**26  # 256 MB of float32 gradients per all-reduce


@dataclass(frozen=True)
class Timeouts:
    collective_s: float  # any collective: a peer that stops answering ends the job
    long_work_s: float  # meetings after long work: a resume's download, an evaluation, a compilation


class SingleProcess:
    """One process trains alone: every collective is the identity."""

    rank = 0
    world_size = 1
    local_rank = 0
    local_world_size = 1
    is_rank0 = True

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def sync_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        pass

    def all_gather_object(self, value: Any, *, long: bool = False) -> list[Any]:
        return [value]

    def broadcast_object(self, value: Any, *, long: bool = False) -> Any:
        return value

    def long_barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class ProcessGroup:
    """This process as one rank of a torch.distributed job (NCCL on CUDA, gloo on the CPU)."""

    def __init__(self, device: torch.device, timeouts: Timeouts) -> None:
        import torch.distributed as dist

        self.device = device
        self.rank = int(os.environ[RANK_ENV])
        self.world_size = int(os.environ[WORLD_SIZE_ENV])
        self.local_rank = int(os.environ.get(LOCAL_RANK_ENV, "0"))
        self.local_world_size = int(os.environ.get(LOCAL_WORLD_SIZE_ENV, "1"))
        self.is_rank0 = self.rank == 0
        backend = "nccl" if device.type == "cuda" else "gloo"
        init: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
        timeout = datetime.timedelta(seconds=timeouts.collective_s)
        dist.init_process_group(
            backend=backend,
            store=_attempt_store(self.rank, self.world_size, timeout),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
            **init,
        )
        # Host-side agreement (objects, the wait for rank 0) on gloo, whatever the training backend.
        self._host = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeouts.collective_s))
        self._long = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeouts.long_work_s))
        self._dist = dist

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over ranks, in place (a tensor on this rank's device)."""
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.SUM)
        return tensor

    def sync_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Sum every trainable parameter's gradient over the ranks, in buckets. A rank without a gradient
        for a parameter (no sample this step) contributes zeros."""
        grads: list[torch.Tensor] = []
        for parameter in parameters:
            if not parameter.requires_grad:
                continue
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            grads.append(parameter.grad)
        for bucket in _buckets(grads, BUCKET_ELEMENTS):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            self._dist.all_reduce(flat, op=self._dist.ReduceOp.SUM)
            offset = 0
            for grad in bucket:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def all_gather_object(self, value: Any, *, long: bool = False) -> list[Any]:
        """Every rank's `value`, in rank order; `long`: waiting with the long timeout (after long work)."""
        gathered: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(gathered, value, group=self._long if long else self._host)
        return gathered

    def broadcast_object(self, value: Any, *, long: bool = False) -> Any:
        """Rank 0's `value`, on every rank; `long`: the others wait for it with the long timeout."""
        box = [value if self.is_rank0 else None]
        self._dist.broadcast_object_list(box, src=0, group=self._long if long else self._host)
        return box[0]

    def long_barrier(self) -> None:
        """Every rank meets here, waiting up to the long timeout for the slowest, outside any collective
        of the training backend."""
        self._dist.barrier(group=self._long)

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta):
    """The launcher's store, under a prefix of this attempt. After a rank dies, torchrun's agent starts
    the ranks again against the same store it serves (`TORCHELASTIC_USE_AGENT_STORE`), where the dead
    attempt's keys are still there: without a prefix, the new ranks read the old ranks' addresses and
    either fail to connect or wait for them until the timeout."""
    import torch.distributed as dist

    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_serves and rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"dflash/attempt-{attempt}", store)


def _buckets(tensors: Sequence[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype and device, up to `limit` elements each (a larger tensor alone)."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        last = buckets[-1] if buckets else None
        fits = last is not None and size + tensor.numel() <= limit
        if fits and last[0].dtype == tensor.dtype and last[0].device == tensor.device:
            last.append(tensor)
            size += tensor.numel()
        else:
            buckets.append([tensor])
            size = tensor.numel()
    return buckets


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a job that torch.distributed's launcher started."""
    return RANK_ENV in os.environ and WORLD_SIZE_ENV in os.environ
