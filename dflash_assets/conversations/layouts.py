"""Rows of any layout as one shape: a `Conversation` (OpenAI-style messages plus the row's tools), or
`Dropped` saying why the row cannot be used. Everything after this module sees only that shape; the chat
template renders it (tools and tool calls included), never our code.

Layouts (`DFLASH_DATASET_FORMAT`; `auto` decides by the fields a row has):

- `messages`: `{"messages": [{"role", "content", ...}], "tools": [...]}`, roles system, user,
  assistant and tool. Content is a string or a list of parts (`{"type": "text", "text": ...}`), the text
  parts joined as Qwen-family templates render them (concatenated); a part of another type (an image)
  drops the row. Assistant `tool_calls` are kept, each as `{"type": "function", "function": {"name",
  "arguments"}, "id"}` with the arguments an object (a string holding a JSON object is decoded, as vLLM
  does before rendering; any other string is kept as written). `tool` messages keep `tool_call_id`.
- `sharegpt`: `{"conversations": [{"from", "value"}], "system": ..., "tools": ...}`, `from` mapped by
  `SHAREGPT_ROLES` (`human` -> user, `gpt` -> assistant, `function_call` -> an assistant tool call whose
  value is the call's JSON, `observation` -> tool, ...).

A `messages` row may also carry `exact_ids` (`EXACT_IDS_FIELD`), written by `dflash-assets
export-completions`: the target's own answers as `target_completions` stored them, token ids included.
Such a row becomes a Conversation holding its messages and tools exactly as written (never normalised:
the same JSON the target's record held) and an `ExactIds`, so it tokenizes to the very ids and mask the
target's record did; a malformed block drops the row as `bad_exact_ids`.

A field holding a JSON string (`messages`, `conversations`, `tools`, a message's `tool_calls`,
`exact_ids`: how Parquet shards often store nested data) is decoded first. Tools given as bare function
schemas are wrapped as `{"type": "function", "function": schema}`, the form `transformers` builds from
functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

DATASET_FORMATS = ("auto", "messages", "sharegpt")
_MISSING = {"auto": "unknown_layout", "messages": "missing_messages", "sharegpt": "missing_conversations"}
ALLOWED_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",  # ShareGPT V3's answers from other assistants
    "bard": "assistant",
    "function_call": "assistant",  # its value is the call: {"name", "arguments"} (or a list of them)
    "tool": "tool",
    "observation": "tool",
    "function_response": "tool",
}

# Every reason a row can be dropped for, here and in tokenize.py: the one list to document.
DROP_REASONS: dict[str, str] = {
    "not_utf8": "the line is not valid UTF-8",
    "empty_line": "the line is blank",
    "malformed_json": "the line, or a field stored as a JSON string (`messages`, `conversations`, `tools`, "
    "`tool_calls`, a ShareGPT `function_call` value), is not valid JSON",
    "unknown_layout": "the row has neither `messages` nor ShareGPT `conversations` "
    "(DFLASH_DATASET_FORMAT=auto); the detail names the fields it has",
    "missing_messages": "the row is not an object with a `messages` field (DFLASH_DATASET_FORMAT=messages)",
    "missing_conversations": "the row is not an object with a ShareGPT `conversations` field "
    "(DFLASH_DATASET_FORMAT=sharegpt)",
    "messages_not_a_list": "`messages` (or ShareGPT `conversations`) is not a list",
    "bad_message": "a message is not an object with text content (a string, or text parts)",
    "non_text_content": "a message's content has a part that is not text (an image, audio, a file): the "
    "detail names it",
    "bad_tool_call": "an assistant's `tool_calls` is not a list of calls each naming its function",
    "bad_tools": "the row's `tools` is not a list of tool schemas (objects)",
    "unknown_role": f"a message's role (ShareGPT `from`) is missing or not one of {', '.join(ALLOWED_ROLES)} "
    f"(ShareGPT: {', '.join(SHAREGPT_ROLES)})",
    "empty_assistant": "an assistant message has neither content nor tool calls",
    "no_assistant": "the conversation has no assistant message",
    "template_error": "the tokenizer's chat template failed on the conversation",
    "assistant_not_located": "an assistant message (its text or its tool calls) could not be found in the "
    "rendered chat template",
    "overlong": "longer than max_length tokens and overlong='drop'",
    "overlong_no_assistant": "truncating to max_length left no assistant token",
    # Regeneration (target_completions): why the target gave no usable answer for a row.
    "no_prompt": "the conversation has no user or tool turn for the target to answer",
    "generation_failed": "the inference server refused the request for good (e.g. a prompt too long)",
    "exceeds_context": "the prompt fills the target's context (max_position_embeddings): no room to answer",
    "prompt_past_max_length": "the conversation's first prompt alone is DFLASH_MAX_LENGTH tokens or more: "
    "training would cut its whole answer, so it is not asked",
    "truncated_answer": "an answer hit max_new_tokens and truncated='drop'",
    # An exported row (`dflash-assets export-completions`) read back as a dataset.
    "bad_exact_ids": "the row's `exact_ids` (the target's answers with their token ids, written by "
    "`dflash-assets export-completions`) is malformed: the detail says what",
}
EXACT_IDS_FIELD = "exact_ids"

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Dropped:
    """Why a row was left out: `reason` is a key of DROP_REASONS, `detail` says what exactly."""

    reason: str
    detail: str = ""

    def __post_init__(self) -> None:
        if self.reason not in DROP_REASONS:
            raise ValueError(f"unknown drop reason {self.reason!r}; known: {sorted(DROP_REASONS)}")

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


@dataclass(frozen=True)
class ExactIds:
    """The target's own answers of an exported row, as `target_completions` recorded them: `turns` (per
    answer: `message`, its index in the messages; `finish_reason`; `completion_token_ids` where the engine
    returned them), the last answer's exact prompt ids, and the chat-template arguments they were made
    with. Tokenized by `tokenize.AnswerTokenizer.last_answer`, as the stored record is."""

    turns: list[dict[str, Any]]
    prompt_token_ids: list[int] | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Conversation:
    """One row in the one shape: messages as the chat template takes them, and the row's tools (None:
    the row has none), passed to the template as `tools=`; `exact_ids` where the row carries the target's
    own answers with their token ids (an exported row: see the module's docstring)."""

    messages: Messages
    tools: list[dict[str, Any]] | None = None
    exact_ids: ExactIds | None = None

    def identity(self) -> Any:
        """What the row's content is, for digests: the messages alone when there are no tools, so rows
        without tools digest as they did before tools were read."""
        return self.messages if self.tools is None else {"messages": self.messages, "tools": self.tools}


def check_dataset_format(layout: str) -> str:
    if layout not in DATASET_FORMATS:
        raise ValueError(f"DFLASH_DATASET_FORMAT={layout!r} must be one of {', '.join(DATASET_FORMATS)}")
    return layout


def row_layout(fields: Any, layout: str) -> str | None:
    """Which layout a row with these fields is read as (None: neither), under `DFLASH_DATASET_FORMAT`."""
    if layout != "auto":
        return layout
    if "messages" in fields:
        return "messages"
    if "conversations" in fields:
        return "sharegpt"
    return None


def conversation_from_row(
    row: Any, layout: str = "auto", *, require_assistant: bool = True
) -> Conversation | Dropped:
    """One dataset row (a decoded JSON object, or a Parquet row's columns) as a Conversation.

    `require_assistant=False` is for conversations the target answers itself: a prompts-only row and an
    empty assistant message are fine there."""
    if not isinstance(row, dict):
        what = f"the row is a JSON {type(row).__name__}, not an object"
        return Dropped(_MISSING[layout], what)
    present = {name for name, value in row.items() if value is not None}
    # Decided by the fields with a value; a Parquet row's null column still says which field it lacks.
    chosen = row_layout(present, layout) or row_layout(row.keys(), layout)
    if chosen is None:
        return Dropped("unknown_layout", f"fields: {sorted(row)[:12]}")
    name = "messages" if chosen == "messages" else "conversations"
    if row.get(name) is None:
        reason = "missing_messages" if chosen == "messages" else "missing_conversations"
        what = f"{name!r} is null" if name in row else f"no {name!r} field (fields: {sorted(row)[:12]})"
        return Dropped(reason, what)
    if row.get(EXACT_IDS_FIELD) is not None:
        return _exported_conversation(row, chosen)
    turns = _json_field(row[name], name)
    if isinstance(turns, Dropped):
        return turns
    if chosen == "sharegpt":
        turns = sharegpt_messages(turns, system=row.get("system"))
        if isinstance(turns, Dropped):
            return turns
    tools = parse_tools(row.get("tools"))
    if isinstance(tools, Dropped):
        return tools
    messages = parse_messages(turns, require_assistant=require_assistant)
    if isinstance(messages, Dropped):
        return messages
    return Conversation(messages, tools)


def _exported_conversation(row: dict[str, Any], layout: str) -> Conversation | Dropped:
    """A row carrying `exact_ids`: its messages and tools kept exactly as written (they are the target's
    record, and any normalising would render other ids than the target saw), after the same checks any
    row gets; every answer the exact ids name must be an assistant message of the row."""
    if layout != "messages":
        return Dropped("bad_exact_ids", f"{EXACT_IDS_FIELD!r} goes with the `messages` layout, not {layout}")
    messages = _json_field(row["messages"], "messages")
    if isinstance(messages, Dropped):
        return messages
    # An earlier answer of the target's may be empty (an end-of-turn token alone): its record kept it.
    checked = parse_messages(messages, require_assistant=False)
    if isinstance(checked, Dropped):
        return checked
    tools = _json_field(row.get("tools"), "tools")
    if isinstance(tools, Dropped):
        return tools
    parsed_tools = parse_tools(tools)
    if isinstance(parsed_tools, Dropped):
        return parsed_tools
    exact = parse_exact_ids(row[EXACT_IDS_FIELD], messages)
    if isinstance(exact, Dropped):
        return exact
    return Conversation(messages, tools if parsed_tools is not None else None, exact)


def parse_exact_ids(value: Any, messages: Messages) -> ExactIds | Dropped:
    """A row's `exact_ids` block checked against its `messages`: `Dropped("bad_exact_ids", <what>)` for
    anything a tokenizer could not use as the target's record (so a broken row is one line, never a
    crash)."""
    value = _json_field(value, EXACT_IDS_FIELD)
    if isinstance(value, Dropped):
        return value

    def bad(what: str) -> Dropped:
        return Dropped("bad_exact_ids", what)

    if not isinstance(value, dict):
        return bad(f"{EXACT_IDS_FIELD!r} is a {type(value).__name__}, not an object")
    turns = value.get("turns")
    if not isinstance(turns, list) or not turns:
        return bad("'turns' is not a non-empty list of answers")
    for number, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return bad(f"turn {number} is a {type(turn).__name__}, not an object")
        position = turn.get("message")
        if not _is_int(position) or not 0 <= position < len(messages):
            return bad(f"turn {number}'s 'message' {position!r} is not an index of the row's messages")
        if messages[position].get("role") != "assistant":
            return bad(
                f"turn {number} names message {position}, a {messages[position].get('role')!r} message"
            )
        if not isinstance(turn.get("finish_reason"), str):
            return bad(f"turn {number} has no 'finish_reason' string")
        problem = _id_list_problem(turn.get("completion_token_ids"))
        if problem:
            return bad(f"turn {number}'s 'completion_token_ids' {problem}")
    prompt_ids = value.get("prompt_token_ids")
    problem = _id_list_problem(prompt_ids)
    if problem:
        return bad(f"'prompt_token_ids' {problem}")
    kwargs = value.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return bad(f"'chat_template_kwargs' is a {type(kwargs).__name__}, not an object")
    return ExactIds(turns, prompt_ids, dict(kwargs or {}))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _id_list_problem(ids: Any) -> str | None:
    """What is wrong with a list of token ids (None: nothing, or no list, which a record may lack)."""
    if ids is None:
        return None
    if not isinstance(ids, list):
        return f"is a {type(ids).__name__}, not a list of token ids"
    for position, token in enumerate(ids):
        if not _is_int(token) or token < 0:
            return f"holds {token!r} at position {position}, not a token id"
    return None


def as_conversation(row: Any, *, require_assistant: bool = True) -> Conversation | Dropped:
    """A row already read (a Conversation or Dropped), or a bare message list, checked as a Conversation."""
    if isinstance(row, Dropped):
        return row
    if isinstance(row, Conversation):
        messages = parse_messages(row.messages, require_assistant=require_assistant)
        return messages if isinstance(messages, Dropped) else Conversation(messages, row.tools)
    messages = parse_messages(row, require_assistant=require_assistant)
    return messages if isinstance(messages, Dropped) else Conversation(messages)


def _json_field(value: Any, name: str) -> Any:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as err:
            return Dropped("not_utf8", f"{name!r} byte offset {err.start} is not UTF-8")
    if not isinstance(value, str) or not value.lstrip().startswith(("[", "{")):
        return value  # not JSON-encoded data: the field's own check says what it is instead
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        return Dropped("malformed_json", f"{name!r} string: {err.msg} at column {err.colno}")
    except RecursionError:
        return Dropped("malformed_json", f"{name!r} string: nested too deeply")


def sharegpt_messages(turns: Any, *, system: Any = None) -> Messages | Dropped:
    """ShareGPT `conversations` (and a row-level `system`) as OpenAI-style messages."""
    if not isinstance(turns, list):
        return Dropped("messages_not_a_list", f"'conversations' is a {type(turns).__name__}")
    messages: Messages = []
    for position, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return Dropped("bad_message", f"turn {position} is a {type(turn).__name__}, not an object")
        if "from" not in turn and "role" in turn:  # some ShareGPT sets write OpenAI-style turns
            messages.append(turn)
            continue
        speaker = turn.get("from")
        speaker = speaker.lower() if isinstance(speaker, str) else speaker
        role = SHAREGPT_ROLES.get(speaker)
        if role is None:
            return Dropped("unknown_role", f"turn {position} is from {turn.get('from')!r}")
        value = turn.get("value")
        if speaker == "function_call":
            calls = _json_field(value, f"turn {position} function_call value")
            if isinstance(calls, Dropped):
                return calls
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        else:
            messages.append({"role": role, "content": value})
    # A row-level system prompt (LLaMA-Factory's layout) opens the conversation unless the turns have one.
    if isinstance(system, str) and system.strip() and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def parse_tools(tools: Any) -> list[dict[str, Any]] | None | Dropped:
    """A row's `tools` as the template takes them (None: the row has none)."""
    if tools is None or tools == "":
        return None
    tools = _json_field(tools, "tools")
    if isinstance(tools, Dropped):
        return tools
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        return Dropped("bad_tools", f"'tools' is a {type(tools).__name__}, not a list of objects")
    if not tools:
        return None
    # Parquet structs carry every key of the column's schema, mostly null: a schema never means them.
    tools = [_without_nulls(tool) for tool in tools]
    return [{"type": "function", "function": t} if "name" in t and "type" not in t else t for t in tools]


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def parse_messages(messages: Any, *, require_assistant: bool = True) -> Messages | Dropped:
    """Check one conversation's message list; return it (messages copied, normalised) or why it is
    unusable. `require_assistant=False`: see `conversation_from_row`."""
    if not isinstance(messages, list):
        return Dropped("messages_not_a_list", f"'messages' is a {type(messages).__name__}")
    checked: Messages = []
    has_assistant = False
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            return Dropped("bad_message", f"message {position} is a {type(message).__name__}, not an object")
        role = message.get("role")
        if role not in ALLOWED_ROLES:
            return Dropped("unknown_role", f"message {position} has role {role!r}")
        content = message_text(message.get("content"), position)
        if isinstance(content, Dropped):
            return content
        tool_calls = parse_tool_calls(message.get("tool_calls"), position)
        if isinstance(tool_calls, Dropped):
            return tool_calls
        if role == "assistant":
            if require_assistant and not content.strip() and not tool_calls:
                return Dropped("empty_assistant", f"message {position} (assistant) has no content")
            has_assistant = True
        # Parquet structs carry every field of the schema, mostly null; the template only wants real ones.
        normalised = {k: v for k, v in message.items() if v is not None and k != "tool_calls"}
        normalised["content"] = content
        if tool_calls:
            normalised["tool_calls"] = tool_calls
        checked.append(normalised)
    if require_assistant and not has_assistant:
        return Dropped("no_assistant", f"roles: {[m['role'] for m in checked]}")
    return checked


def message_text(content: Any, position: int) -> str | Dropped:
    """A message's content as text: a string as it is, text parts concatenated (as Qwen-family templates
    render a list of parts), None as empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return Dropped("bad_message", f"message {position} content is a {type(content).__name__}, not text")
    texts = []
    for number, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type", "text") if isinstance(part, dict) else None
        if kind != "text":
            what = f"a {kind!r} part" if isinstance(kind, str) else f"a {type(part).__name__}"
            reason = "non_text_content" if isinstance(kind, str) else "bad_message"
            return Dropped(reason, f"message {position} content part {number} is {what}")
        if not isinstance(part.get("text"), str):
            return Dropped("bad_message", f"message {position} content part {number} has no string 'text'")
        texts.append(part["text"])
    return "".join(texts)


def parse_tool_calls(tool_calls: Any, position: int) -> list[dict[str, Any]] | Dropped:
    """An assistant's tool calls in the one form `{"type": "function", "function": {"name", "arguments"},
    "id"?}`, arguments an object where the dataset's string holds one; [] for none."""
    if tool_calls is None or tool_calls == "" or tool_calls == []:
        return []
    tool_calls = _json_field(tool_calls, f"message {position} tool_calls")
    if isinstance(tool_calls, Dropped):
        return tool_calls
    if isinstance(tool_calls, dict):  # one call, not wrapped in a list
        tool_calls = [tool_calls]
    if not isinstance(tool_calls, list):
        return Dropped("bad_tool_call", f"message {position} tool_calls is a {type(tool_calls).__name__}")
    calls = []
    for number, call in enumerate(tool_calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            return Dropped("bad_tool_call", f"message {position} tool call {number} names no function")
        normalised: dict[str, Any] = {
            "type": "function",
            "function": {"name": name, "arguments": tool_arguments(function.get("arguments"))},
        }
        if isinstance(call, dict) and call.get("id") is not None:
            normalised["id"] = call["id"]
        calls.append(normalised)
    return calls


def tool_arguments(arguments: Any) -> Any:
    """A call's arguments as an object: a JSON string holding one is decoded, None is {}; any other
    value (a string that is not a JSON object) is kept as written."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return arguments
        return decoded if isinstance(decoded, dict) else arguments
    return arguments


def tool_call_signature(tool_calls: Any) -> list[tuple[str, Any]]:
    """What a turn's tool calls ask for, ids aside: (name, arguments) in order. Two turns whose
    signatures are equal call the same tools with the same arguments."""
    calls = parse_tool_calls(tool_calls, 0)
    if isinstance(calls, Dropped):
        return [("<unreadable>", str(tool_calls))]
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
