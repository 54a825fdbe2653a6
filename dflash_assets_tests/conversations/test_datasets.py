"""Reading conversation datasets: row indices, every kind of bad row, Parquet, gzip, shards of a
dataset repository (a directory, a glob, an S3 prefix, the Hugging Face Hub) and S3."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_assets.conversations.datasets import (
    DROP_REASONS,
    Conversation,
    DatasetError,
    DatasetNotFound,
    Dropped,
    bundled_dataset_path,
    count_rows,
    file_note,
    iter_rows,
    iter_rows_at,
    resolve_dataset,
    row_location,
)
from dflash_assets.conversations.drops import AllRowsDropped, sample_rows
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
    (line({"conversation": [USER]}), "unknown_layout"),
    (line(["not", "an", "object"]), "unknown_layout"),
    (line({"messages": "user: hi"}), "messages_not_a_list"),
    (line({"messages": [{"role": "narrator", "content": "x"}, ANSWER]}), "unknown_role"),
    (line({"messages": [{"content": "no role"}, ANSWER]}), "unknown_role"),
    (line({"messages": [USER, {"role": "assistant", "content": "  "}]}), "empty_assistant"),
    (line({"messages": [{"role": "system", "content": "s"}, USER]}), "no_assistant"),
    (b"\n", "empty_line"),
    (line({"messages": [{"role": "user", "content": [{"type": "text"}]}, ANSWER]}), "bad_message"),
    (line({"messages": [{"role": "user", "content": [{"type": "image_url"}]}, ANSWER]}), "non_text_content"),
    (line({"messages": [USER, {"role": "assistant", "tool_calls": [{"function": {}}]}]}), "bad_tool_call"),
    (line({"messages": [USER, ANSWER], "tools": {"name": "f"}}), "bad_tools"),
    (line({"conversations": [{"from": "narrator", "value": "x"}]}), "unknown_role"),
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
    conversations = [row.messages for _, row in rows]
    assert sum(sum(m["role"] == "user" for m in c) >= 2 for c in conversations) >= 60
    assert sum(c[0]["role"] == "system" for c in conversations) >= 20
    assert len({c[-1]["content"] for c in conversations}) > 0.8 * len(conversations)  # not copies


def test_every_bad_row_is_dropped_with_its_reason_and_keeps_its_line_index(mixed_jsonl: Path) -> None:
    rows = list(iter_rows(mixed_jsonl))
    assert [index for index, _ in rows] == list(range(len(MIXED_LINES)))
    for (index, outcome), (_, expected) in zip(rows, MIXED_LINES, strict=True):
        if expected is None:
            assert isinstance(outcome, Conversation), f"line {index + 1}: {outcome}"
        else:
            assert isinstance(outcome, Dropped) and outcome.reason == expected, f"line {index + 1}: {outcome}"
    assert {expected for _, expected in MIXED_LINES if expected} <= set(DROP_REASONS)
    assert rows[-1][1].messages[1]["content"] == "14 + 14 = 28."


def test_drop_details_say_what_was_wrong(mixed_jsonl: Path) -> None:
    rows = dict(iter_rows(mixed_jsonl))
    assert "0xe9" in rows[2].detail
    assert "narrator" in rows[7].detail
    assert "column" in rows[1].detail
    assert "['conversation']" in rows[4].detail  # an unknown layout names the fields the row has
    assert "'image_url' part" in rows[13].detail


def test_a_sample_range_yields_only_its_rows_and_stops_at_the_end_of_the_data(mixed_jsonl: Path) -> None:
    assert [index for index, _ in iter_rows(mixed_jsonl, SampleRange(3, 5))] == [3, 4, 5]
    assert [index for index, _ in iter_rows(mixed_jsonl, SampleRange(14, 99))] == [14, 15, 16, 17, 18]
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
    assert [isinstance(outcome, Conversation) for _, outcome in rows] == [True, True]


def test_gzipped_jsonl_reads_like_plain_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(gzip.compress(good_line(0) + b"not json\n" + good_line(2)))
    assert count_rows(path) == 3
    assert [getattr(outcome, "reason", "ok") for _, outcome in iter_rows(path)] == [
        "ok",
        "malformed_json",
        "ok",
    ]


# A JSON array of records as ShareGPT-style datasets ship it: record 2 is a bing answer (read as the
# assistant), record 4 has a speaker nobody knows, record 5 asks and is never answered.
ARRAY_RECORDS = [
    {"id": f"r{n}", "conversations": [{"from": "human", "value": f"q{n}"}, {"from": "gpt", "value": f"a{n}"}]}
    for n in range(7)
]
ARRAY_RECORDS[2]["conversations"][1]["from"] = "bing"
ARRAY_RECORDS[4]["conversations"][0]["from"] = "narrator"
ARRAY_RECORDS[5]["conversations"].pop()


@pytest.fixture
def array_json(tmp_path: Path) -> Path:
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(ARRAY_RECORDS, indent=2))
    return path


def test_a_json_array_file_is_read_as_its_records_in_every_way_rows_are_read(array_json: Path) -> None:
    assert count_rows(array_json) == 7
    rows = dict(iter_rows(array_json))
    assert [getattr(rows[i], "reason", "ok") for i in range(7)] == ["ok"] * 4 + [
        "unknown_role",
        "no_assistant",
        "ok",
    ]
    assert rows[2].messages == [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    assert "turn 0 is from 'narrator'" in rows[4].detail
    assert [i for i, _ in iter_rows(array_json, SampleRange(3, 5))] == [3, 4, 5]
    assert [i for i, _ in iter_rows(array_json, SampleRange(5, 99))] == [5, 6]
    assert [(i, getattr(r, "reason", "ok")) for i, r in iter_rows_at(array_json, [6, 4, 1])] == [
        (1, "ok"),
        (4, "unknown_role"),
        (6, "ok"),
    ]
    assert [i for i, _ in iter_rows_at(array_json, [5, 99])] == [5]
    assert row_location(array_json, 4) == "record 4"  # a 0-based position, as the array's records are
    assert file_note(array_json) == ""


def test_a_cut_json_array_gives_its_complete_records_and_a_note_saying_where_it_stops(tmp_path: Path) -> None:
    text = json.dumps(ARRAY_RECORDS, indent=2)
    path = tmp_path / "cut.json.gz"
    path.write_bytes(gzip.compress(text[: text.index('"r3"') + 30].encode()))
    assert count_rows(path) == 3 == len(list(iter_rows(path)))
    assert file_note(path).startswith("cut.json.gz stops mid-record at line ")
    assert file_note(path).endswith(": 3 complete record(s) were read and the rest of the file is ignored")


def test_a_json_file_holding_json_lines_is_still_read_line_by_line(tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    path.write_bytes(good_line(0) + b"{oops\n" + good_line(2))
    assert count_rows(path) == 3
    assert [getattr(row, "reason", "ok") for _, row in iter_rows(path)] == ["ok", "malformed_json", "ok"]
    assert row_location(path, 1) == "line 2" and file_note(path) == ""


def test_rows_sampled_over_a_dataset_say_which_would_be_dropped_and_where(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    bad = {111, 500, 999}  # ten rows spread over a thousand are rows 0, 111, 222, ..., 999: 500 is not one
    path.write_bytes(b"".join(b"{oops\n" if n in bad else good_line(n) for n in range(1000)))
    sample = sample_rows(resolve_dataset(path), 1000, 10)
    assert sample.rows == 10 and sample.dropped == 2
    assert sample.line() == (
        "2 of 10 sampled rows would be dropped (malformed_json 2): line 112: malformed_json: Expecting "
        "property name enclosed in double quotes at column 2; line 1000: malformed_json: Expecting property "
        "name enclosed in double quotes at column 2"
    )
    sample.check_not_all_dropped("advice")  # some rows are read: nothing is refused
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b"{oops\n" * 50)
    every = sample_rows(resolve_dataset(broken), 50, 200)
    with pytest.raises(
        AllRowsDropped,
        match=r"every one of the 50 rows sampled from .*broken.jsonl would be dropped \(malformed_json 50\): "
        r"line 1: .*; line 5: [^;]*\. Fix it$",
    ):
        every.check_not_all_dropped("Fix it")


def test_parquet_with_struct_messages_reads_by_row_position_across_row_groups(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    messages = [conversation(f"q{i}", f"a{i}")["messages"] for i in range(10)]
    messages[4] = None
    messages[6] = [{"role": "user", "content": "only a question"}]
    pq.write_table(pa.table({"messages": messages, "id": list(range(10))}), path, row_group_size=3)
    assert count_rows(path) == 10
    rows = dict(iter_rows(path, SampleRange(2, 7)))
    assert sorted(rows) == [2, 3, 4, 5, 6, 7]
    assert rows[5].messages == [{"role": "user", "content": "q5"}, {"role": "assistant", "content": "a5"}]
    assert rows[4].reason == "missing_messages"
    assert rows[6].reason == "no_assistant"


def test_parquet_with_json_string_messages_is_parsed_per_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    values = [json.dumps(conversation("q", "a")["messages"]), "[{broken", json.dumps({"role": "user"})]
    pq.write_table(pa.table({"messages": values}), path)
    rows = dict(iter_rows(path))
    assert rows[0].messages[1]["content"] == "a"
    assert rows[1].reason == "malformed_json"
    assert rows[2].reason == "messages_not_a_list"


def test_parquet_without_a_messages_column_is_rejected_naming_the_columns(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"conversation": ["x"]}), path)
    with pytest.raises(DatasetError, match=r"no 'messages' or ShareGPT 'conversations' column.*conversation"):
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
    (local,) = resolve_dataset(uri, cache_dir=cache).files
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


# --- datasets of several shards ---------------------------------------------------------------------------


def shard_rows(first: int, count: int) -> list[str]:
    return [json.dumps(conversation(f"q{n}", f"a{n}")["messages"]) for n in range(first, first + count)]


def write_repository(root: Path) -> Path:
    """A dataset repository's layout: two Parquet shards of train (row groups of 2), a JSONL.gz shard of
    validation, and files that are no data."""
    (root / "data").mkdir(parents=True)
    pq.write_table(
        pa.table({"messages": shard_rows(0, 5)}), root / "data/train-00000-of-00002.parquet", row_group_size=2
    )
    pq.write_table(
        pa.table({"messages": shard_rows(5, 3)}), root / "data/train-00001-of-00002.parquet", row_group_size=2
    )
    (root / "data/validation-00000-of-00001.jsonl.gz").write_bytes(
        gzip.compress(good_line(100) + good_line(101))
    )
    (root / "README.md").write_text("# a dataset card\n")
    (root / ".cache").mkdir()
    (root / ".cache/stale.jsonl").write_bytes(good_line(999))
    return root


def questions(rows) -> list[tuple[int, str]]:
    return [(index, row.messages[0]["content"]) for index, row in rows]


def test_a_glob_of_shards_is_one_dataset_in_sorted_order_with_global_row_indices(tmp_path: Path) -> None:
    root = write_repository(tmp_path / "repo")
    train = str(root / "data/train-*.parquet")
    assert count_rows(train) == 8
    assert questions(iter_rows(train)) == [(n, f"q{n}") for n in range(8)]
    # A range across the shard boundary, and rows chosen anywhere, keep the same indices.
    assert questions(iter_rows(train, SampleRange(3, 6))) == [(3, "q3"), (4, "q4"), (5, "q5"), (6, "q6")]
    assert questions(iter_rows_at(train, [7, 0, 5])) == [(0, "q0"), (5, "q5"), (7, "q7")]
    assert row_location(train, 6) == "train-00001-of-00002.parquet row 1"


def test_a_directory_of_one_split_reads_every_data_file_and_skips_the_rest(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    (root / "data/part-0.jsonl").write_bytes(good_line(0) + b"{oops\n")
    (root / "data/part-1.jsonl.gz").write_bytes(gzip.compress(good_line(2)))
    pq.write_table(pa.table({"messages": shard_rows(3, 2)}), root / "data/part-2.parquet")
    (root / "README.md").write_text("# card\n")
    (root / ".cache").mkdir()
    (root / ".cache/stale.jsonl").write_bytes(good_line(999))

    rows = list(iter_rows(root))
    assert [(i, getattr(r, "reason", "ok")) for i, r in rows] == [
        (0, "ok"),
        (1, "malformed_json"),
        (2, "ok"),
        (3, "ok"),
        (4, "ok"),
    ]
    assert count_rows(root) == 5 and resolve_dataset(root).names == (
        "data/part-0.jsonl", "data/part-1.jsonl.gz", "data/part-2.parquet",
    )  # fmt: skip
    assert row_location(root, 1) == "data/part-0.jsonl line 2"


def test_a_directory_holding_several_splits_is_refused_naming_them(tmp_path: Path) -> None:
    root = write_repository(tmp_path / "repo")
    with pytest.raises(DatasetError, match=r"several splits \(train, validation\).*glob"):
        count_rows(root)


def test_a_dataset_grown_by_a_new_last_shard_keeps_every_earlier_index(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    root.mkdir()
    (root / "part-0.jsonl").write_bytes(good_line(0) + good_line(1))
    before = questions(iter_rows(root))
    (root / "part-1.jsonl").write_bytes(good_line(2))
    assert questions(iter_rows(root))[: len(before)] == before and count_rows(root) == 3


def test_s3_shards_under_a_prefix_or_a_glob_are_read_as_one_dataset(
    s3_store_url: str, tmp_path: Path
) -> None:
    store = open_store(s3_store_url)
    repo = write_repository(tmp_path / "repo")
    for path in repo.rglob("*"):
        if path.is_file():
            store.put_bytes(f"chats/{path.relative_to(repo).as_posix()}", path.read_bytes())
    cache = tmp_path / "cache"
    train = store.uri("chats/data/train-*.parquet")
    assert questions(iter_rows(train, SampleRange(4, 5), cache_dir=cache)) == [(4, "q4"), (5, "q5")]
    assert resolve_dataset(train, cache_dir=cache).names == (
        "train-00000-of-00002.parquet", "train-00001-of-00002.parquet",
    )  # fmt: skip
    with pytest.raises(DatasetError, match="several splits"):
        count_rows(store.uri("chats/data/"), cache_dir=cache)
    store.delete("chats/data/validation-00000-of-00001.jsonl.gz")
    assert count_rows(store.uri("chats/data"), cache_dir=cache) == 8  # a folder, with or without its "/"


@pytest.fixture
def hub(tmp_path: Path):
    """A dataset repository on a loopback Hub, at two revisions (`main`, tag `v1`)."""
    from dflash_assets_tests.support.hub_server import HubServer

    served = HubServer(
        "someone/chats", write_repository(tmp_path / "repo"), {"main": "a" * 40, "v1": "b" * 40}
    )
    yield served.start()
    served.stop()


def read_hub(hub, tmp_path: Path, code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` run in a fresh process as a user's would (huggingface_hub reads HF_* when imported), the
    Hub at HF_ENDPOINT, its own cache; prints what it read as JSON."""
    environment = {
        **os.environ,
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_CACHE": str(tmp_path / "hf-cache"),
        "HF_TOKEN": "hf_loopback_token",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        **env,
    }
    if "HF_HUB_OFFLINE" not in env:
        environment.pop("HF_HUB_OFFLINE", None)
    script = "import json\nfrom dflash_assets.conversations.datasets import *\n" + code
    return subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120
    )


