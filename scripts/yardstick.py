"""The drafter yardstick: drafters trained side by side on the configured target's data and measured on each
prompt set beside the free floor (prompt lookup), through the product alone. A thin driver: it materialises
the product's own assets (`definitions.build_definitions()`, in this process, against the user's Dagster
instance and store, by `orchestration.execution.in_process` as `dflash-assets demo` does) and prints
`dflash-assets compare`; every figure it shows is one the product stored, which the UI and `compare` read
again later.

    python scripts/yardstick.py data       # every range of DFLASH_DATASET: target_completions (only with
                                           # DFLASH_COMPLETIONS=target), tokenized_completions, hidden states
    python scripts/yardstick.py train VARIANT [VARIANT ...] --steps N [--evals E] [--sets held_out,chat]
    python scripts/yardstick.py table [RUN ...]     # compare --markdown, and each run's curve
    python scripts/yardstick.py reproduce           # the default recipe's row, from the kept data
    python scripts/yardstick.py plot                # docs/images/tau-against-data.svg from the measured rows
    python scripts/yardstick.py keep-references     # the stored greedy outputs and floors, to commit

`reproduce` rebuilds the default recipe's row of the τ-against-data table (docs/drafter.md) from a fresh
clone: the answers SmolLM2 gave ShareGPT's first turns [0:1000] through vLLM, kept in `yardstick-data/`
with their provenance, are tokenized and captured, the product's default drafter (DFLASH_DRAFTER_ARCH,
DFLASH_DRAFTER_LOSS, the block and DFLASH_DISTILL_WEIGHT as the settings say) trains until its held-out
curve is flat (DFLASH_TRAIN_UNTIL_FLAT, `--steps` the cap), and `drafter_evaluations` measures it on 64
held-out prompts and 64 prompts of ShareGPT's first turns past record 16,000 (`sharegpt_later`), 64 new
tokens each, beside prompt lookup. It sets only what the user has not (printed first): DFLASH_HOME,
DFLASH_STORE_URL and any DFLASH_* setting the user exported win, and the sets DFLASH_EVAL_SETS names are
measured too, so `dflash-assets compare --json` lists them beside the table's own. A rerun continues
what the store holds (the captured ranges, the run's checkpoints, the evaluations: each is done once);
`reproduce --zlab` also decodes every set with z-lab's loop (on a finished run, only that), and
`reproduce --conversations N` trains on the first N of the kept conversations not held out (the run
`default-recipe-N`): another data size from the same capture, measured on the same prompts. Under a
learning-rate schedule other than the default (DFLASH_LR_SCHEDULE=wsd) the run's name ends in it
(`default-recipe-wsd`, `default-recipe-250-wsd`).

A variant is `<arch>-<loss>-<block>[-kl<w>]`: `dflash2-dpace-16`, `dflash-decay-16`, `dflash2-dpace-8-kl0.5`
(distillation from the target's distribution at weight w: hidden states captured with the final state,
DFLASH_CAPTURE_FINAL_STATE=1, the default). Each variant is a training run of that name:
`drafter_checkpoints` with run config `run_name`, `drafter_arch`, `loss`, `block_size`, `distill_weight`
from the name and `max_steps`, `num_anchors`, `global_batch_size`, `lr` from the flags, checkpointing every
`steps // evals` steps so that the trainer's own held-out evaluation at each checkpoint gives the curve (τ
against steps, step 0 the fresh weights; recorded in the run's manifest as `curve`); then
`drafter_evaluations` of each set in `--sets` with run config `run_name`, `prompts`, `new_tokens`. A run
already in the store is continued from its last checkpoint (the product resumes, it does not start again):
a fresh comparison wants a fresh DFLASH_STORE_URL. `--zlab` also decodes each export with z-lab's
`dflash_generate` (the `dflash` package, a test dependency `scripts/setup.sh` installs) on the held_out
evaluation's prompts: the engines' own loop beside the product's, τ and outputs equal to the target's.

It sets nothing of its own: the target, the data, the store, the devices and whatever no flag gives are the
user's DFLASH_* settings, printed first. The SmolLM2-on-ShareGPT yardstick (docs/drafter.md, "Measured on a
real model: SmolLM2"; `scripts/gpu-check.sh --stages yardstick` runs the same on a lent GPU):

    export DFLASH_TARGET_MODEL=smollm2 DFLASH_DATASET='sharegpt-first-turn[0:1200]' \\
      DFLASH_COMPLETIONS=target DFLASH_MAX_LENGTH=2048 DFLASH_GENERATE_MAX_NEW_TOKENS=256 \\
      DFLASH_EVAL_SETS='sharegpt=sharegpt-first-turn[17000:]'
    dflash-assets build-smollm2 && dflash-assets build-sharegpt     # the model and the rows, into the cache
    python scripts/yardstick.py data
    python scripts/yardstick.py train dflash-decay-16 dflash-dpace-16 dflash2-dpace-16 dflash2-dpace-8 \\
      --steps 480 --batch 16 --anchors 512 --evals 4 --sets held_out,sharegpt --prompts 32 --new-tokens 64
    python scripts/yardstick.py table

Variants run one after another in one process, or one a process: on a 2-core machine, two processes at once,
each on one thread (`--threads 1`) and each leasing a CPU "device" of its own:

    export DFLASH_DEVICES=cpu:0,cpu:1
    python scripts/yardstick.py train dflash2-dpace-16 --threads 1 --steps 96 ... &
    python scripts/yardstick.py train dflash2-dpace-8 --threads 1 --steps 96 ... &
    wait; python scripts/yardstick.py table
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_assets.cli import UsageError
from dflash_assets.storage.layout import REFERENCES_PREFIX

if TYPE_CHECKING:
    from dflash_assets.orchestration.execution.in_process import InProcessRunner
    from dflash_assets.storage.store import ObjectStore

RANGE_ASSETS = ("target_completions", "tokenized_completions", "hidden_state_partitions")
REPO = Path(__file__).resolve().parents[1]
# What `reproduce` runs on where the user has not said otherwise: the kept answers, the recipe's shape.
KEPT_DATA = REPO / "yardstick-data" / "sharegpt-first-turn-0-1000.smollm2-vllm-fp32.jsonl.gz"
REPRODUCE_SETTINGS = {
    "DFLASH_TARGET_MODEL": "smollm2",
    "DFLASH_DATASET": str(KEPT_DATA),
    "DFLASH_COMPLETIONS": "dataset",
    "DFLASH_MAX_LENGTH": "2048",
    "DFLASH_SAMPLES_PER_PARTITION": "1000",
    "DFLASH_TRAIN_UNTIL_FLAT": "1",
    "DFLASH_TRAIN_CPU_BF16": "1",  # ~1.7x the steps a second where the CPU has bf16 units; else ignored
    "DFLASH_EVAL_PROMPTS": "64",
    "DFLASH_EVAL_NEW_TOKENS": "64",
}
# The target's greedy output and prompt lookup's figures on the yardstick's own prompt sets, as
# `drafter_evaluations` stored them (`REFERENCES_PREFIX`, one object an identity), kept here gzipped so that a
# fresh store's first evaluation on the same kind of machine runs only the drafter's loop (about half an
# hour less for `reproduce`'s two sets on 2 cores). The identity names the target, its precision and
# kernels, the prompts and the budget: a kept file never stands in for anything else.
KEPT_REFERENCES = REPO / "yardstick-data" / REFERENCES_PREFIX
REPRODUCE_SET = ("sharegpt_later", "sharegpt-first-turn[16000:]")  # past every training slice (< 15,000)
REPRODUCE_RUN = "default-recipe"
VARIANT_GRAMMAR = "<arch>-<loss>-<block>[-kl<w>] (e.g. dflash2-dpace-16, dflash2-dpace-8-kl0.5)"


# ------------------------------------------------------------------------------------------------ variants


@dataclass(frozen=True)
class Variant:
    """A drafter to train, named as the training run it becomes."""

    name: str
    arch: str
    loss: str
    block_size: int
    distill_weight: float = 0.0

    def train_config(self) -> dict[str, Any]:
        """What the name fixes of `drafter_checkpoints`' run config (`TrainConfig`)."""
        return {
            "run_name": self.name,
            "drafter_arch": self.arch,
            "loss": self.loss,
            "block_size": self.block_size,
            "distill_weight": self.distill_weight,
        }


