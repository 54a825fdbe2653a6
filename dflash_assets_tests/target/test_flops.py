"""The target's forward shape, counted once on the meta device and then read from the cache: the
same FLOPs as counting the loaded model, and no model built for a target counted before."""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForCausalLM

from dflash_assets.target import flops
from dflash_assets.target.flops import forward_flops, target_forward_shape

LENGTHS = [7, 40, 129]


def test_the_cached_shape_counts_what_the_loaded_model_counts(demo_model_dir, tmp_path, monkeypatch):
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir)
    first = target_forward_shape(demo_model_dir, tmp_path)
    assert len(list((tmp_path / "forward-shapes").glob("*.json"))) == 1

    def no_build(model_dir):
        raise AssertionError("the target was built again")

    monkeypatch.setattr(flops, "meta_target", no_build)
    again = target_forward_shape(demo_model_dir, tmp_path)
    assert again == first
    for through, head in ((None, True), (None, False), (3, False)):
        expected = forward_flops(model, LENGTHS, through, head)
        assert again.flops(LENGTHS, through, head) == pytest.approx(expected)


def test_a_damaged_cache_entry_is_counted_again(demo_model_dir, tmp_path):
    first = target_forward_shape(demo_model_dir, tmp_path)
    (entry,) = (tmp_path / "forward-shapes").glob("*.json")
    entry.write_text(json.dumps({"layer_weights": [1]}))  # a field missing
    assert target_forward_shape(demo_model_dir, tmp_path) == first
    entry.write_text("{")
    assert target_forward_shape(demo_model_dir, tmp_path) == first
    assert json.loads(entry.read_text())["layer_weights"] == list(first.layer_weights)


def test_another_config_is_another_entry(demo_model_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((demo_model_dir / "config.json").read_text())
    config["num_hidden_layers"] = 4
    config["layer_types"] = config["layer_types"][:4] if "layer_types" in config else None
    (other / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    cache = tmp_path / "cache"
    shallow, full = target_forward_shape(other, cache), target_forward_shape(demo_model_dir, cache)
    assert len(shallow.layer_weights) == 4 < len(full.layer_weights)
    assert len(list((cache / "forward-shapes").glob("*.json"))) == 2


def test_a_cache_that_cannot_be_written_still_gives_the_count(demo_model_dir, tmp_path):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the cache directory would be")
    shape = target_forward_shape(demo_model_dir, blocked)
    assert shape == target_forward_shape(demo_model_dir, tmp_path / "cache")
