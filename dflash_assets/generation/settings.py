"""How the target answers: sampling, length, chat-template arguments. Part of a range's fingerprint."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The longest answer when neither a setting nor the target's generation config says: a reasoning target
# thinks out loud for thousands of tokens (SpecForge's regenerated 27B data averages 4.5 K tokens, at most
# 8,192), and an answer cut short trains the drafter on a truncated ending.
DEFAULT_MAX_NEW_TOKENS = 8192


def target_max_new_tokens(model_dir: Path) -> int | None:
    """The answer length the target itself states: `max_new_tokens` in its `generation_config.json` (what
    `generate` and vLLM's `--generation-config auto` take by default), or None. The demo target states 64:
    its bigram answers repeat themselves long before a real model's would end."""
    try:
        value = json.loads((Path(model_dir) / "generation_config.json").read_text()).get("max_new_tokens")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


@dataclass(frozen=True)
class GenerationSettings:
    """Temperature 0 is greedy decoding: what speculative decoding at temperature 0 accepts against."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    # Passed to the chat template (and to servers as `chat_template_kwargs`), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0  # sampled decoding only
    # No turn is asked for once a conversation holds this many tokens (its prompt and answer so far):
    # training cuts every sample at DFLASH_MAX_LENGTH, so an answer starting past it is never trained on,
    # only paid for. None: every turn is answered.
    max_conversation_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(
                f"temperature must be >= 0, got {self.temperature} (DFLASH_GENERATE_TEMPERATURE)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be >= 1, got {self.max_new_tokens} (DFLASH_GENERATE_MAX_NEW_TOKENS)"
            )
        if self.max_conversation_tokens is not None and self.max_conversation_tokens < 1:
            raise ValueError(
                f"max_conversation_tokens must be >= 1 or None, got {self.max_conversation_tokens} "
                "(DFLASH_MAX_LENGTH)"
            )
        try:
            json.dumps(self.chat_template_kwargs)
        except TypeError as error:
            raise ValueError(f"chat_template_kwargs must be JSON: {error}") from None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def fingerprint(self) -> dict[str, Any]:
        """What decides the answers: two ranges with different values are never mixed. A greedy run's
        sampling knobs and seed decide nothing, so they are left out of it."""
        values = asdict(self)
        if self.max_conversation_tokens is None:  # ranges answered before it existed keep their fingerprint
            values.pop("max_conversation_tokens")
        if self.greedy:
            for name in ("top_p", "top_k", "seed"):
                values.pop(name)
        return values
