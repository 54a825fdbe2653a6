"""Mistakes a user fixes by changing one setting, flag, path or URL, told in one line without a traceback.

`check_settings` reads every `DFLASH_*` value that has a shape to check, before any work: when a
`dflash-assets` command starts and when the code location loads. It reads values only (no file, store,
model or network: a dataset that is missing or a bucket that refuses us is found when a command uses
it) and never prints a secret's value. `user_error_message` picks such a mistake out of an exception
(a bug keeps its traceback); `dflash-assets` prints it, and `report_in_one_line` makes a `dagster` or `dg`
command typed at a shell that loads this code location do the same. Nowhere else: a code server, the
webserver, the daemon, a run or step worker, a test or a notebook that loads it keeps its own hook.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from dflash_assets import settings
from dflash_assets.settings import Setting, SettingError

# Values of settings whose meaning lives in a module that imports torch (so not imported at load); a
# test holds the shapes equal to `drafter.config.DRAFTER_SHAPES` and builds each executor named.
DRAFTER_SHAPES = ("auto", "dflash", "dflash-swa", "target")
DRAFTER_ARCHS = ("dflash", "dflash2")  # drafter.config.ARCHITECTURES
DRAFTER_LOSSES = ("dpace", "decay")  # drafter.objective.LOSSES
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")  # training.settings.LR_SCHEDULES
TRAIN_MODES = ("offline", "online")
EXECUTORS = ("local", "k8s", "celery")

# Integers: the smallest value, and whether the setting may also be empty (unset: no value).
_INTEGERS: dict[Setting, tuple[int, bool]] = {
    settings.STAGING_MAX_BYTES: (1, False),
    settings.UPLOAD_MAX_IN_FLIGHT: (1, False),
    settings.SAMPLES_PER_PARTITION: (1, False),
    settings.MAX_LENGTH: (1, False),
    settings.GENERATE_CONCURRENCY: (1, False),
    settings.GENERATE_MAX_NEW_TOKENS: (1, True),
    settings.NUM_DRAFT_LAYERS: (1, False),
    settings.MAX_TOKENS_PER_BATCH: (1, False),
    settings.TRAIN_MAX_STEPS: (0, True),
    settings.TRAIN_GLOBAL_BATCH_SIZE: (1, False),
    settings.MASK_TOKEN_ID: (0, True),
    settings.CHECKPOINT_EVERY_STEPS: (0, False),
    settings.RETRIGGER_MAX_ATTEMPTS: (0, False),
    settings.CELERY_STEP_RESUBMITS: (0, False),
    settings.K8S_TRAIN_GPUS: (1, False),
    settings.TRAIN_NNODES: (1, False),
    settings.TRAIN_RDZV_PORT: (0, False),
    settings.TRAIN_MAX_RESTARTS: (0, False),
    settings.BLOCK_SIZE: (2, True),
    settings.EVAL_PROMPTS: (1, False),
    settings.EVAL_NEW_TOKENS: (1, False),
}
# Numbers: the smallest value, and whether it is allowed itself.
_NUMBERS: dict[Setting, tuple[float, bool]] = {
    settings.GENERATE_TEMPERATURE: (0.0, True),
    settings.CHECKPOINT_EVERY_MINUTES: (0.0, True),
    settings.RETRIGGER_BACKOFF_S: (0.0, True),
    settings.CELERY_NODE_LOST_AFTER_S: (0.0, False),
    settings.CELERY_RUN_CHECK_S: (0.0, False),
    settings.PEAK_TFLOPS: (0.0, False),
    settings.TRAIN_RDZV_TIMEOUT_S: (0.0, False),
    settings.TRAIN_COLLECTIVE_TIMEOUT_S: (0.0, False),
    settings.TRAIN_EVAL_TIMEOUT_S: (0.0, False),
    settings.VLLM_START_TIMEOUT_S: (0.0, False),
}


def _choices() -> dict[Setting, tuple[str, ...]]:
    from dflash_assets.conversations.layouts import DATASET_FORMATS
    from dflash_assets.storage.store import CHECKSUM_MODES

    return {
        settings.COMPLETIONS: ("dataset", "target"),
        settings.DATASET_FORMAT: DATASET_FORMATS,
        settings.S3_CHECKSUM: CHECKSUM_MODES,
        settings.TRAIN_MODE: TRAIN_MODES,
        settings.DRAFTER_SHAPE: DRAFTER_SHAPES,
        settings.DRAFTER_ARCH: DRAFTER_ARCHS,
        settings.DRAFTER_LOSS: DRAFTER_LOSSES,
        settings.LR_SCHEDULE: LR_SCHEDULES,
        settings.EXECUTOR: EXECUTORS,
        settings.GENERATE_ENGINE: ("",) + settings.GENERATE_ENGINES,
        settings.GENERATE_DTYPE: ("", "auto", "float32", "bfloat16", "float16"),
    }


def _hidden_state_dtype(value: str) -> None:
    from dflash_assets.extraction.object_size import check_hidden_state_dtype

    check_hidden_state_dtype(value)


def _store_url(value: str) -> None:
    from dflash_assets.storage.open_store import check_store_url

    check_store_url(settings.store_url())


def _dataset(value: str) -> None:
    from dflash_assets.conversations import sharegpt
    from dflash_assets.conversations.datasets import DatasetError

    if sharegpt.is_reference(value):
        try:
            sharegpt.parse_slice(value)
        except DatasetError as error:
            raise SettingError(f"{settings.DATASET.name}: {error}") from None
        return
    if value == "bundled" or value.startswith(("s3://", "file://")) or "://" not in value:
        if value.startswith("s3://") and not value[len("s3://") :].split("/", 1)[0]:
            raise SettingError(
                f"{settings.DATASET.name}={value!r} names no bucket: s3://<bucket>/<key or prefix>"
            )
        return
    if value.startswith("hf://"):
        parts = value[len("hf://") :].split("/")
        if parts[0] != "datasets" or len([part for part in parts[1:3] if part]) < 2:
            raise SettingError(
                f"{settings.DATASET.name}={value!r} must be "
                "hf://datasets/<owner>/<name>[@revision]/<path or glob>"
            )
        return
    raise SettingError(
        f"{settings.DATASET.name}={value!r} has an unsupported scheme: use a local path, file:///path, "
        "s3://<bucket>/<key or prefix>, hf://datasets/<owner>/<name>/<path> or `bundled`"
    )


def _local_directory(setting: Setting) -> Callable[[str], None]:
    def check(value: str) -> None:
        if "://" in value:
            raise SettingError(f"{setting.name}={value!r} must be a local directory, not a URL")

    return check


def _layer_ids(value: str) -> None:
    from dflash_assets.target.layer_ids import parse_layer_ids

    if any(layer < 0 for layer in parse_layer_ids(value)):
        raise SettingError(f"{settings.TARGET_LAYER_IDS.name}={value!r}: layer ids are 0 or more")


def _devices(value: str) -> None:
    from dflash_assets.target.devices import check_device_name

    for device in filter(None, (d.strip() for d in value.split(","))):
        check_device_name(device)


def _generate_urls(value: str) -> None:
    from dflash_assets.generation.openai_server import Server, parse_urls

    for url in parse_urls(value):
        Server(url)


def _node_selector(value: str) -> None:
    for pair in filter(None, (p.strip() for p in value.split(","))):
        key, sep, _ = pair.partition("=")
        if not sep or not key.strip():
            raise SettingError(
                f"{settings.K8S_NODE_SELECTOR.name}={value!r}: expected key=value[,key=value], e.g. "
                "nvidia.com/gpu.present=true"
            )


def _run_name(value: str) -> None:
    if "/" in value or value in (".", "..") or not value.isprintable():
        raise SettingError(
            f"{settings.RUN_NAME.name}={value!r} must be one path segment (it names checkpoints/<run>/ "
            "and drafter/<run>/): no '/'"
        )


def _eval_sets(value: str) -> None:
    from dflash_assets.evaluation.prompt_sets import PromptSetError, parse_eval_sets

    try:
        parse_eval_sets(value)
    except PromptSetError as error:
        raise SettingError(str(error)) from None


def _ranks_per_node(value: str) -> None:
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise SettingError(f"{settings.TRAIN_NPROC_PER_NODE.name}={value!r} must be `auto` or 1 or more")


def _git_url(value: str) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    if "@" in parts.netloc:  # never echo it: it may hold a token
        raise SettingError(f"{settings.GIT_URL.name} must not carry credentials: give the address alone")
    if parts.scheme not in ("https", "http") or not parts.hostname or parts.path.strip("/").count("/") < 1:
        raise SettingError(
            f"{settings.GIT_URL.name}={value!r} must be a repository's web address, e.g. "
            "https://github.com/<org>/<repo>"
        )
    if "github" not in parts.hostname and "gitlab" not in parts.hostname:
        raise SettingError(
            f"{settings.GIT_URL.name}={value!r}: Dagster links code on GitHub and GitLab only (a host name "
            "holding `github` or `gitlab`); unset it to link to the source files instead"
        )


def _between_0_and_1(setting: Setting) -> Callable[[str], None]:
    def check(value: str) -> None:
        if not 0.0 <= setting.get_float() <= 1.0:
            raise SettingError(f"{setting.name}={value!r} must be between 0 and 1")

    return check


def _flag(setting: Setting) -> Callable[[str], None]:
    def check(value: str) -> None:
        setting.get_bool()

    return check


def _special() -> dict[Setting, Callable[[str], None]]:
    return {
        settings.STORE_URL: _store_url,
        settings.DATASET: _dataset,
        settings.HIDDEN_STATE_DTYPE: _hidden_state_dtype,
        settings.HOME: _local_directory(settings.HOME),
        settings.STAGING_DIR: _local_directory(settings.STAGING_DIR),
        settings.CACHE_DIR: _local_directory(settings.CACHE_DIR),
        settings.TARGET_LAYER_IDS: _layer_ids,
        settings.DEVICES: _devices,
        settings.GENERATE_URL: _generate_urls,
        settings.K8S_NODE_SELECTOR: _node_selector,
        settings.RUN_NAME: _run_name,
        settings.TRAIN_NPROC_PER_NODE: _ranks_per_node,
        settings.GIT_URL: _git_url,
        settings.DPACE_ALPHA: _between_0_and_1(settings.DPACE_ALPHA),
        settings.DISTILL_WEIGHT: _between_0_and_1(settings.DISTILL_WEIGHT),
        settings.CAPTURE_FINAL_STATE: _flag(settings.CAPTURE_FINAL_STATE),
        settings.TRAIN_UNTIL_FLAT: _flag(settings.TRAIN_UNTIL_FLAT),
        settings.DRAFTER_INIT: _local_directory(settings.DRAFTER_INIT),
        settings.EVAL_SETS: _eval_sets,
    }


def _check_one(setting: Setting) -> None:
    value = setting.get()
    if setting in _INTEGERS:
        smallest, may_be_empty = _INTEGERS[setting]
        if may_be_empty and not value:
            return
        number = setting.get_int()
        if number < smallest:
            raise SettingError(f"{setting.name}={value!r} must be {smallest} or more")
    elif setting in _NUMBERS:
        smallest, inclusive = _NUMBERS[setting]
        if not value:  # no default: unset
            return
        number = setting.get_float()
        if number < smallest or (number == smallest and not inclusive):
            raise SettingError(
                f"{setting.name}={value!r} must be {'at least' if inclusive else 'more than'} {smallest:g}"
            )
    elif setting in (choices := _choices()):
        allowed = choices[setting]
        if value and value not in allowed:
            raise SettingError(
                f"{setting.name}={value!r} is not one of {', '.join(allowed)}"
                + (f": unset it for the default, {setting.default}" if setting.default else "")
            )
    elif setting in (special := _special()) and value:
        special[setting](value)
    if setting is settings.EXECUTOR and value == "celery":
        from dflash_assets.orchestration.execution.celery_app import broker_url

        broker_url()  # its messages name the setting and the scheme, never the URL


def check_settings() -> None:
    """Raise one `SettingError` naming every `DFLASH_*` value that cannot be used, and what to do."""
    problems = []
    for setting in settings.ALL_SETTINGS:
        try:
            _check_one(setting)
        except ValueError as error:  # SettingError, and the core's parsers' ValueErrors
            message = str(error)
            problems.append(message if setting.name in message else f"{setting.name}: {message}")
    if problems:
        raise SettingError("; ".join(problems))


# ------------------------------------------------------------------------------ reporting


def user_error_types() -> tuple[type[BaseException], ...]:
    from dflash_assets.conversations.datasets import DatasetError
    from dflash_assets.drafter.config import MaskTokenError
    from dflash_assets.drafter.published import DrafterInitError
    from dflash_assets.evaluation.prompt_sets import PromptSetError
    from dflash_assets.evaluation.runs import RunNotTrained
    from dflash_assets.orchestration.partitions import NotASampleRange
    from dflash_assets.storage.store import StoreConfigError
    from dflash_assets.target.smollm2 import RealModelMissing

    return (
        SettingError, DatasetError, StoreConfigError, NotASampleRange, DrafterInitError, MaskTokenError,
        RealModelMissing, PromptSetError, RunNotTrained,
    )  # fmt: skip


def user_error_message(error: BaseException) -> str | None:
    """The one line for a mistake of the user's anywhere in `error`'s chain (a bad setting, a missing
    dataset, a store URL or credentials refused, a partition key that is no range of the dataset); None
    for anything else, which keeps its traceback."""
    types = user_error_types()
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, types):
            return " ".join(str(current).split())
        current = current.__cause__ or current.__context__
    return None


# The `dagster` and `dg` subcommands a person types that load the code location in their own process and
# let a mistake end them: `dagster asset materialize`, `dagster job execute`, `dg launch`. Every other
# command either serves (`dagster api grpc`, `code-server`, `dev`; the webserver and the daemon are
# programs of their own), runs a launched run or step (`dagster api execute_run`, `execute_step`) or
# reports a failed load itself (`dagster definitions validate`, `dg check defs`, `dg list defs`).
SHELL_COMMANDS = frozenset({"asset", "job", "launch"})


def loaded_by_a_shell_command() -> bool:
    """Whether this process is one of the `SHELL_COMMANDS`, loading the code location now: the click
    command Dagster's and dg's command lines run it from says which (a plain import runs in none)."""
    import click

    context = click.get_current_context(silent=True)
    if context is None:
        return False
    words = []
    while context.parent is not None:  # the root is the program, named as it was started
        words.append(context.info_name)
        context = context.parent
    return bool(words) and words[-1] in SHELL_COMMANDS


def report_in_one_line() -> None:
    """Make an uncaught user mistake end this process with one line on stderr (exit status 1), not a
    traceback. `definitions.py` installs it in a `dagster` or `dg` command typed at a shell only
    (`loaded_by_a_shell_command`). Anything else still goes to the previous hook. Idempotent."""
    previous = sys.excepthook
    if getattr(previous, "_dflash_one_line", False):
        return

    def hook(kind, value, traceback) -> None:
        message = user_error_message(value) if isinstance(value, BaseException) else None
        if message is None:
            previous(kind, value, traceback)
        else:
            print(f"dflash-assets: {message}", file=sys.stderr, flush=True)

    hook._dflash_one_line = True  # type: ignore[attr-defined]
    sys.excepthook = hook
