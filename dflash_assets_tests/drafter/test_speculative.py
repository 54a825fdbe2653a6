"""Acceptance measured with the target in the loop: correct decoding, honest tau, and training raises it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.speculative import (
    MIN_PROMPTS_PER_BUCKET,
    PromptLookup,
    TargetVerifier,
    by_context_length,
    context_bucket,
    greedy_decode,
    speculative_decode,
)
from dflash_assets.evaluation.measure import combine_figures, greedy_reference, measure
from dflash_assets.evaluation.prompt_sets import Prompt, held_out_prompt_set
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OnlineData
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import train_drafter
from dflash_assets_tests.support.drafter_fixtures import (
    CYCLE_START,
    MASK_TOKEN_ID,
    load_capture,
    tiny_drafter_config,
)


@pytest.fixture(scope="module")
def verifier(target_dir: Path, config: DrafterConfig) -> TargetVerifier:
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return TargetVerifier(model, config.target_layer_ids)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(rng.randrange(8, 20))] for _ in range(count)]


def recomputed_greedy(verifier: TargetVerifier, prompt: list[int], count: int) -> list[int]:
    """Greedy decoding without any cache: the whole sequence through the target for every token."""
    ids = list(prompt)
    for _ in range(count):
        with torch.no_grad():
            logits = verifier.model(input_ids=torch.tensor([ids]), use_cache=False).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_a_prefill_computes_the_logits_of_its_last_position_only_and_gives_the_same_token_and_states(
    verifier: TargetVerifier,
) -> None:
    rows: list[int] = []
    head = verifier.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, output: rows.append(args[0].shape[1]))
    prompt = prompts(1, seed=5)[0]
    try:
        greedy, states = verifier.run(prompt, verifier.new_cache())
        every, every_states = verifier.run(prompt, verifier.new_cache(), every_position=True)
    finally:
        handle.remove()
    assert rows == [1, len(prompt)]  # [T, V] logits only where asked for
    assert greedy.tolist() == every[-1:].tolist() and torch.equal(states, every_states)


def test_a_verification_round_on_a_committed_cache_gives_every_positions_token(
    verifier: TargetVerifier,
) -> None:
    prompt, block = prompts(2, seed=6)
    cache = verifier.new_cache()
    verifier.run(prompt, cache)
    greedy, states = verifier.run(block, cache)
    assert greedy.shape == (len(block),) and states.shape[0] == len(block)
    assert greedy.tolist() == recomputed_next_tokens(verifier, prompt, block)


def recomputed_next_tokens(verifier: TargetVerifier, prompt: list[int], block: list[int]) -> list[int]:
    with torch.no_grad():
        logits = verifier.model(input_ids=torch.tensor([prompt + block]), use_cache=False).logits
    return logits[0, len(prompt) :].argmax(dim=-1).tolist()


def test_the_target_runs_as_capture_runs_it_even_inside_the_drafters_bf16_autocast(
    verifier: TargetVerifier,
) -> None:
    """Evaluation drafts under training's bf16 autocast; the target's tokens and states must still be
    the ones captured for training, which ran it without autocast."""
    prompt = prompts(1, seed=7)[0]
    greedy, states = verifier.run(prompt, verifier.new_cache(), every_position=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside, inside_states = verifier.run(prompt, verifier.new_cache(), every_position=True)
    assert torch.equal(inside, greedy) and torch.equal(inside_states, states)


class ScriptedDrafter(torch.nn.Module):
    """Drafts from a script: the target's own continuation (an oracle) or something always wrong."""

    def __init__(
        self, config: DrafterConfig, prompt_length: int, continuation: list[int], wrong: bool
    ) -> None:
        super().__init__()
        self.config, self.prompt_length = config, prompt_length
        self.continuation, self.wrong = continuation, wrong

    def draft_block(self, context: torch.Tensor, anchor: int) -> torch.Tensor:
        # The anchor sits at position len(context); drafts cover the positions after it.
        start = context.shape[0] - self.prompt_length + 1
        drafts = self.continuation[start : start + self.config.block_size - 1]
        drafts += [0] * (self.config.block_size - 1 - len(drafts))
        return torch.tensor([(t + 1) % MASK_TOKEN_ID if self.wrong else t for t in drafts])


def test_the_cached_greedy_decoding_equals_recomputing_the_whole_sequence(verifier: TargetVerifier) -> None:
    prompt = prompts(1, seed=3)[0]
    assert greedy_decode(verifier, prompt, 24, set()) == recomputed_greedy(verifier, prompt, 24)


