"""An answer the target wrote in this process, read into content, reasoning and tool calls the way
`transformers serve` reads it: the tokenizer's `response_template` (saved in its `tokenizer_config.json`),
else the one `transformers serve` falls back to for the model's type; without either, no tool calls are
read (the answer stays text, and a dataset turn that called tools ends its conversation there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def response_template(tokenizer: Any, model_config: Any) -> dict[str, Any] | None:
    """The response template answers are parsed with (None: none is known for this target)."""
    template = getattr(tokenizer, "response_template", None)
    if template is not None:
        return template
    try:  # transformers serve's own fallbacks, by model type; a CLI module, so it may be absent
        from transformers.cli.serving.utils import get_response_template
    except ImportError:
        return None
    try:
        return get_response_template(tokenizer, model_config)
    except (AttributeError, TypeError):
        return None


def parse_answer(
    tokenizer: Any,
    template: dict[str, Any] | None,
    completion: Sequence[int],
    prompt: Sequence[int],
    tools: list[dict[str, Any]] | None,
) -> tuple[str, str | None, list[dict[str, Any]]] | None:
    """(content, reasoning, tool calls) of one answer's ids after its prompt, or None without a template
    or when it cannot be parsed (the caller then keeps the text as it is)."""
    if template is None:
        return None
    try:
        parsed = tokenizer.parse_response(list(completion), template, prefix=list(prompt), tools=tools)
    except Exception:  # noqa: BLE001 - an unparsable answer stays text, as a server without a parser keeps it
        return None
    content = parsed.get("content") or ""
    reasoning = parsed.get("reasoning_content") or parsed.get("thinking") or None
    calls = [call for call in parsed.get("tool_calls") or [] if isinstance(call, dict)]
    return content.strip(), reasoning.strip() if isinstance(reasoning, str) else None, calls