def parse_variant(name: str) -> Variant:
    """`<arch>-<loss>-<block>[-kl<w>]` as a `Variant`; a name that is not one raises `UsageError` saying
    which part is wrong."""
    from dflash_assets.drafter.config import ARCHITECTURES
    from dflash_assets.drafter.objective import LOSSES

    parts = name.split("-")
    if len(parts) not in (3, 4):
        raise UsageError(f"variant {name!r} is not {VARIANT_GRAMMAR}")
    arch, loss, block, *distill = parts
    if arch not in ARCHITECTURES:
        raise UsageError(f"variant {name!r}: architecture {arch!r} is not one of {', '.join(ARCHITECTURES)}")
    if loss not in LOSSES:
        raise UsageError(f"variant {name!r}: loss {loss!r} is not one of {', '.join(LOSSES)}")
    if not block.isascii() or not block.isdigit() or int(block) < 2:
        raise UsageError(f"variant {name!r}: block {block!r} is not a whole number of 2 or more")
    weight = 0.0
    if distill:
        try:
            weight = float(distill[0].removeprefix("kl")) if distill[0].startswith("kl") else math.nan
        except ValueError:
            weight = math.nan
        if not 0 < weight <= 1:
            raise UsageError(
                f"variant {name!r}: {distill[0]!r} is not kl<w>, the distillation weight w in (0, 1]"
            )
    return Variant(name, arch, loss, int(block), weight)


