"""DFlash + decay, DFlash + D-PACE and DFlash2 + D-PACE trained side by side on the demo's data, at equal
steps, data, seed and held-out prompts, each measured by two decoding loops: the trainer's own (greedy
speculative decoding with the target, `drafter/speculative.py`) and z-lab's `dflash_generate` from the
`dflash` package on the export. Every decoding is checked against the target's own greedy output.

    bash scripts/up.sh --no-ui        # or `dflash-assets demo`: the demo's ranges in $DFLASH_HOME/store
    python scripts/drafter_side_by_side.py [--steps 240] [--prompts 32] [--new-tokens 40] [--out FILE]

It trains through the product's trainer (`DrafterTrainer`, offline from the stored hidden states, the
demo's 4 sequences a step), so the figures are those of the recipe a user runs. z-lab's package is a test
dependency (`scripts/setup.sh` installs it); `dflash_assets_tests/support/zlab.py` says what it is given
to run on a CPU with transformers 5.25.
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
from dflash_assets.drafter.config import DrafterConfig  # noqa: E402
from dflash_assets.drafter.export import export_drafter  # noqa: E402
from dflash_assets.storage.open_store import open_store  # noqa: E402
from dflash_assets.target.model import load_target_model  # noqa: E402
from dflash_assets.training.job import TrainingJob, offline_data  # noqa: E402
from dflash_assets.training.settings import TrainSettings  # noqa: E402
from dflash_assets.training.train import DrafterTrainer  # noqa: E402
from dflash_assets_tests.support.zlab import load_zlab_drafter, zlab_generate  # noqa: E402

VARIANTS = (("dflash", "decay"), ("dflash", "dpace"), ("dflash2", "dpace"))


def train_variant(arch: str, loss: str, args: argparse.Namespace, work: Path) -> dict:
    from dflash_assets.orchestration.resources import TargetModelResource

    target = TargetModelResource()
    config = DrafterConfig.from_target(
        target.model_dir(), num_layers=target.draft_layers(), target_layer_ids=target.layer_ids(), arch=arch
    )
    config.extra["target_model_name"] = target.name  # what the hidden-state objects record
    store = open_store(settings.store_url())
    prefixes = sorted(
        {
            info.key.rsplit("/", 1)[0]
            for info in store.list("hidden-states/")
            if info.key.endswith("/_manifest.json")
        }
    )
    if not prefixes:
        raise SystemExit(f"no committed hidden-state ranges in {settings.store_url()}: run the demo first")
    train = TrainSettings(
        mode="offline", max_steps=args.steps, global_batch_size=4, loss=loss, eval_samples=args.prompts,
        spec_eval_prompts=args.prompts, spec_eval_max_new_tokens=args.new_tokens, checkpoint_every_steps=None,
        checkpoint_every_minutes=None, log_every_steps=max(1, args.steps // 4),
    )  # fmt: skip
    job = TrainingJob(
        run=f"{arch}-{loss}", mode="offline", store_url=settings.store_url(),
        hidden_state_partitions=prefixes, tokenized_partitions=[], drafter_config=config.to_json(),
        target_model_name=target.name, settings={},
    )  # fmt: skip
    data = offline_data(job, store, work / "cache", 1)
    started = time.monotonic()
    trainer = DrafterTrainer(
        config, train, data, store=open_store(str(work / "store")), run=job.run, work_dir=work / job.run,
        log=lambda line: print(f"  [{job.run}] {line}", flush=True),
    )  # fmt: skip
    result = trainer.train()
    seconds = time.monotonic() - started
    evaluator = trainer.evaluator._speculative  # the prompts and greedy outputs the trainer measured
    export_drafter(result.model, work / job.run / "export")
    zlab, info = load_zlab_drafter(work / job.run / "export")
    model = load_target_model(config.target_model, "cpu")
    lengths, lossless = [], True
    for prompt, greedy in zip(evaluator.prompts, evaluator._greedy, strict=True):
        tokens, rounds = zlab_generate(zlab, model, prompt, args.new_tokens, sorted(evaluator.stop_token_ids))
        lossless &= tokens == greedy
        lengths += rounds
    speculative, baseline = result.speculative or {}, (result.baseline or {}).get("speculative") or {}
    return {
        "arch": arch,
        "loss": loss,
        "steps": result.steps,
        "train_seconds": seconds,
        "tau_trainer": speculative.get("acceptance_length_tau"),
        "tau_trainer_fresh": baseline.get("acceptance_length_tau"),
        "trainer_matches_greedy": speculative.get("matches_target_greedy"),
        "tau_zlab": sum(lengths) / len(lengths) if lengths else None,
        "zlab_matches_greedy": lossless,
        "zlab_loading": {name: sorted(keys) for name, keys in info.items() if keys},
        "teacher_forced_tau": result.teacher_forced_tau,
        "prompts": len(evaluator.prompts),
        "tokens_per_s": result.tokens_per_second,
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| drafter | objective | tau, trainer | tau, z-lab `dflash_generate` | x today (trainer / z-lab) "
        "| lossless (trainer / z-lab) | fresh tau | train s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    today = rows[0]
    for row in rows:
        ratio = (
            f"{row['tau_trainer'] / today['tau_trainer']:.2f} / {row['tau_zlab'] / today['tau_zlab']:.2f}"
            if today["tau_trainer"] and today["tau_zlab"]
            else "n/a"
        )
        lines.append(
            f"| {row['arch']} | {row['loss']} | {row['tau_trainer']:.3f} | {row['tau_zlab']:.3f} | {ratio} | "
            f"{row['trainer_matches_greedy']} / {row['zlab_matches_greedy']} | "
            f"{row['tau_trainer_fresh']:.3f} | {row['train_seconds']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240, help="optimiser steps each (the demo's 240)")
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts (and samples)")
    parser.add_argument("--new-tokens", type=int, default=40, help="tokens decoded per prompt")
    parser.add_argument("--only", default="", help="comma-separated variants, e.g. dflash2-dpace")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    wanted = {name for name in args.only.split(",") if name}
    rows = []
    with tempfile.TemporaryDirectory(prefix="side-by-side-") as scratch:
        for arch, loss in VARIANTS:
            if wanted and f"{arch}-{loss}" not in wanted:
                continue
            print(f"training {arch} + {loss}: {args.steps} steps", flush=True)
            torch.manual_seed(0)
            rows.append(train_variant(arch, loss, args, Path(scratch) / f"{arch}-{loss}"))
            print(json.dumps(rows[-1]), flush=True)
            if args.out:  # after each variant: a long run interrupted keeps what it measured
                args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
