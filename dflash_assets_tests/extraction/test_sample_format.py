"""The hidden-state object format: tensors, metadata, atomic writes, finite checks, size estimates."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_assets.extraction.object_size import sample_object_nbytes
from dflash_assets.extraction.sample_format import (
    SAMPLE_FORMAT,
    CorruptSampleError,
    NonFiniteHiddenStates,
    estimate_sample_nbytes,
    parse_sample_object_name,
    read_sample,
    read_sample_metadata,
    sample_object_name,
    write_sample,
)
from dflash_assets_tests.support.targets import assert_within_e4m3_rounding

LAYERS = [1, 3, 5]


def make_sample(num_tokens: int = 11, hidden_size: int = 8, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return dict(
        sample_index=17,
        input_ids=torch.randint(0, 1000, (num_tokens,), generator=generator).tolist(),
        loss_mask=[0] * min(4, num_tokens) + [1] * max(0, num_tokens - 4),
        hidden_states=torch.randn(num_tokens, len(LAYERS), hidden_size, generator=generator),
        target_layer_ids=LAYERS,
        target_model="tiny/qwen3_5",
    )


def test_a_sample_round_trips_with_the_contracted_dtypes_shapes_and_metadata(tmp_path):
    sample = make_sample()
    path = tmp_path / sample_object_name(17)
    size = write_sample(path, **sample, extra_metadata={"tokenizer": "demo"})
    assert size == path.stat().st_size
    for source in (path, path.read_bytes()):
        loaded = read_sample(source)
        assert loaded.sample_index == 17
        assert loaded.input_ids.dtype == torch.int32 and loaded.input_ids.tolist() == sample["input_ids"]
        assert loaded.loss_mask.dtype == torch.uint8 and loaded.loss_mask.tolist() == sample["loss_mask"]
        assert loaded.hidden_states.dtype == torch.bfloat16 and loaded.hidden_states.shape == (11, 3, 8)
        assert torch.equal(loaded.hidden_states, sample["hidden_states"].bfloat16())
        assert loaded.target_layer_ids == LAYERS and loaded.target_model == "tiny/qwen3_5"
        assert loaded.hidden_size == 8 and loaded.num_tokens == 11
        assert loaded.metadata["format"] == SAMPLE_FORMAT == "dflash-assets.hidden-states/2"
        assert loaded.metadata["hidden_state_dtype"] == "bf16" and loaded.hidden_states_scale is None
        assert json.loads(loaded.metadata["target_layer_ids"]) == LAYERS
        assert loaded.metadata["sample_index"] == "17" and loaded.metadata["tokenizer"] == "demo"


def test_reading_only_the_header_gives_the_metadata(tmp_path):
    path = tmp_path / "hs_00000017.safetensors"
    write_sample(path, **make_sample())
    metadata = read_sample_metadata(path)
    assert (
        metadata["sample_index"] == "17" and metadata["hidden_size"] == "8" and metadata["num_tokens"] == "11"
    )


def test_non_finite_hidden_states_raise_naming_the_sample_and_write_nothing(tmp_path):
    sample = make_sample()
    sample["hidden_states"][6, 1, 2] = float("nan")
    path = tmp_path / "hs_00000017.safetensors"
    with pytest.raises(NonFiniteHiddenStates) as error:
        write_sample(path, **sample)
    assert error.value.sample_index == 17
    assert "sample 17" in str(error.value) and "token 6" in str(error.value) and "layer 3" in str(error.value)
    assert list(tmp_path.iterdir()) == []
    sample["hidden_states"][6, 1, 2] = float("inf")
    with pytest.raises(NonFiniteHiddenStates):
        write_sample(path, **sample)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_neither_a_final_nor_a_temp_file(tmp_path):
    sample = make_sample()
    sample["target_layer_ids"] = [1, 3]  # does not match K=3
    with pytest.raises(ValueError, match="3 layers"):
        write_sample(tmp_path / "hs_00000017.safetensors", **sample)
    assert list(tmp_path.iterdir()) == []


def test_the_same_sample_always_gives_the_same_bytes(tmp_path):
    first = tmp_path / "a.safetensors"
    second = tmp_path / "b.safetensors"
    write_sample(first, **make_sample(), extra_metadata={"x": "1", "a": "2"})
    write_sample(second, **make_sample(), extra_metadata={"a": "2", "x": "1"})
    assert first.read_bytes() == second.read_bytes()


def test_an_existing_file_is_replaced_whole(tmp_path):
    path = tmp_path / "hs_00000017.safetensors"
    write_sample(path, **make_sample(seed=1))
    write_sample(path, **make_sample(seed=2))
    assert torch.equal(read_sample(path).hidden_states, make_sample(seed=2)["hidden_states"].bfloat16())
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("bad", ["input_ids", "loss_mask"])
def test_token_and_mask_lengths_must_match_the_hidden_states(tmp_path, bad):
    sample = make_sample()
    sample[bad] = sample[bad][:-1]
    with pytest.raises(ValueError, match="sample 17"):
        write_sample(tmp_path / "x.safetensors", **sample)


def test_metadata_must_be_text_and_may_not_override_the_contract(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        write_sample(tmp_path / "x.safetensors", **make_sample(), extra_metadata={"sample_index": "3"})
    with pytest.raises(TypeError):
        write_sample(tmp_path / "x.safetensors", **make_sample(), extra_metadata={"n": 3})


def test_truncated_or_foreign_files_are_reported_as_corrupt(tmp_path):
    path = tmp_path / "hs_00000017.safetensors"
    write_sample(path, **make_sample())
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CorruptSampleError, match="bytes"):
        read_sample_metadata(path)
    with pytest.raises(CorruptSampleError):
        read_sample(data[:-10])
    path.write_bytes(b"\x03")
    with pytest.raises(CorruptSampleError):
        read_sample_metadata(path)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(CorruptSampleError, match="format"):
        read_sample(path)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize(("num_tokens", "hidden_size"), [(1, 8), (11, 8), (300, 64), (2048, 96)])
def test_the_size_estimate_is_an_upper_bound_close_to_the_real_size(tmp_path, num_tokens, hidden_size, dtype):
    sample = make_sample(num_tokens=num_tokens, hidden_size=hidden_size)
    sample["target_model"] = "/very/long/path/" + "x" * 400
    size = write_sample(tmp_path / "s.safetensors", **sample, hidden_state_dtype=dtype)
    name_bytes = len(sample["target_model"])
    estimate = estimate_sample_nbytes(num_tokens, len(LAYERS), hidden_size, name_bytes, dtype)
    assert size <= estimate <= size + 8192


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize(
    ("sample_index", "num_tokens", "target_model"),
    [(0, 1, "m"), (17, 11, "tiny/qwen3_5"), (12_345_678, 3072, "Qwen3.6-27B@0123456789ab"), (9, 4, "é" * 9)],
)
def test_the_object_size_is_known_exactly_before_the_object_is_written(
    tmp_path, dtype, sample_index, num_tokens, target_model
):
    sample = make_sample(num_tokens=num_tokens, hidden_size=16)
    sample.update(sample_index=sample_index, target_model=target_model)
    extra = {"tokenizer": "demo"}
    path = tmp_path / "s.safetensors"
    written = write_sample(path, **sample, hidden_state_dtype=dtype, extra_metadata=extra)
    predicted = sample_object_nbytes(
        sample_index=sample_index,
        num_tokens=num_tokens,
        target_layer_ids=LAYERS,
        target_model=target_model,
        hidden_size=16,
        dtype=dtype,
        extra_metadata=extra,
    )
    assert predicted == written == path.stat().st_size


def test_an_fp8_object_round_trips_its_scales_and_dequantises_near_the_original(tmp_path):
    sample = make_sample(num_tokens=20, hidden_size=32)
    sample["hidden_states"] = sample["hidden_states"] * 2000
    path = tmp_path / sample_object_name(17)
    write_sample(path, **sample, hidden_state_dtype="fp8")
    for source in (path, path.read_bytes()):
        loaded = read_sample(source)
        assert loaded.hidden_state_dtype == "fp8" and loaded.metadata["hidden_state_dtype"] == "fp8"
        assert loaded.hidden_states.dtype == torch.float8_e4m3fn and loaded.hidden_states.shape == (20, 3, 32)
        scale = loaded.hidden_states_scale
        assert scale.dtype == torch.float32 and scale.shape == (20, 3)
        assert_within_e4m3_rounding(loaded.dequantized(), sample["hidden_states"], slack=0.0)


def test_a_format_1_object_from_before_fp8_is_still_read_as_bf16(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "hs_00000017.safetensors"
    hidden = torch.randn(4, 3, 8).bfloat16()
    metadata = {
        "format": "dflash-assets.hidden-states/1",
        "sample_index": "17",
        "target_layer_ids": json.dumps(LAYERS),
        "target_model": "old",
        "hidden_size": "8",
        "num_tokens": "4",
    }
    tensors = {
        "input_ids": torch.arange(4, dtype=torch.int32),
        "loss_mask": torch.ones(4, dtype=torch.uint8),
        "hidden_states": hidden,
    }
    save_file(tensors, str(path), metadata=metadata)
    loaded = read_sample(path)
    assert loaded.hidden_state_dtype == "bf16" and torch.equal(loaded.dequantized(torch.bfloat16), hidden)


def test_object_names_are_zero_padded_indices_and_parse_back():
    assert sample_object_name(17) == "hs_00000017.safetensors"
    assert parse_sample_object_name("hs_00000017.safetensors") == 17
    assert parse_sample_object_name(sample_object_name(123_456_789)) == 123_456_789
    for other in (
        "_manifest.json",
        ".hs_00000017.safetensors.tmp-1-ab",
        "hs_17.safetensors",
        "hs_00000017.bin",
    ):
        assert parse_sample_object_name(other) is None
