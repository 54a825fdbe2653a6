"""Greedy or sampled decoding over the target's own forward, on a KV cache written in place: what
`generate_rows` runs for a target whose every layer is plain attention (`decodes_in_place`).

Why not `generate`: SmolLM2-135M (float32, 2 CPU cores) answered 44 ShareGPT first turns (33 to 1,368
prompt tokens, 192 new ones) at 22 tokens/s where vLLM's CPU build answers 223. The batch of 42 was padded
to its longest prompt: 57 K prefill positions for 10.6 K real ones, each a whole token's forward, and every
decoding step attended over 1,400+ positions a row where most rows hold 250. `DynamicCache` grows by
`torch.cat`, a fresh copy of every layer's keys and values at each step: 47 % of a step at 40 rows of 200
positions, more as the cache grows. So here:

- Prompts are grouped by length (`decoding_groups`): a group's rows decode together, at the width of its
  longest prompt. A second group costs a decoding step more (the weights read again, the Python of a
  forward), so groups are cut only where that buys more: a step's cost is counted as the cached positions
  that weigh as much as the weights (`step_positions`).
- Each group's keys and values live in one tensor a layer, allocated at the group's final width and written
  in place (`InPlaceCache`); attention reads only the columns filled so far.
- The prefill runs in sub-batches of near-equal prompt lengths, each writing its rows straight into the
  group's cache, left-padded to the group's width, so every row's answer starts at the same column.
- A row leaves its group as soon as it stops (the cache keeps only the rows still decoding), and only the
  last position's logits are computed (`logits_to_keep=1`).

Greedy answers are the argmax of the float32 logits, as `generate`'s; positions are counted from each row's
first prompt token, as `generate` counts them under left padding. Sampled answers are reproducible: one
generator, seeded once, draws every token of the call. A target this cannot serve (sliding-window or
linear-attention layers, a generation config asking for more than temperature, top-k and top-p) is left
to `generate`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from dflash_assets.target.batching import plan_batches
from dflash_assets.target.model import cache_is_plain_attention

# Positions of one prefill forward, padding included: enough to keep a CPU's matrix products at full speed,
# few enough that the activations of a long prompt stay small beside the cache.
PREFILL_TOKENS = 8192
# Largest share of padding in a prefill forward (the prompt lengths of a group can span 100 K positions).
PREFILL_PADDING = 0.1

# Generation-config fields the loop here does not implement, each with the value that leaves it off (None
# leaves every one off): a config setting one otherwise (a repetition penalty, beams, min-p...) decodes with
# `generate`.
_NOT_IMPLEMENTED: dict[str, Any] = {
    **dict.fromkeys(
        [
            "num_beams",
            "num_return_sequences",
            "num_beam_groups",
            "repetition_penalty",
            "encoder_repetition_penalty",
            "guidance_scale",
            "typical_p",
        ],
        1,
    ),
    **dict.fromkeys(
        [
            "no_repeat_ngram_size",
            "encoder_no_repeat_ngram_size",
            "min_length",
            "min_new_tokens",
            "epsilon_cutoff",
            "eta_cutoff",
            "diversity_penalty",
            "renormalize_logits",
            "remove_invalid_values",
            "token_healing",
            "use_mtp",
        ],
        0,
    ),
    **dict.fromkeys(
        [
            "bad_words_ids",
            "sequence_bias",
            "forced_bos_token_id",
            "forced_eos_token_id",
            "suppress_tokens",
            "begin_suppress_tokens",
            "exponential_decay_length_penalty",
            "min_p",
            "top_h",
            "watermarking_config",
            "stop_strings",
            "max_time",
            "penalty_alpha",
            "dola_layers",
            "constraints",
            "force_words_ids",
            "prompt_lookup_num_tokens",
        ],
        None,
    ),
}


def decodes_in_place(model: Any, config: Any) -> bool:
    """Whether `decode_rows` answers for `model` under the generation `config`: a decoder-only model taking
    `logits_to_keep`, every layer of whose cache is plain keys and values (what `DynamicCache` builds as a
    `DynamicLayer`: no sliding window, no linear-attention state), asked for greedy decoding or for sampling
    with temperature, top-k and top-p only."""
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return False
    if not cache_is_plain_attention(getattr(model, "config", None)):
        return False
    values = ((getattr(config, name, None), off) for name, off in _NOT_IMPLEMENTED.items())
    return all(value is None or value == off for value, off in values)


def step_positions(model: Any) -> int:
    """A decoding step's fixed cost, as the cached positions that cost as much to read: every weight is
    read once a step whatever the batch, a position costs its keys and values in every layer (SmolLM2-135M:
    134.5 M weights, 11,520 values a position, so 11.7 K positions)."""
    from dflash_assets.target.model import config_value, text_config

    config = text_config(model.config)
    heads = config_value(config, "num_attention_heads")
    head_dim = config_value(config, "head_dim") or config_value(config, "hidden_size") // heads
    kv_heads = config_value(config, "num_key_value_heads") or heads
    per_position = 2 * config_value(config, "num_hidden_layers") * kv_heads * head_dim
    return max(1, sum(p.numel() for p in model.parameters()) // per_position)


def decoding_groups(lengths: Sequence[int], step_cost: int) -> list[list[int]]:
    """Indices into `lengths` (prompt lengths), grouped to decode together, longest group first, each group
    longest prompt first. Groups are runs of the prompts sorted by length, cut to minimise the cost of a
    decoding step over all groups: `step_cost` each, plus the padded positions each row reads (its group's
    longest prompt less its own). Exact, by dynamic programming over the cuts (64 prompts: 2,080 runs)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    prefix = [0]
    for i in order:
        prefix.append(prefix[-1] + lengths[i])
    best, start = [0] + [0] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        width = lengths[order[end - 1]]
        costs = (
            (best[begin] + step_cost + (end - begin) * width - (prefix[end] - prefix[begin]), begin)
            for begin in range(end)
        )
        best[end], start[end] = min(costs)
    groups, end = [], len(order)
    while end:
        groups.append(order[start[end] : end][::-1])
        end = start[end]
    return groups