# ------------------------------------------------------------------------------------------ the product


def print_settings(product: InProcessRunner) -> None:
    """What this run is made of: the user's settings, as the product reads them."""
    from dflash_assets import settings

    shown = (settings.TARGET_MODEL, settings.DATASET, settings.COMPLETIONS, settings.MAX_LENGTH,
             settings.GENERATE_MAX_NEW_TOKENS, settings.EVAL_SETS, settings.DEVICES)  # fmt: skip
    print("settings: " + ", ".join(f"{s.name}={s.get()!r}" for s in shown))
    print(f"store: {product.resources['store'].store_url()}", flush=True)


# ---------------------------------------------------------------------------------------------- commands


def run_data(product: InProcessRunner) -> int:
    """Every range of DFLASH_DATASET through the range assets, registered first; done work is kept."""
    from dflash_assets import settings, terminal
    from dflash_assets.orchestration.execution.in_process import register_ranges

    ranges = register_ranges(product.instance)
    keys = ranges.keys
    print(
        f"{len(keys)} sample ranges cover {settings.DATASET.get()} ({keys[0]} .. {keys[-1]}); "
        f"{len(ranges.new)} new"
    )
    regenerate = settings.completions_source() == "target"
    names = [n for n in RANGE_ASSETS if n in product.names and (n != "target_completions" or regenerate)]
    started = time.monotonic()
    model_dir = product.resources["target_model"].model_dir()  # built on first use (smollm2: the wheel)
    print(f"  the target: {model_dir} ({time.monotonic() - started:.1f} s)", flush=True)
    with terminal.live_progress():  # a status line on a terminal, a line now and then in a log
        for key in keys:
            for name in names:
                if not product.materialise(name, partition=key).success:
                    return 1
    return 0


def evaluation_sets(names: str) -> list[str]:
    """The prompt sets `--sets` names, each a partition of `drafter_evaluations` on these settings."""
    from dflash_assets import settings
    from dflash_assets.evaluation.prompt_sets import parse_eval_sets

    known = [spec.name for spec in parse_eval_sets(settings.EVAL_SETS.get())]
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        raise UsageError(
            f"--sets {names!r}: {', '.join(unknown) or 'no set'} is not a prompt set here "
            f"({', '.join(known)}); name a set in {settings.EVAL_SETS.name} as name=reference"
        )
    return chosen


