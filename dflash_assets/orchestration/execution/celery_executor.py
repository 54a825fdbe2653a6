"""`DFLASH_EXECUTOR=celery`: the run worker queues each step on a broker, worker nodes run them.

dagster_celery's executor and execution loop, with the project's step submission: each step goes to
its `dagster-celery/queue` (`k8s.py`: `gpu` or `default`) as the `celery_worker.py` task, and the
run worker asks the worker that started it, through Celery's remote control, whether it still runs
it. A worker that stops saying so for `DFLASH_CELERY_NODE_LOST_AFTER_S` (its whole process group
killed, the machine gone, or restarted under the same name without the step), or whose step
process died, has lost the step: the run worker revokes it (so a node that was only unreachable
stops it) and submits it again, at most `DFLASH_CELERY_STEP_RESUBMITS` times per step. Another node
(or the same one restarted) picks it up and resumes from the store: every object the lost node had
uploaded is kept, what it held only in its own staging is extracted again. The run itself neither
fails nor waits forever: one lost node, one new submission, and a run with no worker up simply
waits in the queue until one starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dagster import (
    DagsterRun,
    ExecutorDefinition,
    InitExecutorContext,
    executor,
    multiple_process_executor_requirements,
)
from dagster._core.events import EngineEventData
from dagster._core.execution.retries import RetryMode, get_retries_config
from dagster._grpc.types import ExecuteStepArgs
from dagster._serdes import pack_value
from dagster_celery.core_execution_loop import core_celery_execution_loop
from dagster_celery.executor import CeleryExecutor

from dflash_assets import settings
from dflash_assets.orchestration.execution.celery_app import TASK_NAME, broker_url, result_backend
from dflash_assets.orchestration.execution.k8s import CPU_QUEUE

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult
    from dagster._core.execution.context.system import PlanOrchestrationContext
    from dagster._core.execution.plan.plan import ExecutionPlan

PING_TIMEOUT_S = 2.0


class StepLost(Exception):
    """A step lost its node more often than `DFLASH_CELERY_STEP_RESUBMITS` allows."""


class NodeWatch:
    """One step's Celery task as dagster_celery's loop polls it (`ready`, `get`, `revoke`), submitted
    again when the node running it is lost."""

    def __init__(
        self,
        app: Celery,
        log: Callable[[str], None],
        step_key: str,
        queue: str,
        send: Callable[[], AsyncResult],
        lost_after_s: float,
        resubmits: int,
    ):
        self._app, self._log, self._step_key, self._queue, self._send = app, log, step_key, queue, send
        self._lost_after_s = lost_after_s
        self._check_every_s = max(1.0, min(5.0, lost_after_s / 4))
        self._resubmits_left = resubmits
        self._gave_up: str | None = None
        self._submit()

    def _submit(self) -> None:
        self._result = self._send()
        self._worker: str | None = None  # the Celery worker that started it, once one has
        self._answered_at = time.monotonic()
        self._next_check = 0.0

    @property
    def task_id(self) -> str:
        return self._result.id

    def ready(self) -> bool:
        if self._gave_up:
            return True
        if self._result.ready():
            if not self._process_lost():
                return True
            return self._gave_up is not None
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self._check_every_s
            self._check_node(now)
        return self._gave_up is not None

    def get(self) -> Any:
        if self._gave_up:
            raise StepLost(self._gave_up)
        return self._result.get()

    def revoke(self) -> None:
        self._result.revoke(terminate=True)

    def _process_lost(self) -> bool:
        """The step's process died under a living worker (killed, out of memory): lost like a node."""
        if self._result.state != "FAILURE" or type(self._result.result).__name__ != "WorkerLostError":
            return False
        self._lost(f"its step process on {self._worker or 'the node'} died ({self._result.result})")
        return True

    def _check_node(self, now: float) -> None:
        state = self._result.state
        if state != "STARTED":  # still queued: it waits for any node, however long
            self._answered_at = now
            return
        info = self._result.info
        worker = info.get("hostname") if isinstance(info, dict) else None
        if not worker:
            return
        if worker != self._worker:
            self._worker, self._answered_at = worker, now
        if self._runs_it(worker):
            self._answered_at = time.monotonic()
        elif now - self._answered_at >= self._lost_after_s:
            self._lost(f"node {worker} has not reported it running for {now - self._answered_at:.0f}s")

    def _runs_it(self, worker: str) -> bool:
        """Whether `worker` answers and lists this step among its active tasks (a worker restarted
        under the same name answers too, without the step)."""
        replies = self._app.control.inspect(destination=[worker], timeout=PING_TIMEOUT_S).active() or {}
        return any(task.get("id") == self._result.id for task in replies.get(worker) or [])

    def _lost(self, why: str) -> None:
        lost = self._result
        lost.revoke(terminate=True, signal="SIGKILL")  # should it be alive after all, it stops
        if self._resubmits_left <= 0:
            self._gave_up = (
                f"step {self._step_key} lost: {why}; it was submitted again as often as "
                f"{settings.CELERY_STEP_RESUBMITS.name} allows, so the run fails"
            )
            self._log(self._gave_up)
            return
        self._resubmits_left -= 1
        self._submit()
        self._log(
            f"step {self._step_key} lost: {why}. Submitted again to queue {self._queue!r} as task "
            f"{self.task_id} (was {lost.id}); objects already in the store are kept"
        )


