"""Training input, offline or online: both yield the same `DrafterBatch` for the same samples.

Offline, hidden states are streamed from the store through a bounded cache; online, the target
computes them for each micro-batch. Collation rounds and zeroes them the same way, so a batch gives the
same loss either way."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.objective import DrafterBatch
from dflash_assets.extraction.object_size import estimate_num_tokens
from dflash_assets.extraction.sample_format import HiddenStateSample, parse_sample_object_name
from dflash_assets.storage.store import ObjectStore
from dflash_assets.target.batching import pad_batch
from dflash_assets.target.devices import thread_on_device
from dflash_assets.training.sample_stream import SampleStream, partition_of
from dflash_assets.training.settings import TrainSettings

HiddenStatesFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class OfflineData:
    """Hidden-state objects in the store, e.g. `StoredPartition.object_keys()` of several partitions."""

    store: ObjectStore
    objects: Sequence[tuple[str, int]]  # (key, size in bytes)
    cache_dir: str | Path  # owned by training: files there that it will not read soon are deleted
    cache_budget_bytes: int = 16 * 2**30
    # Token count of each object (e.g. from the partition manifest), for length bucketing. Without it,
    # lengths are estimated from object sizes: close enough to bucket, never used for correctness.
    num_tokens: Sequence[int] | None = None
    # Stored dtype of each object (`bf16`/`fp8`, from its partition's manifest), for those estimates.
    hidden_state_dtypes: Sequence[str] | None = None
    prefetch_objects: int = 16
    download_threads: int = 8
    mode: ClassVar[str] = "offline"


@dataclass
class OnlineData:
    """Tokenized samples plus the target: `target_hidden_states(input_ids [B, T], attention_mask [B, T])
    -> [B, T, K, H]`, e.g. a `capture.HiddenStateCapture`, possibly on other devices than the drafter."""

    samples: Sequence[TokenizedSample]
    target_hidden_states: HiddenStatesFn
    partitions: Sequence[str] = ()  # reported in the result
    # The target runs on devices of its own: run it on the next micro-batch while the drafter trains on
    # this one (on the drafter's own device it would only queue behind the drafter's work).
    overlap: bool = False
    mode: ClassVar[str] = "online"


def collate_hidden_state_samples(samples: Sequence[HiddenStateSample], max_length: int) -> DrafterBatch:
    """Right-pad stored samples (truncated to `max_length`) into one batch, in their stored dtype: fp8
    samples stay fp8 with their scales, dequantised on the training device (`context_states`). A batch
    mixing bf16 and fp8 ranges (a dtype changed between ranges) is collated in bf16."""
    lengths = [min(sample.num_tokens, max_length) for sample in samples]
    input_ids, attention_mask = pad_batch(
        [s.input_ids[:n].tolist() for s, n in zip(samples, lengths, strict=True)], 0
    )
    fp8 = all(sample.hidden_state_dtype == "fp8" for sample in samples)
    first = samples[0].hidden_states
    shape = (len(samples), input_ids.shape[1], *first.shape[1:])
    hidden_states = torch.zeros(shape, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scale = torch.zeros(shape[:3], dtype=torch.float32) if fp8 else None
    loss_mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
        if scale is not None:
            hidden_states[row, :length] = sample.hidden_states[:length]
            scale[row, :length] = sample.hidden_states_scale[:length]
        elif sample.hidden_state_dtype == "fp8":
            hidden_states[row, :length] = sample.dequantized(torch.bfloat16)[:length]
        else:
            hidden_states[row, :length] = sample.hidden_states[:length]
        loss_mask[row, :length] = sample.loss_mask[:length].bool()
    return DrafterBatch(
        input_ids=input_ids,
        loss_mask=loss_mask & attention_mask.bool(),
        hidden_states=hidden_states,
        lengths=torch.tensor(lengths, dtype=torch.long),
        sample_indices=[sample.sample_index for sample in samples],
        hidden_states_scale=scale,
    )


def collate_tokenized_samples(
    samples: Sequence[TokenizedSample],
    max_length: int,
    target_hidden_states: HiddenStatesFn,
    config: DrafterConfig,
) -> DrafterBatch:
    """Right-pad tokenized samples and run the target on them.

    The result is rounded to bfloat16 and zeroed on padding, exactly like stored objects, so online
    and offline training see identical inputs.
    """
    lengths = [min(sample.num_tokens, max_length) for sample in samples]
    input_ids, attention_mask = pad_batch([s.input_ids[:n] for s, n in zip(samples, lengths, strict=True)], 0)
    loss_mask, _ = pad_batch([s.loss_mask[:n] for s, n in zip(samples, lengths, strict=True)], 0)
    hidden_states = target_hidden_states(input_ids, attention_mask)
    expected = (*input_ids.shape, config.num_context_layers, config.target_hidden_size)
    if tuple(hidden_states.shape) != expected:
        raise ValueError(
            f"the target returned hidden states of shape {tuple(hidden_states.shape)} for samples "
            f"{[s.sample_index for s in samples]}, expected {expected} [B, T, K, H]; do the capture's "
            f"target layers match the drafter's {config.target_layer_ids}?"
        )
    padding = attention_mask.to(hidden_states.device)[:, :, None, None] == 0
    return DrafterBatch(
        input_ids=input_ids,
        loss_mask=loss_mask.bool() & attention_mask.bool(),
        hidden_states=hidden_states.to(torch.bfloat16).masked_fill(padding, 0),
        lengths=torch.tensor(lengths, dtype=torch.long),
        sample_indices=[s.sample_index for s in samples],
    )


class OfflineSource:
    """Stored samples, streamed from the store in the order training will use them."""

    def __init__(self, data: OfflineData, config: DrafterConfig, settings: TrainSettings) -> None:
        self.data, self.config, self.settings = data, config, settings
        self.cache_dir = Path(data.cache_dir)
        self.objects = list(data.objects)
        if data.num_tokens is not None:
            lengths = list(data.num_tokens)
        else:
            dtypes = list(data.hidden_state_dtypes or ["bf16"] * len(self.objects))
            shape = (config.num_context_layers, config.target_hidden_size)
            sizes = [size for _, size in self.objects]
            lengths = [estimate_num_tokens(n, *shape, d) for n, d in zip(sizes, dtypes, strict=True)]
        self.lengths = [min(n, settings.max_length) for n in lengths]
        parsed = [parse_sample_object_name(key.rsplit("/", 1)[-1]) for key, _ in self.objects]
        self.sample_indices = [index if index is not None else pos for pos, index in enumerate(parsed)]
        self.partitions = sorted({partition_of(key) for key, _ in self.objects})
        self._streams: dict[str, SampleStream] = {}

    def setup_streams(self, eval_ids: Sequence[int]) -> None:
        """Split the cache budget: evaluation gets what its largest objects need, training the rest."""
        budget = self.data.cache_budget_bytes
        eval_sizes = sorted((self.objects[i][1] for i in eval_ids), reverse=True)
        eval_budget = max(sum(eval_sizes[:2]), budget // 8) if eval_sizes else 0
        train_budget = budget - eval_budget
        largest = max(size for _, size in self.objects)
        if train_budget < largest:
            raise ValueError(
                f"sample cache budget {budget} bytes leaves {train_budget} for training, less than the "
                f"largest hidden-state object ({largest} bytes); raise the cache budget"
            )
        common = {
            "prefetch_objects": self.data.prefetch_objects,
            "download_threads": self.data.download_threads,
            "config": self.config,
        }
        self._streams["train"] = SampleStream(
            self.data.store, self.cache_dir / "train", cache_budget_bytes=train_budget, **common
        )
        if eval_budget:
            self._streams["eval"] = SampleStream(
                self.data.store, self.cache_dir / "eval", cache_budget_bytes=eval_budget, **common
            )

    def iterate(self, ids: Sequence[int], stream: str = "train") -> Iterator[HiddenStateSample]:
        for _, sample in self._streams[stream].iterate([self.objects[i] for i in ids]):
            yield sample

    def collate(self, samples: Sequence[HiddenStateSample]) -> DrafterBatch:
        return collate_hidden_state_samples(samples, self.settings.max_length)

    def prepare(self, ids: Sequence[int]) -> None:
        """Nothing to start ahead: the stream already downloads ahead."""

    def settle(self) -> None:
        pass


class OnlineSource:
    """Tokenized samples; collating a micro-batch runs the target on it. With `overlap`, `prepare(ids)`
    starts that on a background thread (the target's devices work while the drafter's do), and
    `collate` of the same samples takes its result; the target never runs twice at once."""

    def __init__(self, data: OnlineData, config: DrafterConfig, settings: TrainSettings) -> None:
        self.data, self.config, self.settings = data, config, settings
        self.samples = list(data.samples)
        self.lengths = [min(s.num_tokens, settings.max_length) for s in self.samples]
        self.sample_indices = [s.sample_index for s in self.samples]
        self.partitions = list(data.partitions)
        self._ahead: ThreadPoolExecutor | None = None
        self._pending: tuple[tuple[int, ...], Future[DrafterBatch]] | None = None

    def setup_streams(self, eval_ids: Sequence[int]) -> None:
        pass

    def iterate(self, ids: Sequence[int], stream: str = "train") -> Iterator[TokenizedSample]:
        return (self.samples[i] for i in ids)

    def _collate_now(self, samples: Sequence[TokenizedSample]) -> DrafterBatch:
        return collate_tokenized_samples(
            samples, self.settings.max_length, self.data.target_hidden_states, self.config
        )

    def prepare(self, ids: Sequence[int]) -> None:
        """Start running the target on the samples `ids` (the next micro-batch), with `overlap`."""
        if not self.data.overlap or not ids:
            return
        self.settle()
        if self._ahead is None:  # its thread's allocations go to the drafter's device, not GPU 0
            self._ahead = ThreadPoolExecutor(
                1, thread_name_prefix="target-ahead", initializer=thread_on_device(self.settings.device)
            )
        samples = [self.samples[i] for i in ids]
        key = tuple(s.sample_index for s in samples)
        self._pending = (key, self._ahead.submit(self._collate_now, samples))

    def settle(self) -> None:
        """Wait for the target's work started ahead (before anything else uses the target)."""
        if self._pending is not None:
            self._pending[1].exception()  # waits; an error surfaces where the batch is collated

    def collate(self, samples: Sequence[TokenizedSample]) -> DrafterBatch:
        if self._pending is not None:
            key, future = self._pending
            if key == tuple(s.sample_index for s in samples):
                self._pending = None
                return future.result()
            # Prepared for other samples (held-out ones are evaluated in between, or a step is redone
            # in smaller micro-batches): it finishes first and stays for its own turn.
            future.exception()
        return self._collate_now(samples)
