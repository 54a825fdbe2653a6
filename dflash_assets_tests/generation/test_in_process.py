"""The in-process engine: batched answers equal Hugging Face `generate` one prompt at a time, end at the
target's end-of-turn token, and keep the exact ids the target produced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_assets.conversations.datasets import bundled_dataset_path
from dflash_assets.generation.conversation import Regeneration
from dflash_assets.generation.engine import TurnRequest, TurnScheduler
from dflash_assets.generation.in_process import InProcessEngine, prompt_token_ids, split_reasoning
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.target.model import load_target_model


@pytest.fixture(scope="module")
def demo_target(demo_model_dir: Path):
    from transformers import AutoTokenizer

    return load_target_model(demo_model_dir, "cpu"), AutoTokenizer.from_pretrained(demo_model_dir)


def bundled_conversations(count: int) -> list[list[dict]]:
    with open(bundled_dataset_path()) as handle:
        return [json.loads(line)["messages"] for _, line in zip(range(count), handle, strict=False)]


def answer_all(engine: InProcessEngine, conversations: list[list[dict]]) -> list[Regeneration]:
    plans = [Regeneration(i, messages) for i, messages in enumerate(conversations)]
    scheduler = TurnScheduler(plans, on_finished=lambda c: None, on_dropped=lambda c, d: None)
    engine.run(scheduler, tick=lambda: None)
    return plans


@pytest.mark.slow  # several seconds of CPU: the full suite's, not the quick loop's
def test_batched_greedy_answers_equal_generate_one_prompt_at_a_time(demo_target):
    model, tokenizer = demo_target
    settings = GenerationSettings(max_new_tokens=24)
    conversations = bundled_conversations(6)  # each turn is generated again alone: the slow half
    engine = InProcessEngine(model, tokenizer, settings, device="cpu", max_tokens_per_batch=400)
    batches: list[list[int]] = []  # the prompt lengths of each batch the engine generated
    generate_batch = engine._generate_batch

    def recorded(prompts, requests, new_tokens):
        batches.append([len(p) for p in prompts])
        return generate_batch(prompts, requests, new_tokens)

    engine._generate_batch = recorded
    answered = answer_all(engine, conversations)
    assert any(len(set(lengths)) > 1 for lengths in batches), batches  # padded batches among them

    for plan in answered:
        for position, answer in zip(plan.positions, plan.answers, strict=True):
            history = plan.messages()[:position]
            prompt = prompt_token_ids(tokenizer, history, settings)
            assert answer.prompt_token_ids == prompt
            with torch.inference_mode():
                alone = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
            expected = alone[0, len(prompt) :].tolist()
            assert answer.completion_token_ids == expected, f"sample {plan.sample_index} turn {position}"
            assert answer.content == tokenizer.decode(expected, skip_special_tokens=True).strip()
    assert sum(plan.turns for plan in answered) > len(answered)  # multi-turn rows among them


def test_a_range_of_the_demo_is_answered_in_batches_as_wide_as_its_ready_turns(demo_target):
    """A demo range (100 conversations, 161 turns, at most 4 a conversation) regenerated with the engine's
    default batching: each prefill forward starts one batch, and the ready turns go out together, so the
    range takes no more batches than its longest conversation's turns plus its turns / 64 (one request a
    forward would take 161; a padding bound made 33 batches of 1 to 17)."""
    model, tokenizer = demo_target
    conversations = bundled_conversations(100)
    widths: list[tuple[int, int]] = []  # (rows, positions) of every forward the target ran
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        engine = InProcessEngine(model, tokenizer, GenerationSettings(max_new_tokens=8), device="cpu")
        answered = answer_all(engine, conversations)
    finally:
        hook.remove()
    turns = sum(plan.turns for plan in answered)
    longest = max(plan.turns for plan in answered)
    assert all(plan.finished for plan in answered)
    prefills = [rows for rows, positions in widths if positions > 1]  # a batch's first forward
    assert prefills[0] == engine.max_batch_size == 64  # the first 64 conversations' first turns, together
    assert sum(prefills) == turns
    assert len(prefills) <= longest + -(-turns // engine.max_batch_size), prefills
    decoded = [rows for rows, positions in widths if positions == 1]
    assert sum(decoded) / len(decoded) >= 32, decoded  # decoding steps run wide, not one row each


@pytest.mark.slow  # several seconds of CPU: the full suite's, not the quick loop's
def test_an_answer_ends_at_the_end_of_turn_token_or_at_max_new_tokens(demo_target):
    model, tokenizer = demo_target
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = InProcessEngine(model, tokenizer, GenerationSettings(max_new_tokens=40), device="cpu")
    answers = [a for plan in answer_all(engine, bundled_conversations(12)) for a in plan.answers]
    stopped = [a for a in answers if a.finish_reason == "stop"]
    cut = [a for a in answers if a.finish_reason == "length"]
    assert stopped and cut  # the demo target does both within 40 tokens on these prompts
    assert all(a.completion_token_ids[-1] == end_of_turn for a in stopped)
    assert all(end_of_turn not in a.completion_token_ids[:-1] for a in stopped)
    assert all(len(a.completion_token_ids) == 40 and end_of_turn not in a.completion_token_ids for a in cut)
    assert all("<|im_end|>" not in a.content for a in answers)


def test_rows_leave_the_batch_once_they_stop_and_the_answers_stay_those_of_one_generate_call(
    demo_target, monkeypatch: pytest.MonkeyPatch
):
    """A batch decodes in rounds (here of 4, 8, 16 then 12 new tokens, up to 40); rows that have stopped
    take no part in the next round, where one `generate` call decodes every row until the last ends."""
    from dflash_assets.generation import in_process

    model, tokenizer = demo_target
    monkeypatch.setattr(in_process, "FIRST_ROUND_TOKENS", 4)
    engine = InProcessEngine(model, tokenizer, GenerationSettings(max_new_tokens=40), device="cpu")
    prompts = [prompt_token_ids(tokenizer, c[:1], engine.settings) for c in bundled_conversations(12)]
    config, stop = engine.generation_config, engine.stop_ids
    decoded: list[int] = []  # rows of every decoding step (one position a row)
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            decoded.append(kwargs["input_ids"].shape[0]) if kwargs["input_ids"].shape[1] == 1 else None
        ),
        with_kwargs=True,
    )
    try:
        rounds = in_process.generate_rows(model, prompts, engine.pad_id, config, None, "cpu")
        rows_in_rounds, decoded[:] = list(decoded), []
        once = in_process._generate_once(model, prompts, engine.pad_id, config, None, "cpu")
        rows_in_one_call = list(decoded)
    finally:
        hook.remove()

    def cut(row: list[int]) -> list[int]:
        end = next((i for i, token in enumerate(row) if token in stop), None)
        return row[: end + 1] if end is not None else row

    assert rounds == [cut(row) for row in once]
    lengths = sorted(len(row) for row in rounds)
    assert lengths[0] < 40 and lengths[-1] == 40  # some stop early, some run to the limit
    assert max(rows_in_one_call) == min(rows_in_one_call) == len(prompts)  # one call: always every row
    assert rows_in_rounds[-1] == sum(n == 40 for n in lengths)  # the last round: only rows still going
    assert sum(rows_in_rounds) < sum(rows_in_one_call)


def test_a_batch_out_of_memory_is_halved_only_after_the_failed_generate_has_let_go_of_its_tensors(
    demo_target,
):
    """The retry after an out-of-memory runs outside the `except` block: inside it, the traceback holds
    the failed `generate`'s frames (its KV cache, its activations), so on a GPU the halves would fail too."""
    import weakref

    model, tokenizer = demo_target
    engine = InProcessEngine(model, tokenizer, GenerationSettings(max_new_tokens=2), device="cpu")
    failed: list[weakref.ref] = []
    alive_at_next_forward: list[bool] = []
    rows_seen: list[int] = []

    def fail_large_batches(module, args, kwargs):
        alive_at_next_forward.append(any(ref() is not None for ref in failed))
        rows = (args[0] if args else kwargs["hidden_states"]).shape[0]
        rows_seen.append(rows)
        activations = torch.empty(rows, 1 << 16)
        if rows > 1:
            failed.append(weakref.ref(activations))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    handle = model.model.layers[1].register_forward_pre_hook(fail_large_batches, with_kwargs=True)
    try:
        prompts = [prompt_token_ids(tokenizer, c[:1], engine.settings) for c in bundled_conversations(2)]
        plans = [Regeneration(i, c) for i, c in enumerate(bundled_conversations(2))]
        requests = [TurnRequest(plan, 0, plan.messages()[:1]) for plan in plans]
        answers = engine._generate(prompts, requests, 2)
    finally:
        handle.remove()
    assert len(answers) == 2 and len(failed) == 1 and rows_seen[0] == 2
    assert alive_at_next_forward and not any(alive_at_next_forward)


