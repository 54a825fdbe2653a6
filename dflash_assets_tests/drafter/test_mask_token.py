"""The mask token: an explicit id, else the tokenizer's mask_token, else the first unused embedding row,
else a reserved special token the chat template never writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash_assets.drafter.config import DrafterConfig, MaskTokenError, mask_token_text, resolve_mask_token

WORDS = ["<eos>", "hello", "world", "again"]


# ChatML around the turns, as SmolLM2's template writes them.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + '<|im_end|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)


def tokenizer_dir(
    tmp_path: Path,
    *,
    mask_token: str | None,
    embedding_rows: int,
    specials: tuple[str, ...] = (),
    chat_template: str | None = None,
) -> Path:
    vocab = {word: i for i, word in enumerate(WORDS + ([mask_token] if mask_token else []))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", mask_token=mask_token)
    tokenizer.add_special_tokens({"additional_special_tokens": list(specials)})
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": embedding_rows}))
    return tmp_path


def test_the_tokenizers_mask_token_is_used_when_it_has_one(tmp_path: Path) -> None:
    directory = tokenizer_dir(tmp_path, mask_token="<mask>", embedding_rows=8)
    mask_id, reason = resolve_mask_token(directory, None, 8)
    assert mask_id == 4 and "mask_token '<mask>'" in reason


def test_without_a_mask_token_the_first_id_past_the_vocabulary_is_used(tmp_path: Path) -> None:
    # As the published Qwen3 drafters do: 151669 = len(tokenizer), a row the tokenizer never names.
    directory = tokenizer_dir(tmp_path, mask_token=None, embedding_rows=8)
    mask_id, reason = resolve_mask_token(directory, None, 8)
    assert mask_id == len(WORDS) and "past the tokenizer's 4 named tokens" in reason


def test_an_explicit_id_wins_and_must_have_an_embedding_row(tmp_path: Path) -> None:
    directory = tokenizer_dir(tmp_path, mask_token="<mask>", embedding_rows=8)
    mask_id, reason = resolve_mask_token(directory, 7, 8)
    assert mask_id == 7 and reason.startswith("explicit setting (DFLASH_MASK_TOKEN_ID")
    with pytest.raises(ValueError, match="DFLASH_MASK_TOKEN_ID=8 is outside the target's embedding matrix"):
        resolve_mask_token(directory, 8, 8)


def test_a_tokenizer_that_names_every_row_and_no_mask_token_asks_for_the_setting(tmp_path: Path) -> None:
    directory = tokenizer_dir(tmp_path, mask_token=None, embedding_rows=len(WORDS))
    with pytest.raises(MaskTokenError, match="set DFLASH_MASK_TOKEN_ID") as raised:
        resolve_mask_token(directory, None, len(WORDS))
    assert "\n" not in str(raised.value)


def test_a_tokenizer_naming_every_row_lends_its_last_special_token_that_no_conversation_holds(
    tmp_path: Path,
) -> None:
    # SmolLM2's case: 49,152 named rows, no mask token, ChatML's two tokens written by the template and a
    # tail of special tokens (`<repo_name>` .. `<empty_output>`) that a chat never holds.
    specials = ("<|im_start|>", "<|im_end|>", "<file_sep>", "<empty_output>")
    rows = len(WORDS) + len(specials)
    directory = tokenizer_dir(
        tmp_path, mask_token=None, embedding_rows=rows, specials=specials, chat_template=CHATML
    )
    mask_id, reason = resolve_mask_token(directory, None, rows)
    assert mask_id == len(WORDS) + 3  # `<empty_output>`: the last, and unwritten
    assert "never writes" in reason and "names all 8 embedding rows" in reason
    assert mask_token_text(directory, mask_id) == "<empty_output>"  # what SGLang looks it up by


def test_special_tokens_the_chat_template_writes_or_the_tokenizer_uses_are_never_lent(tmp_path: Path) -> None:
    # `<|im_end|>` is the last special token, but every turn ends with it; `<eos>` is the eos token.
    specials = ("<|im_start|>", "<|im_end|>")
    rows = len(WORDS) + len(specials)
    directory = tokenizer_dir(
        tmp_path, mask_token=None, embedding_rows=rows, specials=specials, chat_template=CHATML
    )
    with pytest.raises(MaskTokenError, match="no special token its chat template leaves unused"):
        resolve_mask_token(directory, None, rows)


# -- dflash_config.mask_token: the text SGLang looks the mask token up by


def test_the_mask_tokens_text_is_the_tokenizers_own_token_at_that_id(tmp_path: Path) -> None:
    directory = tokenizer_dir(tmp_path, mask_token="<mask>", embedding_rows=8)
    assert mask_token_text(directory, 4) == "<mask>"
    assert mask_token_text(directory, 1) == "hello"  # an explicit id the tokenizer names (like 248070)


def test_an_id_past_the_named_tokens_is_sglangs_default_unless_the_tokenizer_has_it(tmp_path: Path) -> None:
    # SGLang adds `<|MASK|>` at len(tokenizer): the very id the first-unused-id rule picks.
    plain = tokenizer_dir(tmp_path / "plain", mask_token=None, embedding_rows=8)
    assert mask_token_text(plain, len(WORDS)) == "<|MASK|>"
    # A tokenizer that has `<|MASK|>` under another id would make SGLang refuse: another name is written.
    taken = tokenizer_dir(tmp_path / "taken", mask_token="<|MASK|>", embedding_rows=8)
    assert mask_token_text(taken, 6) == "<|dflash_mask|>"


def test_the_export_writes_the_mask_token_beside_its_id(tmp_path: Path) -> None:
    directory = tokenizer_dir(tmp_path, mask_token="<mask>", embedding_rows=8)
    config = json.loads((directory / "config.json").read_text())
    config.update(hidden_size=16, num_hidden_layers=8, num_attention_heads=2, intermediate_size=32)
    (directory / "config.json").write_text(json.dumps(config))
    drafter = DrafterConfig.from_target(directory, num_layers=1, shape="target")
    raw = drafter.to_reference_dict()["dflash_config"]
    assert (raw["mask_token_id"], raw["mask_token"]) == (4, "<mask>")
    assert DrafterConfig.from_reference_dict(drafter.to_reference_dict()).mask_token == "<mask>"
