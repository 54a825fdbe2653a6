"""Which turns of a conversation the target answers, and the conversation it ends up with.

System, user and tool turns are kept as written. Every assistant turn is regenerated, in order, against
the history as regenerated so far (so turn 2 answers what the target itself said in turn 1); an empty
assistant message is answered like any other, and a conversation that ends with a user (or tool) turn
gets an answer appended (a prompts-only dataset).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_assets.conversations.datasets import Dropped, Messages, parse_messages


@dataclass
class Answer:
    """What the engine said for one turn. Token ids are kept where the engine returns them, so training
    never re-tokenises the target's own words."""

    content: str
    finish_reason: str  # "stop" (the target ended its turn) or "length" (cut at max_new_tokens)
    reasoning: str | None = None  # a reasoning block the engine returned apart from the content
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
        return message

    def num_tokens(self) -> int:
        if self.completion_token_ids is not None:
            return len(self.completion_token_ids)
        return self.completion_tokens or 0


@dataclass
class Regeneration:
    """One conversation on its way through the engine: the turns answered so far, and what is next."""

    sample_index: int
    source: Messages  # as read from the dataset
    answers: list[Answer] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # where each answer goes in `messages`

    def __post_init__(self) -> None:
        if not self.positions:
            self.positions = answer_positions(self.source)

    @property
    def turns(self) -> int:
        return len(self.positions)

    @property
    def finished(self) -> bool:
        return len(self.answers) == len(self.positions)

    def next_prompt(self) -> Messages:
        """The history the next answer is generated from (earlier answers already the target's own)."""
        return self._messages_through(self.positions[len(self.answers)])

    def messages(self) -> Messages:
        """The whole conversation with every assistant turn the target's."""
        return self._messages_through(len(self.source) + 1)

    def _messages_through(self, stop: int) -> Messages:
        out: Messages = []
        answers = dict(zip(self.positions, self.answers, strict=False))
        for position in range(min(stop, len(self.source) + 1)):
            if position in answers:
                out.append(answers[position].message())
            elif position < len(self.source) and self.source[position]["role"] != "assistant":
                out.append(dict(self.source[position]))
        return out


def answer_positions(messages: Messages) -> list[int]:
    """Indexes (in the regenerated conversation) of the turns the target answers: every assistant
    message, plus one past the end when the conversation ends with a non-assistant turn."""
    positions = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    if messages and messages[-1]["role"] != "assistant":
        positions.append(len(messages))
    return positions


def plan_regeneration(sample_index: int, row: Any) -> Regeneration | Dropped:
    """A dataset row (its messages, or why they are unusable) as a conversation to regenerate."""
    if isinstance(row, Dropped):
        return row
    messages = parse_messages(row, require_assistant=False)
    if isinstance(messages, Dropped):
        return messages
    if not any(message["role"] in ("user", "tool") for message in messages):
        return Dropped("no_prompt", f"roles: {[m['role'] for m in messages]}")
    return Regeneration(sample_index, messages)
