"""A target whose chat template renders tools and tool calls the way Qwen3's does (written for these
tests): the tools block in the system turn, each call as `<tool_call>{"name", "arguments"}</tool_call>`,
tool results as `<tool_response>` inside a user turn, text parts of a multi-part content concatenated;
optionally with `{% generation %}` around what the assistant writes. `tool_target` copies the demo
target with it (and a response template, so `transformers serve` and the in-process engine read its tool
calls back).
"""

from __future__ import annotations

import shutil
from pathlib import Path

_TEMPLATE = r"""
{%- macro text(content) -%}
    {%- if content is string -%}{{- content -}}
    {%- elif content -%}
        {%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- text(messages[0].content) + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call functions. Their signatures, within <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nCall one as <tool_call>\n{"name": <name>, "arguments": <object>}\n' }}
    {{- '</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + text(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'user' or message.role == 'system' %}
        {{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}@OPEN@
        {%- set content = text(message.content) %}
        {%- if message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}
            {%- if call.function %}{%- set call = call.function %}{%- endif %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}{{- call.arguments }}
            {%- else %}{{- call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        @CONTENT_END@{{- '<|im_end|>' }}@TURN_END@{{- '\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

MARKS = ("turn", "content", None)  # {% generation %} around content, calls and <|im_end|>; without it; none


def qwen3_tool_template(mark: str | None = "turn") -> str:
    """The template; `mark` says what `{% generation %}` wraps (None: no markers)."""
    if mark not in MARKS:
        raise ValueError(f"mark must be one of {MARKS}")
    opening = "{%- generation -%}" if mark else ""
    return (
        _TEMPLATE.replace("@OPEN@", opening)
        .replace("@CONTENT_END@", "{%- endgeneration -%}" if mark == "content" else "")
        .replace("@TURN_END@", "{%- endgeneration -%}" if mark == "turn" else "")
    )


# How an answer of this template is read back (transformers' response-template format).
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {
            "open_pattern": r"\s*<tool_call>",
            "close": "</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}


def tool_target(demo_model_dir: Path, destination: Path, mark: str | None = "turn") -> Path:
    """The demo target under `destination`, its tokenizer's chat template the Qwen3-style tool one."""
    from transformers import AutoTokenizer

    if not destination.exists():
        shutil.copytree(demo_model_dir, destination)
        tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
        tokenizer.chat_template = qwen3_tool_template(mark)
        tokenizer.response_template = RESPONSE_TEMPLATE
        for stale in ("chat_template.jinja", "chat_template.json"):
            (destination / stale).unlink(missing_ok=True)
        tokenizer.save_pretrained(destination)
    return destination
