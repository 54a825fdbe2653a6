"""Sample-range partition keys: `<start>-<end>`, both ends zero-padded to 8 digits, end inclusive.

This is the one parser for keys. Ranges have a fixed size, so a key never changes when the dataset
grows: the last range is simply partly filled until more rows arrive.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

KEY_DIGITS = 8
_KEY_PATTERN = re.compile(r"^(\d{8})-(\d{8})$")


@dataclass(frozen=True, order=True)
class SampleRange:
    """Rows `start..end` (inclusive) of the source dataset, by 0-based row position."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid sample range {self.start}..{self.end}: need 0 <= start <= end")
        if self.end >= 10**KEY_DIGITS:
            raise ValueError(f"sample range end {self.end} does not fit in {KEY_DIGITS} digits")

    @property
    def key(self) -> str:
        return f"{self.start:0{KEY_DIGITS}d}-{self.end:0{KEY_DIGITS}d}"

    @classmethod
    def parse(cls, key: str) -> SampleRange:
        match = _KEY_PATTERN.match(key)
        if match is None:
            raise ValueError(
                f"partition key {key!r} is not a sample range: expected '<start>-<end>' with both ends "
                f"zero-padded to {KEY_DIGITS} digits, e.g. '00000000-00009999'"
            )
        return cls(int(match.group(1)), int(match.group(2)))

    def __len__(self) -> int:
        return self.end - self.start + 1

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and self.start <= index <= self.end

    def indices(self) -> range:
        return range(self.start, self.end + 1)

    def __str__(self) -> str:
        return self.key


def sample_ranges(num_samples: int, samples_per_partition: int) -> Iterator[SampleRange]:
    """Fixed-size ranges covering rows `0..num_samples-1`; the last one may extend past the data."""
    if samples_per_partition <= 0:
        raise ValueError(f"samples per partition must be positive, got {samples_per_partition}")
    for start in range(0, max(num_samples, 0), samples_per_partition):
        yield SampleRange(start, start + samples_per_partition - 1)


def range_containing(index: int, samples_per_partition: int) -> SampleRange:
    start = (index // samples_per_partition) * samples_per_partition
    return SampleRange(start, start + samples_per_partition - 1)
