"""`dflash-assets bench --gpu`: capture and extraction at real target shapes on one GPU, in one command.

Random-weight targets of real shapes are built directly in device memory, so nothing is downloaded:
an 8B dense Qwen3 and a Qwen3.6-27B-shaped hybrid (gated-delta-net + full attention) cut to 8 of its
64 layers. For each, on the same synthetic samples and in interleaved rounds (median reported):
capture ÷ the anchors' way (full forward with `output_hidden_states=True`, batches of 8 in dataset
order), extraction with writes ÷ the forward alone (hooks + early stop, nothing copied to the host),
extraction with writes in fp8 ÷ in bf16, model FLOPs utilisation of each and peak device memory above
the weights; then the hybrid target's capture split over k = 1, 2, 4 devices (as many as the node has:
`bench/tensor_parallel.py`). `--tiny` runs the same code on tiny shapes on whatever device there is (the CPU
included): what tests and GPU-less machines run. A full run saves what it measured where
`dflash-assets plan` reads it (`planning/gpu_result.py`).

The drafter training step has its own section at the end of this file.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_assets import settings
from dflash_assets.bench.capture_ways import ANCHOR_BATCH_SIZE, run_anchors_way, run_capture, synchronize
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.storage.layout import HIDDEN_STATES_PREFIX
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.batching import padding_fraction, plan_batches
from dflash_assets.target.flops import forward_flops, peak_flops
from dflash_assets.target.kernels import kernel_paths
from dflash_assets.target.layer_ids import dflash_target_layer_ids

EXTRACTION_TOKEN_BUDGET = int(settings.MAX_TOKENS_PER_BATCH.default)  # the product's default


def stated_or_sheet_peak(device: torch.device) -> float | None:
    """The peak MFU is measured against: `DFLASH_PEAK_TFLOPS`, else the device's data sheet."""
    return peak_flops(device, stated=settings.peak_flops())


@dataclass(frozen=True)
class TargetShape:
    """A target architecture to build with random weights: transformers config fields + layers to capture."""

    name: str
    model_type: str  # "qwen3" (dense) or "qwen3_5_text" (hybrid)
    config: dict[str, Any]
    max_length: int  # samples are 256..max_length tokens (tiny: 8..max_length)

    @property
    def layer_ids(self) -> list[int]:
        return dflash_target_layer_ids(self.config["num_hidden_layers"], 5)


def _hybrid_layer_types(num_layers: int) -> list[str]:
    # Qwen3.5/3.6: three gated-delta-net layers, then one full-attention layer, repeated.
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


REAL_SHAPES = [
    TargetShape(
        "Qwen3-8B shape (dense, 36 layers)",
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
        max_length=3072,
    ),
    TargetShape(
        "Qwen3.6-27B shape (hybrid, 8 of its 64 layers)",
        "qwen3_5_text",
        dict(
            vocab_size=248320,
            hidden_size=5120,
            intermediate_size=17408,
            num_hidden_layers=8,
            layer_types=_hybrid_layer_types(8),
            num_attention_heads=24,
            num_key_value_heads=4,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=48,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            max_position_embeddings=262144,
            tie_word_embeddings=False,
        ),
        max_length=3072,
    ),
]

TINY_SHAPES = [
    TargetShape(
        "tiny dense (qwen3)",
        "qwen3",
        dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
        max_length=96,
    ),
    TargetShape(
        "tiny hybrid (qwen3_5_text)",
        "qwen3_5_text",
        dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=8,
            layer_types=_hybrid_layer_types(8),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
        max_length=96,
    ),
]


