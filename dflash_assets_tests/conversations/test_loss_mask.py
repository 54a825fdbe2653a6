"""The assistant loss mask under a real model's chat template (SmolLM2-135M-Instruct's ChatML)."""

from __future__ import annotations

from pathlib import Path


def test_a_real_models_template_masks_exactly_what_the_assistant_wrote(smollm2_dir: Path) -> None:
    """SmolLM2's ChatML template adds a system prompt of its own when the conversation has none: only the
    two answers and the `<|im_end|>` closing each are masked, never that system prompt or the headers."""
    from transformers import AutoTokenizer

    from dflash_assets.conversations.tokenize import tokenize_conversation

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
        {"role": "user", "content": "And 3 + 3?"},
        {"role": "assistant", "content": "3 + 3 = 6."},
    ]
    sample = tokenize_conversation(tokenizer, messages)
    assert tokenizer.decode(sample.input_ids).startswith("<|im_start|>system\nYou are a helpful AI assistant")
    masked = [i for i, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expected = [*tokenizer.encode("2 + 2 = 4."), end, *tokenizer.encode("3 + 3 = 6."), end]
    assert masked == expected
    # The masked runs are exactly the two answers, each followed by an unmasked newline and header.
    runs = "".join(map(str, sample.loss_mask)).strip("0").split("0")
    assert [len(run) for run in runs if run] == [len(tokenizer.encode("2 + 2 = 4.")) + 1] + [
        len(tokenizer.encode("3 + 3 = 6.")) + 1
    ]
