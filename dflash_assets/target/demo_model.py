"""The embedded default target model: a tiny, deterministic Qwen3.5-family causal LM with its own tokenizer.

It is a normal Hugging Face model directory (loaded with `AutoModelForCausalLM.from_pretrained`, like a
real target), of the real architecture — gated-delta-net ("linear_attention") layers mixed with full
attention — only small: no network, no GPU and no credentials are needed to run the whole pipeline.
The tokenizer is a byte-level BPE trained offline on the bundled conversations, with a ChatML chat
template and a `<|mask|>` token for the drafter. Its embedding and LM head are fitted as a bigram
model of the same conversations, so greedy predictions look like the data; the decoder layers stay
random (seeded) but each one visibly changes the hidden state.

    python -m dflash_assets.target.demo_model [DIR]    # build into DIR, or into the shared cache
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dflash_assets.conversations.datasets import Dropped, bundled_dataset_path, iter_rows

# Bump when anything below changes what gets built: cached copies are keyed by it.
DEMO_MODEL_VERSION = "3"  # 2: no transitions between turns; 3: max_new_tokens in its generation config
DEMO_MODEL_NAME = "dflash-assets/demo-target"

IM_START, IM_END, END_OF_TEXT, MASK = "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|mask|>"
SPECIAL_TOKENS = [END_OF_TEXT, IM_START, IM_END, MASK]
VOCAB_SIZE = 1536

# Qwen-style ChatML. Content must be a string; a generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

NUM_LAYERS = 12
# The real family's rhythm: three gated-delta-net layers, then one full-attention layer.
LAYER_TYPES = [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(NUM_LAYERS)]
MODEL_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": NUM_LAYERS,
    "layer_types": LAYER_TYPES,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    # Small linear-attention heads: the defaults (16 x 128) make a CPU forward ~40x slower.
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}

# The target's own answer length (its generation config's `max_new_tokens`, which regeneration uses when
# DFLASH_GENERATE_MAX_NEW_TOKENS is unset): a bigram model's greedy answers repeat themselves long before
# a real model's would end, and 64 tokens regenerate the bundled 500 conversations in under a minute.
# The demo, a shell and the UI all read it here, so each continues the others' ranges.
MAX_NEW_TOKENS = 64

BIGRAM_STEPS = 60
BIGRAM_LR = 0.05
LAYER_WEIGHT_SCALE = 3.0


def build_demo_model(directory: Path, seed: int = 0) -> Path:
    """Build the demo target into `directory` (created; must be empty if it exists) and return it.

    The same seed gives byte-identical files on the same machine and library versions.
    """
    import torch

    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} is not empty: build the demo model into a new directory")
    directory.mkdir(parents=True, exist_ok=True)
    conversations = _bundled_conversations()
    tokenizer = build_demo_tokenizer(conversations)
    # Single-threaded: reduction order, and so every bit of the fitted weights, then does not depend
    # on how many cores the machine has. fork_rng leaves the caller's random state untouched.
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        try:
            model = _new_model(tokenizer)
            _fit_bigram_head(model, tokenizer, conversations, seed=seed)
        finally:
            torch.set_num_threads(threads)
    model.config.dflash_demo = {"version": DEMO_MODEL_VERSION, "seed": seed}
    model.generation_config.max_new_tokens = MAX_NEW_TOKENS
    with _quiet_progress_bars():
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    _write_readme(directory, seed)
    return directory


def demo_model_dir_name() -> str:
    """Cache directory name: the recipe version plus a hash of the data it was trained on."""
    data_hash = hashlib.sha256(bundled_dataset_path().read_bytes()).hexdigest()[:10]
    return f"demo-target-{DEMO_MODEL_VERSION}-{data_hash}"


def ensure_demo_model(cache_dir: Path) -> Path:
    """The demo target's directory in the cache, built on first use (`ensure_built`)."""
    return ensure_built(Path(cache_dir), demo_model_dir_name(), build_demo_model)


def ensure_built(root: Path, name: str, build: Callable[[Path], Any]) -> Path:
    """`root / name`, a model directory `build(directory)` writes, built on first use.

    Concurrent callers (several Dagster runs starting at once) serialise on a lock file; the build
    goes to a temporary directory renamed into place, so a killed build never leaves a half model.
    """
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    if (target / "config.json").is_file():
        return target
    with _exclusive_lock(root / f"{name}.lock"):
        if (target / "config.json").is_file():
            return target
        # Holding the lock means no build is running: leftovers are from builds that were killed.
        for stale in root.glob(f".{name}.building-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():  # no config.json: not something this function wrote; never load it
            shutil.rmtree(target)
        building = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=root))
        try:
            build(building)
            building.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            os.rename(building, target)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
    return target


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    # A progress bar for one tiny file is only noise in run logs.
    from transformers.utils import logging as transformers_logging

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            transformers_logging.enable_progress_bar()


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the OS if the process dies
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _bundled_conversations() -> list[list[dict[str, Any]]]:
    return [row.messages for _, row in iter_rows(bundled_dataset_path()) if not isinstance(row, Dropped)]


