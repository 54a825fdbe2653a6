"""What the run worker and the worker nodes agree on: the broker, the result backend, the queues,
the step task's name and the Celery settings that make a lost node cost nothing.

The broker URL comes from `DFLASH_CELERY_BROKER_URL` in each process's environment and nowhere
else: not run config, not process arguments, not logs (Celery masks its password when it prints
it; messages here name only its scheme). Steps are acknowledged when a node starts them (Celery's
default), not when they end: a range runs for hours, longer than Redis's visibility timeout or
RabbitMQ's consumer timeout allow a message to stay unacknowledged without being redelivered or
its channel closed. A step whose node dies is submitted again by the run worker that waits for it
(`celery_executor.py`); on Redis a worker fetches a step only when it has a free process for it, so
a dead node never takes queued steps with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dflash_assets import settings

if TYPE_CHECKING:
    from celery import Celery
    from kombu import Queue

TASK_NAME = "dflash_assets.execute_step"
REDIS_SCHEMES = ("redis", "rediss", "sentinel")
AMQP_SCHEMES = ("amqp", "amqps", "pyamqp")
MAX_PRIORITY = 10  # dagster_celery's `task_queue_max_priority`


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def broker_url() -> str:
    """`DFLASH_CELERY_BROKER_URL`, checked; errors name the setting and the scheme, never the URL."""
    url = settings.CELERY_BROKER_URL.get()
    if not url:
        raise settings.SettingError(
            f"{settings.EXECUTOR.name}=celery and `dflash-assets worker` need "
            f"{settings.CELERY_BROKER_URL.name}: the broker, e.g. redis://127.0.0.1:6379/0 or "
            "amqp://user:password@host:5672//"
        )
    scheme = _scheme(url)
    if scheme not in REDIS_SCHEMES + AMQP_SCHEMES:
        raise settings.SettingError(
            f"{settings.CELERY_BROKER_URL.name} must be a Redis (redis://, rediss://) or RabbitMQ (amqp://, "
            f"amqps://) URL; it starts with {scheme + '://' if scheme else 'no scheme'}"
        )
    return url


def result_backend(broker: str) -> str:
    """`DFLASH_CELERY_RESULT_BACKEND`, else the broker for Redis and `rpc://` for RabbitMQ."""
    return settings.CELERY_RESULT_BACKEND.get() or (broker if _scheme(broker) in REDIS_SCHEMES else "rpc://")


def is_redis(url: str) -> bool:
    return _scheme(url) in REDIS_SCHEMES


def step_queue(name: str) -> Queue:
    """A queue as dagster_celery's app declares one when it publishes to it (the run worker publishes
    through that app): RabbitMQ refuses to declare one queue two ways."""
    from kombu import Exchange, Queue

    return Queue(name, Exchange(name), routing_key=name, queue_arguments={"x-max-priority": MAX_PRIORITY})


def celery_settings(broker: str) -> dict:
    """The Celery settings of a worker node's app."""
    return {
        "task_acks_late": False,  # see the module docstring
        "task_track_started": True,  # the run worker reads which node started its step
        "worker_prefetch_multiplier": 1,
        "worker_disable_prefetch": is_redis(broker),  # Celery supports it on Redis only
        "worker_redirect_stdouts": False,  # Dagster captures a step's stdout and stderr itself
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        # A queue of each worker's own, so a multi-node training run can send a join to a chosen node.
        "worker_direct": True,
    }


def node_app(queues: Sequence[str]) -> Celery:
    """The Celery app of a worker node listening on `queues` (the step task is registered by
    `celery_worker.py`)."""
    from celery import Celery

    broker = broker_url()
    app = Celery("dflash_assets", broker=broker, backend=result_backend(broker), set_as_current=False)
    app.conf.update(celery_settings(broker))
    app.conf.task_queues = [step_queue(name) for name in queues]
    return app
