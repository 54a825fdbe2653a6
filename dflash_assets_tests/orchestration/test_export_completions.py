"""`dflash-assets export-completions`: the target's stored answers as one JSONL dataset in the `messages`
layout, read back (`DFLASH_COMPLETIONS=dataset`) to the very ids and loss mask the target's own
`tokenized_completions` made (tools, tool calls and reasoning included); a range that is not stored, or
changed since its commit, is one line and no file; a malformed exported row is one dropped row with its
reason."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from dflash_assets import cli
from dflash_assets.conversations.datasets import bundled_dataset_path
from dflash_assets.conversations.layouts import EXACT_IDS_FIELD
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.conversations.shard import read_shard
from dflash_assets.conversations.tokenize import tokenize_range
from dflash_assets.generation.export import export_completions
from dflash_assets.generation.tokenized import tokenize_completions
from dflash_assets.storage.manifest import new_manifest, read_manifest, write_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import make_dagster_home, shared_tmp_dir
from dflash_assets_tests.support.in_process import environment, materialize_here
from dflash_assets_tests.support.shared import build_once
from dflash_assets_tests.support.tool_target import qwen3_tool_template

ROWS = 8  # the bundled data's first 7 rows, then one the target cannot answer
KEY = f"00000000-{ROWS - 1:08d}"
SHARD = f"tokenized-completions/{KEY}/shard.parquet"


def run_cli(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    """`dflash-assets <argv>` in this process under `env`: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with environment(env), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def exported(tmp_path_factory, demo_model_dir: Path) -> dict:
    """One range of the bundled data answered by the demo target (the in-process engine) and tokenized,
    exported, then tokenized again from the exported file as a dataset: once per test run."""

    def build(root: Path) -> dict:
        dataset = root / "conversations.jsonl"
        with open(bundled_dataset_path(), encoding="utf-8") as source:
            lines = [line for _, line in zip(range(ROWS - 1), source, strict=False)]
        dataset.write_text("".join(lines) + json.dumps({"messages": "not a list"}) + "\n", encoding="utf-8")
        env = {
            **os.environ,
            "DFLASH_HOME": str(root / "home"),
            "DFLASH_CACHE_DIR": str(demo_model_dir.parent),
            "DFLASH_DATASET": str(dataset),
            "DFLASH_SAMPLES_PER_PARTITION": str(ROWS),
            "DFLASH_COMPLETIONS": "target",
            "DFLASH_GENERATE_TEMPERATURE": "0",
            "DFLASH_GENERATE_MAX_NEW_TOKENS": "16",
            "DFLASH_STORE_URL": str(root / "store"),
            "DAGSTER_HOME": make_dagster_home(root / "dagster-home"),
            "OMP_NUM_THREADS": "1",
        }
        run = materialize_here("target_completions,tokenized_completions", KEY, env)
        assert run.success, run.output[-4000:]
        out = root / "export" / "answers.jsonl"
        status, stdout, stderr = run_cli(["export-completions", str(out)], env)
        assert status == 0, stderr[-3000:]
        # The exported file as a dataset: its rows are samples 0..N-1 of a new range, in another store.
        back = {
            **env,
            "DFLASH_DATASET": str(out),
            "DFLASH_COMPLETIONS": "dataset",
            "DFLASH_STORE_URL": str(root / "store-read-back"),
            "DAGSTER_HOME": make_dagster_home(root / "dagster-home-read-back"),
        }
        read_back = materialize_here("tokenized_completions", KEY, back)
        assert read_back.success, read_back.output[-4000:]
        return {
            "env": env,
            "back": back,
            "out": str(out),
            "stdout": stdout,
            "exact_target_ids": read_back.metadata["exact_target_ids"],
        }

    return build_once(shared_tmp_dir(tmp_path_factory) / "exported-completions", build)


def test_the_exported_answers_read_back_as_a_dataset_give_the_same_ids_and_loss_mask_for_every_sample(
    exported,
):
    original = read_shard(open_store(exported["env"]["DFLASH_STORE_URL"]).get_bytes(SHARD))
    read_back = read_shard(open_store(exported["back"]["DFLASH_STORE_URL"]).get_bytes(SHARD))
    assert [s.sample_index for s in original] == list(range(ROWS - 1))  # the last row was never answered
    assert [s.sample_index for s in read_back] == list(range(len(original)))  # rows of the new file
    for before, after in zip(original, read_back, strict=True):
        assert after.input_ids == before.input_ids, f"sample {before.sample_index}"
        assert after.loss_mask == before.loss_mask, f"sample {before.sample_index}"
    assert exported["exact_target_ids"] == len(original)  # the target's own ids, never re-tokenised