def test_a_hugging_face_dataset_is_read_through_huggingface_hub_with_its_token_then_offline(
    hub, tmp_path
) -> None:
    uri = "hf://datasets/someone/chats@v1/data/train-*.parquet"
    read = (
        f"files = resolve_dataset({uri!r})\n"
        "rows = [(i, r.messages[0]['content']) for i, r in iter_rows(files)]\n"
        "print(json.dumps({'rows': rows, 'names': files.names, 'count': count_rows(files)}))"
    )
    online = read_hub(hub, tmp_path, read)
    assert online.returncode == 0, online.stderr[-2000:]
    got = json.loads(online.stdout.splitlines()[-1])
    assert got["rows"] == [[n, f"q{n}"] for n in range(8)] and got["count"] == 8
    assert got["names"] == ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]
    downloads = sorted(path for method, path, _ in hub.requests if method == "GET" and "/resolve/" in path)
    commit = "b" * 40  # the tag's commit: only the shards the glob names are downloaded
    assert downloads == [
        f"/datasets/someone/chats/resolve/{commit}/data/train-0000{i}-of-00002.parquet" for i in range(2)
    ]
    assert {auth for _, path, auth in hub.requests if "someone/chats" in path} == {"Bearer hf_loopback_token"}

    # Offline, the same dataset comes from huggingface_hub's cache without a request.
    seen = len(hub.requests)
    offline = read_hub(hub, tmp_path, read, HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr[-2000:]
    assert json.loads(offline.stdout.splitlines()[-1]) == got and len(hub.requests) == seen
    missing = read_hub(hub, tmp_path, "count_rows('hf://datasets/someone/chats@v2/data')", HF_HUB_OFFLINE="1")
    assert missing.returncode == 1
    assert "DatasetNotFound: dataset hf://datasets/someone/chats@v2/data cannot be read" in missing.stderr
    assert "HF_HUB_OFFLINE" in missing.stderr and "hf_loopback_token" not in missing.stderr


def test_a_missing_hugging_face_dataset_or_library_fails_with_one_clear_line(hub, tmp_path) -> None:
    other = read_hub(hub, tmp_path, "count_rows('hf://datasets/someone/other/data')")
    assert "DatasetNotFound: dataset hf://datasets/someone/other/data cannot be read" in other.stderr
    assert "HF_TOKEN" in other.stderr and "hf_loopback_token" not in other.stderr
    with pytest.raises(DatasetError, match=r"hf://datasets/<owner>/<name>"):
        count_rows("hf://someone/chats")
    without = read_hub(
        hub,
        tmp_path,
        "import sys; sys.modules['huggingface_hub'] = None\ncount_rows('hf://datasets/someone/chats/data')",
    )
    assert "needs the huggingface_hub package: pip install huggingface_hub" in without.stderr
