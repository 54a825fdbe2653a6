"""One interface for every way of asking the target: the scheduler hands out turns, an engine answers them.

`TurnScheduler` holds the conversations of a range. A conversation has one turn in the queue at a time
(its next answer depends on the previous one); answering it hands the answer to `on_answered` (the
journal) and queues the next turn, and the last answer hands the finished conversation to
`on_finished`. Engines pull as many turns as they can use at once: the in-process engine a batch, a
server engine one per request slot.

The next turn of a conversation already under way goes out before the first turn of one not started:
the engine's slots stay full (new conversations fill whatever the others leave free), while the
conversations in progress finish as soon as they can. A range's data is then usable part-way, and a
kill leaves few conversations half-answered, instead of every first turn answered and none finished.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dflash_assets.conversations.datasets import Dropped, Messages
from dflash_assets.generation.conversation import Answer, Regeneration


class EngineUnavailable(RuntimeError):
    """The engine cannot answer at all (server unreachable, another model, failing for good): the range
    fails, and every finished conversation stays persisted for the rerun."""


def new_token_limit(prompt_tokens: int, max_new_tokens: int, context_tokens: int | None) -> int:
    """New tokens a turn may ask for: `max_new_tokens`, cut to what the target's context leaves after the
    prompt, so prompt plus answer never pass `max_position_embeddings` (an answer cut there ends with
    `finish_reason: length`). Below 1 there is no room: the row is dropped (`no_room`)."""
    if context_tokens is None:
        return max_new_tokens
    return min(max_new_tokens, context_tokens - prompt_tokens)


def no_room(prompt_tokens: int, context_tokens: int | None) -> Dropped:
    return Dropped(
        "exceeds_context",
        f"a prompt of {prompt_tokens} tokens leaves no room for an answer in the target's "
        f"{context_tokens} positions",
    )


def past_max_length(turn: int, prompt_tokens: int, max_conversation_tokens: int | None) -> Dropped | None:
    """Why a conversation's first turn is not asked at all: its prompt alone reaches the training length
    (`max_conversation_tokens`, DFLASH_MAX_LENGTH), so training would cut every token of the answer.
    None for a turn worth asking (a later turn's bound is checked after each answer: `Regeneration`)."""
    if turn or max_conversation_tokens is None or prompt_tokens < max_conversation_tokens:
        return None
    return Dropped(
        "prompt_past_max_length",
        f"its prompt is {prompt_tokens} tokens, at least DFLASH_MAX_LENGTH={max_conversation_tokens}: "
        "training would cut the whole answer",
    )


@dataclass
class EngineStats:
    requests: int = 0  # turns sent to the engine (one per server request)
    retries: int = 0
    server_errors: int = 0  # 408/429/5xx answers and dropped connections
    in_flight: int = 0
    # New tokens of turns not answered yet (an engine that sees them as they come: the in-process one);
    # a progress line says them while no conversation finishes.
    tokens_in_flight: int = 0


@dataclass(frozen=True)
class TurnRequest:
    conversation: Regeneration
    turn: int  # which answer of the conversation (0-based)
    messages: Messages  # the history to answer

    @property
    def sample_index(self) -> int:
        return self.conversation.sample_index

    @property
    def tools(self) -> list[dict] | None:
        """The row's tools, rendered into every turn's prompt (and sent to servers)."""
        return self.conversation.tools


class TurnScheduler:
    """Thread-safe queue of the next turn of every unfinished conversation."""

    def __init__(
        self,
        conversations: Sequence[Regeneration],
        *,
        on_finished: Callable[[Regeneration], None],
        on_dropped: Callable[[Regeneration, Dropped], None],
        on_answered: Callable[[Regeneration, int, Answer], None] | None = None,
    ) -> None:
        """`conversations` may hold answers already (turns answered before a kill): they resume at
        their next turn, ahead of the conversations not started."""
        self._on_finished, self._on_dropped, self._on_answered = on_finished, on_dropped, on_answered
        self._condition = threading.Condition()
        self._continuing: deque[TurnRequest] = deque()  # next turns of conversations under way
        self._fresh: deque[TurnRequest] = deque()  # first turns, in sample order
        self._taken = 0
        self._unfinished = 0
        self._error: BaseException | None = None
        for conversation in conversations:
            self._unfinished += 1
            (self._continuing if conversation.answers else self._fresh).append(self._next(conversation))

    @staticmethod
    def _next(conversation: Regeneration) -> TurnRequest:
        return TurnRequest(conversation, len(conversation.answers), conversation.next_prompt())

    @property
    def unfinished(self) -> int:
        with self._condition:
            return self._unfinished

    def take(self, limit: int | None = None, timeout_s: float | None = None) -> list[TurnRequest]:
        """Up to `limit` ready turns (all of them by default), waiting for one if none is ready yet.
        An empty list means every conversation is done (or `timeout_s` passed with nothing ready)."""
        with self._condition:
            while not self._ready() and self._unfinished and self._error is None:
                if not self._condition.wait(timeout=timeout_s) and timeout_s is not None:
                    break
            if self._error is not None:
                raise self._error
            count = self._ready() if limit is None else min(limit, self._ready())
            # Conversations under way first.
            taken = [(self._continuing or self._fresh).popleft() for _ in range(count)]
            self._taken += len(taken)
            return taken

    def _ready(self) -> int:
        return len(self._continuing) + len(self._fresh)

    def answer(self, request: TurnRequest, answer: Answer) -> None:
        conversation = request.conversation
        if len(conversation.answers) != request.turn:
            raise RuntimeError(f"sample {request.sample_index}: turn {request.turn} answered twice")
        conversation.answers.append(answer)
        if self._on_answered is not None:
            self._on_answered(conversation, request.turn, answer)  # journaled before the next turn goes
        finished = conversation.finished
        if finished:
            self._on_finished(conversation)  # persisted before the conversation counts as done
        with self._condition:
            self._taken -= 1
            if finished:
                self._unfinished -= 1
            else:
                self._continuing.append(self._next(conversation))
            self._condition.notify_all()

    def drop(self, request: TurnRequest, dropped: Dropped) -> None:
        self._on_dropped(request.conversation, dropped)
        with self._condition:
            self._taken -= 1
            self._unfinished -= 1
            self._condition.notify_all()

    def abort(self, error: BaseException) -> None:
        """Stop handing out turns; every `take` raises `error` from now on."""
        with self._condition:
            if self._error is None:
                self._error = error
            self._condition.notify_all()

    def raise_if_aborted(self) -> None:
        with self._condition:
            if self._error is not None:
                raise self._error


class Engine(ABC):
    """Answers turns until the scheduler has none left. `name` is recorded with every conversation."""

    name: str
    stats: EngineStats
    counts_tokens_live = False  # whether `stats.tokens_in_flight` follows tokens as they are made

    @abstractmethod
    def run(self, scheduler: TurnScheduler, tick: Callable[[], None]) -> None:
        """Answer every turn the scheduler holds or will hold; call `tick` now and then (progress)."""

    def close(self) -> None:  # noqa: B027 - engines without resources need nothing here
        pass
