"""The target answering in this process, on a leased device: length-bucketed batches under a token budget,
decoded over the target's own forward with a KV cache written in place (`decoding.py`; Hugging Face
`generate` for a target that loop cannot serve), greedy or sampled.

Prompts are the target's chat template applied to the history with a generation prompt, exactly as
`transformers serve`, vLLM and SGLang build them, and left-padded so every row's new tokens start
together. An answer ends at the first end-of-turn token the target emits (kept, with its id) or at
`max_new_tokens` (`finish_reason: length`). The text is decoded without special tokens and parsed as the
servers parse it (see `split_reasoning`); a row with tools has its prompt rendered with them and its
answers' tool calls read as `transformers serve` reads them (`tool_calls.py`). Prompt plus answer stay
within the target's positions (`max_position_embeddings`): a turn near the end of the context asks for
fewer new tokens, alone in its batch, and a prompt that fills it drops its row (`exceeds_context`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dflash_assets.generation.conversation import Answer
from dflash_assets.generation.decoding import decode_rows, decodes_in_place
from dflash_assets.generation.engine import (
    Engine,
    EngineStats,
    TurnRequest,
    TurnScheduler,
    new_token_limit,
    no_room,
    past_max_length,
)
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.generation.tool_calls import parse_answer, response_template
from dflash_assets.target.batching import plan_batches
from dflash_assets.target.devices import release_cached_memory
from dflash_assets.target.threads import decoding_threads


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """What ends the target's turn: its generation config's `eos_token_id` (one id or a list), else the
    tokenizer's end-of-sequence token."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list | tuple) else [eos]
    return {int(i) for i in ids if i is not None}


def split_reasoning(text: str) -> tuple[str, str | None]:
    """`<think>…</think>answer` (Qwen3-style templates) -> (answer, reasoning), each stripped of the
    whitespace around it, as the servers' response parsers return them (`transformers serve`, vLLM's
    reasoning parsers): the history of the next turn is then the same whichever engine answered. The
    exact ids keep every token the target wrote."""
    if "</think>" not in text:
        return text.strip(), None
    reasoning, _, answer = text.partition("</think>")
    return answer.strip(), reasoning.replace("<think>", "", 1).strip()


def prompt_token_ids(
    tokenizer: Any, messages: Sequence[dict], settings: GenerationSettings, tools: list[dict] | None = None
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        list(messages),
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **settings.chat_template_kwargs,
    )
    return [int(i) for i in (ids["input_ids"] if isinstance(ids, dict) else ids)]


