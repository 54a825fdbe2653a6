"""Regenerating a range: every turn answered in order against the regenerated history (up to the token
budget), each row stored once in `completions.jsonl`, and a rerun after any failure asking only for what
was not finished."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_assets.conversations.datasets import Dropped
from dflash_assets.conversations.tokenize import TooManyBadRows
from dflash_assets.generation.engine import EngineUnavailable
from dflash_assets.generation.records import CompletionRecord, DroppedRow, parse_line
from dflash_assets.generation.regenerate import (
    _same_answers,
    completions_fingerprint,
    dataset_identity,
    regenerate_range,
)
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.storage.layout import COMPLETIONS_NAME
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.manifest import new_manifest, write_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.uploader import Uploader
from dflash_assets_tests.support.engines import ScriptedEngine, never_opened, scripted_content
from dflash_assets_tests.support.stores import WatchedStore

PREFIX = "target-completions/00000000-00000099"
SETTINGS = GenerationSettings(max_new_tokens=16)
FINGERPRINT = completions_fingerprint("tiny@0123", SETTINGS)


def conversation(index: int, q: str = "q") -> list[dict]:
    """Three shapes in turn: two answered turns after a system prompt, a prompt only, an empty answer."""
    if index % 3 == 0:
        return [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"{q}{index}a"},
            {"role": "assistant", "content": "the dataset's first answer"},
            {"role": "user", "content": f"{q}{index}b"},
            {"role": "assistant", "content": "the dataset's second answer"},
        ]
    if index % 3 == 1:
        return [{"role": "user", "content": f"{q}{index}"}]
    return [{"role": "user", "content": f"{q}{index}"}, {"role": "assistant", "content": ""}]


def make_rows(n: int = 12, unreadable: tuple[int, ...] = (5,), words: str = "q") -> list[tuple[int, object]]:
    """`words` replaces the questions' letter: two datasets of the same shape whose words differ."""
    bad = Dropped("malformed_json", "at column 3")
    return [(i, bad if i in unreadable else conversation(i, words)) for i in range(n)]


def turns_of(rows) -> int:
    return sum(2 if i % 3 == 0 else 1 for i, row in rows if not isinstance(row, Dropped))


def regenerate(store: ObjectStore, staging: Path, rows, engine, **options):
    options = {"fingerprint": FINGERPRINT, "progress_every_s": 0.0, "chunk_records": 4, **options}
    with Uploader(store, backoff_s=0.01) as uploader:
        return regenerate_range(
            rows=rows,
            open_engine=engine if callable(engine) and not hasattr(engine, "run") else engine.opener(),
            store=store,
            prefix=PREFIX,
            staging_dir=staging,
            uploader=uploader,
            log=lambda message: None,
            **options,
        )


def stored_lines(store: ObjectStore) -> list:
    text = store.get_bytes(f"{PREFIX}/{COMPLETIONS_NAME}").decode()
    return [parse_line(line, "test") for line in text.splitlines() if line.strip()]


def test_every_turn_is_answered_in_order_against_the_regenerated_history(store_url, tmp_path):
    store = open_store(store_url)
    rows = make_rows()
    result = regenerate(store, tmp_path / "staging", rows, ScriptedEngine())
    lines = stored_lines(store)

    assert [line.sample_index for line in lines] == list(range(12))  # every row once, in order
    records = {line.sample_index: line for line in lines if isinstance(line, CompletionRecord)}
    assert set(records) == set(range(12)) - {5}
    two_turns = records[0].messages
    assert [m["role"] for m in two_turns] == ["system", "user", "assistant", "user", "assistant"]
    assert two_turns[2]["content"] == "answer 0.0 to [q0a]"
    # The second answer was generated from a history holding the first regenerated answer, not the
    # dataset's: the scripted engine names the last prompt message, which is the second question.
    assert two_turns[4]["content"] == "answer 0.1 to [q0b]"
    assert "the dataset's" not in json.dumps(two_turns)
    assert records[1].messages[-1] == {"role": "assistant", "content": "answer 1.0 to [q1]"}  # prompts only
    assert records[2].messages == [  # an empty answer is answered like any other
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "answer 2.0 to [q2]"},
    ]
    assert records[0].turns[-1]["message"] == 4 and records[0].turns[0]["message"] == 2
    assert result.dropped == {5: "malformed_json"} and result.records == 11
    assert result.generated_now == 11 and result.requests == turns_of(rows)
    # Chunks were the way in; the range is one object (plus its fingerprint) once merged.
    names = sorted(info.key.rsplit("/", 1)[-1] for info in store.list(PREFIX + "/"))
    assert names == ["_fingerprint.json", COMPLETIONS_NAME]


