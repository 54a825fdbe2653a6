"""Reading chat-conversation datasets: JSONL (optionally gzipped) or Parquet files, one file or a dataset
repository's shards, on the local disk, on S3 or on the Hugging Face Hub.

What `DFLASH_DATASET` may name (`resolve_dataset`):
- a file: `chat.jsonl`, `chat.jsonl.gz`, `chat.parquet`, or `chat.json` holding one JSON array of records
  (read as its records, streamed: `json_array.py`) (local, `file://`, or `s3://bucket/key`);
- a directory of shards (a Hugging Face dataset repository's layout, `data/train-00000-of-00004.parquet`)
  or a glob (`data/train-*.parquet`, `**` across folders), local or under `s3://bucket/prefix/`;
- `hf://datasets/<owner>/<name>[@revision]/<path or glob>`, read through `huggingface_hub` (its token,
  cache and `HF_HUB_OFFLINE`).

Shards are read as one dataset in sorted order: a row's index is its 0-based position in that sequence
(the physical line number for JSONL), so indices never shift when rows are dropped, and a dataset that
grows by a new last shard keeps every earlier index. A directory holding several splits
(`train-…`, `test-…`) is refused: a glob chooses one.

Each row becomes a `Conversation` or `Dropped` in `layouts.py` (which holds `DROP_REASONS`), the one
place layouts are read.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from dflash_assets.conversations import json_array
from dflash_assets.conversations.errors import DatasetError, DatasetNotFound
from dflash_assets.conversations.layouts import (
    ALLOWED_ROLES,
    DROP_REASONS,
    Conversation,
    Dropped,
    Messages,
    check_dataset_format,
    conversation_from_row,
    parse_messages,
    row_layout,
)
from dflash_assets.conversations.sample_range import SampleRange

__all__ = [
    "ALLOWED_ROLES",
    "DROP_REASONS",
    "Conversation",
    "DatasetError",
    "DatasetFiles",
    "DatasetNotFound",
    "Dropped",
    "Messages",
    "count_rows",
    "iter_rows",
    "iter_rows_at",
    "parse_messages",
    "resolve_dataset",
    "row_location",
]

DATASET_SETTING = "DFLASH_DATASET"
FORMAT_SETTING = "DFLASH_DATASET_FORMAT"
# What a directory's data files end with (a glob takes whatever it matches).
SHARD_SUFFIXES = (".parquet", ".pq", ".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")
# Fields a Parquet shard's rows are read from (other columns, an image say, are never read); `exact_ids`
# is an exported row's token ids (`layouts.EXACT_IDS_FIELD`).
ROW_COLUMNS = ("messages", "conversations", "tools", "system", "exact_ids")
_SPLIT_SHARD = re.compile(r"^(?P<split>.+?)-\d{5}-of-\d{5}$")
_GLOB = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class DatasetFiles:
    """A dataset as the local files read, in order, as one: `names` are the shards as a person finds
    them (relative to the directory, prefix or repository; None for a single file)."""

    uri: str
    files: tuple[Path, ...]
    names: tuple[str, ...] | None = None

    def stamp(self) -> str:
        """Who the files are (path, size, modification time each): a cache key for their row count."""
        digest = hashlib.sha256()
        for path in self.files:
            stat = path.stat()
            digest.update(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
        return digest.hexdigest()


DatasetSource = str | Path | DatasetFiles | None


def bundled_dataset_path() -> Path:
    """The sample conversations shipped inside the package (the default dataset)."""
    return Path(str(resources.files("dflash_assets").joinpath("data", "conversations.jsonl")))


def dataset_uri(name: str, cache_dir: Path | None = None) -> str:
    """The dataset a `DFLASH_DATASET` value (or an evaluation set's reference) names: `bundled` is the
    shipped sample, `sharegpt` or `sharegpt[start:end]` the built-in ShareGPT or a slice of its rows (built
    into `cache_dir`, default `DFLASH_CACHE_DIR`, on first use: `sharegpt.py`), anything else as given."""
    from dflash_assets.conversations import sharegpt

    if name == "bundled":
        return str(bundled_dataset_path())
    if sharegpt.is_reference(name):
        if cache_dir is None:
            from dflash_assets import settings

            cache_dir = settings.cache_dir()
        # Said on stderr: a first use may be inside `plan --json`, whose stdout is the JSON alone.
        return str(sharegpt.dataset_file(name, cache_dir, log=lambda line: print(line, file=sys.stderr)))
    return name


def resolve_dataset(
    source: DatasetSource = None, *, s3: Any = None, cache_dir: Path | None = None
) -> DatasetFiles:
    """The local files of a dataset (see the module docstring): None/"" -> the bundled sample; `s3://`
    objects downloaded once per version into `cache_dir` (`s3` is an optional store.S3Settings); `hf://`
    through huggingface_hub's own cache; local paths checked to exist."""
    if isinstance(source, DatasetFiles):
        return source
    if source is None or str(source).strip() == "":
        return DatasetFiles(str(bundled_dataset_path()), (bundled_dataset_path(),))
    text = str(source).strip()
    if text.startswith("s3://"):
        return _s3_files(text, s3=s3, cache_dir=cache_dir)
    if text.startswith("hf://"):
        return _hub_files(text)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        raise DatasetError(
            f"dataset {text!r} has an unsupported scheme: set {DATASET_SETTING} to a local path, "
            "file:///path, s3://bucket/key or hf://datasets/<owner>/<name>/<path>"
        )
    return _local_files(text, uri=str(source))


def _local_files(spec: str, *, uri: str, root: Path | None = None) -> DatasetFiles:
    """A file, a directory's data files or a glob's matches; `root` is what names are relative to."""
    path = Path(spec).expanduser()
    if _GLOB.search(spec):
        base = _glob_base(path)
        matches = sorted(p for p in base.glob(str(path.relative_to(base))) if p.is_file())
        if not matches:
            raise DatasetNotFound(f"dataset {uri}: no file matches {spec}: fix {DATASET_SETTING}")
        return _shards(uri, matches, root or base)
    if path.is_file():
        return DatasetFiles(uri, (path,)) if root is None else _shards(uri, [path], root)
    if path.is_dir():
        found = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.name.lower().endswith(SHARD_SUFFIXES)
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not found:
            raise DatasetNotFound(
                f"dataset {uri}: the directory {path} holds no data file ({', '.join(SHARD_SUFFIXES)}): fix "
                f"{DATASET_SETTING}"
            )
        return _shards(uri, found, root or path)
    raise DatasetNotFound(
        f"dataset {path} does not exist or is not a file: set {DATASET_SETTING} to a JSONL or Parquet "
        "file, a directory or glob of them (local, s3://bucket/key or hf://datasets/<owner>/<name>), or "
        "unset it to use the bundled sample conversations"
    )


def _glob_base(path: Path) -> Path:
    """The folder a glob is matched under: its longest leading part without wildcards."""
    parts = []
    for part in path.parts:
        if _GLOB.search(part):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


def _shards(uri: str, files: list[Path], root: Path) -> DatasetFiles:
    names = [p.relative_to(root).as_posix() if p.is_relative_to(root) else p.name for p in files]
    _check_one_split(uri, names)
    return DatasetFiles(uri, tuple(files), tuple(names))


def _check_one_split(uri: str, names: Iterable[str]) -> None:
    """Refuse shards of several splits (`train-00000-of-00002`, `test-00000-of-00001`) read as one."""
    splits = set()
    for name in names:
        stem = name.rsplit("/", 1)[-1].split(".", 1)[0]
        match = _SPLIT_SHARD.match(stem)
        if match:
            splits.add(match["split"])
    if len(splits) > 1:
        raise DatasetError(
            f"dataset {uri} holds shards of several splits ({', '.join(sorted(splits))}): set "
            f"{DATASET_SETTING} to a glob of one, e.g. …/{sorted(splits)[-1]}-*.parquet"
        )


def _s3_files(uri: str, *, s3: Any, cache_dir: Path | None) -> DatasetFiles:
    from dflash_assets.storage.open_store import open_store

    bucket, _, key = uri[len("s3://") :].partition("/")
    if not bucket:
        raise DatasetError(
            f"dataset {uri!r} names no bucket: write s3://<bucket>/<key>; fix {DATASET_SETTING}"
        )
    if cache_dir is None:
        raise ValueError(f"dataset {uri}: an s3:// dataset needs a cache directory to download into")
    store = open_store(f"s3://{bucket}", s3)
    endpoint = getattr(store, "endpoint_url", "default")
    info = store.head(key) if key and not key.endswith("/") and not _GLOB.search(key) else None
    if info is not None:
        return DatasetFiles(uri, (_download_s3_object(store, bucket, info, cache_dir, uri),))
    wildcard = _GLOB.search(key)
    if wildcard is None:  # a folder of shards, written with or without its trailing "/"
        base = key if not key or key.endswith("/") else key + "/"
        infos = [
            i
            for i in store.list(base)
            if i.key.lower().endswith(SHARD_SUFFIXES)
            and not any(part.startswith(".") for part in i.key[len(base) :].split("/"))
        ]
    else:
        base = key[: wildcard.start()].rpartition("/")[0]
        base = base + "/" if base else ""
        pattern = _glob_regex(key)
        infos = [i for i in store.list(base) if pattern.fullmatch(i.key)]
    if not infos:
        raise DatasetNotFound(
            f"dataset {uri} does not exist (endpoint {endpoint}): fix {DATASET_SETTING} or upload the file"
        )
    names = tuple(i.key[len(base) :] for i in infos)
    _check_one_split(uri, names)
    files = tuple(_download_s3_object(store, bucket, i, cache_dir, uri) for i in infos)
    return DatasetFiles(uri, files, names)


def _download_s3_object(store: Any, bucket: str, info: Any, cache_dir: Path, uri: str) -> Path:
    from dflash_assets.storage.store import ObjectNotFound

    # The ETag is part of the cached path so a replaced object is fetched again even at equal size.
    version = "".join(ch for ch in (info.etag or "no-etag") if ch.isalnum())[:32]
    local = cache_dir / "datasets" / "s3" / bucket / version / info.key
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        return store.download(info.key, local)
    except ObjectNotFound as err:
        raise DatasetNotFound(f"dataset {uri} disappeared while downloading: {err}") from None


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """A glob over keys as `pathlib` globs paths: `*` and `?` stay within a folder, `**/` spans folders."""
    out, position = [], 0
    while position < len(pattern):
        if pattern.startswith("**/", position):
            out.append("(?:.*/)?")
            position += 3
        elif pattern.startswith("**", position):
            out.append(".*")
            position += 2
        elif pattern[position] == "*":
            out.append("[^/]*")
            position += 1
        elif pattern[position] == "?":
            out.append("[^/]")
            position += 1
        elif pattern[position] == "[" and "]" in pattern[position + 1 :]:
            close = pattern.index("]", position + 1)
            out.append("[" + pattern[position + 1 : close].replace("!", "^", 1) + "]")
            position = close + 1
        else:
            out.append(re.escape(pattern[position]))
            position += 1
    return re.compile("".join(out))


def _hub_files(uri: str) -> DatasetFiles:
    """`hf://datasets/<owner>/<name>[@revision]/<path or glob>` through huggingface_hub's cache."""
    kind, owner, name, path = ([*uri[len("hf://") :].split("/", 3), "", "", ""])[:4]
    if kind != "datasets" or not owner or not name:
        raise DatasetError(
            f"dataset {uri!r} is not a Hugging Face dataset: write hf://datasets/<owner>/<name>[@revision]/"
            f"<path or glob>; fix {DATASET_SETTING}"
        )
    name, _, revision = name.partition("@")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise DatasetError(
            f"dataset {uri} is on the Hugging Face Hub, which needs the huggingface_hub package: "
            "pip install huggingface_hub (or set DFLASH_DATASET to a local copy)"
        ) from None
    patterns = None if not path else [path] if _GLOB.search(path) else [path, path.rstrip("/") + "/*"]
    try:
        local = Path(
            snapshot_download(
                repo_id=f"{owner}/{name}",
                repo_type="dataset",
                revision=unquote(revision) or None,
                allow_patterns=patterns,
            )
        )
    except Exception as error:  # noqa: BLE001 - every hub failure means the same to the user
        first_line = (str(error).strip().splitlines() or [""])[0][:300]
        raise DatasetNotFound(
            f"dataset {uri} cannot be read from the Hugging Face Hub ({type(error).__name__}: {first_line}): "
            f"check {DATASET_SETTING}, HF_TOKEN for a private or gated dataset, and HF_HUB_OFFLINE=1 only "
            "when the files are in the cache"
        ) from None
    return _local_files(str(local / path) if path else str(local), uri=uri, root=local)


def file_format(path: Path) -> str:
    """'parquet', 'jsonl' or 'json_array' (a `.json` file whose text opens with `[`), from the file name,
    else from the Parquet magic bytes."""
    name = path.name.lower()
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".json", ".json.gz")):
        return "json_array" if json_array.is_json_array(path) else "jsonl"
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".ndjson.gz")):
        return "jsonl"
    with path.open("rb") as handle:
        return "parquet" if handle.read(4) == b"PAR1" else "jsonl"


