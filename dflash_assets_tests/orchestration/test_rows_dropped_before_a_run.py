"""Rows that would be dropped are said before anything runs: `dflash-assets ranges` reads rows spread over
the dataset and `dflash-assets plan` the rows it tokenizes, and each says how many would be dropped, by
reason, where the first ones are and what is wrong with them, and where a JSON array file stops short. A
dataset whose every sampled row would be dropped registers no range. In process: the commands read the
environment when they start."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from pathlib import Path

import pytest

from dflash_assets import cli
from dflash_assets.orchestration.partitions import PARTITIONS_NAME
from dflash_assets.settings import ALL_SETTINGS
from dflash_assets_tests.conftest import make_dagster_home, open_instance


def _record(n: int) -> dict:
    return {"id": f"r{n}", "conversations": [{"from": "human", "value": f"What is {n} + {n}?"},
                                             {"from": "gpt", "value": f"{2 * n}."}]}  # fmt: skip


def _cut_array(path: Path) -> Path:
    """Forty ShareGPT-style records, three of them unusable, then a forty-first cut mid-record."""
    records = [_record(n) for n in range(40)]
    records[7]["conversations"][1]["from"] = "wizard"
    records[19]["conversations"][0]["from"] = "narrator"
    records[30]["conversations"].pop()  # a question nobody answered
    text = json.dumps([*records, _record(40)], indent=2)
    path.write_text(text[: text.rindex('"gpt"')])
    return path


DROPPED = (
    "3 of 40 {rows} would be dropped (unknown_role 2, no_assistant 1): record 7: unknown_role: turn 1 is "
    "from 'wizard'; record 19: unknown_role: turn 0 is from 'narrator'; record 30: no_assistant: roles: "
    "['user']"
)


@pytest.fixture
def user_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No DFLASH_* setting from outside, a private DFLASH_HOME and DAGSTER_HOME; returns the DAGSTER_HOME."""
    for setting in ALL_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    home = make_dagster_home(tmp_path / "dagster-home")
    monkeypatch.setenv("DAGSTER_HOME", home)
    return Path(home)


def _registered(dagster_home: Path) -> list[str]:
    with open_instance(dagster_home) as instance:
        return list(instance.get_dynamic_partitions(PARTITIONS_NAME))


def test_ranges_says_which_sampled_rows_would_be_dropped_and_where_the_file_stops_then_registers(
    user_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, caplog
):
    monkeypatch.setenv("DFLASH_DATASET", str(_cut_array(tmp_path / "chats.json")))
    monkeypatch.setenv("DFLASH_SAMPLES_PER_PARTITION", "10")
    with caplog.at_level(logging.WARNING):
        assert cli.main(["ranges"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"WARNING: chats.json stops mid-record at line {_cut_line(tmp_path / 'chats.json')}: 40 complete "
        "record(s) were read and the rest of the file is ignored",
        "WARNING: " + DROPPED.format(rows="sampled rows"),
    ]
    assert not caplog.records  # the note is said once, by the command, not again by the reader's log
    assert out == "4 sample ranges cover the dataset (00000000-00000009 .. 00000030-00000039); 4 new\n"
    assert _registered(user_env) == ["00000000-00000009", "00000010-00000019", "00000020-00000029",
                                     "00000030-00000039"]  # fmt: skip


def _cut_line(path: Path) -> int:
    """The line the forty-first record opens on: where the file stops being records."""
    text = path.read_text()
    return text[: text.rindex('"id": "r40"')].count("\n")


def test_ranges_registers_nothing_when_every_sampled_row_would_be_dropped(
    user_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
):
    # A JSON array read line by line, as ShareGPT's file was before arrays were read: no line is a row.
    dataset = tmp_path / "sharegpt.jsonl"
    dataset.write_text(json.dumps([_record(n) for n in range(300)], indent=2))
    monkeypatch.setenv("DFLASH_DATASET", str(dataset))
    assert cli.main(["ranges"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(
        f"dflash-assets ranges: every one of the 200 rows sampled from {dataset} would be dropped "
        "(malformed_json 200): line 1: malformed_json: Expecting value at column 2; line "
    )
    assert err.rstrip().endswith("Nothing was registered: check DFLASH_DATASET and DFLASH_DATASET_FORMAT")
    assert _registered(user_env) == []


def test_plan_warns_of_the_rows_it_tokenized_that_would_be_dropped_and_of_a_cut_file(
    user_env: Path, tmp_path: Path, demo_model_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(demo_model_dir.parent))
    monkeypatch.setenv("DFLASH_DATASET", str(_cut_array(tmp_path / "chats.json")))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["plan", "--json"]) == 0
    plan = json.loads(printed.getvalue())  # whatever was said on the way, stdout is the JSON alone
    assert plan["rows"] == 40 and plan["samples"] == 37
    assert plan["warnings"][:2] == [
        f"chats.json stops mid-record at line {_cut_line(tmp_path / 'chats.json')}: 40 complete record(s) "
        "were read and the rest of the file is ignored",
        DROPPED.format(rows="rows"),  # every row tokenized, none left to sample
    ]

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["plan", "--sample-rows", "20"]) == 0
    warnings = [line for line in printed.getvalue().splitlines() if line.startswith("WARNING: ")]
    assert warnings[0].startswith("WARNING: chats.json stops mid-record at line ")
    # The plan's random sample of 20 (seed 0) holds records 19 and 30 of the three.
    assert warnings[1] == (
        "WARNING: 2 of 20 sampled rows would be dropped (no_assistant 1, unknown_role 1): record 19: "
        "unknown_role: turn 0 is from 'narrator'; record 30: no_assistant: roles: ['user']"
    )
