"""The target answering through OpenAI-compatible servers (vLLM, SGLang, `transformers serve`).

Requests go to `/chat/completions` of one or more base URLs (`http://host:port/v1`), at most
`concurrency` in flight across them, each to the URL with the fewest in flight. Throttling, timeouts,
5xx answers and dropped connections are retried with exponential backoff (jittered, `Retry-After`
honoured), each retry on the next URL; a request that keeps failing ends the run naming the URL. A
server that is unreachable or serves another model is refused before the first request.

The API key comes from the environment (`DFLASH_GENERATE_API_KEY`, else `OPENAI_API_KEY`, read by
`settings.generate_api_key()` when a run opens its engine) and is sent only in the `Authorization`
header: never logged, never in an error, never in run config.

Servers that return token ids (vLLM with `return_token_ids`) give the exact ids of every answer; the
others give text, which `tokenized_completions` tokenises with the target's tokenizer.

A row's tools are sent as `tools`, its messages in the API's form (a tool call's arguments as a JSON
string, every call with an id), and an answer's `tool_calls` are read back.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from dflash_assets.conversations.layouts import Dropped, parse_tool_calls
from dflash_assets.generation.conversation import Answer
from dflash_assets.generation.engine import (
    Engine,
    EngineStats,
    EngineUnavailable,
    TurnRequest,
    TurnScheduler,
    new_token_limit,
    no_room,
    past_max_length,
)
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.redaction import redact

URL_SETTING = "DFLASH_GENERATE_URL"
MODEL_SETTING = "DFLASH_GENERATE_MODEL"
API_KEY_VARIABLES = ("DFLASH_GENERATE_API_KEY", "OPENAI_API_KEY")
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
# Fields a server may not know; a server that refuses one is asked again without it.
OPTIONAL_FIELDS = ("return_token_ids",)


class _Retry(Exception):
    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class _RequestRefused(Exception):
    """A 4xx that asking again will not change."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Server:
    """One base URL: its address, the model it serves, the optional fields it takes, its connections."""

    base_url: str
    model: str = ""
    optional_fields: set[str] = field(default_factory=lambda: set(OPTIONAL_FIELDS))
    in_flight: int = 0
    _local: threading.local = field(default_factory=threading.local, repr=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"{URL_SETTING} entry {self.base_url!r} is not an http(s) base URL like http://host:8000/v1"
            )
        self.scheme, self.host = parts.scheme, parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.path = parts.path.rstrip("/")

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        """This thread's keep-alive connection to the server."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            conn = cls(self.host, self.port, timeout=timeout_s)
            self._local.conn = conn
        return conn

    def drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def parse_urls(text: str) -> list[str]:
    urls = [part.strip().rstrip("/") for part in text.split(",") if part.strip()]
    if not urls:
        raise ValueError(f"{URL_SETTING} names no server; expected e.g. http://127.0.0.1:8000/v1")
    return urls


class OpenAIEngine(Engine):
    def __init__(
        self,
        base_urls: Sequence[str],
        settings: GenerationSettings,
        *,
        target_name: str,
        prompt_tokens: Callable[..., int] | None = None,
        model: str | None = None,
        api_key: str | None = None,
        concurrency: int = 64,
        timeout_s: float = 600.0,
        max_attempts: int = 8,
        backoff_s: float = 1.0,
        warn: Callable[[str], None] = print,
        context_tokens: int | None = None,
    ) -> None:
        """`context_tokens` (the target's `max_position_embeddings`), with `prompt_tokens` (messages, and
        `tools=` for a row that has them -> the prompt's length), keeps every request's prompt plus
        `max_tokens` within the target's context."""
        if concurrency < 1:
            raise ValueError(f"DFLASH_GENERATE_CONCURRENCY must be >= 1, got {concurrency}")
        self.servers = [Server(url) for url in base_urls]
        self.settings, self.target_name, self.requested_model = settings, target_name, model
        self._prompt_tokens, self._api_key = prompt_tokens, api_key
        self.context_tokens = context_tokens if prompt_tokens is not None else None
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.max_attempts, self.backoff_s, self.warn = max(1, max_attempts), backoff_s, warn
        self.stats = EngineStats()
        self.name = redact(",".join(s.base_url for s in self.servers))  # recorded with every answer
        self.description = f"{len(self.servers)} server(s) at {self.name}, {concurrency} requests in flight"
        self._lock = threading.Lock()
        self._prompt_mismatch_warned = False
        self.prompt_token_mismatches = 0
        self.answered_tokens = 0  # new tokens of every answer returned so far

    # -- before the first request

    def check(self) -> None:
        """Every server answers `/models` and serves the target (or `DFLASH_GENERATE_MODEL`)."""
        for server in self.servers:
            try:
                status, body = self._call(server, "GET", "/models", None, timeout_s=30.0)
            except (OSError, http.client.HTTPException) as error:
                raise EngineUnavailable(
                    f"cannot reach the inference server at {server.base_url} ({type(error).__name__}: "
                    f"{error}); start it, or fix {URL_SETTING}"
                ) from None
            if status != 200:
                raise EngineUnavailable(
                    f"{server.base_url}/models answered HTTP {status} ({_detail(body)}); is "
                    f"{server.base_url} an OpenAI-compatible base URL (ending in /v1)? Fix {URL_SETTING}"
                )
            entries = [entry for entry in (body or {}).get("data", []) if entry.get("id")]
            server.model = self._choose_model(server, [str(entry["id"]) for entry in entries])
            # Only vLLM is known to return token ids (`return_token_ids`); others are not asked, so no
            # request is spent on a refusal (one that refuses anyway is asked again without it).
            if not any(entry.get("owned_by") == "vllm" for entry in entries):
                server.optional_fields.clear()

    def _choose_model(self, server: Server, served: list[str]) -> str:
        if self.requested_model:
            if self.requested_model in served:
                return self.requested_model
            raise EngineUnavailable(
                f"{server.base_url} serves {served}, not {self.requested_model!r} ({MODEL_SETTING}); "
                f"point {URL_SETTING} at a server of that model, or fix {MODEL_SETTING}"
            )
        wanted = self.target_name.rstrip("/").rsplit("/", 1)[-1].lower()
        matching = [name for name in served if name.rstrip("/").rsplit("/", 1)[-1].lower() == wanted]
        if len(matching) == 1:
            return matching[0]
        raise EngineUnavailable(
            f"{server.base_url} serves {served or 'no model'}, and none is the target {wanted!r} "
            f"(DFLASH_TARGET_MODEL): the answers would be another model's. Point {URL_SETTING} at a server "
            f"of the target, or set {MODEL_SETTING} to the served name if it is the same model"
        )

    # -- answering

    def run(self, scheduler: TurnScheduler, tick: Callable[[], None]) -> None:
        workers = [
            threading.Thread(target=self._work, args=(scheduler,), name=f"generate-{n}", daemon=True)
            for n in range(self.concurrency)
        ]
        for worker in workers:
            worker.start()
        while any(worker.is_alive() for worker in workers):
            for worker in workers:
                worker.join(timeout=0.2)
            tick()
        scheduler.raise_if_aborted()

    def _work(self, scheduler: TurnScheduler) -> None:
        try:
            while requests := scheduler.take(limit=1):
                request = requests[0]
                max_tokens, prompt_tokens = self._max_tokens(request)
                bound = self.settings.max_conversation_tokens
                if (dropped := past_max_length(request.turn, prompt_tokens, bound)) is not None:
                    scheduler.drop(request, dropped)
                    continue
                if max_tokens < 1:
                    scheduler.drop(request, no_room(prompt_tokens, self.context_tokens))
                    continue
                try:
                    answer = self._answer(request, max_tokens)
                except _RequestRefused as refused:
                    scheduler.drop(request, Dropped("generation_failed", str(refused)[:300]))
                    continue
                scheduler.answer(request, answer)
        except BaseException as error:  # noqa: BLE001 - every worker stops on the first fatal error
            scheduler.abort(error)

    def _pick(self, previous: Server | None) -> Server:
        with self._lock:
            candidates = [s for s in self.servers if s is not previous] or self.servers
            server = min(candidates, key=lambda s: s.in_flight)
            server.in_flight += 1
            self.stats.in_flight += 1
            return server

    def _release(self, server: Server) -> None:
        with self._lock:
            server.in_flight -= 1
            self.stats.in_flight -= 1

    def _max_tokens(self, request: TurnRequest) -> tuple[int, int]:
        """`max_tokens` for this turn within the target's context, and the prompt's length (0: uncounted)."""
        if self.context_tokens is None or self._prompt_tokens is None:
            return self.settings.max_new_tokens, 0
        prompt = self._count_prompt(request)
        return new_token_limit(prompt, self.settings.max_new_tokens, self.context_tokens), prompt

    def _count_prompt(self, request: TurnRequest) -> int:
        assert self._prompt_tokens is not None
        if request.tools:
            return self._prompt_tokens(request.messages, tools=request.tools)
        return self._prompt_tokens(request.messages)

    def _answer(self, request: TurnRequest, max_tokens: int | None = None) -> Answer:
        last_error = ""
        server: Server | None = None
        for attempt in range(self.max_attempts):
            server = self._pick(server if attempt else None)
            try:
                with self._lock:
                    self.stats.requests += 1
                return self._request(server, request, max_tokens)
            except _Retry as retry:
                last_error = f"{server.base_url}: {retry}"
                with self._lock:
                    self.stats.server_errors += 1
                if attempt + 1 < self.max_attempts:
                    with self._lock:
                        self.stats.retries += 1
                    time.sleep(self._backoff(attempt, retry.retry_after_s))
            finally:
                self._release(server)
        raise EngineUnavailable(
            f"the inference server keeps failing: sample {request.sample_index} turn {request.turn + 1} "
            f"failed {self.max_attempts} times, last {last_error}. Check the server (and {URL_SETTING}); "
            "every finished conversation is kept and a rerun asks only for the others"
        )

    def _backoff(self, attempt: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:
            return min(60.0, retry_after_s)
        return min(30.0, self.backoff_s * 2**attempt) * (0.5 + random.random())

    def _body(self, server: Server, request: TurnRequest, max_tokens: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": server.model,
            "messages": wire_messages(request.messages),
            "max_tokens": max_tokens or self.settings.max_new_tokens,
            "temperature": self.settings.temperature,
            "stream": False,
        }
        if not self.settings.greedy:
            body["top_p"] = self.settings.top_p
            body["seed"] = self.settings.seed
            if self.settings.top_k:
                body["top_k"] = self.settings.top_k
        if request.tools:
            body["tools"] = request.tools
        if self.settings.chat_template_kwargs:
            body["chat_template_kwargs"] = dict(self.settings.chat_template_kwargs)
        for name in server.optional_fields:
            body[name] = True
        return body

    def _request(self, server: Server, request: TurnRequest, max_tokens: int | None = None) -> Answer:
        body = self._body(server, request, max_tokens)
        try:
            status, response = self._call(server, "POST", "/chat/completions", body, timeout_s=self.timeout_s)
        except (OSError, http.client.HTTPException) as error:
            server.drop_connection()
            raise _Retry(f"connection failed ({type(error).__name__}: {error})") from None
        if status == 200:
            return self._parse(server, request, response)
        detail = _detail(response)
        if status in RETRY_STATUSES:
            raise _Retry(f"HTTP {status} ({detail})", _retry_after(response))
        refused = [name for name in OPTIONAL_FIELDS if name in body and name in detail]
        if status in (400, 422) and refused:
            with self._lock:
                first = bool(server.optional_fields & set(refused))
                server.optional_fields.difference_update(refused)
            if first:  # requests in flight meanwhile were refused too; say it once
                self.warn(
                    f"{server.base_url} does not take {refused}: its answers are stored as text and "
                    "tokenised with the target's tokenizer (a server that returns token ids keeps them exact)"
                )
            return self._request(server, request, max_tokens)
        if status in (401, 403):
            raise EngineUnavailable(
                f"{server.base_url} refused the request (HTTP {status}: {detail}); set "
                f"{API_KEY_VARIABLES[0]} to the server's API key (read from the environment only)"
            )
        if status == 404 or (status == 400 and server.model and server.model in detail):
            raise EngineUnavailable(
                f"{server.base_url} does not serve {server.model!r} (HTTP {status}: {detail}); fix "
                f"{URL_SETTING} or {MODEL_SETTING}"
            )
        raise _RequestRefused(status, f"HTTP {status} from {server.base_url}: {detail}")

    def _call(
        self, server: Server, method: str, path: str, body: dict | None, *, timeout_s: float
    ) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        conn = server.connection(timeout_s)
        conn.timeout = timeout_s
        try:
            conn.request(method, server.path + path, body=payload, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except (TimeoutError, OSError, http.client.HTTPException):
            server.drop_connection()
            raise
        if response.getheader("Connection", "").lower() == "close":
            server.drop_connection()
        try:
            parsed: Any = json.loads(raw) if raw else None
        except ValueError:
            parsed = {"raw": raw[:300].decode(errors="replace")}
        if isinstance(parsed, dict) and response.getheader("Retry-After"):
            parsed.setdefault("_retry_after", response.getheader("Retry-After"))
        return response.status, self._redact(parsed)

    def _redact(self, value: Any) -> Any:
        if not self._api_key:
            return value
        text = json.dumps(value)
        if self._api_key not in text:
            return value
        return json.loads(text.replace(self._api_key, "<redacted>"))

    def _parse(self, server: Server, request: TurnRequest, response: Any) -> Answer:
        try:
            choice = response["choices"][0]
            message = choice.get("message") or {}
        except (KeyError, IndexError, TypeError):
            raise _Retry(f"an answer without choices ({str(response)[:200]})") from None
        content = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        usage = response.get("usage") or {}
        completion_ids = choice.get("token_ids")
        prompt_ids = response.get("prompt_token_ids")
        finish = choice.get("finish_reason") or "stop"
        tool_calls = parse_tool_calls(message.get("tool_calls"), 0)
        answer = Answer(
            content=content,
            reasoning=reasoning or None,
            tool_calls=tool_calls if tool_calls and not isinstance(tool_calls, Dropped) else None,
            finish_reason="length" if finish == "length" else "stop",
            completion_token_ids=[int(i) for i in completion_ids] if completion_ids is not None else None,
            prompt_token_ids=[int(i) for i in prompt_ids] if prompt_ids is not None else None,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens"),
        )
        with self._lock:
            self.answered_tokens += answer.num_tokens()
        self._check_prompt_tokens(server, request, answer)
        uncounted = answer.prompt_token_ids is None and answer.prompt_tokens is None
        if uncounted and self._prompt_tokens is not None:
            # A server that counts nothing: the target's own count, so a conversation's length (against
            # its token budget) still includes the prompt.
            answer.prompt_tokens = self._count_prompt(request)
        return answer

    def _check_prompt_tokens(self, server: Server, request: TurnRequest, answer: Answer) -> None:
        """The server's prompt count against the target's own tokenizer: a different count means another
        tokenizer or chat template, whose answers would be scored against prompts the drafter never sees."""
        if self._prompt_tokens is None or answer.prompt_tokens is None:
            return
        expected = self._count_prompt(request)
        if expected == answer.prompt_tokens:
            return
        with self._lock:
            self.prompt_token_mismatches += 1
            first = not self._prompt_mismatch_warned
            self._prompt_mismatch_warned = True
        if first:
            self.warn(
                f"{server.base_url} counted {answer.prompt_tokens} prompt tokens for sample "
                f"{request.sample_index} where the target's tokenizer and chat template count {expected}: it "
                "may serve another model or template (counted in the range's metadata)"
            )


def wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat-completions API takes them: a tool call's arguments as a JSON string, and an
    id on every call (the API requires one; the template of a call without one never shows it)."""
    out = []
    for position, message in enumerate(messages):
        calls = message.get("tool_calls")
        if not calls:
            out.append(message)
            continue
        wired = []
        for number, call in enumerate(calls):
            arguments = call["function"]["arguments"]
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            wired.append(
                {
                    "id": call.get("id") or f"call_{position}_{number}",
                    "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": arguments},
                }
            )
        out.append({**message, "tool_calls": wired})
    return out


def _detail(body: Any) -> str:
    if isinstance(body, dict):
        for key in ("detail", "message", "error"):
            value = body.get(key)
            if isinstance(value, dict):
                value = value.get("message") or json.dumps(value)
            if value:
                return str(value)[:300]
        if "raw" in body:
            return str(body["raw"])
    return str(body)[:300]


def _retry_after(body: Any) -> float | None:
    if isinstance(body, dict) and body.get("_retry_after"):
        try:
            return float(body["_retry_after"])
        except ValueError:
            return None
    return None
