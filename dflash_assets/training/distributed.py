"""How the ranks of one training run agree: the process group, the collectives the trainer uses, and the
gradient reduction.

Data-parallel with replicated weights: every rank holds the whole drafter and its AdamW state and
computes the gradients of its own share of each global batch; torch's DDP reducer sums them over the
ranks in buckets during the backward of the rank's last micro-batch (`ReplicatedGradients`), so the sum
overlaps the backward; the earlier micro-batches only add to the local gradients (DDP's `no_sync`). Every
rank applies the same update. The gradients are sums, never means: the trainer divides them by the whole
global batch's label weight, so any world size and any micro-batch split make the same steps.

DDP's reducer needs every rank to run exactly one reducing backward a step, and the trainer keeps it so
whatever happens on one rank: ranks run different numbers of micro-batches (only the last reduces); a
rank without a sample in a ragged last batch runs a zero-loss forward and backward so its hooks fire; a
rank that runs out of memory before its reducing micro-batch redoes its own micro-batches smaller, alone
(no collective has begun); one that runs out of memory inside it finishes its part of the reduction with
zeros (`finish_failed_reduction`, what DDP's own join does for a rank without a backward), says so in the
step's figures, and every rank redoes the step on a fresh reducer (`rebuild`). None of it leaves another
rank inside a collective.

`SingleProcess` is the same interface for one process: the trainer never asks how many ranks there are.

Every collective has a timeout (`collective_timeout_s`): a dead peer ends the job instead of hanging it.
Work between collectives that can take minutes on one rank and seconds on another (a checkpoint's
download on resume, an evaluation with the target, the first compilation) ends in a meeting on a
separate gloo group with its own, longer timeout (`long_work_s`: `long_barrier`, and the `long=True`
object collectives), so the collective timeout never has to cover it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator
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
BUCKET_CAP_MB = 25  # DDP's default: a bucket's all-reduce starts as soon as its gradients are ready


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

    def gradient_reduction(self, model: torch.nn.Module, settle: Callable[[Any], None]) -> LocalGradients:
        return LocalGradients(model)

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

    def gradient_reduction(
        self, model: torch.nn.Module, settle: Callable[[Any], None]
    ) -> ReplicatedGradients:
        """DDP's reducer over `model`, built by every rank together: `settle(reduction)` runs one
        reducing micro-batch and one more forward (see `ReplicatedGradients`)."""
        return ReplicatedGradients(model, self.device, settle)

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


class LocalGradients:
    """One process alone: every backward adds to the gradients in place, and there is nothing to reduce."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.module = model  # what the training forwards run through

    def accumulating(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def reducing(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_failed_reduction(self, begun: bool) -> None:
        pass

    def rebuild(self) -> None:
        pass


class ReplicatedGradients:
    """DDP's reducer over the drafter. Forwards run through `module` (the DDP wrapper: its hooks see the
    backward); a micro-batch under `accumulating` adds to the local gradients (DDP's `no_sync`), the one
    under `reducing` (a rank's last of the step) has them summed over the ranks in DDP's buckets while its
    backward runs, with a communication hook that sums (DDP's default divides by the world size; the
    trainer divides by the global label weight instead).

    DDP's first reducing backward records the order gradients come in and its next forward regroups the
    buckets by it, with a broadcast from rank 0: a collective inside a forward, which would pair wrongly
    with a rank that redoes its micro-batches. So every rank runs `settle` (a reducing micro-batch and
    one more forward) right after building the reducer, together, and the buckets never change after."""

    def __init__(self, model: torch.nn.Module, device: torch.device, settle: Callable[[Any], None]) -> None:
        self.model, self.device, self._settle = model, device, settle
        self.launched = 0  # buckets whose all-reduce this rank began in the current reducing backward
        self.module: Any = None
        self.rebuild()

    def rebuild(self) -> None:
        """A fresh reducer, settled (every rank together, after a failed reduction)."""
        from torch.nn.parallel import DistributedDataParallel

        self.module = None  # the old reducer's buckets go before the new one allocates its own
        self.module = DistributedDataParallel(
            self.model,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            # The frozen embedding and LM head are buffers, the same on every rank and 2.5 GB each at a
            # 248 K vocabulary: never broadcast. The weights are the same by construction and compared
            # before the first step (`check_ranks_agree`): no collective at construction either.
            forward_sync_buffers=False,
            init_sync=False,
            bucket_cap_mb=BUCKET_CAP_MB,
            gradient_as_bucket_view=True,  # the gradients are the buckets: no second copy of them
        )
        self.module.register_comm_hook(self, _summed)
        self._settle(self)

    def accumulating(self) -> contextlib.AbstractContextManager:
        return self.module.no_sync()

    @contextlib.contextmanager
    def reducing(self) -> Iterator[None]:
        self.launched = 0
        yield

    def finish_failed_reduction(self, begun: bool) -> None:
        """After this rank's step failed (out of memory) in its reducing micro-batch (`begun`) or before
        it: all-reduce zeros for every bucket it had not begun, in the reducer's order, as DDP's join does
        for a rank without a backward, so the other ranks' backward completes. The gradients are then not
        the step's on any rank: the step is redone or stopped everywhere, on a fresh reducer."""
        reducer = self.module.reducer
        launched = self.launched if begun else 0
        for bucket in reducer._get_zeros_like_grad_buckets()[launched:]:
            reducer._run_comm_hook(bucket).wait()


def _summed(state, bucket):  # unannotated: DDP accepts no annotation but its own classes here
    """DDP's communication hook: the bucket's sum over the ranks (not DDP's default mean)."""
    import torch.distributed as dist

    state.launched += 1
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, async_op=True)
    return work.get_future().then(lambda done: done.value()[0])


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a job that torch.distributed's launcher started."""
    return RANK_ENV in os.environ and WORLD_SIZE_ENV in os.environ