def test_each_exported_row_is_a_messages_row_with_its_exact_ids_and_where_it_came_from(exported):
    store = open_store(exported["env"]["DFLASH_STORE_URL"])
    manifest = read_manifest(store, f"target-completions/{KEY}")
    fingerprint = json.loads(store.get_bytes(f"target-completions/{KEY}/_fingerprint.json"))
    rows = [json.loads(line) for line in Path(exported["out"]).read_text(encoding="utf-8").splitlines()]
    assert [row["provenance"]["sample_index"] for row in rows] == list(range(ROWS - 1))
    model, revision = manifest["target_model"].split("@")
    for row in rows:
        assert set(row) == {"messages", EXACT_IDS_FIELD, "provenance"}  # the bundled rows have no tools
        assert row["messages"][-1]["role"] == "assistant"
        last = row[EXACT_IDS_FIELD]["turns"][-1]
        assert last["message"] == len(row["messages"]) - 1  # the last answer ends the conversation
        assert last["completion_token_ids"] and row[EXACT_IDS_FIELD]["prompt_token_ids"]
        provenance = row["provenance"]
        assert provenance["format"] == "dflash-assets.exported-completion/1"
        assert provenance["range"] == KEY
        assert (provenance["target_model"], provenance["target_revision"]) == (model, revision)
        assert provenance["engine"] == (manifest.get("engine") or "not recorded")
        assert provenance["generation"] == manifest["generation"]
        assert provenance["generation"]["max_new_tokens"] == 16
        assert provenance["dataset"] == fingerprint["dataset"]
        assert provenance["dataset"]["uri"].endswith("conversations.jsonl")
        assert provenance["answered_by"] == "in-process"


def test_the_export_ends_saying_what_it_wrote_and_which_rows_it_left_out_and_why(exported):
    out = Path(exported["out"])
    lines = exported["stdout"].splitlines()
    assert lines == [
        "1 row was left out, dropped by target_completions (messages_not_a_list 1)",
        f"wrote {ROWS - 1} rows of 1 range(s) ({KEY}) to {out}: {out.stat().st_size:,} bytes",
    ]
    assert [path.name for path in out.parent.iterdir()] == [out.name]  # no temporary file left beside it


def test_naming_a_range_that_is_not_stored_is_one_line_naming_it_and_the_stored_ones(exported, tmp_path):
    out = tmp_path / "answers.jsonl"
    status, stdout, stderr = run_cli(
        ["export-completions", str(out), KEY, "00000100-00000199"], exported["env"]
    )
    assert status == 2 and stdout == ""
    assert len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith("dflash-assets export-completions: target_completions range is not stored")
    assert "00000100-00000199; stored ranges: " + KEY in stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_export_that_fails_part_way_leaves_the_earlier_file_as_it_was_and_no_partial_one(
    exported, tmp_path
):
    store = tmp_path / "store"
    shutil.copytree(exported["env"]["DFLASH_STORE_URL"], store)
    with open(store / "target-completions" / KEY / "completions.jsonl", "a", encoding="utf-8") as handle:
        handle.write("\n")  # changed after its commit: no reader takes it, nor does the export
    out = tmp_path / "export" / "answers.jsonl"
    out.parent.mkdir()
    out.write_text("an earlier export\n")
    status, _, stderr = run_cli(
        ["export-completions", str(out)], {**exported["env"], "DFLASH_STORE_URL": str(store)}
    )
    assert status == 2 and len(stderr.splitlines()) == 1, stderr
    assert f"range {KEY} changed since it was committed" in stderr
    assert out.read_text() == "an earlier export\n"
    assert [path.name for path in out.parent.iterdir()] == [out.name]


def test_a_malformed_exact_ids_row_is_dropped_with_a_one_line_reason_and_the_others_are_kept(
    tmp_path, demo_model_dir: Path
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    answer = tokenizer("Four.", add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}]

    def row(**exact) -> dict:
        turn = {"message": 1, "finish_reason": "stop", "completion_token_ids": answer}
        return {"messages": messages, EXACT_IDS_FIELD: {"turns": [turn], **exact}}

    broken = [
        row(turns=[{"message": 1, "finish_reason": "stop", "completion_token_ids": "1 2 3"}]),
        row(turns=[{"message": 0, "finish_reason": "stop", "completion_token_ids": answer}]),
        row(turns=[]),
        row(prompt_token_ids=[1, -2]),
        {"messages": messages, EXACT_IDS_FIELD: "{not json"},
    ]
    dataset = tmp_path / "exported.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in [row(), *broken]))
    result = tokenize_range(tokenizer, dataset, SampleRange(0, 5), max_bad_fraction=1.0)
    assert [s.sample_index for s in result.samples] == [0] and result.exact_ids == 1
    assert result.samples[0].input_ids[-len(answer) :] == answer  # the ids as given, not re-tokenised
    assert result.dropped == {1: "bad_exact_ids", 2: "bad_exact_ids", 3: "bad_exact_ids",
                              4: "bad_exact_ids", 5: "malformed_json"}  # fmt: skip
    details = [bad.detail for bad in result.bad_rows]
    assert details == [
        "turn 0's 'completion_token_ids' is a str, not a list of token ids",
        "turn 0 names message 0, a 'user' message",
        "'turns' is not a non-empty list of answers",
        "'prompt_token_ids' holds -2 at position 1, not a token id",
        "'exact_ids' string: Expecting property name enclosed in double quotes at column 2",
    ]
    assert "\n" not in result.dropped_line()