class InProcessEngine(Engine):
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        settings: GenerationSettings,
        *,
        device: str,
        max_tokens_per_batch: int = 65536,
        max_batch_size: int = 64,
        context_tokens: int | None = None,
    ) -> None:
        from dflash_assets.target.model import context_length_of

        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        # Positions the target reads (default: its config's `max_position_embeddings`).
        self.context_tokens = context_tokens or context_length_of(model.config)
        self.device = next(model.parameters()).device
        self.name = "in-process"
        self.description = f"the target in this process on {device}"
        self.max_tokens_per_batch, self.max_batch_size = max_tokens_per_batch, max_batch_size
        self.stats = EngineStats()
        self.stop_ids = stop_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.stop_ids))
        self.generation_config = self._generation_config()

    def _generation_config(self) -> Any:
        """The target's own generation config (what `generate` and the servers start from: a
        `repetition_penalty` there applies to every engine alike), with the sampling chosen here."""
        import copy

        from transformers import GenerationConfig

        base = getattr(self.model, "generation_config", None)
        config = copy.deepcopy(base) if base is not None else GenerationConfig()
        config.max_new_tokens = self.settings.max_new_tokens
        config.max_length = None
        config.eos_token_id = sorted(self.stop_ids)
        config.pad_token_id = self.pad_id
        config.do_sample = not self.settings.greedy
        if self.settings.greedy:
            config.temperature = config.top_p = config.top_k = None  # greedy: none of them applies
        else:
            config.temperature, config.top_p = self.settings.temperature, self.settings.top_p
            config.top_k = self.settings.top_k or None
        return config

    counts_tokens_live = True  # every forward of the target is seen (`_count_forward`)

    def run(self, scheduler: TurnScheduler, tick: Callable[[], None]) -> None:
        # A batch of long prompts answers all at once, minutes later on a CPU: every forward of the target
        # counts the tokens it makes (one a row) and ticks, so the range's progress says how far it is.
        hook = self.model.register_forward_pre_hook(self._count_forward(tick), with_kwargs=True)
        try:
            self._run(scheduler, tick)
        finally:
            hook.remove()
            self.stats.tokens_in_flight = 0

    def _count_forward(self, tick: Callable[[], None]) -> Callable[..., None]:
        def count(module: Any, args: tuple, kwargs: dict) -> None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None and hasattr(ids, "shape"):
                self.stats.tokens_in_flight += int(ids.shape[0])
            tick()

        return count

    def _run(self, scheduler: TurnScheduler, tick: Callable[[], None]) -> None:
        max_new = self.settings.max_new_tokens
        # A batch's worth at a time, so the next turns of conversations under way join the next batch
        # (the scheduler hands them out first) instead of waiting behind every first turn of the range.
        while taken := scheduler.take(limit=self.max_batch_size):
            requests, prompts = [], []
            for request in taken:
                prompt = prompt_token_ids(self.tokenizer, request.messages, self.settings, request.tools)
                bound = self.settings.max_conversation_tokens
                if (dropped := past_max_length(request.turn, len(prompt), bound)) is not None:
                    scheduler.drop(request, dropped)
                    continue
                requests.append(request)
                prompts.append(prompt)
            if not requests:
                continue
            limits = [new_token_limit(len(p), max_new, self.context_tokens) for p in prompts]
            whole = [i for i, limit in enumerate(limits) if limit == max_new]
            budget = [len(prompts[i]) + max_new for i in whole]
            token_budget = max(self.max_tokens_per_batch, max(budget, default=0))
            # No padding bound (extraction's 5 % would cut 64 ready turns into batches of 5 to 26): a
            # batch runs its `max_new_tokens` decoding steps whatever its width, so two half batches cost
            # twice the steps, while padding costs only prompt positions. The token budget bounds memory.
            batches = [
                ([whole[j] for j in batch], max_new)
                for batch in plan_batches(
                    budget, token_budget, self.max_batch_size, max_padding_fraction=None
                )
            ]
            # A turn the context cuts short runs alone: its batch-mates would get its shorter answers.
            batches += [([i], limit) for i, limit in enumerate(limits) if 0 < limit < max_new]
            for i, limit in enumerate(limits):
                if limit < 1:
                    scheduler.drop(requests[i], no_room(len(prompts[i]), self.context_tokens))
            for batch, new_tokens in batches:
                self.stats.in_flight = len(batch)
                answers = self._generate(
                    [prompts[i] for i in batch], [requests[i] for i in batch], new_tokens
                )
                self.stats.requests += len(batch)
                self.stats.in_flight = self.stats.tokens_in_flight = 0  # answered: counted as finished
                for i, answer in zip(batch, answers, strict=True):
                    scheduler.answer(requests[i], answer)
                tick()

    def _generate(
        self, prompts: list[list[int]], requests: list[TurnRequest], new_tokens: int
    ) -> list[Answer]:
        """One batch, halved on running out of device memory (a single prompt that cannot fit fails)."""
        answers = self._generate_or_none(prompts, requests, new_tokens)
        if answers is not None:
            return answers
        # Out of memory: the halves run here, after the `except` block has ended and taken the failed
        # `generate`'s traceback (its frames and their tensors, the KV cache among them) with it.
        if len(prompts) == 1:
            raise torch.cuda.OutOfMemoryError(
                f"sample {requests[0].sample_index}: a prompt of {len(prompts[0])} tokens plus "
                f"{new_tokens} new ones does not fit on {self.device}; lower "
                "DFLASH_GENERATE_MAX_NEW_TOKENS or the dataset's prompt lengths"
            )
        release_cached_memory()
        half = len(prompts) // 2
        return self._generate(prompts[:half], requests[:half], new_tokens) + self._generate(
            prompts[half:], requests[half:], new_tokens
        )

    def _generate_or_none(
        self, prompts: list[list[int]], requests: list[TurnRequest], new_tokens: int
    ) -> list[Answer] | None:
        """The batch's answers, or None when it ran out of device memory (retried by the caller)."""
        try:
            return self._generate_batch(prompts, requests, new_tokens)
        except torch.cuda.OutOfMemoryError:
            return None

    def _generate_batch(
        self, prompts: list[list[int]], requests: list[TurnRequest], new_tokens: int | None = None
    ) -> list[Answer]:
        # Sampled answers are reproducible for the same batches: the seed covers which turns they are.
        seed = None if self.settings.greedy else sampling_seed(self.settings.seed, requests)
        config = self.generation_config
        if new_tokens is not None and new_tokens != config.max_new_tokens:
            import copy

            config = copy.deepcopy(config)
            config.max_new_tokens = new_tokens
        rows = self._generate_rows(prompts, config, seed)
        return [
            self._answer(prompt, generated, request.tools)
            for prompt, generated, request in zip(prompts, rows, requests, strict=True)
        ]

    def _generate_rows(self, prompts: list[list[int]], config: Any, seed: int | None) -> list[list[int]]:
        """Each prompt's new tokens, up to the config's `max_new_tokens`, cut after a stop token."""
        return generate_rows(self.model, prompts, self.pad_id, config, seed, self.device)

    def _answer(self, prompt: list[int], generated: list[int], tools: list[dict] | None = None) -> Answer:
        end = next((i for i, token in enumerate(generated) if token in self.stop_ids), None)
        completion = generated[: end + 1] if end is not None else generated
        parsed = None
        if tools:  # read only for rows with tools (looking the template up imports transformers serve)
            if not hasattr(self, "response_template"):
                config = getattr(self.model, "config", None)
                self.response_template = response_template(self.tokenizer, config)
            parsed = parse_answer(self.tokenizer, self.response_template, completion, prompt, tools)
        if parsed is not None:
            content, reasoning, tool_calls = parsed
        else:
            text = self.tokenizer.decode(completion, skip_special_tokens=True)
            (content, reasoning), tool_calls = split_reasoning(text), None
        return Answer(
            content=content,
            reasoning=reasoning,
            tool_calls=tool_calls or None,
            finish_reason="stop" if end is not None else "length",
            completion_token_ids=completion,
            prompt_token_ids=list(prompt),
            prompt_tokens=len(prompt),
            completion_tokens=len(completion),
        )


