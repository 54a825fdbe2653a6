"""The tokenized sample: what `tokenized_completions` produces and every later stage consumes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class TokenizedSample:
    """One conversation after the chat template: token ids and a 0/1 mask of assistant tokens.

    `sample_index` is the row's 0-based position in the source dataset, so dropped rows leave gaps.
    """

    sample_index: int
    input_ids: list[int]
    loss_mask: list[int]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(
                f"sample {self.sample_index}: {len(self.input_ids)} input ids but "
                f"{len(self.loss_mask)} loss-mask entries"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def samples_digest(samples: Iterable[TokenizedSample]) -> str:
    """A digest of the samples' content (index, token ids, loss mask), whatever file they were read from:
    what a later stage's work was made from."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(f"{sample.sample_index}:{sample.input_ids}:{sample.loss_mask}\n".encode())
    return digest.hexdigest()