def file_note(path: Path) -> str:
    """What a person should know about one file before its rows are used ("" for nothing): a JSON array
    that stops before its end says where, and how many records it holds. The caller shows it: the log
    line `json_array` writes for it when its records are read is not written in this process."""
    return json_array.take_note(path) if file_format(path) == "json_array" else ""


def dataset_notes(dataset: DatasetFiles) -> list[str]:
    """`file_note` of every file of the dataset that has one, in order."""
    return [note for note in (file_note(path) for path in dataset.files) if note]


_ROW_COUNTS: dict[tuple[str, int, int], int] = {}


def file_rows(path: Path) -> int:
    """Rows of one file: newlines for JSONL and footer metadata for Parquet, without parsing any; a JSON
    array's complete records, parsed once (remembered per file version, so the shards before a range are
    counted once per process)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _ROW_COUNTS:
        return _ROW_COUNTS[key]
    kind = file_format(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        count = pq.ParquetFile(path).metadata.num_rows
    elif kind == "json_array":
        count = json_array.read_end(path).records
    else:
        count, last_byte = 0, b"\n"
        with _open_binary(path) as handle:
            while chunk := handle.read(8 * 2**20):
                count += chunk.count(b"\n")
                last_byte = chunk[-1:]
        # A last line without a trailing newline is still a row (iteration yields it too).
        count += last_byte != b"\n"
    _ROW_COUNTS[key] = count
    return count


def count_rows(source: DatasetSource = None, *, s3: Any = None, cache_dir: Path | None = None) -> int:
    """Number of rows over every shard, without parsing any."""
    return sum(file_rows(path) for path in resolve_dataset(source, s3=s3, cache_dir=cache_dir).files)


def iter_rows(
    source: DatasetSource = None,
    sample_range: SampleRange | None = None,
    *,
    s3: Any = None,
    cache_dir: Path | None = None,
    require_assistant: bool = True,
    layout: str = "auto",
) -> Iterator[tuple[int, Conversation | Dropped]]:
    """Yield `(index, Conversation or Dropped)` for the rows of `sample_range` (all rows when None) that
    exist; a range running past the end of the data simply stops early. `layout` is
    `DFLASH_DATASET_FORMAT`'s value; `require_assistant`: see `layouts.conversation_from_row`.

    The dataset is resolved (and downloaded) before this returns, so a missing file fails here and
    not at the first `next()`.
    """
    check_dataset_format(layout)
    dataset = resolve_dataset(source, s3=s3, cache_dir=cache_dir)
    start = sample_range.start if sample_range else 0
    end = sample_range.end if sample_range else None
    return _iter_range(dataset, start, end, layout, require_assistant)


def _iter_range(
    dataset: DatasetFiles, start: int, end: int | None, layout: str, require_assistant: bool
) -> Iterator[tuple[int, Conversation | Dropped]]:
    offset = 0
    for number, path in enumerate(dataset.files):
        if end is not None and offset > end:
            return
        last = number == len(dataset.files) - 1
        rows = None if last else file_rows(path)  # the last shard's count is never needed
        if rows is not None and offset + rows <= start:
            offset += rows
            continue
        local_end = None if end is None else end - offset
        for local, row in _iter_file(path, max(0, start - offset), local_end, layout, require_assistant):
            yield offset + local, row
        offset += rows or 0


def iter_rows_at(
    source: DatasetSource,
    indices: Iterable[int],
    *,
    s3: Any = None,
    cache_dir: Path | None = None,
    layout: str = "auto",
    require_assistant: bool = True,
) -> Iterator[tuple[int, Conversation | Dropped]]:
    """`(index, Conversation or Dropped)` for the given row indices that exist, in ascending order, in
    one pass: only the chosen rows are parsed (JSONL) or read (Parquet: their row groups). For sampling a
    large dataset, e.g. the capacity plan's estimate. `require_assistant`: as for `iter_rows`."""
    check_dataset_format(layout)
    dataset = resolve_dataset(source, s3=s3, cache_dir=cache_dir)
    wanted = sorted(set(indices))
    if not wanted:
        return iter(())
    return _iter_rows_at(dataset, wanted, layout, require_assistant)


