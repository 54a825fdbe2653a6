"""`drafter_evaluations` end to end: a drafter trained on the demo target, measured on its held-out rows and
on two prompt sets of the user's own (a ShareGPT file and an OpenAI-messages file, rows training never
saw), with a real Dagster instance and a local store. Every output is the target's own, τ is what z-lab's
`dflash_generate` measures on the same prompts, the check judges it against the floor, and
`dflash-assets compare` reads the stored evaluations back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dagster import AssetCheckKey, AssetCheckSeverity, AssetKey

from dflash_assets.conversations.datasets import bundled_dataset_path
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import make_dagster_home, open_instance
from dflash_assets_tests.support.in_process import environment, materialize_here

RUN = "evaluated"
SETS = ("held_out", "chat_sharegpt", "chat_messages")
COMPARED = ("held_out", "chat_messages", "chat_sharegpt")  # as `compare` lists a run's sets: held_out first
PROMPTS, NEW_TOKENS = 4, 24
# Two training steps: a drafter that barely learnt, which is what the floor beside it is for.
# The trainer's checkpoint evaluation takes its prompts and budget from DFLASH_EVAL_PROMPTS/_NEW_TOKENS.
TRAIN = {"max_steps": 2, "global_batch_size": 6, "num_anchors": 16, "eval_samples": 4, "max_length": 256}
UNSEEN_ROWS = range(400, 406)  # the bundled data's rows past both trained ranges (0-47)
SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


def _write_sets(root: Path) -> dict[str, Path]:
    """The bundled rows training never saw, once as ShareGPT records and once as OpenAI messages."""
    lines = bundled_dataset_path().read_text().splitlines()
    rows = [json.loads(lines[i]) for i in UNSEEN_ROWS]
    sharegpt = root / "sharegpt.jsonl"
    sharegpt.write_text(
        "".join(
            json.dumps({"id": f"row-{i}", "conversations": [
                {"from": SHAREGPT_FROM[m["role"]], "value": m["content"]} for m in row["messages"]
            ]}) + "\n"
            for i, row in zip(UNSEEN_ROWS, rows, strict=True)
        )
    )  # fmt: skip
    messages = root / "messages.jsonl"
    messages.write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in rows))
    return {"chat_sharegpt": sharegpt, "chat_messages": messages}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, demo_ranges, demo_model_dir):
    """The shared demo ranges in a local store, a short training run on them, then `drafter_evaluations`
    of every set, each materialised as a user would (definitions rebuilt under `DFLASH_EVAL_SETS`)."""
    root = tmp_path_factory.mktemp("evaluations")
    store_url = str(root / "store")
    demo_ranges.copy_to(open_store(store_url))
    files = _write_sets(root)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DFLASH_"))},
        "DAGSTER_HOME": make_dagster_home(root / "dagster-home"),
        "DFLASH_HOME": str(root / "home"),
        "DFLASH_CACHE_DIR": str(demo_model_dir.parent),
        "DFLASH_SAMPLES_PER_PARTITION": "24",
        "DFLASH_STORE_URL": store_url,
        "DFLASH_RUN_NAME": RUN,
        "DFLASH_EVAL_SETS": ",".join(f"{name}={path}" for name, path in files.items()),
        "DFLASH_EVAL_PROMPTS": str(PROMPTS),
        "DFLASH_EVAL_NEW_TOKENS": str(NEW_TOKENS),
        "OMP_NUM_THREADS": "1",
    }
    trained = materialize_here("drafter_checkpoints", None, env, config={"drafter_checkpoints": TRAIN})
    assert trained.success, trained.output[-4000:]
    runs = {name: materialize_here("drafter_evaluations", name, env) for name in SETS}
    for name, run in runs.items():
        assert run.success, f"{name}: {run.output[-4000:]}"
    return {"env": env, "store": open_store(store_url), "runs": runs, "model_dir": demo_model_dir,
            "trained": trained}  # fmt: skip


def _record(evaluated: dict, name: str) -> dict:
    return json.loads(evaluated["store"].get_bytes(f"evaluations/{RUN}/{name}/evaluation.json"))


def test_each_set_reports_tau_beside_the_floor_and_every_output_is_the_targets_own(evaluated):
    for name in SETS:
        metadata = evaluated["runs"][name].metadata
        assert {"tau", "floor_tau", "prompts", "lossless_prompts"} <= set(metadata), name
        assert metadata["prompts"] == PROMPTS, name
        # Greedy speculative decoding is lossless, for the trained drafter and for prompt lookup alike.
        assert metadata["lossless_prompts"] == metadata["floor_lossless_prompts"] == PROMPTS, name
        assert metadata["tau"] >= 1.0 and metadata["floor_tau"] >= 1.0, name
        assert metadata["prompt_set"] == name and metadata["run"] == RUN
        record = _record(evaluated, name)
        assert (record["tau"], record["floor_tau"]) == (metadata["tau"], metadata["floor_tau"])
        assert record["max_new_tokens"] == NEW_TOKENS and record["drafter"]["mismatched"] == []
        assert record["training"]["drafter_arch"] and record["training"]["steps"] == TRAIN["max_steps"]
        manifest = read_manifest(evaluated["store"], f"evaluations/{RUN}/{name}")
        assert manifest is not None and manifest["objects"] == {"evaluation.json": len(
            evaluated["store"].get_bytes(f"evaluations/{RUN}/{name}/evaluation.json"))}  # fmt: skip
        assert (manifest["tau"], manifest["floor_tau"]) == (record["tau"], record["floor_tau"])
    assert _record(evaluated, "held_out")["prompt_locations"][0].startswith("sample ")
    # The user's sets: their first rows, as the files number them.
    for name in ("chat_sharegpt", "chat_messages"):
        assert _record(evaluated, name)["prompt_locations"] == [f"line {i}" for i in range(1, PROMPTS + 1)]
    # One conversation per line, whichever layout it was written in: the same prompts.
    assert (
        _record(evaluated, "chat_sharegpt")["prompt_tokens"]
        == _record(evaluated, "chat_messages")["prompt_tokens"]
    )


def test_the_trainers_final_figure_is_the_held_out_evaluations_tau_exactly(evaluated):
    """One measurement, one held-out rule, the export's weights: the run's last curve point and its metadata's
    τ are what `drafter_evaluations` measures on `held_out` at the same prompts and budget, to the bit."""
    trained, measured = evaluated["trained"].metadata, evaluated["runs"]["held_out"].metadata
    manifest = read_manifest(evaluated["store"], f"checkpoints/{RUN}")
    record = _record(evaluated, "held_out")
    assert trained["acceptance_length_tau"] == measured["tau"] == record["tau"]
    assert manifest["curve"][-1]["tau"] == manifest["acceptance_length_tau"] == record["tau"]
    assert trained["spec_matches_target_greedy"] is True and measured["lossless_prompts"] == PROMPTS


def test_a_second_evaluation_of_the_same_prompts_reuses_the_targets_greedy_output_and_the_floor(evaluated):
    """The reference depends on the target, the prompts and the budget only: stored by the first evaluation
    of a set of prompts, read by the next one, which then runs only the drafter's loop, to the same figures.
    The two user sets are the same rows in two layouts, the same prompts: the second reused the first's."""
    sharegpt, messages = _record(evaluated, "chat_sharegpt"), _record(evaluated, "chat_messages")
    assert (sharegpt["reference_reused"], messages["reference_reused"]) == (False, True)
    assert messages["floor"] == sharegpt["floor"] and messages["tau"] == sharegpt["tau"]
    assert len(list(evaluated["store"].list("evaluation-references/"))) == 2  # held_out's, the chat rows'
    first = _record(evaluated, "held_out")
    assert first["reference_reused"] is False
    again = materialize_here("drafter_evaluations", "held_out", evaluated["env"])
    assert again.success, again.output[-3000:]
    second = _record(evaluated, "held_out")
    assert second["reference_reused"] is True and second["greedy_seconds"] < first["greedy_seconds"]
    assert (second["tau"], second["floor"]) == (first["tau"], first["floor"])
    assert "as decoded before" in again.output and "as measured before" in again.output
    assert len(list(evaluated["store"].list("evaluation-references/"))) == 2