def test_a_rerun_of_a_complete_range_opens_no_engine(tmp_path):
    store = LocalStore(tmp_path / "store")
    rows = make_rows()
    regenerate(store, tmp_path / "staging", rows, ScriptedEngine())
    before = store.get_bytes(f"{PREFIX}/{COMPLETIONS_NAME}")
    result = regenerate(store, tmp_path / "staging", rows, never_opened)
    assert result.generated_now == 0 and result.reused_from_store == 12
    assert store.get_bytes(f"{PREFIX}/{COMPLETIONS_NAME}") == before


def test_after_the_engine_fails_a_rerun_asks_only_for_the_unfinished_conversations(store_url, tmp_path):
    store = open_store(store_url)
    rows = make_rows(30)
    failing = ScriptedEngine(fail_after=13)
    with pytest.raises(EngineUnavailable):
        regenerate(store, tmp_path / "staging", rows, failing)
    finished_before = {
        line.sample_index
        for line in _all_stored_or_staged(store, tmp_path / "staging")
        if isinstance(line, CompletionRecord)
    }
    assert finished_before, "conversations finished before the failure must be kept"

    again = ScriptedEngine()
    result = regenerate(store, tmp_path / "staging", rows, again)
    asked_again = {sample for sample, _ in again.asked}
    assert not asked_again & finished_before  # nothing finished was asked for again
    unfinished = [(i, row) for i, row in rows if i not in finished_before]
    assert len(again.asked) == turns_of(unfinished)  # every turn of the others, once
    assert result.reused_from_store + result.reused_from_staging == len(finished_before)

    uninterrupted = LocalStore(tmp_path / "reference")
    regenerate(uninterrupted, tmp_path / "staging-reference", rows, ScriptedEngine())
    assert [line.to_json() for line in stored_lines(store)] == [
        line.to_json() for line in stored_lines(uninterrupted)
    ]


def _all_stored_or_staged(store: ObjectStore, staging: Path) -> list:
    lines = []
    for info in store.list(PREFIX + "/chunks/"):
        lines += [parse_line(t, info.key) for t in store.get_bytes(info.key).decode().splitlines() if t]
    for path in staging.glob("*.jsonl"):
        lines += [parse_line(t, str(path)) for t in path.read_text().splitlines() if t.strip()]
    return lines


def run_killed_after(
    journaled: int,
    store_dir: Path,
    staging: Path,
    rows: int,
    words: str = "q",
    engine_batch: int = 3,
    budget: int | None = None,
) -> list[str]:
    """Regenerate `rows` rows (`make_rows(rows, words=...)`, fingerprinted with their dataset) in a child
    process that SIGKILLs itself right after its `journaled`-th answered turn reached the journal
    (before any chunk is sealed); returns the journal's lines. With a `budget`, answers state
    `ten_per_message` prompts and conversations end at it."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
        from test_regenerate import (
            LocalStore, ScriptedEngine, fingerprint_of, make_rows, regenerate, ten_per_message
        )
        rows = make_rows({rows}, words={words!r})
        regenerate(LocalStore({str(store_dir)!r}), __import__("pathlib").Path({str(staging)!r}), rows,
                   ScriptedEngine(batch={engine_batch}, prompt_tokens=ten_per_message), chunk_records=1000,
                   chunk_every_s=3600, fingerprint=fingerprint_of(rows, budget={budget}),
                   token_budget={budget})
        """
    )
    env = {**os.environ, "DFLASH_FAULT_POINTS": f"regenerate_journal@{journaled}"}
    killed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    return (staging / "journal.jsonl").read_text().splitlines()


