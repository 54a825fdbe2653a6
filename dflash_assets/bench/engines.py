"""Every generation engine that is available, side by side on the same prompts in one run
(`dflash-assets bench --only generation`): the in-process engine always, vLLM's server when an environment
with vLLM is found (`DFLASH_VLLM_PYTHON`, or the one `scripts/vllm_cpu.sh --install` makes), the user's
servers when `DFLASH_GENERATE_URL` names them.

Each engine answers the same first turns (ShareGPT's when built, the bundled conversations' otherwise)
through the product's own path (`Regeneration` plans and the `TurnScheduler`, as `target_completions`
asks), greedy, at the dtype the product loads the target at. Figures: tokens/s of the answering alone (a
server's start is timed apart), the rate against vLLM's, how many answers are token for token the
in-process engine's and where the first difference falls in the others; and the machine's limit for
this model: its forward's FLOPs a token at the measured matmul rate of this device.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_assets import settings
from dflash_assets.conversations.layouts import Conversation
from dflash_assets.generation.conversation import Regeneration, plan_regeneration
from dflash_assets.generation.engine import Engine, TurnScheduler
from dflash_assets.generation.settings import GenerationSettings

VLLM_RATIO_FIGURE = "generation tokens/s, in-process engine / vLLM server (same prompts, same dtype)"


@dataclass
class EngineRun:
    name: str
    seconds: float = 0.0
    start_seconds: float = 0.0  # a server's start, not in `seconds`
    answers: dict[int, list[int]] = field(default_factory=dict)  # sample index -> completion ids
    dropped: int = 0
    note: str = ""

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids in self.answers.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def engine_prompts(count: int, log: Callable[[str], None] = print) -> tuple[str, list[tuple[int, Any]]]:
    """`count` first turns: ShareGPT's when it is built here, else the bundled conversations'."""
    from dflash_assets.conversations import sharegpt
    from dflash_assets.conversations.datasets import bundled_dataset_path, iter_rows

    reference = f"sharegpt-first-turn[0:{count}]"
    try:
        built = (settings.cache_dir() / "datasets").glob("sharegpt-v*/*.jsonl")
        if not any(built):
            raise FileNotFoundError("ShareGPT is not built")
        path = sharegpt.dataset_file(reference, settings.cache_dir(), log=log)
        name = reference
    except (OSError, ValueError) as error:
        log(f"  ShareGPT not built here ({error}); the bundled conversations' first turns instead")
        path, name = bundled_dataset_path(), f"the bundled conversations' first {count} turns"
    rows = []
    for index, row in iter_rows(path, require_assistant=False):
        if isinstance(row, Conversation):
            rows.append((index, row))
        if len(rows) == count:
            break
    return name, rows


def _answer_all(engine: Engine, rows: list[tuple[int, Any]], budget: int | None) -> EngineRun:
    run = EngineRun(engine.name)
    plans = []
    for index, row in rows:
        plan = plan_regeneration(index, row, budget)
        if isinstance(plan, Regeneration):
            plans.append(plan)
    dropped: list[int] = []
    scheduler = TurnScheduler(
        plans, on_finished=lambda c: None, on_dropped=lambda c, d: dropped.append(c.sample_index)
    )
    started = time.perf_counter()
    engine.run(scheduler, tick=lambda: None)
    run.seconds = time.perf_counter() - started
    for plan in plans:
        if plan.answers and plan.answers[0].completion_token_ids is not None:
            run.answers[plan.sample_index] = list(plan.answers[0].completion_token_ids)
    run.dropped = len(dropped)
    return run


@contextlib.contextmanager
def _in_process(model_dir: str, generation: GenerationSettings, device: str) -> Iterator[Engine]:
    from transformers import AutoTokenizer

    from dflash_assets.generation.in_process import InProcessEngine
    from dflash_assets.target.model import load_target_model

    model = load_target_model(model_dir, device)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    yield InProcessEngine(model, tokenizer, generation, device=device)
    del model


@contextlib.contextmanager
def _vllm(model_dir: str, generation: GenerationSettings, device: str, log) -> Iterator[Engine]:
    import shlex

    from transformers import AutoConfig, AutoTokenizer

    from dflash_assets.generation.in_process import prompt_token_ids
    from dflash_assets.generation.vllm_server import VllmInstall, vllm_engine
    from dflash_assets.target.model import context_length_of

    install = VllmInstall.find(settings.vllm_python())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dtype = settings.GENERATE_DTYPE.get() or ("bfloat16" if device.startswith("cuda") else "float32")
    with vllm_engine(
        install,
        model_dir,
        dtype=dtype,
        devices=[device],
        extra_args=shlex.split(settings.VLLM_ARGS.get()),
        start_timeout_s=settings.VLLM_START_TIMEOUT_S.get_float(),
        log=lambda line: log(f"    {line}") if not line.startswith("vllm: ") else None,
        settings=generation,
        prompt_tokens=lambda messages, tools=None: len(
            prompt_token_ids(tokenizer, messages, generation, tools)
        ),
        concurrency=settings.GENERATE_CONCURRENCY.get_int(),
        context_tokens=context_length_of(AutoConfig.from_pretrained(model_dir)),
    ) as engine:
        yield engine


def machine_limit(model_dir: str, device: str, mean_context: float) -> dict[str, float]:
    """The target's forward FLOPs a generated token (2 x its matmul weights, the LM head included, plus
    attention over `mean_context` positions) and this device's measured fp32 matmul rate at a decoding
    batch's shape: their quotient is the most tokens/s any engine can generate here."""
    from transformers import AutoConfig

    from dflash_assets.target.model import text_config

    config = text_config(AutoConfig.from_pretrained(model_dir))
    hidden, layers = config.hidden_size, config.num_hidden_layers
    intermediate, vocab = config.intermediate_size, config.vocab_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", heads) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_layer = hidden * head_dim * (heads * 2 + kv_heads * 2) + 3 * hidden * intermediate
    matmul_flops = 2 * (layers * per_layer + hidden * vocab)
    attention_flops = 4 * layers * heads * head_dim * mean_context
    flops = matmul_flops + attention_flops
    a = torch.randn(64, hidden, device=device)
    b = torch.randn(hidden, intermediate, device=device)
    for _ in range(3):
        a @ b
    rounds, started = 0, time.perf_counter()
    while time.perf_counter() - started < 1.0:
        for _ in range(20):
            a @ b
        rounds += 20
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    rate = rounds * 2 * 64 * hidden * intermediate / (time.perf_counter() - started)
    return {"flops_per_token": flops, "matmul_flops_per_s": rate, "tokens_per_s": rate / flops}


