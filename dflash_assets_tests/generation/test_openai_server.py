"""The server engine against a real OpenAI-compatible server (`transformers serve` on loopback, serving the
demo target on the CPU): it agrees with the in-process engine at temperature 0, retries what a server
may fail, spreads requests over several servers, and says clearly which URL is wrong."""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflash_assets import settings
from dflash_assets.generation.engine import EngineUnavailable
from dflash_assets.generation.in_process import InProcessEngine, prompt_token_ids
from dflash_assets.generation.openai_server import OpenAIEngine
from dflash_assets.generation.records import CompletionRecord, iter_records
from dflash_assets.generation.regenerate import completions_fingerprint, regenerate_range
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.storage.layout import COMPLETIONS_NAME
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.moto_server import LOOPBACK, free_port
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.model import load_target_model
from dflash_assets_tests.generation.test_in_process import bundled_conversations
from dflash_assets_tests.support.inference_server import TransformersServer

pytestmark = pytest.mark.slow  # a real server process per module
SETTINGS = GenerationSettings(max_new_tokens=12)
CONVERSATIONS = 6


@pytest.fixture(scope="module")
def server(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    served = TransformersServer(demo_model_dir, tmp_path_factory.mktemp("serve") / "serve.log").start()
    yield served
    served.stop()


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


def server_engine(urls: list[str], tokenizer, demo_model_dir: Path, **options) -> OpenAIEngine:
    options = {"concurrency": 3, "backoff_s": 0.05, **options}
    return OpenAIEngine(
        urls,
        SETTINGS,
        target_name=demo_model_dir.name,
        prompt_tokens=lambda messages: len(prompt_token_ids(tokenizer, messages, SETTINGS)),
        **options,
    )


def regenerate(engine, tmp_path: Path, name: str) -> dict[int, CompletionRecord]:
    rows = list(enumerate(bundled_conversations(CONVERSATIONS)))
    store = LocalStore(tmp_path / name / "store")

    @contextlib.contextmanager
    def open_engine():
        if isinstance(engine, OpenAIEngine):
            engine.check()
        yield engine

    with Uploader(store) as uploader:
        regenerate_range(
            rows=rows,
            open_engine=open_engine,
            store=store,
            prefix="target-completions/x",
            staging_dir=tmp_path / name / "staging",
            uploader=uploader,
            fingerprint=completions_fingerprint("demo", SETTINGS),
            log=lambda message: None,
        )
    local = tmp_path / name / COMPLETIONS_NAME
    store.download(f"target-completions/x/{COMPLETIONS_NAME}", local)
    return {record.sample_index: record for record in iter_records(local)}


@pytest.fixture(scope="module")
def in_process_answers(demo_model_dir: Path, tokenizer, tmp_path_factory: pytest.TempPathFactory):
    model = load_target_model(demo_model_dir, "cpu")
    engine = InProcessEngine(model, tokenizer, SETTINGS, device="cpu")
    return regenerate(engine, tmp_path_factory.mktemp("in-process"), "in-process")


def test_the_server_and_the_in_process_engine_agree_at_temperature_0(
    server, tokenizer, demo_model_dir, in_process_answers, tmp_path
):
    engine = server_engine([server.base_url], tokenizer, demo_model_dir)
    served = regenerate(engine, tmp_path, "served")
    assert set(served) == set(in_process_answers) == set(range(CONVERSATIONS))
    for index, record in served.items():
        assert record.messages == in_process_answers[index].messages, f"sample {index}"
        assert [t["finish_reason"] for t in record.turns] == [
            t["finish_reason"] for t in in_process_answers[index].turns
        ]
    assert any(len(r.turns) > 1 for r in served.values())  # multi-turn rows regenerated turn by turn
    # transformers serve returns text only: no ids are claimed, and its prompt counts match ours.
    assert all("completion_token_ids" not in t for r in served.values() for t in r.turns)
    assert engine.prompt_token_mismatches == 0
    assert engine.stats.requests == sum(len(r.turns) for r in served.values())


def test_throttling_and_dropped_connections_are_retried_to_the_same_answers(
    server, tokenizer, demo_model_dir, in_process_answers, faulty_proxy, tmp_path
):
    flaky = faulty_proxy(server.base_url.removesuffix("/v1"))
    flaky.fail_first(2, "503", methods=["POST"])
    engine = server_engine([flaky.endpoint_url + "/v1"], tokenizer, demo_model_dir, concurrency=1)
    served = regenerate(engine, tmp_path, "flaky-503")
    flaky.fail_first(2, "drop", methods=["POST"])
    dropped = server_engine([flaky.endpoint_url + "/v1"], tokenizer, demo_model_dir, concurrency=1)
    served_after_drops = regenerate(dropped, tmp_path, "flaky-drop")

    assert flaky.counters.injected_503 == 2 and flaky.counters.dropped == 2
    assert engine.stats.retries == 2 and dropped.stats.retries == 2
    for answers in (served, served_after_drops):
        assert {i: r.messages for i, r in answers.items()} == {
            i: r.messages for i, r in in_process_answers.items()
        }


def test_requests_are_spread_over_every_server_url(server, tokenizer, demo_model_dir, faulty_proxy, tmp_path):
    first, second = (
        faulty_proxy(server.base_url.removesuffix("/v1")),
        faulty_proxy(server.base_url.removesuffix("/v1")),
    )
    urls = [first.endpoint_url + "/v1", second.endpoint_url + "/v1"]
    regenerate(server_engine(urls, tokenizer, demo_model_dir, concurrency=2), tmp_path, "spread")
    posts = [p.counters.requests for p in (first, second)]
    assert all(count >= 2 for count in posts), posts


def test_an_unreachable_server_is_refused_before_any_request_naming_the_url(tokenizer, demo_model_dir):
    url = f"http://{LOOPBACK}:{free_port()}/v1"
    with pytest.raises(
        EngineUnavailable, match=rf"cannot reach the inference server at {url}.*DFLASH_GENERATE_URL"
    ):
        server_engine([url], tokenizer, demo_model_dir).check()


def test_a_server_of_another_model_is_refused_naming_what_it_serves(server, tokenizer):
    engine = OpenAIEngine([server.base_url], SETTINGS, target_name="Qwen3.6-27B")
    with pytest.raises(EngineUnavailable, match=r"none is the target 'qwen3.6-27b'.*DFLASH_GENERATE_MODEL"):
        engine.check()
    wrong = OpenAIEngine([server.base_url], SETTINGS, target_name="x", model="another/model")
    with pytest.raises(EngineUnavailable, match=r"not 'another/model'"):
        wrong.check()


def test_a_server_that_goes_down_ends_the_run_naming_it_and_keeps_what_finished(
    server, tokenizer, demo_model_dir, faulty_proxy, tmp_path
):
    proxy = faulty_proxy(server.base_url.removesuffix("/v1"))
    url = proxy.endpoint_url + "/v1"
    engine = server_engine([url], tokenizer, demo_model_dir, concurrency=1, max_attempts=3)
    engine.check()
    answered = threading.Event()
    real_request = engine._request

    def request_then_go_down(target_server, request, *rest):
        answer = real_request(target_server, request, *rest)
        if not answered.is_set():
            answered.set()
            proxy.go_down()
        return answer

    engine._request = request_then_go_down  # type: ignore[method-assign]
    store = LocalStore(tmp_path / "store")
    rows = list(enumerate(bundled_conversations(CONVERSATIONS)))
    with pytest.raises(EngineUnavailable, match=rf"keeps failing.*{url}"), Uploader(store) as uploader:
        regenerate_range(
            rows=rows,
            open_engine=lambda: contextlib.nullcontext(engine),
            store=store,
            prefix="target-completions/x",
            staging_dir=tmp_path / "staging",
            uploader=uploader,
            fingerprint=completions_fingerprint("demo", SETTINGS),
            log=lambda message: None,
        )
    kept = list((tmp_path / "staging").glob("chunk-*.jsonl")) + list(
        store.list("target-completions/x/chunks/")
    )
    assert kept, "the conversation answered before the outage must be persisted"


class _RecordingServer(BaseHTTPRequestHandler):
    """A server that wants an API key: it lists one model and refuses requests without the key."""

    seen_headers: list[dict[str, str]] = []
    key = "sk-test-secret-never-print"

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._answer(200, {"object": "list", "data": [{"id": "served/demo"}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen_headers.append(dict(self.headers))
        if self.headers.get("Authorization") != f"Bearer {self.key}":
            self._answer(401, {"error": {"message": "invalid api key"}})
            return
        self._answer(
            200,
            {
                "choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1},
            },
        )

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def key_server():
    httpd = ThreadingHTTPServer((LOOPBACK, 0), _RecordingServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://{LOOPBACK}:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_the_api_key_comes_from_the_environment_and_only_goes_in_the_authorization_header(
    key_server, monkeypatch, capsys
):
    from dflash_assets.generation.conversation import Regeneration
    from dflash_assets.generation.engine import TurnRequest

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("DFLASH_GENERATE_API_KEY", _RecordingServer.key)
    conversation = Regeneration(0, [{"role": "user", "content": "hi"}])
    request = TurnRequest(conversation, 0, conversation.next_prompt())

    engine = OpenAIEngine(
        [key_server], SETTINGS, target_name="demo", model="served/demo", api_key=settings.generate_api_key()
    )
    engine.check()
    assert engine._request(engine.servers[0], request).content == "ok"
    assert _RecordingServer.seen_headers[-1]["Authorization"] == f"Bearer {_RecordingServer.key}"

    wrong = OpenAIEngine(
        [key_server], SETTINGS, target_name="demo", model="served/demo", api_key="sk-wrong-key-x"
    )
    wrong.check()
    with pytest.raises(EngineUnavailable) as refused:
        wrong._request(wrong.servers[0], request)
    assert "DFLASH_GENERATE_API_KEY" in str(refused.value) and "sk-wrong-key-x" not in str(refused.value)
    assert _RecordingServer.key not in capsys.readouterr().out


def test_a_retry_goes_to_the_next_server(
    server, tokenizer, demo_model_dir, in_process_answers, faulty_proxy, tmp_path
):
    failing, healthy = (faulty_proxy(server.base_url.removesuffix("/v1")) for _ in range(2))
    failing.fail_share(1.0, "503", methods=["POST"])
    urls = [failing.endpoint_url + "/v1", healthy.endpoint_url + "/v1"]
    engine = server_engine(urls, tokenizer, demo_model_dir, concurrency=1, max_attempts=3)
    served = regenerate(engine, tmp_path, "next-url")
    assert {i: r.messages for i, r in served.items()} == {
        i: r.messages for i, r in in_process_answers.items()
    }
    assert failing.counters.injected_503 > 0 and failing.counters.forwarded == 1  # its /models only
    assert engine.stats.retries == failing.counters.injected_503


class _FakeVLLM(BaseHTTPRequestHandler):
    """Speaks as vLLM does: `owned_by: vllm`, and with `return_token_ids` the exact prompt and answer
    ids beside the text. With `knows_token_ids` off it refuses the field, as an older vLLM would."""

    knows_token_ids = True
    bodies: list[dict] = []

    def do_GET(self) -> None:  # noqa: N802
        self._answer(200, {"object": "list", "data": [{"id": "org/demo-target", "owned_by": "vllm"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        type(self).bodies.append(body)
        if "return_token_ids" in body and not self.knows_token_ids:
            self._answer(400, {"message": "unknown field return_token_ids"})
            return
        answer: dict = {
            "choices": [{"message": {"content": "four"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        }
        if body.get("return_token_ids"):
            answer["prompt_token_ids"] = [5, 6, 7]
            answer["choices"][0]["token_ids"] = [11, 2]
        self._answer(200, answer)

    _answer = _RecordingServer._answer

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("knows_token_ids", [True, False])
def test_vllm_is_asked_for_token_ids_and_a_server_that_refuses_the_field_is_asked_again_without_it(
    knows_token_ids, monkeypatch
):
    from dflash_assets.generation.conversation import Regeneration
    from dflash_assets.generation.engine import TurnRequest

    monkeypatch.setattr(_FakeVLLM, "knows_token_ids", knows_token_ids)
    _FakeVLLM.bodies = []
    httpd = ThreadingHTTPServer((LOOPBACK, 0), _FakeVLLM)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://{LOOPBACK}:{httpd.server_address[1]}/v1"
        warnings: list[str] = []
        engine = OpenAIEngine([url], SETTINGS, target_name="/models/demo-target", warn=warnings.append)
        engine.check()
        conversation = Regeneration(0, [{"role": "user", "content": "2+2?"}])
        answer = engine._answer(TurnRequest(conversation, 0, conversation.next_prompt()))
    finally:
        httpd.shutdown()
    assert engine.servers[0].model == "org/demo-target"  # the served name, matched by the target's
    assert _FakeVLLM.bodies[0]["return_token_ids"] is True
    if knows_token_ids:
        assert (answer.completion_token_ids, answer.prompt_token_ids) == ([11, 2], [5, 6, 7])
        assert len(_FakeVLLM.bodies) == 1 and not warnings
    else:
        assert answer.completion_token_ids is None and answer.content == "four"
        assert len(_FakeVLLM.bodies) == 2 and "return_token_ids" not in _FakeVLLM.bodies[1]
        assert any("does not take ['return_token_ids']" in w for w in warnings)


def test_a_server_is_never_asked_past_the_targets_context_and_a_prompt_that_fills_it_drops_its_row():
    from dflash_assets.generation.conversation import Regeneration
    from dflash_assets.generation.engine import TurnScheduler

    _FakeVLLM.bodies = []
    httpd = ThreadingHTTPServer((LOOPBACK, 0), _FakeVLLM)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    lengths = {"short": 10, "long": 20}  # the target tokenizer's count of each prompt, as the engine sees it
    dropped: dict[int, str] = {}
    try:
        engine = OpenAIEngine(
            [f"http://{LOOPBACK}:{httpd.server_address[1]}/v1"],
            SETTINGS,  # max_new_tokens 12
            target_name="/models/demo-target",
            prompt_tokens=lambda messages: lengths[messages[-1]["content"]],
            context_tokens=14,
            warn=lambda message: None,
        )
        engine.check()
        plans = [Regeneration(i, [{"role": "user", "content": text}]) for i, text in enumerate(lengths)]
        scheduler = TurnScheduler(
            plans,
            on_finished=lambda c: None,
            on_dropped=lambda c, d: dropped.update({c.sample_index: d.reason}),
        )
        engine.run(scheduler, tick=lambda: None)
    finally:
        httpd.shutdown()
    assert [body["max_tokens"] for body in _FakeVLLM.bodies] == [4]  # 10 + 4 = the 14 positions
    assert dropped == {1: "exceeds_context"} and plans[0].finished


class _Uncounting(BaseHTTPRequestHandler):
    """A server that returns the answer's text and nothing else: no ids, no usage."""

    def do_GET(self) -> None:  # noqa: N802
        self._answer(200, {"object": "list", "data": [{"id": "org/demo-target"}]})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer(200, {"choices": [{"message": {"content": "four"}, "finish_reason": "stop"}]})

    _answer = _RecordingServer._answer

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize(
    ("handler", "knows_token_ids", "expected"),
    [(_FakeVLLM, True, 3 + 2), (_FakeVLLM, False, 3 + 2), (_Uncounting, False, 9)],
    ids=["vllm's ids", "a server's usage counts", "the target's own count of the prompt"],
)
def test_a_served_conversations_length_is_its_ids_else_the_servers_counts_else_the_targets_prompt_count(
    handler, knows_token_ids, expected, monkeypatch
):
    """What a conversation's token budget is measured against: [5, 6, 7] + [11, 2] as ids, or 3 + 2 as
    counted, from the fake vLLM; the target tokenizer's count (9 here) where a server counts nothing."""
    from dflash_assets.generation.conversation import Regeneration
    from dflash_assets.generation.engine import TurnRequest

    monkeypatch.setattr(_FakeVLLM, "knows_token_ids", knows_token_ids)
    httpd = ThreadingHTTPServer((LOOPBACK, 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        engine = OpenAIEngine(
            [f"http://{LOOPBACK}:{httpd.server_address[1]}/v1"],
            SETTINGS,
            target_name="/models/demo-target",
            prompt_tokens=lambda messages: 9 if handler is _Uncounting else 3,
            warn=lambda message: None,
        )
        engine.check()
        conversation = Regeneration(0, [{"role": "user", "content": "2+2?"}])
        answer = engine._answer(TurnRequest(conversation, 0, conversation.next_prompt()))
    finally:
        httpd.shutdown()
    assert answer.conversation_tokens() == expected