@pytest.mark.parametrize("wrong", [False, True])
def test_speculative_decoding_returns_the_target_greedy_output_whatever_the_drafts(
    verifier: TargetVerifier, config: DrafterConfig, wrong: bool
) -> None:
    prompt = prompts(1, seed=4)[0]
    continuation = greedy_decode(verifier, prompt, 50 + config.block_size, set())  # what the drafts read
    drafter = ScriptedDrafter(config, len(prompt), continuation, wrong)
    result = speculative_decode(drafter, verifier, prompt, 50, set())

    assert result.tokens == continuation[:50]
    if wrong:  # every draft rejected: one token per round, from the target
        assert result.acceptance_lengths == [1] * 49
    else:  # every draft accepted: a whole block per round, the last round cut at 50 tokens
        assert result.acceptance_lengths[:3] == [config.block_size] * 3
        assert 1 + sum(result.acceptance_lengths) >= 50


def test_decoding_stops_after_a_stop_token(verifier: TargetVerifier, config: DrafterConfig) -> None:
    prompt = prompts(1, seed=5)[0]
    continuation = greedy_decode(verifier, prompt, 40, set())
    stop = continuation[7]
    first = continuation.index(stop)
    drafter = ScriptedDrafter(config, len(prompt), continuation, wrong=False)
    assert speculative_decode(drafter, verifier, prompt, 40, {stop}).tokens == continuation[: first + 1]
    assert greedy_decode(verifier, prompt, 40, {stop}) == continuation[: first + 1]


def test_prompt_lookup_drafts_what_followed_the_most_recent_earlier_occurrence_of_the_last_tokens() -> None:
    lookup = PromptLookup(block_size=4, max_ngram=3)
    # "5 6 7" occurred twice before; the later occurrence was followed by 1 2 3 (3 drafts: block 4).
    assert lookup.propose([5, 6, 7, 9, 9, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7]) == [1, 2, 3]
    # No trigram matches: the longest shorter n-gram that does (the bigram "8 7").
    assert lookup.propose([8, 7, 4, 4, 4, 1, 8, 7]) == [4, 4, 4]
    # Near the end the drafts are what there is; a token seen nowhere before drafts nothing.
    assert lookup.propose([3, 1, 2, 3]) == [1, 2, 3]
    assert lookup.propose([1, 2, 3, 4]) == []


def test_prompt_lookup_decoding_is_the_targets_greedy_output_and_catches_what_repeats(
    verifier: TargetVerifier,
) -> None:
    prompt = prompts(1, seed=8)[0]
    greedy = greedy_decode(verifier, prompt, 40, set())
    # A prompt holding the target's own answer: the lookup finds it and drafts it.
    repeated = prompt + greedy + prompt
    expected = greedy_decode(verifier, repeated, 40, set())
    result = speculative_decode(PromptLookup(block_size=8), verifier, repeated, 40, set())
    assert result.tokens == expected
    assert sum(result.acceptance_lengths) / len(result.acceptance_lengths) > 1.0
    plain = speculative_decode(PromptLookup(block_size=8), verifier, prompt, 40, set())
    assert plain.tokens == greedy


def measured(verifier: TargetVerifier, proposer, token_lists, new_tokens: int, block_size: int = 8) -> dict:
    """The one measurement (`evaluation/measure.py`) of `proposer` on `token_lists`, as a dict."""
    prompts = [Prompt(f"prompt {i}", list(ids)) for i, ids in enumerate(token_lists)]
    greedy = greedy_reference(verifier, prompts, max_new_tokens=new_tokens, stop_token_ids=set())
    figures = measure(
        proposer,
        verifier,
        prompts,
        greedy,
        max_new_tokens=new_tokens,
        stop_token_ids=set(),
        block_size=block_size,
    )
    return figures.as_dict()


def test_held_out_prompts_end_where_the_last_assistant_turn_begins_and_a_long_one_is_skipped_not_cut() -> (
    None
):
    rows = [(7, [1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 1, 1, 0, 0, 1, 1]), (3, [9, 9, 9], [0, 0, 0])]
    found = held_out_prompt_set(rows, count=5, max_prompt_tokens=100)
    assert [(p.location, p.token_ids) for p in found.prompts] == [("sample 7", [1, 2, 3, 4, 5, 6])]
    assert dict(found.skipped) == {"no_prompt": 1}
    short = held_out_prompt_set(rows, count=5, max_prompt_tokens=4)
    assert short.prompts == [] and dict(short.skipped) == {"no_prompt": 1, "too_long": 1}