def turn_lines(journal: list[str]) -> set[tuple[int, int]]:
    """(sample, turn) of every answered turn in the journal (finished conversations' records aside)."""
    return {(body["sample_index"], body["turn"]) for body in map(json.loads, journal) if "turn" in body}


def fingerprint_of(rows, uri: str = "conversations.jsonl", budget: int | None = None) -> dict:
    settings = dataclasses.replace(SETTINGS, max_conversation_tokens=budget)
    return completions_fingerprint("tiny@0123", settings, dataset=dataset_identity(uri, rows))


def ten_per_message(request) -> int:
    """The prompt length a scripted answer states: ten tokens per message of its history."""
    return 10 * len(request.messages)


def all_turns(rows) -> set[tuple[int, int]]:
    return {(i, t) for i, row in rows if not isinstance(row, Dropped) for t in range(2 if i % 3 == 0 else 1)}


def test_a_sigkill_mid_range_asks_again_only_for_turns_never_answered(tmp_path):
    """Killed right after its 8th answered turn reached the journal (no chunk uploaded yet): the rerun
    asks for every other turn once, resumes half-answered conversations at their next turn, and stores
    what an uninterrupted run stores."""
    store_dir, staging = tmp_path / "store", tmp_path / "staging"
    journal = run_killed_after(8, store_dir, staging, rows=30)
    journaled = turn_lines(journal)
    assert len(journaled) == 8
    assert any(turn == 0 and (i, 1) not in journaled for i, turn in journaled if i % 3 == 0), (
        "the kill left no conversation half-answered"
    )

    rows = make_rows(30)
    again = ScriptedEngine()
    result = regenerate(LocalStore(store_dir), staging, rows, again, fingerprint=fingerprint_of(rows))
    assert set(again.asked) == all_turns(rows) - journaled and len(again.asked) == len(set(again.asked))
    finished_in_journal = {i for i, _ in journaled if i % 3 != 0 or {(i, 0), (i, 1)} <= journaled}
    assert result.reused_from_staging == len(finished_in_journal)

    reference = LocalStore(tmp_path / "reference")
    regenerate(
        reference, tmp_path / "staging-reference", rows, ScriptedEngine(), fingerprint=fingerprint_of(rows)
    )
    assert [line.to_json() for line in stored_lines(LocalStore(store_dir))] == [
        line.to_json() for line in stored_lines(reference)
    ]


