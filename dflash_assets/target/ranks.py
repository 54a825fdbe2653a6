"""A rank of a target replica split over several devices, as torch.distributed's launcher starts it for
a step (`orchestration/execution/target_launch.py`): the job file every rank reads, the link to the step
that launched it, and the life of a rank.

A rank:

1. dies with its launcher (a launcher killed by SIGKILL leaves no rank behind);
2. leases one device through the same lock files as every other run on the host, within the timeout (a
   busy host fails the rank naming who holds the devices);
3. joins the process group and loads its shard of the target straight onto its device;
4. rank 0 runs the stage (`lead`) and reports to the step through a `torch.distributed.TCPStore` the step
   serves (log lines, warnings, progress, the outcome); the other ranks follow it (`TargetGroup.follow`),
   and a follower that fails says why there too before it ends (out of memory, say: every rank stops, see
   `tensor_parallel.fail_fast_on_out_of_memory`).

The stage's own entries are `extraction/rank.py` (a range's capture) and `generation/rank.py` (a
generation server for the step's regeneration).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

EVENTS_QUEUE = "dflash/target/events"
REQUESTS_QUEUE = "dflash/target/requests"
REPLIES_QUEUE = "dflash/target/replies"
# Errors a relaunch cannot mend (settings, data): the step says them as they are.
FATAL = (ValueError, FileNotFoundError, NotImplementedError)


@dataclass
class TargetRankJob:
    """What every rank of one split target needs (JSON, no credentials: boto3 reads its own)."""

    stage: str  # "capture" or "regeneration": what rank 0 runs
    model_dir: str
    tp: int  # devices (ranks) the target spans
    devices: list[str]  # lease candidates, e.g. ["cuda:0", "cuda:1"] or ["cpu:0", "cpu:1"]
    lock_dir: str
    holder: str  # who leases, for the lock files (e.g. "run <id>")
    timeout_s: float  # the device lease, any collective, a follower waiting for its leader
    step: str = ""  # host:port of the step's TCPStore
    work: dict[str, Any] = field(default_factory=dict)  # the stage's own fields

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> TargetRankJob:
        return cls(**json.loads(text))


class StepLink:
    """The rank side of the step's store: rank 0's reports, and a server's requests and replies. A step
    that is gone is no reason for a report to fail the work: a failed report is dropped with one warning."""

    def __init__(self, endpoint: str, timeout_s: float, events_queue: str = EVENTS_QUEUE) -> None:
        import torch.distributed as dist

        host, port = endpoint.rsplit(":", 1)
        self._store = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self._events_queue = events_queue  # training's ranks report to a queue of their own
        self._failed = False
        self._lock = threading.Lock()

    def event(self, kind: str, body: Any) -> None:
        try:
            with self._lock:
                self._store.queue_push(
                    self._events_queue, json.dumps({"kind": kind, "body": body}, default=str)
                )
        except Exception as error:  # noqa: BLE001 (any transport error)
            if not self._failed:
                self._failed = True
                print(f"WARNING: the step stopped hearing rank 0's reports ({error})", file=sys.stderr)

    def log(self, message: str) -> None:
        self.event("log", message)

    def warn(self, message: str) -> None:
        self.event("warn", message)

    def next_request(self, wait_s: float) -> dict[str, Any] | None:
        """The step's next request, or None when none came within `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                if self._store.queue_len(REQUESTS_QUEUE) > 0:
                    return json.loads(self._store.queue_pop(REQUESTS_QUEUE, block=False))
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.005)

    def reply(self, body: dict[str, Any]) -> None:
        with self._lock:
            self._store.queue_push(REPLIES_QUEUE, json.dumps(body))


def die_with_parent() -> None:
    """SIGKILL this process as soon as its parent dies (Linux: the kernel's parent-death signal; else a
    thread that watches the parent)."""
    parent = os.getppid()
    armed = False
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            armed = ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != parent or parent == 1:  # died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    if not armed:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="dflash-parent-watch", daemon=True).start()


Lead = Callable[[Any, Any, list[str], StepLink], dict[str, Any]]
Handlers = Callable[[Any], Mapping[str, Callable[..., Any]]]


def rank_main(
    argv: list[str] | None, *, prog: str, description: str | None, what: str,
    lead: Callable[[TargetRankJob], Lead], handlers: Callable[[TargetRankJob], Handlers], lm_head: bool,
) -> int:  # fmt: skip
    """A rank module's command line: `python -m <prog> JOB`, JOB the `what`'s TargetRankJob JSON."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    parser.add_argument("job", help=f"the {what}'s TargetRankJob JSON")
    args = parser.parse_args(argv)
    die_with_parent()
    job = TargetRankJob.from_json(Path(args.job).read_text())
    return run_target_rank(job, lead(job), handlers(job), lm_head=lm_head)


def run_target_rank(job: TargetRankJob, lead: Lead, handlers: Handlers, *, lm_head: bool = True) -> int:
    """One rank's life (see the module docstring). `lead(group, model, devices, link)` is rank 0's work and
    returns its outcome (JSON); `handlers(model)` are the commands a follower runs when the leader sends
    them. `lm_head=False` loads the shards without the LM head (capture never reads logits)."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if all(name.split(":")[0] == "cpu" for name in job.devices):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a split over `cpu:N` leases runs on the CPU alone
    from dflash_assets.target.devices import DeviceLeaseTimeout, lease_device, torch_device
    from dflash_assets.target.tensor_parallel import TargetGroup, load_target_shard

    link = StepLink(job.step, job.timeout_s)
    say = link.log if rank == 0 else (lambda message: print(message, file=sys.stderr, flush=True))
    # A rank tries the device of its local rank first, so the ranks usually get one device each in order;
    # the lock files decide (another run may hold any of them).
    candidates = job.devices[local_rank:] + job.devices[:local_rank]
    with contextlib.ExitStack() as stack:
        try:
            device = stack.enter_context(
                lease_device(
                    candidates,
                    lock_dir=job.lock_dir,
                    timeout_s=job.timeout_s,
                    holder=f"{job.holder} target rank {rank}".strip(),
                    log=say,
                )
            )
        except DeviceLeaseTimeout as error:
            message = (
                f"target rank {rank} found no free device in time: {error}. Other runs hold the devices: "
                "wait for them, lower DFLASH_TARGET_TP, or add devices (DFLASH_DEVICES)"
            )
            link.event("fatal", message)
            raise SystemExit(message) from None
        target = torch_device(device)
        if target.type == "cuda":
            import torch

            torch.cuda.set_device(target)
        group = TargetGroup(target, job.timeout_s)
        stack.callback(group.close)
        devices = group.all_gather_object(device)
        if rank == 0:
            link.log(f"target split over {job.tp} devices ({', '.join(devices)}); loading the shards")
        model = load_target_shard(job.model_dir, target, job.tp, lm_head=lm_head)
        if rank != 0:
            try:
                group.follow(handlers(model))
            except Exception as error:
                # Rank 0 may be waiting in a collective this rank never reaches: the launcher stops it
                # when this process ends, and the step hears why from here.
                link.event("error", f"target rank {rank} ({device}): {type(error).__name__}: {error}")
                raise
            return 0
        group.start_heartbeat()
        try:
            outcome = lead(group, model, devices, link)
        except FATAL as error:
            link.event("fatal", f"{type(error).__name__}: {error}")
            raise
        except Exception as error:
            link.event("error", f"{type(error).__name__}: {error}")
            traceback.print_exc()
            raise
        group.stop_followers()
        link.event("outcome", outcome)
    return 0
