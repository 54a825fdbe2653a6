"""What an evaluation loads: one prompt set's prompts (held-out rows from the store, or a dataset rendered by
the target's chat template) and, on one device, the target and the run's export."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dflash_assets.evaluation.prompt_sets import (
    HELD_OUT,
    PromptSet,
    PromptSetError,
    dataset_prompt_set,
    held_out_prompt_set,
    parse_eval_sets,
)

# A prompt with no room for this many new tokens in the target's context is skipped (the context is the
# target's `max_position_embeddings`; a target that states none is given this many prompt tokens at most).
UNSTATED_CONTEXT = 32768


def max_prompt_tokens(target_dir: Path, new_tokens: int) -> int:
    """The longest prompt the target can answer with `new_tokens` more tokens in its context."""
    from transformers import AutoConfig

    from dflash_assets.target.model import context_length_of

    context = context_length_of(AutoConfig.from_pretrained(str(target_dir))) or UNSTATED_CONTEXT
    return max(1, context - new_tokens)


def load_prompt_set(
    name: str,
    eval_sets: str,
    *,
    object_store: Any,
    run_manifest: dict[str, Any],
    target_dir: Path,
    count: int,
    new_tokens: int,
    cache_dir: Path,
) -> PromptSet:
    """The prompts of the set `name` (`held_out`, or one `eval_sets` names), at most `count`. A set's rows
    are read in the layout each row has (`auto`): a set is its own dataset, whatever DFLASH_DATASET_FORMAT
    says of the training data's."""
    from dflash_assets.conversations.datasets import dataset_uri, iter_rows, resolve_dataset, row_location
    from dflash_assets.evaluation.runs import held_out_samples
    from dflash_assets.generation.in_process import prompt_token_ids
    from dflash_assets.generation.settings import GenerationSettings

    longest = max_prompt_tokens(target_dir, new_tokens)
    if name == HELD_OUT:
        samples = held_out_samples(object_store, run_manifest, cache_dir)
        rows = [(sample.sample_index, sample.input_ids, sample.loss_mask) for sample in samples]
        found = held_out_prompt_set(rows, count=count, max_prompt_tokens=longest)
        if not found.prompts:
            raise PromptSetError(
                f"{HELD_OUT}: run {run_manifest.get('run')!r} holds no held-out prompt "
                f"({len(samples)} held-out samples found in the tokenized ranges it trained on): train with "
                "eval_samples above 0"
            )
        return found
    specs = {spec.name: spec for spec in parse_eval_sets(eval_sets)}
    if name not in specs:
        raise PromptSetError(
            f"prompt set {name!r} is not named in DFLASH_EVAL_SETS ({', '.join(specs)}): add "
            "name=reference to it (the code location reads it when it loads)"
        )
    spec = specs[name]
    files = resolve_dataset(dataset_uri(spec.reference, cache_dir=None), cache_dir=cache_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    settings = GenerationSettings()
    found = dataset_prompt_set(
        spec,
        iter_rows(files, require_assistant=False, layout="auto"),
        lambda messages, tools: prompt_token_ids(tokenizer, messages, settings, tools),
        count=count,
        max_prompt_tokens=longest,
        location=lambda index: row_location(files, index),
    )
    if not found.prompts:
        raise PromptSetError(
            f"prompt set {name!r} ({spec.reference}) gave no prompt from {found.rows_read} rows"
            + (f": {found.describe_skipped()}; first: {found.skipped_details[0]}" if found.skipped else "")
        )
    return found


@contextlib.contextmanager
def loaded_for_evaluation(
    target_dir: Path, export_dir: Path, device: str
) -> Iterator[tuple[Any, Any, set[int]]]:
    """(the target as a `TargetVerifier`, the export as a drafter, the target's stop token ids) on `device`,
    released after: bf16 on a GPU (as engines serve them), float32 on a CPU."""
    from dflash_assets.drafter.export import load_drafter
    from dflash_assets.drafter.speculative import TargetVerifier, stop_token_ids_of
    from dflash_assets.target.model import load_target_model
    from dflash_assets.target.threads import decoding_threads

    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    drafter = load_drafter(export_dir, target_model=target_dir, device=device, dtype=dtype)
    model = load_target_model(target_dir, device)
    try:
        verifier = TargetVerifier(model, drafter.config.target_layer_ids)
        with decoding_threads(model):
            yield verifier, drafter, stop_token_ids_of(str(target_dir))
    finally:
        del model, drafter
        gc.collect()
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
