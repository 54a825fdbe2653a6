"""One range extracted into a store with its own uploader and staging: the extraction tests' harness."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.extract import ExtractionResult, extract_range
from dflash_assets.extraction.sample_format import parse_sample_object_name
from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.layer_ids import dflash_target_layer_ids
from dflash_assets_tests.support.targets import TINY_LAYERS, TINY_VOCAB

PREFIX = "hidden-states/00000100-00000199"
MODEL_NAME = "tiny-qwen3_5"
DEFAULT_LAYERS = dflash_target_layer_ids(TINY_LAYERS)  # [1, 2, 4, 6, 7]


def make_samples(n: int = 12, seed: int = 0) -> list[TokenizedSample]:
    """Rows 100.. with row 105 dropped upstream (indices keep their gap), lengths 3..90."""
    generator = torch.Generator().manual_seed(seed)
    indices = [i for i in range(100, 101 + n) if i != 105][:n]
    samples = []
    for index in indices:
        length = int(torch.randint(3, 91, (1,), generator=generator))
        input_ids = torch.randint(1, TINY_VOCAB, (length,), generator=generator).tolist()
        loss_mask = [0] * (length // 3) + [1] * (length - length // 3)
        samples.append(TokenizedSample(index, input_ids, loss_mask))
    return samples


class Extraction:
    """One `extract_range` call with its own uploader, log lines and staging directory."""

    def __init__(self, store: ObjectStore, staging_dir: Path, **uploader_options):
        self.store = store
        self.staging_dir = staging_dir
        self.uploader_options = {"staging_budget_bytes": 64 * 2**20, "backoff_s": 0.01, **uploader_options}
        self.logs: list[str] = []
        self.uploader: Uploader | None = None

    def run(self, model, samples, layer_ids=DEFAULT_LAYERS, **options) -> ExtractionResult:
        options = {"max_tokens_per_batch": 256, "progress_every_s": 0.0, **options}
        with Uploader(self.store, **self.uploader_options) as uploader:
            self.uploader = uploader
            return extract_range(
                model=model,
                target_model_name=MODEL_NAME,
                samples=samples,
                target_layer_ids=list(layer_ids),
                store=self.store,
                prefix=PREFIX,
                staging_dir=self.staging_dir,
                uploader=uploader,
                device="cpu:0",
                log=self.logs.append,
                **options,
            )

    def staged_files(self) -> list[str]:
        if not self.staging_dir.exists():
            return []
        return sorted(p.name for p in self.staging_dir.iterdir() if not p.name.startswith((".ex", "_")))


def stored_objects(store: ObjectStore) -> dict[str, bytes]:
    return {
        info.key.rsplit("/", 1)[1]: store.get_bytes(info.key)
        for info in store.list(PREFIX + "/")
        if parse_sample_object_name(info.key.rsplit("/", 1)[1]) is not None
    }
