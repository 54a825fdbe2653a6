"""Rows of every layout become one Conversation: ShareGPT, JSON-string fields, multi-part content, tool
calls with their arguments as strings or objects, and the drops that name what was wrong."""

from __future__ import annotations

import json

import pytest

from dflash_assets.conversations.layouts import (
    DROP_REASONS,
    Conversation,
    Dropped,
    conversation_from_row,
    tool_call_signature,
)

WEATHER = {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def test_sharegpt_roles_become_messages_with_the_row_level_system_and_tools():
    row = {
        "system": "Be brief.",
        "tools": json.dumps([WEATHER]),
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": "18C"},
            {"from": "gpt", "value": "It is 18C."},
        ],
    }
    conversation = conversation_from_row(row)
    assert conversation == Conversation(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": "It is 18C."},
        ],
        tools=[{"type": "function", "function": WEATHER}],
    )


def test_sharegpt_v3s_other_assistants_answer_as_the_assistant():
    for speaker in ("chatgpt", "bing", "bard", "Bing"):
        row = {"conversations": [{"from": "human", "value": "q"}, {"from": speaker, "value": "a"}]}
        assert conversation_from_row(row).messages[1] == {"role": "assistant", "content": "a"}, speaker


def test_a_sharegpt_system_turn_is_kept_and_the_row_level_one_not_repeated():
    turns = [{"from": "system", "value": "S"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    row = {"system": "ignored", "conversations": turns}
    messages = conversation_from_row(row).messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant"] and messages[0]["content"] == "S"


def test_text_parts_are_joined_and_a_part_that_is_not_text_drops_the_row_naming_it():
    parts = [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]
    row = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": [{"type": "text",
           "text": "18C."}]}]}  # fmt: skip
    assert conversation_from_row(row).messages[0]["content"] == "Weather in Paris?"

    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    dropped = conversation_from_row(
        {"messages": [{"role": "user", "content": [*parts, image]}, row["messages"][1]]}
    )
    assert dropped == Dropped("non_text_content", "message 0 content part 2 is a 'image_url' part")


def test_tool_call_arguments_as_a_string_and_as_an_object_become_one_form():
    as_string = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    flat = {"name": "get_weather", "arguments": {"city": "Paris"}}  # some sets write calls unwrapped
    for call in (as_string, flat):
        row = {"messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": None,
               "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "18C"},
               {"role": "assistant", "content": "18C."}]}  # fmt: skip
        messages = conversation_from_row(row).messages
        expected = {**CALL, "id": "c1"} if "id" in call else CALL
        assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [expected]}
        assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "18C"}
    assert (
        tool_call_signature([as_string])
        == tool_call_signature([flat])
        == [("get_weather", {"city": "Paris"})]
    )


def test_json_string_columns_are_decoded_as_parquet_shards_store_them():
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": None,
                "tool_calls": json.dumps([CALL])}]  # fmt: skip
    conversation = conversation_from_row(
        {"messages": json.dumps(messages), "tools": json.dumps([WEATHER]), "id": 7}
    )
    assert conversation.messages[1]["tool_calls"] == [CALL]
    assert conversation.tools == [{"type": "function", "function": WEATHER}]


def test_an_assistant_turn_that_only_calls_a_tool_is_not_empty():
    row = {
        "messages": [
            {"role": "user", "content": "?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
        ]
    }
    assert isinstance(conversation_from_row(row), Conversation)
    empty = {
        "messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": []}]
    }
    assert conversation_from_row(empty).reason == "empty_assistant"


@pytest.mark.parametrize(
    ("row", "layout", "reason", "detail"),
    [
        ({"prompt": "x", "answer": "y"}, "auto", "unknown_layout", "fields: ['answer', 'prompt']"),
        (
            {"conversations": [{"from": "human", "value": "q"}]},
            "messages",
            "missing_messages",
            "conversations",
        ),
        ({"messages": [{"role": "user", "content": "q"}]}, "sharegpt", "missing_conversations", "messages"),
        ({"conversations": [{"from": "narrator", "value": "q"}]}, "auto", "unknown_role", "'narrator'"),
        ({"messages": [], "tools": "[{broken"}, "auto", "malformed_json", "'tools' string"),
        (
            {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]},
            "auto",
            "bad_tool_call",
            "names no function",
        ),  # fmt: skip
        ({"messages": [], "tools": [["not", "a", "schema"]]}, "auto", "bad_tools", "list of objects"),
        ({"messages": None, "conversations": None}, "auto", "missing_messages", "'messages' is null"),
    ],
)
def test_a_row_that_cannot_be_read_is_dropped_naming_what_it_has(row, layout, reason, detail):
    dropped = conversation_from_row(row, layout)
    assert isinstance(dropped, Dropped) and dropped.reason == reason and reason in DROP_REASONS
    assert detail in dropped.detail


def test_the_setting_forces_a_layout_that_auto_would_not_choose():
    row = {
        "messages": "unused",
        "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}],
    }
    assert conversation_from_row(row, "auto").reason == "messages_not_a_list"  # auto reads `messages` first
    assert conversation_from_row(row, "sharegpt").messages[1] == {"role": "assistant", "content": "a"}
