"""Conversations -> token ids + assistant loss mask, and the tokenized shard file.

The loss mask is 1 on the tokens the target model itself produced: each assistant message's content
as the chat template renders it, plus the end-of-turn token right after it (`<|im_end|>` in ChatML), so
a drafter learns to stop. Headers (`<|im_start|>assistant\\n`), system and user turns and template
scaffolding (e.g. an empty `<think></think>` the template inserts) stay 0. It does not rely on
`{% generation %}` markers: the conversation is rendered once, each assistant content is located in
the rendered text, and character spans are mapped to tokens through the fast tokenizer's offsets.

Shard format (`write_shard` / `read_shard`), one Parquet file per sample range, zstd-compressed,
one row per kept conversation in ascending `sample_index`:

    sample_index  int64          row's 0-based position in the source dataset (dropped rows leave gaps)
    input_ids     list<int32>    token ids of the rendered conversation, truncated to max_length
    loss_mask     list<uint8>    1 = assistant token to train on, same length as input_ids
    num_tokens    int32          len(input_ids), so lengths can be read without the lists

File metadata key `dflash_format` = `dflash-assets.tokenized/1`.
"""

from __future__ import annotations

import io
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_assets.conversations.datasets import (
    DatasetError,
    Dropped,
    Messages,
    iter_rows,
    parse_messages,
    resolve_dataset,
    row_location,
)
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.conversations.samples import TokenizedSample

SHARD_FORMAT = "dflash-assets.tokenized/1"
SHARD_FORMAT_KEY = b"dflash_format"
OVERLONG_POLICIES = ("truncate", "drop")
DEFAULT_MAX_LENGTH = 3072
_ENCODE_BATCH = 256  # rows rendered in Python, then encoded together by the Rust tokenizer


@dataclass(frozen=True)
class BadRow:
    """Where the first dropped row of a range is, so a person can open the file at that line."""

    dataset: str
    index: int
    location: str  # "line 8" (JSONL, 1-based) or "row 7" (Parquet position)
    reason: str
    detail: str

    def __str__(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.dataset} {self.location}: {self.reason}{detail}"


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

    @property
    def mean_length(self) -> float:
        return self.tokens / len(self.samples) if self.samples else 0.0

    @property
    def max_length(self) -> int:
        return max((s.num_tokens for s in self.samples), default=0)

    @property
    def bad_fraction(self) -> float:
        return len(self.dropped) / self.rows if self.rows else 0.0


class TooManyBadRows(DatasetError):
    pass


def tokenize_conversation(
    tokenizer: Any,
    messages: Messages,
    max_length: int = DEFAULT_MAX_LENGTH,
    overlong: str = "truncate",
    *,
    sample_index: int = 0,
) -> TokenizedSample | Dropped:
    """Tokenize one conversation with the tokenizer's chat template; Dropped says why it cannot be used."""
    _check_tokenizer(tokenizer)
    _check_overlong(overlong, max_length)
    return _tokenize_batch(tokenizer, [(sample_index, messages)], max_length, overlong)[0][0]


