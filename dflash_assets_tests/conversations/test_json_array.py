"""A `.json` file holding one JSON array, read as its records a chunk at a time: however it is laid out,
compressed or cut short, every complete record comes back, and a file that stops early says where in one
line."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import pytest

from dflash_assets.conversations import json_array
from dflash_assets.conversations.json_array import NotAJsonArray, is_json_array, iter_records, read_end

RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]},
    {"id": "b", "n": -12.5e-3, "flags": [True, False, None], "text": 'caf\u00e9 \u2603 \U0001f600 "q" \\ \n'},
    {"id": "c", "nested": {"deep": [[1, 2], {"x": 10}]}, "big": 12345678901234567890, "e": 1e21},
]


def _records(path: Path) -> list:
    return [record for _, record in iter_records(path)]


def test_a_pretty_printed_array_is_read_as_its_records_in_order(tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(RECORDS, indent=2, ensure_ascii=False), encoding="utf-8")
    assert is_json_array(path)
    assert list(iter_records(path)) == list(enumerate(RECORDS))
    end = read_end(path)
    assert end.complete and end.records == 3 and end.note == ""


def test_a_one_line_array_is_read_as_its_records(tmp_path: Path) -> None:
    path = tmp_path / "chats.json"
    path.write_text(json.dumps(RECORDS, separators=(",", ":")))
    assert _records(path) == RECORDS
    assert read_end(path).complete


def test_an_empty_array_has_no_records_and_is_complete(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text(" [ \n ] \n")
    assert _records(path) == []
    end = read_end(path)
    assert end.complete and end.records == 0 and end.note == ""


def test_a_file_that_stops_mid_record_gives_the_records_before_and_a_note_naming_the_line_and_count(
    tmp_path: Path,
) -> None:
    text = json.dumps(RECORDS, indent=2)
    third = text.index('"id": "c"')
    path = tmp_path / "cut.json"
    path.write_text(text[: third + 20])  # inside the third record
    assert _records(path) == RECORDS[:2]
    end = read_end(path)
    line_of_third = text[:third].count("\n") + 1  # the record's opening brace is on the line before its id
    assert not end.complete and end.records == 2 and end.line == line_of_third - 1
    assert end.note == (
        f"cut.json stops mid-record at line {line_of_third - 1}: 2 complete record(s) were read and the "
        "rest of the file is ignored"
    )


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_a_file_cut_at_any_character_gives_exactly_the_records_completed_before_the_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Whatever the cut falls on (a string, an escape, a number's fraction or exponent, a literal, a
    multi-byte character) and however the chunks fall, the cut is said to be one, never a malformed record."""
    monkeypatch.setattr(json_array, "CHUNK_CHARS", chunk)
    text = json.dumps(RECORDS, ensure_ascii=False)
    data = text.encode()
    ends = [len(json.dumps(RECORDS[: n + 1], ensure_ascii=False)[:-1].encode()) for n in range(len(RECORDS))]
    path = tmp_path / "cut.json"
    for cut in range(1, len(data)):
        path.write_bytes(data[:cut])
        complete = sum(end <= cut for end in ends)
        assert _records(path) == RECORDS[:complete], cut
        end = read_end(path)
        assert end.records == complete and not end.complete, cut
        assert end.why in ("stops mid-record", "stops before its closing ']'"), (cut, end.why)


def test_a_malformed_record_mid_file_ends_the_reading_there_without_reading_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(json_array, "CHUNK_CHARS", 64)
    good = json.dumps(RECORDS[0])
    path = tmp_path / "broken.json"
    # Far past the bad record, a byte that is not UTF-8: reading on to it would be said instead.
    path.write_bytes(f'[\n{good},\n{{"id": nope}},\n'.encode() + (good + ",\n").encode() * 200 + b'"\xff"]')
    assert _records(path) == [RECORDS[0]]
    end = read_end(path)
    assert (end.records, end.line, end.why) == (1, 3, "has a malformed record")
    assert "broken.json has a malformed record at line 3: 1 complete record(s) were read" in end.note


def test_a_byte_that_is_not_utf8_mid_file_ends_the_reading_with_a_note(tmp_path: Path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(b'[{"id": "a"},\n{"id": "caf\xe9"},\n{"id": "c"}]')
    assert _records(path) == [{"id": "a"}]
    end = read_end(path)
    assert (end.records, end.line, end.why) == (1, 2, "is not UTF-8")


def test_records_without_a_comma_between_them_end_the_reading_with_a_note(tmp_path: Path) -> None:
    path = tmp_path / "nocomma.json"
    path.write_text(f"[{json.dumps(RECORDS[0])}\n{json.dumps(RECORDS[1])}]")
    assert _records(path) == [RECORDS[0]]
    assert read_end(path).why == "has no ',' between two records"


def test_a_gzipped_array_reads_like_a_plain_one(tmp_path: Path) -> None:
    path = tmp_path / "chats.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(json.dumps(RECORDS, indent=1))
    assert is_json_array(path)
    assert _records(path) == RECORDS and read_end(path).complete


def test_a_byte_order_mark_and_blank_lines_before_the_array_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf\n\n  " + json.dumps(RECORDS).encode())
    assert is_json_array(path)
    assert _records(path) == RECORDS


def test_a_record_larger_than_the_chunk_is_read_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(json_array, "CHUNK_CHARS", 16)
    large = [{"id": n, "text": ("\u00e9\U0001f600 word " * 300) + str(n)} for n in range(4)]
    path = tmp_path / "large.json"
    path.write_text(json.dumps(large, ensure_ascii=False, indent=2), encoding="utf-8")
    assert _records(path) == large
    assert read_end(path).records == 4


def test_a_file_that_is_no_array_is_refused_and_jsonl_is_not_taken_for_one(tmp_path: Path) -> None:
    jsonl = tmp_path / "rows.json"
    jsonl.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    assert not is_json_array(jsonl)
    with pytest.raises(NotAJsonArray, match="rows.json is not a JSON array"):
        _records(jsonl)
    empty = tmp_path / "empty.json"
    empty.write_text("\n\n")
    assert not is_json_array(empty)


def test_a_cut_files_note_is_logged_once_when_its_records_are_read_and_never_when_a_caller_shows_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    text = json.dumps(RECORDS)
    read = tmp_path / "read.json"
    read.write_text(text[:-10])
    shown = tmp_path / "shown.json"
    shown.write_text(text[:-10])
    with caplog.at_level(logging.WARNING, logger=json_array.__name__):
        assert read_end(read).records == 2  # a question about the file logs nothing
        _records(read)
        _records(read)
        assert json_array.take_note(shown).startswith("shown.json stops mid-record")
        _records(shown)
    notes = [record.getMessage() for record in caplog.records]
    assert len(notes) == 1 and notes[0].startswith("read.json stops mid-record at line 1: 2 complete")
