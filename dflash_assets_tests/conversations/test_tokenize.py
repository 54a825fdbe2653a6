"""Tokenizing conversations: the assistant loss mask under real chat templates, drops, and the shard file."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from dflash_assets.conversations.datasets import Dropped
from dflash_assets.conversations.layouts import Conversation
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.conversations.shard import SHARD_FORMAT, read_shard, write_shard
from dflash_assets.conversations.tokenize import TooManyBadRows, tokenize_conversation, tokenize_range

# A Qwen3-style template written for these tests: system first, reasoning stripped from assistant
# turns before the last user message, and a (possibly empty) <think> block on the turns after it.
QWEN3_STYLE_TEMPLATE = """
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n')
                                       .split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_user %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'
                + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Rewrites assistant text (newlines -> spaces), so contents are not found verbatim: the prefix-diff
# fallback has to find the turns. No newline between turns, so the next header follows <|im_end|>.
REWRITING_TEMPLATE = """
{%- for message in messages %}
    {%- set content = message.content | replace('\\n', ' ')
                      if message.role == 'assistant' else message.content %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Rewrites assistant text AND renders differently depending on the whole conversation: nothing can
# locate the assistant turns reliably.
UNLOCATABLE_TEMPLATE = """
{{- messages | length }} messages
{%- for message in messages %}
    {{- '<|im_start|>' + message.role + '\\n' + (message.content | upper) + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

END = "<|im_end|>"

MULTI_TURN = [
    {"role": "system", "content": "You are a careful math tutor."},
    {"role": "user", "content": "What is 12 × 3?"},
    {"role": "assistant", "content": "<think>\nTen threes are 30, two more are 6.\n</think>\n\n12 × 3 = 36."},
    {"role": "user", "content": "Repeat after me: 36 is even."},
    {"role": "assistant", "content": "36 is even."},
    {"role": "user", "content": "And 36 ÷ 4?"},
    {"role": "assistant", "content": "<think>\nQuarter of 36.\n</think>\n\n36 ÷ 4 = 9."},
]


@pytest.fixture
def tokenizer(demo_model_dir: Path):
    return AutoTokenizer.from_pretrained(demo_model_dir)


def with_template(demo_model_dir: Path, template: str):
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    tokenizer.chat_template = template
    return tokenizer


def masked_text(tokenizer, sample: TokenizedSample) -> str:
    return tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_loss_mask_covers_exactly_each_assistant_reply_and_its_end_token(tokenizer) -> None:
    sample = tokenize_conversation(tokenizer, MULTI_TURN, sample_index=7)
    assert isinstance(sample, TokenizedSample) and sample.sample_index == 7
    replies = [m["content"] for m in MULTI_TURN if m["role"] == "assistant"]
    assert masked_text(tokenizer, sample) == "".join(reply + END for reply in replies)
    # The ids are exactly what the chat template produces; the mask adds nothing to the text.
    assert sample.input_ids == tokenizer.apply_chat_template(MULTI_TURN, return_dict=False)
    assert set(sample.loss_mask) == {0, 1}


def test_loss_mask_follows_a_qwen3_template_that_strips_earlier_reasoning(demo_model_dir: Path) -> None:
    tokenizer = with_template(demo_model_dir, QWEN3_STYLE_TEMPLATE)
    sample = tokenize_conversation(tokenizer, MULTI_TURN)
    assert isinstance(sample, TokenizedSample), sample
    rendered = tokenizer.decode(sample.input_ids)
    assert "Ten threes" not in rendered  # the template dropped the first turn's reasoning
    assert masked_text(tokenizer, sample) == (
        "12 × 3 = 36." + END + "36 is even." + END + "<think>\nQuarter of 36.\n</think>\n\n36 ÷ 4 = 9." + END
    )


def test_an_empty_think_block_the_template_inserts_is_not_trained_on(demo_model_dir: Path) -> None:
    tokenizer = with_template(demo_model_dir, QWEN3_STYLE_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    sample = tokenize_conversation(tokenizer, messages)
    assert "<think>\n\n</think>\n\nHello there." in tokenizer.decode(sample.input_ids)
    assert masked_text(tokenizer, sample) == "Hello there." + END


def test_templates_that_rewrite_assistant_text_fall_back_to_prefix_rendering(demo_model_dir: Path) -> None:
    tokenizer = with_template(demo_model_dir, REWRITING_TEMPLATE)
    messages = [
        {"role": "user", "content": "Two lines please."},
        {"role": "assistant", "content": "Line one.\nLine two."},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "A\nB"},
    ]
    sample = tokenize_conversation(tokenizer, messages)
    assert isinstance(sample, TokenizedSample), sample
    assert masked_text(tokenizer, sample) == "Line one. Line two." + END + "A B" + END


def test_a_conversation_whose_replies_cannot_be_located_is_dropped(demo_model_dir: Path) -> None:
    tokenizer = with_template(demo_model_dir, UNLOCATABLE_TEMPLATE)
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi there"}]
    outcome = tokenize_conversation(tokenizer, messages)
    assert isinstance(outcome, Dropped) and outcome.reason == "assistant_not_located"


def test_a_failing_chat_template_drops_the_row_with_its_message(demo_model_dir: Path) -> None:
    tokenizer = with_template(
        demo_model_dir,
        "{%- if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}"
        "{%- endif %}" + REWRITING_TEMPLATE,
    )
    outcome = tokenize_conversation(tokenizer, MULTI_TURN)
    assert isinstance(outcome, Dropped) and outcome.reason == "template_error"
    assert "first message must be from the user" in outcome.detail


def test_overlong_conversations_are_truncated_or_dropped_as_configured(tokenizer) -> None:
    long_reply = " ".join(f"step {i} done." for i in range(60))
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": long_reply}]
    full = tokenize_conversation(tokenizer, messages)
    assert full.num_tokens > 40

    cut = tokenize_conversation(tokenizer, messages, max_length=40)
    assert cut.input_ids == full.input_ids[:40] and cut.loss_mask == full.loss_mask[:40]

    dropped = tokenize_conversation(tokenizer, messages, max_length=40, overlong="drop")
    assert isinstance(dropped, Dropped) and dropped.reason == "overlong"

    late_answer = [{"role": "user", "content": long_reply}, {"role": "assistant", "content": "Done."}]
    nothing_left = tokenize_conversation(tokenizer, late_answer, max_length=40)
    assert isinstance(nothing_left, Dropped) and nothing_left.reason == "overlong_no_assistant"

    with pytest.raises(ValueError, match="overlong"):
        tokenize_conversation(tokenizer, messages, overlong="keep")


def test_a_range_reports_kept_samples_drops_by_reason_and_the_first_bad_line(
    tokenizer, tmp_path: Path
) -> None:
    good = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]}
    path = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            good,
            good,
            "{not json",
            good,
            {"messages": [{"role": "user", "content": "no answer"}]},
            {"messages": [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "late"}]},
            good,
        ],
    )
    progress: list[tuple[int, int]] = []
    result = tokenize_range(
        tokenizer, path, SampleRange(1, 99), max_length=64, on_progress=lambda *p: progress.append(p)
    )
    assert [s.sample_index for s in result.samples] == [1, 3, 6]
    assert result.dropped == {2: "malformed_json", 4: "no_assistant", 5: "overlong_no_assistant"}
    assert result.dropped_by_reason == {"malformed_json": 1, "no_assistant": 1, "overlong_no_assistant": 1}
    assert result.rows == 6 and result.truncated == 0
    assert result.tokens == sum(s.num_tokens for s in result.samples)
    assert result.loss_tokens == sum(sum(s.loss_mask) for s in result.samples)
    assert result.max_length == result.samples[0].num_tokens and result.mean_length == result.max_length
    assert result.first_bad.location == "line 3" and result.first_bad.reason == "malformed_json"
    assert progress[-1] == (6, 3)


