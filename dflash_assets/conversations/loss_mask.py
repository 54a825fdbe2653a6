"""The assistant loss mask under a chat template: which tokens of a rendered conversation the target
itself produced.

The mask is 1 on what the target writes in each assistant turn as the chat template renders it (its
content and its tool calls), plus the end-of-turn token right after it (`<|im_end|>` in ChatML), so a
drafter learns to stop. Headers (`<|im_start|>assistant\\n`), system, user and tool turns, the tools
block and template scaffolding (e.g. an empty `<think></think>` the template inserts) stay 0.

A template that marks assistant text with `{% generation %}` decides the mask itself (transformers'
`return_assistant_tokens_mask`), plus the end-of-turn token after each marked span. Other templates are
rendered once and each assistant content is located in the text; an assistant's tool calls (and a
`reasoning_content` field) are what the rendering gains from them (the conversation rendered again
without that turn's field, the difference taken); character spans map to tokens through the fast
tokenizer's offsets.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dflash_assets.conversations.layouts import Dropped, Messages

_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class TemplateLayout:
    header: str | None  # start of an assistant turn in rendered text, e.g. "<|im_start|>assistant"
    end_token_ids: frozenset[int]  # special tokens that may close an assistant turn
    marks_generation: bool = False  # the template wraps assistant text in {% generation %}


@dataclass(frozen=True)
class Rendered:
    """A conversation under the chat template: its text and the character spans the target wrote, or
    (templates with `{% generation %}`) its token ids and the finished mask."""

    text: str
    spans: list[tuple[int, int]]
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None


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
    marks = bool(_GENERATION_MARK.search(str(getattr(tokenizer, "chat_template", "") or "")))
    return TemplateLayout(header, frozenset(special_ids), marks)


def render_with_spans(
    tokenizer: Any,
    layout: TemplateLayout,
    messages: Messages,
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Rendered | Dropped:
    """The conversation rendered with its tools, and where the target's words are in it."""
    kwargs = dict(chat_template_kwargs or {})

    def render(these: Messages, prompt: bool = add_generation_prompt) -> str:
        return tokenizer.apply_chat_template(
            these, tools=tools, tokenize=False, add_generation_prompt=prompt, **kwargs
        )

    try:
        if layout.marks_generation:
            return _marked_rendering(tokenizer, layout, messages, tools, add_generation_prompt, kwargs)
        text = render(messages)
    except Exception as err:
        return Dropped("template_error", f"{type(err).__name__}: {err}"[:300])
    spans = locate_assistant_spans(text, messages, layout.header)
    if spans is None:
        spans = _prefix_diff_spans(render, text, messages)
    if spans is None:
        return Dropped(
            "assistant_not_located", "assistant content not found verbatim in the rendered template"
        )
    written = _written_field_spans(render, text, messages, layout.header)
    if isinstance(written, Dropped):
        return written
    return Rendered(text, sorted(spans + written))


def _marked_rendering(
    tokenizer: Any,
    layout: TemplateLayout,
    messages: Messages,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
) -> Rendered:
    """The template's own assistant mask, and the end-of-turn token right after each marked span."""
    out = tokenizer.apply_chat_template(
        messages,
        tools=tools,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    ids, mask = [int(i) for i in out["input_ids"]], [int(m) for m in out["assistant_masks"]]
    for position in range(len(ids) - 1):
        closes = mask[position] and not mask[position + 1] and ids[position + 1] in layout.end_token_ids
        if closes and ids[position] not in layout.end_token_ids:
            mask[position + 1] = 1
    return Rendered("", [], ids, mask)


def _written_field_spans(
    render: Callable[[Messages], str], text: str, messages: Messages, header: str | None
) -> list[tuple[int, int]] | Dropped:
    """Where each assistant's tool calls and reasoning are in `text`: what rendering the field adds to
    the conversation rendered without it. Tool calls the template does not render drop the row (the
    target's turn cannot be shown); reasoning it strips (earlier turns, in Qwen3-style templates) is
    simply not there."""
    fields = ("reasoning_content", "tool_calls")
    if not any(m["role"] == "assistant" and any(m.get(f) for f in fields) for m in messages):
        return []
    turn_starts = _turn_starts(text, header)
    spans: list[tuple[int, int]] = []
    assistant = -1
    for position, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        assistant += 1
        floor = turn_starts[assistant] if assistant < len(turn_starts) else 0
        for name in fields:
            if not message.get(name):
                continue
            without = [dict(m) for m in messages]
            del without[position][name]
            try:
                other = render(without)
            except Exception as err:
                return Dropped("template_error", f"message {position} without its {name}: {err}"[:300])
            span = _added_span(text, other, floor)
            if span is not None:
                spans.append(span)
            elif name == "tool_calls":
                return Dropped(
                    "assistant_not_located",
                    f"the chat template does not render message {position}'s tool calls",
                )
    return spans


def _turn_starts(text: str, header: str | None) -> list[int]:
    """Where what each assistant writes may start: after each header and the newline closing it."""
    if not header:
        return []
    starts, at = [], text.find(header)
    while at >= 0:
        end = at + len(header)
        starts.append(end + 1 if text.startswith("\n", end) else end)
        at = text.find(header, end)
    return starts


def _added_span(text: str, other: str, floor: int) -> tuple[int, int] | None:
    """The part of `text` that `other` lacks. An insertion can often sit at several places (its first
    characters equal those after it): the first one at or after `floor` (where the turn's own text
    starts) is taken, so neither the header's newline nor the next tag's first character is counted."""
    shortest = min(len(text), len(other))
    suffix = 0
    while suffix < shortest and text[-1 - suffix] == other[-1 - suffix]:
        suffix += 1
    prefix = 0
    while prefix < shortest and text[prefix] == other[prefix]:
        prefix += 1
    extra = len(text) - len(other)
    if extra > 0 and prefix + suffix >= len(other):  # a pure insertion: any start in [lowest, prefix]
        start = max(len(other) - suffix, min(prefix, floor))
        return start, start + extra
    start, end = min(prefix, shortest - suffix), len(text) - suffix
    return (start, max(end, start)) if end > start else None


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
        if message["role"] == "assistant" and message.get("tool_calls") and not content.strip():
            # Only tool calls, which `_tool_call_spans` finds: step over the turn's header.
            if header:
                if next_header < 0:
                    return None
                cursor = next_header + len(header)
            continue
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


def _prefix_diff_spans(
    render: Callable[..., str], text: str, messages: Messages
) -> list[tuple[int, int]] | None:
    """Fallback: an assistant turn is what rendering messages[:i+1] adds to messages[:i] plus the
    generation prompt. Only valid when the template renders every prefix as a prefix of the whole."""
    spans: list[tuple[int, int]] = []
    for position, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if position == 0:
            return None  # no prompt before it to diff against
        try:
            before = render(messages[:position], True)
            through = render(messages[: position + 1], False)
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