def _lost_after_s() -> float:
    value = settings.CELERY_NODE_LOST_AFTER_S.get_float()
    if value <= 0:
        raise ValueError(f"{settings.CELERY_NODE_LOST_AFTER_S.name} must be positive, got {value}")
    return value


def _resubmits() -> int:
    value = settings.CELERY_STEP_RESUBMITS.get_int()
    if value < 0:
        raise ValueError(f"{settings.CELERY_STEP_RESUBMITS.name} must be 0 or more, got {value}")
    return value


def _submit_step(
    app: Celery, plan_context: PlanOrchestrationContext, step, queue: str, priority: int, known_state
):
    """dagster_celery's `step_execution_fn`: the step to its queue, watched."""
    args = ExecuteStepArgs(
        job_origin=plan_context.reconstructable_job.get_python_origin(),
        run_id=plan_context.dagster_run.run_id,
        step_keys_to_execute=[step.key],
        instance_ref=plan_context.instance.get_ref(),
        retry_mode=plan_context.executor.retries.for_inner_plan(),
        known_state=known_state,
        print_serialized_events=True,
    )
    kwargs = {
        "execute_step_args_packed": pack_value(args),
        "executable_dict": plan_context.reconstructable_job.to_dict(),
    }
    run: DagsterRun = plan_context.dagster_run
    instance = plan_context.instance

    def log(message: str) -> None:
        instance.report_engine_event(message, run, EngineEventData(), step_key=step.key)

    def send() -> AsyncResult:
        return app.send_task(TASK_NAME, kwargs=kwargs, queue=queue, routing_key=queue, priority=priority)

    return NodeWatch(app, log, step.key, queue, send, _lost_after_s(), _resubmits())


class CeleryStepExecutor(CeleryExecutor):
    """dagster_celery's executor with the broker from the environment and the project's submission."""

    def __init__(self, retries: RetryMode):
        broker = broker_url()
        super().__init__(
            retries=retries,
            broker=broker,
            backend=result_backend(broker),
            config_source={"task_default_queue": CPU_QUEUE},
        )

    def execute(self, plan_context: PlanOrchestrationContext, execution_plan: ExecutionPlan):
        _lost_after_s(), _resubmits()  # bad settings fail the run before any step is queued
        return core_celery_execution_loop(plan_context, execution_plan, step_execution_fn=_submit_step)


def celery_step_executor() -> ExecutorDefinition:
    """The `celery` executor; the broker URL is checked when the code location loads, read when a run
    starts, and never part of the run's config."""
    broker_url()

    @executor(
        name="celery",
        config_schema={"retries": get_retries_config()},
        requirements=multiple_process_executor_requirements(),
    )
    def celery(init_context: InitExecutorContext) -> CeleryStepExecutor:
        """Steps queued on DFLASH_CELERY_BROKER_URL for `dflash-assets worker` nodes."""
        return CeleryStepExecutor(RetryMode.from_config(init_context.executor_config["retries"]))

    return celery