def tokenize_range(
    tokenizer: Any,
    dataset_uri: str | Path | None,
    sample_range: SampleRange,
    *,
    max_length: int = DEFAULT_MAX_LENGTH,
    overlong: str = "truncate",
    max_bad_fraction: float = 0.5,
    s3: Any = None,
    cache_dir: Path | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> TokenizeResult:
    """Tokenize the rows of `sample_range` that exist in the dataset (None = the bundled sample).

    Raises TooManyBadRows, naming the file and its first bad line, when more than `max_bad_fraction`
    of the range's rows are dropped. `on_progress(rows_done, rows_kept)` is called after each batch.
    """
    _check_tokenizer(tokenizer)
    _check_overlong(overlong, max_length)
    path = resolve_dataset(dataset_uri, s3=s3, cache_dir=cache_dir)
    dataset_name = str(dataset_uri) if dataset_uri else str(path)
    result = TokenizeResult()
    drop_counts: Counter[str] = Counter()

    def record_drop(index: int, dropped: Dropped) -> None:
        result.dropped[index] = dropped.reason
        drop_counts[dropped.reason] += 1
        if result.first_bad is None:
            location = row_location(path, index)
            result.first_bad = BadRow(dataset_name, index, location, dropped.reason, dropped.detail)

    batch: list[tuple[int, Messages | Dropped]] = []

    def run_batch() -> None:
        outcomes = _tokenize_batch(tokenizer, batch, max_length, overlong)
        for (index, _), (outcome, truncated) in zip(batch, outcomes, strict=True):
            if isinstance(outcome, Dropped):
                record_drop(index, outcome)
                continue
            result.samples.append(outcome)
            result.tokens += outcome.num_tokens
            result.loss_tokens += sum(outcome.loss_mask)
            result.truncated += truncated
        batch.clear()
        if on_progress is not None:
            on_progress(result.rows, len(result.samples))

    for index, row in iter_rows(path, sample_range):
        result.rows += 1
        batch.append((index, row))
        if len(batch) >= _ENCODE_BATCH:
            run_batch()
    if batch:
        run_batch()
    result.dropped_by_reason = dict(sorted(drop_counts.items()))

    if result.rows and result.bad_fraction > max_bad_fraction:
        counts = ", ".join(f"{reason}={count}" for reason, count in result.dropped_by_reason.items())
        raise TooManyBadRows(
            f"{len(result.dropped)} of {result.rows} rows in sample range {sample_range.key} of "
            f"{dataset_name} were dropped ({counts}), more than max_bad_fraction={max_bad_fraction}. "
            f"First bad row: {result.first_bad}. Fix the dataset, or raise max_bad_fraction / max_length "
            "if these drops are expected."
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
        _check_tokenizer(tokenizer)
        _check_overlong(overlong, max_length)
        self.tokenizer, self.max_length, self.overlong = tokenizer, max_length, overlong
        self.kwargs = dict(chat_template_kwargs or {})
        self.layout = _template_layout(tokenizer)
        self.end_of_turn_id = _end_of_turn_id(tokenizer, self.layout)

    def __call__(
        self,
        history: Messages,
        answer: dict[str, Any],
        *,
        stopped: bool,
        completion_token_ids: Sequence[int] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        sample_index: int = 0,
    ) -> AnsweredSample:
        tokenizer = self.tokenizer
        try:
            text = tokenizer.apply_chat_template(
                history, tokenize=False, add_generation_prompt=True, **self.kwargs
            )
        except Exception as err:
            return AnsweredSample(Dropped("template_error", f"{type(err).__name__}: {err}"[:300]))
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).encodings[0]
        ids = list(encoding.ids)
        spans = _locate_assistant_spans(text, history, self.layout.header) or []
        mask = _mask_from_spans(spans, encoding.offsets, encoding.ids, self.layout.end_token_ids, text)
        if prompt_token_ids is not None and list(prompt_token_ids) != ids:
            ids, mask = [int(i) for i in prompt_token_ids], [0] * len(prompt_token_ids)
        if completion_token_ids is not None:
            completion = [int(i) for i in completion_token_ids]
        else:
            completion = list(tokenizer(_answer_text(answer), add_special_tokens=False)["input_ids"])
            if stopped and self.end_of_turn_id is not None:
                completion.append(self.end_of_turn_id)
        if not completion:
            return AnsweredSample(Dropped("empty_assistant", "the target's answer has no tokens"))
        sample, truncated = _fit_length(
            sample_index, ids + completion, mask + [1] * len(completion), self.max_length, self.overlong
        )
        return AnsweredSample(sample, truncated, exact=completion_token_ids is not None)


def _answer_text(answer: dict[str, Any]) -> str:
    """The text the target wrote: its reasoning block (as Qwen3-style templates open it), then the answer."""
    content = answer.get("content") or ""
    reasoning = answer.get("reasoning_content")
    return f"<think>\n{reasoning}\n</think>\n\n{content}" if reasoning else content


def _end_of_turn_id(tokenizer: Any, layout: _TemplateLayout) -> int | None:
    """The special token the chat template puts right after an assistant's content (`<|im_end|>` in
    ChatML), else the tokenizer's end-of-sequence token."""
    probe = "dflash-probe-answer"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": probe}], tokenize=False
        )
    except Exception:
        text = ""
    at = text.find(probe)
    if at >= 0:
        after = tokenizer(text[at + len(probe) :], add_special_tokens=False)["input_ids"]
        if after and after[0] in layout.end_token_ids:
            return int(after[0])
    return tokenizer.eos_token_id


# --- one batch of conversations -------------------------------------------------------------------


