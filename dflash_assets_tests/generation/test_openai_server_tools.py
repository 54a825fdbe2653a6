"""Tool-calling rows through OpenAI-compatible servers: the row's `tools` are sent and rendered by the
server (`transformers serve` on loopback, serving the demo target with a Qwen3-style tool template),
the history goes in the API's form, and an answer's `tool_calls` are read back."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash_assets.generation.conversation import Answer, Regeneration
from dflash_assets.generation.engine import TurnRequest
from dflash_assets.generation.in_process import InProcessEngine, prompt_token_ids
from dflash_assets.generation.openai_server import OpenAIEngine
from dflash_assets.generation.records import iter_records
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.storage.layout import COMPLETIONS_NAME
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.moto_server import LOOPBACK
from dflash_assets.target.model import load_target_model
from dflash_assets_tests.generation.test_regenerate_tool_calls import PREFIX, WEATHER, regenerate, rows_of
from dflash_assets_tests.support.inference_server import TransformersServer
from dflash_assets_tests.support.tool_target import tool_target

SETTINGS = GenerationSettings(max_new_tokens=12)


class _Engine:
    """What `regenerate` opens: this engine, checked first when it talks to servers."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def opener(self):
        @contextlib.contextmanager
        def open_engine():
            if isinstance(self.engine, OpenAIEngine):
                self.engine.check()
            yield self.engine

        return open_engine


def stored(store: LocalStore, tmp_path: Path, name: str) -> dict:
    local = tmp_path / f"{name}.jsonl"
    store.download(f"{PREFIX}/{COMPLETIONS_NAME}", local)
    return {record.sample_index: record for record in iter_records(local)}


@pytest.mark.slow  # a real server process
def test_transformers_serve_renders_the_rows_tools_and_answers_as_the_in_process_target(
    demo_model_dir: Path, tmp_path: Path
):
    from transformers import AutoTokenizer

    directory = tool_target(demo_model_dir, tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    rows = rows_of(3)
    served = TransformersServer(directory, tmp_path / "serve.log").start()
    try:
        engine = OpenAIEngine(
            [served.base_url],
            SETTINGS,
            target_name=directory.name,
            prompt_tokens=lambda messages, tools=None: len(
                prompt_token_ids(tokenizer, messages, SETTINGS, tools)
            ),
            concurrency=2,
        )
        regenerate(LocalStore(tmp_path / "served"), tmp_path / "s1", rows, _Engine(engine))
    finally:
        served.stop()
    in_process = InProcessEngine(load_target_model(directory, "cpu"), tokenizer, SETTINGS, device="cpu")
    regenerate(LocalStore(tmp_path / "local"), tmp_path / "s2", rows, _Engine(in_process))

    # The server counted the prompt the target's template makes with the tools block: they were rendered.
    first = rows[0][1].messages[:1]
    with_tools = len(prompt_token_ids(tokenizer, first, SETTINGS, [WEATHER]))
    assert with_tools > len(prompt_token_ids(tokenizer, first, SETTINGS)) + 20
    assert engine.prompt_token_mismatches == 0 and engine.stats.requests == 3
    served_records = stored(LocalStore(tmp_path / "served"), tmp_path, "served")
    local_records = stored(LocalStore(tmp_path / "local"), tmp_path, "local")
    for index, record in served_records.items():
        assert record.messages == local_records[index].messages, f"sample {index}"
        assert record.ended_early == local_records[index].ended_early == "tool_calls_differ"


class _ToolServer(BaseHTTPRequestHandler):
    """An OpenAI-compatible server that answers with a tool call, recording what it was sent."""

    bodies: list[dict] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer({"object": "list", "data": [{"id": "org/target"}]})

    def do_POST(self) -> None:  # noqa: N802
        type(self).bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        call = {
            "id": "srv-1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        self._answer({"choices": [{"message": message, "finish_reason": "tool_calls"}], "usage": {}})

    def _answer(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def test_tools_are_sent_the_history_goes_in_the_apis_form_and_tool_calls_are_read_back():
    _ToolServer.bodies = []
    httpd = ThreadingHTTPServer((LOOPBACK, 0), _ToolServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    _, row = rows_of(1)[0]
    conversation = Regeneration(0, row.messages, tools=row.tools)
    try:
        engine = OpenAIEngine(
            [f"http://{LOOPBACK}:{httpd.server_address[1]}/v1"], SETTINGS, target_name="target"
        )
        engine.check()
        same_call = [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "city0"}}}
        ]
        conversation.answers.append(Answer(content="", finish_reason="stop", tool_calls=same_call))
        answer = engine._answer(TurnRequest(conversation, 1, conversation.next_prompt()))
    finally:
        httpd.shutdown()
    body = _ToolServer.bodies[0]
    assert body["tools"] == [WEATHER]
    assistant = body["messages"][1]
    assert assistant["tool_calls"] == [
        {
            "id": "call-0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "city0"}'},
        }
    ]  # the dataset's id (the tool result refers to it), arguments a JSON string as the API has them
    assert body["messages"][2] == {"role": "tool", "tool_call_id": "call-0", "content": "0C"}
    assert answer.finish_reason == "stop" and answer.content == ""
    assert answer.tool_calls == [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
            "id": "srv-1",
        }
    ]
