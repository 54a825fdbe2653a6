"""Reading chat-conversation datasets: local JSONL (optionally gzipped), Parquet, or either on S3.

A row is one conversation, `{"messages": [{"role": ..., "content": ...}, ...]}`. Its index is its
0-based position in the file — the physical line number for JSONL — so indices never shift when
rows are dropped. A row that cannot be used comes back as `Dropped(reason, detail)` instead of its
messages; the reasons are the keys of `DROP_REASONS`.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from dflash_assets.conversations.sample_range import SampleRange

DATASET_SETTING = "DFLASH_DATASET"
ALLOWED_ROLES = ("system", "user", "assistant", "tool")

# Every reason a row can be dropped for, here and in tokenize.py: the one list to document.
DROP_REASONS: dict[str, str] = {
    "not_utf8": "the line is not valid UTF-8",
    "empty_line": "the line is blank",
    "malformed_json": "the line (or a Parquet `messages` string) is not valid JSON",
    "missing_messages": "the row is not an object with a `messages` field",
    "messages_not_a_list": "`messages` is not a list",
    "bad_message": "a message is not an object with a string `content`",
    "unknown_role": f"a message's role is missing or not one of {', '.join(ALLOWED_ROLES)}",
    "empty_assistant": "an assistant message has empty content",
    "no_assistant": "the conversation has no assistant message",
    "template_error": "the tokenizer's chat template failed on the conversation",
    "assistant_not_located": "an assistant message could not be found in the rendered chat template",
    "overlong": "longer than max_length tokens and overlong='drop'",
    "overlong_no_assistant": "truncating to max_length left no assistant token",
    # Regeneration (target_completions): why the target gave no usable answer for a row.
    "no_prompt": "the conversation has no user or tool turn for the target to answer",
    "generation_failed": "the inference server refused the request for good (e.g. a prompt too long)",
    "exceeds_context": "the prompt fills the target's context (max_position_embeddings): no room to answer",
    "truncated_answer": "an answer hit max_new_tokens and truncated='drop'",
}

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Dropped:
    """Why a row was left out: `reason` is a key of DROP_REASONS, `detail` says what exactly."""

    reason: str
    detail: str = ""

    def __post_init__(self) -> None:
        if self.reason not in DROP_REASONS:
            raise ValueError(f"unknown drop reason {self.reason!r}; known: {sorted(DROP_REASONS)}")

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


class DatasetError(ValueError):
    """The dataset as a whole cannot be used (wrong format, missing column, too many bad rows)."""


class DatasetNotFound(DatasetError, FileNotFoundError):
    pass


def bundled_dataset_path() -> Path:
    """The sample conversations shipped inside the package (the default dataset)."""
    return Path(str(resources.files("dflash_assets").joinpath("data", "conversations.jsonl")))


def dataset_uri(name: str) -> str:
    """The dataset a `DFLASH_DATASET` value names: `bundled` is the shipped sample, anything else as given."""
    return str(bundled_dataset_path()) if name == "bundled" else name


def resolve_dataset(uri: str | Path | None = None, *, s3: Any = None, cache_dir: Path | None = None) -> Path:
    """A local path for `uri`: None/"" -> the bundled sample; s3://bucket/key -> downloaded once into the
    cache (`s3` is an optional store.S3Settings); a path or file:// URL -> checked to exist."""
    if uri is None or str(uri).strip() == "":
        return bundled_dataset_path()
    text = str(uri).strip()
    if text.startswith("s3://"):
        return _download_s3_dataset(text, s3=s3, cache_dir=cache_dir)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise DatasetError(
            f"dataset {text!r} has an unsupported scheme: set {DATASET_SETTING} to a local path, "
            "file:///path or s3://bucket/key"
        )
    path = Path(text).expanduser()
    if not path.is_file():
        raise DatasetNotFound(
            f"dataset {path} does not exist or is not a file: set {DATASET_SETTING} to a JSONL or Parquet "
            "file (local path or s3://bucket/key), or unset it to use the bundled sample conversations"
        )
    return path


def _download_s3_dataset(uri: str, *, s3: Any, cache_dir: Path | None) -> Path:
    from dflash_assets.storage.open_store import open_store
    from dflash_assets.storage.store import ObjectNotFound

    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket or not key or key.endswith("/"):
        raise DatasetError(
            f"dataset {uri!r} must name one object, s3://<bucket>/<key>: fix {DATASET_SETTING}"
        )
    store = open_store(f"s3://{bucket}", s3)
    info = store.head(key)
    if info is None:
        raise DatasetNotFound(
            f"dataset {uri} does not exist (endpoint {getattr(store, 'endpoint_url', 'default')}): "
            f"fix {DATASET_SETTING} or upload the file"
        )
    # The ETag is part of the cached path so a replaced object is fetched again even at equal size.
    version = "".join(ch for ch in (info.etag or "no-etag") if ch.isalnum())[:32]
    if cache_dir is None:
        raise ValueError(f"dataset {uri}: an s3:// dataset needs a cache directory to download into")
    local = cache_dir / "datasets" / "s3" / bucket / version / key
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        return store.download(key, local)
    except ObjectNotFound as err:
        raise DatasetNotFound(f"dataset {uri} disappeared while downloading: {err}") from None


