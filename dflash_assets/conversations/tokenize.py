"""Conversations -> token ids + assistant loss mask, a row at a time or a range at once, with an account
of every row left out and why. The mask itself is `loss_mask.py`'s; the file a range is written to is
`shard.py`'s.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_assets import settings
from dflash_assets.conversations.datasets import (
    DatasetError,
    DatasetSource,
    iter_rows,
    resolve_dataset,
    row_location,
)
from dflash_assets.conversations.drops import SHOWN, BadRow, dropped_line
from dflash_assets.conversations.layouts import Conversation, Dropped, ExactIds, Messages, as_conversation
from dflash_assets.conversations.loss_mask import (
    Rendered,
    TemplateLayout,
    check_tokenizer,
    end_of_turn_id,
    mask_from_spans,
    render_with_spans,
    template_layout,
)
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.conversations.samples import TokenizedSample

OVERLONG_POLICIES = ("truncate", "drop")
DEFAULT_MAX_LENGTH = int(settings.MAX_LENGTH.default)  # stated once, in the settings table
_ENCODE_BATCH = 256  # rows rendered in Python, then encoded together by the Rust tokenizer


@dataclass
class TokenizeResult:
    """One sample range, tokenized: the kept samples and an account of everything left out."""

    samples: list[TokenizedSample] = field(default_factory=list)
    dropped: dict[int, str] = field(default_factory=dict)  # sample index -> drop reason
    dropped_by_reason: dict[str, int] = field(default_factory=dict)  # reason -> number of rows
    rows: int = 0  # rows of the range present in the dataset (kept + dropped)
    tokens: int = 0  # over kept samples, after truncation
    loss_tokens: int = 0  # tokens with loss_mask 1
    truncated: int = 0  # kept samples cut to max_length
    exact_ids: int = 0  # kept samples whose answer ids are the target's own (regenerated data)
    first_bad: BadRow | None = None  # the first dropped row, to point a person at the file
    bad_rows: list[BadRow] = field(default_factory=list)  # the first `drops.SHOWN` dropped rows, in order

    def dropped_line(self, *, rows_word: str = "rows", verb: str = "were dropped") -> str:
        """The dropped rows in one line: how many, by reason, and the first few with what was wrong."""
        return dropped_line(self.rows, self.dropped_by_reason, self.bad_rows, rows_word=rows_word, verb=verb)

    @property
    def mean_length(self) -> float:
        return self.tokens / len(self.samples) if self.samples else 0.0

    @property
    def max_length(self) -> int:
        return max((s.num_tokens for s in self.samples), default=0)

    def metadata(self) -> dict[str, Any]:
        """What tokenizing the range reports: numbers a UI plots across ranges."""
        return {
            "samples": len(self.samples),
            "tokens": self.tokens,
            "mean_length": float(self.mean_length),
            "max_length": self.max_length,
            "truncated": self.truncated,
            "dropped": len(self.dropped),
            "exact_target_ids": self.exact_ids,
            **{f"dropped_{reason}": count for reason, count in sorted(self.dropped_by_reason.items())},
        }

    def manifest_fields(self) -> dict[str, Any]:
        """What the range's manifest records beside its shard."""
        return {
            "sample_indices": [sample.sample_index for sample in self.samples],
            "dropped": {str(index): reason for index, reason in sorted(self.dropped.items())},
            "tokens": self.tokens,
        }


class TooManyBadRows(DatasetError):
    pass


def check_bad_rows(
    rows: int,
    dropped: Mapping[int, str],
    max_bad_fraction: float,
    *,
    where: str,
    first_bad: BadRow | str | None,
    advice: str = "",
) -> None:
    """Raise `TooManyBadRows` when more than `max_bad_fraction` of `rows` were dropped (`dropped`: sample
    index -> reason), naming `where` they are, the count per reason and the first bad row."""
    if not rows or len(dropped) / rows <= max_bad_fraction:
        return
    counts = ", ".join(f"{reason}={count}" for reason, count in sorted(Counter(dropped.values()).items()))
    raise TooManyBadRows(
        f"{len(dropped)} of {rows} rows {where} were dropped ({counts}), more than "
        f"max_bad_fraction={max_bad_fraction}. First bad row: {first_bad}." + (f" {advice}" if advice else "")
    )


def tokenize_conversation(
    tokenizer: Any,
    messages: Messages | Conversation,
    max_length: int = DEFAULT_MAX_LENGTH,
    overlong: str = "truncate",
    *,
    sample_index: int = 0,
) -> TokenizedSample | Dropped:
    """Tokenize one conversation (its messages, or a Conversation with its tools) with the tokenizer's
    chat template; Dropped says why it cannot be used."""
    check_tokenizer(tokenizer)
    _check_overlong(overlong, max_length)
    return _tokenize_batch(tokenizer, [(sample_index, messages)], max_length, overlong)[0].sample