def test_a_torn_last_journal_line_is_asked_again_and_the_rest_kept(tmp_path):
    store_dir, staging = tmp_path / "store", tmp_path / "staging"
    lines = run_killed_after(4, store_dir, staging, rows=12)
    # A write cut short by the kill: the last line lost its second half and its newline.
    (staging / "journal.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    kept = turn_lines(lines[:-1])
    torn = (json.loads(lines[-1])["sample_index"], json.loads(lines[-1])["turn"])  # the kill came after it

    rows = make_rows(12)
    again = ScriptedEngine()
    regenerate(LocalStore(store_dir), staging, rows, again, fingerprint=fingerprint_of(rows))
    assert torn in again.asked and not set(again.asked) & kept
    assert set(again.asked) == all_turns(rows) - kept


def test_answers_staged_for_another_dataset_are_discarded_naming_both(tmp_path):
    """Two pipelines' staging never meets (local_state.py); should one range's staging directory hold
    another dataset's answers anyway, the fingerprint turns them away and says whose they were."""
    staging = tmp_path / "staging"
    theirs = run_killed_after(5, tmp_path / "their-store", staging, rows=12, words="other")
    assert len(turn_lines(theirs)) == 5

    ours = make_rows(12)
    warnings: list[str] = []
    engine = ScriptedEngine()
    store = LocalStore(tmp_path / "our-store")
    regenerate(store, staging, ours, engine, fingerprint=fingerprint_of(ours), warn=warnings.append)
    assert set(engine.asked) == all_turns(ours)  # nothing of theirs was taken for ours
    assert "other" not in store.get_bytes(f"{PREFIX}/{COMPLETIONS_NAME}").decode()
    discarded = next(w for w in warnings if "staging" in w)
    assert fingerprint_of(make_rows(12, words="other"))["dataset"]["rows_sha256"] in discarded
    assert fingerprint_of(ours)["dataset"]["rows_sha256"] in discarded


def test_a_moved_dataset_keeps_its_stored_answers_and_changed_rows_do_not(tmp_path):
    store, rows = LocalStore(tmp_path / "store"), make_rows(6, unreadable=())
    regenerate(
        store, tmp_path / "staging", rows, ScriptedEngine(), fingerprint=fingerprint_of(rows, "a.jsonl")
    )
    moved = regenerate(
        store, tmp_path / "staging", rows, never_opened, fingerprint=fingerprint_of(rows, "b.jsonl")
    )
    assert moved.reused_from_store == 6  # same rows read from another path: the same answers

    changed = make_rows(6, unreadable=(), words="new")
    engine = ScriptedEngine()
    regenerate(store, tmp_path / "staging", changed, engine, fingerprint=fingerprint_of(changed, "b.jsonl"))
    assert set(engine.asked) == all_turns(changed)
    assert "new" in store.get_bytes(f"{PREFIX}/{COMPLETIONS_NAME}").decode()


def test_conversations_under_way_get_their_next_turn_before_new_ones_start():
    from dflash_assets.generation.conversation import Answer, Regeneration
    from dflash_assets.generation.engine import TurnScheduler

    conversations = [Regeneration(i, conversation(0)) for i in range(4)]  # two turns each
    scheduler = TurnScheduler(conversations, on_finished=lambda c: None, on_dropped=lambda c, d: None)
    order = []
    while requests := scheduler.take(limit=2):  # an engine with two slots
        for request in requests:
            order.append((request.sample_index, request.turn))
            scheduler.answer(request, Answer(content="a", finish_reason="stop"))
    # Two conversations at a time, each finished before the next two start.
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]


def test_answers_made_under_other_settings_are_deleted_manifest_first_and_regenerated(tmp_path):
    store = WatchedStore(tmp_path / "store")
    rows = make_rows(6, unreadable=())
    regenerate(store, tmp_path / "staging", rows, ScriptedEngine())
    write_manifest(store, PREFIX, new_manifest("target_completions", "00000000-00000099", {}))
    sampled = completions_fingerprint("tiny@0123", GenerationSettings(temperature=0.7, max_new_tokens=16))
    again = ScriptedEngine()
    regenerate(store, tmp_path / "staging", rows, again, fingerprint=sampled)

    assert store.deletions and store.objects_deleted_under_a_manifest() == []  # un-committed first
    assert len(again.asked) == turns_of(rows)  # every answer made again under the new settings
    assert json.loads(store.get_bytes(f"{PREFIX}/_fingerprint.json")) == sampled


def test_truncated_answers_are_kept_and_counted_or_dropped_by_policy(tmp_path):
    rows = make_rows(6, unreadable=())
    kept = regenerate(LocalStore(tmp_path / "a"), tmp_path / "sa", rows, ScriptedEngine(truncate={1, 4}))
    assert kept.truncated == 2 and kept.records == 6 and kept.dropped == {}

    fingerprint = completions_fingerprint("tiny@0123", SETTINGS, truncated="drop")
    dropped = regenerate(
        LocalStore(tmp_path / "b"),
        tmp_path / "sb",
        rows,
        ScriptedEngine(truncate={1, 4}),
        truncated="drop",
        fingerprint=fingerprint,
    )
    assert dropped.records == 4 and dropped.dropped == {1: "truncated_answer", 4: "truncated_answer"}
    assert fingerprint != FINGERPRINT  # the policy changes what a range holds: never mixed


