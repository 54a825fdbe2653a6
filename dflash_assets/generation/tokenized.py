"""A range's regenerated conversations as tokenized samples: what `tokenized_completions` reads when the
target answered them itself (`DFLASH_COMPLETIONS=target`).

Each sample is the last answer's prompt followed by the answer, with the target's exact token ids where
the engine returned them (the in-process engine always does), so the drafter trains on exactly the
tokens the target produced; earlier answers inside the prompt are in the loss mask too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash_assets.conversations.datasets import Dropped
from dflash_assets.conversations.drops import SHOWN, BadRow
from dflash_assets.conversations.tokenize import (
    DEFAULT_MAX_LENGTH,
    AnswerTokenizer,
    TokenizeResult,
    check_bad_rows,
)
from dflash_assets.generation.records import iter_records


def tokenize_completions(
    tokenizer: Any,
    completions: Path,
    *,
    dropped_upstream: Mapping[int, str] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    max_length: int = DEFAULT_MAX_LENGTH,
    overlong: str = "truncate",
    max_bad_fraction: float = 0.5,
    where: str = "target_completions",
) -> TokenizeResult:
    """Tokenize every record of a range's `completions.jsonl`. `dropped_upstream` (row -> reason, from
    the target_completions manifest) carries rows the target never answered into `result.dropped`."""
    encode = AnswerTokenizer(
        tokenizer, chat_template_kwargs=chat_template_kwargs, max_length=max_length, overlong=overlong
    )
    result = TokenizeResult()
    reasons: Counter[str] = Counter()

    def drop(index: int, dropped: Dropped) -> None:
        result.dropped[index] = dropped.reason
        reasons[dropped.reason] += 1
        # Rows dropped upstream come first, then the records in order: keep the lowest indices.
        result.bad_rows.append(BadRow(where, index, f"row {index}", dropped.reason, dropped.detail))
        result.bad_rows = sorted(result.bad_rows, key=lambda bad: bad.index)[:SHOWN]
        result.first_bad = result.bad_rows[0]

    for index, reason in sorted((dropped_upstream or {}).items()):
        result.rows += 1
        drop(int(index), Dropped(reason, "dropped by target_completions"))
    for record in iter_records(completions):
        result.rows += 1
        # The one tokenization of a regenerated conversation: an exported row carrying this record is
        # tokenized by the same call (conversations/tokenize.py `_tokenize_batch`), to the same ids.
        answered = encode.last_answer(
            record.messages,
            record.turns,
            prompt_token_ids=record.prompt_token_ids,
            tools=record.tools,
            sample_index=record.sample_index,
        )
        if isinstance(answered.sample, Dropped):
            drop(record.sample_index, answered.sample)
            continue
        result.samples.append(answered.sample)
        result.tokens += answered.sample.num_tokens
        result.loss_tokens += sum(answered.sample.loss_mask)
        result.truncated += answered.truncated
        result.exact_ids += answered.exact
    result.samples.sort(key=lambda sample: sample.sample_index)
    result.dropped = dict(sorted(result.dropped.items()))
    result.dropped_by_reason = dict(sorted(reasons.items()))
    check_bad_rows(
        result.rows, result.dropped, max_bad_fraction, where=f"of {where}", first_bad=result.first_bad
    )
    return result
