"""The training step's side of a run: one rank in the step's own process, or ranks launched with
torch.distributed's launcher (`training/launcher.py`) and followed until they end.

With several ranks the step serves a `torch.distributed.TCPStore` that rank 0 queues its reports in
(log lines, progress, committed checkpoints, the outcome: `training/rank.py`), wherever rank 0 runs, and
replays them into Dagster as they come. It checks that this node has the devices its ranks need before
launching them (waiting, with a status, while other runs hold them), and it watches the launcher: the
step ends when the launcher does, with the outcome or with a message naming what failed. A step that is
stopped stops its launcher, whose ranks die with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dflash_assets import settings
from dflash_assets.orchestration.execution.launched import (
    LauncherOutput,
    stop_launcher,
    wait_for_free_devices,
)
from dflash_assets.orchestration.resources import DeviceLeaseResource, StoreResource, TargetModelResource
from dflash_assets.storage.layout import LAUNCH_PREFIX

if TYPE_CHECKING:  # the code location loads this module; torch comes only with a run
    from dflash_assets.training.job import TrainingJob
    from dflash_assets.training.rank import NodeSpec

POLL_S = 0.2


class TrainingFailed(RuntimeError):
    """The ranks ended without an outcome: the message says which and how."""


@dataclass(frozen=True)
class Launch:
    """How many ranks, where they meet, how long they wait to meet and how often they restart (the
    collective timeouts travel with the node's `NodeSpec`). No defaults here: the step takes them from
    the settings (`TrainConfig.launch`), the bench states its own."""

    nproc_per_node: int
    nnodes: int
    rdzv_host: str  # empty: this host's name
    rdzv_port: int  # 0: a free port, chosen at launch
    rdzv_timeout_s: float
    max_restarts: int

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @property
    def in_process(self) -> bool:
        return self.world_size == 1


class Reports(Protocol):
    """What the step does with rank 0's reports (the Dagster layer implements it)."""

    def log(self, message: str) -> None: ...

    def progress(self, snapshot: Any) -> None: ...

    def checkpoint(self, report: dict[str, Any]) -> None: ...

    def status(self, text: str) -> None: ...


# ------------------------------------------------------------------------------------------ one rank here


def train_here(job: TrainingJob, spec: NodeSpec, reports: Reports) -> dict[str, Any]:
    """One rank, in this process: the device leased like any run's, no process group."""
    from dflash_assets.target.devices import lease_device
    from dflash_assets.training.distributed import SingleProcess
    from dflash_assets.training.job import run_job

    with contextlib.ExitStack() as stack:
        lease = lambda: stack.enter_context(  # noqa: E731
            lease_device(spec.devices, lock_dir=spec.lock_dir, holder=spec.holder, log=reports.log)
        )
        device = lease()
        target_devices = [lease() for _ in range(job.online_target_devices if job.mode == "online" else 0)]
        node = spec.resources(device, target_devices, spec.holder)
        return run_job(job, node, collective=SingleProcess(), events=reports)


# ------------------------------------------------------------------------------------------ ranks launched


class EventStore:
    """The TCPStore rank 0 reports to, served by this process."""

    def __init__(self, host_for_ranks: str) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore(
            host_for_ranks,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=30),
        )
        self.endpoint = f"{host_for_ranks}:{self._store.port}"

    def drain(self) -> Iterator[dict[str, Any]]:
        from dflash_assets.training.rank import EVENTS_QUEUE

        while self._store.queue_len(EVENTS_QUEUE) > 0:
            yield json.loads(self._store.queue_pop(EVENTS_QUEUE, block=False))


def wait_for_devices(spec: NodeSpec, needed: int, reports: Reports, setting: str) -> None:
    """Return once `needed` of the node's devices are free; a node that could never offer them fails."""
    if len(spec.devices) < needed:
        raise TrainingFailed(
            f"{setting} asks for {needed} device(s) on node {spec.node}, which offers "
            f"{len(spec.devices)} ({', '.join(spec.devices)}): lower it, or list more devices in "
            "DFLASH_DEVICES (a CPU-only machine simulates them: DFLASH_DEVICES=cpu:0,cpu:1)"
        )
    wait_for_free_devices(
        spec.devices,
        spec.lock_dir,
        needed,
        where=f" on node {spec.node}",
        status=reports.status,
        log=reports.log,
    )


