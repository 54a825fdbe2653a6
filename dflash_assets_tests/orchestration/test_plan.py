"""`dflash-assets plan` checked against what materialising stores: the plan's bytes are the store's, in bf16
and in fp8, and `tokenized_completions` records the same totals. Both run in this process, each under the
environment a user would set (the settings are read when they run)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest
from dagster import AssetKey

from dflash_assets.extraction.sample_format import parse_sample_object_name, read_sample
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import make_dagster_home, open_instance, shared_tmp_dir
from dflash_assets_tests.support.in_process import environment, materialize_here
from dflash_assets_tests.support.shared import build_once

KEY = "00000000-00000023"
PLAN_KEYS = (
    "samples",
    "tokens",
    "bytes_per_token",
    "hidden_state_bytes",
    "staging_bytes_needed",
    "extraction_hours",
    "upload_bytes_per_s_needed",
    "offline_read_bytes_per_s",
    "warnings",
)


def _plan(env: dict[str, str], *extra: str) -> dict:
    """`dflash-assets plan --json` under `env`, in this process (the plan reads its settings when it runs)."""
    from dflash_assets import cli

    printed = io.StringIO()
    with environment(env), contextlib.redirect_stdout(printed):
        assert cli.main(["plan", "--json", *extra]) == 0
    return json.loads(printed.getvalue())


def _materialize(env: dict[str, str]) -> None:
    run = materialize_here("tokenized_completions,hidden_state_partitions", KEY, env)
    assert run.success, run.output[-4000:]


def _stored_objects(store_url: str) -> dict[str, int]:
    store = open_store(store_url)
    return {
        info.key: info.size
        for info in store.list(f"hidden-states/{KEY}/")
        if parse_sample_object_name(info.key.rsplit("/", 1)[-1]) is not None
    }


@pytest.fixture(scope="module")
def planned_and_stored(tmp_path_factory, demo_model_dir, demo_ranges):
    """The plan on embedded defaults (24-sample ranges), then one range in each dtype: bf16 is
    conftest's `demo_ranges`, fp8 is materialised here into a copy of
    its instance, so one instance records both. Built once per test run (`build_once`)."""

    def build(root: Path) -> dict:
        env = {
            **os.environ,
            "DFLASH_HOME": str(root / "home"),
            "DFLASH_CACHE_DIR": str(demo_model_dir.parent),
            "DAGSTER_HOME": make_dagster_home(root / "dagster-home"),
            "DFLASH_SAMPLES_PER_PARTITION": "24",
            "OMP_NUM_THREADS": "1",
        }
        plan = _plan(env)
        assert demo_ranges.keys[0] == KEY and demo_ranges.env["DFLASH_SAMPLES_PER_PARTITION"] == "24"
        instance = root / "instance"
        shutil.copytree(demo_ranges.dagster_home, instance)
        stores = {"bf16": {**env, "DAGSTER_HOME": str(instance), "DFLASH_STORE_URL": demo_ranges.store_url}}
        fp8 = {"DFLASH_HIDDEN_STATE_DTYPE": "fp8", "DFLASH_STORE_URL": str(root / "store-fp8")}
        stores["fp8"] = {**stores["bf16"], **fp8}
        _materialize(stores["fp8"])
        return {"plan": plan, "stores": stores, "env": env}

    return build_once(shared_tmp_dir(tmp_path_factory) / "plan", build)


def test_the_plan_has_every_figure_the_issue_names_and_is_exact_when_every_row_is_tokenized(
    planned_and_stored,
):
    plan = planned_and_stored["plan"]
    assert all(key in plan for key in PLAN_KEYS)
    assert plan["estimate"]["exact"] and plan["rows"] == 500 and plan["ranges"] == 21
    assert plan["hidden_state_dtype"] == "bf16"
    assert plan["bytes_per_token"] == (5 + 1) * 64 * 2 + 5  # 5 taps and the final state
    assert set(plan["device_memory"]) == {"extraction", "regeneration", "training", "evaluation"}
    assert plan["extraction_hours"]["devices_1"] > 0 and plan["offline_read_bytes_per_s"] > 0
    assert any("DFLASH_HIDDEN_STATE_DTYPE=fp8" in warning for warning in plan["warnings"])


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_planned_bytes_are_the_bytes_the_store_holds_after_materialising(planned_and_stored, dtype):
    planned = next(r for r in planned_and_stored["plan"]["per_range"] if r["partition"] == KEY)
    stored = _stored_objects(planned_and_stored["stores"][dtype]["DFLASH_STORE_URL"])
    assert len(stored) == planned["objects"]
    assert sum(stored.values()) == planned["hidden_state_bytes_by_dtype"][dtype]  # to the byte
    store = open_store(planned_and_stored["stores"][dtype]["DFLASH_STORE_URL"])
    assert read_sample(store.get_bytes(next(iter(stored)))).hidden_state_dtype == dtype


def test_fp8_objects_are_about_half_the_bf16_ones(planned_and_stored):
    sizes = {
        d: sum(_stored_objects(env["DFLASH_STORE_URL"]).values())
        for d, env in planned_and_stored["stores"].items()
    }
    assert 0.5 < sizes["fp8"] / sizes["bf16"] < 0.56


def test_tokenized_completions_records_the_range_and_run_totals_and_a_replan_reads_the_store(
    planned_and_stored,
):
    env = planned_and_stored["stores"]["bf16"]
    planned = next(r for r in planned_and_stored["plan"]["per_range"] if r["partition"] == KEY)
    with open_instance(env["DAGSTER_HOME"]) as instance:
        events = instance.fetch_materializations(AssetKey("tokenized_completions"), limit=10).records
    metadata = [e.asset_materialization.metadata for e in events if e.asset_materialization.partition == KEY]
    recorded = {m["plan_hidden_state_dtype"].value: m for m in metadata}
    for dtype in ("bf16", "fp8"):
        assert (
            recorded[dtype]["plan_range_hidden_state_bytes"].value
            == planned["hidden_state_bytes_by_dtype"][dtype]
        )
    whole_run = recorded["bf16"]["plan_run_hidden_state_bytes"].value
    exact_total = planned_and_stored["plan"]["hidden_state_bytes"]
    assert whole_run == pytest.approx(exact_total, rel=0.25)  # the other 20 ranges extrapolated from this one
    assert recorded["bf16"]["plan_run_ranges_estimated"].value == 20

    replanned = _plan(env)
    sources = {r["partition"]: r["source"] for r in replanned["per_range"]}
    assert sources[KEY] == "tokenized" and replanned["hidden_state_bytes"] == exact_total
