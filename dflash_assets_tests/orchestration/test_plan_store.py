"""`dflash-assets plan` for the seeds' node (Qwen3.6-27B shape, 8 H200s, 914 K samples of 2,017 tokens)
and the store: without a rate the offline line says what all its ranks need and warns; with
`--store-gbps` the offline figure is what the store carries; a saved `bench --only store` measurement of
this store counts, one of another store does not; across nodes the gradient all-reduce is in the rates
and named."""

from __future__ import annotations

import json
import math
import re

import pytest

from dflash_assets import cli
from dflash_assets.planning.store_result import save_store_result, store_result_path
from dflash_assets.planning.training_split import DEFAULT_INTER_NODE_GBPS
from dflash_assets_tests.orchestration.test_plan_split import SEEDS, config_only_27b  # noqa: F401

SEEDS_NODE = [*SEEDS, "--online-target-devices", "7"]
pytestmark = pytest.mark.usefixtures("config_only_27b")  # the Qwen3.6-27B-shaped config-only target


def _plan(capsys, *extra: str) -> tuple[str, dict]:
    assert cli.main(["plan", *SEEDS_NODE, *extra]) == 0
    text = capsys.readouterr().out
    assert cli.main(["plan", "--json", *SEEDS_NODE, *extra]) == 0
    return text, json.loads(capsys.readouterr().out)


def _offline_block(text: str) -> str:
    return text[text.index("  offline") : text.index("  choice")]


def test_without_a_store_rate_the_offline_line_states_what_all_eight_ranks_need_and_warns(
    capsys,
):
    text, plan = _plan(capsys)
    offline = plan["training_split"]["offline"]
    bytes_per_token = plan["training_split"]["store"]["bytes_per_token"]
    assert 61_445 < bytes_per_token < 61_446  # 5 taps and the final state × 5120 × bf16, ids, mask, header
    assert offline["tokens_per_s"] == pytest.approx(8 * 25_100) and offline["store_bytes_per_s"] is None
    assert offline["read_bytes_per_s_needed"] == pytest.approx(8 * 25_100 * bytes_per_token)
    assert "needs 11.5 GiB/s from the store for 8 ranks" in _offline_block(text)
    warning = next(w for w in plan["warnings"] if "store's rate is unknown" in w)
    assert "11.5 GiB/s from the store for 8 ranks" in warning and "bench --only store" in warning
    # Offline on an unmeasured store is never the choice; the reason says what it would take.
    assert plan["training_split"]["choice"] == "online"
    assert "only if the store delivers 11.5 GiB/s" in plan["training_split"]["choice_reason"]


def test_with_store_gbps_the_offline_figure_is_what_the_store_carries(capsys):
    text, plan = _plan(capsys, "--store-gbps", "2")
    split = plan["training_split"]
    offline = split["offline"]
    assert offline["tokens_per_s"] <= 2e9 / 61_445  # what 2 GB/s (10^9 bytes a second) carries
    assert offline["tokens_per_s"] == math.floor(2e9 / split["store"]["bytes_per_token"])
    assert offline["bottleneck"] == "store" and offline["compute_tokens_per_s"] == pytest.approx(200_800)
    assert offline["days"] == pytest.approx(split["tokens_to_train"] / offline["tokens_per_s"] / 86400)
    block = _offline_block(text)
    assert f"{offline['tokens_per_s']:,.0f} tokens/s" in block and "store-bound" in block
    assert "--store-gbps 2" in block
    assert not any("store's rate is unknown" in w for w in plan["warnings"])
    # fp8 halves the bytes a token: offline in fp8 (extraction first) beats online's 2.6 days here.
    options = {option["name"]: option for option in split["options"]}
    assert options["offline in fp8"]["tokens_per_s"] == pytest.approx(2 * offline["tokens_per_s"], rel=1e-3)
    assert options["offline in bf16"]["days"] > options["online"]["days"] > options["offline in fp8"]["days"]
    assert split["choice"] == "offline in fp8"
    assert "DFLASH_HIDDEN_STATE_DTYPE=fp8" in split["choice_reason"] and "  choice" in text


def test_across_two_nodes_the_gradient_all_reduce_is_named_and_in_every_rate(capsys):
    text, plan = _plan(capsys, "--nodes", "2")
    split = plan["training_split"]
    allreduce = split["gradient_allreduce"]
    seconds = allreduce["gradient_bytes"] / (DEFAULT_INTER_NODE_GBPS * 1e9)  # 2(N-1)/N = 1 at two nodes
    assert allreduce["seconds_per_step"] == pytest.approx(seconds)
    assert allreduce["step_tokens"] == pytest.approx(32 * 2017)
    assert re.search(r"  gradient all-reduce +\S+ GiB of float32 gradients a step between 2 nodes", text)
    offline = split["offline"]
    step = allreduce["step_tokens"]
    assert offline["compute_tokens_per_s"] == pytest.approx(16 * 25_100)
    assert offline["tokens_per_s"] == pytest.approx(step / (step / (16 * 25_100) + seconds))
    best = split["recommended"]
    assert best["tokens_per_s"] == pytest.approx(step / (step / best["compute_tokens_per_s"] + seconds))
    assert any("all-reduce takes" in w and "--inter-node-gbps" in w for w in plan["warnings"])
    # A fast link makes two nodes nearly twice one.
    _, fast = _plan(capsys, "--nodes", "2", "--inter-node-gbps", "400")
    assert fast["training_split"]["offline"]["tokens_per_s"] > 1.8 * 200_800


def test_a_saved_measurement_of_this_store_sets_the_rate_and_one_of_another_store_is_set_aside(
    tmp_path, capsys
):
    from dflash_assets.orchestration.resources import StoreResource

    url = StoreResource().store_url()
    measured = {"store": url, "object_bytes": 103_000_000, "read": {"bytes_per_s": 3e9}}
    save_store_result(store_result_path(tmp_path / "cache"), measured)
    text, plan = _plan(capsys)
    offline = plan["training_split"]["offline"]
    assert offline["store_bytes_per_s"] == 3e9 and offline["bottleneck"] == "store"
    assert "bench --only store" in text[text.index("  offline") :]

    save_store_result(store_result_path(tmp_path / "cache"), {**measured, "store": "s3://elsewhere/x"})
    _, other = _plan(capsys)
    assert other["training_split"]["offline"]["store_bytes_per_s"] is None
    assert any("s3://elsewhere/x" in w and "set aside" in w for w in other["warnings"])
