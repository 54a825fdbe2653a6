"""Which turns the target answers (up to the token budget), the history each answer is generated from, and
the tokenized sample made of the last answer (exact ids where the engine kept them, the text otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_assets.conversations.datasets import Dropped
from dflash_assets.conversations.tokenize import AnswerTokenizer
from dflash_assets.generation.conversation import Answer, Regeneration, answer_positions, plan_regeneration
from dflash_assets.generation.records import CompletionRecord


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


THREE_TURNS = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "u1"},
    {"role": "assistant", "content": "the dataset's a1"},
    {"role": "user", "content": "u2"},
    {"role": "assistant", "content": "the dataset's a2"},
    {"role": "user", "content": "u3"},
    {"role": "assistant", "content": "the dataset's a3"},
]


def answer_of(prompt_tokens: int, completion_tokens: int, content: str = "a") -> Answer:
    """An answer as the in-process engine gives it: the exact ids of its prompt and of itself."""
    return Answer(
        content=content,
        finish_reason="stop",
        prompt_token_ids=list(range(prompt_tokens)),
        completion_token_ids=list(range(completion_tokens)),
    )


def answer_until_finished(plan: Regeneration, lengths: list[tuple[int, int]]) -> list[int]:
    """Answer `plan` turn by turn as the scheduler does (`(prompt, completion)` tokens per turn) until it
    is finished; returns the turns asked for."""
    asked = []
    for turn, (prompt, completion) in enumerate(lengths):
        if plan.finished:
            break
        asked.append(turn)
        plan.answers.append(answer_of(prompt, completion, f"a{turn + 1}"))
    return asked


def test_a_conversation_ends_after_the_answer_that_brings_it_to_the_token_budget():
    plan = plan_regeneration(0, THREE_TURNS, token_budget=100)
    assert not isinstance(plan, Dropped) and plan.turns == 3
    asked = answer_until_finished(plan, [(60, 40), (130, 10), (160, 10)])  # 60 + 40: the budget, reached

    assert asked == [0] and plan.finished  # the later turns are never asked for
    assert plan.ended_at() == 0 and plan.ended_because() == "max_length"
    record = CompletionRecord.from_regeneration(plan, "in-process")
    assert [m["content"] for m in record.messages] == ["be brief", "u1", "a1"]  # one answer, nothing after
    assert len(record.turns) == 1 and record.ended_early == "max_length"
    assert record.prompt_token_ids == list(range(60))  # the trained sample: that answer's prompt, then it


def test_a_conversation_one_token_short_of_the_budget_gets_its_next_turn():
    plan = plan_regeneration(0, THREE_TURNS, token_budget=100)
    assert answer_until_finished(plan, [(60, 39), (110, 10), (130, 10)]) == [0, 1]
    assert plan.ended_at() == 1 and len(plan.messages()) == 5


@pytest.mark.parametrize("budget", [None, 10_000], ids=["no budget", "a budget nobody reaches"])
def test_without_a_budget_or_under_one_every_turn_is_answered(budget):
    plan = plan_regeneration(0, THREE_TURNS, token_budget=budget)
    assert answer_until_finished(plan, [(60, 40), (130, 10), (160, 10)]) == [0, 1, 2]
    assert plan.ended_at() is None and plan.ended_because() is None
    assert [m["content"] for m in plan.messages()][-1] == "a3"


def test_the_last_turn_past_the_budget_is_no_early_end():
    """Nothing follows the last answer: a record that reaches the budget there says nothing of it."""
    plan = plan_regeneration(0, [{"role": "user", "content": "u"}], token_budget=10)
    plan.answers.append(answer_of(30, 30))
    assert plan.finished and plan.ended_because() is None
    assert CompletionRecord.from_regeneration(plan, "in-process").ended_early is None


def test_a_conversations_length_is_the_prompt_and_the_answer_as_ids_else_as_counted():
    # The in-process engine (and vLLM with return_token_ids): exact ids.
    assert answer_of(60, 40).conversation_tokens() == 100
    # A server that returns text: its usage counts.
    counted = Answer(content="a", finish_reason="stop", prompt_tokens=60, completion_tokens=40)
    assert counted.conversation_tokens() == 100
    # Nothing counted (the server engine fills in the prompt's own count where it can): 0, so a budget
    # never ends a conversation on a count it lacks.
    assert Answer(content="a", finish_reason="stop").conversation_tokens() == 0


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
