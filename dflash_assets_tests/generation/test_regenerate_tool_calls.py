"""Regenerating tool-calling rows: the row's tools go with every turn, a turn whose calls match the
dataset's continues (with the dataset's call ids), one whose calls differ ends the conversation there
and is counted, and a kill right after such a turn never asks for it again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from dflash_assets.conversations.layouts import Conversation
from dflash_assets.generation.records import CompletionRecord, parse_line
from dflash_assets.generation.regenerate import completions_fingerprint, dataset_identity, regenerate_range
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.storage.layout import COMPLETIONS_NAME
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.uploader import Uploader
from dflash_assets_tests.support.engines import ScriptedEngine

PREFIX = "target-completions/00000000-00000099"
SETTINGS = GenerationSettings(max_new_tokens=16)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def weather(city: str, call_id: str | None = None, *, as_string: bool = False) -> dict:
    arguments = json.dumps({"city": city}) if as_string else {"city": city}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {**call, "id": call_id} if call_id else call


def tool_row(index: int) -> Conversation:
    """Ask, call the tool, its result, the answer; then a follow-up question and its answer."""
    city = f"city{index}"
    return Conversation(
        [
            {"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [weather(city, f"call-{index}")]},
            {"role": "tool", "tool_call_id": f"call-{index}", "content": f"{index}C"},
            {"role": "assistant", "content": f"{index}C in {city}."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You're welcome."},
        ],
        tools=[WEATHER],
    )


def rows_of(count: int) -> list[tuple[int, Conversation]]:
    return [(i, tool_row(i)) for i in range(count)]


def target_calls(request):
    """The target calls the dataset's tool with the dataset's arguments (as a server's JSON string, under
    its own id) for even rows, another city for odd ones; later turns make no call."""
    if request.turn != 0:
        return None
    city = f"city{request.sample_index}" if request.sample_index % 2 == 0 else "Atlantis"
    return [weather(city, f"server-{request.sample_index}", as_string=True)]


def fingerprint_of(rows) -> dict:
    return completions_fingerprint("tiny@0123", SETTINGS, dataset=dataset_identity("tools.jsonl", rows))


def regenerate(store, staging: Path, rows, engine):
    with Uploader(store, backoff_s=0.01) as uploader:
        return regenerate_range(
            rows=rows,
            open_engine=engine.opener(),
            store=store,
            prefix=PREFIX,
            staging_dir=staging,
            uploader=uploader,
            fingerprint=fingerprint_of(rows),
            progress_every_s=0.0,
            chunk_records=1000,
            chunk_every_s=3600,
            log=lambda message: None,
        )


def stored_records(store) -> dict[int, CompletionRecord]:
    text = store.get_bytes(f"{PREFIX}/{COMPLETIONS_NAME}").decode()
    lines = [parse_line(line, "test") for line in text.splitlines() if line.strip()]
    return {line.sample_index: line for line in lines if isinstance(line, CompletionRecord)}


def test_a_turn_whose_tool_calls_differ_ends_the_conversation_there_and_is_counted(tmp_path):
    store, rows = LocalStore(tmp_path / "store"), rows_of(6)
    engine = ScriptedEngine(tool_calls=target_calls)
    result = regenerate(store, tmp_path / "staging", rows, engine)
    records = stored_records(store)

    assert all(tools == [WEATHER] for tools in engine.tools_seen.values())  # every turn had the tools
    assert result.metadata()["ended_at_tool_calls"] == 3 and result.metadata()["tool_call_turns"] == 6
    for index, record in records.items():
        assert record.tools == [WEATHER]
        if index % 2:  # another call than the dataset's: its tool result answers nothing the target asked
            assert record.ended_early == "tool_calls_differ" and len(record.turns) == 1
            assert [m["role"] for m in record.messages] == ["user", "assistant"]
            assert record.messages[1]["tool_calls"] == [weather("Atlantis", f"server-{index}")]
        else:  # the dataset's call: the conversation goes on, the tool result still refers to its id
            assert record.ended_early is None and len(record.turns) == 3
            assert record.messages[1]["tool_calls"] == [weather(f"city{index}", f"call-{index}")]
            assert record.messages[2] == {
                "role": "tool",
                "tool_call_id": f"call-{index}",
                "content": f"{index}C",
            }
    assert sorted(engine.asked) == sorted(
        [(i, 0) for i in range(6)] + [(i, t) for i in (0, 2, 4) for t in (1, 2)]
    )


def test_a_kill_right_after_a_turn_that_ended_its_conversation_never_asks_for_it_again(tmp_path):
    store_dir, staging = tmp_path / "store", tmp_path / "staging"
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from pathlib import Path
        from test_regenerate_tool_calls import LocalStore, ScriptedEngine, regenerate, rows_of, target_calls
        rows = [(i, row) for i, row in rows_of(4) if i % 2]  # rows 1 and 3: both end at their first turn
        regenerate(LocalStore({str(store_dir)!r}), Path({str(staging)!r}), rows,
                   ScriptedEngine(batch=1, tool_calls=target_calls))
        """
    )
    env = {**os.environ, "DFLASH_FAULT_POINTS": "regenerate_journal@1"}
    killed = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    journal = [json.loads(line) for line in (staging / "journal.jsonl").read_text().splitlines()]
    assert [(line["sample_index"], line.get("turn")) for line in journal] == [(1, 0)]  # the turn, no record

    rows = [(i, row) for i, row in rows_of(4) if i % 2]
    again = ScriptedEngine(batch=1, tool_calls=target_calls)
    result = regenerate(LocalStore(store_dir), staging, rows, again)
    assert again.asked == [(3, 0)] and result.reused_from_staging == 1
    assert result.ended_at_tool_calls == 2
    assert stored_records(LocalStore(store_dir))[1].messages[1]["tool_calls"] == [
        weather("Atlantis", "server-1")
    ]