class _InPlaceLayer(DynamicLayer):
    """One layer's keys and values for a group: `[rows, kv heads, capacity, head dim]`, allocated at the
    first write, zeros where nothing is written (a masked position must not hold a NaN: its weight is 0, but
    0 * NaN is NaN). `window` says where forwards write and what attention reads: (rows, first column,
    columns filled)."""

    def __init__(self, rows: int, capacity: int) -> None:
        super().__init__()
        self.rows, self.capacity = rows, capacity
        self.window: tuple[slice, int, int] = (slice(0, rows), 0, 0)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.buffers = tuple(
            states.new_zeros((self.rows, states.shape[1], self.capacity, states.shape[3]))
            for states in (key_states, value_states)
        )
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, first, filled = self.window
        end = first + filled + key_states.shape[-2]
        self.keys, self.values = (buffer[rows, :, first:end] for buffer in self.buffers)
        self.keys[:, :, filled:].copy_(key_states)
        self.values[:, :, filled:].copy_(value_states)
        self.window = (rows, first, end - first)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.window[2]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.buffers is not None:
            self.buffers = tuple(buffer.index_select(0, indices.to(buffer.device)) for buffer in self.buffers)
        self.rows = len(indices)
        self.window = (slice(0, self.rows), *self.window[1:])


class InPlaceCache(Cache):
    """A group's cache, every layer an `_InPlaceLayer`: `write_at` points the next forward at some of its
    rows and columns, `batch_select_indices` keeps only the rows still decoding."""

    def __init__(self, layers: int, rows: int, capacity: int) -> None:
        super().__init__(layers=[_InPlaceLayer(rows, capacity) for _ in range(layers)])

    def write_at(self, rows: slice, first: int, filled: int = 0) -> None:
        for layer in self.layers:
            layer.window = (rows, first, filled)


def decode_rows(
    model: Any, prompts: list[list[int]], pad_id: int, config: Any, seed: int | None, device: Any
) -> list[list[int]]:
    """Each prompt's new tokens, up to the config's `max_new_tokens`, cut after the first of its
    `eos_token_id`s (a row that never stops has `max_new_tokens`)."""
    from transformers import DynamicCache

    stop_ids = config.eos_token_id if isinstance(config.eos_token_id, list | tuple) else [config.eos_token_id]
    stop_ids = {int(i) for i in stop_ids if i is not None}
    pick = _token_picker(config, seed)
    layers = len(DynamicCache(config=model.config).layers)
    answers: list[list[int]] = [[] for _ in prompts]
    with torch.inference_mode():
        for group in decoding_groups([len(p) for p in prompts], step_positions(model)):
            rows = _decode_group(
                _Forward(model, layers, device),
                [prompts[i] for i in group],
                pad_id,
                int(config.max_new_tokens),
                stop_ids,
                pick,
            )
            for i, row in zip(group, rows, strict=True):
                answers[i] = row
    return answers


