"""Serve a target with a DFlash drafter in vLLM's CPU build and measure the engine's mean acceptance length.

    scripts/vllm_cpu.sh --target DIR --drafter DIR --prompts FILE [--new-tokens 64] [--out FILE.json]

(`scripts/vllm_cpu.sh` makes the vLLM virtual environment and runs this file in it; with vLLM already
installed, `python scripts/vllm_cpu_acceptance.py ...` takes the same arguments.)

The drafter is an export in z-lab/dflash's layout (`config.json` with architectures ["DFlashDraftModel"],
`block_size`, `dflash_config.target_layer_ids` and `mask_token_id`, `model.safetensors`). The script loads
the target twice with `vllm.LLM`, one engine after the other in this process:

1. alone, greedy (temperature 0), `--new-tokens` new tokens a prompt (or fewer, where the target stops);
2. with the speculative config `{"method": "dflash", "model": DRAFTER, "num_speculative_tokens":
   block_size - 1}`, same sampling.

It reads the engine's spec-decode counters (`vllm:spec_decode_num_drafts`,
`vllm:spec_decode_num_accepted_tokens`, ...) through `LLM.get_metrics()`, and each request's own counts
through vLLM's per-request spec-decode metrics. Mean acceptance length = 1 + accepted / drafts (the bonus
token included). Greedy speculative decoding must not change the output, so it also checks that every
prompt's token ids are the same with and without the drafter.

FILE is JSON lines, each `{"messages": [...]}` (chat messages, rendered with the target tokenizer's chat
template and add_generation_prompt=True) or `{"prompt_token_ids": [...]}`.

The JSON report is printed and, with --out, written. The exit status is 0 when every output matched the
target alone, 1 when any differed, 2 for bad input.

This file runs in the vLLM environment: it imports vLLM and transformers, never the `dflash_assets`
package.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

# vLLM's CPU build reads these when it starts; set before vLLM is imported. The hub is never reached: every
# model is a local directory.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache for each engine

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
}
SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


class InputError(ValueError):
    """A bad argument or input file (exit status 2)."""


def read_json(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def load_prompts(path: Path, target: Path) -> list[list[int]]:
    """Prompt token ids, one list a line of `path`: chat messages rendered by the target's chat template
    (add_generation_prompt=True), or the line's own `prompt_token_ids`."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise InputError(f"{path}: no prompts")
    tokenizer = None
    prompts: list[list[int]] = []
    for number, row in enumerate(rows, start=1):
        if "prompt_token_ids" in row:
            prompts.append([int(i) for i in row["prompt_token_ids"]])
        elif "messages" in row:
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(target))
            ids = tokenizer.apply_chat_template(
                row["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            prompts.append([int(i) for i in (ids["input_ids"] if isinstance(ids, dict) else ids)])
        else:
            raise InputError(f"{path}:{number}: a line needs `messages` or `prompt_token_ids`")
    return prompts


def drafter_settings(drafter: Path) -> dict[str, Any]:
    """What vLLM takes from the export's config.json."""
    config = read_json(drafter / "config.json")
    dflash = config.get("dflash_config") or {}
    block_size = dflash.get("block_size", config.get("block_size"))
    return {
        "architectures": config.get("architectures"),
        "model_type": config.get("model_type"),
        "block_size": block_size,
        "target_layer_ids": dflash.get("target_layer_ids"),
        "mask_token_id": dflash.get("mask_token_id", config.get("mask_token_id")),
        "torch_dtype": config.get("torch_dtype", config.get("dtype")),
    }


def target_hf_overrides(target: Path) -> dict[str, Any] | None:
    """Overrides for a target whose config.json names a quantization its weights do not have.

    A `quantization_config` of quant_method gguf beside safetensors weights and no .gguf file is left over
    from a conversion; vLLM refuses it ("Unknown quantization method: gguf"). The override drops it for
    this run and leaves the directory as it is."""
    quant = read_json(target / "config.json").get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "gguf":
        return None
    if any(target.glob("*.gguf")) or not any(target.glob("*.safetensors")):
        return None
    print(
        f"note: {target}/config.json has a stale quantization_config (gguf) beside safetensors weights; "
        "running with hf_overrides={'quantization_config': None}",
        file=sys.stderr,
    )
    return {"quantization_config": None}


def spec_counters(llm: Any) -> dict[str, Any]:
    """The engine's spec-decode counters, summed over engines."""
    from vllm.v1.metrics.reader import Counter, Vector

    totals: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS.values()}
    per_position: list[int] = []
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[metric.name]] += metric.value
        elif isinstance(metric, Vector) and metric.name == SPEC_PER_POSITION:
            per_position = (
                [a + b for a, b in zip(per_position, metric.values, strict=True)]
                if per_position
                else list(metric.values)
            )
    totals["accepted_per_position"] = per_position
    return totals


def acceptance(accepted: int, drafts: int, draft_tokens: int | None = None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "accepted": accepted,
        "drafts": drafts,
        "mean_acceptance_length": round(1.0 + accepted / drafts, 4) if drafts else None,
    }
    if draft_tokens is not None:
        result["draft_tokens"] = draft_tokens
        result["draft_acceptance_rate"] = round(accepted / draft_tokens, 4) if draft_tokens else None
    return result


