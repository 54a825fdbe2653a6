"""Acceptance measured for real: greedy speculative decoding with the target in the loop.

Each round the drafter proposes a block from the target's hidden states of every position before the
anchor (the last token the target produced); the target verifies the block in one forward; the leading
run of drafts equal to the target's own greedy choice is accepted, plus the target's next token. The
acceptance length of a round is that run + 1 (no more than the round could still produce before the
token budget or a stop token), and tau is its mean: what SGLang and vLLM report. A DFlash2 drafter drafts
through its candidate selector (`DFlash2Drafter.propose`), as the engines run it.

A target whose every layer is plain attention (SmolLM2, Llama, Qwen3) verifies on its committed cache and
drops the rejected drafts' keys and values after, as the engines do: one target forward a round, and the
accepted tokens' states come from that forward. Hybrid targets (gated delta net + attention) and sliding
windows keep state that cannot be rolled back past a rejected draft, so for them nothing is rolled back:
the target's cache holds only committed tokens, each verification runs on a copy of it, and the accepted
tokens are then appended to the committed cache (a second forward of at most a block). Correctness is
checked, not assumed: the tokens decoded either way must equal the target's own greedy decoding, token for
token.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.target.model import cache_is_plain_attention


@dataclass
class DecodeResult:
    tokens: list[int]  # generated after the prompt, stop token included when one was produced
    acceptance_lengths: list[int]  # per verification round: accepted drafts + 1


class TargetVerifier:
    """The target as decoding uses it: `run(ids, cache) -> (greedy next token at each position [n],
    hidden states of the drafter's layers [n, K, H] in bfloat16)`, appending `ids` to `cache`.

    "Layer i" is Hugging Face `output_hidden_states[i + 1]`, as captured for training. States are
    rounded to bfloat16 like the stored training data, which is also what a bf16 engine feeds. The target
    runs without autocast, as capture does: under the caller's bf16 autocast (the drafter's, in training)
    its float32 parts would run in bf16, and its states and greedy tokens would not be the captured ones.
    """

    # A prefill longer than this runs a chunk at a time through the cache: `output_hidden_states` holds
    # every layer's states of the tokens it runs (64 layers x 32 K tokens x 5,120 in bf16 is 21 GB for a
    # 27B target), and the full-attention layers' activations grow with it; only the drafter's layers of
    # each chunk are kept.
    PREFILL_CHUNK_TOKENS = 4096

    def __init__(self, model: nn.Module, target_layer_ids: Sequence[int]) -> None:
        self.model = model.eval()
        self.target_layer_ids = list(target_layer_ids)
        # transformers renamed `past_key_values` to `cache`; take whichever this version has.
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._keeps_logits = "logits_to_keep" in parameters
        self.rolls_back = cache_is_plain_attention(getattr(model, "config", None))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def drop_last(self, cache: Any, count: int) -> None:
        """Forget the last `count` positions of `cache` (a rejected draft's keys and values); only where
        `rolls_back`: every layer plain keys and values, `[batch, heads, positions, head_dim]`."""
        if count <= 0:
            return
        if not self.rolls_back:
            raise ValueError("this target's cache cannot be rolled back (sliding or recurrent layers)")
        for layer in cache.layers:
            layer.keys = layer.keys[..., :-count, :]
            layer.values = layer.values[..., :-count, :]

    @torch.no_grad()
    def run(
        self, ids: Sequence[int], cache: Any, *, every_position: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`every_position=False` returns the greedy token of the last position only ([1]); None (the
        default) does so for a prefill (an empty cache), where decoding reads only the last token and the
        logits of every position would be [T, V] (3 GB in float32 for a 3 K-token prompt at a 248 K
        vocabulary). A verification round needs every position's token: its cache is never empty."""
        if every_position is None:
            every_position = int(cache.get_seq_length()) > 0
        ids = list(ids)
        if not every_position and len(ids) > self.PREFILL_CHUNK_TOKENS:
            step = self.PREFILL_CHUNK_TOKENS
            states = [
                self.run(ids[i : i + step], cache, every_position=False) for i in range(0, len(ids), step)
            ]
            return states[-1][0], torch.cat([hidden for _, hidden in states])
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        keep = {} if every_position or not self._keeps_logits else {"logits_to_keep": 1}
        with torch.autocast(self.device.type, enabled=False):
            output = self.model(
                input_ids=input_ids,
                output_hidden_states=True,
                use_cache=True,
                **{self._cache_argument: cache},
                **keep,
            )
        logits = output.logits[0] if every_position else output.logits[0, -1:]
        greedy = logits.argmax(dim=-1).cpu()
        hidden = torch.stack([output.hidden_states[i + 1][0] for i in self.target_layer_ids], dim=1)
        return greedy, hidden.to(torch.bfloat16)


def greedy_decode(
    verifier: TargetVerifier, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: set[int]
) -> list[int]:
    """The target's own greedy decoding, one token per forward (the reference for equality)."""
    cache = verifier.new_cache()
    greedy, _ = verifier.run(prompt, cache)
    generated = [int(greedy[-1])]
    while len(generated) < max_new_tokens and generated[-1] not in stop_token_ids:
        greedy, _ = verifier.run(generated[-1:], cache)
        generated.append(int(greedy[-1]))
    return generated


def speculative_decode(
    drafter: DFlashDrafter | PromptLookup,
    verifier: TargetVerifier,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: set[int],
) -> DecodeResult:
    """Greedy speculative decoding of up to `max_new_tokens` after `prompt` (stops after a stop token).

    A trained drafter drafts from the target's states before the anchor; a `PromptLookup` from the tokens
    so far alone. Either way the target verifies, and the accepted tokens are the target's own."""
    if not prompt:
        raise ValueError("speculative decoding needs a non-empty prompt")
    committed = verifier.new_cache()
    greedy, context = verifier.run(prompt, committed)  # prefill: the first new token is the target's
    generated = [int(greedy[-1])]
    lengths: list[int] = []
    # The drafter's context keys and values, kept across rounds where its layers allow it.
    draft_cache = drafter.new_draft_cache() if isinstance(drafter, DFlashDrafter) else None
    while len(generated) < max_new_tokens and generated[-1] not in stop_token_ids:
        anchor = generated[-1]
        if isinstance(drafter, PromptLookup):
            drafts = drafter.propose([*prompt, *generated])
        elif draft_cache is not None:
            drafts = drafter.draft_block(context, anchor, cache=draft_cache).tolist()
        else:
            drafts = drafter.draft_block(context, anchor).tolist()
        # greedy[j]: the target's token after anchor + drafts[:j]
        verified = committed if verifier.rolls_back else copy.deepcopy(committed)
        greedy, states = verifier.run([anchor, *drafts], verified)
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == int(greedy[accepted]):
            accepted += 1
        new = [*drafts[:accepted], int(greedy[accepted])]
        before = len(generated)
        for token in new:
            generated.append(token)
            if len(generated) == max_new_tokens or token in stop_token_ids:
                break
        # The tokens this round produced: accepted drafts past the budget or a stop token count for nothing
        # (as z-lab's `dflash_generate` counts them).
        lengths.append(len(generated) - before)
        # Commit the anchor and the accepted drafts: their states become context for the next block.
        if verifier.rolls_back:
            verifier.drop_last(committed, len(drafts) - accepted)
            states = states[: accepted + 1]
        else:
            _, states = verifier.run([anchor, *drafts[:accepted]], committed)
        context = torch.cat([context, states])
    return DecodeResult(tokens=generated, acceptance_lengths=lengths)


@dataclass(frozen=True)
class PromptLookup:
    """A training-free drafter (prompt lookup, the n-gram drafter vLLM and transformers ship): the last
    `n` tokens so far (n from `max_ngram` down to `min_ngram`) are looked up earlier in the prompt and
    answer, and the tokens that followed their most recent earlier occurrence are the drafts, at most
    `block_size - 1` of them; no occurrence drafts nothing (the round is a plain decoding step). It
    learns nothing, so it is the floor a trained drafter must clear on the same prompts: text that
    repeats itself (loops, copied code, quoted questions) is what it catches."""

    block_size: int = 16
    max_ngram: int = 3
    min_ngram: int = 1

    def propose(self, tokens: Sequence[int]) -> list[int]:
        """Drafts to follow `tokens` (the prompt, then every token generated, the anchor last)."""
        tokens = list(tokens)
        budget = self.block_size - 1
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = tokens[-n:]
            # The most recent earlier start of the suffix, not the suffix itself.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + budget]
        return []


# Held-out prompts by their length in tokens: served drafters' acceptance falls with the context (users'
# first complaint: 70 % to 16 % at 172 K for a drafter trained with a 2,048-token window), and one mean over
# short prompts hides it. (name, first length, end length or None); names are TensorBoard and metadata tags.
CONTEXT_BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("under_2k", 0, 2048),
    ("2k_8k", 2048, 8192),
    ("8k_32k", 8192, 32768),
    ("32k_plus", 32768, None),
)
# Fewer prompts than this in a bucket and its tau is said to be too few to mean anything: one prompt's
# rounds are not independent, and a few prompts' tau swings with which they are.
MIN_PROMPTS_PER_BUCKET = 4


