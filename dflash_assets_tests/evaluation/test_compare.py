"""Runs side by side: the stored evaluations of a real (local) store read back in order, one marked stale
once its run is exported again, and the rows as aligned text, a markdown table or JSON."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_assets.evaluation.compare import comparison_rows, format_comparison, ordered, stored_evaluations
from dflash_assets.storage.manifest import new_manifest, write_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.support.evaluation_records import evaluation

HEADER = ["run", "set", "prompts", "τ", "floor τ", "× floor", "lossless", "drafter", "objective", "block"]


def _rows() -> list[dict]:
    held_out = evaluation(3.25, 1.5, name="held_out", run="r1")
    held_out["training"].update(parameters=12_345_678, train_seconds=95.0, distill_weight=0.5)
    code = evaluation(1.25, 2.5, name="code", run="r2")
    code["training"].update(train_seconds=5400.0)
    return comparison_rows([held_out, code])


def test_the_text_table_aligns_one_row_per_evaluation_under_its_titles():
    lines = format_comparison(_rows(), "text").splitlines()
    assert lines[0].split("  ")[0] == "run" and lines[0].startswith("run  set       prompts  τ      floor τ")
    assert lines[0].endswith("training")  # no stale row: no note column
    first, second = lines[1].split(), lines[2].split()
    assert first == ["r1", "held_out", "2", "3.250", "1.500", "2.17", "2/2", "dflash2", "dpace", "+", "KL",
                     "0.5", "4", "12.3", "M", "6", "95", "s"]  # fmt: skip
    assert second == ["r2", "code", "2", "1.250", "2.500", "0.50", "2/2", "dflash2", "dpace", "4", "?", "6",
                      "90", "min"]  # fmt: skip
    for title in ("τ", "floor τ", "lossless", "training"):  # every column starts where its title does
        column = lines[0].index(title)
        assert lines[1][column] != " " and lines[2][column] != " " and lines[1][column - 1] == " ", title


def test_the_markdown_table_has_a_header_a_rule_and_a_row_per_evaluation():
    lines = format_comparison(_rows(), "markdown").splitlines()
    assert [cell.strip() for cell in lines[0].strip("|").split("|")][: len(HEADER)] == HEADER
    assert lines[1] == "|" + "---|" * 13
    assert lines[2] == (
        "| r1 | held_out | 2 | 3.250 | 1.500 | 2.17 | 2/2 | dflash2 | dpace + KL 0.5 | 4 | 12.3 M | 6 "
        "| 95 s |"
    )
    assert lines[3].startswith("| r2 | code | 2 | 1.250 | 2.500 | 0.50 | 2/2 |") and len(lines) == 4


def test_the_json_is_the_rows_themselves():
    rows = _rows()
    assert json.loads(format_comparison(rows, "json")) == rows
    assert rows[0]["objective"] == "dpace + KL 0.5" and rows[0]["ratio"] == 3.25 / 1.5
    assert format_comparison([], "json") == "[]"
    assert format_comparison([], "text") == "no stored evaluation: materialise drafter_evaluations first"


def test_a_stale_evaluation_gets_a_note_column_that_says_so():
    rows = _rows()
    rows[1]["stale"] = True
    text = format_comparison(rows, "text").splitlines()
    assert text[0].endswith("note") and text[2].endswith("stale: exported again since")
    assert text[1].endswith("95 s")  # the current one has no note
    markdown = format_comparison(rows, "markdown").splitlines()
    assert markdown[1] == "|" + "---|" * 14 and markdown[3].endswith("| stale: exported again since |")


def _commit(store, record: dict) -> None:
    prefix = f"evaluations/{record['run']}/{record['prompt_set']}"
    body = (json.dumps(record) + "\n").encode()
    store.put_bytes(f"{prefix}/evaluation.json", body)
    write_manifest(store, prefix, new_manifest("drafter_evaluations", record["prompt_set"],
                                               {"evaluation.json": len(body)}))  # fmt: skip


def test_stored_evaluations_are_read_by_run_held_out_first_committed_only_and_stale_when_exported_again(
    tmp_path: Path,
):
    store = open_store(str(tmp_path / "store"))
    for run in ("r1", "r2"):
        store.put_bytes(f"drafter/{run}/model.safetensors", f"weights of {run}".encode())
    from dflash_assets.evaluation.runs import export_identity

    for run, name in (("r2", "chat"), ("r1", "zeta"), ("r1", "held_out"), ("r1", "code")):
        record = evaluation(2.0, 1.0, name=name, run=run)
        record["export_identity"] = export_identity(store, run)
        _commit(store, record)
    dead = evaluation(2.0, 1.0, name="died", run="r1")  # written, never committed
    store.put_bytes("evaluations/r1/died/evaluation.json", json.dumps(dead).encode())

    found = stored_evaluations(store)
    assert [(r["run"], r["prompt_set"]) for r in found] == [
        ("r1", "held_out"), ("r1", "code"), ("r1", "zeta"), ("r2", "chat"),
    ]  # fmt: skip
    assert not any(r["stale"] for r in found)
    assert [r["prompt_set"] for r in stored_evaluations(store, ["r2"])] == ["chat"]

    store.put_bytes("drafter/r2/model.safetensors", b"weights of r2, trained again")
    found = {(r["run"], r["prompt_set"]): r["stale"] for r in stored_evaluations(store)}
    assert found == {("r1", "held_out"): False, ("r1", "code"): False, ("r1", "zeta"): False,
                     ("r2", "chat"): True}  # fmt: skip
    assert stored_evaluations(store, ["nobody"]) == []


def test_runs_are_ordered_by_the_data_they_trained_on_and_say_it_in_two_columns():
    small = evaluation(1.2, 1.3, name="held_out", run="z-small")
    small["training"].update(training_conversations=250, training_answer_tokens=50_000)
    large = evaluation(1.6, 1.3, name="held_out", run="a-large")
    large["training"].update(training_conversations=4_000, training_answer_tokens=800_000)
    later = evaluation(1.5, 1.2, name="later", run="a-large")
    later["training"].update(training_conversations=4_000, training_answer_tokens=800_000)
    rows = comparison_rows([later, large, small])
    assert [(r["run"], r["prompt_set"]) for r in ordered(rows)] == [
        ("a-large", "held_out"), ("a-large", "later"), ("z-small", "held_out")]  # fmt: skip
    by_data = ordered(rows, "conversations")
    assert [(r["run"], r["prompt_set"]) for r in by_data] == [
        ("z-small", "held_out"), ("a-large", "held_out"), ("a-large", "later")]  # fmt: skip
    assert [r["run"] for r in ordered(rows, "answer_tokens")] == ["z-small", "a-large", "a-large"]
    lines = format_comparison(by_data, "markdown").splitlines()
    assert "| conversations | answer tokens |" in lines[0]
    assert "| 250 | 50,000 |" in lines[2] and "| 4,000 | 800,000 |" in lines[3]
    assert "conversations" not in format_comparison(_rows(), "markdown")  # runs that recorded no size
