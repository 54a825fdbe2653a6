"""Training over several Celery worker nodes (`DFLASH_EXECUTOR=celery`, `DFLASH_TRAIN_NNODES` > 1).

The training step runs on one `gpu` node and launches that node's ranks itself (`train_launch.py`).
For every other node it needs, it picks a `gpu` queue worker on another node with a free step slot and
sends a join task to that worker's own queue (Celery's direct queues, `worker_direct`): the task runs
this node's share with torch.distributed's launcher, which meets the step's launcher through c10d
rendezvous. Nothing is queued where it cannot start: a node whose slots are all taken (by this step
itself, or by extraction ranges) is not chosen, and while too few nodes are free the step waits with a
status naming who holds them, then fails before the rendezvous timeout with a message saying so.

While the ranks train, the step watches each join: a node that stops answering for
`DFLASH_CELERY_NODE_LOST_AFTER_S`, or whose launcher ended with an error, ends the launch; the step stops
its own ranks and launches every node again (`train_launch.train_launched`), placing the other nodes
anew on whichever are free (the same one, once it is back), up to `DFLASH_TRAIN_MAX_RESTARTS` times.
Every launch resumes from the last committed checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dflash_assets import settings
from dflash_assets.orchestration.execution.celery_app import broker_url, result_backend
from dflash_assets.orchestration.execution.k8s import GPU_QUEUE
from dflash_assets.orchestration.execution.train_launch import Launch, NodeLost, Reports, TrainingFailed

if TYPE_CHECKING:
    from dflash_assets.training.job import TrainingJob
    from dflash_assets.training.rank import NodeSpec

JOIN_TASK_NAME = "dflash_assets.join_training"
INSPECT_TIMEOUT_S = 2.0
PLACE_EVERY_S = 5.0
STARTUP_MARGIN_S = 60.0  # a join sent this long before the rendezvous timeout still makes it


def _node_of(hostname: str) -> str:
    return hostname.split("@", 1)[0]


class _Nodes:
    """What the `gpu` queue's workers say about themselves: who listens, how many slots, how many busy."""

    def __init__(self, app) -> None:
        self.app = app

    def free_slots(self, exclude: set[str]) -> tuple[list[str], list[str]]:
        """(Celery hostnames of `gpu` workers with a free slot, most free first; descriptions of the
        others), leaving out the nodes in `exclude`."""
        inspect = self.app.control.inspect(timeout=INSPECT_TIMEOUT_S)
        queues = inspect.active_queues() or {}
        active = inspect.active() or {}
        stats = inspect.stats() or {}
        free, busy = [], []
        for hostname, listened in sorted(queues.items()):
            if _node_of(hostname) in exclude or not any(q.get("name") == GPU_QUEUE for q in listened):
                continue
            slots = int(((stats.get(hostname) or {}).get("pool") or {}).get("max-concurrency") or 1)
            running = active.get(hostname) or []
            if len(running) < slots:
                free.append((slots - len(running), hostname))
            else:
                names = ", ".join(sorted({str(task.get("name", "?")).rsplit(".", 1)[-1] for task in running}))
                busy.append(f"{_node_of(hostname)} ({len(running)}/{slots} slots busy: {names})")
        return [hostname for _, hostname in sorted(free, key=lambda f: (-f[0], f[1]))], busy

    def runs(self, hostname: str, task_id: str) -> bool:
        replies = self.app.control.inspect(destination=[hostname], timeout=INSPECT_TIMEOUT_S).active() or {}
        return any(task.get("id") == task_id for task in replies.get(hostname) or [])


class _Join:
    def __init__(self, hostname: str, result) -> None:
        self.hostname, self.result = hostname, result
        self.answered_at = time.monotonic()


