"""`DFLASH_EXECUTOR=celery` in the small: which queue each step goes to, what the code location and
the worker command accept, and the rule by which the run worker counts a step's node as lost.
The same parts run for real, two nodes on loopback, in test_celery_nodes.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dagster_celery.tags import DAGSTER_CELERY_QUEUE_TAG

from dflash_assets import settings
from dflash_assets.definitions import defs
from dflash_assets.orchestration.execution import celery_executor
from dflash_assets.orchestration.execution.celery_app import broker_url, result_backend
from dflash_assets.orchestration.execution.celery_executor import NodeWatch, StepLost
from dflash_assets.orchestration.execution.celery_worker import node_device_count, worker_argv
from dflash_assets.orchestration.execution.k8s import CELERY_QUEUE_TAG

SECRET = "do-not-print-me"


def test_gpu_steps_go_to_the_gpu_queue_and_tokenisation_to_the_default_queue():
    assert CELERY_QUEUE_TAG == DAGSTER_CELERY_QUEUE_TAG
    queues = {a.key.to_user_string(): a.op.tags.get(DAGSTER_CELERY_QUEUE_TAG) for a in defs.assets}
    assert queues == {
        "target_completions": "gpu",  # the target generates in the step's own process
        "tokenized_completions": "default",
        "hidden_state_partitions": "gpu",
        "drafter_checkpoints": "gpu",
        "drafter_evaluations": "gpu",  # the target decodes each prompt set with the drafter
    }


def _load(env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    probe = (
        "import json, sys\n"
        "from dflash_assets.definitions import defs\n"
        "job = defs.get_repository_def().get_implicit_global_asset_job_def()\n"
        "fields = sorted(job.executor_def.config_schema.as_field().config_type.fields)\n"
        "print(json.dumps([job.executor_def.name, fields, 'torch' in sys.modules]))\n"
    )
    env = {**os.environ, "DFLASH_HOME": str(tmp_path), "DFLASH_EXECUTOR": "celery", **env}
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)


def test_with_dflash_executor_celery_the_code_location_runs_steps_through_celery_with_no_broker_in_config(
    tmp_path,
):
    done = _load({"DFLASH_CELERY_BROKER_URL": f"redis://default:{SECRET}@127.0.0.1:6379/3"}, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    name, fields, torch_imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert name == "celery"
    assert fields == ["retries"]  # the broker comes from the environment, never from run config
    assert not torch_imported
    assert SECRET not in done.stdout + done.stderr


def test_without_a_broker_url_the_code_location_refuses_to_load_naming_the_setting(tmp_path):
    done = _load({"DFLASH_CELERY_BROKER_URL": ""}, tmp_path)
    assert done.returncode != 0
    assert "DFLASH_CELERY_BROKER_URL" in done.stderr


def test_a_broker_url_of_another_kind_is_refused_naming_the_setting_but_not_the_url(monkeypatch):
    monkeypatch.setenv("DFLASH_CELERY_BROKER_URL", f"http://user:{SECRET}@broker:80/")
    with pytest.raises(ValueError, match="DFLASH_CELERY_BROKER_URL") as refused:
        broker_url()
    assert SECRET not in str(refused.value) and "http://" in str(refused.value)


def test_results_go_to_redis_itself_or_back_over_rabbitmq_unless_a_backend_is_set(monkeypatch):
    monkeypatch.delenv("DFLASH_CELERY_RESULT_BACKEND", raising=False)
    assert result_backend("redis://127.0.0.1:6379/4") == "redis://127.0.0.1:6379/4"
    assert result_backend("amqp://guest:guest@127.0.0.1:5672//") == "rpc://"
    monkeypatch.setenv("DFLASH_CELERY_RESULT_BACKEND", "redis://results:6379/0")
    assert result_backend("amqp://guest:guest@127.0.0.1:5672//") == "redis://results:6379/0"


def test_the_worker_runs_one_step_per_process_and_its_arguments_hold_no_broker_url():
    argv = worker_argv(["gpu", "default"], "node-a", 4)
    assert "--hostname=node-a@%h" in argv and "--queues=gpu,default" in argv
    assert "--concurrency=4" in argv and "--max-tasks-per-child=1" in argv
    assert not any("://" in arg for arg in argv)


def test_a_node_runs_as_many_steps_at_once_as_it_has_devices(monkeypatch):
    monkeypatch.setenv("DFLASH_DEVICES", "cuda:0,cuda:1,cuda:2")
    assert node_device_count() == 3
    monkeypatch.delenv("DFLASH_DEVICES")
    import torch

    assert node_device_count() == max(1, torch.cuda.device_count())  # a CPU-only node: one at a time


def _worker_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).with_name("dflash-assets")), "worker", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_worker_command_refuses_to_start_without_a_broker_or_a_usable_name():
    done = _worker_cli("--queue", "gpu", "--name", "node-a", DFLASH_CELERY_BROKER_URL="")
    assert done.returncode == 2 and "DFLASH_CELERY_BROKER_URL" in done.stderr
    done = _worker_cli(
        "--queue", "gpu", "--name", "node a", DFLASH_CELERY_BROKER_URL="redis://127.0.0.1:6379/5"
    )
    assert done.returncode == 2 and "--name" in done.stderr
    done = _worker_cli("--name", "node-a")
    assert done.returncode == 2 and "--queue" in done.stderr


# --- when a step's node is lost ---------------------------------------------------------------------


class FakeResult:
    """A Celery AsyncResult whose state the test sets."""

    def __init__(self, task_id: str):
        self.id, self.state, self.info, self.result, self.revoked = task_id, "PENDING", None, None, False

    def ready(self) -> bool:
        return self.state in ("SUCCESS", "FAILURE")

    def get(self):
        return ["events"]

    def revoke(self, terminate: bool = False, signal: str | None = None) -> None:
        self.revoked = True

    def start_on(self, worker: str) -> None:
        self.state, self.info = "STARTED", {"hostname": worker, "pid": 1}


class FakeCelery:
    """Celery's remote control: `running` maps each worker that answers to the task ids it runs."""

    def __init__(self):
        self.running: dict[str, set[str]] = {}
        self.control = self

    def inspect(self, destination, timeout):
        app = self

        class Inspect:
            def active(self):
                return {w: [{"id": i} for i in app.running[w]] for w in destination if w in app.running}

        return Inspect()


