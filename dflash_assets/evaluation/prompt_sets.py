"""Prompt sets: the traffic a drafter is measured on, one set at a time.

`DFLASH_EVAL_SETS` names them, `name=reference` pairs separated by commas (`chat=sharegpt[17000:],
code=/data/code.jsonl`), a reference being anything the product reads as a dataset: a file in any layout
it reads, a directory of shards, `s3://`, `hf://`, a built-in name (`bundled`, `sharegpt[a:b]`). The set
`held_out` is always there: the run's own held-out rows, which training never saw.

A prompt is a conversation up to the user (or tool) turn before its last answer, rendered by the target's
chat template with the generation prompt after it (what a server sends the model); a row with no answer
is a prompt as it is. The first `count` rows that make a prompt are the set, in the dataset's order; a
prompt longer than the target can answer at its context is skipped and counted, never cut.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dflash_assets.conversations.layouts import Conversation, Dropped, Messages

HELD_OUT = "held_out"
SETTING = "DFLASH_EVAL_SETS"
# A set's name is a partition key and part of a store prefix: letters, digits, `_`, `-` and `.`.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Skipped rows whose detail is kept, for the log and the stored evaluation (the rest are counted).
SKIPPED_DETAILS = 5


class PromptSetError(ValueError):
    """`DFLASH_EVAL_SETS` or a set's data cannot be used: one line naming which and why."""


@dataclass(frozen=True)
class PromptSetSpec:
    """A named set and the dataset reference its prompts come from ("" for `held_out`)."""

    name: str
    reference: str = ""


def parse_eval_sets(text: str) -> list[PromptSetSpec]:
    """`held_out` first, then the sets `text` names (`name=reference,...`) in its order."""
    specs = [PromptSetSpec(HELD_OUT)]
    for part in (piece.strip() for piece in (text or "").split(",")):
        if not part:
            continue
        name, equals, reference = (piece.strip() for piece in part.partition("="))
        if not equals or not reference:
            raise PromptSetError(
                f"{SETTING}: {part!r} is not name=reference (e.g. chat=sharegpt[17000:] or "
                "code=/data/code.jsonl)"
            )
        if not _NAME.match(name):
            raise PromptSetError(
                f"{SETTING}: the set name {name!r} must be letters, digits, '_', '-' or '.' (at most 64): it "
                "is a partition key and part of the store's prefix"
            )
        if name == HELD_OUT:
            raise PromptSetError(
                f"{SETTING}: {HELD_OUT!r} is the run's own held-out rows, always evaluated: name your set "
                "otherwise"
            )
        if any(spec.name == name for spec in specs):
            raise PromptSetError(f"{SETTING}: the set {name!r} is named twice")
        specs.append(PromptSetSpec(name, reference))
    return specs


@dataclass(frozen=True)
class Prompt:
    """One prompt: where it came from (`line 8`, `record 7`, `sample 412`) and its token ids."""

    location: str
    token_ids: list[int]


@dataclass
class PromptSet:
    """The prompts of one set, and what was read to find them."""

    name: str
    reference: str
    prompts: list[Prompt]
    rows_read: int = 0
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> rows
    skipped_details: list[str] = field(default_factory=list)  # the first few, located

    def skip(self, reason: str, location: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        if len(self.skipped_details) < SKIPPED_DETAILS:
            self.skipped_details.append(f"{location}: {reason}" + (f": {detail}" if detail else ""))

    def describe_skipped(self) -> str:
        """`3 rows skipped (too_long 2, no_prompt 1)`, or "" when none was."""
        if not self.skipped:
            return ""
        counts = ", ".join(f"{reason} {count}" for reason, count in sorted(self.skipped.items()))
        return f"{sum(self.skipped.values())} row(s) skipped ({counts})"


def prompt_messages(conversation: Conversation) -> Messages | None:
    """The conversation up to the turn before its last answer (None when no user or tool turn is left):
    what the target was asked when it gave that answer. A conversation with no answer is all prompt."""
    messages = conversation.messages
    answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if answers:
        messages = messages[: answers[-1]]
    while messages and messages[-1]["role"] == "assistant":  # a conversation ending on two answers
        messages = messages[:-1]
    if not any(message["role"] in ("user", "tool") for message in messages):
        return None
    return [dict(message) for message in messages]


def dataset_prompt_set(
    spec: PromptSetSpec,
    rows: Iterable[tuple[int, Conversation | Dropped]],
    render: Callable[[Messages, list[dict[str, Any]] | None], list[int]],
    *,
    count: int,
    max_prompt_tokens: int,
    location: Callable[[int], str],
) -> PromptSet:
    """The first `count` prompts of `rows` (a dataset's rows as `datasets.iter_rows` yields them), each
    rendered by `render(messages, tools)`; a row that makes no prompt, or one longer than
    `max_prompt_tokens`, is skipped and counted."""
    found = PromptSet(spec.name, spec.reference, [])
    for index, row in rows:
        if len(found.prompts) >= count:
            break
        found.rows_read += 1
        if isinstance(row, Dropped):
            found.skip(row.reason, location(index), row.detail)
            continue
        messages = prompt_messages(row)
        if messages is None:
            found.skip("no_prompt", location(index), f"roles: {[m['role'] for m in row.messages]}")
            continue
        try:
            token_ids = render(messages, row.tools)
        except Exception as error:  # noqa: BLE001 - a template's failure on one row skips that row
            found.skip("template_error", location(index), f"{type(error).__name__}: {error}"[:200])
            continue
        if len(token_ids) > max_prompt_tokens:
            found.skip("too_long", location(index), f"{len(token_ids)} tokens, at most {max_prompt_tokens}")
            continue
        found.prompts.append(Prompt(location(index), token_ids))
    return found


def held_out_prompt_set(
    rows: Iterable[tuple[int, Sequence[int], Sequence[int]]], *, count: int, max_prompt_tokens: int
) -> PromptSet:
    """The held-out rule, the one the trainer's curve and `drafter_evaluations`' `held_out` both use: each
    held-out row (sample index, token ids, loss mask, as training read it) is a prompt of every token before
    its last assistant turn; a row with none, or longer than `max_prompt_tokens` (the target's context less
    the new tokens), is skipped and counted, never cut. `count` prompts are taken in turn from each context
    bucket that has any, so long prompts are measured too when most are short (all short: the first
    `count` by sample index), and kept in sample-index order. Deterministic: every rank picks the same."""
    from dflash_assets.drafter.speculative import CONTEXT_BUCKETS, context_bucket

    found = PromptSet(HELD_OUT, "", [])
    candidates: list[Prompt] = []
    for sample_index, input_ids, loss_mask in sorted(rows, key=lambda row: row[0]):
        found.rows_read += 1
        where = f"sample {sample_index}"
        mask = [int(m) for m in loss_mask]
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        if not starts:
            found.skip("no_prompt", where, "no assistant token after the first")
            continue
        token_ids = [int(t) for t in input_ids[: starts[-1]]]
        if len(token_ids) > max_prompt_tokens:
            found.skip("too_long", where, f"{len(token_ids)} tokens, at most {max_prompt_tokens}")
            continue
        candidates.append(Prompt(where, token_ids))
    queues: dict[str, list[int]] = {}
    for i, prompt in enumerate(candidates):
        queues.setdefault(context_bucket(len(prompt.token_ids)), []).append(i)
    ordered = [queues[name] for name, _, _ in CONTEXT_BUCKETS if name in queues]
    chosen: list[int] = []
    while len(chosen) < count and any(ordered):
        for queue in ordered:
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    found.prompts = [candidates[i] for i in sorted(chosen)]
    return found
