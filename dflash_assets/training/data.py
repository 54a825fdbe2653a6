"""Training input, offline or online: both yield the same `DrafterBatch` for the same samples.

Offline, hidden states are read from the store ahead of training, through a cache the node's ranks
share (`sample_stream.py`); online, the target computes them for each micro-batch. Collation rounds and
zeroes them the same way, so a batch gives the same loss either way."""

from __future__ import annotations

import contextlib
import threading
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
from dflash_assets.training.plan import split_eval
from dflash_assets.training.sample_stream import (
    MAX_IN_FLIGHT,
    NODE_CACHE_DIR,
    CacheLayout,
    NodeCache,
    SampleStream,
    StreamClosed,
    StreamIteration,
    partition_of,
    plan_node_cache,
)
from dflash_assets.training.settings import TrainSettings

HiddenStatesFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class OfflineData:
    """Hidden-state objects in the store, e.g. `StoredPartition.object_keys()` of several partitions."""

    store: ObjectStore
    objects: Sequence[tuple[str, int]]  # (key, size in bytes, from the manifest: no HEAD before a GET)
    # The node's cache folder, shared by its ranks (each gives the same folder and budget): the objects
    # that fit `cache_budget_bytes` stay there for the run; the rest streams through memory every epoch.
    cache_dir: str | Path
    cache_budget_bytes: int = 16 * 2**30  # the node's, on disk (`sample_stream.plan_node_cache`)
    # Token count of each object (e.g. from the partition manifest), for length bucketing. Without it,
    # lengths are estimated from object sizes: close enough to bucket, never used for correctness.
    num_tokens: Sequence[int] | None = None
    # Stored dtype of each object (`bf16`/`fp8`, from its partition's manifest), for those estimates.
    hidden_state_dtypes: Sequence[str] | None = None
    read_ahead_bytes: int | None = None  # each stream's, in memory (None: `plan_node_cache`'s default)
    max_in_flight: int = MAX_IN_FLIGHT  # requests at once a stream may grow to
    mode: ClassVar[str] = "offline"

    @property
    def node_cache_dir(self) -> Path:
        return Path(self.cache_dir) / NODE_CACHE_DIR


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


def collate_hidden_state_samples(
    samples: Sequence[HiddenStateSample],
    max_length: int,
    *,
    pin_memory: bool = False,
    final_state: bool = False,
) -> DrafterBatch:
    """Right-pad stored samples (truncated to `max_length`) into one batch, in their stored dtype: fp8
    samples stay fp8 with their scales, dequantised on the training device (`context_states`). A batch
    mixing bf16 and fp8 ranges (a dtype changed between ranges) is collated in bf16. `pin_memory` puts
    the hidden states in page-locked memory, which a CUDA device copies from fastest. `final_state` adds
    each sample's final hidden state as one more slot after its layers (distillation reads it)."""
    if final_state:
        lacking = [sample.sample_index for sample in samples if not sample.has_final_state]
        if lacking:
            raise ValueError(
                f"samples {lacking} hold no final hidden state, which distillation (DFLASH_DISTILL_WEIGHT) "
                "reads: capture their ranges again with DFLASH_CAPTURE_FINAL_STATE=1"
            )
    lengths = [min(sample.num_tokens, max_length) for sample in samples]
    input_ids, attention_mask = pad_batch(
        [s.input_ids[:n].tolist() for s, n in zip(samples, lengths, strict=True)], 0
    )
    fp8 = all(sample.hidden_state_dtype == "fp8" for sample in samples)
    layers, hidden = samples[0].hidden_states.shape[1:]
    shape = (len(samples), input_ids.shape[1], layers + int(final_state), hidden)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    # Each row written once: its sample's states, then zeros on its padding (no zero-fill before the copy:
    # at ~100 MB a sample, memory passes are what collation costs).
    hidden_states = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
    scale = torch.empty(shape[:3], dtype=torch.float32, pin_memory=pin_memory) if fp8 else None
    loss_mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    for row, (sample, length) in enumerate(zip(samples, lengths, strict=True)):
        if scale is not None:
            hidden_states[row, :length, :layers] = sample.hidden_states[:length]
            scale[row, :length, :layers] = sample.hidden_states_scale[:length]
            if final_state:
                hidden_states[row, :length, layers] = sample.final_hidden_states[:length]
                scale[row, :length, layers] = sample.final_hidden_states_scale[:length]
            scale[row, length:] = 0
        elif sample.hidden_state_dtype == "fp8":
            hidden_states[row, :length, :layers] = sample.dequantized(torch.bfloat16)[:length]
            if final_state:
                hidden_states[row, :length, layers] = sample.final_dequantized(torch.bfloat16)[:length]
        else:
            hidden_states[row, :length, :layers] = sample.hidden_states[:length]
            if final_state:
                hidden_states[row, :length, layers] = sample.final_hidden_states[:length]
        hidden_states[row, length:].view(torch.uint8).zero_()  # fp8 has no zero_ of its own
        loss_mask[row, :length] = sample.loss_mask[:length].bool()
    return DrafterBatch(
        input_ids=input_ids,
        loss_mask=loss_mask & attention_mask.bool(),
        hidden_states=hidden_states,
        lengths=torch.tensor(lengths, dtype=torch.long),
        sample_indices=[sample.sample_index for sample in samples],
        hidden_states_scale=scale,
        final_state=final_state,
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
    final_state = bool(getattr(target_hidden_states, "final_state", False))  # a capture's last slot
    expected = (*input_ids.shape, config.num_context_layers + int(final_state), config.target_hidden_size)
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
        final_state=final_state,
    )


