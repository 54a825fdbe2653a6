"""Which turns the target answers, the history each answer is generated from, and the tokenized sample
made of the last answer (exact ids where the engine kept them, the text otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_assets.conversations.datasets import Dropped
from dflash_assets.conversations.tokenize import AnswerTokenizer
from dflash_assets.generation.conversation import Answer, Regeneration, answer_positions, plan_regeneration


def test_every_assistant_turn_and_a_trailing_user_turn_are_answered():
    conversation = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]
    assert answer_positions(conversation) == [2, 4]
    assert answer_positions(conversation[:3]) == [2]
    assert isinstance(
        plan_regeneration(0, [{"role": "system", "content": "s"}]), Dropped
    )  # nothing to answer
    assert (
        plan_regeneration(0, [{"role": "user", "content": "u"}, {"role": "assistant", "content": ""}]).turns
        == 1
    )


def test_each_answer_is_generated_from_the_history_the_target_wrote_with_its_reasoning_kept():
    plan = Regeneration(
        3,
        [
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "the dataset's a1"},
            {"role": "user", "content": "u2"},
            {"role": "assistant", "content": "the dataset's a2"},
        ],
    )
    assert plan.next_prompt() == [{"role": "user", "content": "u1"}]
    plan.answers.append(Answer(content="a1", reasoning="because", finish_reason="stop"))
    # The template sees the earlier answer with its reasoning, and strips it as it does for history.
    assert plan.next_prompt() == [
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "because"},
        {"role": "user", "content": "u2"},
    ]
    plan.answers.append(Answer(content="a2", finish_reason="length"))
    assert plan.finished and [m["content"] for m in plan.messages()] == ["u1", "a1", "u2", "a2"]


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


def test_an_answer_with_exact_ids_is_the_prompt_then_those_ids_and_only_the_answers_are_learned(tokenizer):
    history = [{"role": "user", "content": "Say hi."}]
    prompt = tokenizer.apply_chat_template(
        history, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [17, 42, 99, end]  # what the target produced, whatever its text re-tokenises to
    encode = AnswerTokenizer(tokenizer)
    answered = encode(
        history,
        {"role": "assistant", "content": "ignored"},
        stopped=True,
        completion_token_ids=ids,
        prompt_token_ids=prompt,
    )
    assert answered.exact and answered.sample.input_ids == prompt + ids
    assert answered.sample.loss_mask == [0] * len(prompt) + [1] * len(ids)


def test_a_text_answer_is_tokenised_and_closed_with_the_end_of_turn_token_only_when_the_target_stopped(
    tokenizer,
):
    history = [
        {"role": "user", "content": "Say hi."},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "Again."},
    ]
    encode = AnswerTokenizer(tokenizer)
    stopped = encode(history, {"role": "assistant", "content": "Hi again."}, stopped=True)
    cut = encode(history, {"role": "assistant", "content": "Hi again."}, stopped=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert not stopped.exact and stopped.sample.input_ids[-1] == end
    assert cut.sample.input_ids == stopped.sample.input_ids[:-1]
    text = tokenizer.decode(stopped.sample.input_ids)
    assert text.endswith("<|im_start|>assistant\nHi again.<|im_end|>")
    # The earlier answer inside the prompt is learned too, with its end-of-turn token; questions are not.
    sample = stopped.sample
    learned = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
    assert learned == "Hi there.<|im_end|>Hi again.<|im_end|>"


def test_a_separate_reasoning_block_is_put_back_before_the_answer_as_qwen3_templates_write_it(tokenizer):
    encode = AnswerTokenizer(tokenizer)
    answer = {"role": "assistant", "content": "4", "reasoning_content": "2+2"}
    sample = encode([{"role": "user", "content": "2+2?"}], answer, stopped=True).sample
    learned = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])
    assert learned == "<think>\n2+2\n</think>\n\n4<|im_end|>"
