"""Capturing target hidden states: the layer convention, early stopping, batch invariance, config checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.target.batching import pad_batch
from dflash_assets.target.layer_ids import dflash_target_layer_ids, parse_layer_ids, resolve_target_layer_ids
from dflash_assets.target.model import TargetModelError, load_target_model
from dflash_assets_tests.support.targets import (
    BF16_ATOL,
    BF16_RTOL,
    TINY_LAYERS,
    TINY_VOCAB,
    random_token_lists,
    reference_hidden_states,
    save_tiny_target,
    tiny_text_config_kwargs,
)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir: Path) -> torch.nn.Module:
    return load_target_model(tiny_target_dir, "cpu")


# -- the layer rule and its settings


def test_dflash_rule_gives_the_seed_layers_for_a_64_layer_target():
    assert dflash_target_layer_ids(64) == [1, 16, 31, 46, 61]
    assert dflash_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]


def test_dflash_rule_rounds_as_the_reference_implementations_do():
    # 1 + i*6/4 = 1, 2.5, 4, 5.5, 7: Python's round (half to even), as z-lab/dflash, SGLang and vLLM.
    assert dflash_target_layer_ids(10, 5) == [1, 2, 4, 6, 7]
    assert dflash_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_target_layer_ids(64, 1) == [32]  # one draft layer: the middle layer N // 2
    assert dflash_target_layer_ids(12, 1) == [6]


def test_dflash_rule_refuses_a_model_too_shallow_for_distinct_layers():
    with pytest.raises(ValueError, match="DFLASH_TARGET_LAYER_IDS"):
        dflash_target_layer_ids(6, 5)


@pytest.mark.parametrize("text", ["1,16,31", "[1, 16, 31]", " 1 16 31 ", "1, 16,31,"])
def test_layer_ids_parse_from_comma_lists_and_json_lists(text):
    assert parse_layer_ids(text) == [1, 16, 31]


@pytest.mark.parametrize("text", ["", "[]", "1,x,3", "1.5"])
def test_unparsable_layer_ids_name_the_setting(text):
    with pytest.raises(ValueError, match="DFLASH_TARGET_LAYER_IDS"):
        parse_layer_ids(text)


def test_explicit_layer_ids_beyond_the_model_name_the_layer_the_depth_and_the_setting():
    with pytest.raises(ValueError) as error:
        resolve_target_layer_ids({"num_hidden_layers": 10}, [1, 5, 10])
    message = str(error.value)
    assert "layer 10" in message and "10 decoder layers" in message and "DFLASH_TARGET_LAYER_IDS" in message
    with pytest.raises(ValueError, match="layer -1"):
        resolve_target_layer_ids({"num_hidden_layers": 10}, [-1, 3])


@pytest.mark.parametrize("layer_ids", [[3, 3, 5], [5, 3]])
def test_explicit_layer_ids_must_be_strictly_increasing(layer_ids):
    with pytest.raises(ValueError, match="strictly increasing"):
        resolve_target_layer_ids({"num_hidden_layers": 10}, layer_ids)


def test_layer_count_is_read_from_a_nested_text_config_and_missing_counts_fail_clearly(tiny_target_dir):
    from transformers import AutoConfig

    nested = {"model_type": "qwen3_5", "text_config": {"num_hidden_layers": 64}}
    assert resolve_target_layer_ids(nested, None) == [1, 16, 31, 46, 61]
    assert resolve_target_layer_ids(AutoConfig.from_pretrained(tiny_target_dir), None) == [1, 2, 4, 6, 7]
    assert resolve_target_layer_ids(json.loads((tiny_target_dir / "config.json").read_text()), [0, 8]) == [
        0,
        8,  # the last usable layer of 10: layer 9 is the last decoder layer (see target/test_layer_ids.py)
    ]
    with pytest.raises(ValueError, match="num_hidden_layers"):
        resolve_target_layer_ids({"model_type": "bert"}, None)


# -- loading


def test_loading_a_missing_model_directory_names_the_path_and_the_setting(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(TargetModelError) as error:
        load_target_model(missing, "cpu")
    assert str(missing) in str(error.value) and "DFLASH_TARGET_MODEL" in str(error.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TargetModelError, match="no config.json"):
        load_target_model(tmp_path / "empty", "cpu")


def test_loading_a_directory_without_weights_fails_with_the_setting(tmp_path, tiny_target_dir):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_target_dir / "config.json").read_text())
    with pytest.raises(TargetModelError, match="DFLASH_TARGET_MODEL"):
        load_target_model(broken, "cpu:1")


def test_the_target_loads_in_eval_mode_as_float32_on_cpu(tiny_target):
    assert not tiny_target.training
    assert next(tiny_target.parameters()).dtype == torch.float32


# -- capture


@pytest.mark.parametrize(
    "layer_ids",
    [dflash_target_layer_ids(TINY_LAYERS), [0, 4, TINY_LAYERS - 2]],
    ids=["dflash-default", "first-middle-last-usable"],
)
def test_captured_layer_i_is_hf_hidden_states_i_plus_1(tiny_target, layer_ids):
    samples = random_token_lists([23, 40, 7])
    input_ids, attention_mask = pad_batch(samples, pad_id=0)
    captured = HiddenStateCapture(tiny_target, layer_ids)(input_ids, attention_mask)
    assert captured.shape == (3, 40, len(layer_ids), 64)
    for row, tokens in enumerate(samples):
        reference = reference_hidden_states(tiny_target, tokens)
        for slot, layer_id in enumerate(layer_ids):
            got = captured[row, : len(tokens), slot]
            torch.testing.assert_close(
                got.bfloat16(), reference[layer_id + 1].bfloat16(), atol=BF16_ATOL, rtol=BF16_RTOL
            )
            # Neighbouring layers differ, so an off-by-one would not pass unnoticed.
            assert not torch.allclose(got, reference[layer_id], atol=1e-3)


def test_the_last_layer_is_never_captured_hf_returns_it_post_norm_and_engines_never_serve_it(tiny_target):
    # hidden_states[-1] is the last layer after the final norm; engines capture "before layer N", which
    # never fires: a drafter trained on it would be served something else (target/layer_ids.py).
    with pytest.raises(ValueError, match=f"DFLASH_TARGET_LAYER_IDS=\\[{TINY_LAYERS - 1}\\]: layer"):
        HiddenStateCapture(tiny_target, [TINY_LAYERS - 1])


def test_the_forward_stops_after_the_last_needed_layer(tiny_target):
    calls: dict[str, int] = {}

    def counter(name):
        def hook(module, args):
            calls[name] = calls.get(name, 0) + 1

        return hook

    watched = {f"layer{i}": layer for i, layer in enumerate(tiny_target.model.layers)}
    watched |= {"norm": tiny_target.model.norm, "lm_head": tiny_target.lm_head}
    handles = [module.register_forward_pre_hook(counter(name)) for name, module in watched.items()]
    try:
        HiddenStateCapture(tiny_target, [1, 4])(*pad_batch(random_token_lists([12, 9]), 0))
    finally:
        for handle in handles:
            handle.remove()
    assert calls == {f"layer{i}": 1 for i in range(5)}  # layers 5.., the final norm and lm_head never ran


def test_capture_leaves_no_hooks_and_returns_an_ordinary_tensor(tiny_target):
    # (transformers installs its own output-capturing hooks once output_hidden_states was used)
    before = [len(layer._forward_hooks) for layer in tiny_target.model.layers]
    captured = HiddenStateCapture(tiny_target, [2])(torch.tensor([[5, 6, 7]]), torch.ones(1, 3))
    assert [len(layer._forward_hooks) for layer in tiny_target.model.layers] == before
    # Online training feeds this to modules that save inputs for backward; inference tensors cannot be.
    assert not captured.is_inference()
    with torch.inference_mode():
        assert tiny_target(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, TINY_VOCAB)


def test_a_sample_captured_alone_equals_it_inside_a_padded_batch(tiny_target):
    layer_ids = dflash_target_layer_ids(TINY_LAYERS)
    capture = HiddenStateCapture(tiny_target, layer_ids)
    shorter, sample, longer = random_token_lists([9, 50, 130], seed=7)
    alone = capture(torch.tensor([sample]), torch.ones(1, len(sample)))[0]
    batched = capture(*pad_batch([longer, sample, shorter], pad_id=0))[1, : len(sample)]
    torch.testing.assert_close(batched.bfloat16(), alone.bfloat16(), atol=BF16_ATOL, rtol=BF16_RTOL)
    # Far tighter in fp32: only summation order differs between the two forwards.
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


def test_capture_finds_the_layers_of_a_multimodal_qwen3_5_checkpoint():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    config = Qwen3_5Config(text_config=tiny_text_config_kwargs(6), vision_config=vision)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    assert resolve_target_layer_ids(model.config, [0, 4]) == [0, 4]
    tokens = random_token_lists([16])[0]
    captured = HiddenStateCapture(model, [0, 2])(torch.tensor([tokens]), torch.ones(1, 16))
    with torch.inference_mode():
        reference = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(captured[0, :, 0], reference[1][0])
    torch.testing.assert_close(captured[0, :, 1], reference[3][0])


# -- a real language model


def test_on_a_real_model_captured_layer_i_is_hf_hidden_states_i_plus_1(smollm2_dir: Path) -> None:
    """SmolLM2-135M-Instruct (llama, 30 layers, hidden 576): the DFlash rule's layers of two chat samples of
    different lengths, captured in one padded batch, against transformers' own `output_hidden_states`."""
    from transformers import AutoTokenizer

    model = load_target_model(smollm2_dir, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    samples = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            tokenize=True,
            return_dict=False,
        )
        for question, answer in [
            ("What is the capital of France?", "The capital of France is Paris."),
            ("Name three primary colours.", "Red, yellow and blue are the three primary colours of paint."),
        ]
    ]
    layer_ids = resolve_target_layer_ids(model.config, None, num_draft_layers=5)
    assert layer_ids == [1, 8, 14, 20, 27]
    captured = HiddenStateCapture(model, layer_ids)(*pad_batch(samples, pad_id=tokenizer.pad_token_id))
    assert captured.shape == (2, max(map(len, samples)), 5, 576)
    for row, tokens in enumerate(samples):
        reference = reference_hidden_states(model, tokens)
        for slot, layer_id in enumerate(layer_ids):
            got = captured[row, : len(tokens), slot]
            torch.testing.assert_close(
                got.bfloat16(), reference[layer_id + 1].bfloat16(), atol=BF16_ATOL * 4, rtol=BF16_RTOL
            )
            assert not torch.allclose(got, reference[layer_id], atol=1e-2)  # an off-by-one shows
