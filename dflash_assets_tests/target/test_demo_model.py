"""The embedded demo target: a real qwen3_5_text model directory, deterministic, cached safely."""

from __future__ import annotations

import hashlib
import math
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash_assets.conversations.datasets import Dropped, bundled_dataset_path, iter_rows
from dflash_assets.target import demo_model


def file_hashes(directory: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if path.is_file()
    }


def test_demo_model_loads_with_auto_classes_as_a_hybrid_qwen3_5_model(demo_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(demo_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir)

    assert config.model_type == "qwen3_5_text"
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert config.num_hidden_layers == 12
    assert (
        config.layer_types
        == ["linear_attention"] * 3 + ["full_attention"] + (["linear_attention"] * 3 + ["full_attention"]) * 2
    )
    assert config.hidden_size == 64
    assert config.vocab_size == len(tokenizer)
    assert config.dflash_demo["version"] == demo_model.DEMO_MODEL_VERSION
    assert tokenizer.is_fast
    assert tokenizer.mask_token == "<|mask|>" and tokenizer.mask_token_id is not None
    assert tokenizer.eos_token == "<|im_end|>" and config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.pad_token == "<|endoftext|>" and config.pad_token_id == tokenizer.pad_token_id
    assert (demo_model_dir / "README.md").read_text().startswith("# dflash-assets/demo-target")

    input_ids = torch.tensor([tokenizer("Convert 5 miles to kilometres.")["input_ids"]])
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True)
    assert len(out.hidden_states) == config.num_hidden_layers + 1
    assert out.hidden_states[3].shape == (1, input_ids.shape[1], 64)
    assert out.logits.shape == (1, input_ids.shape[1], len(tokenizer))


def test_demo_chat_template_is_chatml_with_an_assistant_generation_prompt(demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    # Special tokens are single tokens, never split by BPE merges.
    ids = tokenizer("<|im_start|>user\nHi<|im_end|><|mask|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[-2:] == [tokenizer.eos_token_id, tokenizer.mask_token_id]


def test_demo_tokenizer_round_trips_arbitrary_unicode_text(demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    text = "Héllo wörld: 3 × 4 ≈ 12 — 日本語 🙂\n\tdone"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_demo_model_predicts_the_bundled_conversations_far_better_than_chance(demo_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir)
    rows = iter_rows(bundled_dataset_path())
    conversations = [row.messages for _, row in rows if not isinstance(row, Dropped)]
    input_ids = torch.tensor([tokenizer.apply_chat_template(conversations[0], return_dict=False)])
    with torch.no_grad():
        out = model(input_ids=input_ids, labels=input_ids, output_hidden_states=True)
    assert out.loss.item() < 0.6 * math.log(len(tokenizer))
    # Each decoder layer changes the hidden state, so layer ids are distinguishable downstream.
    # (hidden_states[0] is the embedding output, [-1] is after the final norm.)
    for before, after in zip(out.hidden_states[:-2], out.hidden_states[1:-1], strict=True):
        assert not torch.allclose(before, after, atol=1e-3)


@pytest.mark.slow  # several seconds of CPU: the full suite's, not the quick loop's
def test_same_seed_builds_byte_identical_files_through_the_command_line(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    again = tmp_path / "again"
    assert demo_model.main([str(again)]) == 0
    hashes = file_hashes(again)
    assert set(hashes) >= {"config.json", "model.safetensors", "tokenizer.json", "README.md"}
    assert hashes == file_hashes(demo_model_dir)


def test_building_into_a_non_empty_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "something.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        demo_model.build_demo_model(tmp_path)
    assert (tmp_path / "something.txt").read_text() == "keep me"


@pytest.mark.slow  # several seconds of CPU: the full suite's, not the quick loop's
def test_concurrent_first_use_builds_once_and_clears_a_killed_build(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    name = demo_model.demo_model_dir_name()
    killed = cache / f".{name}.building-killed"
    killed.mkdir()
    (killed / "config.json").write_text("{half written")

    results: list[Path] = []
    errors: list[BaseException] = []

    def first_use() -> None:
        try:
            results.append(demo_model.ensure_demo_model(cache))
        except BaseException as err:  # reported below, so a failure is not swallowed by the thread
            errors.append(err)

    threads = [threading.Thread(target=first_use) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert not errors
    assert results == [cache / name, cache / name]
    assert not killed.exists()
    assert sorted(p.name for p in cache.iterdir()) == [name, f"{name}.lock"]
    assert file_hashes(cache / name) == file_hashes(demo_model_dir)
    # Later calls reuse the directory as it is.
    mtime = (cache / name / "model.safetensors").stat().st_mtime_ns
    assert demo_model.ensure_demo_model(cache) == cache / name
    assert (cache / name / "model.safetensors").stat().st_mtime_ns == mtime