def test_the_check_warns_when_the_drafter_is_below_the_floor_and_names_the_set_and_both_figures(evaluated):
    key = AssetCheckKey(AssetKey("drafter_evaluations"), "tau_at_least_floor")
    with open_instance(evaluated["env"]["DAGSTER_HOME"]) as instance:
        history = instance.event_log_storage.get_asset_check_execution_history(key, limit=10)
    by_set = {}
    for execution in history:
        by_set.setdefault(execution.partition, execution.event.dagster_event.event_specific_data)
    assert set(by_set) == set(SETS)
    for name, check in by_set.items():
        record = _record(evaluated, name)
        assert check.passed == (record["tau"] >= record["floor_tau"]), name
        assert check.severity == AssetCheckSeverity.WARN
        assert check.description.startswith(f"{name}: the drafter's τ {record['tau']:.3f} is ")
        assert f"the prompt-lookup floor's τ {record['floor_tau']:.3f}" in check.description


def test_tau_is_what_z_labs_dflash_generate_measures_on_the_same_prompts(evaluated, tmp_path):
    """The product's loop against z-lab's own `dflash_generate` on the export: the same tokens per round."""
    from dflash_assets.bench.zlab import load_zlab_drafter, zlab_generate
    from dflash_assets.drafter.speculative import stop_token_ids_of
    from dflash_assets.evaluation.loaders import load_prompt_set
    from dflash_assets.evaluation.runs import download_export, run_manifest
    from dflash_assets.target.model import load_target_model

    store, model_dir, env = evaluated["store"], evaluated["model_dir"], evaluated["env"]
    export = download_export(store, RUN, tmp_path / "export")
    drafter, _ = load_zlab_drafter(export)
    target = load_target_model(model_dir, "cpu")
    stops = sorted(stop_token_ids_of(str(model_dir)))
    for name in SETS:
        with environment(env):
            prompts = load_prompt_set(
                name, env["DFLASH_EVAL_SETS"], object_store=store, run_manifest=run_manifest(store, RUN),
                target_dir=model_dir, count=PROMPTS, new_tokens=NEW_TOKENS, cache_dir=tmp_path / "cache",
            )  # fmt: skip
        record = _record(evaluated, name)
        assert [p.location for p in prompts.prompts] == record["prompt_locations"]
        assert [len(p.token_ids) for p in prompts.prompts] == record["prompt_tokens"]
        lengths = []
        for prompt in prompts.prompts:
            _, rounds = zlab_generate(drafter, target, prompt.token_ids, NEW_TOKENS, stops)
            lengths += rounds
        assert record["drafter"]["rounds"] == len(lengths), name
        assert record["tau"] == pytest.approx(sum(lengths) / len(lengths), rel=0.02), name


