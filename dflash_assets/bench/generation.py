"""Generation figures: the in-process engine's batched answers against `generate` one conversation at a
time, the way a script without batching regenerates, on the same prompts in the same run; and on the
configured target when it is not the demo (a real model, `DFLASH_TARGET_MODEL=smollm2`), the engine's
batches, whose rows leave once they stop, against one `generate` call per batch, which decodes every row
until the longest answer ends."""

from __future__ import annotations

import json
import statistics
import time

import torch

from dflash_assets import settings
from dflash_assets.conversations.datasets import bundled_dataset_path
from dflash_assets.generation.conversation import Regeneration
from dflash_assets.generation.engine import TurnScheduler
from dflash_assets.generation.in_process import (
    InProcessEngine,
    _generate_once,
    generate_rows,
    prompt_token_ids,
)
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.target.demo_model import ensure_demo_model
from dflash_assets.target.model import load_target_model

BATCHED_FIGURE = "generation tokens/s, batched in-process engine / one conversation at a time"


def _first_turns(count: int) -> list[list[dict]]:
    """The history before each conversation's first answer: the prompts both ways answer."""
    prompts = []
    with open(bundled_dataset_path()) as handle:
        for line in handle:
            messages = json.loads(line)["messages"]
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompts.append(messages[:first])
            if len(prompts) == count:
                break
    return prompts


def _batched(engine: InProcessEngine, prompts: list[list[dict]]) -> tuple[int, list[list[int]]]:
    plans = [Regeneration(i, prompt) for i, prompt in enumerate(prompts)]
    engine.run(
        TurnScheduler(plans, on_finished=lambda c: None, on_dropped=lambda c, d: None), tick=lambda: None
    )
    answers = [plan.answers[0].completion_token_ids for plan in plans]
    return sum(len(a) for a in answers), answers


def _demo_range(engine: InProcessEngine, count: int) -> dict[str, float]:
    """The first `count` bundled conversations, every turn, regenerated as a demo range is: its rate and
    the widths of the batches the engine ran (counted at the target's forwards)."""
    with open(bundled_dataset_path()) as handle:
        plans = [
            Regeneration(i, json.loads(line)["messages"])
            for i, line in zip(range(count), handle, strict=False)
        ]
    widths: list[int] = []  # rows of every prefill: one per batch

    def count_batch(module, args, kwargs) -> None:
        rows, positions = kwargs["input_ids"].shape
        if positions > 1:  # a prefill starts a batch; decoding steps feed one position a row
            widths.append(rows)

    hook = engine.model.register_forward_pre_hook(count_batch, with_kwargs=True)
    started = time.perf_counter()
    try:
        engine.run(
            TurnScheduler(plans, on_finished=lambda c: None, on_dropped=lambda c, d: None), tick=lambda: None
        )
    finally:
        hook.remove()
    seconds = time.perf_counter() - started
    tokens = sum(answer.num_tokens() for plan in plans for answer in plan.answers)
    return {
        "conversations/s": len(plans) / seconds,
        "tokens/s": tokens / seconds,
        "turns": sum(plan.turns for plan in plans),
        "batches": len(widths),
        "mean width": statistics.mean(widths),
    }


def _one_at_a_time(model, tokenizer, prompts, generation: GenerationSettings) -> tuple[int, list[list[int]]]:
    answers = []
    for prompt in prompts:
        ids = prompt_token_ids(tokenizer, prompt, generation)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=generation.max_new_tokens, do_sample=False
            )
        answers.append(out[0, len(ids) :].tolist())
    return sum(len(a) for a in answers), answers