class Clock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def watch(monkeypatch):
    clock, app, sent, log = Clock(), FakeCelery(), [], []
    monkeypatch.setattr(celery_executor, "time", clock)

    def send() -> FakeResult:
        sent.append(FakeResult(f"task-{len(sent)}"))
        return sent[-1]

    def make(resubmits: int = 1) -> NodeWatch:
        return NodeWatch(app, log.append, "hidden_state_partitions", "gpu", send, 30.0, resubmits)

    make.clock, make.app, make.sent, make.log = clock, app, sent, log
    return make


def _advance(watcher: NodeWatch, clock: Clock, seconds: float, step: float = 1.0) -> bool:
    ready = False
    for _ in range(int(seconds / step)):
        clock.now += step
        ready = watcher.ready()
    return ready


def test_a_queued_step_waits_for_a_node_however_long_it_takes(watch):
    watcher = watch()
    assert not _advance(watcher, watch.clock, 3600)
    assert len(watch.sent) == 1


def test_a_step_whose_node_answers_is_never_lost(watch):
    watcher = watch()
    watch.sent[0].start_on("node-a@host")
    watch.app.running["node-a@host"] = {"task-0"}
    assert not _advance(watcher, watch.clock, 600)
    watch.sent[0].state = "SUCCESS"
    assert watcher.ready() and watcher.get() == ["events"] and len(watch.sent) == 1


def test_a_silent_node_loses_its_step_once_which_is_submitted_again_then_the_run_gives_up(watch):
    watcher = watch(resubmits=1)
    watch.sent[0].start_on("node-a@host")
    assert not _advance(watcher, watch.clock, 25)  # not yet: 30 s of silence make a node lost
    assert not _advance(watcher, watch.clock, 10)
    assert len(watch.sent) == 2 and watch.sent[0].revoked
    assert "node node-a@host has not reported it running" in watch.log[0] and "task-1" in watch.log[0]
    assert not _advance(watcher, watch.clock, 600)  # the new submission waits in the queue
    watch.sent[1].start_on("node-b@host")
    assert _advance(watcher, watch.clock, 40)  # node B falls silent too: nothing left to try
    assert len(watch.sent) == 2
    with pytest.raises(StepLost, match=settings.CELERY_STEP_RESUBMITS.name):
        watcher.get()


def test_a_step_process_killed_under_a_living_worker_counts_as_lost(watch):
    watcher = watch(resubmits=1)
    result = watch.sent[0]
    result.start_on("node-a@host")
    watch.app.running["node-a@host"] = {"task-0"}
    assert not _advance(watcher, watch.clock, 10)
    result.state, result.result = "FAILURE", type("WorkerLostError", (Exception,), {})("signal 9")
    assert not watcher.ready()  # not a failure of the step: submitted again
    assert len(watch.sent) == 2 and "its step process on node-a@host died" in watch.log[0]


def test_a_worker_restarted_under_the_same_name_does_not_keep_a_step_it_no_longer_runs_alive(watch):
    watcher = watch()
    watch.sent[0].start_on("node-a@host")
    watch.app.running["node-a@host"] = set()  # it answers, but the step died with its predecessor
    assert not _advance(watcher, watch.clock, 35)
    assert len(watch.sent) == 2
