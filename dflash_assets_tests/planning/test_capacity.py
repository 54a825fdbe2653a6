"""The capacity plan's arithmetic: exact object bytes, the seeds' shape, estimates with an interval,
hours from a saved GPU measurement, and warnings that name the setting to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_assets.conversations.datasets import bundled_dataset_path
from dflash_assets.extraction.sample_format import estimate_sample_nbytes, write_sample
from dflash_assets.planning.capacity import (
    DeviceProfile,
    PlanSettings,
    TargetFacts,
    extraction_rate,
    plan_capacity,
    range_object_bytes,
)
from dflash_assets.planning.workload import RangeWorkload, Workload, build_workload
from dflash_assets_tests.support.extraction import make_samples

LAYERS_27B = [1, 16, 31, 46, 61]
H200 = DeviceProfile("NVIDIA H200", "cuda", 141 * 10**9, 989e12, "test")


def _target(name="Qwen3.6-27B@0123456789ab", layers=LAYERS_27B, hidden=5120, flops=2.0e10) -> TargetFacts:
    return TargetFacts(Path("."), name, layers, hidden, "qwen3_5_text", flops, 54 * 10**9)


def _settings(tmp_path: Path, **overrides) -> PlanSettings:
    fields = dict(
        hidden_state_dtype="bf16",
        max_tokens_per_batch=16384,
        staging_max_bytes=8 * 2**30,
        staging_dir=tmp_path / "staging",
        store_url="s3://bucket/prefix",
        devices=4,
    )
    return PlanSettings(**{**fields, **overrides})


MEMORY = {
    "extraction": 70 * 10**9,
    "regeneration": 90 * 10**9,
    "training": 40 * 10**9,
    "evaluation": 80 * 10**9,
}


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_ranges_bytes_are_exactly_the_objects_the_writer_writes(tmp_path, dtype):
    samples = make_samples(9)
    layers, hidden, name = [1, 2, 4], 16, "tiny/qwen3_5@abc"
    written = 0
    for sample in samples:
        written += write_sample(
            tmp_path / "x.safetensors",
            sample_index=sample.sample_index,
            input_ids=sample.input_ids,
            loss_mask=sample.loss_mask,
            hidden_states=torch.randn(sample.num_tokens, len(layers), hidden),
            target_layer_ids=layers,
            target_model=name,
            hidden_state_dtype=dtype,
        )
    workload = RangeWorkload(
        "00000100-00000199",
        10,
        len(samples),
        sum(s.num_tokens for s in samples),
        "dataset",
        lengths=[s.num_tokens for s in samples],
        sample_indices=[s.sample_index for s in samples],
    )
    assert range_object_bytes(workload, _target(name, layers, hidden), dtype) == written
    # From the totals alone (a tokenized range whose shard was not read) only the headers are guessed: the
    # digits of each sample's length and the header's padding to 8 bytes, a few bytes a sample.
    totals = RangeWorkload(workload.partition, 10, workload.samples, workload.tokens, "tokenized")
    guessed = range_object_bytes(totals, _target(name, layers, hidden), dtype)
    assert abs(guessed - written) <= 8 * len(samples)


def test_at_the_seeds_shape_the_plan_gives_the_issues_figures(tmp_path):
    """5 layers x 5120 x 2 bytes = 51 KiB a token; 914K samples of ~1.5K tokens are ~70 TB in bf16, and
    offline training at 25.1K tokens/s reads ~1.3 GB/s back (issue 14's arithmetic)."""
    per_range = 10_000
    ranges = [
        RangeWorkload(
            f"{start:08d}-{start + per_range - 1:08d}", per_range, per_range, per_range * 1500, "tokenized"
        )
        for start in range(0, 910_000, per_range)
    ] + [RangeWorkload("00910000-00919999", 4000, 4000, 4000 * 1500, "tokenized")]
    workload = Workload("seeds.jsonl", 914_000, per_range, 3072, ranges, sample_lengths=[1500] * 64)
    plan = plan_capacity(workload, _target(), H200, _settings(tmp_path), MEMORY).as_dict()
    assert plan["samples"] == 914_000 and plan["tokens"] == 914_000 * 1500
    assert plan["bytes_per_token"] == 5 * 5120 * 2 + 5 == 51_205
    assert 69e12 < plan["hidden_state_bytes"] < 71e12
    assert plan["hidden_state_bytes_by_dtype"]["fp8"] / plan["hidden_state_bytes"] == pytest.approx(
        0.5, abs=0.01
    )
    assert plan["offline_read_bytes_per_s"] == pytest.approx(1.29e9, rel=0.01)
    assert plan["s3_requests"]["training_get"] == 6 * 914_000 and plan["objects"] == 914_000
    # A batch of 16,384 tokens holds ten 1.5K-token samples: their ten staging reservations, ~0.77 GB.
    one = estimate_sample_nbytes(1500, 5, 5120, len(_target().name), "bf16")
    assert plan["staging_bytes_needed"] == 10 * one
    hours = plan["extraction_hours"]
    assert hours["devices"] == 4 and hours["devices_n"] == pytest.approx(hours["devices_1"] / 4)
    assert hours["devices_1"] * 3600 * hours["tokens_per_s_per_device"] == pytest.approx(
        hours["computed_tokens"]
    )
    assert plan["upload_bytes_per_s_needed"] == pytest.approx(
        plan["hidden_state_bytes"] / (hours["devices_n"] * 3600)
    )
    assert any("DFLASH_HIDDEN_STATE_DTYPE=fp8" in warning for warning in plan["warnings"])


def test_warnings_name_the_setting_to_change(tmp_path):
    ranges = [RangeWorkload("00000000-00000099", 100, 100, 100 * 3000, "tokenized")]
    workload = Workload("d.jsonl", 100, 100, 3072, ranges, sample_lengths=[3000] * 100)
    memory = {**MEMORY, "evaluation": 200 * 10**9}
    settings = _settings(tmp_path, staging_max_bytes=2**20, store_url=str(tmp_path / "store"))
    plan = plan_capacity(workload, _target(), H200, settings, memory)
    text = "\n".join(plan.warnings)
    assert "DFLASH_STAGING_MAX_BYTES=1048576 is below one batch" in text
    assert "spec_eval_prompts: 0" in text and "evaluation needs" in text
    fp8 = plan_capacity(workload, _target(), H200, _settings(tmp_path, hidden_state_dtype="fp8"), MEMORY)
    assert not any("DFLASH_HIDDEN_STATE_DTYPE" in warning for warning in fp8.warnings)
    huge = Workload(
        "d.jsonl", 100, 100, 3072, [RangeWorkload("00000000-00000099", 100, 100, 10**12, "tokenized")]
    )
    local = plan_capacity(
        huge, _target(), H200, _settings(tmp_path, store_url=str(tmp_path / "store")), MEMORY
    )
    assert any("DFLASH_STORE_URL" in warning and "free" in warning for warning in local.warnings)


def test_hours_come_from_a_saved_gpu_measurement_scaled_by_flops_per_token(tmp_path):
    measured = {
        "device": "NVIDIA H200",
        "measured_at": "now",
        "targets": [
            {
                "shape": "dense",
                "model_type": "qwen3",
                "tokens_per_s": {"extraction": 1000.0},
                "flops_per_token": {"extraction": 4e10},
                "mfu": {"extraction": 0.3},
            },
            {
                "shape": "hybrid",
                "model_type": "qwen3_5_text",
                "tokens_per_s": {"extraction": 3000.0, "extraction_fp8": 3300.0},
                "flops_per_token": {"extraction": 1e10, "extraction_fp8": 1e10},
                "mfu": {"extraction": 0.2, "extraction_fp8": 0.22},
            },
        ],
    }
    target = _target(flops=2e10)  # a hybrid with twice the FLOPs a token of the measured shape
    rate, source = extraction_rate(target, H200, _settings(tmp_path), measured)
    assert rate == pytest.approx(1500.0) and "bench --gpu" in source and "hybrid" in source
    rate, _ = extraction_rate(target, H200, _settings(tmp_path, hidden_state_dtype="fp8"), measured)
    assert rate == pytest.approx(1650.0)
    a100 = DeviceProfile("NVIDIA A100", "cuda", 80 * 10**9, 312e12, "test")
    rate, source = extraction_rate(target, a100, _settings(tmp_path), measured)  # another device: its MFU
    assert rate == pytest.approx(0.2 * 312e12 / 2e10) and "MFU" in source
    rate, source = extraction_rate(target, H200, _settings(tmp_path, mfu=0.5), None)
    assert rate == pytest.approx(0.5 * 989e12 / 2e10) and "stated 50% MFU" in source


def test_a_sampled_estimate_carries_an_interval_that_holds_the_exact_total(demo_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    common = dict(
        dataset_uri=str(bundled_dataset_path()),
        samples_per_partition=100,
        max_length=3072,
        tokenizer=tokenizer,
    )
    exact = build_workload(**common, sample_rows=0)
    estimate = build_workload(**common, sample_rows=150)
    assert exact.exact and exact.tokens_error_95 == 0 and len(exact.lengths) == exact.samples == 500
    assert not estimate.exact and estimate.sampled_rows == 150 and estimate.estimated_rows == 500
    assert 0 < estimate.relative_error_95 < 0.2
    assert abs(estimate.tokens - exact.tokens) <= estimate.tokens_error_95
    assert estimate.samples == pytest.approx(exact.samples, rel=0.05)


def test_the_plan_counts_the_tokens_of_sharegpt_shards_as_tokenized_completions_makes_them(
    demo_model_dir, tmp_path
):
    """The plan's token counts read the same layouts and shards: a folder of ShareGPT JSONL shards gives
    the samples and tokens `tokenize_range` gives (none as `unknown_layout`), and the forced format too."""
    from transformers import AutoTokenizer

    from dflash_assets.conversations.datasets import iter_rows
    from dflash_assets.conversations.sample_range import SampleRange
    from dflash_assets.conversations.tokenize import tokenize_range

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    rows = [row.messages for _, row in iter_rows(bundled_dataset_path(), SampleRange(0, 59))]
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [
        {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in r]} for r in rows
    ]
    (tmp_path / "shards").mkdir()
    for number in range(3):
        part = sharegpt[number * 20 : (number + 1) * 20]
        (tmp_path / "shards" / f"part-{number}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    dataset = str(tmp_path / "shards")

    tokenized = tokenize_range(tokenizer, dataset, SampleRange(0, 99))
    assert len(tokenized.samples) == 60 and not tokenized.dropped
    common = dict(dataset_uri=dataset, samples_per_partition=100, max_length=3072, tokenizer=tokenizer)
    for layout in ("auto", "sharegpt"):
        plan = build_workload(**common, sample_rows=0, layout=layout)
        assert (plan.rows, plan.samples, plan.tokens) == (60, 60, tokenized.tokens)
    forced = build_workload(**common, sample_rows=0, layout="messages")
    assert forced.samples == 0  # read as OpenAI-style rows, ShareGPT ones have no `messages`
