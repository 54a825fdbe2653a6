"""A drafter trained at one sample length against one trained at another, τ by context length: both train
on the same stored hidden states (the configured store's committed ranges, captured at the longer
length), one with samples cut at `--max-length` (the trainer's own cut: a causal target's states of a
sample's first N tokens are the same whether it stopped there or went on, so this is the drafter a
capture at N would have given), then z-lab's `dflash_generate` decodes each export on the same held-out
prompts, and τ is counted per context-length bucket (`drafter/speculative.py`'s `CONTEXT_BUCKETS`).
Beside them, on the same prompts, the training-free prompt-lookup drafter; every decoding is checked
against the target's own greedy output.

    # long conversations of the target's own answers (scripts/long_conversations.py), captured at 8,192
    python scripts/length_side_by_side.py train --max-length 3072 --export out/3k --out out/3k.json
    python scripts/length_side_by_side.py train --max-length 8192 --export out/8k --out out/8k.json
    python scripts/length_side_by_side.py evaluate held-out.jsonl --exports out/3k out/8k --out out/eval.json

Each `train` is one process (run two at once, one thread each, on a 2-core machine).
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

from drafter_side_by_side import offline_drafter_data, parse_variant, zlab_decode  # noqa: E402

from dflash_assets.drafter.export import export_drafter  # noqa: E402
from dflash_assets.drafter.speculative import (  # noqa: E402
    PromptLookup,
    SpeculativeEvaluator,
    TargetVerifier,
    bucket_label,
    by_context_length,
    stop_token_ids_of,
)
from dflash_assets.orchestration.resources import TargetModelResource  # noqa: E402
from dflash_assets.storage.open_store import open_store  # noqa: E402
from dflash_assets.training.settings import TrainSettings  # noqa: E402
from dflash_assets.training.train import DrafterTrainer  # noqa: E402


def train(args: argparse.Namespace) -> None:
    arch, loss, block, distill = parse_variant(args.variant)
    name = f"{args.variant}-{args.max_length}"
    train_settings = TrainSettings(
        mode="offline", max_steps=args.steps, global_batch_size=args.batch, loss=loss, block_size=block,
        num_anchors=args.anchors, lr=args.lr, seed=args.seed, max_length=args.max_length, eval_samples=0,
        distill_weight=distill, spec_eval_prompts=0, checkpoint_every_steps=args.steps,
        checkpoint_every_minutes=None, log_every_steps=max(1, args.steps // 8),
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="length-side-by-side-") as scratch:
        work = Path(scratch)
        config, data = offline_drafter_data(name, arch, block, work / "cache")
        torch.manual_seed(args.seed)
        started = time.monotonic()
        trainer = DrafterTrainer(
            config, train_settings, data, store=open_store(str(work / "store")), run=name,
            work_dir=work / name, log=lambda line: print(f"  [{name}] {line}", flush=True),
        )  # fmt: skip
        result = trainer.train()
        seconds = time.monotonic() - started
    export_drafter(result.model, args.export)
    row = {
        "variant": args.variant,
        "max_length": args.max_length,
        "steps": result.steps,
        "train_seconds": seconds,
        "tokens_per_s": result.tokens_per_second,
        "export": str(args.export),
        "samples": len(data.objects),
    }
    print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(row, indent=1) + "\n")


def held_out_prompts(path: Path, tokenizer) -> list[list[int]]:
    """Each conversation's tokens up to its last assistant turn, as the target is asked for it."""
    prompts = []
    for line in path.read_text().splitlines():
        messages = json.loads(line)["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompts.append(
            list(
                tokenizer.apply_chat_template(
                    messages[:last], add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        )
    return prompts


def bucket_table(rows: list[dict]) -> str:
    buckets = list(rows[0]["by_context_length"])
    head = "| drafter | " + " | ".join(f"τ {bucket_label(b)}" for b in buckets) + " | τ all | lossless |"
    lines = [head, "|" + "---|" * (len(buckets) + 3)]
    for row in rows:
        cells = []
        for bucket in buckets:
            entry = row["by_context_length"].get(bucket) or {}
            tau = entry.get("acceptance_length_tau")
            cells.append(f"{tau:.3f} ({entry['prompts']} prompts)" if tau is not None else "—")
        lines.append(
            f"| {row['drafter']} | " + " | ".join(cells) + f" | {row['tau']:.3f} | {row['lossless']} |"
        )
    return "\n".join(lines)


def evaluate(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from dflash_assets.target.model import load_target_model
    from dflash_assets_tests.support.zlab import load_zlab_drafter

    target = TargetModelResource()
    tokenizer = AutoTokenizer.from_pretrained(str(target.model_dir()))
    tokenizer.model_max_length = 2**31  # lengths are checked against the model's context below
    prompts = held_out_prompts(args.held_out, tokenizer)
    model = load_target_model(target.model_dir(), "cpu")
    context = int(getattr(model.config, "max_position_embeddings", 0) or 2**31)
    too_long = [len(p) for p in prompts if len(p) + args.new_tokens > context]
    if too_long:
        raise SystemExit(f"prompts of {too_long} tokens leave no room for {args.new_tokens} new in {context}")
    print(f"{len(prompts)} held-out prompts of {sorted(len(p) for p in prompts)} tokens", flush=True)
    evaluator = SpeculativeEvaluator(
        TargetVerifier(model, target.layer_ids()), prompts, max_new_tokens=args.new_tokens,
        stop_token_ids=stop_token_ids_of(str(target.model_dir())),
    )  # fmt: skip
    started = time.monotonic()
    saved = json.loads(args.reference.read_text()) if args.reference and args.reference.is_file() else None
    if saved is not None and saved["prompts"] == evaluator.prompts:  # the same prompts: decoded before
        evaluator._greedy = saved["greedy"]
        rows = [saved["prompt_lookup"]]
    else:
        floor = evaluator.evaluate(PromptLookup(block_size=args.block))  # decodes the greedy outputs once
        rows = [
            {
                "drafter": f"prompt lookup (block {args.block}, trainer's loop)",
                "tau": floor["acceptance_length_tau"],
                "lossless": f"{floor['prompts'] - len(floor['mismatched_prompts'])}/{floor['prompts']}",
                "by_context_length": floor["by_context_length"],
            }
        ]
        if args.reference:
            reference = {"prompts": evaluator.prompts, "greedy": evaluator._greedy, "prompt_lookup": rows[0]}
            args.reference.write_text(json.dumps(reference) + "\n")
    print(json.dumps(rows[-1]), f"{time.monotonic() - started:.0f} s", flush=True)
    for export in args.exports:
        started = time.monotonic()
        drafter, _ = load_zlab_drafter(export)
        per_prompt, same = zlab_decode(drafter, model, evaluator, args.new_tokens)
        parts = [(len(p), len(r), sum(r)) for p, r in zip(evaluator.prompts, per_prompt, strict=True)]
        rounds, accepted = sum(p[1] for p in parts), sum(p[2] for p in parts)
        trained = json.loads((Path(export) / "config.json").read_text())
        rows.append(
            {
                "drafter": f"{Path(export).name} (z-lab `dflash_generate`)",
                "export": str(export),
                "architecture": trained["architectures"][0],
                "tau": accepted / rounds,
                "lossless": f"{same}/{len(parts)}",
                "by_context_length": by_context_length(parts),
            }
        )
        print(json.dumps(rows[-1]), f"{time.monotonic() - started:.0f} s", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"prompts": [len(p) for p in prompts], "rows": rows}, indent=1) + "\n")
    print(bucket_table(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser(
        "train", help="train one drafter on the store's ranges, samples cut at a length"
    )
    fit.add_argument(
        "--max-length", type=int, required=True, help="tokens a sample keeps (the trainer's cut)"
    )
    fit.add_argument("--variant", default="dflash2-dpace-16", help="<arch>-<loss>-<block>, as side by side")
    fit.add_argument("--steps", type=int, default=96)
    fit.add_argument("--batch", type=int, default=4, help="sequences a step")
    fit.add_argument("--anchors", type=int, default=32, help="anchors a sequence")
    fit.add_argument("--lr", type=float, default=6e-4)
    fit.add_argument("--seed", type=int, default=0)
    fit.add_argument("--export", type=Path, required=True, help="the export's directory")
    fit.add_argument("--out", type=Path, default=None, help="write the run's figures as JSON here")
    score = commands.add_parser("evaluate", help="τ by context length of exports on held-out conversations")
    score.add_argument("held_out", type=Path, help="JSONL of `messages` conversations, none trained on")
    score.add_argument("--exports", type=Path, nargs="+", required=True)
    score.add_argument("--new-tokens", type=int, default=64)
    score.add_argument("--block", type=int, default=16, help="prompt lookup's block")
    score.add_argument("--out", type=Path, default=None)
    score.add_argument(
        "--reference", type=Path, default=None,
        help="the target's greedy outputs and the prompt-lookup row: read from FILE when it holds these "
        "prompts' (an evaluation of other exports on the same prompts), else decoded and written there",
    )  # fmt: skip
    for command in (fit, score):
        command.add_argument(
            "--threads", type=int, default=None, help="torch intra-op threads (default: all)"
        )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    (train if args.command == "train" else evaluate)(args)


if __name__ == "__main__":
    main()