def test_a_range_with_too_many_bad_rows_fails_naming_the_file_and_first_bad_line(
    tokenizer, tmp_path: Path
) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = write_jsonl(tmp_path / "broken.jsonl", [good, "{oops", {"messages": []}, "[1]"])
    with pytest.raises(TooManyBadRows, match=r"3 of 4 rows.*broken\.jsonl line 2: malformed_json"):
        tokenize_range(tokenizer, path, SampleRange(0, 9))
    assert len(tokenize_range(tokenizer, path, SampleRange(0, 9), max_bad_fraction=0.8).samples) == 1


def test_the_bundled_sample_tokenizes_without_drops(tokenizer) -> None:
    result = tokenize_range(tokenizer, None, SampleRange(0, 9999))
    assert result.rows >= 300 and not result.dropped
    assert all(s.loss_mask[-2:] == [1, 0] for s in result.samples)  # ... <|im_end|> "\n"


def test_shards_round_trip_with_the_documented_columns_and_types(tmp_path: Path) -> None:
    samples = [TokenizedSample(12, [5, 6, 7], [0, 1, 1]), TokenizedSample(3, [1, 2**20], [1, 0])]
    path = tmp_path / "partition" / "shard.parquet"
    size = write_shard(samples, path)

    assert size == path.stat().st_size and [p.name for p in path.parent.iterdir()] == ["shard.parquet"]
    schema = pq.read_schema(path)
    assert [(f.name, str(f.type)) for f in schema] == [
        ("sample_index", "int64"),
        ("input_ids", "list<element: int32>"),
        ("loss_mask", "list<element: uint8>"),
        ("num_tokens", "int32"),
    ]
    assert schema.metadata[b"dflash_format"] == SHARD_FORMAT.encode()
    assert pq.read_table(path).column("num_tokens").to_pylist() == [2, 3]
    expected = sorted(samples, key=lambda s: s.sample_index)
    assert read_shard(path) == expected
    assert read_shard(path.read_bytes()) == expected


