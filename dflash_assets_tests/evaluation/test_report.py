"""An evaluation as stored and judged: the check passes when the drafter's τ is at least the floor's, and
says so in one line naming the set and both figures; a set where nothing was measured never passes."""

from __future__ import annotations

from dflash_assets.evaluation.report import above_floor, check_description, markdown_table, summary_line
from dflash_assets_tests.support.evaluation_records import evaluation


def test_the_check_passes_when_the_drafter_is_at_least_the_floor_and_says_so_with_both_figures():
    above = evaluation(3.25, 1.5)
    assert above_floor(above)
    assert check_description(above) == (
        "chat: the drafter's τ 3.250 is at least the prompt-lookup floor's τ 1.500 (2.17x) on 2 prompts, "
        "64 new tokens each (run r1)"
    )
    assert above_floor(evaluation(1.5, 1.5))  # equal is enough: the floor is cleared, not beaten


def test_a_drafter_below_the_floor_fails_the_check_with_a_description_that_says_below():
    below = evaluation(1.25, 2.5, name="code")
    assert not above_floor(below)
    description = check_description(below)
    assert description.startswith("code: the drafter's τ 1.250 is BELOW the prompt-lookup floor's τ 2.500")
    assert "(0.50x)" in description


def test_a_set_where_no_round_was_decoded_never_passes_and_says_not_measured():
    for tau, floor in ((None, 1.5), (2.0, None), (None, None)):
        record = evaluation(tau, floor)
        assert not above_floor(record)
        assert check_description(record).startswith("chat: not measured")
        assert summary_line(record) == "chat: not measured"


def test_the_record_holds_what_was_measured_on_what_and_the_summary_line_shows_it():
    record = evaluation(3.25, 1.5)
    assert record["prompts"] == 2 and record["prompt_locations"] == ["line 1", "line 2"]
    assert record["prompt_tokens"] == [2, 1]
    assert (record["tau"], record["floor_tau"], record["lossless_prompts"]) == (3.25, 1.5, 2)
    assert record["training"]["drafter_arch"] == "dflash2" and record["training"]["train_seconds"] is None
    assert (
        summary_line(record) == "chat: τ 3.250 against the prompt-lookup floor's 1.500 (2.17x), 2/2 lossless"
    )


def test_the_assets_table_shows_the_drafter_beside_the_floor_and_names_each_mismatch_and_skipped_rows():
    record = evaluation(3.25, 1.5)
    record["drafter"]["mismatched"] = [{"prompt": "line 2", "first_difference": 5}]
    record["rows_skipped"] = {"too_long": 2, "no_prompt": 1}
    lines = markdown_table(record).splitlines()
    assert lines[0] == "Prompt set `chat` (`chats.jsonl`): 2 prompts, 64 new tokens each; run `r1`."
    assert "| trained | 3.250 | 2.17 | 2/2 | 10 | 0.90 / 0.50 / — / — |" in lines  # a block of 4: 3 drafts
    assert "| prompt lookup (floor) | 1.500 | 1.00 | 2/2 | 10 | 0.90 / 0.50 / — / — |" in lines
    assert "- the drafter's output differs from the target's greedy output on line 2 from token 5" in lines
    assert lines[-1] == "Rows skipped while collecting prompts: no_prompt 1, too_long 2."