def dataset_format(path: Path) -> str:
    """'parquet' or 'jsonl', from the file name, else from the Parquet magic bytes."""
    name = path.name.lower()
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".json")):
        return "jsonl"
    with path.open("rb") as handle:
        return "parquet" if handle.read(4) == b"PAR1" else "jsonl"


def count_rows(uri: str | Path | None = None, *, s3: Any = None, cache_dir: Path | None = None) -> int:
    """Number of rows without parsing any: newlines for JSONL, footer metadata for Parquet."""
    path = resolve_dataset(uri, s3=s3, cache_dir=cache_dir)
    if dataset_format(path) == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    count, last_byte = 0, b"\n"
    with _open_binary(path) as handle:
        while chunk := handle.read(8 * 2**20):
            count += chunk.count(b"\n")
            last_byte = chunk[-1:]
    # A last line without a trailing newline is still a row (iteration yields it too).
    return count + (last_byte != b"\n")


def iter_rows(
    uri: str | Path | None = None,
    sample_range: SampleRange | None = None,
    *,
    s3: Any = None,
    cache_dir: Path | None = None,
    require_assistant: bool = True,
) -> Iterator[tuple[int, Messages | Dropped]]:
    """Yield `(index, messages or Dropped)` for the rows of `sample_range` (all rows when None) that
    exist; a range running past the end of the data simply stops early. `require_assistant`: see
    `parse_messages`.

    The dataset is resolved (and downloaded) before this returns, so a missing file fails here and
    not at the first `next()`.
    """
    path = resolve_dataset(uri, s3=s3, cache_dir=cache_dir)
    start = sample_range.start if sample_range else 0
    end = sample_range.end if sample_range else None
    if dataset_format(path) == "parquet":
        return _iter_parquet(path, start, end, require_assistant)
    return _iter_jsonl(path, start, end, require_assistant)


def iter_rows_at(
    uri: str | Path | None, indices: Iterable[int], *, s3: Any = None, cache_dir: Path | None = None
) -> Iterator[tuple[int, Messages | Dropped]]:
    """`(index, messages or Dropped)` for the given row indices that exist, in ascending order, in one
    pass: only the chosen rows are parsed (JSONL) or read (Parquet: their row groups). For sampling a
    large dataset, e.g. the capacity plan's estimate."""
    path = resolve_dataset(uri, s3=s3, cache_dir=cache_dir)
    wanted = sorted(set(indices))
    if not wanted:
        return iter(())
    if dataset_format(path) == "parquet":
        return _iter_parquet_at(path, wanted)
    return _iter_jsonl_at(path, wanted)


def _iter_jsonl_at(path: Path, wanted: list[int]) -> Iterator[tuple[int, Messages | Dropped]]:
    chosen = set(wanted)
    with _open_binary(path) as handle:
        for index, raw_line in enumerate(handle):
            if index in chosen:
                yield index, parse_jsonl_line(raw_line, first_line=index == 0)
            if index >= wanted[-1]:
                return


