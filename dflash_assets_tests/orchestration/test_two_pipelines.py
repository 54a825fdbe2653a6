"""Two pipelines of one user on one host, from the shell: one `DFLASH_HOME`, one Dagster instance, two
S3 prefixes, two datasets of the same shape whose words differ, the same range key. The first is
killed part-way through its regeneration, the second runs, the first runs again: each store holds its
own dataset's conversations and samples, and the first resumes from its own staging."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from dagster import AssetKey
from transformers import AutoTokenizer

from dflash_assets.conversations.shard import read_shard
from dflash_assets.generation.records import CompletionRecord, parse_line
from dflash_assets.storage.layout import COMPLETIONS_NAME
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import aws_env, aws_env_set, create_bucket, make_dagster_home, open_instance
from dflash_assets_tests.support.cli import IN_PROCESS, dagster, run_cli
from dflash_assets_tests.support.stores import staging_of

KEY = "00000000-00000005"
SELECT = "target_completions,tokenized_completions"
WORDS = {
    "one": ["apples", "rivers", "stones", "clouds", "lamps", "gardens"],
    "two": ["engines", "tigers", "violins", "deserts", "coins", "bridges"],
}


def rows(words: list[str]) -> list[dict]:
    """Six conversations; the odd ones have a second turn, answered against the target's first answer."""
    out = []
    for i, word in enumerate(words):
        messages = [{"role": "user", "content": f"Describe {word}."}, {"role": "assistant", "content": "x"}]
        if i % 2:
            messages += [
                {"role": "user", "content": f"More about {word}?"},
                {"role": "assistant", "content": "y"},
            ]
        out.append({"messages": messages})
    return out


def materialize_args(config: dict | None = None) -> list[str]:
    run_config = {**IN_PROCESS, "ops": {"target_completions": {"config": config or {}}}}
    return [
        "asset", "materialize", "-m", "dflash_assets.definitions", "--select", SELECT, "--partition", KEY,
        "--config-json", json.dumps(run_config),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory, moto_endpoint, demo_model_dir):
    root = tmp_path_factory.mktemp("two-pipelines")
    create_bucket(moto_endpoint, "two-pipelines")
    user = {
        **os.environ,
        **aws_env(moto_endpoint),
        "DFLASH_HOME": str(root / "home"),  # one user: one home, one instance
        "DAGSTER_HOME": make_dagster_home(root / "dagster-home"),
        "DFLASH_CACHE_DIR": str(demo_model_dir.parent),
        "DFLASH_SAMPLES_PER_PARTITION": "6",
        "DFLASH_COMPLETIONS": "target",
        "DFLASH_GENERATE_MAX_NEW_TOKENS": "8",
        "OMP_NUM_THREADS": "1",
    }
    envs = {}
    for name, words in WORDS.items():
        dataset = root / f"{name}.jsonl"
        dataset.write_text("".join(json.dumps(row) + "\n" for row in rows(words)))
        envs[name] = {
            **user,
            "DFLASH_DATASET": str(dataset),
            "DFLASH_STORE_URL": f"s3://two-pipelines/{name}",
        }
    with aws_env_set(moto_endpoint):
        yield {"envs": envs, "model_dir": demo_model_dir}


def test_two_pipelines_on_one_host_keep_to_their_own_store_whatever_is_killed(pipelines):
    one, two = pipelines["envs"]["one"], pipelines["envs"]["two"]
    journal = staging_of(one, f"target-completions/{KEY}") / "journal.jsonl"

    # The first pipeline, killed (its whole process group) once a conversation is staged; batches of two
    # conversations keep it from finishing before the kill.
    process = dagster(materialize_args({"max_batch_size": 2}), one)
    deadline = time.monotonic() + 300
    while not (journal.exists() and journal.read_text().count("\n") >= 1):
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no conversation was staged in time"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert open_store(one["DFLASH_STORE_URL"]).head(f"target-completions/{KEY}/{COMPLETIONS_NAME}") is None

    # The second pipeline, the same range key, from start to end; then the first again.
    code, output = run_cli(materialize_args(), two)
    assert code == 0, output[-4000:]
    code, output = run_cli(materialize_args(), one)
    assert code == 0, output[-4000:]
    with open_instance(one["DAGSTER_HOME"]) as instance:  # the first's rerun is the latest
        event = instance.get_latest_materialization_event(AssetKey("target_completions"))
        metadata = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    assert metadata["reused_from_staging"] >= 1  # what the killed run had finished, from its own staging
    assert metadata["generated_now"] + metadata["reused_from_staging"] == 6

    tokenizer = AutoTokenizer.from_pretrained(pipelines["model_dir"])
    for name, env in pipelines["envs"].items():
        own, other = WORDS[name], WORDS["two" if name == "one" else "one"]
        store = open_store(env["DFLASH_STORE_URL"])
        text = store.get_bytes(f"target-completions/{KEY}/{COMPLETIONS_NAME}").decode()
        records = [parse_line(line, name) for line in text.splitlines()]
        assert all(isinstance(record, CompletionRecord) for record in records)
        for record in records:  # every user turn is this dataset's own, in its own row
            users = [m["content"] for m in record.messages if m["role"] == "user"]
            assert users == [
                m["content"] for m in rows(own)[record.sample_index]["messages"] if m["role"] == "user"
            ]
        samples = read_shard(store.get_bytes(f"tokenized-completions/{KEY}/shard.parquet"))
        assert [s.sample_index for s in samples] == list(range(6))
        for sample in samples:
            decoded = tokenizer.decode(sample.input_ids)
            assert own[sample.sample_index] in decoded, (name, decoded)
            assert not any(word in decoded for word in other), (name, decoded)