def sampling_seed(seed: int, requests: Sequence[TurnRequest]) -> int:
    """The seed of one sampled batch: the run's seed and which turns the batch holds."""
    key = f"{seed}:" + ",".join(f"{r.sample_index}.{r.turn}" for r in requests)
    return int(hashlib.sha256(key.encode()).hexdigest()[:15], 16)


# New tokens of the first decoding round of a batch; each later round decodes twice as many
# (`generate_in_rounds`).
FIRST_ROUND_TOKENS = 64


def generate_rows(
    model: Any, prompts: list[list[int]], pad_id: int, config: Any, seed: int | None, device: Any
) -> list[list[int]]:
    """Each prompt's new tokens, up to the config's `max_new_tokens`, cut after the first of its
    `eos_token_id`s (a row that never stops has `max_new_tokens`). Every rank of a split target runs it
    alike.

    A target whose layers are all plain attention decodes in `decoding.decode_rows` (length-grouped rows on
    a KV cache written in place: SmolLM2 on 2 cores, 53 tokens/s where `generate` made 22); any other (the
    demo target's linear-attention layers, a sliding window, a generation config asking for a repetition
    penalty...) decodes with `generate`, in rounds (`generate_in_rounds`)."""
    if decodes_in_place(model, config):
        with decoding_threads(model):
            return decode_rows(model, prompts, pad_id, config, seed, device)
    return generate_in_rounds(model, prompts, pad_id, config, seed, device)