@pytest.mark.slow  # a drafter trained until tau moves, decoded with the target
def test_training_on_the_targets_own_completions_raises_measured_acceptance(
    tmp_path: Path, own_completions
) -> None:
    # The product's input: conversations whose assistant turns the target itself generated.
    target_dir, samples = own_completions
    config = tiny_drafter_config(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    verifier = TargetVerifier(model, config.target_layer_ids)
    for sample in samples:  # the target continues the cycle from the prompt's last token
        start = sample.loss_mask.index(1)
        step = sample.input_ids[start - 1] - CYCLE_START
        assert sample.input_ids[start : start + 3] == [CYCLE_START + (step + k) % 8 for k in (1, 2, 3)]
    settings = TrainSettings(
        mode="online",
        epochs=12,
        global_batch_size=8,
        lr=3e-3,
        num_anchors=16,
        eval_samples=6,
        spec_eval_prompts=6,
        spec_eval_max_new_tokens=24,
        log_every_steps=100,
        checkpoint_every_minutes=None,
    )
    result = train_drafter(
        config,
        settings,
        OnlineData(samples, load_capture(target_dir)),
        store=open_store(str(tmp_path / "store")),
        run="own-completions",
        work_dir=tmp_path / "work",
        target_verifier=lambda: verifier,
    )
    baseline = result.baseline["speculative"]
    assert baseline["mismatched"] == [] and result.speculative["mismatched"] == []
    assert result.acceptance_length_tau > baseline["tau"] + 0.5, (
        baseline["tau"],
        result.acceptance_length_tau,
    )
    # Measured again on the held-out rule's prompts, by the one measurement, with the weights as exported.
    from dflash_assets.drafter.export import weights_as_exported

    rows = [
        (s.sample_index, s.input_ids, s.loss_mask)
        for s in samples
        if s.sample_index in result.eval_sample_indices
    ]
    held_out = held_out_prompt_set(rows, count=6, max_prompt_tokens=10_000).prompts
    with weights_as_exported(result.model):
        again = measured(verifier, result.model, [p.token_ids for p in held_out], 24, config.block_size)
    assert again["tau"] == result.acceptance_length_tau


@pytest.mark.slow  # several seconds of CPU: the full suite's, not the quick loop's
def test_a_fresh_drafter_is_rarely_accepted(verifier: TargetVerifier, config: DrafterConfig) -> None:
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(config)
    result = measured(verifier, drafter, prompts(3, seed=9), 20, config.block_size)
    assert result["lossless_prompts"] == result["prompts"] == 3 and result["rounds"] > 0
    assert 1.0 <= result["tau"] < 1.5


def test_a_prompt_falls_in_the_bucket_of_its_length_in_tokens() -> None:
    assert [context_bucket(n) for n in (1, 2047, 2048, 8191, 8192, 32767, 32768, 200_000)] == [
        "under_2k", "under_2k", "2k_8k", "2k_8k", "8k_32k", "8k_32k", "32k_plus", "32k_plus",
    ]  # fmt: skip


def test_tau_per_bucket_weighs_rounds_as_the_whole_does_and_says_when_prompts_are_too_few() -> None:
    # (prompt tokens, rounds, accepted tokens): four short prompts, one of 3 K tokens.
    figures = by_context_length([(100, 10, 30), (200, 5, 5), (300, 5, 10), (400, 10, 15), (3000, 4, 6)])
    assert list(figures) == ["under_2k", "2k_8k"]
    short, long = figures["under_2k"], figures["2k_8k"]
    assert (short["prompts"], short["rounds"], short["accepted"]) == (4, 30, 60)
    assert short["tau"] == 2.0 and short["enough_prompts"]
    assert long["tau"] == 1.5 and long["prompts"] < MIN_PROMPTS_PER_BUCKET
    assert not long["enough_prompts"]


def test_the_evaluated_prompts_take_each_length_in_turn_so_a_few_long_ones_are_measured() -> None:
    short = [[1] * n for n in (10, 11, 12, 13, 14, 15)]
    long = [[2] * 2100, [3] * 9000]
    prompts = [*short[:3], long[0], *short[3:], long[1]]

    def chosen(token_lists, count):  # each row a prompt and then its answer
        rows = [(i, [*ids, 5], [0] * len(ids) + [1]) for i, ids in enumerate(token_lists)]
        return [
            p.token_ids for p in held_out_prompt_set(rows, count=count, max_prompt_tokens=100_000).prompts
        ]

    assert [len(p) for p in chosen(prompts, 4)] == [10, 11, 2100, 9000]  # one of each bucket, then the next
    assert chosen(prompts, 100) == prompts
    assert chosen(short, 3) == short[:3]  # all short: the first ones by sample index


def test_tau_by_prompt_length_is_measured_on_a_long_prompt_and_combines_over_ranks_as_one_process(
    verifier: TargetVerifier,
) -> None:
    rng = random.Random(3)
    long_prompt = [rng.randrange(1, 250) for _ in range(2100)]
    all_prompts = [*prompts(4, seed=4), long_prompt]
    lookup = PromptLookup(block_size=8)
    whole = measured(verifier, lookup, all_prompts, 12)
    buckets = whole["by_context_length"]
    assert {name: entry["prompts"] for name, entry in buckets.items()} == {"under_2k": 4, "2k_8k": 1}
    assert buckets["under_2k"]["enough_prompts"] and not buckets["2k_8k"]["enough_prompts"]
    assert sum(entry["rounds"] for entry in buckets.values()) == whole["rounds"]
    assert sum(entry["accepted"] for entry in buckets.values()) / whole["rounds"] == pytest.approx(
        whole["tau"]
    )
    # Two ranks, prompt i on rank i mod 2, add up to the one process's figures, bucket by bucket.
    ranks = [measured(verifier, lookup, all_prompts[r::2], 12) for r in (0, 1)]
    combined = combine_figures(ranks)
    assert combined["by_context_length"] == buckets
    assert combined["tau"] == pytest.approx(whole["tau"])
    assert combined["acceptance_by_position"] == pytest.approx(whole["acceptance_by_position"])
    assert (combined["rounds"], combined["prompts"], combined["lossless_prompts"]) == (whole["rounds"], 5, 5)


def test_a_long_prefill_runs_a_chunk_at_a_time_and_gives_the_same_token_states_and_decoding(
    verifier: TargetVerifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = [random.Random(8).randrange(1, 250) for _ in range(45)]
    whole_cache = verifier.new_cache()
    whole, whole_states = verifier.run(prompt, whole_cache)
    monkeypatch.setattr(verifier, "PREFILL_CHUNK_TOKENS", 8)  # 6 chunks, the last of 5 tokens
    seen: list[int] = []
    handle = verifier.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    chunked_cache = verifier.new_cache()
    try:
        chunked, chunked_states = verifier.run(prompt, chunked_cache)
    finally:
        handle.remove()
    assert seen == [8, 8, 8, 8, 8, 5]  # no forward holds every layer's states of the whole prompt
    assert chunked.tolist() == whole.tolist() and chunked_states.shape == whole_states.shape
    torch.testing.assert_close(chunked_states.float(), whole_states.float(), rtol=2**-7, atol=1e-3)
    assert int(chunked_cache.get_seq_length()) == len(prompt)
    # The cache the chunks built decodes on as the whole prefill's does.
    assert greedy_decode(verifier, prompt, 12, set()) == recomputed_greedy(verifier, prompt, 12)


class PartlyRightDrafter(ScriptedDrafter):
    """Right on the first `round % block_size` drafts of a round, wrong after: every accepted length
    occurs, so every length of rejected tail is cut from the cache. Records the context it was given."""

    def __init__(self, config: DrafterConfig, prompt_length: int, continuation: list[int]) -> None:
        super().__init__(config, prompt_length, continuation, wrong=False)
        self.contexts: list[torch.Tensor] = []

    def draft_block(self, context: torch.Tensor, anchor: int) -> torch.Tensor:
        drafts = super().draft_block(context, anchor)
        right = len(self.contexts) % self.config.block_size
        self.contexts.append(context.clone())
        drafts[right:] = (drafts[right:] + 1) % MASK_TOKEN_ID
        return drafts


def plain_attention_target() -> torch.nn.Module:
    """A small random Llama: every layer plain attention, so its cache can be cut back."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_a_plain_attention_target_verifies_once_a_round_and_cuts_the_rejected_drafts_from_its_cache(
    verifier: TargetVerifier, config: DrafterConfig
) -> None:
    assert not verifier.rolls_back  # the demo target's linear-attention layers: verified on a copy
    plain = TargetVerifier(plain_attention_target(), [0, 1])
    assert plain.rolls_back
    prompt = prompts(1, seed=6)[0]
    continuation = greedy_decode(plain, prompt, 60 + config.block_size, set())
    drafter = PartlyRightDrafter(config, len(prompt), continuation)
    forwards = []
    hook = plain.model.register_forward_hook(lambda module, args, output: forwards.append(1))
    try:
        result = speculative_decode(drafter, plain, prompt, 60, set())
    finally:
        hook.remove()

    assert result.tokens == continuation[:60]  # lossless whatever was cut
    # Round r had its first r % block_size drafts right: that many accepted, plus the target's token.
    expected = [r % config.block_size + 1 for r in range(len(result.acceptance_lengths))]
    assert result.acceptance_lengths[:-1] == expected[:-1]
    assert max(expected[:-1]) >= 6  # long accepted runs and short ones were both cut from the cache
    assert len(forwards) == 1 + len(result.acceptance_lengths)  # the prefill, then one forward a round
    # The context each round drafted from is the target's states of everything committed: the same as
    # one forward over the whole sequence gives (bf16 rounding apart), never a rejected draft's.
    last = drafter.contexts[-1]
    sequence = [*prompt, *result.tokens][: last.shape[0]]
    _, recomputed = plain.run(sequence, plain.new_cache())
    assert last.shape == recomputed.shape
    torch.testing.assert_close(last.float(), recomputed.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_the_drafters_kept_context_keys_give_the_block_a_whole_projection_gives(
    verifier: TargetVerifier, config: DrafterConfig, arch: str
) -> None:
    """Rounds over a context that grows by what each commits: the kept keys and values project each
    position once and give the block the uncached path gives, round after round."""
    from dataclasses import replace

    from dflash_assets.drafter.model import drafter_class

    torch.manual_seed(0)
    shaped = replace(config, arch=arch)
    width = shaped.hidden_size
    drafter = drafter_class(shaped)(
        shaped, torch.randn(shaped.vocab_size, width), torch.randn(shaped.vocab_size, width)
    ).eval()
    prompt = prompts(1, seed=8)[0]
    _, context = verifier.run(prompt + greedy_decode(verifier, prompt, 30, set()), verifier.new_cache())
    cache = drafter.new_draft_cache()
    projected = []
    hook = drafter.fc.register_forward_hook(lambda module, args, output: projected.append(args[0].shape[1]))
    previous = 0
    try:
        for length in (len(prompt), len(prompt) + 1, len(prompt) + 6, len(prompt) + 14, context.shape[0]):
            anchor = 7 + length % 5
            kept = drafter.block_hidden(context[:length], anchor, cache)
            assert projected == [length - previous]  # only the positions committed since the last round
            whole = drafter.block_hidden(context[:length], anchor)
            assert projected[1] == length  # the uncached path projects the whole context every round
            torch.testing.assert_close(kept, whole, atol=1e-4, rtol=1e-4)
            projected.clear()
            previous = length
    finally:
        hook.remove()
    with pytest.raises(ValueError, match="the context shrank from"):
        drafter.block_hidden(context[:5], 3, cache)


def test_speculative_decoding_projects_each_context_position_once_and_drafts_as_without_the_cache(
    verifier: TargetVerifier, config: DrafterConfig, monkeypatch
) -> None:
    torch.manual_seed(1)
    width = config.hidden_size
    drafter = DFlashDrafter(
        config, torch.randn(config.vocab_size, width), torch.randn(config.vocab_size, width)
    )
    prompt = prompts(1, seed=9)[0]
    projected: list[int] = []
    hook = drafter.fc.register_forward_hook(lambda module, args, output: projected.append(args[0].shape[1]))
    try:
        kept = speculative_decode(drafter.eval(), verifier, prompt, 40, set())
        kept_rows, projected[:] = sum(projected), []
        monkeypatch.setattr(DFlashDrafter, "new_draft_cache", lambda self: None)
        whole = speculative_decode(drafter, verifier, prompt, 40, set())
    finally:
        hook.remove()
    assert (kept.tokens, kept.acceptance_lengths) == (whole.tokens, whole.acceptance_lengths)
    rounds = len(kept.acceptance_lengths)
    # The last round drafted from every position before its anchor, each projected once over the rounds.
    assert kept_rows == len(prompt) + len(kept.tokens) - kept.acceptance_lengths[-1] - 1
    assert sum(projected) > kept_rows * rounds / 4  # the whole context again every round