def tokenize_rows(
    tokenizer: Any,
    rows: Iterable[tuple[int, Conversation | Messages | Dropped]],
    dataset: DatasetSource,
    dataset_name: str,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    overlong: str = "truncate",
    on_progress: Callable[[int, int], None] | None = None,
) -> TokenizeResult:
    """Tokenize `(index, Conversation or Dropped)` rows of `dataset` (e.g. `iter_rows`, or a sample of
    rows from `iter_rows_at`), in batches the Rust tokenizer encodes together. A row with the target's
    exact ids (an exported row) is tokenized as the target's stored record is (`_tokenize_batch`)."""
    check_tokenizer(tokenizer)
    _check_overlong(overlong, max_length)
    dataset = resolve_dataset(dataset)
    result = TokenizeResult()
    drop_counts: Counter[str] = Counter()

    def record_drop(index: int, dropped: Dropped) -> None:
        result.dropped[index] = dropped.reason
        drop_counts[dropped.reason] += 1
        if len(result.bad_rows) < SHOWN:  # rows come in order: these are the first
            location = row_location(dataset, index)
            result.bad_rows.append(BadRow(dataset_name, index, location, dropped.reason, dropped.detail))
            result.first_bad = result.bad_rows[0]

    batch: list[tuple[int, Conversation | Messages | Dropped]] = []

    def run_batch() -> None:
        outcomes = _tokenize_batch(tokenizer, batch, max_length, overlong)
        for (index, _), outcome in zip(batch, outcomes, strict=True):
            sample = outcome.sample
            if isinstance(sample, Dropped):
                record_drop(index, sample)
                continue
            result.samples.append(sample)
            result.tokens += sample.num_tokens
            result.loss_tokens += sum(sample.loss_mask)
            result.truncated += outcome.truncated
            result.exact_ids += outcome.exact
        batch.clear()
        if on_progress is not None:
            on_progress(result.rows, len(result.samples))

    for index, row in rows:
        result.rows += 1
        batch.append((index, row))
        if len(batch) >= _ENCODE_BATCH:
            run_batch()
    if batch:
        run_batch()
    result.dropped_by_reason = dict(sorted(drop_counts.items()))
    return result


def tokenize_range(
    tokenizer: Any,
    dataset_uri: DatasetSource,
    sample_range: SampleRange,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    overlong: str = "truncate",
    max_bad_fraction: float = 0.5,
    s3: Any = None,
    cache_dir: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    layout: str = "auto",
) -> TokenizeResult:
    """Tokenize the rows of `sample_range` that exist in the dataset (None = the bundled sample), read
    in `layout` (`DFLASH_DATASET_FORMAT`).

    Raises TooManyBadRows, naming the file and its first bad line, when more than `max_bad_fraction`
    of the range's rows are dropped. `on_progress(rows_done, rows_kept)` is called after each batch.
    """
    check_tokenizer(tokenizer)
    _check_overlong(overlong, max_length)
    dataset = resolve_dataset(dataset_uri, s3=s3, cache_dir=cache_dir)
    dataset_name = dataset.uri if dataset_uri is not None else str(dataset.files[0])
    rows = iter_rows(dataset, sample_range, layout=layout)
    result = tokenize_rows(
        tokenizer,
        rows,
        dataset,
        dataset_name,
        max_length=max_length,
        overlong=overlong,
        on_progress=on_progress,
    )
    check_bad_rows(
        result.rows,
        result.dropped,
        max_bad_fraction,
        where=f"in sample range {sample_range.key} of {dataset_name}",
        first_bad=result.first_bad,
        advice="Fix the dataset, or raise max_bad_fraction / max_length if these drops are expected.",
    )
    return result


# --- a conversation whose last answer the target wrote ------------------------------------------------


@dataclass(frozen=True)
class AnsweredSample:
    """A tokenized conversation ending in the target's own answer, and how its ids were obtained."""

    sample: TokenizedSample | Dropped
    truncated: bool = False  # cut to max_length
    exact: bool = False  # the answer's ids are the ones the target produced, not re-tokenised text


