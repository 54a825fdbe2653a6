"""Reading conversation datasets: row indices, every kind of bad row, Parquet, gzip and S3."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_assets.conversations.datasets import (
    DROP_REASONS,
    DatasetError,
    DatasetNotFound,
    Dropped,
    bundled_dataset_path,
    count_rows,
    iter_rows,
    resolve_dataset,
)
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.storage.open_store import open_store


def conversation(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def good_line(n: int) -> bytes:
    return json.dumps(conversation(f"What is {n} + {n}?", f"{n} + {n} = {2 * n}.")).encode() + b"\n"


def line(value: object) -> bytes:
    return json.dumps(value).encode() + b"\n"


USER, ANSWER = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "y"}

# One physical line per entry; the expected reason (None = usable) sits next to it.
MIXED_LINES: list[tuple[bytes, str | None]] = [
    (good_line(0), None),
    (b'{"messages": [{"role": "user", "content": "hi"}\n', "malformed_json"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}, ' + line(ANSWER)[:-1] + b"]}\n", "not_utf8"),
    (good_line(3), None),
    (line({"conversation": [USER]}), "missing_messages"),
    (line(["not", "an", "object"]), "missing_messages"),
    (line({"messages": "user: hi"}), "messages_not_a_list"),
    (line({"messages": [{"role": "narrator", "content": "x"}, ANSWER]}), "unknown_role"),
    (line({"messages": [{"content": "no role"}, ANSWER]}), "unknown_role"),
    (line({"messages": [USER, {"role": "assistant", "content": "  "}]}), "empty_assistant"),
    (line({"messages": [{"role": "system", "content": "s"}, USER]}), "no_assistant"),
    (b"\n", "empty_line"),
    (line({"messages": [{"role": "user", "content": [{"type": "text"}]}, ANSWER]}), "bad_message"),
    (line({"messages": ["just a string", ANSWER]}), "bad_message"),
    (good_line(14), None),
]


@pytest.fixture
def mixed_jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"".join(line for line, _ in MIXED_LINES))
    return path


def test_bundled_sample_has_hundreds_of_varied_valid_conversations() -> None:
    path = bundled_dataset_path()
    assert path.is_file() and path.stat().st_size < 2**20
    rows = list(iter_rows(None))
    assert count_rows(None) == len(rows) >= 300
    assert all(not isinstance(messages, Dropped) for _, messages in rows)
    conversations = [messages for _, messages in rows]
    assert sum(sum(m["role"] == "user" for m in c) >= 2 for c in conversations) >= 60
    assert sum(c[0]["role"] == "system" for c in conversations) >= 20
    assert len({c[-1]["content"] for c in conversations}) > 0.8 * len(conversations)  # not copies


def test_every_bad_row_is_dropped_with_its_reason_and_keeps_its_line_index(mixed_jsonl: Path) -> None:
    rows = list(iter_rows(mixed_jsonl))
    assert [index for index, _ in rows] == list(range(len(MIXED_LINES)))
    for (index, outcome), (_, expected) in zip(rows, MIXED_LINES, strict=True):
        if expected is None:
            assert isinstance(outcome, list), f"line {index + 1}: {outcome}"
        else:
            assert isinstance(outcome, Dropped) and outcome.reason == expected, f"line {index + 1}: {outcome}"
    assert {expected for _, expected in MIXED_LINES if expected} <= set(DROP_REASONS)
    assert rows[14][1][1]["content"] == "14 + 14 = 28."


def test_drop_details_say_what_was_wrong(mixed_jsonl: Path) -> None:
    rows = dict(iter_rows(mixed_jsonl))
    assert "0xe9" in rows[2].detail
    assert "narrator" in rows[7].detail
    assert "column" in rows[1].detail


def test_a_sample_range_yields_only_its_rows_and_stops_at_the_end_of_the_data(mixed_jsonl: Path) -> None:
    assert [index for index, _ in iter_rows(mixed_jsonl, SampleRange(3, 5))] == [3, 4, 5]
    assert [index for index, _ in iter_rows(mixed_jsonl, SampleRange(10, 99))] == [10, 11, 12, 13, 14]
    assert list(iter_rows(mixed_jsonl, SampleRange(100, 199))) == []


def test_row_count_matches_iteration_including_blank_lines_and_a_missing_final_newline(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_bytes(good_line(0) + b"\n" + good_line(2) + good_line(3).rstrip(b"\n"))
    assert count_rows(path) == 4 == len(list(iter_rows(path)))
    path.write_bytes(b"")
    assert count_rows(path) == 0 == len(list(iter_rows(path)))


def test_crlf_line_endings_and_a_byte_order_mark_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "windows.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf" + good_line(1).replace(b"\n", b"\r\n") + good_line(2).replace(b"\n", b"\r\n")
    )
    rows = list(iter_rows(path))
    assert [isinstance(outcome, list) for _, outcome in rows] == [True, True]


def test_gzipped_jsonl_reads_like_plain_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(good_line(0) + b"not json\n" + good_line(2)))
    assert count_rows(path) == 3
    assert [getattr(outcome, "reason", "ok") for _, outcome in iter_rows(path)] == [
        "ok",
        "malformed_json",
        "ok",
    ]


def test_parquet_with_struct_messages_reads_by_row_position_across_row_groups(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    messages = [conversation(f"q{i}", f"a{i}")["messages"] for i in range(10)]
    messages[4] = None
    messages[6] = [{"role": "user", "content": "only a question"}]
    pq.write_table(pa.table({"messages": messages, "id": list(range(10))}), path, row_group_size=3)
    assert count_rows(path) == 10
    rows = dict(iter_rows(path, SampleRange(2, 7)))
    assert sorted(rows) == [2, 3, 4, 5, 6, 7]
    assert rows[5] == [{"role": "user", "content": "q5"}, {"role": "assistant", "content": "a5"}]
    assert rows[4].reason == "missing_messages"
    assert rows[6].reason == "no_assistant"


def test_parquet_with_json_string_messages_is_parsed_per_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    values = [json.dumps(conversation("q", "a")["messages"]), "[{broken", json.dumps({"role": "user"})]
    pq.write_table(pa.table({"messages": values}), path)
    rows = dict(iter_rows(path))
    assert rows[0][1]["content"] == "a"
    assert rows[1].reason == "malformed_json"
    assert rows[2].reason == "messages_not_a_list"


def test_parquet_without_a_messages_column_is_rejected_naming_the_columns(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"conversation": ["x"]}), path)
    with pytest.raises(DatasetError, match=r"no 'messages' column.*conversation"):
        list(iter_rows(path))


def test_a_missing_dataset_fails_before_any_row_is_read_naming_the_path_and_setting(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetNotFound, match=r"nope\.jsonl.*DFLASH_DATASET"):
        iter_rows(missing)  # no next(): the generator must not defer the check
    with pytest.raises(DatasetNotFound, match="DFLASH_DATASET"):
        count_rows(str(missing))
    with pytest.raises(DatasetError, match="unsupported scheme"):
        resolve_dataset("http://example.com/data.jsonl")


def test_an_s3_dataset_is_downloaded_once_into_the_cache(s3_store_url: str, tmp_path: Path) -> None:
    store = open_store(s3_store_url)
    store.put_bytes("datasets/chat.jsonl", good_line(0) + b"{oops\n" + good_line(2))
    uri = store.uri("datasets/chat.jsonl")
    cache = tmp_path / "cache"

    assert count_rows(uri, cache_dir=cache) == 3
    local = resolve_dataset(uri, cache_dir=cache)
    assert local.is_file() and cache in local.parents
    first_download = local.stat().st_mtime_ns
    rows = list(iter_rows(uri, SampleRange(1, 2), cache_dir=cache))
    assert [(i, getattr(r, "reason", "ok")) for i, r in rows] == [(1, "malformed_json"), (2, "ok")]
    assert local.stat().st_mtime_ns == first_download

    # A replaced object (new ETag) is fetched again rather than served stale from the cache.
    store.put_bytes("datasets/chat.jsonl", good_line(5))
    assert count_rows(uri, cache_dir=cache) == 1

    with pytest.raises(DatasetNotFound, match=r"missing\.jsonl.*DFLASH_DATASET"):
        count_rows(store.uri("datasets/missing.jsonl"), cache_dir=cache)