class CeleryJoins:
    """The other nodes of one launch, placed and watched (`check()` each poll, `stop()` at the end)."""

    def __init__(
        self,
        app,
        launch: dict[str, Any],
        *,
        own_node: str,
        run_id: str,
        reports: Reports,
        rendezvous_timeout_s: float,
        lost_after_s: float,
    ) -> None:
        self.app, self.launch, self.own_node, self.run_id = app, launch, own_node, run_id
        self.reports = reports
        self.nodes = _Nodes(app)
        self.needed = int(launch["nnodes"]) - 1
        self.rendezvous_timeout_s, self.lost_after_s = rendezvous_timeout_s, lost_after_s
        self.joins: list[_Join] = []
        self._waiting_since: float | None = None
        self._next_check = 0.0
        self._place(block=True)

    def _send(self, hostname: str) -> _Join:
        from celery.utils.nodenames import worker_direct

        result = self.app.send_task(
            JOIN_TASK_NAME,
            kwargs={"launch": self.launch, "run_id": self.run_id},
            queue=worker_direct(hostname),
        )
        self.reports.log(f"node {_node_of(hostname)} joins the training (task {result.id})")
        return _Join(hostname, result)

    def _place(self, *, block: bool) -> None:
        """Send joins to free nodes until `needed` are placed; with `block`, wait for nodes to free up."""
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
        reminded = 0.0
        while len(self.joins) < self.needed:
            taken = {self.own_node, *(_node_of(j.hostname) for j in self.joins)}
            free, busy = self.nodes.free_slots(taken)
            for hostname in free[: self.needed - len(self.joins)]:
                self.joins.append(self._send(hostname))
            if len(self.joins) >= self.needed:
                break
            waited = time.monotonic() - self._waiting_since
            missing = self.needed - len(self.joins)
            what = (
                f"{settings.TRAIN_NNODES.name}={self.needed + 1}: waiting for {missing} more `{GPU_QUEUE}` "
                f"worker node(s) besides {self.own_node} with a free slot"
                + (f"; busy: {'; '.join(busy)}" if busy else "; no other node listens on the queue")
            )
            if waited > max(30.0, self.rendezvous_timeout_s - STARTUP_MARGIN_S):
                raise TrainingFailed(
                    f"{what}, for {waited:.0f} s: start more `dflash-assets worker --queue gpu` nodes, let "
                    f"the busy ones finish, or lower {settings.TRAIN_NNODES.name}"
                )
            self.reports.status(what)
            if waited >= reminded:
                self.reports.log(f"{what} ({waited:.0f} s so far)")
                reminded = waited + 60.0
            if not block:
                return
            time.sleep(PLACE_EVERY_S)
        self._waiting_since = None

    def check(self) -> None:
        """Raise `NodeLost` when a join's node stopped answering or its launcher ended with an error."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + PLACE_EVERY_S
        for join in self.joins:
            lost = self._lost(join, now)
            if lost is not None:
                raise NodeLost(f"node {_node_of(join.hostname)} left the training ({lost})")

    def lost_after_failure(self) -> str | None:
        """After this node's ranks failed: which other node, if any, was lost, so the message names it
        rather than the collective that broke (a dead peer usually shows first as a closed connection).
        A node whose launcher has ended, or that still reports its launcher running, is not to blame;
        one that has stopped answering is, once it has been silent for `lost_after_s`."""
        deadline = time.monotonic() + self.lost_after_s + PLACE_EVERY_S
        while True:
            now, silent = time.monotonic(), False
            for join in self.joins:
                lost = self._lost(join, now)
                if join.result.state != "STARTED":
                    continue  # its launcher ended (or never began): not what broke the ranks
                if lost is not None:
                    return f"node {_node_of(join.hostname)} left the training ({lost})"
                silent |= join.answered_at < now
            if not silent or now >= deadline:
                return None
            time.sleep(PLACE_EVERY_S)

    def _lost(self, join: _Join, now: float) -> str | None:
        state = join.result.state
        if state == "SUCCESS":
            return None  # its ranks finished: the run is ending
        if state in ("FAILURE", "REVOKED"):
            return f"its launcher ended: {join.result.result}"
        if state != "STARTED":
            join.answered_at = now  # still queued for that node
            return None
        if self.nodes.runs(join.hostname, join.result.id):
            join.answered_at = now
            return None
        if now - join.answered_at >= self.lost_after_s:
            return f"it has not answered for {now - join.answered_at:.0f} s"
        return None

    def stop(self, *, grace_s: float = 30.0) -> None:
        """Let the joins end by themselves for `grace_s` (their ranks finished with this node's), then
        revoke what is left (their launchers, and the ranks with them, stop)."""
        deadline = time.monotonic() + grace_s
        while any(not j.result.ready() for j in self.joins) and time.monotonic() < deadline:
            time.sleep(0.5)
        for join in self.joins:
            if not join.result.ready():
                join.result.revoke(terminate=True, signal="SIGTERM")


def celery_joins(
    job: TrainingJob, launch: Launch, spec: NodeSpec, reports: Reports, *, run_id: str
) -> Callable[[dict[str, Any]], CeleryJoins]:
    """`joins` for `train_launched`: the other nodes of the launch, on the `gpu` queue's workers."""
    from celery import Celery

    broker = broker_url()
    app = Celery("dflash_assets", broker=broker, backend=result_backend(broker), set_as_current=False)
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    return lambda published: CeleryJoins(
        app,
        published,
        own_node=spec.node,
        run_id=run_id,
        reports=reports,
        rendezvous_timeout_s=launch.rdzv_timeout_s,
        lost_after_s=settings.CELERY_NODE_LOST_AFTER_S.get_float(),
    )


def join_training(task, launch: dict[str, Any], run_id: str) -> int:
    """The join task on a worker node: this node's ranks of a launch started on another node."""
    import sys

    from dflash_assets.orchestration.execution.train_launch import join_launch, node_spec
    from dflash_assets.orchestration.resources import DeviceLeaseResource, StoreResource, TargetModelResource
    from dflash_assets.training.job import TrainingJob

    job = TrainingJob.from_json(launch["job"])
    spec = node_spec(
        StoreResource(url=job.store_url),
        TargetModelResource(),
        DeviceLeaseResource(),
        run=job.run,
        holder=f"run {run_id} (joined)",
    )

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    code = join_launch(launch, spec, log)
    if code != 0:
        raise RuntimeError(f"node {spec.node}'s training launcher ended with exit code {code}")
    return code
