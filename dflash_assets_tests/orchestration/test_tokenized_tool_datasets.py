"""The held-out check of datasets as users have them, through `tokenized_completions` with the dataset's
own answers: a ShareGPT JSONL, and a directory of two Parquet shards of tool-calling rows (JSON-string
columns, multi-part content, arguments as strings and as objects), under a Qwen3-style template that
renders tools and tool calls. Every stored sample must be the template's own rendering of its row with
its tools, and its loss mask the template's `{% generation %}` mask (plus the end-of-turn token after
each answer where the template's marks leave it out)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dagster import DagsterInstance, materialize
from transformers import AutoTokenizer

from dflash_assets.conversations.shard import read_shard
from dflash_assets.orchestration.assets.tokenized_completions import tokenized_completions_asset
from dflash_assets.orchestration.io_manager import StoreIOManager
from dflash_assets.orchestration.resources import DatasetResource, StoreResource, TargetModelResource
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.support.tool_target import qwen3_tool_template, tool_target

KEY = "00000000-00000099"
END = "<|im_end|>"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERT = {
    "type": "function",
    "function": {
        "name": "convert",
        "parameters": {"type": "object", "properties": {"celsius": {"type": "number"}}},
    },
}


def text_parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": text} for text in texts]


def call(name: str, arguments: dict, call_id: str, *, as_string: bool) -> dict:
    # Datasets write string arguments with json.dumps: the template prints them as they are.
    args = json.dumps(arguments) if as_string else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


# Tool-calling rows as a dataset stores them: `messages` and `tools` as JSON strings in Parquet columns.
SHARD_0 = [
    (
        [
            {"role": "system", "content": "You are a weather assistant."},
            {"role": "user", "content": text_parts("What is the weather ", "in Paris?")},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("get_weather", {"city": "Paris"}, "c1", as_string=True)],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18C, sunny"},
            {"role": "assistant", "content": text_parts("It is 18C ", "and sunny in Paris.")},
        ],
        [WEATHER],
    ),
    (
        [
            {"role": "user", "content": "Compare Oslo and Rome, in Fahrenheit too."},
            {
                "role": "assistant",
                "content": "Let me check both.",
                "tool_calls": [
                    call("get_weather", {"city": "Oslo"}, "a", as_string=False),
                    call("get_weather", {"city": "Rome"}, "b", as_string=True),
                ],
            },
            {"role": "tool", "tool_call_id": "a", "content": "3C"},
            {"role": "tool", "tool_call_id": "b", "content": "24C"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call("convert", {"celsius": 3}, "c", as_string=False)],
            },
            {"role": "tool", "tool_call_id": "c", "content": text_parts("37.4F")},
            {"role": "assistant", "content": "Oslo 3C (37.4F), Rome 24C."},
        ],
        [WEATHER, CONVERT],
    ),
    ([{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": text_parts("Hi", "!")}], None),
]
SHARD_1 = [
    (
        [
            {"role": "user", "content": "Weather in Lima?"},
            {
                "role": "assistant",
                "reasoning_content": "The user wants Lima's weather: call the tool.",
                "content": "",
                "tool_calls": [call("get_weather", {"city": "Lima"}, "l1", as_string=False)],
            },
            {"role": "tool", "tool_call_id": "l1", "content": "20C"},
            {"role": "assistant", "content": "20C in Lima."},
            {"role": "user", "content": "And Quito?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [call("get_weather", {"city": "Quito"}, "q1", as_string=True)],
            },
            {"role": "tool", "tool_call_id": "q1", "content": "14C"},
            {"role": "assistant", "content": "14C in Quito."},
        ],
        [WEATHER],
    ),
    (
        [
            {"role": "user", "content": "Is 30C hot?"},
            {"role": "assistant", "content": "Yes, 30C is hot.", "tool_calls": []},
        ],
        [CONVERT],
    ),
]

# ShareGPT rows, and the messages each one is (written out by hand: what the layout means).
SHAREGPT = [
    (
        {
            "system": "You are a weather assistant.",
            "tools": json.dumps([WEATHER]),
            "conversations": [
                {"from": "human", "value": "Weather in Paris?"},
                {
                    "from": "function_call",
                    "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}),
                },
                {"from": "observation", "value": "18C"},
                {"from": "gpt", "value": "18C in Paris."},
            ],
        },
        [
            {"role": "system", "content": "You are a weather assistant."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": "18C"},
            {"role": "assistant", "content": "18C in Paris."},
        ],
        [WEATHER],
    ),
    (
        {
            "conversations": [
                {"from": "system", "value": "Answer in one line."},
                {"from": "human", "value": "Capital of Peru?"},
                {"from": "gpt", "value": "Lima."},
                {"from": "human", "value": "And of Chile?"},
                {"from": "gpt", "value": "Santiago."},
            ]
        },
        [
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "Capital of Peru?"},
            {"role": "assistant", "content": "Lima."},
            {"role": "user", "content": "And of Chile?"},
            {"role": "assistant", "content": "Santiago."},
        ],
        None,
    ),
]


def write_parquet_repository(root: Path) -> Path:
    (root / "data").mkdir(parents=True)
    for number, rows in enumerate((SHARD_0, SHARD_1)):
        table = pa.table(
            {
                "id": [f"row-{number}-{i}" for i in range(len(rows))],
                "messages": [json.dumps(messages) for messages, _ in rows],
                "tools": [json.dumps(tools) if tools else None for _, tools in rows],
            }
        )
        pq.write_table(table, root / f"data/train-0000{number}-of-00002.parquet")
    (root / "README.md").write_text(
        "---\nconfigs: [{config_name: default, data_files: data/*.parquet}]\n---\n"
    )
    return root


def write_sharegpt(path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row, _, _ in SHAREGPT))
    return path


def with_end_of_turn(ids: list[int], mask: list[int], end: int) -> list[int]:
    """The template's mask plus the end-of-turn token right after each masked span it leaves it out of."""
    out = list(mask)
    for p in range(len(ids) - 1):
        if mask[p] and not mask[p + 1] and ids[p + 1] == end and ids[p] != end:
            out[p + 1] = 1
    return out


