"""The code location's executor: Dagster's own, wrapped so the run worker records who it is.

A step cannot tell which process is its run worker (with the multiprocess executor each step runs
in a child process that exits when the step ends), so the record is made where the run is
orchestrated: `Executor.execute` runs in the run worker, before any step. It then reaps runs on
this host whose worker died, so rerunning a killed range from the shell needs no daemon.

`DFLASH_EXECUTOR` (read when the code location loads) chooses the engine: `local` (default; steps
as processes of the run worker, or in it with `execution: {config: {in_process: {}}}`) or `k8s`
(`dagster_k8s.k8s_job_executor`: one Kubernetes Job per step, with the `dagster-k8s/config` op tags
of `k8s.py`; needs the `k8s` extra) or `celery` (`celery_executor.py`: steps queued on a broker for
`dflash-assets worker` nodes, on the `dagster-celery/queue` of `k8s.py`; needs the `celery` extra).

The local engine's step processes start from a forkserver that has imported the code location and
what steps import (`step_imports.py`), instead of each importing torch and transformers again (spawn,
Dagster's default): a run's steps then start in a fraction of a second. A run chooses otherwise with
`execution: {config: {multiprocess: {start_method: {spawn: {}}}}}`.

While the run worker executes a run, step processes it starts die with it (`orphans.py`); a step
process arms that watchdog when it imports this module to rebuild its job (the forkserver does, and
the steps forked from it re-arm against it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

from dagster import DagsterEvent, ExecutorDefinition, InitExecutorContext, multi_or_in_process_executor
from dagster._core.execution.context.system import PlanOrchestrationContext
from dagster._core.execution.plan.plan import ExecutionPlan
from dagster._core.execution.retries import RetryMode
from dagster._core.execution.step_dependency_config import StepDependencyConfig
from dagster._core.executor.base import Executor

from dflash_assets import settings
from dflash_assets.orchestration.execution.orphans import (
    arm_if_started_by_a_run_worker,
    run_worker_environment,
)
from dflash_assets.orchestration.execution.recovery import reap_dead_runs, record_run_worker

arm_if_started_by_a_run_worker()

# The run-shaping settings of the process that launched the run (`settings.RUN_SETTINGS`), for steps that
# run on other nodes (`celery_worker.py` applies them before the step).
RUN_SETTINGS_TAG = "dflash/run_settings"

# What the forkserver of the local engine imports before forking step processes.
STEP_PRELOAD = ("dflash_assets.definitions", "dflash_assets.orchestration.execution.step_imports")


def with_forkserver_steps(executor_config: Mapping[str, object]) -> Mapping[str, object]:
    """The local engine's config with step processes started from a preloaded forkserver, unless the
    run chose a start method (or runs its steps in process)."""
    multiprocess = executor_config.get("multiprocess")
    if not isinstance(multiprocess, Mapping) or multiprocess.get("start_method"):
        return executor_config
    start = {"forkserver": {"preload_modules": list(STEP_PRELOAD)}}
    return {**executor_config, "multiprocess": {**multiprocess, "start_method": start}}


class RunWorkerRecordingExecutor(Executor):
    """Delegates every step to `inner`; first tags the run with its worker and reaps dead runs."""

    def __init__(self, inner: Executor):
        self._inner = inner

    @property
    def retries(self) -> RetryMode:
        return self._inner.retries

    @property
    def step_dependency_config(self) -> StepDependencyConfig:
        return self._inner.step_dependency_config

    def execute(
        self, plan_context: PlanOrchestrationContext, execution_plan: ExecutionPlan
    ) -> Iterator[DagsterEvent]:
        instance, run = plan_context.instance, plan_context.dagster_run
        worker = record_run_worker(instance, run.run_id)
        given = settings.given_run_settings()
        if given and RUN_SETTINGS_TAG not in run.tags:  # a re-execution keeps the first launch's
            instance.add_run_tags(run.run_id, {RUN_SETTINGS_TAG: json.dumps(given, sort_keys=True)})
        plan_context.log.debug(f"run worker {worker.tag}")
        reap_dead_runs(instance, plan_context.log.warning, rerun=run)
        with run_worker_environment():
            yield from self._inner.execute(plan_context, execution_plan)

    def __getattr__(self, name: str):
        # What an engine asks of its own executor (the Celery loop: `app_args`) is the inner one's.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)


def recording(inner: ExecutorDefinition, *, forkserver_steps: bool = False) -> ExecutorDefinition:
    """`inner` with the same name, config schema and requirements, recording its run worker (and with
    `forkserver_steps`, its step processes started by `with_forkserver_steps`)."""
    creation_fn = inner.executor_creation_fn
    assert creation_fn is not None, f"executor {inner.name} has no creation function"

    def create(init_context: InitExecutorContext) -> Executor:
        if forkserver_steps:
            init_context = init_context._replace(
                executor_config=with_forkserver_steps(init_context.executor_config)
            )
        return RunWorkerRecordingExecutor(creation_fn(init_context))

    return ExecutorDefinition(
        name=inner.name,
        config_schema=inner.config_schema,
        requirements=inner.get_requirements,
        executor_creation_fn=create,
        description=inner.description,
    )


def code_location_executor() -> ExecutorDefinition:
    kind = settings.EXECUTOR.get()
    if kind == "k8s":
        from dagster_k8s import k8s_job_executor

        return recording(k8s_job_executor)
    if kind == "celery":
        from dflash_assets.orchestration.execution.celery_executor import celery_step_executor

        return recording(celery_step_executor())
    if kind != "local":
        raise ValueError(f"{settings.EXECUTOR.name}={kind!r}: expected `local`, `k8s` or `celery`")
    return recording(multi_or_in_process_executor, forkserver_steps=True)
