"""What a run will extract, range by range: kept samples and their tokens, from the best source there is.

For each sample range of the dataset, in order of preference:
1. `tokenized`: the range is materialised in the store; its manifest gives the exact sample count and
   token total (and a few ranges' shards give per-sample lengths for the distribution);
2. `dataset`: the range is tokenized now, every row (when the rows left are few enough);
3. `estimated`: a uniform random sample of the rows left is tokenized, and each such range gets the
   sample's mean per row; the 95 % interval of the extrapolated token total is reported with it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_assets.conversations.datasets import count_rows, dataset_notes, iter_rows_at, resolve_dataset
from dflash_assets.conversations.sample_range import SampleRange, range_containing, sample_ranges
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.conversations.shard import read_shard
from dflash_assets.conversations.tokenize import tokenize_rows
from dflash_assets.storage.layout import SHARD_NAME, TOKENIZED_PREFIX
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.store import ObjectStore

Z_95 = 1.96


@dataclass
class RangeWorkload:
    """One sample range. `samples`/`tokens` are exact unless `source == "estimated"` (expected values)."""

    partition: str
    rows: int  # rows of the range present in the dataset
    samples: float
    tokens: float
    source: str  # "tokenized", "dataset" or "estimated"
    lengths: list[int] | None = None  # per kept sample, when known
    sample_indices: list[int] | None = None
    truncated: float = 0.0  # samples cut to max_length

    @property
    def exact(self) -> bool:
        return self.source != "estimated"


@dataclass
class Workload:
    dataset: str
    rows: int
    samples_per_partition: int
    max_length: int
    ranges: list[RangeWorkload]
    sample_lengths: list[int] = field(default_factory=list)  # kept samples of the sampled rows
    sampled_rows: int = 0  # rows tokenized as a sample for the estimated ranges
    estimated_rows: int = 0  # rows of the estimated ranges
    tokens_error_95: float = 0.0  # half-width of the 95 % interval of the token total (0: exact)
    notes: list[str] = field(default_factory=list)
    # What a person should know about the data before a run: a file cut short, rows that would be dropped.
    warnings: list[str] = field(default_factory=list)
    given: str = ""  # a what-if's counts (`plan --samples --mean-tokens`), said in words

    @property
    def lengths(self) -> list[int]:
        """Every per-sample length known (exact ranges and the sample): the distribution."""
        return [n for r in self.ranges if r.lengths for n in r.lengths] + self.sample_lengths

    @property
    def samples(self) -> float:
        return sum(r.samples for r in self.ranges)

    @property
    def tokens(self) -> float:
        return sum(r.tokens for r in self.ranges)

    @property
    def truncated(self) -> float:
        return sum(r.truncated for r in self.ranges)

    @property
    def exact(self) -> bool:
        return all(r.exact for r in self.ranges)

    @property
    def relative_error_95(self) -> float:
        return self.tokens_error_95 / self.tokens if self.tokens else 0.0


def _present_rows(sample_range: SampleRange, rows: int) -> int:
    return max(0, min(sample_range.end, rows - 1) - sample_range.start + 1)


def _spread(items: Sequence[Any], count: int) -> list[Any]:
    """Up to `count` items evenly spread over `items` (first and last included)."""
    if len(items) <= count:
        return list(items)
    if count <= 1:
        return [items[0]]
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def _from_samples(
    partition: str, rows: int, samples: Sequence[TokenizedSample], max_length: int, source: str
):
    lengths = [s.num_tokens for s in samples]
    return RangeWorkload(
        partition=partition,
        rows=rows,
        samples=len(samples),
        tokens=sum(lengths),
        source=source,
        lengths=lengths,
        sample_indices=[s.sample_index for s in samples],
        truncated=sum(n >= max_length for n in lengths),
    )


def build_workload(
    *,
    dataset_uri: str,
    samples_per_partition: int,
    max_length: int,
    tokenizer: Any | None,
    store: ObjectStore | None = None,
    known: dict[str, Sequence[TokenizedSample]] | None = None,
    sample_rows: int = 5000,
    shards_for_lengths: int = 8,
    overlong: str = "truncate",
    seed: int = 0,
    cache_dir: Path | None = None,
    rows: int | None = None,
    layout: str = "auto",
    log: Callable[[str], None] = lambda message: None,
) -> Workload:
    """The workload of every range covering `dataset_uri` (see the module docstring).

    `known` gives ranges already tokenized in this process (partition -> kept samples), e.g. the range
    `tokenized_completions` is materialising. Without a `tokenizer` nothing is tokenized: ranges not
    known or in the store are estimated from the ranges that are. `sample_rows=0` tokenizes every row.
    `rows` is the dataset's row count when the caller knows it (counting a large file takes a scan).
    Rows are read in `layout` (`DFLASH_DATASET_FORMAT`), as `tokenized_completions` reads them; the
    workload's `warnings` say which of the rows tokenized would be dropped and why, and where a file stops
    short (a cut JSON array).
    """
    path = resolve_dataset(dataset_uri, cache_dir=cache_dir)
    file_notes = dataset_notes(path)
    rows = count_rows(path) if rows is None else rows
    if rows == 0:
        raise ValueError(f"dataset {dataset_uri!r} has no rows: check DFLASH_DATASET")
    ranges: dict[str, RangeWorkload] = {}
    left: list[SampleRange] = []
    materialised: list[tuple[str, int]] = []
    for sample_range in sample_ranges(rows, samples_per_partition):
        key, present = sample_range.key, _present_rows(sample_range, rows)
        if known and key in known:
            ranges[key] = _from_samples(key, present, known[key], max_length, "tokenized")
            continue
        manifest = read_manifest(store, f"{TOKENIZED_PREFIX}/{key}") if store is not None else None
        if manifest is None:
            left.append(sample_range)
            continue
        indices = [int(i) for i in manifest.get("sample_indices", [])]
        ranges[key] = RangeWorkload(key, present, len(indices), int(manifest.get("tokens", 0)), "tokenized")
        ranges[key].sample_indices = indices
        materialised.append((key, int(manifest.get("max_length", max_length))))
    # Per-sample lengths of a few materialised ranges (a shard download each), for the distribution.
    for key, range_max_length in _spread(materialised, shards_for_lengths):
        local = (cache_dir or Path(".")) / "plan-shards" / key / SHARD_NAME
        local.parent.mkdir(parents=True, exist_ok=True)
        store.download(f"{TOKENIZED_PREFIX}/{key}/{SHARD_NAME}", local)
        shard = read_shard(local)
        ranges[key] = _from_samples(key, ranges[key].rows, shard, range_max_length, "tokenized")
    if materialised:
        log(
            f"{len(materialised)} ranges are tokenized in the store "
            f"({min(len(materialised), shards_for_lengths)} of their shards read for the length distribution)"
        )

    workload = Workload(str(dataset_uri), rows, samples_per_partition, max_length, [], warnings=file_notes)
    left_rows = [i for r in left for i in range(r.start, r.start + _present_rows(r, rows))]
    if left_rows and tokenizer is not None:
        whole = sample_rows <= 0 or len(left_rows) <= sample_rows
        chosen = left_rows if whole else sorted(random.Random(seed).sample(left_rows, sample_rows))
        log(
            f"tokenizing {'every one' if whole else f'a random sample of {len(chosen):,}'} of the "
            f"{len(left_rows):,} rows not tokenized yet"
        )
        result = tokenize_rows(
            tokenizer,
            iter_rows_at(path, chosen, layout=layout),
            path,
            str(dataset_uri),
            max_length=max_length,
            overlong=overlong,
        )
        if result.dropped:
            what = "rows" if whole else "sampled rows"
            workload.warnings.append(result.dropped_line(rows_word=what, verb="would be dropped"))
        if whole:
            by_range: dict[str, list[TokenizedSample]] = {r.key: [] for r in left}
            for sample in result.samples:
                by_range[range_containing(sample.sample_index, samples_per_partition).key].append(sample)
            for sample_range in left:
                present = _present_rows(sample_range, rows)
                ranges[sample_range.key] = _from_samples(
                    sample_range.key, present, by_range[sample_range.key], max_length, "dataset"
                )
        else:
            _estimate(workload, ranges, left, rows, len(chosen), result.samples, max_length)
    elif left_rows:
        _estimate_from_known(workload, ranges, left, rows)
    workload.ranges = [ranges[r.key] for r in sample_ranges(rows, samples_per_partition)]
    return workload


def _estimate(workload, ranges, left, rows, sampled, kept: Sequence[TokenizedSample], max_length) -> None:
    """Each left range gets the sample's means per row; the interval is that of a mean of `sampled` rows
    drawn without replacement from the rows left."""
    # Tokens per sampled row: a kept row's count, 0 for a dropped one (order does not matter here).
    per_row = [s.num_tokens for s in kept] + [0] * (sampled - len(kept))
    total_left = sum(_present_rows(r, rows) for r in left)
    mean_tokens = sum(per_row) / sampled
    kept_fraction = len(kept) / sampled
    truncated_fraction = sum(s.num_tokens >= max_length for s in kept) / sampled
    variance = sum((t - mean_tokens) ** 2 for t in per_row) / max(sampled - 1, 1)
    finite = max(0.0, 1 - sampled / total_left)
    workload.tokens_error_95 = Z_95 * total_left * math.sqrt(variance / sampled * finite)
    workload.sampled_rows, workload.estimated_rows = sampled, total_left
    workload.sample_lengths = [s.num_tokens for s in kept]
    for sample_range in left:
        present = _present_rows(sample_range, rows)
        ranges[sample_range.key] = RangeWorkload(
            sample_range.key,
            present,
            present * kept_fraction,
            present * mean_tokens,
            "estimated",
            truncated=present * truncated_fraction,
        )


def _estimate_from_known(workload, ranges, left, rows) -> None:
    """No tokenizer: the ranges left get the known ranges' means per row (no interval: they are not a
    random sample of the dataset)."""
    known = [r for r in ranges.values() if r.rows]
    if not known:
        raise ValueError("no range is tokenized and no tokenizer was given: nothing to estimate from")
    known_rows = sum(r.rows for r in known)
    samples_per_row = sum(r.samples for r in known) / known_rows
    tokens_per_row = sum(r.tokens for r in known) / known_rows
    truncated_per_row = sum(r.truncated for r in known) / known_rows
    total_left = 0
    for sample_range in left:
        present = _present_rows(sample_range, rows)
        total_left += present
        ranges[sample_range.key] = RangeWorkload(
            sample_range.key,
            present,
            present * samples_per_row,
            present * tokens_per_row,
            "estimated",
            truncated=present * truncated_per_row,
        )
    workload.estimated_rows = total_left
    workload.notes.append(
        f"{total_left:,} rows not tokenized yet are estimated from the {known_rows:,} rows of the tokenized "
        "ranges (not a random sample: no error bound)"
    )


GIVEN_LENGTHS = 1024  # per-sample lengths a what-if workload carries for its distribution


def given_workload(
    *,
    samples: int,
    mean_tokens: float,
    samples_per_partition: int,
    max_length: int,
    lengths: Sequence[int] = (),
    dataset: str = "given",
    given: str = "",
    warnings: Sequence[str] = (),
) -> Workload:
    """A what-if workload (`plan --samples N --mean-tokens T`): `samples` samples of `mean_tokens`
    tokens on average, in ranges of `samples_per_partition`. Per-sample lengths follow `lengths` (a
    dataset's, scaled to the mean and truncated at `max_length`), else every sample is at the mean;
    `warnings` are the dataset's, when one was read."""
    if lengths:
        scale = mean_tokens / (sum(lengths) / len(lengths))
        shape = [min(max_length, max(1, round(n * scale))) for n in _spread(sorted(lengths), GIVEN_LENGTHS)]
    else:
        shape = [min(max_length, max(1, round(mean_tokens)))] * min(samples, GIVEN_LENGTHS)
    truncated_fraction = sum(n >= max_length for n in shape) / len(shape) if shape else 0.0
    ranges = []
    for sample_range in sample_ranges(samples, samples_per_partition):
        present = _present_rows(sample_range, samples)
        ranges.append(
            RangeWorkload(
                sample_range.key,
                present,
                present,
                present * mean_tokens,
                "given",
                truncated=present * truncated_fraction,
            )
        )
    return Workload(
        dataset,
        samples,
        samples_per_partition,
        max_length,
        ranges,
        sample_lengths=shape,
        given=given,
        warnings=list(warnings),
    )
