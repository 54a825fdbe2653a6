"""`dflash-assets bench` runs and prints its ratios (the figures themselves are read, not asserted: the
machine is shared)."""

from __future__ import annotations

import re

import pytest

from dflash_assets import cli


@pytest.mark.slow
def test_the_generation_row_compares_the_batched_engine_with_one_conversation_at_a_time(
    capsys, monkeypatch, tmp_path, demo_model_dir
):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(demo_model_dir.parent))
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    assert cli.main(["bench", "--quick", "--only", "generation"]) == 0
    out = capsys.readouterr().out
    ratio = re.search(
        r"^\s+([\d.]+)\s+generation tokens/s, batched in-process engine / one conversation", out, re.M
    )
    assert ratio and float(ratio.group(1)) > 0
    assert "batched answers equal the one-at-a-time answers: True" in out


@pytest.mark.slow  # a torchrun launch of 2 ranks: ~11 s of process starts and teardown on 2 cores
def test_the_scaling_row_divides_two_launched_ranks_samples_per_second_by_one_ranks(
    capfd, monkeypatch, tmp_path, demo_model_dir
):
    monkeypatch.setenv("DFLASH_CACHE_DIR", str(demo_model_dir.parent))
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    assert cli.main(["bench", "--quick", "--only", "scaling"]) == 0
    out = capfd.readouterr().out  # capfd: the launcher writes to this process's stdout descriptor

    def figure(pattern: str) -> float:
        found = re.search(rf"^\s+([\d.]+)\s+training samples/s, {pattern}", out, re.M)
        assert found, f"no row {pattern!r} in:\n{out}"
        return float(found.group(1))

    ratio = figure("2 ranks / 1 rank")
    one, two = figure("1 rank on 1 core"), figure("2 ranks on 2 cores")
    assert one > 0 and two > 0 and ratio == pytest.approx(two / one, abs=2e-3)
    # The two measurements are what rank 0's outcome says they were: one rank here, two launched ranks
    # (a world of 2 only exists once both joined the process group).
    runs = {int(m.group(1)): m.group(0) for m in re.finditer(r"^  (\d) rank\(s\): .*$", out, re.M)}
    assert "in this process" in runs[1] and "world size 1 on cpu:0 (rank 0's outcome)" in runs[1]
    assert "launched by torch.distributed.run" in runs[2]
    assert "world size 2 on cpu:0, cpu:1 (rank 0's outcome)" in runs[2]


@pytest.mark.slow  # a moto server and a proxy process, 256 small objects a side over three rounds
def test_the_store_bench_measures_the_configured_store_saves_it_for_the_plan_and_prints_the_feed_row(
    capsys, monkeypatch, tmp_path, demo_model_dir, s3_store_url
):
    import json

    from dflash_assets.planning.store_result import load_store_result, store_result_path

    monkeypatch.setenv("DFLASH_CACHE_DIR", str(demo_model_dir.parent))
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    monkeypatch.setenv("DFLASH_STORE_URL", s3_store_url)
    result_path = store_result_path(demo_model_dir.parent)
    monkeypatch.setattr(
        "dflash_assets.planning.store_result.store_result_path", lambda _: tmp_path / "s.json"
    )
    assert cli.main(["bench", "--quick", "--only", "store"]) == 0
    out = capsys.readouterr().out

    def figure(name: str) -> float:
        found = re.search(rf"^\s+([\d.]+)\s+{re.escape(name)}$", out, re.M)
        assert found, f"no row {name!r} in:\n{out}"
        return float(found.group(1))

    assert figure("store: read GB/s (training reader)") > 0 and figure("store: write objects/s") > 0
    assert figure("feed: training reader / plain GETs, objects/s (25 ms proxy)") > 0
    # One GET an object on both sides: no HEAD before a GET.
    assert (
        figure("feed: training reader requests an object")
        == figure("feed: plain GETs requests an object")
        == 1
    )
    assert figure("feed: training reader client CPU ms an object") > 0
    saved = load_store_result(tmp_path / "s.json")
    assert saved is not None and saved["store"] == s3_store_url and saved["read"]["bytes_per_s"] > 0
    assert saved["read"]["requests"] == {"GET": saved["objects"]}  # the training reader: one GET each
    assert not result_path.exists() or json.loads(result_path.read_text())["store"] != s3_store_url
    # The plan takes the measured rate for this store.
    assert cli.main(["plan", "--json", "--samples", "1000", "--mean-tokens", "100"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["training_split"]["offline"]["store_bytes_per_s"] == saved["read"]["bytes_per_s"]


def test_the_store_bench_moves_objects_of_the_stored_size_final_state_included(tmp_path):
    from dflash_assets.bench.store import ObjectShape
    from dflash_assets.extraction.object_size import bytes_per_token

    def size(final_state: bool) -> int:
        shape = ObjectShape(300, [1, 3, 5], 64, "bf16", "t", "test", final_state=final_state)
        return shape.write(tmp_path / f"hs_{int(final_state)}.safetensors")

    # One more [T, H] slot of bf16 states, the final state the capture stores by default (and its header
    # entry): the bench's objects are the stored objects' size.
    extra = 300 * (bytes_per_token(3, 64, "bf16", True) - bytes_per_token(3, 64, "bf16"))
    assert extra == 300 * 64 * 2
    assert 0 <= size(True) - size(False) - extra < 256