def failure_message(returncode: int, tail: list[str], last_error: str | None) -> str:
    """What the launcher's end says about the ranks: torchrun's root-cause lines, and rank 0's error."""
    how = f"signal {-returncode}" if returncode < 0 else f"exit code {returncode}"
    cause = [
        line.strip()
        for line in tail
        if any(word in line for word in ("rank", "exitcode", "error_file", "Signal", "RendezvousTimeout"))
    ][-6:]
    detail = f" ({last_error})" if last_error else ""
    return (
        f"the training ranks failed: the launcher ended with {how}{detail}. "
        + (" | ".join(cause) if cause else "See the step's stderr for each rank's output.")
        + " Materialise drafter_checkpoints again to resume from the last committed checkpoint."
    )


class NodeLost(Exception):
    """Another node of a multi-node launch left it (died, or its launcher failed)."""


def train_launched(
    job: TrainingJob,
    launch: Launch,
    spec: NodeSpec,
    reports: Reports,
    *,
    rendezvous_host: str,
    setting: str,
    joins: Callable[[dict[str, Any]], Any] | None = None,
) -> dict[str, Any]:
    """Launch this node's ranks (and, with `joins`, have the other nodes join), follow them, return rank
    0's outcome. `joins(published)` places the other nodes' launchers and returns a watch with `check()`
    (raising `NodeLost`), `lost_after_failure()` and `stop()` (`celery_training.py`).

    On one node, torch.distributed's agent restarts the ranks itself after one dies. Over several nodes
    the step does: when a node is lost or any launcher fails, every node is launched again (a fresh
    rendezvous, the other nodes placed again), up to `max_restarts` times; each launch resumes from the
    last committed checkpoint. A fresh launch never depends on a dead node's agent leaving the old
    rendezvous cleanly."""
    needed = launch.nproc_per_node * (1 + (job.online_target_devices if job.mode == "online" else 0))
    wait_for_devices(spec, needed, reports, setting)
    events = EventStore(rendezvous_host)
    spec = dataclasses.replace(spec, events=events.endpoint)
    attempt = 0
    while True:
        try:
            return _launch_once(job, launch, spec, reports, events, rendezvous_host, joins)
        except NodeLost as lost:
            if launch.nnodes == 1 or attempt >= launch.max_restarts:
                raise TrainingFailed(
                    f"{lost}; the run was launched again as often as {settings.TRAIN_MAX_RESTARTS.name} "
                    "allows. Materialise drafter_checkpoints again to resume from the last committed "
                    "checkpoint."
                ) from None
            attempt += 1
            reports.log(
                f"WARNING: {lost}; launching every node again ({attempt} of {launch.max_restarts}), from the "
                "last committed checkpoint"
            )


def _launch_dir(spec: NodeSpec, run_id: str) -> Path:
    """A launch's own folder, `<work_dir>/launch/<run_id>/`: the files its ranks read, deleted when the
    launcher has ended."""
    return Path(spec.work_dir) / "launch" / run_id


def _rank_entry(job: TrainingJob, spec: NodeSpec, run_id: str) -> list[str]:
    """The ranks' entry for torchrun, with the job and node files it reads written under the launch's
    own folder."""
    launch_dir = _launch_dir(spec, run_id)
    launch_dir.mkdir(parents=True, exist_ok=True)
    (launch_dir / "job.json").write_text(job.to_json())
    (launch_dir / "node.json").write_text(spec.to_json())
    return ["-m", "dflash_assets.training.rank", str(launch_dir / "job.json"), str(launch_dir / "node.json")]


def _launcher_env(nproc_per_node: int) -> dict[str, str]:
    from dflash_assets.training.launcher import network_env

    # torchrun would set 1 with a warning; a rank gets its share of the cores instead.
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    for name, value in network_env(settings.TRAIN_NETWORK_INTERFACE.get()).items():
        env.setdefault(name, value)  # a user's own GLOO_/NCCL_SOCKET_IFNAME wins
    return env


def network_address(nnodes: int) -> str:
    """The address this node's ranks are reached at, from DFLASH_TRAIN_NETWORK_INTERFACE (empty: the
    host's name); a multi-node run on a host whose name resolves to loopback is refused here, before
    anything is launched."""
    from dflash_assets.training.launcher import NetworkError, check_reachable, interface_address

    interface = settings.TRAIN_NETWORK_INTERFACE.get()
    try:
        check_reachable(nnodes, interface)
        return interface_address(interface) if interface else ""
    except NetworkError as error:
        raise settings.SettingError(str(error)) from None


