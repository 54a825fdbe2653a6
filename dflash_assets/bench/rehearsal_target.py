"""The rehearsal's target and data: a target of the configured one's real width, vocabulary and captured
layers (random weights, from its `config.json` alone), cut to the depth those layers need and, where this
host cannot run the real layers, narrowed inside; and conversations of the plan's mean length under its
chat template. `rehearse.py` runs the pipeline on them."""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Narrow insides for a host that cannot run the real layers: the width, vocabulary and depth stay.
NARROW_INTERMEDIATE = 1024
NARROW_HEADS = {"num_attention_heads": 2, "num_key_value_heads": 1}
NARROW_LINEAR_HEADS = {"linear_num_key_heads": 2, "linear_num_value_heads": 2}
NARROW_EXPERTS = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2}
ANSWER_TEXT = (
    "the node trains a drafter on hidden states captured from the target while the store keeps every "
    "object safe and each range commits once its manifest is written and the checkpoint resumes exactly "
    "where the run stopped across ranks nodes and days of work"
)
WORDS = tuple(ANSWER_TEXT.split(" "))


@dataclass
class RehearsalTarget:
    directory: Path
    config: dict[str, Any]
    layer_ids: list[int]
    notes: list[str] = field(default_factory=list)


def rehearsal_config(
    configured: dict[str, Any], layer_ids: list[int], narrow: bool
) -> tuple[dict[str, Any], list[str]]:
    """The text config of the rehearsal's target: the configured one cut to the layers `layer_ids` need,
    and with `narrow`, its insides narrowed (width, vocabulary, depth and head sizes kept). The notes say
    what was changed."""
    from dflash_assets.target.model import text_config

    config = json.loads(json.dumps(text_config(configured)))
    # One layer past the deepest captured: a captured layer may not be the last (its raw output is what
    # serving engines read as the next layer's input); the forward stops before that layer runs.
    real_depth = int(config["num_hidden_layers"])
    depth = min(real_depth, max(layer_ids) + 2)
    notes = []
    if depth < real_depth:
        notes.append(
            f"cut to {depth} of its {real_depth} decoder layers (the deepest captured is {max(layer_ids)})"
        )
    config["num_hidden_layers"] = depth
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:depth]
    if narrow:
        changed = []
        for key, value in list(config.items()):
            if key.endswith("intermediate_size") and isinstance(value, int) and value > NARROW_INTERMEDIATE:
                config[key] = NARROW_INTERMEDIATE
                changed.append(f"{key} {value:,} -> {NARROW_INTERMEDIATE:,}")
        for key, small in {**NARROW_HEADS, **NARROW_LINEAR_HEADS, **NARROW_EXPERTS}.items():
            value = config.get(key)
            if isinstance(value, int) and value > small:
                config[key] = small
                changed.append(f"{key} {value} -> {small}")
        if changed:
            notes.append("narrow insides for this host: " + ", ".join(changed))
    config.setdefault("tie_word_embeddings", False)
    return config, notes


def build_rehearsal_target(
    configured_dir: Path, layer_ids: list[int], narrow: bool, cache_dir: Path, log: Callable[[str], None]
) -> RehearsalTarget:
    """The rehearsal's target as a Hugging Face model directory (random bf16 weights, the configured
    target's tokenizer or else the demo's), built once per config under `cache_dir` and reused."""
    configured = json.loads((configured_dir / "config.json").read_text())
    config, notes = rehearsal_config(configured, layer_ids, narrow)
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    directory = cache_dir / "rehearsal" / f"target-{key}"
    tokenizer_dir = configured_dir if (configured_dir / "tokenizer_config.json").is_file() else None
    if tokenizer_dir is None:
        from dflash_assets.target.demo_model import ensure_demo_model

        tokenizer_dir = ensure_demo_model(cache_dir)
        notes.append("the demo tokenizer (the configured directory has none): ids below the real vocabulary")
    if not (directory / ".complete").is_file():
        log(f"building the rehearsal target in {directory} (random weights, once) ...")
        shutil.rmtree(directory, ignore_errors=True)
        partial = directory.with_name(directory.name + f".partial-{uuid.uuid4().hex[:6]}")
        _write_random_target(config, partial)
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
        ):
            if (tokenizer_dir / name).is_file():
                shutil.copy2(tokenizer_dir / name, partial / name)
        (partial / ".complete").write_text(json.dumps(config, indent=1))
        partial.rename(directory)
    _tokenizer_takes_the_context(directory, config.get("max_position_embeddings"))
    return RehearsalTarget(directory, config, layer_ids, notes)


