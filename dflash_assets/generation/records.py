"""The `target_completions` objects: one JSON line per conversation, in chunks while a range runs and in
one `completions.jsonl` per range once it is complete.

A record (format `dflash-assets.completions/1`):

    {"sample_index": 17,                      the row's 0-based position in the source dataset
     "messages": [...],                       the conversation, every assistant turn the target's
     "turns": [{"message": 2,                 index into messages of an answer the target wrote
                "finish_reason": "stop",      "stop" (ended its turn) or "length" (cut at max_new_tokens)
                "completion_tokens": 57,
                "completion_token_ids": [...]}],   where the engine returned them
     "prompt_token_ids": [...],               the exact prompt of the last answer, where returned
     "tools": [...],                          the row's tools, where it has any (every prompt had them)
     "ended_early": "tool_calls_differ",      where later turns were not asked for: a turn's tool calls left
                                              the dataset's, or "max_length": the conversation reached
                                              DFLASH_MAX_LENGTH tokens
     "engine": "in-process"}

A row that could not be answered is a line `{"sample_index": 18, "dropped": "<reason>", "detail": "..."}`
in the chunks; the range's manifest lists such rows under `dropped` and `completions.jsonl` leaves them out.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_assets.conversations.layouts import Dropped
from dflash_assets.generation.conversation import Regeneration

COMPLETIONS_FORMAT = "dflash-assets.completions/1"


@dataclass(frozen=True)
class CompletionRecord:
    sample_index: int
    messages: list[dict[str, Any]]
    turns: list[dict[str, Any]]
    prompt_token_ids: list[int] | None
    engine: str
    tools: list[dict[str, Any]] | None = None
    ended_early: str | None = None  # `Regeneration.ended_because()`: later turns not asked for

    @classmethod
    def from_regeneration(cls, conversation: Regeneration, engine: str) -> CompletionRecord:
        turns = []
        answered = conversation.positions[: len(conversation.answers)]
        for position, answer in zip(answered, conversation.answers, strict=True):
            turn: dict[str, Any] = {
                "message": _message_index(conversation, position),
                "finish_reason": answer.finish_reason,
                "completion_tokens": answer.num_tokens(),
            }
            if answer.completion_token_ids is not None:
                turn["completion_token_ids"] = list(answer.completion_token_ids)
            turns.append(turn)
        last = conversation.answers[-1]
        return cls(
            sample_index=conversation.sample_index,
            messages=conversation.messages(),
            turns=turns,
            prompt_token_ids=list(last.prompt_token_ids) if last.prompt_token_ids is not None else None,
            engine=engine,
            tools=conversation.tools,
            ended_early=conversation.ended_because(),
        )

    @property
    def truncated(self) -> bool:
        return any(turn["finish_reason"] == "length" for turn in self.turns)

    @property
    def tool_call_turns(self) -> int:
        """The target's answers that called tools."""
        return sum(bool(self.messages[int(turn["message"])].get("tool_calls")) for turn in self.turns)

    @property
    def generated_tokens(self) -> int:
        return sum(int(turn.get("completion_tokens") or 0) for turn in self.turns)

    def to_json(self) -> str:
        body: dict[str, Any] = {
            "sample_index": self.sample_index,
            "messages": self.messages,
            "turns": self.turns,
        }
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        if self.tools is not None:
            body["tools"] = self.tools
        if self.ended_early is not None:
            body["ended_early"] = self.ended_early
        body["engine"] = self.engine
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True)
class DroppedRow:
    sample_index: int
    dropped: Dropped

    def to_json(self) -> str:
        return json.dumps(
            {
                "sample_index": self.sample_index,
                "dropped": self.dropped.reason,
                "detail": self.dropped.detail,
            },
            ensure_ascii=False,
        )


Line = CompletionRecord | DroppedRow


def _message_index(conversation: Regeneration, position: int) -> int:
    # Positions count source messages, assistant ones included; the regenerated conversation drops
    # nothing, so a position is its index there too.
    return position


def parse_line(text: str, where: str) -> Line:
    """One line of a chunk or of `completions.jsonl`; a clear error names the object and the line."""
    try:
        body = json.loads(text)
        index = int(body["sample_index"])
        if "dropped" in body:
            return DroppedRow(index, Dropped(body["dropped"], body.get("detail", "")))
        return CompletionRecord(
            sample_index=index,
            messages=list(body["messages"]),
            turns=list(body["turns"]),
            prompt_token_ids=body.get("prompt_token_ids"),
            engine=str(body.get("engine", "")),
            tools=body.get("tools"),
            ended_early=body.get("ended_early"),
        )
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{where}: not a completion record ({type(error).__name__}: {error})") from None


def read_lines(path: Path, *, tolerate_torn_tail: bool = False) -> list[Line]:
    """Every record of a file. With `tolerate_torn_tail`, a last line without its newline (a write cut
    short by a kill) is left out instead of failing: it was never acknowledged."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # after the last newline: b"" for a complete file
    out = [parse_line(line.decode(), f"{path} line {n + 1}") for n, line in enumerate(lines) if line.strip()]
    if tail.strip() and not tolerate_torn_tail:
        raise ValueError(f"{path}: the last line has no newline (a partial write)")
    return out


def chunk_name(lines: Iterable[Line]) -> str:
    """`chunk-<first>-<last>-<digest>.jsonl`: the same records always give the same name."""
    items = sorted(lines, key=lambda line: line.sample_index)
    digest = hashlib.sha256("\n".join(line.to_json() for line in items).encode()).hexdigest()[:12]
    return f"chunk-{items[0].sample_index:08d}-{items[-1].sample_index:08d}-{digest}.jsonl"


def is_chunk_name(name: str) -> bool:
    return name.startswith("chunk-") and name.endswith(".jsonl")


def write_lines(path: Path, lines: Iterable[Line]) -> int:
    """Write records atomically (a temporary name, then a rename); returns the size in bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "w", encoding="utf-8") as handle:
            for line in lines:
                handle.write(line.to_json() + "\n")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path.stat().st_size


def iter_records(path: Path) -> Iterator[CompletionRecord]:
    """The records of a range's `completions.jsonl` (dropped rows are not in it)."""
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            if text.strip():
                line = parse_line(text, f"{path} line {number}")
                if isinstance(line, CompletionRecord):
                    yield line
