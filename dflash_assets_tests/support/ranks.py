"""Test support: the ranks of one data-parallel job as spawned processes on this machine (gloo, one
thread each), each running a test's function with its `distributed.ProcessGroup`.

torch.distributed's launcher is what users run (the end-to-end tests use it); this is the same process
group without the launcher, so a test of what ranks say to each other costs seconds. A rank still
running when the job's time is up is killed and the test fails naming it: distributed code fails by
hanging, and a test must say so rather than hang too.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queues
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from dflash_assets.storage.moto_server import free_port


class RankFailed(AssertionError):
    pass


def run_ranks(
    function: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 180.0,
    nodes: Sequence[str] | None = None,
) -> list[Any]:
    """`function(group, *args)` on every rank (a module-level function: it is pickled by name); each
    rank's return value, in rank order. An exception in a rank is returned as `("error", text)`.
    `nodes`: the node each rank plays (LOCAL_RANK and LOCAL_WORLD_SIZE follow; default: one node)."""
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    port = free_port()
    nodes = list(nodes) if nodes is not None else ["node"] * world_size
    processes = [
        context.Process(
            target=_rank_main,
            args=(
                function,
                rank,
                world_size,
                nodes[:rank].count(nodes[rank]),
                nodes.count(nodes[rank]),
                port,
                results,
                args,
            ),  # fmt: skip
            name=f"test-rank-{rank}",
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    answers: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(answers) < world_size:
            try:
                rank, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                answers[rank] = value
            except queues.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(answers))
                    raise RankFailed(
                        f"ranks {missing} gave no answer within {timeout_s:.0f} s "
                        f"(exit codes {[p.exitcode for p in processes]})"
                    ) from None
        for process in processes:
            process.join(timeout=max(1.0, deadline - time.monotonic()))
        left = [p.name for p in processes if p.is_alive()]
        if left:
            raise RankFailed(f"{left} still running after answering: a rank waits on a collective")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    return [answers[rank] for rank in range(world_size)]


def _rank_main(function, rank, world_size, local_rank, local_world_size, port, results, args) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    from dflash_assets.training.distributed import ProcessGroup, Timeouts

    torch.set_num_threads(1)
    group = ProcessGroup(torch.device("cpu"), Timeouts(collective_s=60, long_work_s=60))
    try:
        value = function(group, *args)
    except Exception as error:  # the test reads it; the traceback goes to the rank's stderr
        traceback.print_exc()
        value = ("error", f"{type(error).__name__}: {error}")
    results.put((rank, value))
    group.close()
