"""`target_completions` with `DFLASH_GENERATE_ENGINE=vllm` from the shell, as a user runs it: the range
starts its own server, stores the answers with their exact ids and where they came from, stops the server,
leaves none behind when the run is killed with SIGKILL, resumes, and refuses to mix another engine's
answers into the range. The server is `support/fake_vllm.py`'s; vLLM itself: `test_vllm_real.py`."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from dflash_assets.generation.records import CompletionRecord, parse_line
from dflash_assets.storage.layout import COMPLETIONS_NAME
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import make_dagster_home
from dflash_assets_tests.support.cli import dagster, materialize_args
from dflash_assets_tests.support.fake_vllm import alive, fake_vllm_environment
from dflash_assets_tests.support.stores import staging_of

KEY = "00000000-00000005"
ENGINE = {"name": "vllm", "build": "cpu", "version": "0.32.0", "dtype": "float32"}


@pytest.fixture
def env(tmp_path, demo_model_dir: Path) -> dict[str, str]:
    dataset = tmp_path / "conversations.jsonl"
    rows = [{"messages": [{"role": "user", "content": " ".join(["word"] * (3 + i))}]} for i in range(6)]
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    fake = fake_vllm_environment(tmp_path / "fake-vllm")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")])),
        "FAKE_VLLM_PIDS": str(tmp_path / "pids"),
        "DFLASH_HOME": str(tmp_path / "home"),
        "DFLASH_CACHE_DIR": str(demo_model_dir.parent),
        "DFLASH_STORE_URL": str(tmp_path / "store"),
        "DFLASH_DATASET": str(dataset),
        "DFLASH_SAMPLES_PER_PARTITION": "6",
        "DFLASH_COMPLETIONS": "target",
        "DFLASH_GENERATE_ENGINE": "vllm",
        "DFLASH_VLLM_PYTHON": sys.executable,  # an environment that holds the fake vLLM
        "DFLASH_GENERATE_MAX_NEW_TOKENS": "16",
        "DFLASH_GENERATE_CONCURRENCY": "2",
        "DAGSTER_HOME": make_dagster_home(tmp_path / "dagster-home"),
        "OMP_NUM_THREADS": "1",
    }


def server_pids(env: dict[str, str]) -> list[int]:
    path = Path(env["FAKE_VLLM_PIDS"])
    return [int(pid) for pid in path.read_text().split()] if path.exists() else []


def run(env: dict[str, str], timeout_s: float = 300) -> tuple[int, str]:
    process = dagster(materialize_args("target_completions", KEY), env)
    output, _ = process.communicate(timeout=timeout_s)
    return process.returncode, output


def stored_records(env: dict[str, str]) -> dict[int, CompletionRecord]:
    text = open_store(env["DFLASH_STORE_URL"]).get_bytes(f"target-completions/{KEY}/{COMPLETIONS_NAME}")
    lines = [parse_line(line, "completions") for line in text.decode().splitlines()]
    return {line.sample_index: line for line in lines if isinstance(line, CompletionRecord)}


def test_a_range_starts_its_own_server_stores_the_answers_with_their_engine_and_stops_it(env):
    code, output = run(env)
    assert code == 0, output[-4000:]
    records = stored_records(env)
    assert sorted(records) == list(range(6))
    # The fake server counts the prompt's words out as ids: exact ids, as vLLM returns them.
    assert records[2].turns[0]["completion_token_ids"] == [1, 2, 3, 4, 5, 2]
    assert {record.engine for record in records.values()} == {"vllm 0.32.0 float32"}
    manifest = read_manifest(open_store(env["DFLASH_STORE_URL"]), f"target-completions/{KEY}")
    assert manifest["engine"] == ENGINE  # where the answers came from, beside the sampling
    assert manifest["generation"]["temperature"] == 0.0
    fingerprint = json.loads(
        open_store(env["DFLASH_STORE_URL"]).get_bytes(f"target-completions/{KEY}/_fingerprint.json")
    )
    assert fingerprint["engine"] == ENGINE
    assert "vllm: fake vllm: dtype float32" in output  # the server's own lines in the run's log
    assert "vLLM server at http://127.0.0.1:" in output and "stopped" in output
    pids = server_pids(env)
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)

    # Another engine asks for the same range: refused, naming both; the stored answers stay.
    code, output = run({**env, "DFLASH_GENERATE_ENGINE": "in_process"})
    assert code != 0
    assert "holds answers made by vllm 0.32.0 (cpu) float32; this run answers with in_process" in output
    assert stored_records(env).keys() == records.keys()


@pytest.mark.parametrize("kill", ["the run alone", "the run's process group"])
def test_a_run_killed_with_sigkill_leaves_no_server_and_the_rerun_keeps_what_was_answered(env, kill):
    env = {**env, "FAKE_VLLM_DELAY_S": "1.5"}  # answers outlast the kill's polling
    journal = staging_of(env, f"target-completions/{KEY}") / "journal.jsonl"
    process = dagster(materialize_args("target_completions", KEY), env)
    deadline = time.monotonic() + 240
    while not (journal.exists() and journal.read_text().count("\n") >= 2):
        assert process.poll() is None, process.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no answer was journaled in time"
        time.sleep(0.05)
    pids = server_pids(env)
    assert pids and all(alive(pid) for pid in pids)
    if kill == "the run alone":
        os.kill(process.pid, signal.SIGKILL)  # the parent alone: its step process dies with it
    else:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids), f"a server outlived {kill}"
    code, output = run({**env, "FAKE_VLLM_DELAY_S": "0"})
    assert code == 0, output[-4000:]
    assert sorted(stored_records(env)) == list(range(6))
    summary = re.search(r"\((\d+) generated now, 0 already in the store, (\d+) recovered from local", output)
    assert summary, output[-3000:]
    generated, recovered = int(summary[1]), int(summary[2])
    assert recovered >= 1 and generated + recovered == 6  # what the killed run answered was kept
    assert output.count("fake vllm: answered") == generated  # and never asked for again
