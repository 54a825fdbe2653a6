"""The in-process engine on tool-calling rows: prompts rendered with the row's tools, answers read back
into content and tool calls as `transformers serve` reads them, and the rule for calls that differ
applied to what the real (demo) target says."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from dflash_assets.generation.in_process import InProcessEngine, prompt_token_ids
from dflash_assets.generation.records import iter_records
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.generation.tokenized import tokenize_completions
from dflash_assets.storage.layout import COMPLETIONS_NAME
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.target.model import load_target_model
from dflash_assets_tests.generation.test_regenerate_tool_calls import PREFIX, WEATHER, regenerate, rows_of
from dflash_assets_tests.support.tool_target import tool_target

SETTINGS = GenerationSettings(max_new_tokens=12)


@pytest.fixture(scope="module")
def tool_model(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    directory = tool_target(demo_model_dir, tmp_path_factory.mktemp("tools") / "target")
    return load_target_model(directory, "cpu"), AutoTokenizer.from_pretrained(directory)


def test_an_answer_that_calls_a_tool_is_read_back_as_its_tool_calls(tool_model):
    model, tokenizer = tool_model
    engine = InProcessEngine(model, tokenizer, SETTINGS, device="cpu")
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = prompt_token_ids(tokenizer, messages, SETTINGS, [WEATHER])
    assert "get_weather" in tokenizer.decode(prompt)  # the tools block is in the prompt
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    written = f"Checking.\n<tool_call>\n{call}\n</tool_call><|im_end|>"
    generated = tokenizer(written, add_special_tokens=False)["input_ids"] + [tokenizer.pad_token_id] * 3

    answer = engine._answer(prompt, generated, [WEATHER])
    assert answer.content == "Checking." and answer.finish_reason == "stop"
    assert answer.tool_calls == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert answer.completion_token_ids == generated[:-3]  # the exact ids, up to the end-of-turn token
    # A row without tools is read as before: the same text is content.
    assert engine._answer(prompt, generated, None).tool_calls is None


@pytest.mark.slow  # a few seconds of CPU generation
def test_the_real_target_regenerates_tool_rows_with_their_tools_and_ends_them_where_it_calls_nothing(
    tool_model, tmp_path
):
    """The demo target never calls the weather tool: every row ends at its first turn (which the
    dataset answered with a call), counted, and its stored sample is the exact prompt with tools plus the
    target's own ids."""
    model, tokenizer = tool_model
    rows = rows_of(3)
    store = LocalStore(tmp_path / "store")

    class InProcess:  # what `regenerate` opens
        @staticmethod
        def opener():
            return lambda: contextlib.nullcontext(InProcessEngine(model, tokenizer, SETTINGS, device="cpu"))

    result = regenerate(store, tmp_path / "staging", rows, InProcess())
    assert result.ended_at_tool_calls == 3 and result.tool_call_turns == 0
    local = tmp_path / COMPLETIONS_NAME
    store.download(f"{PREFIX}/{COMPLETIONS_NAME}", local)
    records = list(iter_records(local))
    for record in records:
        assert record.ended_early == "tool_calls_differ" and record.tools == [WEATHER]
        assert record.prompt_token_ids == prompt_token_ids(
            tokenizer, record.messages[:1], SETTINGS, [WEATHER]
        )

    tokenized = tokenize_completions(tokenizer, local)
    for sample, record in zip(tokenized.samples, records, strict=True):
        ids = record.turns[-1]["completion_token_ids"]
        assert sample.input_ids == record.prompt_token_ids + ids
        assert sample.loss_mask == [0] * len(record.prompt_token_ids) + [1] * len(ids)
