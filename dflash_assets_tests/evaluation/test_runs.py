"""What an evaluation reads of a training run, from a real (local) store: its manifest (a run never trained
is one line naming it), its export (fetched again when the run is exported again), its held-out
samples from the tokenized ranges it trained on, and its evaluations, committed ones only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.conversations.shard import write_shard
from dflash_assets.evaluation.runs import (
    RunNotTrained,
    download_export,
    export_identity,
    held_out_samples,
    read_evaluation,
    run_manifest,
)
from dflash_assets.storage.layout import SHARD_NAME
from dflash_assets.storage.manifest import new_manifest, write_manifest
from dflash_assets.storage.open_store import open_store


@pytest.fixture
def store(tmp_path: Path):
    return open_store(str(tmp_path / "store"))


def _export(store, run: str, weights: bytes) -> None:
    store.put_bytes(f"drafter/{run}/config.json", b'{"block_size": 4}')
    store.put_bytes(f"drafter/{run}/model.safetensors", weights)
    store.put_bytes(f"drafter/{run}/README.md", b"# card")


def test_a_run_never_trained_is_one_line_naming_it_and_what_to_materialise(store, tmp_path):
    with pytest.raises(RunNotTrained) as missing:
        run_manifest(store, "nowhere")
    message = str(missing.value)
    assert "training run 'nowhere' is not in" in message and "materialise drafter_checkpoints" in message
    assert "\n" not in message
    with pytest.raises(RunNotTrained, match="training run 'nowhere' has no export in"):
        download_export(store, "nowhere", tmp_path / "exports")
    assert export_identity(store, "nowhere") is None


def test_the_export_is_fetched_once_and_again_when_the_run_is_exported_again(store, tmp_path):
    _export(store, "r1", b"A" * 64)
    store.put_bytes("drafter/r1/step_00000002/model.safetensors", b"not the export")  # not flat: not read
    first = download_export(store, "r1", tmp_path / "exports")
    assert sorted(p.name for p in first.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (first / "model.safetensors").read_bytes() == b"A" * 64
    assert download_export(store, "r1", tmp_path / "exports") == first  # the same content: the same copy
    identity = export_identity(store, "r1")

    _export(store, "r1", b"B" * 64)  # trained again: new weights of the same size
    assert export_identity(store, "r1") != identity
    again = download_export(store, "r1", tmp_path / "exports")
    assert (again / "model.safetensors").read_bytes() == b"B" * 64
    assert [p.name for p in (tmp_path / "exports").iterdir()] == [again.name]  # the older copy is gone


def test_an_evaluation_is_read_once_committed_and_one_written_but_never_committed_reads_as_none(store):
    record = {"run": "r1", "prompt_set": "held_out", "tau": 2.5}
    body = json.dumps(record).encode()
    store.put_bytes("evaluations/r1/held_out/evaluation.json", body)  # a step that died before its manifest
    assert read_evaluation(store, "r1", "held_out") is None
    manifest = new_manifest("drafter_evaluations", "held_out", {"evaluation.json": len(body)})
    write_manifest(store, "evaluations/r1/held_out", manifest)
    assert read_evaluation(store, "r1", "held_out") == record
    assert read_evaluation(store, "r1", "code") is None and read_evaluation(store, "r2", "held_out") is None


def test_held_out_samples_are_read_from_the_ranges_the_run_trained_on(store, tmp_path):
    ranges = {
        "00000000-00000003": [TokenizedSample(i, [1, 2, i], [0, 1, 1]) for i in range(4)],
        "00000004-00000007": [TokenizedSample(i, [3, i], [0, 1]) for i in range(4, 8)],
    }
    for key, samples in ranges.items():
        prefix = f"tokenized-completions/{key}"
        size = write_shard(samples, tmp_path / key / SHARD_NAME)
        store.put_bytes(f"{prefix}/{SHARD_NAME}", (tmp_path / key / SHARD_NAME).read_bytes())
        write_manifest(store, prefix, new_manifest("tokenized_completions", key, {SHARD_NAME: size}))
    manifest = {"trained_partitions": list(ranges), "eval_sample_indices": [6, 1, 5]}
    found = held_out_samples(store, manifest, tmp_path / "cache")
    assert found == [ranges["00000000-00000003"][1], ranges["00000004-00000007"][1:3][0],
                     ranges["00000004-00000007"][2]]  # fmt: skip
    assert held_out_samples(store, {**manifest, "eval_sample_indices": []}, tmp_path / "cache") == []