def test_refused_requests_drop_their_rows_and_too_many_fail_the_range_naming_the_first(tmp_path):
    store = LocalStore(tmp_path / "store")
    rows = make_rows(6, unreadable=())
    result = regenerate(store, tmp_path / "staging", rows, ScriptedEngine(refuse={3}))
    assert result.dropped == {3: "generation_failed"}
    dropped_line = next(line for line in stored_lines(store) if isinstance(line, DroppedRow))
    assert dropped_line.dropped.detail == "HTTP 400: prompt too long"

    with pytest.raises(TooManyBadRows, match=r"row 0.*generation_failed.*prompt too long"):
        regenerate(LocalStore(tmp_path / "other"), tmp_path / "s2", rows, ScriptedEngine(refuse={0, 1, 2, 4}))


def test_the_scripted_answer_names_its_history():
    # The other tests read which history an answer came from off its text; pin that rule here.
    from dflash_assets.generation.conversation import Regeneration
    from dflash_assets.generation.engine import TurnRequest

    conv = Regeneration(7, conversation(6))
    assert scripted_content(TurnRequest(conv, 0, conv.next_prompt())) == "answer 7.0 to [q6a]"


# ------------------------------------------------------------------------------ the token budget


def three_turns(index: int) -> list[dict]:
    return [
        {"role": "user", "content": f"q{index}a"},
        {"role": "assistant", "content": "the dataset's first answer"},
        {"role": "user", "content": f"q{index}b"},
        {"role": "assistant", "content": "the dataset's second answer"},
        {"role": "user", "content": f"q{index}c"},
        {"role": "assistant", "content": "the dataset's third answer"},
    ]


def bounded(budget: int | None, rows) -> dict:
    return {"fingerprint": fingerprint_of(rows, budget=budget), "token_budget": budget}


def test_a_conversation_ends_at_the_answer_that_reaches_the_token_budget_and_later_turns_are_never_asked(
    tmp_path,
):
    """Ten tokens per message of prompt and five of answer: the three answers of a three-turn row bring
    it to 15, 35 and 55 tokens. A budget of 35 is reached by the second: the third is never asked for."""
    rows = [(0, three_turns(0)), (1, [{"role": "user", "content": "q1"}])]
    store = LocalStore(tmp_path / "store")
    engine = ScriptedEngine(prompt_tokens=ten_per_message)
    result = regenerate(store, tmp_path / "staging", rows, engine, **bounded(35, rows))

    assert sorted(engine.asked) == [(0, 0), (0, 1), (1, 0)]
    record, single = stored_lines(store)
    assert [m["content"] for m in record.messages] == [
        "q0a",
        "answer 0.0 to [q0a]",
        "q0b",
        "answer 0.1 to [q0b]",
    ]
    assert len(record.turns) == 2 and record.ended_early == "max_length"
    assert single.ended_early is None  # one turn, nothing cut
    assert result.records == 2 and result.ended_at_max_length == 1 and result.ended_at_tool_calls == 0
    assert result.metadata()["ended_at_max_length"] == result.manifest_fields()["ended_at_max_length"] == 1
    assert "1 ended at the token budget (DFLASH_MAX_LENGTH)" in result.summary()


@pytest.mark.parametrize("budget", [None, 56], ids=["no budget", "a budget nobody reaches"])
def test_without_a_budget_or_under_one_every_turn_is_answered(tmp_path, budget):
    rows = [(0, three_turns(0))]
    engine = ScriptedEngine(prompt_tokens=ten_per_message)
    result = regenerate(
        LocalStore(tmp_path / "store"), tmp_path / "staging", rows, engine, **bounded(budget, rows)
    )
    assert sorted(engine.asked) == [(0, 0), (0, 1), (0, 2)]
    assert result.ended_at_max_length == 0 and len(stored_lines(LocalStore(tmp_path / "store"))[0].turns) == 3