class AnswerTokenizer:
    """`prompt + answer` as the target saw and wrote it: the chat template applied to the history with a
    generation prompt (the prompt), then the answer's tokens (loss mask 1), ending with the end-of-turn
    token when the target stopped on it. Earlier assistant turns inside the prompt are masked 1 too.

    With `completion_token_ids` the answer's ids are the target's own (never re-tokenised); with
    `prompt_token_ids` too, they are the exact prompt the engine used (should the template render other
    ids, those are kept and the prompt's mask is left 0). Without ids the answer text is tokenised with
    the target's tokenizer, a reasoning block first as Qwen3-style templates render it.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_length: int = DEFAULT_MAX_LENGTH,
        overlong: str = "truncate",
    ) -> None:
        check_tokenizer(tokenizer)
        _check_overlong(overlong, max_length)
        self.tokenizer, self.max_length, self.overlong = tokenizer, max_length, overlong
        self.kwargs = dict(chat_template_kwargs or {})
        self.layout = template_layout(tokenizer)
        self.end_of_turn_id = end_of_turn_id(tokenizer, self.layout)

    def __call__(
        self,
        history: Messages,
        answer: dict[str, Any],
        *,
        stopped: bool,
        completion_token_ids: Sequence[int] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        sample_index: int = 0,
        tools: list[dict[str, Any]] | None = None,
    ) -> AnsweredSample:
        tokenizer = self.tokenizer
        rendered = render_with_spans(
            tokenizer,
            self.layout,
            history,
            tools,
            add_generation_prompt=True,
            chat_template_kwargs=self.kwargs,
        )
        if isinstance(rendered, Dropped):
            if rendered.reason == "template_error":
                return AnsweredSample(rendered)
            # Earlier answers that cannot be located are left out of the mask; the last answer still counts.
            rendered = self._prompt_only(history, tools)
            if isinstance(rendered, Dropped):
                return AnsweredSample(rendered)
        ids, mask = _encoded(tokenizer, self.layout, rendered)
        if prompt_token_ids is not None and list(prompt_token_ids) != ids:
            ids, mask = [int(i) for i in prompt_token_ids], [0] * len(prompt_token_ids)
        if completion_token_ids is not None:
            completion = [int(i) for i in completion_token_ids]
        else:
            text = self._answer_text(history, answer, tools)
            if isinstance(text, Dropped):
                return AnsweredSample(text)
            completion = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if stopped and self.end_of_turn_id is not None:
                completion.append(self.end_of_turn_id)
        if not completion:
            return AnsweredSample(Dropped("empty_assistant", "the target's answer has no tokens"))
        sample, truncated = _fit_length(
            sample_index, ids + completion, mask + [1] * len(completion), self.max_length, self.overlong
        )
        return AnsweredSample(sample, truncated, exact=completion_token_ids is not None)

    def last_answer(
        self,
        messages: Messages,
        turns: Sequence[Mapping[str, Any]],
        *,
        prompt_token_ids: Sequence[int] | None,
        tools: list[dict[str, Any]] | None,
        sample_index: int,
    ) -> AnsweredSample:
        """A regenerated conversation as a sample: its last answer (`turns[-1]`, as `target_completions`
        records each answer) after the history before it. The one way such a conversation is tokenized,
        read from the store's record (`generation/tokenized.py`) or from an exported row carrying it
        (`_tokenize_batch`), so both give the same ids and mask."""
        turn = turns[-1]
        position = int(turn["message"])
        return self(
            messages[:position],
            messages[position],
            stopped=turn["finish_reason"] == "stop",
            completion_token_ids=turn.get("completion_token_ids"),
            prompt_token_ids=prompt_token_ids,
            sample_index=sample_index,
            tools=tools,
        )

    def _prompt_only(self, history: Messages, tools: list[dict[str, Any]] | None) -> Rendered | Dropped:
        try:
            text = self.tokenizer.apply_chat_template(
                history, tools=tools, tokenize=False, add_generation_prompt=True, **self.kwargs
            )
        except Exception as err:
            return Dropped("template_error", f"{type(err).__name__}: {err}"[:300])
        return Rendered(text, [])

    def _answer_text(
        self, history: Messages, answer: dict[str, Any], tools: list[dict[str, Any]] | None
    ) -> str | Dropped:
        """The text the target wrote: its reasoning block (as Qwen3-style templates open it), then the
        answer; an answer with tool calls as the template renders the turn (what the conversation gains
        from it after the generation prompt), up to its end-of-turn token."""
        if not answer.get("tool_calls"):
            return _answer_text(answer)
        try:
            prompt = self.tokenizer.apply_chat_template(
                history, tools=tools, tokenize=False, add_generation_prompt=True, **self.kwargs
            )
            whole = self.tokenizer.apply_chat_template(
                [*history, answer], tools=tools, tokenize=False, **self.kwargs
            )
        except Exception as err:
            return Dropped("template_error", f"{type(err).__name__}: {err}"[:300])
        end = (
            None if self.end_of_turn_id is None else self.tokenizer.convert_ids_to_tokens(self.end_of_turn_id)
        )
        if not whole.startswith(prompt) or not end or end not in whole[len(prompt) :]:
            return Dropped(
                "assistant_not_located",
                "the answer's tool calls: the template does not render the turn after its generation prompt",
            )
        return whole[len(prompt) :].rsplit(end, 1)[0]


def _answer_text(answer: dict[str, Any]) -> str:
    """The text the target wrote: its reasoning block (as Qwen3-style templates open it), then the answer."""
    content = answer.get("content") or ""
    reasoning = answer.get("reasoning_content")
    return f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content


# --- one batch of conversations -------------------------------------------------------------------


def _encoded(tokenizer: Any, layout: TemplateLayout, rendered: Rendered) -> tuple[list[int], list[int]]:
    """One rendering's ids and mask (a template with `{% generation %}` has both already)."""
    if rendered.input_ids is not None and rendered.loss_mask is not None:
        return list(rendered.input_ids), list(rendered.loss_mask)
    encoding = tokenizer(rendered.text, add_special_tokens=False, return_offsets_mapping=True).encodings[0]
    mask = mask_from_spans(
        rendered.spans, encoding.offsets, encoding.ids, layout.end_token_ids, rendered.text
    )
    return list(encoding.ids), mask