def test_a_shard_refuses_duplicate_sample_indices(tmp_path: Path) -> None:
    samples = [TokenizedSample(1, [1], [1]), TokenizedSample(1, [2], [1])]
    with pytest.raises(ValueError, match="duplicate sample_index"):
        write_shard(samples, tmp_path / "shard.parquet")
    assert list(tmp_path.iterdir()) == []


# --- tool calls ------------------------------------------------------------------------------------


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def weather_call(city: str, call_id: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": city}},
    }


TOOL_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [weather_call("Paris", "c1")]},
    {"role": "tool", "tool_call_id": "c1", "content": "18C and sunny"},
    {"role": "user", "content": "And Oslo and Rome?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [weather_call("Oslo", "c2"), weather_call("Rome", "c3")],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "3C"},
    {"role": "tool", "tool_call_id": "c3", "content": "24C"},
    {"role": "assistant", "content": "Oslo 3C, Rome 24C."},
]


def template_mask(tokenizer, messages, tools) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


@pytest.mark.parametrize("mark", ["turn", "content", None])
def test_tool_calls_are_learned_and_tool_results_and_the_tools_block_are_not(
    demo_model_dir: Path, mark
) -> None:
    """Whatever `{% generation %}` marks (the turn, its text without <|im_end|>, or nothing: the calls
    are then found by rendering without them), the mask is the assistant turns and their <|im_end|>."""
    from dflash_assets_tests.support.tool_target import qwen3_tool_template

    tokenizer = with_template(demo_model_dir, qwen3_tool_template(mark))
    sample = tokenize_conversation(tokenizer, Conversation(TOOL_TURNS, [WEATHER_TOOL]))
    assert isinstance(sample, TokenizedSample), sample
    assert sample.input_ids == tokenizer.apply_chat_template(
        TOOL_TURNS, tools=[WEATHER_TOOL], return_dict=False
    )
    marked = with_template(demo_model_dir, qwen3_tool_template("turn"))
    assert sample.loss_mask == template_mask(marked, TOOL_TURNS, [WEATHER_TOOL])[1]
    learned = masked_text(tokenizer, sample)
    assert learned == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' + END
        + "Checking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' + END
        + "Oslo 3C, Rome 24C." + END
    )  # fmt: skip
    unlearned = tokenizer.decode(
        [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m]
    )
    assert "# Tools" in unlearned and '"name": "get_weather", "parameters"' in unlearned  # the tools block
    assert "<tool_response>\n18C and sunny\n</tool_response>" in unlearned  # a tool's result


def test_a_template_marking_text_without_the_end_of_turn_token_gets_it_added(demo_model_dir: Path) -> None:
    from dflash_assets_tests.support.tool_target import qwen3_tool_template

    tokenizer = with_template(demo_model_dir, qwen3_tool_template("content"))
    ids, marked = template_mask(tokenizer, TOOL_TURNS, [WEATHER_TOOL])
    sample = tokenize_conversation(tokenizer, Conversation(TOOL_TURNS, [WEATHER_TOOL]))
    end = tokenizer.convert_tokens_to_ids(END)
    added = [p for p, (m, n) in enumerate(zip(marked, sample.loss_mask, strict=True)) if n and not m]
    assert len(added) == 3 and all(ids[p] == end and marked[p - 1] for p in added)


def test_a_template_that_does_not_render_tool_calls_drops_the_row_naming_the_message(tokenizer) -> None:
    outcome = tokenize_conversation(tokenizer, Conversation(TOOL_TURNS, [WEATHER_TOOL]))  # the demo's ChatML
    assert outcome == Dropped(
        "assistant_not_located", "the chat template does not render message 2's tool calls"
    )