def _compare(env: dict, *args: str) -> subprocess.CompletedProcess:
    command = Path(sys.executable).with_name("dflash-assets")
    return subprocess.run(
        [str(command), "compare", *args], env=env, capture_output=True, text=True, timeout=120
    )


def test_compare_lists_the_run_with_every_set_as_text_markdown_and_json(evaluated):
    env = evaluated["env"]
    text = _compare(env, RUN)
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0].startswith("run ") and "floor τ" in lines[0]
    assert [line.split()[:2] for line in lines[1:]] == [[RUN, name] for name in COMPARED]
    markdown = _compare(env, "--markdown")  # every run evaluated: this one
    assert markdown.returncode == 0, markdown.stderr
    rows = markdown.stdout.splitlines()
    assert rows[0].startswith("| run | set |") and rows[1].startswith("|---|")
    assert [row.split(" | ")[1] for row in rows[2:]] == list(COMPARED)
    listed = _compare(env, RUN, "--json")
    assert listed.returncode == 0, listed.stderr
    found = {row["prompt_set"]: row for row in json.loads(listed.stdout)}
    assert set(found) == set(SETS)
    for name, row in found.items():
        record = _record(evaluated, name)
        assert (row["run"], row["tau"], row["floor_tau"]) == (RUN, record["tau"], record["floor_tau"])
        assert row["lossless_prompts"] == PROMPTS and row["stale"] is False
        assert row["steps"] == TRAIN["max_steps"] and row["parameters"] > 0
        # What it trained on: the two ranges' 48 conversations less the 4 held out, and their answer tokens.
        manifest = read_manifest(evaluated["store"], f"checkpoints/{RUN}")
        assert (
            row["training_conversations"] == manifest["training_conversations"] == 48 - TRAIN["eval_samples"]
        )
        assert row["training_answer_tokens"] == manifest["training_answer_tokens"] > 0


def test_compare_of_a_run_never_trained_is_one_line_naming_it(evaluated):
    done = _compare(evaluated["env"], "never-trained")
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "'never-trained'" in lines[0] and "drafter_checkpoints" in lines[0], (
        done.stderr
    )
