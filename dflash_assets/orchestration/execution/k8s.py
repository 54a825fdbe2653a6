"""Where steps run: the `dagster-k8s/config` op tag of the GPU-bound assets, and every step's Celery queue.

With `DFLASH_EXECUTOR=k8s` every step runs as its own Kubernetes Job (`dagster_k8s.k8s_job_executor`),
and the executor reads this tag from the step's op. Elsewhere the tag is inert. The pod asks for
whole GPUs (`nvidia.com/gpu`, the NVIDIA device plugin's resource), tolerates the usual GPU taint,
lands on GPU nodes, and stages hidden states on the node's ephemeral storage: an emptyDir volume
with a size limit, counted against an `ephemeral-storage` request so the scheduler picks a node
with room for it. Staged files only wait for their upload, so nothing is lost with the pod.

With `DFLASH_EXECUTOR=celery` the `dagster-celery/queue` tag puts GPU steps on the `gpu` queue and
CPU steps (tokenisation) on `default`; a node takes the queues its `dflash-assets worker --queue`
names. Under any other executor that tag is inert too.
"""

from __future__ import annotations

from typing import Any

from dflash_assets import settings

K8S_CONFIG_TAG = "dagster-k8s/config"
CELERY_QUEUE_TAG = "dagster-celery/queue"  # dagster_celery.tags.DAGSTER_CELERY_QUEUE_TAG (an optional extra)
GPU_QUEUE = "gpu"
CPU_QUEUE = "default"
GPU_RESOURCE = "nvidia.com/gpu"
STAGING_VOLUME = "dflash-staging"
STAGING_MOUNT = "/var/lib/dflash/staging"


def _node_selector() -> dict[str, str]:
    raw = settings.K8S_NODE_SELECTOR.get()
    selector = {}
    for pair in filter(None, (p.strip() for p in raw.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{settings.K8S_NODE_SELECTOR.name}={raw!r}: expected key=value[,key=value]")
        selector[key.strip()] = value.strip()
    return selector


def cpu_step_tags() -> dict[str, Any]:
    """Op tags of a step that needs no GPU: Celery's `default` queue."""
    return {CELERY_QUEUE_TAG: CPU_QUEUE}


def gpu_step_tags(gpus: int = 1) -> dict[str, Any]:
    """Op tags placing a step on `gpus` whole GPUs (with local staging on ephemeral storage on
    Kubernetes), and on Celery's `gpu` queue."""
    if gpus < 1:
        raise ValueError(f"a GPU step needs at least one GPU, got {gpus}")
    staging_size = settings.K8S_STAGING_SIZE.get()
    return {
        CELERY_QUEUE_TAG: GPU_QUEUE,
        K8S_CONFIG_TAG: {
            "container_config": {
                "resources": {
                    # Extended resources are requested by their limit alone.
                    "limits": {GPU_RESOURCE: str(gpus), "ephemeral-storage": staging_size},
                    "requests": {"ephemeral-storage": staging_size},
                },
                "env": [{"name": settings.STAGING_DIR.name, "value": STAGING_MOUNT}],
                "volume_mounts": [{"name": STAGING_VOLUME, "mount_path": STAGING_MOUNT}],
            },
            "pod_spec_config": {
                "node_selector": _node_selector(),
                "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
                "volumes": [{"name": STAGING_VOLUME, "empty_dir": {"size_limit": staging_size}}],
            },
        },
    }
