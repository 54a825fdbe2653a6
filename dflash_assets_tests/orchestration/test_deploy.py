"""The deployment files, checked offline as far as this machine allows: every instance file against
Dagster's own config schema, the Helm values for what the official chart needs (and their launcher,
compute-log and instance sections against the schemas of the classes they configure), a step Job
built by dagster_k8s's own job construction, the compose file, and the Dockerfile through hadolint.
Nothing here talks to a cluster, a registry or Docker; what only a real cluster can show is listed
in docs/deploy.md ("Kubernetes")."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dagster import AssetKey, DagsterRun
from dagster._config import process_config
from dagster._core.instance.config import dagster_instance_config

from dflash_assets.orchestration.execution.k8s import GPU_RESOURCE, STAGING_MOUNT
from dflash_assets_tests.conftest import REPO

DEPLOY = REPO / "deploy"
INSTANCE_FILES = [REPO / "dagster.yaml", DEPLOY / "dagster-postgres.yaml", DEPLOY / "dagster-nodes.yaml"]


def _instance_config(path: Path, tmp_path: Path) -> dict:
    home = tmp_path / path.stem
    home.mkdir()
    shutil.copy(path, home / "dagster.yaml")
    config, _ = dagster_instance_config(str(home))  # raises on anything the schema refuses
    return dict(config)


@pytest.mark.parametrize("path", INSTANCE_FILES, ids=lambda p: p.name)
def test_every_instance_file_is_accepted_by_dagsters_schema_and_sets_the_recovery_policy(path, tmp_path):
    config = _instance_config(path, tmp_path)
    assert config["concurrency"]["pools"]["granularity"] == "run"
    assert config["run_retries"] == {"enabled": True, "max_retries": 2, "retry_on_asset_or_op_failure": False}
    monitoring = config["run_monitoring"]
    assert monitoring["enabled"] and monitoring["free_slots_after_run_end_seconds"] > 0


def test_an_instance_file_dagster_refuses_is_refused_here_too(tmp_path):
    from dagster._core.errors import DagsterInvalidConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text("run_monitoring:\n  start_timeout_second: 10\n")  # a misspelt key
    with pytest.raises(DagsterInvalidConfigError):
        _instance_config(bad, tmp_path)


# --- Helm ------------------------------------------------------------------------------------------

VALUES = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _snake_keys(mapping: dict) -> dict:
    return {_snake(k): v for k, v in mapping.items()}


def _instance_the_chart_renders() -> dict:
    """The parts of the instance's dagster.yaml that the chart renders from these values (run
    launcher, compute logs, run queue, monitoring, retries, additional config), as its templates map
    them; the chart's own fields (service account, instance config map) filled as it fills them."""
    daemon = VALUES["dagsterDaemon"]
    queue = daemon["runCoordinator"]["config"]["queuedRunCoordinator"]
    launcher = VALUES["runLauncher"]["config"]["k8sRunLauncher"]
    run_k8s_config = {_snake(k): v for k, v in launcher.get("runK8sConfig", {}).items()}
    return {
        "storage": {
            "postgres": {
                "postgres_db": {
                    "hostname": VALUES["postgresql"]["postgresqlHost"],
                    "username": VALUES["postgresql"]["postgresqlUsername"],
                    "password": {"env": "DAGSTER_PG_PASSWORD"},
                    "db_name": VALUES["postgresql"]["postgresqlDatabase"],
                    "port": VALUES["postgresql"]["service"]["port"],
                }
            }
        },
        "run_launcher": {
            "module": "dagster_k8s",
            "class": VALUES["runLauncher"]["type"],
            "config": {
                "load_incluster_config": launcher["loadInclusterConfig"],
                "image_pull_policy": launcher["imagePullPolicy"],
                "service_account_name": "dagster",
                "instance_config_map": "dagster-instance",
                "postgres_password_secret": VALUES["global"]["postgresqlSecretName"],
                "dagster_home": "/opt/dagster/dagster_home",
                "env_secrets": [s["name"] for s in launcher["envSecrets"]],
                "run_k8s_config": run_k8s_config,
            },
        },
        "compute_logs": {
            "module": "dagster_aws.s3.compute_log_manager",
            "class": VALUES["computeLogManager"]["type"],
            "config": _snake_keys(VALUES["computeLogManager"]["config"]["s3ComputeLogManager"]),
        },
        "run_coordinator": {
            "module": "dagster.core.run_coordinator",
            "class": daemon["runCoordinator"]["type"],
            # The template renders `config` only when some value is set.
            **({"config": _snake_keys(queue)} if queue else {}),
        },
        "run_monitoring": _snake_keys(daemon["runMonitoring"]),
        "run_retries": _snake_keys(daemon["runRetries"]),
        **VALUES["additionalInstanceConfig"],
    }