def _record(index: int, messages: list[dict], turns: list[dict], **more) -> str:
    return json.dumps({"sample_index": index, "messages": messages, "turns": turns, **more, "engine": "x"})


def _commit_range(store, key: str, lines: list[str], **fields) -> None:
    """A range as target_completions commits it: its `completions.jsonl`, then its manifest."""
    body = "".join(line + "\n" for line in lines).encode()
    store.put_bytes(f"target-completions/{key}/completions.jsonl", body)
    manifest = new_manifest("target_completions", key, {"completions.jsonl": len(body)}, **fields)
    write_manifest(store, f"target-completions/{key}", manifest)


def test_tools_tool_calls_reasoning_and_a_prompt_of_other_ids_read_back_as_their_records_tokenize(
    tmp_path, demo_model_dir: Path
):
    """Two ranges written as target_completions writes them (the second made before engines, datasets
    and fingerprints were recorded): every record tokenizes from the exported file as from the store."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    tokenizer.chat_template = qwen3_tool_template("turn")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        "id": "c1",
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is 21 °C."},
    ]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [end]

    def turn(message: int, text: str | None, finish: str = "stop") -> dict:
        answer = {"message": message, "finish_reason": finish, "completion_tokens": 3}
        return {**answer, "completion_token_ids": ids(text)} if text is not None else answer

    prompt = tokenizer.apply_chat_template(
        messages[:4], tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    short = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    store = open_store(str(tmp_path / "store"))
    generation = {"temperature": 0.0, "max_new_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}}
    _commit_range(
        store,
        "00000000-00000001",
        [_record(0, messages, [turn(2, "<tool_call>x</tool_call>"), turn(4, "It is 21 °C.")],
                 prompt_token_ids=prompt, tools=tools),
         _record(1, short, [turn(1, "Hello", "length")], prompt_token_ids=[7, *prompt[:5]])],
        target_model="demo@abc", generation=generation, engine={"name": "vllm", "dtype": "float32"},
        dropped={},
    )  # fmt: skip
    store.put_bytes(
        "target-completions/00000000-00000001/_fingerprint.json",
        json.dumps({"target_model": "demo@abc", "dataset": {"uri": "s3://u:hunter22@b/d.jsonl"}}).encode(),
    )
    _commit_range(
        store,
        "00000002-00000003",
        [_record(3, short, [turn(1, None)])],  # the engine returned no ids: its text is tokenized
        target_model="demo", generation=generation, dropped={"2": "generation_failed"},
    )  # fmt: skip
    out = tmp_path / "answers.jsonl"
    result = export_completions(store, out)
    assert (result.rows, result.ranges) == (3, ["00000000-00000001", "00000002-00000003"])
    assert result.left_out_line() == "1 row was left out, dropped by target_completions (generation_failed 1)"

    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [row["provenance"]["sample_index"] for row in rows] == [0, 1, 3]
    assert rows[0]["tools"] == tools and rows[0]["messages"] == messages
    assert rows[0]["provenance"]["dataset"] == {"uri": "s3://u:***@b/d.jsonl"}  # never a password
    assert rows[0]["provenance"]["engine"] == {"name": "vllm", "dtype": "float32"}
    assert rows[2]["provenance"]["engine"] == rows[2]["provenance"]["dataset"] == "not recorded"
    assert (rows[2]["provenance"]["target_model"], rows[2]["provenance"]["target_revision"]) == (
        "demo",
        "not recorded",
    )

    expected = []
    for key in ("00000000-00000001", "00000002-00000003"):
        local = tmp_path / f"{key}.jsonl"
        store.download(f"target-completions/{key}/completions.jsonl", local)
        kwargs = generation["chat_template_kwargs"]
        expected += tokenize_completions(tokenizer, local, chat_template_kwargs=kwargs).samples
    read_back = tokenize_range(tokenizer, out, SampleRange(0, 9))
    assert [s.sample_index for s in read_back.samples] == [0, 1, 2] and read_back.exact_ids == 2
    assert [(s.input_ids, s.loss_mask) for s in read_back.samples] == [
        (s.input_ids, s.loss_mask) for s in expected
    ]
    assert any(read_back.samples[0].loss_mask[: len(prompt)])  # the earlier answer is learned too
    assert not any(read_back.samples[1].loss_mask[:6])  # a prompt of other ids is kept, unmasked
