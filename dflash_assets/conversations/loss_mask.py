"""The assistant loss mask under a chat template: which tokens of a rendered conversation the target
itself produced.

The mask is 1 on each assistant message's content as the chat template renders it, plus the end-of-turn
token right after it (`<|im_end|>` in ChatML), so a drafter learns to stop. Headers
(`<|im_start|>assistant\\n`), system and user turns and template scaffolding (e.g. an empty
`<think></think>` the template inserts) stay 0. It does not rely on `{% generation %}` markers: the
conversation is rendered once, each assistant content is located in the rendered text, and character
spans are mapped to tokens through the fast tokenizer's offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflash_assets.conversations.datasets import Dropped, Messages


@dataclass(frozen=True)
class TemplateLayout:
    header: str | None  # start of an assistant turn in rendered text, e.g. "<|im_start|>assistant"
    end_token_ids: frozenset[int]  # special tokens that may close an assistant turn


def template_layout(tokenizer: Any) -> TemplateLayout:
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
    return TemplateLayout(header, frozenset(special_ids))


def render_with_spans(
    tokenizer: Any, layout: TemplateLayout, messages: Messages
) -> tuple[str, list[tuple[int, int]]] | Dropped:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:
        return Dropped("template_error", f"{type(err).__name__}: {err}"[:300])
    spans = locate_assistant_spans(text, messages, layout.header)
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


def locate_assistant_spans(text: str, messages: Messages, header: str | None) -> list[tuple[int, int]] | None:
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


def mask_from_spans(
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


def end_of_turn_id(tokenizer: Any, layout: TemplateLayout) -> int | None:
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


def check_tokenizer(tokenizer: Any) -> None:
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