def generate_in_rounds(
    model: Any, prompts: list[list[int]], pad_id: int, config: Any, seed: int | None, device: Any
) -> list[list[int]]:
    """`generate_rows` with `generate`.

    `generate` decodes every row of a batch until its last row stops, at the batch's full width: one
    answer that loops to `max_new_tokens` made 47 others wait for it (SmolLM2 on 2 cores: 19 useful
    tokens/s in a batch of 48 where seven answers ran to 768 tokens and the rest ended by 330). So rows
    leave once they stop: decoding runs in rounds of 64, 128, 256, ... new tokens, and after each round the
    rows that have not stopped continue alone, from their prompt and answer so far (one prefill each,
    left-padded again). Greedy answers are the same as one `generate` call's up to float rounding between
    a prefill and cached decoding; sampled ones are reproducible for the same batch (each round is seeded)."""
    import copy

    stop_ids = config.eos_token_id if isinstance(config.eos_token_id, list | tuple) else [config.eos_token_id]
    stop_ids = {int(i) for i in stop_ids if i is not None}
    answers: list[list[int]] = [[] for _ in prompts]
    running = list(range(len(prompts)))
    budget, round_tokens, round_index = int(config.max_new_tokens), FIRST_ROUND_TOKENS, 0
    while running and budget > 0:
        this_round = min(round_tokens, budget)
        round_config = copy.deepcopy(config)
        round_config.max_new_tokens = this_round
        inputs = [prompts[i] + answers[i] for i in running]
        rows = _generate_once(
            model, inputs, pad_id, round_config, None if seed is None else seed + round_index, device
        )
        still = []
        for i, row in zip(running, rows, strict=True):
            end = next((k for k, token in enumerate(row) if token in stop_ids), None)
            answers[i] += row[: end + 1] if end is not None else row[:this_round]
            if end is None and len(row) >= this_round:
                still.append(i)
        running, budget = still, budget - this_round
        round_tokens, round_index = round_tokens * 2, round_index + 1
    return answers


def _generate_once(
    model: Any, prompts: list[list[int]], pad_id: int, config: Any, seed: int | None, device: Any
) -> list[list[int]]:
    """`model.generate` over the prompts left-padded into one batch (so every row's new tokens start
    together): each row's tokens after the prompts."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    if seed is not None:
        torch.manual_seed(seed)
    with torch.inference_mode(), decoding_threads(model):
        output = model.generate(
            input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), generation_config=config
        )
    return [output[row, width:].tolist() for row in range(len(prompts))]


class SplitTargetEngine(InProcessEngine):
    """The target split over several devices (`DFLASH_TARGET_TP`), answering through its ranks
    (`generation/rank.py`): batches are planned, and answers parsed, here exactly as in-process; each
    batch's `generate` runs on every rank, and `generate_remote(request)` carries it there and back."""

    def __init__(
        self,
        generate_remote: Callable[[dict[str, Any]], list[list[int]]],
        model_dir: Any,
        tokenizer: Any,
        settings: GenerationSettings,
        *,
        devices: str,
        max_tokens_per_batch: int = 65536,
        max_batch_size: int = 64,
    ) -> None:
        super().__init__(
            TargetConfigs.read(model_dir),
            tokenizer,
            settings,
            device=devices,
            max_tokens_per_batch=max_tokens_per_batch,
            max_batch_size=max_batch_size,
        )
        self.description = f"the target split over {devices}"
        self._generate_remote = generate_remote

    counts_tokens_live = False  # its forwards run on the ranks, unseen here

    def run(self, scheduler: TurnScheduler, tick: Callable[[], None]) -> None:
        self._run(scheduler, tick)

    def _generate_rows(self, prompts: list[list[int]], config: Any, seed: int | None) -> list[list[int]]:
        request = {"prompts": prompts, "pad_id": self.pad_id, "config": config.to_dict(), "seed": seed}
        return self._generate_remote(request)


class TargetConfigs:
    """What the engine reads of a model it does not hold: its config and generation config, as
    `from_pretrained` would give them."""

    def __init__(self, config: Any, generation_config: Any) -> None:
        self.config, self.generation_config = config, generation_config

    @classmethod
    def read(cls, model_dir: Any) -> TargetConfigs:
        from transformers import AutoConfig, GenerationConfig

        config = AutoConfig.from_pretrained(model_dir)
        try:
            generation = GenerationConfig.from_pretrained(model_dir)
        except OSError:  # no generation_config.json: what from_pretrained derives from the config
            generation = GenerationConfig.from_model_config(config)
        return cls(config, generation)

    def parameters(self):
        return iter([torch.empty(0)])  # the engine's own tensors stay on the host