def _launch_once(job, launch: Launch, spec: NodeSpec, reports: Reports, events, rendezvous_host, joins):
    from dflash_assets.training.launcher import Rendezvous, free_port, launcher_command, torchrun_arguments

    run_id = uuid.uuid4().hex[:12]
    entry = _rank_entry(job, spec, run_id)
    rendezvous = Rendezvous(
        host=rendezvous_host,
        port=launch.rdzv_port or free_port(),
        run_id=run_id,
        nnodes=launch.nnodes,
        join_timeout_s=launch.rdzv_timeout_s,
        # Over several nodes the step restarts whole launches (`train_launched`).
        max_restarts=launch.max_restarts if launch.nnodes == 1 else 0,
    )
    local_addr = network_address(launch.nnodes)
    arguments = torchrun_arguments(
        rendezvous, launch.nproc_per_node, is_host=True, entry=entry, local_addr=local_addr
    )
    env = _launcher_env(launch.nproc_per_node)
    reports.log(
        f"launching {launch.nproc_per_node} rank(s) on node {spec.node} of {launch.nnodes} node(s) "
        f"(world size {launch.world_size}; rendezvous {rendezvous.host}:{rendezvous.port}, "
        f"id {rendezvous.run_id})"
    )
    published = {
        "job": job.to_json(),
        "host": rendezvous.host,
        "port": rendezvous.port,
        "run_id": rendezvous.run_id,
        "nnodes": launch.nnodes,
        "nproc_per_node": launch.nproc_per_node,
        "join_timeout_s": launch.rdzv_timeout_s,
        "max_restarts": rendezvous.max_restarts,
        "collective_timeout_s": spec.collective_timeout_s,  # every node's ranks wait alike
        "eval_timeout_s": spec.eval_timeout_s,
        "events": events.endpoint,
    }
    # The other nodes are placed first (waiting for free ones): this node's rendezvous then only waits
    # for them to start.
    watch = joins(published) if joins is not None else None
    try:
        process = subprocess.Popen(launcher_command(arguments), env=env, stderr=subprocess.PIPE, text=True)
    except BaseException:
        if watch is not None:
            watch.stop(grace_s=0)
        raise
    tail = LauncherOutput(process.stderr, "launcher-stderr")
    heard = _Heard()
    try:
        while heard.fatal is None:
            for event in events.drain():
                heard.dispatch(event, reports)
            if watch is not None:
                watch.check()
            if process.poll() is not None:
                break
            time.sleep(POLL_S)
        if heard.fatal is not None:  # no restart would mend it: stop every rank now
            stop_launcher(process)
        tail.join()
        for event in events.drain():
            heard.dispatch(event, reports)
        # This node's ranks failed: when another node was lost, that is what to say (the ranks only saw
        # a closed connection), and it is learnt before the joins are stopped.
        lost_node = (
            watch.lost_after_failure()
            if watch is not None and heard.fatal is None and process.returncode != 0
            else None
        )
    finally:
        stop_launcher(process)
        shutil.rmtree(_launch_dir(spec, run_id), ignore_errors=True)
        if watch is not None:
            watch.stop(grace_s=30.0 if process.returncode == 0 else 0)
    if heard.fatal is not None:
        raise TrainingFailed(f"the training ranks stopped: {heard.fatal}")
    if process.returncode != 0 or heard.outcome is None:
        message = failure_message(process.returncode, list(tail.lines), heard.last_error)
        if launch.nnodes > 1:
            raise NodeLost(f"{lost_node}; {message}" if lost_node else message)
        raise TrainingFailed(message)
    return heard.outcome


class _Heard:
    """What the ranks have said so far."""

    def __init__(self) -> None:
        self.outcome: dict[str, Any] | None = None
        self.last_error: str | None = None
        self.fatal: str | None = None

    def dispatch(self, event: dict[str, Any], reports: Reports) -> None:
        from dflash_assets.terminal import ProgressSnapshot

        kind, body = event.get("kind"), event.get("body")
        if kind == "log":
            reports.log(body)
            if isinstance(body, str) and body.startswith("ERROR:"):
                self.last_error = body.removeprefix("ERROR:").strip()
        elif kind == "progress":
            reports.progress(ProgressSnapshot(**body))
        elif kind == "checkpoint":
            reports.checkpoint(body)
        elif kind == "outcome":
            self.outcome = body
        elif kind == "fatal" and self.fatal is None:
            self.fatal = body
            reports.log(f"ERROR: {body}")


# ------------------------------------------------------------------------------------------ this node


def node_spec(
    store: StoreResource,
    target_model: TargetModelResource,
    devices: DeviceLeaseResource,
    *,
    run: str,
    holder: str,
):
    """What this node offers the run's ranks: its devices and their lock files, its copy of the target,
    its local directories."""
    from dflash_assets.training.rank import NodeSpec

    return NodeSpec(
        node=settings.node_name(),
        devices=devices.candidates(),
        lock_dir=str(devices.lock_directory()),
        target_model_dir=str(target_model.model_dir()),
        target_model_name=target_model.name,
        work_dir=str(store.training_dir(run)),
        train_cache_dir=str(store.train_cache_dir(run)),
        read_cache_dir=str(store.read_cache_dir()),
        collective_timeout_s=settings.TRAIN_COLLECTIVE_TIMEOUT_S.get_float(),
        eval_timeout_s=settings.TRAIN_EVAL_TIMEOUT_S.get_float(),
        holder=holder,
    )


