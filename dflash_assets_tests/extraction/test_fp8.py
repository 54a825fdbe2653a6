"""FP8 hidden states: e4m3 with a float32 scale per (token, layer), quantised where the states are, within
e4m3's rounding of Hugging Face's own forward, about half the bytes, and never mixed with bf16 objects."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.extract import extraction_fingerprint
from dflash_assets.extraction.fp8 import encode_states, quantize_e4m3, relative_error_per_layer
from dflash_assets.extraction.object_size import bytes_per_token
from dflash_assets.extraction.sample_format import (
    read_sample,
    sample_object_name,
    staged_file_problem,
    write_sample,
)
from dflash_assets.extraction.verify import verify_hidden_state_partition
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.manifest import new_manifest, write_manifest
from dflash_assets.target.batching import pad_batch
from dflash_assets_tests.support.extraction import (
    DEFAULT_LAYERS,
    MODEL_NAME,
    PREFIX,
    Extraction,
    make_samples,
    stored_objects,
)
from dflash_assets_tests.support.targets import assert_within_e4m3_rounding, reference_hidden_states


def test_values_far_beyond_448_keep_e4m3_rounding_of_their_own_row_and_a_zero_row_stays_zero():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 4, 32, generator=generator) * torch.tensor([1e-3, 1.0, 3e3, 1e5])[None, :, None]
    hidden[2, 1] = 0.0  # an all-zero (token, layer) row
    hidden[3, 2, 5] = 6e4  # one outlier: only its own row's scale grows
    values, scale = quantize_e4m3(hidden)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (6, 4)
    assert bool((scale > 0).all()), "a scale is never zero"
    dequantised = values.float() * scale[..., None]
    assert bool(torch.isfinite(dequantised).all())
    assert_within_e4m3_rounding(dequantised, hidden, slack=0.0)
    assert bool((dequantised[2, 1] == 0).all())
    # Without the scale the same cast saturates at 448: the reason the scale exists.
    unscaled = hidden.to(torch.float8_e4m3fn).float()
    assert float((unscaled - hidden).abs().max()) > 1e4


def test_the_scale_is_per_token_and_layer_so_a_loud_layer_leaves_the_others_error_unchanged():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(50, 3, 64, generator=generator)
    before = relative_error_per_layer(hidden, encode_states(hidden, "fp8").dequantize())
    loud = hidden.clone()
    loud[:, 1] *= 1e4
    after = relative_error_per_layer(loud, encode_states(loud, "fp8").dequantize())
    assert after[0] == pytest.approx(before[0]) and after[2] == pytest.approx(before[2])
    assert after[1] == pytest.approx(before[1], rel=1e-3)


def test_per_layer_relative_error_of_fp8_against_bf16_on_the_same_capture(target):
    """Fidelity, measured: the same captured batch stored both ways, each compared with the float32
    capture, layer by layer. bf16 keeps 8 mantissa bits (~0.2 %), e4m3 with its scale 3 (~2-3 %)."""
    samples = make_samples(8)
    capture = HiddenStateCapture(target, DEFAULT_LAYERS)
    input_ids, attention_mask = pad_batch([s.input_ids for s in samples], 0)
    captured = capture(input_ids, attention_mask)  # float32 on the CPU: the reference for both
    real = attention_mask.bool()
    reference = captured[real]  # [tokens, K, H], padding left out
    bf16 = relative_error_per_layer(reference, encode_states(captured, "bf16").dequantize()[real])
    fp8 = relative_error_per_layer(reference, encode_states(captured, "fp8").dequantize()[real])
    assert len(fp8) == len(bf16) == len(DEFAULT_LAYERS)
    for layer, (error_bf16, error_fp8) in enumerate(zip(bf16, fp8, strict=True)):
        assert error_bf16 < 0.004, (layer, error_bf16)
        assert 0.005 < error_fp8 < 0.04, (layer, error_fp8)  # e4m3's rounding, and no more


def test_fp8_extraction_stores_hugging_face_hidden_states_within_e4m3_rounding(target, tmp_path):
    store = LocalStore(tmp_path / "store")
    samples = make_samples(6)
    result = Extraction(store, tmp_path / "staging").run(target, samples, hidden_state_dtype="fp8")
    assert result.fingerprint["hidden_state_dtype"] == "fp8"
    objects = stored_objects(store)
    for sample in samples:
        stored = read_sample(objects[sample_object_name(sample.sample_index)])
        assert stored.hidden_state_dtype == "fp8" and stored.metadata["hidden_state_dtype"] == "fp8"
        assert stored.hidden_states.dtype == torch.float8_e4m3fn
        assert stored.hidden_states_scale.shape == (sample.num_tokens, len(DEFAULT_LAYERS))
        assert stored.input_ids.tolist() == sample.input_ids
        reference = reference_hidden_states(target, sample.input_ids)
        for slot, layer_id in enumerate(DEFAULT_LAYERS):  # "layer i" = output_hidden_states[i + 1]
            assert_within_e4m3_rounding(stored.dequantized()[:, slot], reference[layer_id + 1])


def test_fp8_objects_are_about_half_the_bf16_ones_of_the_same_samples(target, tmp_path):
    samples = make_samples(6)
    sizes = {}
    for dtype in ("bf16", "fp8"):
        store = LocalStore(tmp_path / dtype)
        result = Extraction(store, tmp_path / f"staging-{dtype}").run(
            target, samples, hidden_state_dtype=dtype
        )
        sizes[dtype] = result.bytes_stored
    ratio = sizes["fp8"] / sizes["bf16"]
    per_token = bytes_per_token(len(DEFAULT_LAYERS), 64, "fp8") / bytes_per_token(
        len(DEFAULT_LAYERS), 64, "bf16"
    )
    assert 0.45 < ratio < 0.6 and ratio == pytest.approx(per_token, abs=0.03)


def test_a_changed_dtype_re_extracts_the_range_and_a_rerun_in_fp8_reuses_every_object(target, tmp_path):
    store = LocalStore(tmp_path / "store")
    samples = make_samples(5)
    Extraction(store, tmp_path / "staging").run(target, samples)  # bf16

    changed = Extraction(store, tmp_path / "staging")
    result = changed.run(target, samples, hidden_state_dtype="fp8")
    assert result.extracted_now == 5 and result.reused_from_store == 0
    assert any("deleting them" in line and '"hidden_state_dtype": "bf16"' in line for line in changed.logs)
    assert {read_sample(data).hidden_state_dtype for data in stored_objects(store).values()} == {"fp8"}

    again = Extraction(store, tmp_path / "staging")
    rerun = again.run(target, samples, hidden_state_dtype="fp8")  # the size bounds know fp8 objects
    assert rerun.reused_from_store == 5 and rerun.extracted_now == 0 and again.uploader.stats.uploaded == 0
    assert not any("redoing it" in line for line in again.logs)


def test_a_staged_file_is_resumed_only_under_the_dtype_it_was_written_in(tmp_path):
    sample = make_samples(1)[0]
    path = tmp_path / sample_object_name(sample.sample_index)
    write_sample(
        path,
        sample_index=sample.sample_index,
        input_ids=sample.input_ids,
        loss_mask=sample.loss_mask,
        hidden_states=torch.randn(sample.num_tokens, len(DEFAULT_LAYERS), 64) * 500,
        target_layer_ids=DEFAULT_LAYERS,
        target_model=MODEL_NAME,
        hidden_state_dtype="fp8",
    )
    as_fp8 = extraction_fingerprint(MODEL_NAME, DEFAULT_LAYERS, 64, "fp8")
    as_bf16 = extraction_fingerprint(MODEL_NAME, DEFAULT_LAYERS, 64, "bf16")
    assert staged_file_problem(path, sample, as_fp8, len(DEFAULT_LAYERS), 64) is None
    assert "made by" in staged_file_problem(path, sample, as_bf16, len(DEFAULT_LAYERS), 64)


def test_the_range_check_passes_an_fp8_range_and_flags_an_object_in_another_dtype(target, tmp_path):
    store = LocalStore(tmp_path / "store")
    samples = make_samples(4)
    result = Extraction(store, tmp_path / "staging").run(target, samples, hidden_state_dtype="fp8")
    indices = [s.sample_index for s in samples]
    write_manifest(store, PREFIX, new_manifest("hidden_state_partitions", "x", result.objects))
    check = dict(expected_indices=indices, target_layer_ids=DEFAULT_LAYERS, decode_samples=4)
    assert verify_hidden_state_partition(store, PREFIX, hidden_state_dtype="fp8", **check).passed

    # A bf16 object slipped into the fp8 range (e.g. written by another tool): the check names it.
    odd = samples[0]
    path = tmp_path / "odd.safetensors"
    write_sample(
        path,
        sample_index=odd.sample_index,
        input_ids=odd.input_ids,
        loss_mask=odd.loss_mask,
        hidden_states=torch.randn(odd.num_tokens, len(DEFAULT_LAYERS), 64),
        target_layer_ids=DEFAULT_LAYERS,
        target_model=MODEL_NAME,
    )
    name = sample_object_name(odd.sample_index)
    store.put_file(f"{PREFIX}/{name}", path)
    objects = {**result.objects, name: path.stat().st_size}
    write_manifest(store, PREFIX, new_manifest("hidden_state_partitions", "x", objects))
    report = verify_hidden_state_partition(store, PREFIX, hidden_state_dtype="fp8", **check)
    assert not report.passed and any(name in p and "stored as bf16" in p for p in report.problems)
    assert json.loads(store.get_bytes(f"{PREFIX}/_fingerprint.json"))["hidden_state_dtype"] == "fp8"


def test_a_range_from_before_fp8_is_kept_by_a_bf16_rerun_and_redone_by_an_fp8_one(target, tmp_path):
    store = LocalStore(tmp_path / "store")
    samples = make_samples(4)
    Extraction(store, tmp_path / "staging").run(target, samples)
    # What the previous version wrote: format 1, no dtype (bf16 was the only one).
    legacy = {
        k: v
        for k, v in extraction_fingerprint(MODEL_NAME, DEFAULT_LAYERS, 64).items()
        if k != "hidden_state_dtype"
    }
    store.put_bytes(
        f"{PREFIX}/_fingerprint.json",
        json.dumps({**legacy, "format": "dflash-assets.hidden-states/1"}).encode(),
    )

    kept = Extraction(store, tmp_path / "staging")
    result = kept.run(target, samples)
    assert result.reused_from_store == 4 and result.extracted_now == 0 and kept.uploader.stats.uploaded == 0
    upgraded = json.loads(store.get_bytes(f"{PREFIX}/_fingerprint.json"))
    assert upgraded == extraction_fingerprint(MODEL_NAME, DEFAULT_LAYERS, 64, "bf16")

    store.put_bytes(
        f"{PREFIX}/_fingerprint.json",
        json.dumps({**legacy, "format": "dflash-assets.hidden-states/1"}).encode(),
    )
    redone = Extraction(store, tmp_path / "staging").run(target, samples, hidden_state_dtype="fp8")
    assert redone.extracted_now == 4 and redone.reused_from_store == 0