def bench_engines(
    model_dir: str, name: str, count: int = 48, max_new_tokens: int = 192, max_length: int = 2048
) -> dict[str, float]:
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    generation = GenerationSettings(max_new_tokens=max_new_tokens, max_conversation_tokens=max_length)
    source, rows = engine_prompts(count)
    print(
        f"generation engines: {name} on {device}, {len(rows)} prompts ({source}), up to {max_new_tokens} new "
        f"tokens each, greedy, prompts under {max_length} tokens"
    )
    runs: list[EngineRun] = []
    engines: list[tuple[str, Callable[[], Any]]] = [
        ("in-process", lambda: _in_process(model_dir, generation, device))
    ]
    vllm_python = settings.vllm_python()
    if vllm_python is not None:
        engines.append(("vllm", lambda: _vllm(model_dir, generation, device, print)))
    else:
        print("  vLLM: no environment found (DFLASH_VLLM_PYTHON, or `bash scripts/vllm_cpu.sh --install`)")
    if settings.GENERATE_URL.get():
        print("  the servers of DFLASH_GENERATE_URL are not measured: their devices are not this host's")
    for label, opener in engines:
        started = time.perf_counter()
        try:
            with opener() as engine:
                ready = time.perf_counter() - started
                run = _answer_all(engine, rows, max_length)
                run.name, run.start_seconds = label, ready
        except Exception as error:  # noqa: BLE001 - one engine failing leaves the others' figures
            print(f"  {label}: failed: {type(error).__name__}: {str(error)[:300]}")
            continue
        runs.append(run)
        print(
            f"  {label}: {run.tokens:,} tokens in {run.seconds:.1f} s = {run.tokens_per_s:,.1f} tokens/s "
            f"({len(run.answers)} answers, {run.dropped} dropped; ready after {run.start_seconds:.0f} s)",
            flush=True,
        )
    reference = next((r for r in runs if r.name == "in-process"), None)
    mean_context = statistics.mean(
        [len(ids) for ids in (reference.answers.values() if reference else [])] or [max_new_tokens]
    )
    limit = machine_limit(model_dir, device, mean_context=mean_context)
    print(
        f"  the machine's limit for this model: {limit['flops_per_token'] / 1e6:,.0f} MFLOP a token at "
        f"{limit['matmul_flops_per_s'] / 1e9:,.1f} GFLOP/s (fp32 matmul, a batch of 64 rows) = "
        f"{limit['tokens_per_s']:,.0f} tokens/s"
    )
    figures: dict[str, float] = {
        "generation tokens/s, the machine's limit for the target": limit["tokens_per_s"]
    }
    print(
        f"  {'engine':<12} {'tokens/s':>9} {'of limit':>9} {'identical to in-process':>24}  first difference"
    )
    for run in runs:
        same, firsts = 0, []
        if reference is not None:
            for index, ids in run.answers.items():
                theirs = reference.answers.get(index)
                if theirs is None:
                    continue
                if ids == theirs:
                    same += 1
                else:
                    firsts.append(
                        next(
                            (k for k, (a, b) in enumerate(zip(ids, theirs, strict=False)) if a != b),
                            min(len(ids), len(theirs)),
                        )
                    )
        compared = sum(1 for index in run.answers if reference is not None and index in reference.answers)
        where = (
            f"token {min(firsts)} at the earliest, {statistics.median(firsts):.0f} median" if firsts else "-"
        )
        print(
            f"  {run.name:<12} {run.tokens_per_s:>9,.1f} {run.tokens_per_s / limit['tokens_per_s']:>8.0%} "
            f"{same:>12}/{compared:<11}  {where}"
        )
        figures[f"generation tokens/s, {run.name} engine on the configured target"] = run.tokens_per_s
        figures[f"generation answers identical to in-process, {run.name} engine (share)"] = (
            same / compared if compared else 0.0
        )
    by_name = {run.name: run for run in runs}
    if "in-process" in by_name and "vllm" in by_name and by_name["vllm"].tokens_per_s:
        ratio = by_name["in-process"].tokens_per_s / by_name["vllm"].tokens_per_s
        figures[VLLM_RATIO_FIGURE] = ratio
        print(f"  in-process / vLLM: {ratio:.3f} (target >= 0.25)")
    return figures
