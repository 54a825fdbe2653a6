"""Drafters trained side by side on the configured target's stored hidden states, at equal steps, data, seed
and held-out prompts, each measured by two decoding loops: the trainer's own (greedy speculative decoding
with the target, `drafter/speculative.py`) and z-lab's `dflash_generate` from the `dflash` package on the
export; beside them, on the same prompts, a training-free prompt-lookup drafter (the floor a trained one
must clear). Every decoding is checked against the target's own greedy output.

    DFLASH_TARGET_MODEL=smollm2 dflash-assets demo     # the real model's own answers, captured
    DFLASH_TARGET_MODEL=smollm2 python scripts/drafter_side_by_side.py --steps 960 --out side.json

A variant is `<arch>-<loss>-<block>` (`dflash2-dpace-8`), with `-kl<w>` for distillation from the target's
distribution at weight w (`dflash2-dpace-16-kl0.5`: objects captured with the final state); `--variants`
lists them. Each trains through the
product's trainer (`DrafterTrainer`, offline from the store) and is evaluated `--evals` times along the way
(the curve: τ against steps), then exported and decoded by z-lab's loop. z-lab's package is a test
dependency (`scripts/setup.sh` installs it); `dflash_assets_tests/support/zlab.py` says what it is given to
run on a CPU with transformers 5.25.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_assets import settings  # noqa: E402
from dflash_assets.drafter.export import export_drafter  # noqa: E402
from dflash_assets.drafter.model import drafter_parameter_count  # noqa: E402
from dflash_assets.drafter.speculative import (  # noqa: E402
    PromptLookup,
    SpeculativeEvaluator,
    TargetVerifier,
    stop_token_ids_of,
)
from dflash_assets.orchestration.resources import TargetModelResource  # noqa: E402
from dflash_assets.orchestration.training import TrainConfig, configured_drafter  # noqa: E402
from dflash_assets.storage.open_store import open_store  # noqa: E402
from dflash_assets.target.model import load_target_model  # noqa: E402
from dflash_assets.training.job import TrainingJob, offline_data  # noqa: E402
from dflash_assets.training.settings import TrainSettings  # noqa: E402
from dflash_assets.training.train import DrafterTrainer  # noqa: E402
from dflash_assets_tests.support.zlab import load_zlab_drafter, zlab_generate  # noqa: E402

DEFAULT_VARIANTS = "dflash-decay-16,dflash-dpace-16,dflash2-dpace-16,dflash2-dpace-8"


def parse_variant(name: str) -> tuple[str, str, int, float]:
    arch, loss, block, *rest = name.split("-")
    distill = float(rest[0].removeprefix("kl")) if rest else 0.0
    return arch, loss, int(block), distill


def committed_prefixes(store) -> list[str]:
    prefixes = sorted(
        {
            info.key.rsplit("/", 1)[0]
            for info in store.list("hidden-states/")
            if info.key.endswith("/_manifest.json")
        }
    )
    if not prefixes:
        raise SystemExit(f"no committed hidden-state ranges in {settings.store_url()}: run the demo first")
    return prefixes


def offline_drafter_data(name: str, arch: str, block: int, cache_dir: Path):
    """(the configured target's drafter of `arch` and `block`, every committed hidden-state range of the
    configured store as offline training reads it through a node cache at `cache_dir`)."""
    target = TargetModelResource()
    config = configured_drafter(target, TrainConfig(drafter_arch=arch, block_size=block))
    config.extra["target_model_name"] = target.name  # what the hidden-state objects record
    store = open_store(settings.store_url())
    job = TrainingJob(
        run=name, mode="offline", store_url=settings.store_url(),
        hidden_state_partitions=committed_prefixes(store), tokenized_partitions=[],
        drafter_config=config.to_json(), target_model_name=target.name, settings={},
    )  # fmt: skip
    return config, offline_data(job, store, cache_dir, 1)


def zlab_decode(zlab, model, evaluator: SpeculativeEvaluator, new_tokens: int) -> tuple[list[list[int]], int]:
    """z-lab's `dflash_generate` on each of the evaluator's prompts, whose greedy outputs it has decoded:
    (each prompt's acceptance lengths, how many prompts decoded exactly the target's greedy output)."""
    lengths, same = [], 0
    for prompt, greedy in zip(evaluator.prompts, evaluator._greedy, strict=True):
        tokens, rounds = zlab_generate(zlab, model, prompt, new_tokens, sorted(evaluator.stop_token_ids))
        same += tokens == greedy
        lengths.append(rounds)
    return lengths, same


def train_variant(name: str, args: argparse.Namespace, work: Path) -> tuple[dict, DrafterTrainer]:
    arch, loss, block, distill = parse_variant(name)
    every = max(1, args.steps // args.evals)
    train = TrainSettings(
        mode="offline", max_steps=args.steps, global_batch_size=args.batch, loss=loss, block_size=block,
        num_anchors=args.anchors, lr=args.lr, seed=args.seed, eval_samples=args.prompts,
        distill_weight=distill, spec_eval_prompts=args.prompts, spec_eval_max_new_tokens=args.new_tokens,
        checkpoint_every_steps=every, checkpoint_every_minutes=None, log_every_steps=max(1, every // 2),
    )  # fmt: skip
    config, data = offline_drafter_data(name, arch, block, work / "cache")
    torch.manual_seed(args.seed)
    started = time.monotonic()
    trainer = DrafterTrainer(
        config, train, data, store=open_store(str(work / "store")), run=name, work_dir=work / name,
        log=lambda line: print(f"  [{name}] {line}", flush=True),
    )  # fmt: skip
    evaluation = trainer.evaluator
    if args.curve_prompts:  # the curve on the first few held-out prompts; the end on every one (z-lab)
        every_prompt = type(evaluation)._my_prompts
        evaluation._my_prompts = lambda: every_prompt(evaluation)[: args.curve_prompts]
    result = trainer.train()
    seconds = time.monotonic() - started
    model = load_target_model(config.target_model, "cpu")
    # The held-out prompts the trainer chose, every one, with the target's greedy output of each.
    evaluator = SpeculativeEvaluator(
        TargetVerifier(model, config.target_layer_ids), evaluation._prompts[: args.prompts],
        max_new_tokens=args.new_tokens, stop_token_ids=stop_token_ids_of(config.target_model),
    )  # fmt: skip
    evaluator.evaluate(PromptLookup(block_size=block))  # decodes the greedy outputs once
    if (
        args.out
    ):  # the held-out prompts, for an engine to decode the same ones (scripts/vllm_cpu.sh --prompts)
        prompts_file = args.out.with_suffix(".prompts.jsonl")
        prompts_file.write_text(
            "".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in evaluator.prompts)
        )
    export = (args.exports / name) if args.exports else work / name / "export"
    export_drafter(result.model, export)
    zlab, info = load_zlab_drafter(export)
    per_prompt, same = zlab_decode(zlab, model, evaluator, args.new_tokens)
    lengths, lossless = [n for rounds in per_prompt for n in rounds], same == len(per_prompt)
    speculative, baseline = result.speculative or {}, (result.baseline or {}).get("speculative") or {}
    row = {
        "variant": name,
        "arch": arch,
        "loss": loss,
        "block_size": block,
        "distill_weight": distill,
        "steps": result.steps,
        "train_seconds": seconds,
        "evaluation_seconds": result.evaluation_seconds,
        "parameters": drafter_parameter_count(config),
        "tau_trainer": speculative.get("acceptance_length_tau"),
        "tau_trainer_fresh": baseline.get("acceptance_length_tau"),
        "trainer_prompts": speculative.get("prompts"),
        "trainer_matches_greedy": speculative.get("matches_target_greedy"),
        "tau_zlab": sum(lengths) / len(lengths) if lengths else None,
        "zlab_matches_greedy": lossless,
        "zlab_loading": {key: sorted(keys) for key, keys in info.items() if keys},
        "teacher_forced_tau": result.teacher_forced_tau,
        "curve": result.evaluations,
        "prompts": len(evaluator.prompts),
        "tokens_per_s": result.tokens_per_second,
    }
    return row, evaluator


def prompt_lookup_row(evaluator: SpeculativeEvaluator, block: int) -> dict:
    """The training-free floor on the same held-out prompts, decoded by the trainer's loop."""
    result = evaluator.evaluate(PromptLookup(block_size=block))
    return {
        "variant": f"prompt-lookup-{block}",
        "block_size": block,
        "tau": result["acceptance_length_tau"],
        "matches_target_greedy": result["matches_target_greedy"],
        "prompts": result["prompts"],
    }


