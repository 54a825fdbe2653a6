"""Long conversations made from short ones, for measuring a drafter at the context lengths reasoning targets
write when the data at hand has none: each output row is several conversations one after the other (their
turns in order, as one multi-turn conversation), as many as fit a length drawn between `--min-tokens` and
`--max-tokens` under the configured target's chat template.

The answers stay the ones the source holds: give it the target's own (`target_completions`' records, the
`completions.jsonl` of each range in the store) and every labelled token is what the target said, each
answer to its own question. Rows a range dropped (`"dropped"` lines) are skipped and counted.

    DFLASH_TARGET_MODEL=smollm2 python scripts/long_conversations.py \
        ~/.dflash/store/target-completions/*/completions.jsonl \
        --rows 0:440 --count 24 --min-tokens 4096 --max-tokens 8000 --out long-train.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def read_conversations(paths: list[Path], first: int, stop: int) -> tuple[list[list[dict]], int]:
    """(the message lists of sample indices in [first, stop), rows dropped there)."""
    found: dict[int, list[dict]] = {}
    dropped = 0
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            index = int(row.get("sample_index", number))
            if not first <= index < stop:
                continue
            if row.get("dropped"):
                dropped += 1
                continue
            found[index] = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    return [found[i] for i in sorted(found)], dropped


def build(
    conversations: list[list[dict]],
    tokenizer,
    count: int,
    min_tokens: int,
    max_tokens: int,
    seed: int,
) -> list[dict]:
    """`count` rows, each a run of conversations whose template length lands in [min_tokens, max_tokens]:
    conversations are taken in a shuffled order, going round again when the source runs out."""
    rng = random.Random(seed)
    order: list[int] = []
    rows = []
    while len(rows) < count:
        goal = rng.randint(min_tokens, max_tokens)
        messages: list[dict] = []
        length = 0
        for _ in range(10 * len(conversations)):
            if not order:
                order = list(range(len(conversations)))
                rng.shuffle(order)
            candidate = messages + conversations[order[-1]]
            tokens = len(tokenizer.apply_chat_template(candidate, tokenize=True, return_dict=False))
            if tokens > max_tokens:
                break
            messages, length = candidate, tokens
            order.pop()
            if length >= goal:
                break
        if length < min_tokens:
            raise SystemExit(
                f"could not reach {min_tokens:,} tokens without passing {max_tokens:,}: widen the range"
            )
        rows.append({"messages": messages, "tokens": length})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", type=Path, nargs="+", help="JSONL files of `messages` rows")
    parser.add_argument("--rows", default="0:", help="sample indices FIRST:STOP taken from the sources")
    parser.add_argument("--count", type=int, required=True, help="long conversations to write")
    parser.add_argument("--min-tokens", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from dflash_assets.orchestration.resources import TargetModelResource

    first, _, stop = args.rows.partition(":")
    conversations, dropped = read_conversations(args.sources, int(first or 0), int(stop or 2**62))
    if not conversations:
        raise SystemExit(f"no conversations in rows {args.rows} of {[str(p) for p in args.sources]}")
    tokenizer = AutoTokenizer.from_pretrained(str(TargetModelResource().model_dir()))
    tokenizer.model_max_length = 2**31  # lengths are measured here, never fed to a model
    rows = build(conversations, tokenizer, args.count, args.min_tokens, args.max_tokens, args.seed)
    args.out.write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in rows))
    lengths = sorted(row["tokens"] for row in rows)
    print(
        f"{args.out}: {len(rows)} conversations of {lengths[0]:,}-{lengths[-1]:,} tokens "
        f"(median {lengths[len(lengths) // 2]:,}) from {len(conversations)} source conversations "
        f"(rows {args.rows}; {dropped} dropped rows skipped)"
    )


if __name__ == "__main__":
    main()
