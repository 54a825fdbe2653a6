"""A scripted engine: answers from the prompt itself, counts what it was asked, fails on cue.

Its answer names the sample, the turn and the last prompt message, so a test can read off which
history each answer was generated from."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from dflash_assets.conversations.datasets import Dropped
from dflash_assets.generation.conversation import Answer
from dflash_assets.generation.engine import Engine, EngineStats, EngineUnavailable, TurnRequest, TurnScheduler


def scripted_content(request: TurnRequest) -> str:
    last = request.messages[-1]["content"] if request.messages else ""
    return f"answer {request.sample_index}.{request.turn} to [{last}]"


class ScriptedEngine(Engine):
    def __init__(
        self,
        *,
        fail_after: int | None = None,
        refuse: set[int] | frozenset[int] = frozenset(),
        truncate: set[int] | frozenset[int] = frozenset(),
        batch: int = 3,
        tool_calls: Callable[[TurnRequest], list[dict] | None] | None = None,
        prompt_tokens: Callable[[TurnRequest], int] | None = None,
    ) -> None:
        """`tool_calls(request)`: the calls an answer makes (None: none); `prompt_tokens(request)`: the
        prompt's length each answer states (None: none, as a server that counts nothing). Every answer
        is 5 tokens long."""
        self.name = "scripted"
        self.stats = EngineStats()
        self.asked: list[tuple[int, int]] = []  # (sample, turn) of every request
        self.tools_seen: dict[tuple[int, int], list[dict] | None] = {}  # the tools each request carried
        self.fail_after, self.refuse, self.truncate, self.batch = fail_after, refuse, truncate, batch
        self.tool_calls, self.prompt_tokens = tool_calls, prompt_tokens
        self._lock = threading.Lock()

    def run(self, scheduler: TurnScheduler, tick: Callable[[], None]) -> None:
        while requests := scheduler.take(limit=self.batch):
            for request in requests:
                if self.fail_after is not None and len(self.asked) >= self.fail_after:
                    raise EngineUnavailable("scripted engine: the server went away")
                with self._lock:
                    self.asked.append((request.sample_index, request.turn))
                    self.tools_seen[(request.sample_index, request.turn)] = request.tools
                    self.stats.requests += 1
                if request.sample_index in self.refuse:
                    scheduler.drop(request, Dropped("generation_failed", "HTTP 400: prompt too long"))
                    continue
                content = scripted_content(request)
                finish = "length" if request.sample_index in self.truncate else "stop"
                calls = self.tool_calls(request) if self.tool_calls else None
                answer = Answer(
                    content=content,
                    finish_reason=finish,
                    completion_tokens=5,
                    tool_calls=calls,
                    prompt_tokens=self.prompt_tokens(request) if self.prompt_tokens else None,
                )
                scheduler.answer(request, answer)
            tick()

    def opener(self) -> Callable[[], contextlib.AbstractContextManager[Engine]]:
        @contextlib.contextmanager
        def open_engine() -> Iterator[Engine]:
            yield self

        return open_engine


def never_opened() -> contextlib.AbstractContextManager[Engine]:
    raise AssertionError("the engine was opened although nothing was left to generate")