def table(rows: list[dict], floors: list[dict]) -> str:
    first = next((row for row in rows if row["tau_zlab"]), None)
    lines = [
        "| drafter | objective | block | τ, z-lab `dflash_generate` | τ, trainer | × first row (z-lab) "
        "| lossless (z-lab / trainer) | τ fresh | τ teacher-forced | parameters | train s (no evaluations) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        training = row["train_seconds"] - (row["evaluation_seconds"] or 0)
        ratio = f"{row['tau_zlab'] / first['tau_zlab']:.2f}" if first and row["tau_zlab"] else "n/a"
        objective = row["loss"] + (f" + KL {row['distill_weight']:g}" if row.get("distill_weight") else "")
        lines.append(
            f"| {row['arch']} | {objective} | {row['block_size']} | {row['tau_zlab']:.3f} | "
            f"{row['tau_trainer']:.3f} ({row.get('trainer_prompts') or row['prompts']} prompts) | {ratio} | "
            f"{row['zlab_matches_greedy']} / {row['trainer_matches_greedy']} | "
            f"{row['tau_trainer_fresh']:.3f} | {row['teacher_forced_tau']:.2f} | "
            f"{row['parameters'] / 1e6:.1f} M | {training:.0f} |"
        )
    for floor in floors:
        lines.append(
            f"| prompt lookup (no training) | — | {floor['block_size']} | — | {floor['tau']:.3f} | — | "
            f"— / {floor['matches_target_greedy']} | — | — | 0 | 0 |"
        )
    lines += ["", "Curves (τ measured by the trainer at each evaluation, by step):"]
    for row in rows:
        points = ", ".join(f"{p['step']}: {p['tau']:.2f}" for p in row["curve"] if p["tau"] is not None)
        lines.append(f"- {row['variant']}: {points}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="<arch>-<loss>-<block>, comma-separated")
    parser.add_argument("--steps", type=int, default=240, help="optimiser steps each")
    parser.add_argument("--batch", type=int, default=4, help="sequences a step")
    parser.add_argument("--anchors", type=int, default=64, help="anchors a sequence")
    parser.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evals", type=int, default=4, help="evaluations along the way (the curve)")
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts (and samples)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per prompt")
    parser.add_argument(
        "--curve-prompts", type=int, default=None,
        help="the trainer's evaluations along the way decode only the first N prompts (the end: all)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all)")
    parser.add_argument("--exports", type=Path, default=None, help="keep each export in DIR/<variant>")
    parser.add_argument(
        "--table", type=Path, nargs="+", default=None, help="print one table of these --out files and stop"
    )
    args = parser.parse_args()
    if args.table:  # variants run as separate processes (one a core), shown side by side
        records = [json.loads(path.read_text()) for path in args.table]
        floors = {floor["block_size"]: floor for record in records for floor in record["prompt_lookup"]}
        print(
            table([row for record in records for row in record["rows"]], [floors[b] for b in sorted(floors)])
        )
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict] = []
    floors: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as scratch:
        for name in filter(None, args.variants.split(",")):
            print(f"training {name}: {args.steps} steps", flush=True)
            row, evaluator = train_variant(name, args, Path(scratch) / name)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if row["block_size"] not in {floor["block_size"] for floor in floors}:
                floors.append(prompt_lookup_row(evaluator, row["block_size"]))
                print(json.dumps(floors[-1]), flush=True)
            if args.out:  # after each variant: a long run interrupted keeps what it measured
                record = {
                    "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "rows": rows,
                    "prompt_lookup": floors,
                }
                args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(rows, floors))


if __name__ == "__main__":
    main()