def test_the_helm_values_give_the_chart_what_it_needs():
    deployments = VALUES["dagster-user-deployments"]
    assert deployments["enabled"] and deployments["enableSubchart"]
    (code_location,) = deployments["deployments"]
    assert code_location["dagsterApiGrpcArgs"] == ["-m", "dflash_assets.definitions"]
    assert {"repository", "tag", "pullPolicy"} <= set(code_location["image"])
    assert code_location["image"]["tag"] not in ("", "latest")
    assert code_location["includeConfigInLaunchedRuns"]["enabled"] is True
    env = {e["name"]: e["value"] for e in code_location["env"]}
    assert env["DFLASH_EXECUTOR"] == "k8s" and env["DFLASH_STORE_URL"].startswith("s3://")

    assert VALUES["postgresql"]["enabled"] is False and VALUES["postgresql"]["postgresqlHost"]
    assert VALUES["generatePostgresqlPasswordSecret"] is False
    assert VALUES["runLauncher"]["type"] == "K8sRunLauncher"
    assert VALUES["computeLogManager"]["type"] == "S3ComputeLogManager"

    monitoring = VALUES["dagsterDaemon"]["runMonitoring"]
    assert monitoring["enabled"] and monitoring["startTimeoutSeconds"] >= 900  # GPU image pulls
    assert VALUES["dagsterDaemon"]["runRetries"]["retryOnAssetOrOpFailure"] is False


def test_no_secret_value_is_written_into_the_deployment_files():
    text = "\n".join(
        p.read_text()
        for p in [DEPLOY / "helm" / "values.yaml", DEPLOY / "compose.yaml", DEPLOY / "compose.worker.yaml"]
        + INSTANCE_FILES
    )
    assert "postgresqlPassword" not in text
    assert not re.search(r"AWS_SECRET_ACCESS_KEY:[ \t]*\S", text)
    passed_through = re.sub(r"(?i)password:[ \t]*\n", "", text)  # a key with no value: from the environment
    assert not re.search(r"(?i)password:\s*(?!\$\{)['\"]?\w", passed_through)


def test_the_instance_the_chart_renders_passes_dagsters_schema(tmp_path):
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump(_instance_the_chart_renders()))
    config = _instance_config(rendered, tmp_path)
    assert config["run_monitoring"]["start_timeout_seconds"] == 1800
    assert config["concurrency"]["pools"]["granularity"] == "run"


def test_the_compute_log_manager_values_are_s3_compute_log_manager_config():
    from dagster_aws.s3.compute_log_manager import S3ComputeLogManager

    section = _instance_the_chart_renders()["compute_logs"]
    result = process_config(S3ComputeLogManager.config_type(), section["config"])
    assert result.success, result.errors
    assert result.value["bucket"] == "dflash-dagster-logs"