def test_a_conversation_resumed_after_a_kill_ends_at_the_turn_an_uninterrupted_run_ends_at(tmp_path):
    """Killed right after the first answer of row 0 reached the journal, before its record: that answer
    alone brings the conversation to the budget (2 messages, 25 tokens), so the rerun asks nothing more
    of row 0 and stores what an uninterrupted run stores."""
    store_dir, staging = tmp_path / "store", tmp_path / "staging"
    journal = run_killed_after(1, store_dir, staging, rows=6, budget=25)
    assert turn_lines(journal) == {(0, 0)}

    rows = make_rows(6)
    again = ScriptedEngine(prompt_tokens=ten_per_message)
    result = regenerate(LocalStore(store_dir), staging, rows, again, **bounded(25, rows))
    assert not [turn for turn in again.asked if turn[0] == 0]  # resumed finished: nothing asked again
    assert sorted(again.asked) == [(1, 0), (2, 0), (3, 0), (4, 0)]  # every first turn, no second turn
    assert result.reused_from_staging == 1 and result.ended_at_max_length == 2  # rows 0 and 3

    reference = LocalStore(tmp_path / "reference")
    regenerate(
        reference,
        tmp_path / "staging-reference",
        rows,
        ScriptedEngine(prompt_tokens=ten_per_message),
        **bounded(25, rows),
    )
    assert [line.to_json() for line in stored_lines(LocalStore(store_dir))] == [
        line.to_json() for line in stored_lines(reference)
    ]


def test_settings_without_a_budget_keep_the_fingerprint_older_versions_wrote_and_a_budget_changes_it():
    written_before_the_budget = {"temperature": 0.0, "max_new_tokens": 16, "chat_template_kwargs": {}}
    assert GenerationSettings(max_new_tokens=16).fingerprint() == written_before_the_budget
    bounded_settings = GenerationSettings(max_new_tokens=16, max_conversation_tokens=2048)
    assert bounded_settings.fingerprint() == {**written_before_the_budget, "max_conversation_tokens": 2048}
    with pytest.raises(ValueError, match="DFLASH_MAX_LENGTH"):
        GenerationSettings(max_conversation_tokens=0)


def test_answers_made_before_the_budget_or_to_a_longer_one_are_kept_and_those_cut_shorter_are_not():
    rows = make_rows(6)
    ours = fingerprint_of(rows, budget=2048)
    same = _same_answers(ours)
    # Every turn answered: a superset of what a budget asks for.
    assert same(fingerprint_of(rows, budget=None))
    assert same({k: v for k, v in fingerprint_of(rows, budget=None).items() if k != "dataset"})  # oldest
    assert same(fingerprint_of(rows, "moved.jsonl", budget=2048))
    assert same(fingerprint_of(rows, budget=4096))  # a longer DFLASH_MAX_LENGTH answered every turn asked now
    assert not same(fingerprint_of(rows, budget=1024))  # cut shorter than asked now
    assert not same(fingerprint_of(make_rows(6, words="other"), budget=None))  # other rows, still not
    # Answers cut by a budget never pass for a range without one.
    assert not _same_answers(fingerprint_of(rows, budget=None))(ours)


def test_a_range_answered_before_the_budget_is_kept_whole_and_another_budget_regenerates_it(tmp_path):
    store, rows = LocalStore(tmp_path / "store"), make_rows(6, unreadable=())
    engine = ScriptedEngine(prompt_tokens=ten_per_message)
    regenerate(store, tmp_path / "staging", rows, engine, **bounded(None, rows))
    before = store.get_bytes(f"{PREFIX}/{COMPLETIONS_NAME}")

    kept = regenerate(store, tmp_path / "staging", rows, never_opened, **bounded(25, rows))
    assert kept.reused_from_store == 6 and store.get_bytes(f"{PREFIX}/{COMPLETIONS_NAME}") == before
    assert json.loads(store.get_bytes(f"{PREFIX}/_fingerprint.json")) == fingerprint_of(rows, budget=25)

    engine = ScriptedEngine(prompt_tokens=ten_per_message)
    regenerate(store, tmp_path / "staging", rows, engine, **bounded(45, rows))
    assert sorted(engine.asked) == sorted(all_turns(rows))  # another budget: every turn asked again


def test_a_budget_other_than_the_fingerprints_is_refused_naming_both(tmp_path):
    rows = make_rows(3)
    with pytest.raises(ValueError, match=r"token_budget=25 .*max_conversation_tokens=None"):
        regenerate(
            LocalStore(tmp_path / "store"),
            tmp_path / "staging",
            rows,
            never_opened,
            fingerprint=fingerprint_of(rows),
            token_budget=25,
        )