def build_random_target(shape: TargetShape, device: torch.device) -> nn.Module:
    """The target with random weights, created directly on `device` (bf16 on CUDA, float32 on CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(shape.model_type, **shape.config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def synthetic_samples(shape: TargetShape, total_tokens: int, seed: int = 0) -> list[TokenizedSample]:
    """Random token ids, lengths spread evenly up to the shape's maximum (a chat set's spread)."""
    generator = torch.Generator().manual_seed(seed)
    shortest = 256 if shape.max_length > 512 else 8
    vocab = shape.config["vocab_size"]
    samples: list[TokenizedSample] = []
    tokens = 0
    while tokens < total_tokens:
        length = int(torch.randint(shortest, shape.max_length + 1, (1,), generator=generator))
        ids = torch.randint(1, vocab, (length,), generator=generator).tolist()
        samples.append(TokenizedSample(len(samples), ids, [1] * length))
        tokens += length
    return samples


# ---------------------------------------------------------------------------------------- variants


def run_extraction(
    model: nn.Module,
    samples: Sequence[TokenizedSample],
    layer_ids: list[int],
    directory: Path,
    budget: int,
    hidden_state_dtype: str = "bf16",
) -> None:
    """`extract_range` into a local store on this machine's disk, staging beside it."""
    from dflash_assets.extraction.extract import extract_range

    store = LocalStore(directory / "store")
    with Uploader(store, staging_budget_bytes=8 * 2**30) as uploader:
        result = extract_range(
            model=model,
            target_model_name="bench-random-weights",
            samples=samples,
            target_layer_ids=layer_ids,
            store=store,
            prefix=f"{HIDDEN_STATES_PREFIX}/bench",
            staging_dir=directory / "staging",
            uploader=uploader,
            device=str(next(model.parameters()).device),
            max_tokens_per_batch=budget,
            log=lambda message: None,
            progress_every_s=3600,
            hidden_state_dtype=hidden_state_dtype,
        )
    if result.samples != len(samples):  # a benchmark of an extraction that lost samples means nothing
        raise RuntimeError(f"extraction stored {result.samples} of {len(samples)} samples")


# ------------------------------------------------------------------------------------------ a target


@dataclass
class TargetFigures:
    shape: str
    kernels: str
    tokens: int
    samples: int
    tokens_per_s: dict[str, float] = field(default_factory=dict)  # variant -> median tokens/s
    mfu: dict[str, float | None] = field(default_factory=dict)
    peak_memory_bytes: dict[str, int | None] = field(default_factory=dict)  # above the weights
    padding: dict[str, float] = field(default_factory=dict)
    flops_per_token: dict[str, float] = field(default_factory=dict)  # model FLOPs per real token
    model_type: str = ""
    layer_ids: list[int] = field(default_factory=list)

    def ratio(self, numerator: str, denominator: str) -> float:
        return self.tokens_per_s[numerator] / self.tokens_per_s[denominator]


VARIANTS = ("anchors", "forward", "capture", "extraction", "extraction_fp8")
EXTRACTION_VARIANTS = ("forward", "capture", "extraction", "extraction_fp8")
VARIANT_NAMES = {
    "anchors": "anchors' way (full forward + output_hidden_states)",
    "forward": "forward alone (hooks + early stop, nothing to host)",
    "capture": "capture (forward + bf16 to host)",
    "extraction": "extraction with writes (extract_range, local store)",
    "extraction_fp8": "extraction with writes, fp8 (quantised on device)",
}