def build_demo_tokenizer(conversations: list[list[dict[str, Any]]]) -> Any:
    """A byte-level BPE trained on the conversations' text, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Train on message text only (roles included), never on rendered templates, so no merge ever
    # swallows part of a special token.
    texts = [f"{m['role']}\n{m['content']}" for messages in conversations for m in messages]
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        mask_token=MASK,
        additional_special_tokens=[IM_START],
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _new_model(tokenizer: Any) -> Any:
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(END_OF_TEXT),
        bos_token_id=None,
        **MODEL_SHAPE,
    )
    config._name_or_path = DEMO_MODEL_NAME
    return AutoModelForCausalLM.from_config(config)


def _fit_bigram_head(
    model: Any, tokenizer: Any, conversations: list[list[dict[str, Any]]], *, seed: int
) -> None:
    """Fit the embedding and LM head as a bigram model of the rendered conversations.

    Training the whole model for a few hundred steps takes minutes on a CPU; a bigram fit, full batch
    over the count matrix, takes about a second and already makes greedy predictions plausible text.
    """
    import torch

    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    sequences = [tokenizer.apply_chat_template(m, tokenize=True, return_dict=False) for m in conversations]
    previous = torch.cat([torch.tensor(s[:-1], dtype=torch.long) for s in sequences])
    following = torch.cat([torch.tensor(s[1:], dtype=torch.long) for s in sequences])
    # A chat model ends its turn with <|im_end|> and never writes the next turn's header itself: drop
    # the transitions between turns, or greedy decoding after a generation prompt would loop through
    # `<|im_start|>assistant` headers instead of writing an answer a drafter could learn to predict.
    within_turn = following != tokenizer.convert_tokens_to_ids(IM_START)
    previous, following = previous[within_turn], following[within_turn]
    counts = torch.bincount(previous * vocab + following, minlength=vocab * vocab).view(vocab, vocab).float()
    seen = (counts.sum(1) > 0).nonzero().squeeze(1)
    counts = counts[seen]
    generator = torch.Generator().manual_seed(seed)
    embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=generator) * 0.5)
    head = torch.nn.Parameter(torch.randn(vocab, hidden, generator=generator) * 0.02)
    optimizer = torch.optim.Adam([embed, head], lr=BIGRAM_LR)
    for _ in range(BIGRAM_STEPS):
        # The model's final RMSNorm sits between the residual stream and the head; fit through it.
        logits = _rms_normalise(embed[seen]) @ head.T
        loss = -(counts * torch.log_softmax(logits, dim=-1)).sum() / counts.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(_rms_normalise(embed))
        model.get_output_embeddings().weight.copy_(head)
        # At their init scale the decoder layers barely touch the residual stream, so every layer's
        # hidden state would equal the embedding. Scaled up, each layer visibly mixes in context while
        # the bigram predictions survive.
        for name, parameter in model.named_parameters():
            if ".layers." in name and name.endswith("proj.weight"):
                parameter.mul_(LAYER_WEIGHT_SCALE)


def _rms_normalise(x: Any) -> Any:
    return x * (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()


def _write_readme(directory: Path, seed: int) -> None:
    shape = json.dumps({k: v for k, v in MODEL_SHAPE.items() if k != "layer_types"})
    (directory / "README.md").write_text(
        f"# {DEMO_MODEL_NAME} (demo, version {DEMO_MODEL_VERSION})\n\n"
        "A tiny deterministic Qwen3.5-family (`qwen3_5_text`) causal LM built by "
        "`python -m dflash_assets.target.demo_model`, for running dflash-assets without a real target.\n"
        "Not a useful language model.\n\n"
        f"- seed {seed}; embedding and LM head fitted as a bigram model of the bundled sample "
        "conversations, decoder layers random\n"
        f"- layer types: {', '.join(LAYER_TYPES)}\n"
        f"- shape: {shape}\n"
        f"- tokenizer: byte-level BPE, ChatML chat template, mask token {MASK}\n",
        encoding="utf-8",
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if args:
        path = build_demo_model(Path(args[0]))
    else:
        from dflash_assets import settings  # a script's entry point: the cache the runs use

        path = ensure_demo_model(settings.cache_dir())
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