class OfflineSource:
    """Stored samples, read ahead from the store (or the node's cache) in the order training uses them,
    decoded on threads of their own; `prepare(ids)` collates a micro-batch on another thread while the
    drafter trains on the one before, so the training thread neither reads, decodes nor collates."""

    def __init__(self, data: OfflineData, config: DrafterConfig, settings: TrainSettings) -> None:
        self.data, self.config, self.settings = data, config, settings
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
        self.pin_memory = torch.device(settings.device).type == "cuda"
        self.layout: CacheLayout | None = None
        self.node_cache: NodeCache | None = None
        self._streams: dict[str, SampleStream] = {}
        # The training pass now read: its positions by source id, the samples it yielded and nobody
        # collated yet (by position, and their positions by identity), and the one micro-batch being
        # collated ahead.
        self._iteration: StreamIteration | None = None
        self._positions: dict[int, int] = {}
        self._yielded: dict[int, HiddenStateSample] = {}
        self._position_of: dict[int, int] = {}
        self._ahead: ThreadPoolExecutor | None = None
        self._pending: _Pending | None = None

    def setup_streams(self, eval_ids: Sequence[int]) -> None:
        """The node's cache layout and this rank's streams. Every rank of a node plans the same layout:
        the held-out ids come from the settings (`eval_ids` are the ones this rank evaluates)."""
        _, held_out = split_eval(len(self.objects), self.settings.eval_samples, self.settings.seed)
        self.layout = plan_node_cache(
            self.objects,
            self.data.cache_budget_bytes,
            held_out=held_out,
            window_bytes=self.data.read_ahead_bytes,
        )
        self.node_cache = NodeCache(self.data.store, self.data.node_cache_dir, self.layout.resident)
        self.node_cache.prepare()
        common = {
            "window_bytes": self.layout.window_bytes,
            "node_cache": self.node_cache,
            "max_in_flight": self.data.max_in_flight,
            "config": self.config,
        }
        self._streams["train"] = SampleStream(self.data.store, **common)
        if eval_ids:
            self._streams["eval"] = SampleStream(self.data.store, **common)

    def cache_note(self) -> str:
        """What the node's cache holds for the run, and what each epoch reads again, in a line: said before
        the first step, since a budget that holds the data set at one dataset size may not at the next."""
        from dflash_assets.storage.units import human_bytes

        layout = self.layout
        kept, every = len(layout.resident), len(self.objects)
        again = layout.total_bytes - layout.resident_bytes
        rest = (
            f"the other {every - kept} ({human_bytes(again)}) are read from the store again every epoch; "
            "raise the run config `cache_budget_bytes` to keep them"
            if again
            else "each is downloaded once for the run"
        )
        return (
            f"offline cache: {kept} of {every} hidden-state objects ({human_bytes(layout.resident_bytes)} of "
            f"{human_bytes(layout.total_bytes)}) stay on this node's disk for the run (budget "
            f"{human_bytes(layout.budget_bytes)}, shared by its ranks); {rest}. Each rank reads ahead up to "
            f"{human_bytes(layout.window_bytes)} in memory"
        )

    def iterate(self, ids: Sequence[int], stream: str = "train") -> Iterator[HiddenStateSample]:
        iteration = self._streams[stream].open([self.objects[i] for i in ids])
        if stream == "train":
            self._drop_pending()
            if self._iteration is not None:
                self._iteration.close()
            self._iteration, self._yielded, self._position_of = iteration, {}, {}
            self._positions = {i: position for position, i in enumerate(ids)}
        return self._samples(iteration, track=stream == "train")

    def _samples(self, iteration: StreamIteration, *, track: bool) -> Iterator[HiddenStateSample]:
        try:
            for position, (_, sample) in enumerate(iteration):
                if track:
                    self._yielded[position] = sample
                    self._position_of[id(sample)] = position
                yield sample
        finally:
            iteration.close()

    def prepare(self, ids: Sequence[int]) -> None:
        """Collate the micro-batch of source ids `ids` (the next one) on a thread of its own, from samples
        already yielded or still to come; `collate` of the same samples takes the result."""
        iteration, positions = self._iteration, [self._positions.get(i) for i in ids]
        if not ids or iteration is None or None in positions:
            return
        yielded = {p: self._yielded[p] for p in positions if p in self._yielded}
        later = [p for p in positions if p not in yielded]
        if later and not iteration.hold(later):
            return  # neither yielded here nor still to come (a step redone): collated when asked
        self._drop_pending()
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(1, thread_name_prefix="collate-ahead")
        cancelled = threading.Event()
        key = tuple(positions)

        def collate_ahead() -> DrafterBatch:
            try:
                samples = [
                    yielded[p] if p in yielded else iteration.sample_at(p, cancelled) for p in positions
                ]
                return self._collate_now(samples)
            finally:
                iteration.release(later)

        self._pending = _Pending(key, self._ahead.submit(collate_ahead), cancelled)

    def _drop_pending(self) -> None:
        """Forget the micro-batch collated ahead (it may wait for samples that will not come)."""
        if self._pending is not None:
            self._pending.cancelled.set()
            self._pending = None

    def settle(self) -> None:
        """Nothing to wait for: collating ahead uses no device another part needs."""

    def collate(self, samples: Sequence[HiddenStateSample]) -> DrafterBatch:
        # Collated: the training pass no longer keeps these samples for `prepare`.
        positions = tuple(self._position_of.pop(id(sample), None) for sample in samples)
        for position in positions:
            self._yielded.pop(position, None)
        pending = self._pending
        if pending is not None and pending.key == positions:
            self._pending = None
            with contextlib.suppress(StreamClosed):
                return pending.future.result()
        # Another micro-batch (held-out samples between steps, a step redone smaller): the one prepared
        # keeps its turn, unwaited for.
        return self._collate_now(samples)

    def _collate_now(self, samples: Sequence[HiddenStateSample]) -> DrafterBatch:
        return collate_hidden_state_samples(
            samples,
            self.settings.max_length,
            pin_memory=self.pin_memory,
            final_state=self.settings.distill_weight > 0,  # only what the objective reads crosses
        )


@dataclass
class _Pending:
    key: tuple[int, ...]  # the positions in the training pass of the samples collated
    future: Future[DrafterBatch]
    cancelled: threading.Event


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

    def cache_note(self) -> str:
        return ""  # nothing is read from the store while training

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