def _iter_parquet_at(path: Path, wanted: list[int]) -> Iterator[tuple[int, Messages | Dropped]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if "messages" not in parquet.schema_arrow.names:
        raise DatasetError(
            f"Parquet dataset {path} has no 'messages' column (columns: {parquet.schema_arrow.names})"
        )
    group_start, position = 0, 0
    for group in range(parquet.num_row_groups):
        group_end = group_start + parquet.metadata.row_group(group).num_rows - 1
        here = []
        while position < len(wanted) and wanted[position] <= group_end:
            here.append(wanted[position])
            position += 1
        if here:
            column = parquet.read_row_group(group, columns=["messages"]).column("messages")
            for index in here:
                yield index, _parse_parquet_value(column[index - group_start].as_py())
        if position == len(wanted):
            return
        group_start = group_end + 1


def row_location(path: Path, index: int) -> str:
    """How a person finds a row: 'line 8' (1-based) in JSONL, 'row 7' (0-based position) in Parquet."""
    return f"row {index}" if dataset_format(path) == "parquet" else f"line {index + 1}"


def _open_binary(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else path.open("rb")


def _iter_jsonl(
    path: Path, start: int, end: int | None, require_assistant: bool = True
) -> Iterator[tuple[int, Messages | Dropped]]:
    with _open_binary(path) as handle:
        # Binary lines, decoded one at a time, so one bad byte drops one row instead of the file.
        for index, raw_line in enumerate(handle):
            if index < start:
                continue
            if end is not None and index > end:
                return
            yield (
                index,
                parse_jsonl_line(raw_line, first_line=index == 0, require_assistant=require_assistant),
            )


def parse_jsonl_line(
    raw_line: bytes, *, first_line: bool = False, require_assistant: bool = True
) -> Messages | Dropped:
    line = raw_line.rstrip(b"\n").rstrip(b"\r")
    if first_line and line.startswith(b"\xef\xbb\xbf"):
        line = line[3:]  # a UTF-8 byte-order mark some editors add
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return Dropped("not_utf8", f"byte 0x{line[err.start]:02x} at byte offset {err.start} is not UTF-8")
    if not text.strip():
        return Dropped("empty_line")
    try:
        row = json.loads(text)
    except json.JSONDecodeError as err:
        return Dropped("malformed_json", f"{err.msg} at column {err.colno}")
    except RecursionError:
        return Dropped("malformed_json", "nested too deeply")
    if not isinstance(row, dict):
        return Dropped("missing_messages", f"the line is a JSON {type(row).__name__}, not an object")
    if "messages" not in row or row["messages"] is None:
        return Dropped("missing_messages", f"no 'messages' field (keys: {sorted(row)[:8]})")
    return parse_messages(row["messages"], require_assistant=require_assistant)


def _iter_parquet(
    path: Path, start: int, end: int | None, require_assistant: bool = True
) -> Iterator[tuple[int, Messages | Dropped]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    if "messages" not in parquet.schema_arrow.names:
        raise DatasetError(
            f"Parquet dataset {path} has no 'messages' column (columns: {parquet.schema_arrow.names}); "
            "it needs list<struct<role, content>> or a JSON string per row"
        )
    group_start = 0
    for group in range(parquet.num_row_groups):
        group_rows = parquet.metadata.row_group(group).num_rows
        group_end = group_start + group_rows - 1
        if group_end >= start and (end is None or group_start <= end):
            # Only the row groups that overlap the range are read, and only the one column.
            column = parquet.read_row_group(group, columns=["messages"]).column("messages")
            first = max(start, group_start)
            last = group_end if end is None else min(end, group_end)
            values = column.slice(first - group_start, last - first + 1).to_pylist()
            for offset, value in enumerate(values):
                yield first + offset, _parse_parquet_value(value, require_assistant)
        if end is not None and group_end >= end:
            return
        group_start = group_end + 1


def _parse_parquet_value(value: Any, require_assistant: bool = True) -> Messages | Dropped:
    if value is None:
        return Dropped("missing_messages", "'messages' is null")
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as err:
            return Dropped("not_utf8", f"'messages' byte offset {err.start} is not UTF-8")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            return Dropped("malformed_json", f"'messages' string: {err.msg} at column {err.colno}")
    return parse_messages(value, require_assistant=require_assistant)


def parse_messages(messages: Any, *, require_assistant: bool = True) -> Messages | Dropped:
    """Check one conversation's message list; return it (messages copied) or why it is unusable.

    `require_assistant=False` is for conversations the target answers itself: a prompts-only row and
    an empty assistant message are fine there."""
    if not isinstance(messages, list):
        return Dropped("messages_not_a_list", f"'messages' is a {type(messages).__name__}")
    checked: Messages = []
    has_assistant = False
    for position, message in enumerate(messages):
        if not isinstance(message, dict):
            return Dropped("bad_message", f"message {position} is a {type(message).__name__}, not an object")
        role = message.get("role")
        if role not in ALLOWED_ROLES:
            return Dropped("unknown_role", f"message {position} has role {role!r}")
        content = message.get("content")
        if role == "assistant":
            if require_assistant and (content is None or (isinstance(content, str) and not content.strip())):
                return Dropped("empty_assistant", f"message {position} (assistant) has no content")
            has_assistant = True
        if content is None:
            content = ""
        if not isinstance(content, str):
            return Dropped(
                "bad_message", f"message {position} content is a {type(content).__name__}, not text"
            )
        # Parquet structs carry every field of the schema, mostly null; the template only wants real ones.
        checked.append({k: v for k, v in message.items() if v is not None} | {"content": content})
    if require_assistant and not has_assistant:
        return Dropped("no_assistant", f"roles: {[m['role'] for m in checked]}")
    return checked