def template_rendering(tokenizer, marked, messages, tools) -> tuple[list[int], list[int]]:
    """The template's own ids for the row, and the marked template's assistant mask (+ end-of-turn)."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    out = marked.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert list(out["input_ids"]) == list(ids)
    return list(ids), with_end_of_turn(
        list(ids), list(out["assistant_masks"]), tokenizer.convert_tokens_to_ids(END)
    )


def materialise(dataset: Path, target: Path, tmp_path: Path):
    store = StoreResource(url=str(tmp_path / "store"), staging_dir=str(tmp_path / "staging"))
    result = materialize(
        [tokenized_completions_asset("dataset")],
        partition_key=KEY,
        resources={
            "store": store,
            "store_io_manager": StoreIOManager(store=store),
            "dataset": DatasetResource(dataset=str(dataset)),
            "target_model": TargetModelResource(model=str(target)),
        },
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert result.success, [str(e.event_specific_data.error) for e in result.all_events if e.is_step_failure]
    local = tmp_path / "shard.parquet"
    open_store(str(tmp_path / "store")).download(f"tokenized-completions/{KEY}/shard.parquet", local)
    manifest = read_manifest(open_store(str(tmp_path / "store")), f"tokenized-completions/{KEY}")
    return {sample.sample_index: sample for sample in read_shard(local)}, manifest


@pytest.fixture(
    scope="module", params=["turn", "content", None], ids=["marks-turn", "marks-text", "no-marks"]
)
def target(request, demo_model_dir, tmp_path_factory):
    """The demo target with the Qwen3-style tool template: `{% generation %}` around the whole turn,
    around its text without <|im_end|>, or absent (the product then locates the turns itself)."""
    mark = request.param
    directory = tool_target(demo_model_dir, tmp_path_factory.mktemp("tool-target") / "target", mark)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    marked = AutoTokenizer.from_pretrained(directory)
    marked.chat_template = qwen3_tool_template(mark or "turn")  # the same template, marked
    return directory, tokenizer, marked


def test_tool_calling_parquet_shards_are_stored_as_the_template_renders_and_marks_them(target, tmp_path):
    directory, tokenizer, marked = target
    samples, manifest = materialise(write_parquet_repository(tmp_path / "repo"), directory, tmp_path)
    rows = SHARD_0 + SHARD_1
    assert sorted(samples) == manifest["sample_indices"] == list(range(len(rows)))  # global across shards
    assert manifest["dropped"] == {}
    for index, (messages, tools) in enumerate(rows):
        ids, mask = template_rendering(tokenizer, marked, messages, tools)
        assert samples[index].input_ids == ids, f"row {index}"
        assert samples[index].loss_mask == mask, f"row {index}"
    # What the target writes is learned, tool calls included; tool results and the tools block are not.
    learned = tokenizer.decode(
        [t for t, m in zip(samples[1].input_ids, samples[1].loss_mask, strict=True) if m]
    )
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in learned
    assert "24C" not in learned.replace("Rome 24C.", "") and "Current weather" not in learned


def test_a_sharegpt_jsonl_is_stored_as_the_template_renders_and_marks_its_messages(target, tmp_path):
    directory, tokenizer, marked = target
    samples, manifest = materialise(write_sharegpt(tmp_path / "sharegpt.jsonl"), directory, tmp_path)
    assert sorted(samples) == [0, 1] and manifest["dropped"] == {}
    for index, (_, messages, tools) in enumerate(SHAREGPT):
        ids, mask = template_rendering(tokenizer, marked, messages, tools)
        assert samples[index].input_ids == ids and samples[index].loss_mask == mask, f"row {index}"