def bench_target(
    shape: TargetShape, device: torch.device, total_tokens: int, rounds: int, budget: int
) -> TargetFigures:
    model = build_random_target(shape, device)
    layer_ids = shape.layer_ids
    samples = synthetic_samples(shape, total_tokens)
    lengths = [s.num_tokens for s in samples]
    figures = TargetFigures(
        shape.name,
        kernel_paths(model).describe(),
        tokens=sum(lengths),
        samples=len(samples),
        model_type=shape.model_type,
        layer_ids=list(layer_ids),
    )
    last = layer_ids[-1]
    flops = {
        "anchors": forward_flops(model, lengths, None, lm_head=True),
        **{v: forward_flops(model, lengths, last, lm_head=False) for v in EXTRACTION_VARIANTS},
    }
    figures.flops_per_token = {variant: value / figures.tokens for variant, value in flops.items()}
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else None

    with tempfile.TemporaryDirectory(prefix="dflash-bench-gpu-") as tmp:
        runs: dict[str, Callable[[int], None]] = {
            "anchors": lambda r: run_anchors_way(model, samples, layer_ids),
            "forward": lambda r: run_capture(model, samples, layer_ids, False, budget),
            "capture": lambda r: run_capture(model, samples, layer_ids, True, budget),
            "extraction": lambda r: run_extraction(
                model, samples, layer_ids, Path(tmp) / f"round-{r}", budget
            ),
            "extraction_fp8": lambda r: run_extraction(
                model, samples, layer_ids, Path(tmp) / f"round-{r}-fp8", budget, "fp8"
            ),
        }
        warm = samples[: max(2, len(samples) // 16)]
        run_anchors_way(model, warm, layer_ids)
        run_capture(model, warm, layer_ids, True, budget)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for round_index in range(rounds):
            order = VARIANTS if round_index % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                if device.type == "cuda":
                    synchronize(device)
                    torch.cuda.reset_peak_memory_stats(device)
                start = time.perf_counter()
                runs[variant](round_index)
                synchronize(device)
                times[variant].append(time.perf_counter() - start)
                if weights is not None:
                    peak = torch.cuda.max_memory_allocated(device) - weights
                    figures.peak_memory_bytes[variant] = max(
                        figures.peak_memory_bytes.get(variant) or 0, peak
                    )
                else:
                    figures.peak_memory_bytes[variant] = None
    anchor_batches = [
        list(range(i, min(i + ANCHOR_BATCH_SIZE, len(lengths))))
        for i in range(0, len(lengths), ANCHOR_BATCH_SIZE)
    ]
    figures.padding = {
        "ours": padding_fraction(plan_batches(lengths, budget), lengths),
        "anchors": padding_fraction(anchor_batches, lengths),
    }
    peak = stated_or_sheet_peak(device)
    for variant in VARIANTS:
        seconds = statistics.median(times[variant])
        figures.tokens_per_s[variant] = figures.tokens / seconds
        figures.mfu[variant] = flops[variant] / seconds / peak if peak else None
    return figures


def _format_bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def print_target(figures: TargetFigures, rounds: int, print_fn: Callable[[str], None] = print) -> None:
    print_fn(f"\n{figures.shape}: {figures.samples} samples, {figures.tokens:,} tokens, {rounds} rounds")
    print_fn(f"  {figures.kernels}")
    print_fn(f"  {'variant':52s} {'tokens/s':>10s} {'MFU':>7s} {'peak mem':>10s}")
    for variant in VARIANTS:
        mfu = figures.mfu[variant]
        mfu_text = "n/a" if mfu is None else f"{mfu:.1%}"
        memory = _format_bytes(figures.peak_memory_bytes[variant])
        rate = figures.tokens_per_s[variant]
        print_fn(f"  {VARIANT_NAMES[variant]:52s} {rate:10,.0f} {mfu_text:>7s} {memory:>10s}")
    print_fn(
        f"  capture, ours / anchors' way:              {figures.ratio('capture', 'anchors'):.2f}  (>= 1)"
    )
    print_fn(
        f"  extraction with writes / forward alone:    {figures.ratio('extraction', 'forward'):.2f}  "
        "(target >= 0.9 on an H200)"
    )
    print_fn(f"  extraction with writes / capture alone:    {figures.ratio('extraction', 'capture'):.2f}")
    print_fn(
        f"  extraction with writes, fp8 / bf16:        {figures.ratio('extraction_fp8', 'extraction'):.2f}  "
        "(half the bytes copied, written and uploaded)"
    )
    print_fn(
        f"  padding, ours / anchors' way:              {figures.padding['ours']:.3f} / "
        f"{figures.padding['anchors']:.3f}"
    )


def run_gpu_bench(
    tiny: bool = False,
    tokens: int | None = None,
    rounds: int | None = None,
    device: str | None = None,
    print_fn: Callable[[str], None] = print,
    result_path: Path | None = None,
) -> list[TargetFigures]:
    """Every target shape, one after the other, each in its own interleaved rounds; with `result_path`,
    the figures are saved there for `dflash-assets plan` (`planning/gpu_result.py`)."""
    target_device = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if not tiny and target_device.type != "cuda":
        raise SystemExit(
            "bench --gpu needs a CUDA device for the real shapes (an 8B target in bf16); "
            "use --gpu --tiny for the same benchmark at tiny shapes on this machine"
        )
    if target_device.type == "cpu":
        # Tiny matmuls gain nothing from a second thread; the writers and uploaders get the other cores.
        torch.set_num_threads(1)
    shapes = TINY_SHAPES if tiny else REAL_SHAPES
    tokens = tokens or (2_000 if tiny else 96_000)
    rounds = rounds or (2 if tiny else 3)
    budget = 1024 if tiny else EXTRACTION_TOKEN_BUDGET
    name = torch.cuda.get_device_name(target_device) if target_device.type == "cuda" else "CPU"
    peak = stated_or_sheet_peak(target_device)
    print_fn(
        f"bench --gpu{' --tiny' if tiny else ''}: random-weight targets on {target_device} ({name}), "
        f"peak {'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s bf16'} "
        f"(set {settings.PEAK_TFLOPS.name} to override); ~{tokens:,} tokens per variant, "
        f"token budget {budget:,}"
    )
    results = []
    for shape in shapes:
        figures = bench_target(shape, target_device, tokens, rounds, budget)
        print_target(figures, rounds, print_fn)
        results.append(figures)
        if target_device.type == "cuda":
            torch.cuda.empty_cache()  # the next target's weights need the room
    tensor_parallel = tensor_parallel_figures(shapes[-1], target_device, tokens, budget, rounds, print_fn)
    drafter_step: dict[str, Any] = {}
    for line in drafter_step_figures(tiny, target_device, drafter_step):
        print_fn(line)
    for line in training_scaling_figures(tiny, target_device, print_fn):
        print_fn(line)
    if result_path is not None:
        saved = save_bench_result(result_path, results, target_device, tokens, drafter_step, tensor_parallel)
        print_fn(f"\nsaved for `dflash-assets plan`: {saved}")
    return results


def save_bench_result(
    path: Path,
    results: Sequence[TargetFigures],
    device: torch.device,
    tokens: int,
    drafter_step: dict[str, Any] | None = None,
    tensor_parallel: list[dict[str, Any]] | None = None,
) -> Path:
    """The figures in the format `planning/gpu_result.py` documents (and the tensor-parallel rows)."""
    from dflash_assets.planning.gpu_result import save_gpu_result

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        from dflash_assets.target.memory import host_total_bytes

        name, total = "CPU", host_total_bytes()
    targets = [
        {
            "shape": figures.shape,
            "model_type": figures.model_type,
            "layer_ids": figures.layer_ids,
            "tokens": figures.tokens,
            "samples": figures.samples,
            "tokens_per_s": figures.tokens_per_s,
            "mfu": figures.mfu,
            "flops_per_token": figures.flops_per_token,
            "peak_memory_bytes": figures.peak_memory_bytes,
        }
        for figures in results
    ]
    peak = stated_or_sheet_peak(device)
    return save_gpu_result(
        path,
        {"device": name, "total_memory_bytes": int(total), "peak_flops": peak, "tokens_per_variant": tokens,
         "targets": targets, "drafter_step": drafter_step or None,
         "tensor_parallel": tensor_parallel or None},
    )  # fmt: skip


# ------------------------------------------------------------------------- the target over k devices


def tensor_parallel_figures(
    shape: TargetShape, device: torch.device, tokens: int, budget: int, rounds: int, print_fn
) -> list[dict[str, Any]]:
    """Capture tokens/s with the hybrid target split over k = 1, 2, 4 devices (`bench.tensor_parallel`)."""
    from dflash_assets.bench.tensor_parallel import tensor_parallel_rows

    samples = synthetic_samples(shape, tokens)
    return tensor_parallel_rows(shape, build_random_target, samples, device, budget, rounds, print_fn)


# ------------------------------------------------------------------------- drafter training step


def drafter_step_figures(tiny: bool, device: torch.device, record: dict[str, Any] | None = None) -> list[str]:
    """The drafter training step, flex vs materialised attention (see `bench.drafter_step`); `record`
    receives the figures the plan reads."""
    from dflash_assets.bench.drafter_step import drafter_step_lines

    return drafter_step_lines(device, tiny=tiny, peak_flops=stated_or_sheet_peak, record=record)


# ----------------------------------------------------------------------------------- training scaling


def training_scaling_figures(tiny: bool, device: torch.device, print_fn: Callable[[str], None]) -> list[str]:
    """Per-GPU training tokens/s at 1 rank and at one rank per visible GPU (see `bench.scaling`); one
    round, a GPU node running nothing else (the CPU row, on a shared machine, takes the median of 3)."""
    from dflash_assets.bench.scaling import RandomTargets, gpu_scaling_lines

    targets = RandomTargets(REAL_SHAPES, TINY_SHAPES, build_random_target, synthetic_samples)
    return gpu_scaling_lines(targets, tiny, device, 1, print_fn)