def _tokenize_batch(
    tokenizer: Any, rows: Sequence[tuple[int, Messages | Dropped]], max_length: int, overlong: str
) -> list[tuple[TokenizedSample | Dropped, bool]]:
    """Render and locate assistant spans per row in Python, then encode all texts in one Rust call."""
    layout = _template_layout(tokenizer)
    prepared: list[tuple[str, list[tuple[int, int]]] | Dropped] = []
    for _, row in rows:
        messages = row if isinstance(row, Dropped) else parse_messages(row)
        prepared.append(messages if isinstance(messages, Dropped) else _render(tokenizer, layout, messages))
    texts = [item[0] for item in prepared if not isinstance(item, Dropped)]
    encodings = (
        iter(tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True).encodings)
        if texts
        else None
    )

    outcomes: list[tuple[TokenizedSample | Dropped, bool]] = []
    for (index, _), item in zip(rows, prepared, strict=True):
        if isinstance(item, Dropped):
            outcomes.append((item, False))
            continue
        encoding = next(encodings)
        loss_mask = _mask_from_spans(item[1], encoding.offsets, encoding.ids, layout.end_token_ids, item[0])
        if not any(loss_mask):
            outcomes.append((Dropped("assistant_not_located", "no token overlaps an assistant reply"), False))
            continue
        outcomes.append(_fit_length(index, list(encoding.ids), loss_mask, max_length, overlong))
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


@dataclass(frozen=True)
class _TemplateLayout:
    header: str | None  # start of an assistant turn in rendered text, e.g. "<|im_start|>assistant"
    end_token_ids: frozenset[int]  # special tokens that may close an assistant turn


