"""Prompt sets: `DFLASH_EVAL_SETS` parsed (every mistake one line naming it), a conversation's prompt (up
to the turn before its last answer), a dataset's first prompts with what was skipped and where, and the
run's held-out samples as prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_assets.conversations.datasets import iter_rows, resolve_dataset, row_location
from dflash_assets.conversations.layouts import Conversation
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.evaluation.prompt_sets import (
    HELD_OUT,
    Prompt,
    PromptSetError,
    PromptSetSpec,
    dataset_prompt_set,
    held_out_prompt_set,
    parse_eval_sets,
    prompt_messages,
)
from dflash_assets.orchestration.user_errors import check_settings
from dflash_assets.settings import ALL_SETTINGS, SettingError


def ask(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def answer(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_held_out_comes_first_then_the_named_sets_in_the_order_written():
    specs = parse_eval_sets(" chat = sharegpt[17000:] ,code=/data/code.jsonl,, tools=s3://bucket/tools/ ")
    assert specs == [
        PromptSetSpec(HELD_OUT, ""),
        PromptSetSpec("chat", "sharegpt[17000:]"),
        PromptSetSpec("code", "/data/code.jsonl"),
        PromptSetSpec("tools", "s3://bucket/tools/"),
    ]
    assert parse_eval_sets("") == parse_eval_sets("  ") == [PromptSetSpec(HELD_OUT, "")]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("chat", "'chat' is not name=reference"),
        ("chat=", "'chat=' is not name=reference"),
        ("chat=  ,code=/c.jsonl", "is not name=reference"),
        ("=/data/chat.jsonl", "the set name ''"),
        ("my set=/data/chat.jsonl", "the set name 'my set'"),
        ("a/b=/data/chat.jsonl", "the set name 'a/b'"),
        (f"{'x' * 65}=/data/chat.jsonl", "at most 64"),
        ("held_out=/data/chat.jsonl", "'held_out' is the run's own held-out rows"),
        ("chat=/a.jsonl,code=/c.jsonl,chat=/b.jsonl", "the set 'chat' is named twice"),
    ],
)
def test_every_mistake_in_dflash_eval_sets_is_one_line_naming_the_setting(text: str, said: str):
    with pytest.raises(PromptSetError) as error:
        parse_eval_sets(text)
    message = str(error.value)
    assert message.startswith("DFLASH_EVAL_SETS: ") and said in message, message
    assert "\n" not in message


def test_the_settings_check_refuses_a_bad_dflash_eval_sets_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path
):
    for setting in ALL_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DFLASH_EVAL_SETS", "chat=sharegpt[17000:],code")
    with pytest.raises(SettingError) as error:
        check_settings()
    assert str(error.value) == (
        "DFLASH_EVAL_SETS: 'code' is not name=reference (e.g. chat=sharegpt[17000:] or code=/data/code.jsonl)"
    )
    monkeypatch.setenv("DFLASH_EVAL_SETS", "chat=sharegpt[17000:],code=/data/code.jsonl")
    check_settings()


def test_a_prompt_is_the_conversation_up_to_the_turn_before_its_last_answer():
    system = {"role": "system", "content": "Be brief."}
    conversation = Conversation([system, ask("q1"), answer("a1"), ask("q2"), answer("a2")])
    assert prompt_messages(conversation) == [system, ask("q1"), answer("a1"), ask("q2")]
    # Two answers in a row: the prompt is what came before both.
    assert prompt_messages(Conversation([ask("q1"), answer("a1"), answer("a1, continued")])) == [ask("q1")]


def test_a_conversation_without_an_answer_is_all_prompt_and_one_of_answers_alone_is_none():
    assert prompt_messages(Conversation([ask("q1")])) == [ask("q1")]
    assert prompt_messages(Conversation([answer("a1")])) is None
    assert prompt_messages(Conversation([{"role": "system", "content": "s"}, answer("a1")])) is None


def test_a_tool_result_is_a_prompt_the_last_answer_replies_to():
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}],
    }
    result = {"role": "tool", "content": '{"celsius": 4}', "tool_call_id": "call-1"}
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    conversation = Conversation([ask("Weather in Oslo?"), call, result, answer("4 °C.")], tools)
    prompt = prompt_messages(conversation)
    assert prompt == [ask("Weather in Oslo?"), call, result]
    prompt[0]["content"] = "changed"  # a copy: the row is not touched
    assert conversation.messages[0]["content"] == "Weather in Oslo?"


def _words(messages: list[dict], tools: list[dict] | None) -> list[int]:
    """A stand-in chat template: one token per word of every turn, the role first, then the tools."""
    if any(m["content"] == "BREAKS THE TEMPLATE" for m in messages):
        raise ValueError("the template cannot render this")
    ids = []
    for message in messages:
        ids += [len(message["role"])] + [len(word) for word in str(message["content"]).split()]
    return ids + [100] * len(tools or [])


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def test_a_dataset_set_is_its_first_prompts_skipping_rows_that_make_none_counted_and_located(tmp_path):
    long_question = " ".join(["word"] * 30)
    rows = [
        {"messages": [ask("one two"), answer("a")]},  # line 1: a prompt
        "{not json",  # line 2: dropped as it is read
        {"messages": [answer("an answer to nothing")]},  # line 3: no prompt
        {"messages": [ask(long_question), answer("a")]},  # line 4: longer than the target can answer
        {"messages": [ask("BREAKS THE TEMPLATE"), answer("a")]},  # line 5: the template fails
        {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                           {"from": "human", "value": "three four five"}, {"from": "gpt", "value": "a2"}]},
        {"messages": [ask("no answer yet")]},  # line 7: all prompt
        {"messages": [ask("never read"), answer("a")]},  # line 8: past the count
    ]  # fmt: skip
    files = resolve_dataset(str(_jsonl(tmp_path / "chats.jsonl", rows)), cache_dir=tmp_path)
    found = dataset_prompt_set(
        PromptSetSpec("chat", "chats.jsonl"),
        iter_rows(files, require_assistant=False),
        _words,
        count=3,
        max_prompt_tokens=12,
        location=lambda index: row_location(files, index),
    )
    assert (found.name, found.reference) == ("chat", "chats.jsonl")
    assert found.prompts == [
        Prompt("line 1", _words([ask("one two")], None)),
        Prompt("line 6", _words([ask("q1"), answer("a1"), ask("three four five")], None)),
        Prompt("line 7", _words([ask("no answer yet")], None)),
    ]
    assert found.rows_read == 7  # line 8 was never read
    assert dict(found.skipped) == {"malformed_json": 1, "no_prompt": 1, "too_long": 1, "template_error": 1}
    assert found.describe_skipped() == (
        "4 row(s) skipped (malformed_json 1, no_prompt 1, template_error 1, too_long 1)"
    )
    assert [detail.split(": ")[:2] for detail in found.skipped_details] == [
        ["line 2", "malformed_json"],
        ["line 3", "no_prompt"],
        ["line 4", "too_long"],
        ["line 5", "template_error"],
    ]
    assert found.skipped_details[1] == "line 3: no_prompt: roles: ['assistant']"
    assert found.skipped_details[2] == "line 4: too_long: 31 tokens, at most 12"  # skipped, never cut
    assert found.skipped_details[3] == "line 5: template_error: ValueError: the template cannot render this"


def test_a_prompt_renders_the_rows_tools_and_one_at_the_limit_is_kept_whole(tmp_path):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    rows = [{"messages": [ask("a b c"), answer("x")], "tools": tools}]
    files = resolve_dataset(str(_jsonl(tmp_path / "tools.jsonl", rows)), cache_dir=tmp_path)
    exactly = len(_words([ask("a b c")], tools))
    found = dataset_prompt_set(
        PromptSetSpec("tools", "tools.jsonl"),
        iter_rows(files, require_assistant=False),
        _words,
        count=16,
        max_prompt_tokens=exactly,
        location=lambda index: row_location(files, index),
    )
    assert found.prompts == [Prompt("line 1", [4, 1, 1, 1, 100])] and found.describe_skipped() == ""


def _sample(index: int, turns: list[tuple[list[int], bool]]) -> TokenizedSample:
    """A tokenized sample from (token ids, assistant?) pieces, in order."""
    ids = [token for tokens, _ in turns for token in tokens]
    mask = [int(assistant) for tokens, assistant in turns for _ in tokens]
    return TokenizedSample(index, ids, mask)


def test_held_out_samples_are_prompts_of_every_token_before_their_last_assistant_turn():
    samples = [
        _sample(41, [([1, 2, 3], False), ([4, 5], True), ([6, 7], False), ([8, 9], True), ([10], False)]),
        _sample(7, [([1, 2], False), ([3, 4, 5], True)]),
        _sample(12, [([1, 2, 3, 4], False)]),  # no assistant token: no prompt
        _sample(30, [([1] * 9, False), ([2], True)]),  # longer than the target can answer
        _sample(3, [([5], True), ([6], False)]),  # assistant from the first token: nothing before it
        _sample(50, [([1], False), ([2], True)]),  # past the count
    ]
    rows = [(s.sample_index, s.input_ids, s.loss_mask) for s in samples]
    found = held_out_prompt_set(rows, count=2, max_prompt_tokens=8)
    assert (found.name, found.reference) == (HELD_OUT, "")
    # By sample index, whatever order the shards held them in.
    assert found.prompts == [Prompt("sample 7", [1, 2]), Prompt("sample 41", [1, 2, 3, 4, 5, 6, 7])]
    assert found.rows_read == 6  # every held-out row is read: the rule spreads the count over lengths
    assert dict(found.skipped) == {"no_prompt": 2, "too_long": 1}
    assert found.skipped_details == [
        "sample 3: no_prompt: no assistant token after the first",
        "sample 12: no_prompt: no assistant token after the first",
        "sample 30: too_long: 9 tokens, at most 8",
    ]