def train_config(variant: Variant, args: argparse.Namespace) -> dict[str, Any]:
    flags = {"num_anchors": args.anchors, "global_batch_size": args.batch, "lr": args.lr,
             "spec_eval_prompts": args.curve_prompts, "eval_samples": args.held_out,
             "train_samples": getattr(args, "conversations", None)}  # fmt: skip
    return {
        **variant.train_config(),
        "max_steps": args.steps,
        "checkpoint_every_steps": max(1, args.steps // args.evals),
        **{name: value for name, value in flags.items() if value is not None},
    }


def checked_train(args: argparse.Namespace) -> tuple[list[Variant], list[str]]:
    """`train`'s variants and sets, every flag checked before anything loads: a typo is one line."""
    variants = [parse_variant(name) for name in args.variants]
    if args.tag:  # the run is `<variant>-<tag>`: the same variant at another budget, beside the first
        variants = [replace(variant, name=f"{variant.name}-{args.tag}") for variant in variants]
    sets = evaluation_sets(args.sets)
    for flag, value in (("--steps", args.steps), ("--evals", args.evals)):
        if value < 1:
            raise UsageError(f"{flag} {value} must be 1 or more")
    if args.zlab:  # before hours of training, not after
        from dflash_assets.bench.zlab import ZlabMissing, require_zlab

        try:
            require_zlab()
        except ZlabMissing as error:
            raise UsageError(f"--zlab: {error}") from None
    return variants, sets


def run_train(
    product: InProcessRunner, args: argparse.Namespace, variants: list[Variant] | None = None
) -> int:
    """Each variant (`args.variants`, unless given) trained, then measured on each set; one after another."""
    from dflash_assets import terminal
    from dflash_assets.evaluation.runs import run_manifest
    from dflash_assets.orchestration.execution.in_process import materialisation_metadata
    from dflash_assets.storage.layout import CHECKPOINTS_PREFIX
    from dflash_assets.storage.manifest import read_manifest

    named, sets = checked_train(args)
    variants = variants or named
    store = product.resources["store"].check()
    evaluation = {name: value for name, value in (("prompts", args.prompts), ("new_tokens", args.new_tokens))
                  if value is not None}  # fmt: skip
    for variant in variants:
        earlier = read_manifest(store, f"{CHECKPOINTS_PREFIX}/{variant.name}")
        if earlier is not None:
            print(
                f"{variant.name}: in the store already ({earlier.get('steps')} steps): the product continues "
                "it from its last checkpoint; a fresh DFLASH_STORE_URL trains it from the start"
            )
        every = train_config(variant, args)["checkpoint_every_steps"]
        print(f"{variant.name}: {args.steps} steps, a checkpoint and evaluation every {every}", flush=True)
        with terminal.live_progress():
            trained = product.materialise(
                "drafter_checkpoints", config=train_config(variant, args), label="(all ranges)"
            )
        if not trained.success:
            return 1
        print(f"    curve: {curve_text(run_manifest(store, variant.name).get('curve'))}")
        for name in sets:
            config = {"run_name": variant.name, **evaluation}
            if (done := measured_already(store, variant.name, name, evaluation)) is not None:
                print(f"    {evaluation_text(done)} (measured before on this export)", flush=True)
                continue
            seed_references(store)  # kept since this command started, too
            with terminal.live_progress():
                measured = product.materialise("drafter_evaluations", partition=name, config=config)
            if not measured.success:
                return 1
            metadata = materialisation_metadata(measured, "drafter_evaluations")
            print(f"    {evaluation_text(metadata)}", flush=True)
        if args.zlab:
            for name in sets:
                zlab_cross_check(product, variant.name, name)
    print(f"the table: python scripts/yardstick.py table {' '.join(v.name for v in variants)}")
    return 0


def seed_references(store: ObjectStore, directory: Path = KEPT_REFERENCES) -> int:
    """Every kept reference (`<identity>.json.gz` in `directory`) the store lacks, put in it; how many. A
    kept file that does not read is named and left out (the evaluation then decodes that set again)."""
    import gzip

    from dflash_assets.evaluation.runs import read_reference, write_reference

    seeded = 0
    for path in sorted(directory.glob("*.json.gz")):
        identity = path.name.removesuffix(".json.gz")
        if read_reference(store, identity) is not None:
            continue
        try:
            reference = json.loads(gzip.decompress(path.read_bytes()))
        except (OSError, EOFError, ValueError) as error:
            print(f"kept reference {path} does not read ({error}): that set's greedy output is decoded again")
            continue
        if not isinstance(reference, dict) or not isinstance(reference.get("greedy"), list):
            print(f"kept reference {path} holds no greedy output: that set's greedy output is decoded again")
            continue
        write_reference(store, identity, reference)
        seeded += 1
    if seeded:
        print(
            f"{seeded} kept evaluation reference(s) from {directory} put in the store: the target's greedy "
            "output and prompt lookup's figures on prompts decoded before, by the same target and kernels"
        )
    return seeded


def keep_references(store: ObjectStore, directory: Path = KEPT_REFERENCES) -> int:
    """Every reference in the store that `directory` lacks, written there gzipped (to be committed); how
    many."""
    import gzip

    directory.mkdir(parents=True, exist_ok=True)
    kept = 0
    for info in store.list(f"{REFERENCES_PREFIX}/"):
        name = info.key.rsplit("/", 1)[-1]
        if not name.endswith(".json") or (target := directory / f"{name}.gz").exists():
            continue
        reference = json.loads(bytes(store.get_bytes(info.key)))
        target.write_bytes(gzip.compress(json.dumps(reference, sort_keys=True).encode(), mtime=0))
        print(f"kept {target} ({len(reference['greedy'])} prompts)")
        kept += 1
    print(f"{kept} reference(s) kept in {directory}" if kept else f"every stored reference is in {directory}")
    return kept


def reproduce_settings(environ: dict[str, str]) -> dict[str, str]:
    """The settings `reproduce` adds to `environ`: its defaults where the user set nothing, and its later
    ShareGPT set beside the user's own DFLASH_EVAL_SETS."""
    added = {name: value for name, value in REPRODUCE_SETTINGS.items() if not environ.get(name)}
    name, reference = REPRODUCE_SET
    sets = [part for part in environ.get("DFLASH_EVAL_SETS", "").split(",") if part.strip()]
    if not any(part.split("=", 1)[0].strip() == name for part in sets):
        added["DFLASH_EVAL_SETS"] = ",".join([*sets, f"{name}={reference}"])
    return added


def reproduce_variant(conversations: int | None = None) -> Variant:
    """The product's default drafter on the current settings, as the run `default-recipe`, `-N` for the
    first N conversations (another data size of the same capture: the same held-out rows) and `-wsd` (the
    schedule's name) under a learning-rate schedule other than the default: each its own run."""
    from dflash_assets import settings

    arch = settings.DRAFTER_ARCH.get()
    name = REPRODUCE_RUN + (f"-{conversations}" if conversations else "")
    if (schedule := settings.LR_SCHEDULE.get()) != settings.LR_SCHEDULE.default:
        name += f"-{schedule}"
    return Variant(
        name,
        arch,
        settings.DRAFTER_LOSS.get(),
        settings.block_size_for(arch),
        settings.DISTILL_WEIGHT.get_float(),
    )


def run_reproduce(args: argparse.Namespace) -> int:
    """Data, training until flat and every set's evaluation of the default recipe; then the table."""
    import os

    from dflash_assets import settings
    from dflash_assets.conversations import sharegpt
    from dflash_assets.evaluation.prompt_sets import parse_eval_sets
    from dflash_assets.orchestration.execution.in_process import InProcessRunner

    if args.conversations is not None and args.conversations < 1:
        raise UsageError(f"--conversations {args.conversations} must be 1 or more")
    if not KEPT_DATA.exists():
        raise UsageError(f"the kept data {KEPT_DATA} is not in this checkout: reproduce reads it")
    added = reproduce_settings(dict(os.environ))
    os.environ.update(added)
    print("reproduce sets: " + (", ".join(f"{k}={v!r}" for k, v in added.items()) or "nothing (all yours)"))
    if "sharegpt" in settings.EVAL_SETS.get() + settings.DATASET.get():  # built into the cache once
        sharegpt.install_wheel()
        sharegpt.built_rows(settings.cache_dir(), log=lambda line: None)
    product = InProcessRunner()
    print_settings(product)
    if run_data(product):
        return 1
    variant = reproduce_variant(args.conversations)
    kl = f"-kl{variant.distill_weight:g}" if variant.distill_weight else ""
    args.variants, args.tag = [f"{variant.arch}-{variant.loss}-{variant.block_size}{kl}"], ""
    args.sets = ",".join(spec.name for spec in parse_eval_sets(settings.EVAL_SETS.get()))
    print(
        f"the default recipe: {variant.arch}, {variant.loss}, block {variant.block_size}, distillation "
        f"weight {variant.distill_weight:g}; until the held-out curve is flat, at most {args.steps} steps"
    )
    if run_train(product, args, variants=[variant]):
        return 1
    return run_table([variant.name])


def measured_already(
    store: ObjectStore, run: str, set_name: str, asked: dict[str, int]
) -> dict[str, Any] | None:
    """The committed evaluation of `run` on `set_name` where it measured the run's current export at the
    prompts and tokens asked (unset: the settings'), as `evaluation_text` reads it; else None. A rerun of
    `reproduce` or `train` then measures only what is missing."""
    from dflash_assets import settings
    from dflash_assets.evaluation.runs import export_identity, read_evaluation

    record = read_evaluation(store, run, set_name)
    if record is None or record.get("export_identity") != export_identity(store, run):
        return None
    prompts = asked.get("prompts") or settings.EVAL_PROMPTS.get_int()
    new_tokens = asked.get("new_tokens") or settings.EVAL_NEW_TOKENS.get_int()
    if record.get("max_new_tokens") != new_tokens or record.get("prompts") != prompts:
        return None
    return {**record, "ratio_to_floor": record["ratio"]}


def evaluation_text(metadata: dict[str, Any]) -> str:
    return (
        f"{metadata['prompt_set']}: τ {metadata['tau']:.3f}, prompt lookup {metadata['floor_tau']:.3f} "
        f"({metadata['ratio_to_floor']:.2f}x); {metadata['lossless_prompts']}/{metadata['prompts']} outputs "
        "equal the target's own"
    )


def curve_text(curve: list[dict[str, Any]] | None) -> str:
    """A run's curve from its manifest: `steps 0 / 2 / 4: τ 1.000 / 1.250 / 1.312; teacher-forced τ ...`."""
    if not curve:
        return "none recorded (a run trained before drafter_checkpoints recorded its curve)"

    def figures(name: str, digits: int) -> str:
        return " / ".join("—" if p.get(name) is None else f"{p[name]:.{digits}f}" for p in curve)

    steps = " / ".join(str(point["step"]) for point in curve)
    return f"steps {steps}: τ {figures('tau', 3)}; teacher-forced τ {figures('teacher_forced_tau', 2)}"


def run_table(runs: list[str]) -> int:
    """`dflash-assets compare --markdown`, then each run's curve from its manifest."""
    from dflash_assets.cli import main as dflash_assets
    from dflash_assets.evaluation.compare import stored_evaluations
    from dflash_assets.evaluation.runs import run_manifest
    from dflash_assets.orchestration.resources import StoreResource

    code = dflash_assets(["compare", "--markdown", *runs])
    if code:
        return code
    store = StoreResource().check()
    print("\nCurves (the trainer's held-out evaluation at each checkpoint; step 0: the fresh weights):\n")
    for run in runs or list(dict.fromkeys(record["run"] for record in stored_evaluations(store))):
        print(f"- {run}: {curve_text(run_manifest(store, run).get('curve'))}")
    return 0


def zlab_cross_check(product: InProcessRunner, run: str, set_name: str = "held_out") -> None:
    """z-lab's `dflash_generate` on the export, on one set's evaluation's own prompts and token count,
    each output checked against the target's greedy one: printed beside the product's figures."""
    from dflash_assets import settings
    from dflash_assets.bench.zlab import load_zlab_drafter, zlab_generate
    from dflash_assets.drafter.speculative import TargetVerifier, greedy_decode, stop_token_ids_of
    from dflash_assets.evaluation.loaders import load_prompt_set
    from dflash_assets.evaluation.measure import reference_identity, reference_precision
    from dflash_assets.evaluation.runs import download_export, read_evaluation, read_reference, run_manifest
    from dflash_assets.target.model import load_target_model
    from dflash_assets.target.threads import decoding_threads

    store, target = product.resources["store"].check(), product.resources["target_model"]
    cache = product.resources["store"].read_cache_dir()
    record = read_evaluation(store, run, set_name)
    if record is None:
        raise RuntimeError(f"{run}: no {set_name} evaluation is committed in {store.url} to cross-check")
    manifest, new_tokens = run_manifest(store, run), record["max_new_tokens"]
    prompts = load_prompt_set(
        set_name, settings.EVAL_SETS.get(), object_store=store, run_manifest=manifest,
        target_dir=target.model_dir(), count=record["prompts"], new_tokens=new_tokens, cache_dir=cache,
    ).prompts  # fmt: skip
    if [prompt.location for prompt in prompts] != record["prompt_locations"]:
        raise RuntimeError(f"{run}: the {set_name} prompts are not the ones its evaluation measured")
    export = download_export(store, run, cache / "exports" / run)
    stops = stop_token_ids_of(str(target.model_dir()))
    lengths, lossless = [], 0
    with product.resources["devices"].lease(holder=f"yardstick z-lab {run}") as device:
        model = load_target_model(target.model_dir(), device)
        drafter, _ = load_zlab_drafter(export, device=device, dtype=next(model.parameters()).dtype)
        verifier = TargetVerifier(model, manifest["target_layer_ids"])
        # The target's greedy output as the evaluation stored it (`evaluation-references/`), else decoded.
        identity = reference_identity(
            target.name, reference_precision(device), prompts, max_new_tokens=new_tokens, stop_token_ids=stops
        )
        stored = (read_reference(store, identity) or {}).get("greedy")
        with decoding_threads(model):
            for index, prompt in enumerate(prompts):
                greedy = (
                    stored[index]
                    if stored and len(stored) == len(prompts)
                    else greedy_decode(verifier, prompt.token_ids, new_tokens, stops)
                )
                tokens, rounds = zlab_generate(drafter, model, prompt.token_ids, new_tokens, sorted(stops))
                lossless += tokens == greedy
                lengths += rounds
    tau = sum(lengths) / len(lengths)
    print(
        f"    {set_name} by z-lab's dflash_generate: τ {tau:.3f} (the product's loop {record['tau']:.3f}); "
        f"{tau / record['floor_tau']:.2f}x the prompt-lookup floor's {record['floor_tau']:.3f}; "
        f"{lossless}/{len(prompts)} outputs equal the target's own (the product's "
        f"{record['lossless_prompts']}/{record['prompts']})",
        flush=True,
    )


# A row's `path`: the target's own answers (regenerated, the default) or the dataset's, trained toward the
# target's distribution where the row's objective says so.
DATASET_ANSWERS = "dataset answers"
ROWS_FILE = REPO / "yardstick-data" / "tau-against-data.json"
PLOT_FILE = REPO / "docs" / "images" / "tau-against-data.svg"


def plot_svg(rows: list[dict[str, Any]], bar: float = 1.3) -> str:
    """τ and the prompt-lookup floor against training conversations (log scale), one colour a prompt set
    (held-out rows, a later slice): filled dots τ, rings the floor of the same prompts, a dash `bar` times
    that floor. A plain SVG, no plotting library."""
    width, height, left, right, top, bottom = 640, 400, 60, 190, 20, 50
    xs = [math.log10(row["conversations"]) for row in rows]
    x_low, x_high = math.floor(min(xs) * 2) / 2, math.ceil(max(xs) * 2) / 2 + 0.5
    values = [v for row in rows for v in (row["tau"], row["floor"], bar * row["floor"])]
    y_low, y_high = math.floor(min(values) * 10) / 10, math.ceil(max(values) * 10) / 10

    def x_at(conversations: float) -> float:
        return left + (math.log10(conversations) - x_low) / (x_high - x_low) * (width - left - right)

    def y_at(value: float) -> float:
        return top + (y_high - value) / (y_high - y_low) * (height - top - bottom)

    colours = {}
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for exponent in range(math.ceil(x_low), math.floor(x_high) + 1):
        for factor in (1, 2, 5):
            value = factor * 10**exponent
            if x_low <= math.log10(value) <= x_high:
                x = x_at(value)
                parts.append(
                    f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{height - bottom}" stroke="#ddd"/>'
                )
                parts.append(
                    f'<text x="{x:.1f}" y="{height - bottom + 16}" text-anchor="middle">{value:,}</text>'
                )
    tick = y_low
    while tick <= y_high + 1e-9:
        y = y_at(tick)
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - right}" y2="{y:.1f}" stroke="#eee"/>')
        parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{tick:.1f}</text>')
        tick = round(tick + 0.1, 6)
    parts.append(
        f'<text x="{(left + width - right) / 2:.0f}" y="{height - 12}" text-anchor="middle">training '
        "conversations (log scale)</text>"
    )
    parts.append(
        f'<text transform="translate(16 {(top + height - bottom) / 2:.0f}) rotate(-90)" '
        'text-anchor="middle">τ (tokens a verification round)</text>'
    )
    for row in rows:
        colour = colours.setdefault(row["set"], palette[len(colours) % len(palette)])
        x = x_at(row["conversations"])
        parts.append(
            f'<line x1="{x - 9:.1f}" x2="{x + 9:.1f}" y1="{y_at(bar * row["floor"]):.1f}" '
            f'y2="{y_at(bar * row["floor"]):.1f}" stroke="{colour}" stroke-dasharray="3 2"/>'
        )
        parts.append(
            f'<circle cx="{x:.1f}" cy="{y_at(row["floor"]):.1f}" r="5" fill="none" stroke="{colour}"/>'
        )
        title = (
            f"<title>{row['run']}: {row['set']}, {row['prompts']} prompts, τ {row['tau']:.3f}, "
            f"floor {row['floor']:.3f}</title>"
        )
        radius, y = 3 + row["prompts"] / 32, y_at(row["tau"])
        if row.get("path") == DATASET_ANSWERS:  # a square: trained on the dataset's own answers
            parts.append(
                f'<rect x="{x - radius:.1f}" y="{y - radius:.1f}" width="{2 * radius:.1f}" '
                f'height="{2 * radius:.1f}" fill="{colour}">{title}</rect>'
            )
        else:
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{radius:.1f}" fill="{colour}">{title}</circle>'
            )
    legend_x, legend_y = width - right + 14, top + 10
    for index, (name, colour) in enumerate(colours.items()):
        y = legend_y + 18 * index
        parts.append(f'<circle cx="{legend_x}" cy="{y}" r="4" fill="{colour}"/>')
        parts.append(f'<text x="{legend_x + 10}" y="{y + 4}">{name}</text>')
    y = legend_y + 18 * len(colours) + 10
    parts += [
        f'<circle cx="{legend_x}" cy="{y}" r="4" fill="#555"/>'
        f'<text x="{legend_x + 10}" y="{y + 4}">τ, regenerated (size: prompts)</text>',
        f'<circle cx="{legend_x}" cy="{y + 18}" r="5" fill="none" stroke="#555"/>'
        f'<text x="{legend_x + 10}" y="{y + 22}">prompt lookup</text>',
        f'<line x1="{legend_x - 6}" x2="{legend_x + 6}" y1="{y + 36}" y2="{y + 36}" stroke="#555" '
        f'stroke-dasharray="3 2"/><text x="{legend_x + 10}" y="{y + 40}">{bar}x prompt lookup</text>',
    ]
    if any(row.get("path") == DATASET_ANSWERS for row in rows):
        parts.append(
            f'<rect x="{legend_x - 4}" y="{y + 50}" width="8" height="8" fill="#555"/>'
            f'<text x="{legend_x + 10}" y="{y + 58}">τ, the dataset\'s answers</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def run_plot() -> int:
    """docs/images/tau-against-data.svg from yardstick-data/tau-against-data.json."""
    rows = json.loads(ROWS_FILE.read_text())["rows"]
    PLOT_FILE.parent.mkdir(parents=True, exist_ok=True)
    PLOT_FILE.write_text(plot_svg(rows))
    print(f"{PLOT_FILE}: {len(rows)} measured rows from {ROWS_FILE.name}")
    return 0


# ------------------------------------------------------------------------------------------------- main


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="yardstick.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser(
        "data", help="every range of DFLASH_DATASET: regenerated (target), tokenized, captured"
    )
    train = commands.add_parser("train", help="train each variant, then measure it on each prompt set")
    train.add_argument("variants", nargs="+", metavar="VARIANT", help=VARIANT_GRAMMAR)
    train.add_argument("--steps", type=int, required=True, help="optimiser steps each (run config max_steps)")
    train.add_argument("--evals", type=int, default=4, help="checkpoints, each evaluated: the curve's points")
    train.add_argument("--anchors", type=int, default=None, help="anchors a sequence (num_anchors)")
    train.add_argument("--batch", type=int, default=None, help="sequences a step (global_batch_size)")
    train.add_argument("--lr", type=float, default=None, help="peak learning rate (lr)")
    train.add_argument(
        "--curve-prompts", type=int, default=None,
        help="held-out prompts the trainer decodes at each checkpoint (spec_eval_prompts; the recipe's 8)",
    )  # fmt: skip
    train.add_argument(
        "--held-out", type=int, default=None,
        help="conversations held out of training, the held_out set's prompts (eval_samples; the recipe's 16)",
    )  # fmt: skip
    train.add_argument("--sets", default="held_out", help="prompt sets to measure, comma-separated")
    train.add_argument("--tag", default="", help="run names <variant>-<tag> (the same variant twice)")
    train.add_argument("--prompts", type=int, default=None, help="prompts a set (DFLASH_EVAL_PROMPTS)")
    train.add_argument(
        "--new-tokens", type=int, default=None, help="tokens a prompt (DFLASH_EVAL_NEW_TOKENS)"
    )
    train.add_argument(
        "--zlab", action="store_true", help="also decode each set with z-lab's dflash_generate"
    )
    reproduce = commands.add_parser(
        "reproduce", help="the default recipe's row from the kept data: capture, train until flat, measure"
    )
    reproduce.add_argument("--steps", type=int, default=1200, help="the cap on optimiser steps (max_steps)")
    reproduce.add_argument("--evals", type=int, default=8, help="checkpoints, each evaluated: the curve")
    reproduce.add_argument("--anchors", type=int, default=64, help="anchors a sequence (num_anchors)")
    reproduce.add_argument("--batch", type=int, default=4, help="sequences a step (global_batch_size)")
    reproduce.add_argument("--lr", type=float, default=None, help="peak learning rate (the recipe's)")
    reproduce.add_argument(
        "--curve-prompts",
        type=int,
        default=16,
        help="held-out prompts the trainer decodes at each checkpoint",
    )
    reproduce.add_argument("--held-out", type=int, default=64, help="conversations held out of training")
    reproduce.add_argument(
        "--conversations",
        type=int,
        default=None,
        help="train on the first N conversations not held out (run default-recipe-N): a data size",
    )
    reproduce.add_argument(
        "--prompts", type=int, default=None, help="prompts a set (DFLASH_EVAL_PROMPTS: 64)"
    )
    reproduce.add_argument("--new-tokens", type=int, default=None, help="tokens a prompt (64)")
    reproduce.add_argument(
        "--zlab",
        action="store_true",
        help="also decode every set with z-lab's dflash_generate (a rerun adds it to a finished run)",
    )
    commands.add_parser(
        "keep-references",
        help="the store's evaluation references (greedy output, floor) into yardstick-data, to be committed",
    )
    commands.add_parser("plot", help="docs/images/tau-against-data.svg from yardstick-data's measured rows")
    table = commands.add_parser("table", help="dflash-assets compare --markdown, and each run's curve")
    table.add_argument("runs", nargs="*", metavar="RUN", help="training runs (default: every run evaluated)")
    for command in (commands.choices["data"], train, reproduce):
        command.add_argument(
            "--threads", type=int, default=None, help="torch intra-op threads (default: all)"
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    from dflash_assets.orchestration.user_errors import check_settings, user_error_message

    args = parser().parse_args(argv)
    try:
        check_settings()  # every DFLASH_* value, before any work
        if args.command == "table":
            return run_table(args.runs)
        if args.command == "plot":
            return run_plot()
        if args.command == "keep-references":
            from dflash_assets.orchestration.execution.in_process import InProcessRunner

            keep_references(InProcessRunner().resources["store"].check())
            return 0
        if args.command == "train":
            checked_train(args)
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        if args.command == "reproduce":
            return run_reproduce(args)
        from dflash_assets.orchestration.execution.in_process import InProcessRunner

        product = InProcessRunner()
        print_settings(product)
        return run_data(product) if args.command == "data" else run_train(product, args)
    except Exception as error:
        message = str(error) if isinstance(error, UsageError) else user_error_message(error)
        if message is None:
            raise
        print(f"yardstick {args.command}: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