def _template_layout(tokenizer: Any) -> _TemplateLayout:
    """Read the assistant header off the generation prompt (cheap: two renders of a tiny probe)."""
    header = None
    probe = [{"role": "user", "content": "Hi"}]
    try:
        without = tokenizer.apply_chat_template(probe, tokenize=False)
        with_prompt = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        if with_prompt.startswith(without):
            # The generation prompt's first line is the assistant header; what follows it (a newline,
            # maybe "<think>") varies by turn, so it is not part of what we search for.
            header = with_prompt[len(without) :].strip().split("\n")[0].strip() or None
    except Exception:
        header = None
    special_ids = set(tokenizer.all_special_ids)
    special_ids.update(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return _TemplateLayout(header, frozenset(special_ids))


def _render(
    tokenizer: Any, layout: _TemplateLayout, messages: Messages
) -> tuple[str, list[tuple[int, int]]] | Dropped:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:
        return Dropped("template_error", f"{type(err).__name__}: {err}"[:300])
    spans = _locate_assistant_spans(text, messages, layout.header)
    if spans is None:
        spans = _prefix_diff_spans(tokenizer, text, messages)
    if spans is None:
        return Dropped(
            "assistant_not_located", "assistant content not found verbatim in the rendered template"
        )
    return text, spans


def _content_candidates(content: str) -> list[str]:
    """Forms an assistant content can take after the template: verbatim, or (Qwen3-style templates
    strip reasoning from earlier turns) only the answer after `</think>`, and either one stripped."""
    candidates = [content]
    if "</think>" in content:
        candidates.append(content.rsplit("</think>", 1)[1].lstrip("\n"))
    candidates += [c.strip() for c in candidates]
    unique: list[str] = []
    for candidate in candidates:
        if candidate and candidate not in unique:
            unique.append(candidate)
    return unique


def _locate_assistant_spans(
    text: str, messages: Messages, header: str | None
) -> list[tuple[int, int]] | None:
    """Character spans of each assistant content in `text`, searched forward in message order."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for message in messages:
        content = message["content"]
        # Where the next assistant turn starts: nothing of this message may be matched beyond it.
        next_header = text.find(header, cursor) if header else -1
        limit = next_header if next_header >= 0 else len(text)
        if message["role"] != "assistant":
            # Stepping over user/system text keeps an assistant reply that repeats the question from
            # matching inside the question. Templates may rewrite these messages; then just don't move.
            position = text.find(content, cursor, limit) if content else -1
            if position >= 0:
                cursor = position + len(content)
            continue
        if header:
            if next_header < 0:
                return None
            cursor = next_header + len(header)
            following = text.find(header, cursor)
            limit = following if following >= 0 else len(text)
        for candidate in _content_candidates(content):
            position = text.find(candidate, cursor, limit)
            if position >= 0:
                spans.append((position, position + len(candidate)))
                cursor = position + len(candidate)
                break
        else:
            return None
    return spans


def _prefix_diff_spans(tokenizer: Any, text: str, messages: Messages) -> list[tuple[int, int]] | None:
    """Fallback: an assistant turn is what rendering messages[:i+1] adds to messages[:i] plus the
    generation prompt. Only valid when the template renders every prefix as a prefix of the whole."""
    spans: list[tuple[int, int]] = []
    for position, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if position == 0:
            return None  # no prompt before it to diff against
        try:
            before = tokenizer.apply_chat_template(
                messages[:position], tokenize=False, add_generation_prompt=True
            )
            through = tokenizer.apply_chat_template(messages[: position + 1], tokenize=False)
        except Exception:
            return None
        # Trailing whitespace after the end-of-turn token is scaffolding, not something the model says.
        through = through.rstrip()
        if not (through.startswith(before) and text.startswith(through)) or len(through) <= len(before):
            return None
        spans.append((len(before), len(through)))
    return spans or None


def _mask_from_spans(
    spans: list[tuple[int, int]],
    offsets: Sequence[tuple[int, int]],
    ids: Sequence[int],
    end_token_ids: frozenset[int],
    text: str,
) -> list[int]:
    """1 for every token overlapping a span, and for a special token that directly closes a span."""
    mask = [0] * len(ids)
    token = 0
    for span_start, span_end in spans:
        while token < len(ids) and offsets[token][1] <= span_start:
            token += 1
        last_masked = None
        while token < len(ids) and offsets[token][0] < span_end:
            if offsets[token][1] > offsets[token][0]:
                mask[token] = 1
                last_masked = ids[token]
            token += 1
        # The end-of-turn token (e.g. <|im_end|>) closes the turn; only whitespace may separate it.
        # A span that already ends in one (the prefix-diff fallback's do) must not take the next turn's.
        if (
            token < len(ids)
            and last_masked not in end_token_ids
            and ids[token] in end_token_ids
            and not text[span_end : offsets[token][0]].strip()
        ):
            mask[token] = 1
            token += 1
    return mask


def _check_tokenizer(tokenizer: Any) -> None:
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} is not a fast (Rust) tokenizer; the loss mask needs its "
            "offset mapping: load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat_template: the target model "
            "directory needs one (chat_template.jinja or tokenizer_config.json)"
        )


def _check_overlong(overlong: str, max_length: int) -> None:
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong={overlong!r} must be one of {OVERLONG_POLICIES}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")


# --- the shard file -------------------------------------------------------------------------------


def _shard_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("sample_index", pa.int64()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.uint8())),
            ("num_tokens", pa.int32()),
        ],
        metadata={SHARD_FORMAT_KEY: SHARD_FORMAT.encode()},
    )


def write_shard(samples: Sequence[TokenizedSample], path: Path) -> int:
    """Write samples as one Parquet shard (format in the module docstring); returns its size in bytes.

    Written to a temporary name and renamed, so a killed process never leaves a partial shard.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    ordered = sorted(samples, key=lambda s: s.sample_index)
    indices = [s.sample_index for s in ordered]
    if len(set(indices)) != len(indices):
        raise ValueError("duplicate sample_index in shard: every dataset row may appear at most once")
    table = pa.Table.from_arrays(
        [
            pa.array(indices, type=pa.int64()),
            pa.array([s.input_ids for s in ordered], type=pa.list_(pa.int32())),
            pa.array([s.loss_mask for s in ordered], type=pa.list_(pa.uint8())),
            pa.array([s.num_tokens for s in ordered], type=pa.int32()),
        ],
        schema=_shard_schema(),
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        pq.write_table(table, partial, compression="zstd")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path.stat().st_size


def read_shard(source: Path | str | bytes) -> list[TokenizedSample]:
    """Read a shard written by `write_shard` (a path, or the object's bytes fetched from the store)."""
    import pyarrow.parquet as pq

    where = "shard bytes" if isinstance(source, bytes) else str(source)
    table = pq.read_table(io.BytesIO(source) if isinstance(source, bytes) else source)
    missing = {"sample_index", "input_ids", "loss_mask"} - set(table.column_names)
    if missing:
        raise ValueError(f"{where} is not a tokenized shard: missing columns {sorted(missing)}")
    return [
        TokenizedSample(int(index), input_ids, loss_mask)
        for index, input_ids, loss_mask in zip(
            table.column("sample_index").to_pylist(),
            table.column("input_ids").to_pylist(),
            table.column("loss_mask").to_pylist(),
            strict=True,
        )
    ]