def context_bucket(prompt_tokens: int) -> str:
    """The name of the `CONTEXT_BUCKETS` entry a prompt of `prompt_tokens` tokens falls in."""
    for name, start, end in CONTEXT_BUCKETS:
        if prompt_tokens >= start and (end is None or prompt_tokens < end):
            return name
    raise ValueError(f"a prompt of {prompt_tokens} tokens is in no context bucket")


def by_context_length(
    parts: Sequence[tuple[int, int, int]],  # (prompt tokens, rounds, accepted tokens) per prompt
) -> dict[str, dict[str, Any]]:
    """`{bucket: {prompts, rounds, accepted, tau, enough_prompts}}` for the buckets with any prompt."""
    buckets: dict[str, dict[str, Any]] = {}
    for tokens, rounds, accepted in parts:
        entry = buckets.setdefault(context_bucket(tokens), {"prompts": 0, "rounds": 0, "accepted": 0})
        entry["prompts"] += 1
        entry["rounds"] += rounds
        entry["accepted"] += accepted
    return {name: _bucket_figures(buckets[name]) for name, _, _ in CONTEXT_BUCKETS if name in buckets}


def combine_buckets(parts: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One `by_context_length` of several over disjoint prompts (each rank's share)."""
    totals: dict[str, dict[str, int]] = {}
    for part in parts:
        for name, entry in part.items():
            total = totals.setdefault(name, {"prompts": 0, "rounds": 0, "accepted": 0})
            for key in total:
                total[key] += int(entry[key])
    return {name: _bucket_figures(totals[name]) for name, _, _ in CONTEXT_BUCKETS if name in totals}


def _bucket_figures(entry: dict[str, Any]) -> dict[str, Any]:
    rounds, accepted, prompts = int(entry["rounds"]), int(entry["accepted"]), int(entry["prompts"])
    return {
        "prompts": prompts,
        "rounds": rounds,
        "accepted": accepted,
        "tau": accepted / rounds if rounds else None,
        "enough_prompts": prompts >= MIN_PROMPTS_PER_BUCKET,
    }


def bucket_label(name: str) -> str:
    """`under_2k` -> `< 2K tokens`, for people."""
    start, end = next((start, end) for bucket, start, end in CONTEXT_BUCKETS if bucket == name)
    if not start:
        return f"< {end // 1024}K tokens"
    return f"{start // 1024}K-{end // 1024}K tokens" if end else f">= {start // 1024}K tokens"


def describe_by_context_length(speculative: dict[str, Any] | None) -> str:
    """`< 2K tokens: tau 3.120 (12 prompts); 2K-8K tokens: tau 2.400 (2 prompts: too few to mean
    anything)`, or `not measured`."""
    parts = []
    for name, entry in ((speculative or {}).get("by_context_length") or {}).items():
        tau = entry.get("tau")
        count = int(entry["prompts"])
        text = (
            f"{bucket_label(name)}: tau {tau:.3f}" if tau is not None else f"{bucket_label(name)}: no rounds"
        )
        verdict = (
            "" if entry.get("enough_prompts") else f": too few to mean anything (< {MIN_PROMPTS_PER_BUCKET})"
        )
        parts.append(f"{text} ({count} prompt{'s' if count != 1 else ''}{verdict})")
    return "; ".join(parts) or "not measured"


def stop_token_ids_of(target_model: str) -> set[int]:
    """End-of-turn ids of the target, as regeneration stops on them: its generation config's
    `eos_token_id` (one id or a list: Gemma's `<end_of_turn>` beside `<eos>`), its tokenizer's eos token,
    and ChatML's `<|im_end|>` if the tokenizer has one."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(target_model))
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    try:
        eos = GenerationConfig.from_pretrained(str(target_model)).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    ids.update(int(i) for i in (eos if isinstance(eos, list | tuple) else [eos]) if i is not None)
    return ids
