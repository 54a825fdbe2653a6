"""One rank of a data-parallel training run, as torch.distributed's launcher starts it:
`python -m dflash_assets.training.rank JOB.json NODE.json` (positional: torchrun would take an option
after the module for one of its own).

The job file is the same on every node (`job.TrainingJob`); the node file says what this node offers
(`NodeSpec`: its name, the devices its ranks may lease and the lock directory of those leases, its target
directory, its local directories). The launcher sets torch.distributed's standard environment (`RANK`,
`LOCAL_RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`). The rank:

1. dies with its launcher (a launcher killed by SIGKILL leaves no rank behind);
2. leases its device, and online its target devices, through the same lock files as every other run on
   the node, within the collective timeout (a busy node fails the rank naming who holds the devices);
3. joins the process group, trains its share (`job.run_job`) and, on rank 0, sends its reports to the
   step that launched the run through a `torch.distributed.TCPStore` the step serves (`StoreEvents`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_assets import terminal
from dflash_assets.target.ranks import StepLink, die_with_parent
from dflash_assets.training.distributed import ProcessGroup, Timeouts
from dflash_assets.training.failures import restartable
from dflash_assets.training.job import NodeResources, TrainingJob, run_job

EVENTS_QUEUE = "dflash/events"


@dataclass
class NodeSpec:
    """What one node offers the ranks it runs (written by whoever launches them there)."""

    node: str
    devices: list[str]  # lease candidates, e.g. ["cuda:0", "cuda:1"] or ["cpu:0", "cpu:1"]
    lock_dir: str  # the node's device-lease lock files
    target_model_dir: str
    target_model_name: str
    work_dir: str  # rank 0's checkpoints, curves and export on their way; the node's checkpoint copies
    train_cache_dir: str  # offline: streamed hidden states (each local rank in a folder of its own)
    read_cache_dir: str  # tokenized shards read from the store
    collective_timeout_s: float  # any collective (DFLASH_TRAIN_COLLECTIVE_TIMEOUT_S)
    eval_timeout_s: float  # the other ranks waiting on rank 0's evaluation (DFLASH_TRAIN_EVAL_TIMEOUT_S)
    events: str = ""  # host:port of the step's event store (rank 0 reports there)
    holder: str = ""  # who leases, for the lock files (e.g. "run <id>")

    def resources(
        self,
        device: str,
        target_devices: list[str],
        holder: str,
        rank: int | None = None,
        local_rank: int = 0,
    ) -> NodeResources:
        """The node as one process trains on it with its leased devices: a launched rank (`rank`), with
        caches of its own beside the other local ranks', or the step's own process alone (`rank` None).
        Only rank 0 writes to the work directory; the checkpoint copies in it are the node's, one for all
        its ranks. A spare device for an evaluation is leased, when one is free, from those nobody here
        holds."""
        from dflash_assets.target.devices import try_lease_device

        ranked = (lambda path: Path(path) / f"rank-{local_rank}") if rank is not None else Path
        return NodeResources(
            node=self.node,
            device=device,
            target_model_dir=Path(self.target_model_dir),
            target_model_name=self.target_model_name,
            work_dir=Path(self.work_dir),
            checkpoint_dir=Path(self.work_dir) / "checkpoints",
            train_cache_dir=ranked(self.train_cache_dir),
            read_cache_dir=ranked(self.read_cache_dir),
            target_devices=target_devices,
            spare_device=lambda: try_lease_device(
                [d for d in self.devices if d not in {device, *target_devices}],
                lock_dir=self.lock_dir,
                holder=holder,
            ),
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> NodeSpec:
        return cls(**json.loads(text))


# ----------------------------------------------------------------------------------------- events


@dataclass
class StoreEvents:
    """Rank 0's reports, queued in the step's TCPStore as JSON (the step replays them in Dagster), over the
    same link a split target's ranks report on. A step that is gone is no reason to stop training: a
    failed report is dropped with one warning."""

    endpoint: str
    timeout_s: float = 30.0
    _link: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self._link = StepLink(self.endpoint, self.timeout_s, events_queue=EVENTS_QUEUE)

    def _send(self, kind: str, body: Any) -> None:
        self._link.event(kind, body)

    def log(self, message: str) -> None:
        self._send("log", message)

    def progress(self, snapshot: terminal.ProgressSnapshot) -> None:
        self._send("progress", asdict(snapshot))

    def checkpoint(self, report: dict[str, Any]) -> None:
        self._send("checkpoint", report)

    def outcome(self, outcome: dict[str, Any]) -> None:
        self._send("outcome", outcome)

    def fatal(self, message: str) -> None:
        self._send("fatal", message)


class RankEvents(StoreEvents):
    """Ranks other than 0: their warnings go to their own stderr (the launcher's log); only an error no
    restart can mend reaches the step."""

    def log(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def progress(self, snapshot: terminal.ProgressSnapshot) -> None:
        pass

    def checkpoint(self, report: dict[str, Any]) -> None:
        pass

    def outcome(self, outcome: dict[str, Any]) -> None:
        pass


# ----------------------------------------------------------------------------------------- the rank


def _lease_timeout_message(error: Exception, rank: int, node: str) -> str:
    return (
        f"rank {rank} on node {node} found no free device in time: {error}. Other runs hold the node's "
        "devices: wait for them, lower DFLASH_TRAIN_NPROC_PER_NODE, or add devices (DFLASH_DEVICES)"
    )


def run_rank(job: TrainingJob, spec: NodeSpec) -> int:
    from dflash_assets.target.devices import DeviceLeaseTimeout, lease_device, torch_device
    from dflash_assets.training.distributed import launched_by_torchrun

    if not launched_by_torchrun():
        raise SystemExit("dflash_assets.training.rank runs as a rank of torch.distributed.run (RANK unset)")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    # A rank tries the device of its local rank first, so a node's ranks usually get one device each in
    # order; the lock files decide (another run may hold any of them).
    candidates = spec.devices[local_rank:] + spec.devices[:local_rank]
    holder = f"{spec.holder} rank {rank}".strip()
    timeout = spec.collective_timeout_s
    events: Any = (StoreEvents if rank == 0 else RankEvents)(spec.events)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart and rank == 0:
        events.log(
            f"WARNING: a rank died; the launcher started every rank again (restart {restart} of "
            f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}), from the last committed checkpoint"
        )
    with contextlib.ExitStack() as stack:
        try:
            # A wait is said (whom for) in the step's log, not only when it times out.
            lease = lambda: stack.enter_context(  # noqa: E731
                lease_device(
                    candidates, lock_dir=spec.lock_dir, timeout_s=timeout, holder=holder, log=events.log
                )
            )
            device = lease()
            target_devices = [
                lease() for _ in range(job.online_target_devices if job.mode == "online" else 0)
            ]
        except DeviceLeaseTimeout as error:
            message = _lease_timeout_message(error, rank, spec.node)
            events.fatal(message)
            raise SystemExit(message) from None
        torch_target = torch_device(device)
        if torch_target.type == "cuda":
            import torch

            torch.cuda.set_device(torch_target)
        collective = ProcessGroup(torch_target, Timeouts(spec.collective_timeout_s, spec.eval_timeout_s))
        stack.callback(collective.close)
        node = spec.resources(device, target_devices, holder, rank=rank, local_rank=local_rank)
        try:
            outcome = run_job(job, node, collective=collective, events=events)
        except Exception as error:
            # An error a restart cannot mend (settings, data that does not match the drafter, a bug, a
            # non-finite run) stops every rank at once; one from outside (the store, the network, a dead
            # peer) lets the launcher restart the ranks from the last committed checkpoint.
            if not restartable(error):
                events.fatal(
                    f"rank {rank} on node {spec.node}: {type(error).__name__}: {error} (deterministic: a "
                    "restart would meet it again)"
                )
                raise
            if rank == 0:
                events.log(f"ERROR: rank 0 failed: {type(error).__name__}: {error}")
                traceback.print_exc()
            raise
        if rank == 0:
            events.outcome(outcome)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_assets.training.rank", description=__doc__)
    parser.add_argument("job", help="the run's TrainingJob JSON")
    parser.add_argument("node", help="this node's NodeSpec JSON")
    args = parser.parse_args(argv)
    die_with_parent()
    job = TrainingJob.from_json(Path(args.job).read_text())
    spec = NodeSpec.from_json(Path(args.node).read_text())
    return run_rank(job, spec)


if __name__ == "__main__":
    sys.exit(main())