def _iter_rows_at(
    dataset: DatasetFiles, wanted: list[int], layout: str, require_assistant: bool
) -> Iterator[tuple[int, Conversation | Dropped]]:
    offset, position = 0, 0
    for path in dataset.files:
        rows = file_rows(path)
        here = []
        while position < len(wanted) and wanted[position] < offset + rows:
            here.append(wanted[position] - offset)
            position += 1
        if here:
            reader = {"parquet": _parquet_at, "json_array": _json_array_at}.get(file_format(path), _jsonl_at)
            for local, row in reader(path, here, layout, require_assistant):
                yield offset + local, row
        if position == len(wanted):
            return
        offset += rows


def row_location(dataset: DatasetSource, index: int) -> str:
    """How a person finds a row: 'line 8' (1-based) in JSONL, 'row 7' (0-based position) in Parquet,
    after the shard's name when the dataset has several: 'data/train-00001-of-00002.parquet row 7'."""
    files = resolve_dataset(dataset) if not isinstance(dataset, DatasetFiles) else dataset
    offset = 0
    for number, path in enumerate(files.files):
        rows = file_rows(path) if number < len(files.files) - 1 else index - offset + 1
        if index < offset + rows:
            local = index - offset
            kind = file_format(path)
            where = f"line {local + 1}" if kind == "jsonl" else f"{_ROW_WORD[kind]} {local}"
            return f"{files.names[number]} {where}" if files.names else where
        offset += rows
    return f"row {index}"