def _tokenize_batch(
    tokenizer: Any,
    rows: Sequence[tuple[int, Conversation | Messages | Dropped]],
    max_length: int,
    overlong: str,
) -> list[AnsweredSample]:
    """Render and locate assistant spans per row in Python, then encode all texts in one Rust call. A
    row carrying the target's exact ids goes through `AnswerTokenizer.last_answer` instead, as its stored
    record does in `generation/tokenized.py`: its answers are never re-tokenised."""
    layout = template_layout(tokenizer)
    prepared: list[Rendered | Dropped | tuple[Conversation, ExactIds]] = []
    answerers: dict[str, AnswerTokenizer] = {}  # per chat-template arguments, as a range's record has one
    for _, row in rows:
        if isinstance(row, Conversation) and row.exact_ids is not None:
            prepared.append((row, row.exact_ids))
            continue
        conversation = as_conversation(row)
        if isinstance(conversation, Dropped):
            prepared.append(conversation)
        else:
            prepared.append(render_with_spans(tokenizer, layout, conversation.messages, conversation.tools))
    texts = [item.text for item in prepared if isinstance(item, Rendered) and item.input_ids is None]
    encodings = (
        iter(tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True).encodings)
        if texts
        else None
    )

    outcomes: list[AnsweredSample] = []
    for (index, _), item in zip(rows, prepared, strict=True):
        if isinstance(item, Dropped):
            outcomes.append(AnsweredSample(item))
            continue
        if isinstance(item, tuple):
            conversation, exact = item
            kwargs = exact.chat_template_kwargs
            key = json.dumps(kwargs, sort_keys=True, default=str)
            if key not in answerers:
                answerers[key] = AnswerTokenizer(
                    tokenizer, chat_template_kwargs=kwargs, max_length=max_length, overlong=overlong
                )
            outcomes.append(
                answerers[key].last_answer(
                    conversation.messages,
                    exact.turns,
                    prompt_token_ids=exact.prompt_token_ids,
                    tools=conversation.tools,
                    sample_index=index,
                )
            )
            continue
        if item.input_ids is not None and item.loss_mask is not None:
            input_ids, loss_mask = item.input_ids, item.loss_mask
        else:
            encoding = next(encodings)
            input_ids = list(encoding.ids)
            loss_mask = mask_from_spans(
                item.spans, encoding.offsets, encoding.ids, layout.end_token_ids, item.text
            )
        if not any(loss_mask):
            outcomes.append(
                AnsweredSample(Dropped("assistant_not_located", "no token overlaps an assistant reply"))
            )
            continue
        outcomes.append(AnsweredSample(*_fit_length(index, input_ids, loss_mask, max_length, overlong)))
    return outcomes


def _fit_length(
    index: int, input_ids: list[int], loss_mask: list[int], max_length: int, overlong: str
) -> tuple[TokenizedSample | Dropped, bool]:
    if len(input_ids) <= max_length:
        return TokenizedSample(index, input_ids, loss_mask), False
    if overlong == "drop":
        return Dropped("overlong", f"{len(input_ids)} tokens > max_length {max_length}"), False
    if not any(loss_mask[:max_length]):
        return Dropped(
            "overlong_no_assistant",
            f"{len(input_ids)} tokens; the first assistant token is at {loss_mask.index(1)} "
            f">= max_length {max_length}",
        ), False
    return TokenizedSample(index, input_ids[:max_length], loss_mask[:max_length]), True


def _check_overlong(overlong: str, max_length: int) -> None:
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={overlong!r} must be one of {OVERLONG_POLICIES}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