# ------------------------------------------------------------------------------------------ other nodes


def launch_key(run: str) -> str:
    """Where a multi-node launch is published for the nodes that join it (`dflash-assets train-join`)."""
    return f"{LAUNCH_PREFIX}/{run}.json"


class _Published:
    """Without Celery the other nodes join by hand: the launch is published in the store and each node
    runs `dflash-assets train-join --run <run>`."""

    def __init__(self, job: TrainingJob, reports: Reports, launch: dict[str, Any]) -> None:
        self.store, self.key = job.open_store(), launch_key(job.run)
        self.store.put_bytes(self.key, json.dumps(launch).encode())
        reports.log(
            f"waiting for {launch['nnodes'] - 1} more node(s) to join within "
            f"{launch['join_timeout_s']:.0f} s: "
            f"on each, with the same DFLASH_STORE_URL, run `dflash-assets train-join --run {job.run}`"
        )

    def check(self) -> None:
        pass

    def lost_after_failure(self) -> str | None:
        return None  # nodes that joined by hand report nothing of themselves

    def stop(self, grace_s: float = 0) -> None:
        with contextlib.suppress(Exception):
            self.store.delete(self.key)


def published_joins(job: TrainingJob, reports: Reports) -> Callable[[dict[str, Any]], _Published]:
    return lambda launch: _Published(job, reports, launch)


def join_launch(launch: dict[str, Any], spec: NodeSpec, log: Callable[[str], None]) -> int:
    """Run this node's ranks of a launch started on another node (the `train-join` command, a Celery join
    task); returns the launcher's exit code."""
    from dflash_assets.training.job import TrainingJob
    from dflash_assets.training.launcher import Rendezvous, launcher_command, torchrun_arguments

    job = TrainingJob.from_json(launch["job"])
    spec = dataclasses.replace(
        spec,
        events=launch["events"],
        collective_timeout_s=launch["collective_timeout_s"],
        eval_timeout_s=launch["eval_timeout_s"],
    )
    entry = _rank_entry(job, spec, launch["run_id"])
    rendezvous = Rendezvous(
        host=launch["host"],
        port=int(launch["port"]),
        run_id=launch["run_id"],
        nnodes=int(launch["nnodes"]),
        join_timeout_s=float(launch["join_timeout_s"]),
        max_restarts=int(launch["max_restarts"]),
    )
    local_addr = network_address(int(launch["nnodes"]))
    arguments = torchrun_arguments(
        rendezvous, int(launch["nproc_per_node"]), is_host=False, entry=entry, local_addr=local_addr
    )
    env = _launcher_env(int(launch["nproc_per_node"]))
    log(
        f"node {spec.node} joins run {job.run} at {rendezvous.host}:{rendezvous.port} with "
        f"{launch['nproc_per_node']} rank(s)"
    )
    process = subprocess.Popen(launcher_command(arguments), env=env)
    try:
        return process.wait()
    finally:
        stop_launcher(process)
        shutil.rmtree(_launch_dir(spec, launch["run_id"]), ignore_errors=True)


def join_published(run: str, *, wait_s: float, log: Callable[[str], None]) -> int:
    """`dflash-assets train-join`: wait for `run`'s multi-node launch to be published in this node's
    store, then run this node's ranks of it."""
    store = StoreResource()
    key = launch_key(run)
    deadline = time.monotonic() + wait_s
    log(f"waiting for training run {run!r} to publish its launch at {store.open().uri(key)}")
    while (launch := _read_launch(store.open(), key)) is None:
        if time.monotonic() > deadline:
            raise TrainingFailed(
                f"no launch of training run {run!r} was published at {store.open().uri(key)} within "
                f"{wait_s:.0f} s: materialise drafter_checkpoints with DFLASH_TRAIN_NNODES > 1 on the "
                "first node (the same DFLASH_STORE_URL and DFLASH_RUN_NAME), then run this again"
            )
        time.sleep(2.0)
    spec = node_spec(
        StoreResource(), TargetModelResource(), DeviceLeaseResource(), run=run, holder=f"{run} (joined)"
    )
    return join_launch(launch, spec, log)


def _read_launch(store, key: str) -> dict[str, Any] | None:
    if store.head(key) is None:
        return None
    return json.loads(store.get_bytes(key))
