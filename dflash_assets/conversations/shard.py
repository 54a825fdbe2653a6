"""The tokenized shard: one Parquet file per sample range, zstd-compressed, one row per kept
conversation in ascending `sample_index`:

    sample_index  int64          row's 0-based position in the source dataset (dropped rows leave gaps)
    input_ids     list<int32>    token ids of the rendered conversation, truncated to max_length
    loss_mask     list<uint8>    1 = assistant token to train on, same length as input_ids
    num_tokens    int32          len(input_ids), so lengths can be read without the lists

File metadata key `dflash_format` = `dflash-assets.tokenized/1`. A committed range holds it as
`tokenized-completions/<range>/shard.parquet`.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.storage.layout import SHARD_NAME
from dflash_assets.storage.manifest import StoredPartition

SHARD_FORMAT = "dflash-assets.tokenized/1"
SHARD_FORMAT_KEY = b"dflash_format"


def _shard_schema() -> Any:
    import pyarrow as pa

    return pa.schema(
        [
            ("sample_index", pa.int64()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.uint8())),
            ("num_tokens", pa.int32()),
        ],
        metadata={SHARD_FORMAT_KEY: SHARD_FORMAT.encode()},
    )


def write_shard(samples: Sequence[TokenizedSample], path: Path) -> int:
    """Write samples as one Parquet shard (format in the module docstring); returns its size in bytes.

    Written to a temporary name and renamed, so a killed process never leaves a partial shard.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    ordered = sorted(samples, key=lambda s: s.sample_index)
    indices = [s.sample_index for s in ordered]
    if len(set(indices)) != len(indices):
        raise ValueError("duplicate sample_index in shard: every dataset row may appear at most once")
    table = pa.Table.from_arrays(
        [
            pa.array(indices, type=pa.int64()),
            pa.array([s.input_ids for s in ordered], type=pa.list_(pa.int32())),
            pa.array([s.loss_mask for s in ordered], type=pa.list_(pa.uint8())),
            pa.array([s.num_tokens for s in ordered], type=pa.int32()),
        ],
        schema=_shard_schema(),
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        pq.write_table(table, partial, compression="zstd")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path.stat().st_size


def read_shard(source: Path | str | bytes) -> list[TokenizedSample]:
    """Read a shard written by `write_shard` (a path, or the object's bytes fetched from the store)."""
    import pyarrow.parquet as pq

    where = "shard bytes" if isinstance(source, bytes) else str(source)
    table = pq.read_table(io.BytesIO(source) if isinstance(source, bytes) else source)
    missing = {"sample_index", "input_ids", "loss_mask"} - set(table.column_names)
    if missing:
        raise ValueError(f"{where} is not a tokenized shard: missing columns {sorted(missing)}")
    return [
        TokenizedSample(int(index), input_ids, loss_mask)
        for index, input_ids, loss_mask in zip(
            table.column("sample_index").to_pylist(),
            table.column("input_ids").to_pylist(),
            table.column("loss_mask").to_pylist(),
            strict=True,
        )
    ]


def load_shard(partition: StoredPartition, cache_dir: Path) -> list[TokenizedSample]:
    """A committed range's tokenized samples, read from a local copy under `cache_dir` (the store's read
    cache), downloaded once per content."""
    return read_shard(partition.local_copy(SHARD_NAME, cache_dir))