def bench_generation(
    count: int, rounds: int, max_new_tokens: int = 64, range_size: int = 100
) -> dict[str, float]:
    from transformers import AutoTokenizer

    model_dir = ensure_demo_model(settings.cache_dir())
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    model = load_target_model(model_dir, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generation = GenerationSettings(max_new_tokens=max_new_tokens)
    engine = InProcessEngine(model, tokenizer, generation, device=device)
    prompts = _first_turns(count)
    print(
        f"generation: demo target, {len(prompts)} prompts, up to {max_new_tokens} new tokens each, greedy, "
        f"{rounds} interleaved rounds"
    )
    _batched(engine, prompts[:4]), _one_at_a_time(model, tokenizer, prompts[:2], generation)  # warm-up
    ratios, batched_rates, single_rates, same = [], [], [], True
    for round_index in range(rounds):
        rate: dict[str, float] = {}
        outputs: dict[str, list[list[int]]] = {}
        for way in ("batched", "single") if round_index % 2 == 0 else ("single", "batched"):
            started = time.perf_counter()
            if way == "batched":
                tokens, outputs[way] = _batched(engine, prompts)
            else:
                tokens, outputs[way] = _one_at_a_time(model, tokenizer, prompts, generation)
            rate[way] = tokens / (time.perf_counter() - started)
        # Batching must not change a greedy answer (the batched engine keeps ids up to the stop token).
        same &= all(
            single[: len(b)] == b for single, b in zip(outputs["single"], outputs["batched"], strict=True)
        )
        ratios.append(rate["batched"] / rate["single"])
        batched_rates.append(rate["batched"])
        single_rates.append(rate["single"])
        print(
            f"  round {round_index + 1}: tokens/s batched {rate['batched']:,.0f}, one at a time "
            f"{rate['single']:,.0f}",
            flush=True,
        )
    print(f"  batched answers equal the one-at-a-time answers: {same}")
    # A whole demo range (every turn of 100 conversations), as `target_completions` answers it.
    ranges = [_demo_range(engine, range_size) for _ in range(rounds)]
    middle = sorted(ranges, key=lambda r: r["conversations/s"])[len(ranges) // 2]
    print(
        f"  a demo range of {range_size} conversations ({middle['turns']:.0f} turns): "
        f"{middle['batches']:.0f} batches of {middle['mean width']:.1f} turns on average, "
        f"{middle['conversations/s']:.2f} conversations/s, {middle['tokens/s']:,.0f} tokens/s"
    )
    return {
        BATCHED_FIGURE: statistics.median(ratios),
        "generation tokens/s, batched in-process engine": statistics.median(batched_rates),
        "generation tokens/s, one conversation at a time": statistics.median(single_rates),
        f"generation conversations/s, a demo range of {range_size} (every turn)": middle["conversations/s"],
        f"generation batches for that range's {middle['turns']:.0f} turns": middle["batches"],
    }


ROWS_LEAVING_FIGURE = (
    "generation tokens/s on the configured target, rows leaving the batch / one generate call"
)


def bench_target_generation(
    model_dir: str, name: str, count: int = 48, rounds: int = 2, max_new_tokens: int = 384
) -> dict[str, float]:
    """The configured target's first-turn answers to `count` bundled prompts in one batch, greedy, up to
    `max_new_tokens` each: `generate_rows` (rows leave the batch once they stop) against one `generate`
    call (every row decoded until the longest ends), interleaved over `rounds`. Also where the time goes:
    row-steps decoded per token kept (1.0 wastes nothing) and the answers' lengths."""
    from transformers import AutoTokenizer

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    model = load_target_model(model_dir, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = InProcessEngine(
        model, tokenizer, GenerationSettings(max_new_tokens=max_new_tokens), device=device
    )
    prompts = [prompt_token_ids(tokenizer, p, engine.settings) for p in _first_turns(count)]
    config, stop = engine.generation_config, engine.stop_ids
    print(
        f"generation: {name}, {len(prompts)} prompts in one batch, up to {max_new_tokens} new tokens each, "
        f"greedy, {rounds} interleaved rounds"
    )
    row_steps = [0]

    def count_rows(module, args, kwargs) -> None:
        rows, positions = kwargs["input_ids"].shape
        if positions == 1:  # a decoding step: one position a row
            row_steps[0] += rows

    def cut(row: list[int]) -> list[int]:
        end = next((i for i, token in enumerate(row) if token in stop), None)
        return row[: end + 1] if end is not None else row

    ways = {
        "rows leave": lambda: generate_rows(model, prompts, engine.pad_id, config, None, device),
        "one call": lambda: [
            cut(r) for r in _generate_once(model, prompts, engine.pad_id, config, None, device)
        ],
    }
    hook = model.register_forward_pre_hook(count_rows, with_kwargs=True)
    rates: dict[str, list[float]] = {way: [] for way in ways}
    waste: dict[str, float] = {}
    answers: dict[str, list[list[int]]] = {}
    try:
        for round_index in range(rounds):
            for way in ways if round_index % 2 == 0 else reversed(list(ways)):
                row_steps[0] = 0
                started = time.perf_counter()
                answers[way] = ways[way]()
                seconds = time.perf_counter() - started
                kept = sum(len(a) for a in answers[way])
                rates[way].append(kept / seconds)
                waste[way] = row_steps[0] / max(1, kept - len(prompts))  # the prefill makes each first token
                print(f"  round {round_index + 1}: {way}: {kept / seconds:,.1f} tokens/s", flush=True)
    finally:
        hook.remove()
    lengths = sorted(len(a) for a in answers["rows leave"])
    same = sum(a == b for a, b in zip(answers["rows leave"], answers["one call"], strict=True))
    print(
        f"  answers: {same}/{len(prompts)} equal both ways; lengths p50 {lengths[len(lengths) // 2]}, max "
        f"{lengths[-1]} ({sum(n >= max_new_tokens for n in lengths)} at the limit); row-steps decoded per "
        f"token kept: {waste['rows leave']:.2f} with rows leaving, {waste['one call']:.2f} in one call"
    )
    ratios = [a / b for a, b in zip(rates["rows leave"], rates["one call"], strict=True)]
    return {
        ROWS_LEAVING_FIGURE: statistics.median(ratios),
        "generation tokens/s on the configured target, rows leaving the batch": statistics.median(
            rates["rows leave"]
        ),
        "generation tokens/s on the configured target, one generate call": statistics.median(
            rates["one call"]
        ),
        "generation row-steps per kept token, rows leaving the batch": waste["rows leave"],
        "generation row-steps per kept token, one generate call": waste["one call"],
    }