_ROW_WORD = {"parquet": "row", "json_array": "record"}  # what a 0-based position is called in a file


def _open_binary(path: Path) -> Any:
    return gzip.open(path, "rb") if path.name.lower().endswith(".gz") else path.open("rb")


def _iter_file(
    path: Path, start: int, end: int | None, layout: str, require_assistant: bool
) -> Iterator[tuple[int, Conversation | Dropped]]:
    kind = file_format(path)
    if kind == "parquet":
        return _iter_parquet(path, start, end, layout, require_assistant)
    if kind == "json_array":
        return _iter_json_array(path, start, end, layout, require_assistant)
    return _iter_jsonl(path, start, end, layout, require_assistant)


def _iter_json_array(
    path: Path, start: int, end: int | None, layout: str, require_assistant: bool
) -> Iterator[tuple[int, Conversation | Dropped]]:
    # Records before `start` are decoded too (nothing says where a record starts without reading the
    # ones before it); at about 300 MB/s that is a second for a large file, per range.
    for index, record in json_array.iter_records(path):
        if end is not None and index > end:
            return
        if index >= start:
            yield index, conversation_from_row(record, layout, require_assistant=require_assistant)


def _json_array_at(
    path: Path, wanted: list[int], layout: str, require_assistant: bool
) -> Iterator[tuple[int, Conversation | Dropped]]:
    chosen = set(wanted)
    for index, record in json_array.iter_records(path):
        if index in chosen:
            yield index, conversation_from_row(record, layout, require_assistant=require_assistant)
        if index >= wanted[-1]:
            return