@pytest.fixture
def kubeconfig(tmp_path) -> str:
    """A kubeconfig naming a cluster nobody serves: the launcher is built, never called."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "unused"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "dagster"}}],
                "current-context": "x",
            }
        )
    )
    return str(path)


def _run_launcher(kubeconfig: str):
    from dagster_k8s import K8sRunLauncher

    config = dict(_instance_the_chart_renders()["run_launcher"]["config"])
    config.update(load_incluster_config=False, kubeconfig_file=kubeconfig, job_namespace="dagster")
    result = process_config(K8sRunLauncher.config_type(), config)
    assert result.success, result.errors
    return K8sRunLauncher.from_config_value(None, result.value)


def _step_job(op_tags: dict, kubeconfig: str):
    """The Job `k8s_job_executor` submits for a step with these op tags (the same calls it makes)."""
    from dagster_k8s.container_context import K8sContainerContext
    from dagster_k8s.job import construct_dagster_k8s_job, get_user_defined_k8s_config

    launcher = _run_launcher(kubeconfig)
    run = DagsterRun(job_name="__ASSET_JOB", run_id="0123456789")
    # As K8sStepHandler._get_container_context: the launcher's pod config, then the op's tags.
    context = K8sContainerContext.create_for_run(run, launcher, include_run_tags=False).merge(
        K8sContainerContext(run_k8s_config=get_user_defined_k8s_config(op_tags))
    )
    job_config = context.get_k8s_job_config("registry.example.com/dflash-assets:0.1.0", launcher)
    return construct_dagster_k8s_job(
        job_config=job_config,
        args=["dagster", "api", "execute_step"],
        job_name="dagster-step-0123456789",
        pod_name="dagster-step-0123456789",
        component="step_worker",
        user_defined_k8s_config=context.run_k8s_config,
        labels={"dagster/op": "hidden_state_partitions"},
    )


def _op_tags(asset_name: str) -> dict:
    from dflash_assets.definitions import defs

    node = defs.get_repository_def().asset_graph.get(AssetKey(asset_name))
    return dict(node.assets_def.node_def.tags)


def test_a_hidden_state_step_job_asks_for_a_gpu_on_a_gpu_node_with_staging_on_ephemeral_storage(kubeconfig):
    job = _step_job(_op_tags("hidden_state_partitions"), kubeconfig)
    pod = job.spec.template.spec
    (container,) = pod.containers
    assert container.resources.limits[GPU_RESOURCE] == "1"
    storage = container.resources.limits["ephemeral-storage"]
    assert container.resources.requests["ephemeral-storage"] == storage
    assert any(t.key == GPU_RESOURCE and t.effect == "NoSchedule" for t in pod.tolerations)
    assert pod.node_selector == {"nvidia.com/gpu.present": "true"}
    (staging,) = [v for v in pod.volumes if v.empty_dir is not None]
    assert staging.empty_dir.size_limit == container.resources.limits["ephemeral-storage"]
    assert any(m.name == staging.name and m.mount_path == STAGING_MOUNT for m in container.volume_mounts)
    assert ("DFLASH_STAGING_DIR", STAGING_MOUNT) in [(e.name, e.value) for e in container.env]
    assert "dflash-aws" in [e.secret_ref.name for e in container.env_from if e.secret_ref]
    # Nothing sized for the orchestrating run pod leaks into the step that loads the target.
    assert "memory" not in container.resources.limits


def test_a_tokenizing_step_job_asks_for_no_gpu(kubeconfig):
    job = _step_job(_op_tags("tokenized_completions"), kubeconfig)
    (container,) = job.spec.template.spec.containers
    assert GPU_RESOURCE not in ((container.resources and container.resources.limits) or {})


def test_with_dflash_executor_k8s_the_code_location_runs_steps_as_kubernetes_jobs(tmp_path, monkeypatch):
    from dflash_assets.definitions import build_definitions

    monkeypatch.setenv("DFLASH_EXECUTOR", "k8s")  # read when the code location is built
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    job = build_definitions().get_repository_def().get_implicit_global_asset_job_def()
    assert job.executor_def.name == "k8s"


# --- compose and the image -------------------------------------------------------------------------

COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_the_compose_file_runs_postgres_the_code_location_on_the_gpus_the_webserver_and_the_daemon():
    services = COMPOSE["services"]
    assert set(services) == {"postgres", "code-location", "webserver", "daemon"}
    (gpus,) = services["code-location"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and "gpu" in gpus["capabilities"]
    for name in ("code-location", "webserver", "daemon"):
        mounts = services[name]["volumes"]
        instance = "./${DAGSTER_INSTANCE_FILE:-dagster-postgres.yaml}"
        assert f"{instance}:/opt/dagster/dagster_home/dagster.yaml:ro" in mounts
        assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "dagster-daemon" in services["daemon"]["command"]
    assert "dagster-webserver" in services["webserver"]["command"]
    assert "dflash_assets.definitions" in services["code-location"]["command"]
    workspace = yaml.safe_load((DEPLOY / "workspace.yaml").read_text())
    server = workspace["load_from"][0]["grpc_server"]
    assert (server["host"], server["port"]) == ("code-location", 4000)


WORKER = yaml.safe_load((DEPLOY / "compose.worker.yaml").read_text())


def test_the_worker_compose_file_runs_one_worker_node_on_the_gpus_with_its_own_staging():
    worker = WORKER["services"]["worker"]
    assert worker["command"] == [
        "dflash-assets", "worker", "--queue", "gpu", "--queue", "default", "--name", "${DFLASH_NODE}"
    ]  # fmt: skip
    (gpus,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and gpus["count"] == "all" and "gpu" in gpus["capabilities"]
    env = worker["environment"]
    for secret in ("DFLASH_CELERY_BROKER_URL", "DAGSTER_PG_PASSWORD", "AWS_SECRET_ACCESS_KEY"):
        assert env[secret] is None  # passed through from the node's environment, never written here
    assert (
        env["DFLASH_STAGING_DIR"].startswith("/var/lib/dflash/")
        and "dflash-data:/var/lib/dflash" in (worker["volumes"])
    )
    assert env["DFLASH_STORE_URL"].startswith("${DFLASH_STORE_URL:?")  # one store for every node
    # The broker, on the one node that hosts it: its password in no process argument.
    broker = WORKER["services"]["broker"]
    assert broker["profiles"] == ["broker"] and "--aclfile" in broker["command"][0]
    assert "$$REDIS_PASSWORD" in broker["command"][0]
    assert "REDIS_PASSWORD" not in " ".join(broker["entrypoint"])
    # The head's code location chooses the Celery executor and the broker from its environment.
    head = COMPOSE["services"]["code-location"]["environment"]
    assert head["DFLASH_EXECUTOR"] == "${DFLASH_EXECUTOR:-local}" and head["DFLASH_CELERY_BROKER_URL"] is None


def test_the_several_node_instance_keeps_compute_logs_in_s3_as_s3_compute_log_manager_reads_them(monkeypatch):
    from dagster_aws.s3.compute_log_manager import S3ComputeLogManager

    monkeypatch.setenv("DAGSTER_COMPUTE_LOG_BUCKET", "dflash-logs")
    section = yaml.safe_load((DEPLOY / "dagster-nodes.yaml").read_text())["compute_logs"]
    assert section["class"] == "S3ComputeLogManager"
    result = process_config(S3ComputeLogManager.config_type(), section["config"])
    assert result.success, result.errors
    assert result.value["bucket"] == "dflash-logs"


def test_the_dockerfile_passes_hadolint_and_installs_the_lock_then_the_project_with_the_extras():
    hadolint = Path(sys.executable).with_name("hadolint")
    done = subprocess.run(
        [str(hadolint), "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = (DEPLOY / "Dockerfile").read_text()
    # Every package from the lock, torch included (dflash_assets_tests/project/test_image_lock.py).
    assert "--requirement deploy/requirements.lock" in text
    assert '--no-deps ".[postgres,k8s,celery]"' in text
    assert re.search(r"^FROM \S+:\d", text, re.M)  # a pinned base image


def test_hadolint_here_really_lints():
    hadolint = Path(sys.executable).with_name("hadolint")
    bad = subprocess.run(
        [str(hadolint), "--no-color", "-"],
        input="FROM python:latest\nRUN pip install torch\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "DL3007" in bad.stdout