def run_engine(
    engine_kwargs: dict[str, Any],
    prompts: list[list[int]],
    new_tokens: int,
    ignore_eos: bool,
    speculative_config: dict[str, Any] | None,
) -> dict[str, Any]:
    """Generate greedily with one engine; return its outputs, timings and (speculative) counters."""
    from vllm import LLM, SamplingParams

    kwargs = dict(engine_kwargs)
    if speculative_config is not None:
        kwargs.update(
            speculative_config=speculative_config,
            disable_log_stats=False,  # LLM turns the stat loggers off; get_metrics needs them
            per_request_spec_decode_metrics="summary",
        )
    started = time.perf_counter()
    llm = LLM(**kwargs)
    init_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=ignore_eos)
    started = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    generate_s = time.perf_counter() - started
    result: dict[str, Any] = {"token_ids": [], "finish_reasons": [], "per_request": []}
    for output in outputs:
        completion = output.outputs[0]
        result["token_ids"].append(list(completion.token_ids))
        result["finish_reasons"].append(completion.finish_reason)
        metrics = getattr(completion, "spec_decode_metrics", None)
        if metrics is None:
            result["per_request"].append(None)
        else:
            histogram = list(metrics.histogram)
            result["per_request"].append(
                acceptance(
                    sum(j * n for j, n in enumerate(histogram)), sum(histogram), metrics.num_draft_tokens
                )
                | {"acceptance_histogram": histogram}
            )
    output_tokens = sum(len(ids) for ids in result["token_ids"])
    result["timings_s"] = {
        "engine_init": round(init_s, 2),
        "generate": round(generate_s, 2),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / generate_s, 2) if generate_s else None,
    }
    if speculative_config is not None:
        result["counters"] = spec_counters(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return result


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import vllm

    started = time.perf_counter()
    target, drafter = args.target.resolve(), args.drafter.resolve()
    prompts = load_prompts(args.prompts, target)
    draft = drafter_settings(drafter)
    k = args.num_speculative_tokens or (int(draft["block_size"]) - 1 if draft["block_size"] else None)
    if not k:
        raise InputError(f"{drafter}/config.json has no block_size; pass --num-speculative-tokens")
    engine_kwargs: dict[str, Any] = {
        "model": str(target),
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "enforce_eager": not args.compile,
        "seed": 0,
    }
    overrides = target_hf_overrides(target)
    if overrides:
        engine_kwargs["hf_overrides"] = overrides
    speculative_config = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k}

    alone = run_engine(engine_kwargs, prompts, args.new_tokens, args.ignore_eos, None)
    spec = run_engine(engine_kwargs, prompts, args.new_tokens, args.ignore_eos, speculative_config)

    per_prompt = []
    for i, ids in enumerate(prompts):
        mismatch = first_mismatch(spec["token_ids"][i], alone["token_ids"][i])
        row: dict[str, Any] = {
            "index": i,
            "prompt_tokens": len(ids),
            "output_tokens": len(spec["token_ids"][i]),
            "finish_reason": spec["finish_reasons"][i],
        }
        if spec["per_request"][i] is not None:
            row |= spec["per_request"][i]
        row["identical_to_target"] = mismatch is None
        if mismatch is not None:
            row["first_mismatch_at"] = mismatch
        per_prompt.append(row)
    identical = sum(row["identical_to_target"] for row in per_prompt)

    counters = spec["counters"]
    overall = acceptance(counters["accepted"], counters["drafts"], counters["draft_tokens"])
    overall["accepted_per_position"] = counters["accepted_per_position"]
    overall["source"] = "engine counters (LLM.get_metrics)"
    request_accepted = sum(row.get("accepted", 0) for row in per_prompt)
    request_drafts = sum(row.get("drafts", 0) for row in per_prompt)
    overall["per_request_sums_agree"] = (request_accepted, request_drafts) == (
        counters["accepted"],
        counters["drafts"],
    )

    return {
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "target": str(target),
        "drafter": str(drafter),
        "drafter_config": draft,
        "speculative_config": speculative_config,
        "engine": {name: value for name, value in engine_kwargs.items() if name != "model"},
        "env": {
            name: os.environ.get(name)
            for name in (
                "VLLM_CPU_KVCACHE_SPACE",
                "VLLM_CPU_OMP_THREADS_BIND",
                "LD_PRELOAD",
                "HF_HUB_OFFLINE",
            )
        },
        "prompts": str(args.prompts),
        "num_prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "ignore_eos": args.ignore_eos,
        "acceptance": overall,
        "outputs_identical": {
            "identical": identical,
            "total": len(prompts),
            "all": identical == len(prompts),
        },
        "per_prompt": per_prompt,
        "timings_s": {
            "target_alone": alone["timings_s"],
            "speculative": spec["timings_s"],
            "total": round(time.perf_counter() - started, 2),
        },
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument(
        "--target", type=Path, required=True, help="target model directory (Hugging Face layout)"
    )
    parser.add_argument("--drafter", type=Path, required=True, help="DFlash drafter export directory")
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL: {messages} or {prompt_token_ids}")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens a prompt at most (default 64)")
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        help="draft tokens a step (default: the drafter's block_size - 1)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="engine dtype for target and drafter (default float32; vLLM's CPU "
        "default, auto, runs a float32 target in bfloat16)",
    )
    parser.add_argument("--max-model-len", type=int, default=2048, help="context length (default 2048)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="let vLLM torch.compile the models (enforce_eager=False): on 2 CPU cores about 2 more minutes "
        "an engine at start and no faster here, so the default is eager",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --new-tokens tokens")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = measure(args)
    except (InputError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0 if report["outputs_identical"]["all"] else 1


if __name__ == "__main__":
    sys.exit(main())
