"""Which turns of a conversation the target answers, and the conversation it ends up with.

System, user and tool turns are kept as written. Every assistant turn is regenerated, in order, against
the history as regenerated so far (so turn 2 answers what the target itself said in turn 1); an empty
assistant message is answered like any other, and a conversation that ends with a user (or tool) turn
gets an answer appended (a prompts-only dataset). The row's tools go with every turn.

Tool calls: a regenerated turn whose tool calls differ from the dataset's turn (other functions or
arguments, ids aside; calls where the dataset has none, or none where it has some) ends the conversation
there: the dataset's tool results answer the dataset's calls, not the target's, so nothing after that
turn is asked for or kept. A turn whose calls match keeps the dataset's call ids, so the tool results
still refer to them.

Length: with a token budget (`GenerationSettings.max_conversation_tokens`, the training length
DFLASH_MAX_LENGTH), an answer that brings the conversation to the budget ends it there too: training cuts
every sample at that length, so a later turn would start past it, paid for and never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_assets.conversations.layouts import (
    Dropped,
    Messages,
    as_conversation,
    parse_tool_calls,
    tool_call_signature,
)

# Why a conversation ended before its last turn (a record's `ended_early`).
ENDED_AT_TOOL_CALLS = "tool_calls_differ"  # a turn's tool calls left the dataset's
ENDED_AT_MAX_LENGTH = "max_length"  # the conversation reached its token budget


@dataclass
class Answer:
    """What the engine said for one turn. Token ids are kept where the engine returns them, so training
    never re-tokenises the target's own words."""

    content: str
    finish_reason: str  # "stop" (the target ended its turn) or "length" (cut at max_new_tokens)
    reasoning: str | None = None  # a reasoning block the engine returned apart from the content
    tool_calls: list[dict[str, Any]] | None = None  # the calls the engine parsed from the answer
    completion_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        calls = parse_tool_calls(self.tool_calls, 0)
        if calls and not isinstance(calls, Dropped):
            message["tool_calls"] = calls
        return message

    def num_tokens(self) -> int:
        if self.completion_token_ids is not None:
            return len(self.completion_token_ids)
        return self.completion_tokens or 0

    def conversation_tokens(self) -> int:
        """Tokens of the conversation up to the end of this answer: its prompt and itself, as ids where the
        engine returned them, else as counted. A count the engine left out is 0: an undercount only asks
        for more turns, never for fewer."""
        prompt = len(self.prompt_token_ids) if self.prompt_token_ids is not None else self.prompt_tokens
        return (prompt or 0) + self.num_tokens()


@dataclass
class Regeneration:
    """One conversation on its way through the engine: the turns answered so far, and what is next."""

    sample_index: int
    source: Messages  # as read from the dataset
    answers: list[Answer] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # where each answer goes in `messages`
    tools: list[dict[str, Any]] | None = None  # the row's tools, passed with every turn
    # No later turn once an answer ends at this many tokens of conversation (None: no bound); see
    # `GenerationSettings.max_conversation_tokens`.
    token_budget: int | None = None

    def __post_init__(self) -> None:
        if not self.positions:
            self.positions = answer_positions(self.source)

    @property
    def turns(self) -> int:
        """Turns to answer: every assistant turn, or up to the one the conversation ends at early."""
        cut = self.ended_at()
        return len(self.positions) if cut is None else cut + 1

    @property
    def finished(self) -> bool:
        return len(self.answers) >= self.turns

    def ended_at(self) -> int | None:
        """The answer (0-based) after which the conversation ends early, when a later turn would have
        followed (`ended_because` says why); else None."""
        ending = self._ending()
        return None if ending is None else ending[0]

    def ended_because(self) -> str | None:
        """Why the conversation ends early: ENDED_AT_TOOL_CALLS (an answer's tool calls differ from the
        dataset's turn) or ENDED_AT_MAX_LENGTH (an answer brought it to `token_budget` tokens); else None."""
        ending = self._ending()
        return None if ending is None else ending[1]

    def _ending(self) -> tuple[int, str] | None:
        for number, answer in enumerate(self.answers[: len(self.positions) - 1]):
            if tool_call_signature(answer.tool_calls) != tool_call_signature(self._source_calls(number)):
                return number, ENDED_AT_TOOL_CALLS
            if self.token_budget is not None and answer.conversation_tokens() >= self.token_budget:
                return number, ENDED_AT_MAX_LENGTH
        return None

    def _source_calls(self, number: int) -> Any:
        position = self.positions[number]
        return self.source[position].get("tool_calls") if position < len(self.source) else None

    def next_prompt(self) -> Messages:
        """The history the next answer is generated from (earlier answers already the target's own)."""
        return self._messages_through(self.positions[len(self.answers)])

    def messages(self) -> Messages:
        """The whole conversation with every assistant turn the target's (up to where it ended)."""
        cut = self.ended_at()
        return self._messages_through(len(self.source) + 1 if cut is None else self.positions[cut] + 1)

    def _messages_through(self, stop: int) -> Messages:
        out: Messages = []
        answers = dict(zip(self.positions, enumerate(self.answers), strict=False))
        for position in range(min(stop, len(self.source) + 1)):
            if position in answers:
                number, answer = answers[position]
                out.append(self._with_dataset_call_ids(answer.message(), number))
            elif position < len(self.source) and self.source[position]["role"] != "assistant":
                out.append(dict(self.source[position]))
        return out

    def _with_dataset_call_ids(self, message: dict[str, Any], number: int) -> dict[str, Any]:
        """An answer whose calls match the dataset's takes their ids: the tool results refer to them."""
        source = parse_tool_calls(self._source_calls(number), 0)
        calls = message.get("tool_calls")
        same = not isinstance(source, Dropped) and tool_call_signature(calls) == tool_call_signature(source)
        if not calls or not same:
            return message
        message["tool_calls"] = [
            {**call, "id": theirs["id"]} if "id" in theirs else call
            for call, theirs in zip(calls, source, strict=True)
        ]
        return message


def answer_positions(messages: Messages) -> list[int]:
    """Indexes (in the regenerated conversation) of the turns the target answers: every assistant
    message, plus one past the end when the conversation ends with a non-assistant turn."""
    positions = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if messages and messages[-1]["role"] != "assistant":
        positions.append(len(messages))
    return positions


def plan_regeneration(sample_index: int, row: Any, token_budget: int | None = None) -> Regeneration | Dropped:
    """A dataset row (its Conversation or messages, or why they are unusable) as a conversation to
    regenerate; `token_budget`: see `Regeneration.token_budget`."""
    conversation = as_conversation(row, require_assistant=False)
    if isinstance(conversation, Dropped):
        return conversation
    messages = conversation.messages
    if not any(message["role"] in ("user", "tool") for message in messages):
        return Dropped("no_prompt", f"roles: {[m['role'] for m in messages]}")
    return Regeneration(sample_index, messages, tools=conversation.tools, token_budget=token_budget)