def _iter_jsonl(
    path: Path, start: int, end: int | None, layout: str, require_assistant: bool
) -> Iterator[tuple[int, Conversation | Dropped]]:
    with _open_binary(path) as handle:
        # Binary lines, decoded one at a time, so one bad byte drops one row instead of the file.
        for index, raw_line in enumerate(handle):
            if index < start:
                continue
            if end is not None and index > end:
                return
            yield (
                index,
                parse_jsonl_line(
                    raw_line, first_line=index == 0, layout=layout, require_assistant=require_assistant
                ),
            )


def _jsonl_at(
    path: Path, wanted: list[int], layout: str, require_assistant: bool
) -> Iterator[tuple[int, Conversation | Dropped]]:
    chosen = set(wanted)
    with _open_binary(path) as handle:
        for index, raw_line in enumerate(handle):
            if index in chosen:
                yield (
                    index,
                    parse_jsonl_line(
                        raw_line, first_line=index == 0, layout=layout, require_assistant=require_assistant
                    ),
                )
            if index >= wanted[-1]:
                return


def parse_jsonl_line(
    raw_line: bytes, *, first_line: bool = False, layout: str = "auto", require_assistant: bool = True
) -> Conversation | Dropped:
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
    return conversation_from_row(row, layout, require_assistant=require_assistant)


