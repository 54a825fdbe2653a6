"""The rows a stage leaves out, told to a person in one line: how many of how many, by reason, and where
the first few are (file and line or record) with what was wrong. Said by `dflash-assets plan` and
`dflash-assets ranges` before anything runs (`sample_rows`: rows spread over the dataset), and in a
range's run log by `tokenized_completions` and `target_completions`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dflash_assets.conversations.datasets import DatasetError, DatasetFiles, iter_rows_at, row_location
from dflash_assets.conversations.layouts import Dropped

SHOWN = 5  # dropped rows told by place and detail; the ones after them are only counted


class AllRowsDropped(DatasetError):
    """Every row looked at would be dropped: the dataset, or how it is read, is wrong as a whole."""


@dataclass(frozen=True)
class BadRow:
    """A dropped row where a person finds it: `location` is "line 8" (JSONL, 1-based), "row 7" (Parquet
    position) or "record 7" (a JSON array's), after the shard's name in a dataset of several."""

    dataset: str
    index: int
    location: str
    reason: str
    detail: str

    def __str__(self) -> str:
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.dataset} {self.location}: {self.reason}{detail}"

    def told(self) -> str:
        """Where and why, without the dataset's name: 'record 7: unknown_role: turn 2 is from 'wizard''."""
        return f"{self.location}: {Dropped(self.reason, self.detail)}"


def by_reason_text(by_reason: Mapping[str, int]) -> str:
    """'unknown_role 2, no_assistant 1': the most frequent reason first."""
    return ", ".join(f"{reason} {count:,}" for reason, count in sorted(by_reason.items(), key=_most_first))


def _most_first(item: tuple[str, int]) -> tuple[int, str]:
    return -item[1], item[0]


def dropped_line(
    rows: int,
    by_reason: Mapping[str, int],
    bad_rows: Sequence[BadRow],
    *,
    rows_word: str = "rows",
    verb: str = "were dropped",
) -> str:
    """'3 of 200 sampled rows would be dropped (unknown_role 2, no_assistant 1): record 7: unknown_role:
    turn 2 is from 'wizard'; line 9: ...; and 1 more': `bad_rows` are the first few, in row order."""
    dropped = sum(by_reason.values())
    told = [bad.told() for bad in bad_rows[:SHOWN]]
    if dropped > len(told):
        told.append(f"and {dropped - len(told):,} more")
    return f"{dropped:,} of {rows:,} {rows_word} {verb} ({by_reason_text(by_reason)}): {'; '.join(told)}"


@dataclass
class RowSample:
    """Rows read from a sample spread over a dataset, and those that would be dropped on reading."""

    dataset: str
    rows: int = 0
    by_reason: Counter[str] = field(default_factory=Counter)
    bad_rows: list[BadRow] = field(default_factory=list)  # the first `SHOWN`, in row order

    @property
    def dropped(self) -> int:
        return sum(self.by_reason.values())

    def line(self) -> str:
        return dropped_line(
            self.rows, self.by_reason, self.bad_rows, rows_word="sampled rows", verb="would be dropped"
        )

    def check_not_all_dropped(self, advice: str) -> None:
        """Raise `AllRowsDropped` (one line, `advice` at its end) when every sampled row would be dropped."""
        if self.rows and self.dropped == self.rows:
            told = "; ".join(bad.told() for bad in self.bad_rows)
            raise AllRowsDropped(
                f"every one of the {self.rows:,} rows sampled from {self.dataset} would be dropped "
                f"({by_reason_text(self.by_reason)}): {told}. {advice}"
            )


def sample_rows(
    dataset: DatasetFiles,
    total_rows: int,
    count: int,
    *,
    layout: str = "auto",
    require_assistant: bool = True,
) -> RowSample:
    """Read `count` rows spread evenly over the dataset's `total_rows` (the first and the last among them)
    as `datasets.iter_rows_at` does, and account for those that would be dropped."""
    if total_rows <= count:
        indices = list(range(total_rows))
    else:
        indices = sorted({round(i * (total_rows - 1) / max(count - 1, 1)) for i in range(count)})
    sample = RowSample(dataset.uri)
    for index, row in iter_rows_at(dataset, indices, layout=layout, require_assistant=require_assistant):
        sample.rows += 1
        if isinstance(row, Dropped):
            sample.by_reason[row.reason] += 1
            if len(sample.bad_rows) < SHOWN:
                location = row_location(dataset, index)
                sample.bad_rows.append(BadRow(dataset.uri, index, location, row.reason, row.detail))
    return sample
