"""Every `DFLASH_*` environment variable in one table: name, default, meaning.

The Dagster layer reads defaults from here; run config in the launchpad overrides them. The README's
configuration table is this table. AWS settings are not here: boto3 reads the standard `AWS_*`
variables itself, so credentials never pass through our config, logs or run config.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    meaning: str

    def get(self) -> str:
        value = os.environ.get(self.name, "").strip()
        return value if value else self.default

    def get_int(self) -> int:
        raw = self.get()
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r} is not an integer") from None

    def get_optional_int(self) -> int | None:
        """The integer value, or None when the variable is unset or empty and has no default."""
        return self.get_int() if self.get() else None

    def get_float(self) -> float:
        raw = self.get()
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r} is not a number") from None


def _home() -> Path:
    return Path(os.environ.get("DFLASH_HOME", "").strip() or Path.home() / ".dflash").expanduser()


HOME = Setting("DFLASH_HOME", "~/.dflash", "Root for the default local store, staging and caches.")
STORE_URL = Setting(
    "DFLASH_STORE_URL",
    "",  # resolved by store_url(): $DFLASH_HOME/store
    "Where assets live: `s3://bucket/prefix` or a local directory. Default `$DFLASH_HOME/store`.",
)
STAGING_DIR = Setting(
    "DFLASH_STAGING_DIR", "", "Local staging for objects waiting to upload. Default `$DFLASH_HOME/staging`."
)
CACHE_DIR = Setting(
    "DFLASH_CACHE_DIR",
    "",
    "Demo model, downloaded datasets, read cache, device leases. Default `$DFLASH_HOME/cache`.",
)
STAGING_MAX_BYTES = Setting(
    "DFLASH_STAGING_MAX_BYTES",
    str(8 * 2**30),
    "Bound on local staging bytes; extraction pauses when reached (backpressure).",
)
UPLOAD_MAX_IN_FLIGHT = Setting("DFLASH_UPLOAD_MAX_IN_FLIGHT", "100", "Most uploads in flight at once.")
S3_CHECKSUM = Setting(
    "DFLASH_S3_CHECKSUM",
    "",
    "`when_supported` or `when_required` (for S3-compatible stores that reject CRC32 headers). "
    "Empty: boto3's default (also `AWS_REQUEST_CHECKSUM_CALCULATION`).",
)
TARGET_MODEL = Setting(
    "DFLASH_TARGET_MODEL",
    "demo",
    "Hugging Face model directory of the target LLM. `demo`: the built-in tiny qwen3_5_text model.",
)
DATASET = Setting(
    "DFLASH_DATASET",
    "bundled",
    "Chat conversations: local JSONL/Parquet path or `s3://bucket/key`. `bundled`: the shipped samples.",
)
SAMPLES_PER_PARTITION = Setting(
    "DFLASH_SAMPLES_PER_PARTITION",
    "10000",
    "Rows per sample-range partition (fixed; keys never change when the dataset grows). "
    "With the bundled dataset and no value set: 100.",
)
MAX_LENGTH = Setting("DFLASH_MAX_LENGTH", "3072", "Token limit per sample; longer ones are truncated.")
TARGET_LAYER_IDS = Setting(
    "DFLASH_TARGET_LAYER_IDS",
    "",
    "Target decoder layers to capture, e.g. `1,16,31,46,61`. Empty: the DFlash rule for "
    "`DFLASH_NUM_DRAFT_LAYERS` layers.",
)
NUM_DRAFT_LAYERS = Setting("DFLASH_NUM_DRAFT_LAYERS", "5", "Drafter layers k (and target layers captured).")
DEVICES = Setting(
    "DFLASH_DEVICES",
    "",
    "Devices runs may lease, e.g. `cuda:0,cuda:1`. Empty: every visible CUDA device, else `cpu`.",
)
MAX_TOKENS_PER_BATCH = Setting(
    "DFLASH_MAX_TOKENS_PER_BATCH", "16384", "Extraction token budget per forward (padded tokens included)."
)
TRAIN_MODE = Setting(
    "DFLASH_TRAIN_MODE", "offline", "`offline` (stored hidden states) or `online` (target runs)."
)
TRAIN_MAX_STEPS = Setting(
    "DFLASH_TRAIN_MAX_STEPS",
    "",
    "Exactly this many optimiser steps, over as many epochs as it takes. Empty: the recipe's epochs decide.",
)
TRAIN_GLOBAL_BATCH_SIZE = Setting(
    "DFLASH_TRAIN_GLOBAL_BATCH_SIZE",
    "32",
    "Sequences per optimiser step, reached by gradient accumulation over micro-batches that fit memory.",
)
MASK_TOKEN_ID = Setting(
    "DFLASH_MASK_TOKEN_ID",
    "",
    "Token id of the drafter's mask slots. Empty: the tokenizer's `mask_token`, else the first id past "
    "the tokenizer's vocabulary inside the embedding matrix.",
)
DRAFTER_SHAPE = Setting(
    "DFLASH_DRAFTER_SHAPE",
    "auto",
    "Drafter attention shape: `dflash` (32 query / 8 KV heads of 128, full attention; `auto`), "
    "`dflash-swa` (the Qwen3.6-27B drafter: sliding-window layers then a full one) or `target`.",
)
CHECKPOINT_EVERY_STEPS = Setting("DFLASH_CHECKPOINT_EVERY_STEPS", "100", "Checkpoint every N steps (0: off).")
CHECKPOINT_EVERY_MINUTES = Setting(
    "DFLASH_CHECKPOINT_EVERY_MINUTES", "30", "Checkpoint every M minutes, whichever comes first."
)
RUN_NAME = Setting("DFLASH_RUN_NAME", "drafter", "Training run name: `checkpoints/<run>/`, `drafter/<run>/`.")
RETRIGGER_MAX_ATTEMPTS = Setting(
    "DFLASH_RETRIGGER_MAX_ATTEMPTS", "3", "Times the sensor re-launches a failed range before giving up."
)
RETRIGGER_BACKOFF_S = Setting(
    "DFLASH_RETRIGGER_BACKOFF_S",
    "300",
    "Seconds the failed-range sensor waits after a range's first failure before re-launching it; doubles "
    "with each further attempt.",
)
EXECUTOR = Setting(
    "DFLASH_EXECUTOR",
    "local",
    "`local` (steps as processes of the run worker), `k8s` (one Kubernetes Job per step) or `celery` (steps "
    "queued on a broker for `dflash-assets worker` nodes). Read when the code location loads.",
)
CELERY_BROKER_URL = Setting(
    "DFLASH_CELERY_BROKER_URL",
    "",
    "With `DFLASH_EXECUTOR=celery` and on every worker node: the broker, `redis://[:password@]host:6379/N` "
    "or `amqp://user:password@host:5672//`. Read from the environment only, never logged.",
)
CELERY_RESULT_BACKEND = Setting(
    "DFLASH_CELERY_RESULT_BACKEND",
    "",
    "Where workers leave step results. Empty: the broker itself for Redis, `rpc://` for RabbitMQ.",
)
CELERY_NODE_LOST_AFTER_S = Setting(
    "DFLASH_CELERY_NODE_LOST_AFTER_S",
    "30",
    "Seconds a running step's worker may go without reporting it running before the step counts as lost "
    "and is submitted again. Read when a run starts.",
)
CELERY_STEP_RESUBMITS = Setting(
    "DFLASH_CELERY_STEP_RESUBMITS",
    "2",
    "Times one run submits a step again after losing its node, before the run fails. Read when a run starts.",
)
CELERY_RUN_CHECK_S = Setting(
    "DFLASH_CELERY_RUN_CHECK_S",
    "10",
    "Seconds between a worker node's checks that a running step's run still waits for it; a step whose "
    "run has ended (its run worker died and was reaped, or it was terminated) stops.",
)
NODE = Setting(
    "DFLASH_NODE",
    "",
    "This node's name in step metadata `node` and compute logs (`dflash-assets worker --name` sets it). "
    "Empty: the host name.",
)
K8S_NODE_SELECTOR = Setting(
    "DFLASH_K8S_NODE_SELECTOR",
    "nvidia.com/gpu.present=true",
    "Node labels GPU steps are scheduled on, `key=value[,key=value]`. Read when the code location loads.",
)
K8S_STAGING_SIZE = Setting(
    "DFLASH_K8S_STAGING_SIZE",
    "100Gi",
    "Ephemeral storage for a GPU step's local staging (an emptyDir volume with this size limit; keep it "
    "above DFLASH_STAGING_MAX_BYTES). Read when the code location loads.",
)
K8S_TRAIN_GPUS = Setting(
    "DFLASH_K8S_TRAIN_GPUS",
    "1",
    "GPUs a training step's pod requests (online mode with 7 target replicas: 8). Read when the code "
    "location loads.",
)

ALL_SETTINGS = [value for value in list(globals().values()) if isinstance(value, Setting)]


def store_url() -> str:
    return STORE_URL.get() or str(_home() / "store")


def staging_dir() -> Path:
    return Path(STAGING_DIR.get() or _home() / "staging").expanduser()


def cache_dir() -> Path:
    return Path(CACHE_DIR.get() or _home() / "cache").expanduser()


def node_name() -> str:
    return NODE.get() or socket.gethostname()


def samples_per_partition() -> int:
    if not os.environ.get(SAMPLES_PER_PARTITION.name, "").strip() and DATASET.get() == "bundled":
        return 100
    value = SAMPLES_PER_PARTITION.get_int()
    if value <= 0:
        raise ValueError(f"{SAMPLES_PER_PARTITION.name} must be positive, got {value}")
    return value