def _parquet_columns(path: Path, parquet: Any, layout: str) -> list[str]:
    """The columns rows are read from; a shard without the layout's column is refused as a whole."""
    names = parquet.schema_arrow.names
    chosen = row_layout(names, layout)
    needed = {"messages": "messages", "sharegpt": "conversations"}.get(chosen or "")
    if needed is None or needed not in names:
        wanted = f"{needed!r} column" if needed else "'messages' or ShareGPT 'conversations' column"
        raise DatasetError(
            f"Parquet dataset {path} has no {wanted} (columns: {names}); it needs list<struct<role, "
            f"content>> or a JSON string per row (or set {FORMAT_SETTING} for its layout)"
        )
    return [name for name in ROW_COLUMNS if name in names]


def _iter_parquet(
    path: Path, start: int, end: int | None, layout: str, require_assistant: bool
) -> Iterator[tuple[int, Conversation | Dropped]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    columns = _parquet_columns(path, parquet, layout)
    group_start = 0
    for group in range(parquet.num_row_groups):
        group_rows = parquet.metadata.row_group(group).num_rows
        group_end = group_start + group_rows - 1
        if group_end >= start and (end is None or group_start <= end):
            # Only the row groups that overlap the range are read, and only the conversation's columns.
            table = parquet.read_row_group(group, columns=columns)
            first = max(start, group_start)
            last = group_end if end is None else min(end, group_end)
            rows = table.slice(first - group_start, last - first + 1).to_pylist()
            for offset, row in enumerate(rows):
                yield first + offset, conversation_from_row(row, layout, require_assistant=require_assistant)
        if end is not None and group_end >= end:
            return
        group_start = group_end + 1


def _parquet_at(
    path: Path, wanted: list[int], layout: str, require_assistant: bool
) -> Iterator[tuple[int, Conversation | Dropped]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    columns = _parquet_columns(path, parquet, layout)
    group_start, position = 0, 0
    for group in range(parquet.num_row_groups):
        group_end = group_start + parquet.metadata.row_group(group).num_rows - 1
        here = []
        while position < len(wanted) and wanted[position] <= group_end:
            here.append(wanted[position])
            position += 1
        if here:
            table = parquet.read_row_group(group, columns=columns)
            for index in here:
                row = table.slice(index - group_start, 1).to_pylist()[0]
                yield index, conversation_from_row(row, layout, require_assistant=require_assistant)
        if position == len(wanted):
            return
        group_start = group_end + 1
