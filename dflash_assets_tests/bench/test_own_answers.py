"""`scripts/own_answers.py`: ShareGPT's own answers to the kept data's questions, in the kept order (so a run
holds out the same rows), each cut to the cap; a kept question the source lacks is an error naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_assets_tests.support.scripts import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("own_answers")


def turn(question: str, answer: str, **extra) -> dict:
    return {
        **extra,
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
    }


def words(cap: int):
    def cut(text: str) -> tuple[str, int]:
        split = text.split()
        return (" ".join(split[:cap]) if len(split) > cap else text), min(len(split), cap)

    return cut


def test_the_sources_answers_come_in_the_kept_order_cut_to_the_cap(script):
    kept = [turn("b?", "target says b"), turn("a?", "target says a")]
    source = [
        turn("a?", "one two three four", id="x", source_index=0),
        turn("b?", "five six", id="y", source_index=1),
        turn("b?", "a later duplicate", id="z", source_index=2),
        turn("c?", "never asked", id="w", source_index=3),
    ]
    rows, cut_count, tokens = script.own_answers(kept, source, words(3))
    assert [row["messages"][1]["content"] for row in rows] == ["five six", "one two three"]
    assert [row["id"] for row in rows] == ["y", "x"]  # the first of duplicates
    assert [row["messages"][0]["content"] for row in rows] == ["b?", "a?"]
    assert (cut_count, tokens) == (1, 5)
    assert source[0]["messages"][1]["content"] == "one two three four"  # the source rows are not changed


def test_a_kept_question_the_source_lacks_is_named(script):
    with pytest.raises(ValueError, match=r"kept row 1: its question is not in the source \('d\?'"):
        script.own_answers([turn("a?", ""), turn("d?", "")], [turn("a?", "yes")], words(3))


def test_a_cap_under_one_is_refused_before_anything_loads(script, capsys):
    assert script.main(["--out", "/nonexistent/x.jsonl", "--cap", "0"]) == 2
    assert "--cap 0 must be 1 or more" in capsys.readouterr().err
    assert not Path("/nonexistent/x.jsonl").exists()