def _tokenizer_takes_the_context(directory: Path, context: int | None) -> None:
    """A borrowed tokenizer (the demo's: 4,096) says the target's context as its `model_max_length`, so
    that tokenizing an 8 K rehearsal sample warns of no limit the rehearsal's target does not have."""
    path = directory / "tokenizer_config.json"
    if not context or not path.is_file():
        return
    values = json.loads(path.read_text())
    if int(values.get("model_max_length") or 0) < int(context):
        values["model_max_length"] = int(context)
        path.write_text(json.dumps(values, indent=2) + "\n")


def _write_random_target(config: dict[str, Any], directory: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {
        k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")
    }
    hf_config = AutoConfig.for_model(config["model_type"], **values)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="2GB")
    del model


def rehearsal_conversations(tokenizer: Any, samples: int, mean_tokens: int) -> list[dict[str, Any]]:
    """`samples` conversations of about `mean_tokens` tokens each under the target's chat template (one
    question, one long answer), deterministic."""

    def conversation(index: int, answer_words: int) -> dict[str, Any]:
        question = f"Question {index}: " + " ".join(WORDS[(index + i) % len(WORDS)] for i in range(24)) + "?"
        answer = " ".join(WORDS[(index * 7 + i) % len(WORDS)] for i in range(answer_words)) + "."
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}

    def length(row: dict[str, Any]) -> int:
        return len(tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False))

    rows = []
    for index in range(samples):
        words = mean_tokens // 2  # from below: a first guess past the tokenizer's maximum would warn
        for _ in range(4):  # tokens per word depends on the tokenizer: two or three guesses settle it
            row = conversation(index, words)
            words = max(1, round(words * mean_tokens / max(1, length(row))))
        rows.append(conversation(index, words))
    return rows


CPU_FLOPS_A_SAMPLE = 2e12  # about a minute of a CPU's forward: more, and the layers are narrowed


def real_layers_fit(configured_dir: Path, layer_ids: list[int], mean_tokens: int) -> tuple[bool, str]:
    """Whether this host's device holds the target's real layers (cut to the captured depth) with room
    to spare, and (on a CPU) runs a sample through them in about a minute; and the figures that say so."""
    import torch

    from dflash_assets.target.memory import host_total_bytes

    config, _ = rehearsal_config(json.loads((configured_dir / "config.json").read_text()), layer_ids, False)
    parameters = _parameter_count(config)
    if torch.cuda.is_available():
        memory = torch.cuda.get_device_properties(0).total_memory
        fits = parameters * 2 * 1.3 < memory
        where = f"{torch.cuda.get_device_name(0)}'s {memory / 2**30:.0f} GiB"
    else:
        memory = host_total_bytes()
        fits = parameters * 4 * 1.3 < memory and 2 * parameters * mean_tokens < CPU_FLOPS_A_SAMPLE
        where = f"this host's CPU and {memory / 2**30:.0f} GiB"
    return fits, f"{parameters / 1e9:.2f} B parameters in the real layers; {where}"


def _parameter_count(config: dict[str, Any]) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {
        k: v for k, v in config.items() if k not in ("model_type", "architectures", "transformers_version")
    }
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **values))
    return sum(p.numel() for p in model.parameters())