def test_prompt_and_answer_stay_within_the_context_or_the_row_is_dropped_naming_why(demo_target):
    model, tokenizer = demo_target
    settings = GenerationSettings(max_new_tokens=16)
    # Conversations with one answer, at their end: its prompt is every message before it.
    single_turn = [c for c in bundled_conversations(40) if Regeneration(0, c).positions == [len(c) - 1]]
    length = {id(c): len(prompt_token_ids(tokenizer, c[:-1], settings)) for c in single_turn}
    ordered = sorted(single_turn, key=lambda c: length[id(c)])
    short, cut = ordered[0], ordered[len(ordered) // 2]
    context = length[id(cut)] + 5  # room for 5 new tokens after `cut`'s prompt
    assert length[id(short)] + 16 <= context
    too_long = ordered[-1]
    assert length[id(too_long)] >= context
    conversations = [short, cut, too_long]

    plans = [Regeneration(i, messages) for i, messages in enumerate(conversations)]
    dropped: dict[int, str] = {}
    scheduler = TurnScheduler(
        plans, on_finished=lambda c: None, on_dropped=lambda c, d: dropped.update({c.sample_index: d.reason})
    )
    engine = InProcessEngine(model, tokenizer, settings, device="cpu", context_tokens=context)
    engine.run(scheduler, tick=lambda: None)

    assert dropped == {2: "exceeds_context"}
    full, shortened = plans[0].answers[0], plans[1].answers[0]
    assert full.prompt_tokens + full.completion_tokens <= context
    assert shortened.prompt_tokens + shortened.completion_tokens <= context
    # The shortened answer is what `generate` gives for the 5 tokens the context leaves.
    with torch.inference_mode():
        alone = model.generate(torch.tensor([shortened.prompt_token_ids]), max_new_tokens=5, do_sample=False)
    assert shortened.completion_token_ids == alone[0, shortened.prompt_tokens :].tolist()
    assert shortened.completion_tokens <= 5 and (shortened.completion_tokens == 5) == (
        shortened.finish_reason == "length"
    )


def test_a_first_prompt_at_the_training_length_is_not_asked_and_its_row_is_dropped_naming_why(demo_target):
    """Training cuts every sample at DFLASH_MAX_LENGTH: an answer to a first prompt that long would be cut
    whole, so the engine never generates it (the row is dropped with the reason); shorter ones are asked."""
    model, tokenizer = demo_target
    settings = GenerationSettings(max_new_tokens=8)
    single_turn = [c for c in bundled_conversations(40) if Regeneration(0, c).positions == [len(c) - 1]]
    length = {id(c): len(prompt_token_ids(tokenizer, c[:-1], settings)) for c in single_turn}
    ordered = sorted(single_turn, key=lambda c: length[id(c)])
    short, long = ordered[0], ordered[-1]
    bound = length[id(long)]  # the long prompt reaches it exactly; the short one is well under
    assert length[id(short)] < bound
    bounded = GenerationSettings(max_new_tokens=8, max_conversation_tokens=bound)
    plans = [Regeneration(i, messages) for i, messages in enumerate([short, long])]
    dropped: dict[int, str] = {}
    scheduler = TurnScheduler(
        plans, on_finished=lambda c: None, on_dropped=lambda c, d: dropped.update({c.sample_index: str(d)})
    )
    InProcessEngine(model, tokenizer, bounded, device="cpu").run(scheduler, tick=lambda: None)

    assert list(dropped) == [1] and dropped[1].startswith("prompt_past_max_length: its prompt is")
    assert f"DFLASH_MAX_LENGTH={bound}" in dropped[1]
    assert len(plans[0].answers) == 1 and not plans[1].answers


@pytest.mark.slow  # several seconds of CPU: the full suite's, not the quick loop's
def test_sampled_answers_follow_the_seed(demo_target):
    model, tokenizer = demo_target
    conversations = bundled_conversations(4)

    def sampled(seed: int) -> list[list[int]]:
        settings = GenerationSettings(temperature=1.0, max_new_tokens=16, seed=seed)
        engine = InProcessEngine(model, tokenizer, settings, device="cpu")
        return [a.completion_token_ids for plan in answer_all(engine, conversations) for a in plan.answers]

    greedy_engine = InProcessEngine(model, tokenizer, GenerationSettings(max_new_tokens=16), device="cpu")
    greedy = [
        a.completion_token_ids for plan in answer_all(greedy_engine, conversations) for a in plan.answers
    ]
    first = sampled(1)
    assert sampled(1) == first
    assert first != sampled(2) and first != greedy


def test_a_reasoning_block_is_split_from_the_answer_as_qwen3_templates_write_it():
    assert split_reasoning("<think>\nstep one\n</think>\n\nThe answer.") == ("The answer.", "step one")
    assert split_reasoning("\n\nNo reasoning here. \n") == ("No reasoning here.", None)