def _token_picker(config: Any, seed: int | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Next tokens from float32 logits `[rows, vocabulary]`: the argmax, or a draw after `generate`'s
    warpers (temperature, then top-k, then top-p) from one generator seeded here."""
    if not config.do_sample:
        return lambda logits: logits.argmax(dim=-1)
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p))
    generators: list[torch.Generator] = []  # made at the first draw, on the device of the logits

    def draw(logits: torch.Tensor) -> torch.Tensor:
        if seed is not None and not generators:
            generators.append(torch.Generator(device=logits.device).manual_seed(seed))
        probabilities = torch.softmax(warpers(None, logits), dim=-1)
        generator = generators[0] if generators else None
        return torch.multinomial(probabilities, num_samples=1, generator=generator).squeeze(1)

    return draw


class _Forward:
    """The model's forward on a group's cache, returning the last position's logits in float32."""

    def __init__(self, model: Any, layers: int, device: Any) -> None:
        self.model, self.layers, self.device = model, layers, torch.device(device)
        parameters = inspect.signature(model.forward).parameters
        # transformers 5.25 renamed `past_key_values` to `cache` (the old name warns until 5.40).
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    def __call__(
        self, cache: Cache, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        output = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_argument: cache},
        )
        # On the first device: a target whose layers span several devices ends on its last one.
        return output.logits[:, -1].to(device=self.device, dtype=torch.float32)


def _decode_group(
    forward: _Forward,
    prompts: list[list[int]],
    pad_id: int,
    new_tokens: int,
    stop_ids: set[int],
    pick: Callable[[torch.Tensor], torch.Tensor],
) -> list[list[int]]:
    """One group's answers (its prompts longest first): prefill in sub-batches, then one decoding step
    after another over the rows still going."""
    device, width, rows = forward.device, len(prompts[0]), len(prompts)
    cache = InPlaceCache(forward.layers, rows, width + new_tokens)
    # Left padding: every row's answer starts at column `width`, so a step writes one column for all rows.
    mask = torch.zeros((rows, width + new_tokens), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        mask[row, width - len(prompt) :] = 1
    mask = mask.to(device)
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    for batch in plan_batches([len(p) for p in prompts], PREFILL_TOKENS, None, PREFILL_PADDING):
        # The prompts come longest first, so each sub-batch is a run of rows of the group's cache.
        first, last = batch[0], batch[-1] + 1
        assert batch == list(range(first, last)), batch
        columns = len(prompts[first])
        ids = torch.full((last - first, columns), pad_id, dtype=torch.long)
        for row, prompt in enumerate(prompts[first:last]):
            ids[row, columns - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        batch_mask = mask[first:last, width - columns : width]
        # `generate`'s positions under left padding: counted from each row's first prompt token.
        positions = (batch_mask.cumsum(-1) - 1).clamp(min=0)
        cache.write_at(slice(first, last), width - columns)
        tokens[first:last] = pick(forward(cache, ids.to(device), batch_mask, positions))
    cache.write_at(slice(0, rows), 0, width)

    answers: list[list[int]] = [[] for _ in prompts]
    going = list(range(rows))  # the group's rows still decoding, in the cache's order
    positions = torch.tensor([len(p) for p in prompts], device=device)
    for step in range(new_tokens):
        for row, token in zip(going, tokens.tolist(), strict=True):
            answers[row].append(token)
        keep = [k for k, row in enumerate(going) if answers[row][-1] not in stop_ids]
        if step + 1 == new_tokens or not keep:
            break
        if len(keep) < len(going):
            # Rows that stopped leave: a copy of the cache now is cheaper than decoding them to the end.
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, positions, tokens = mask[index], positions[index], tokens[index]
            going = [going[k] for k in keep]
        logits = forward(cache, tokens[:, None], mask[:, : width + step + 1], positions[:, None])
        positions += 1
        tokens = pick(logits)
    return answers
