"""Extracting a sample range into a store: correct tensors, resume exactly once, never mixing producers."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.extract import (
    PartitionBusy,
    extraction_fingerprint,
)
from dflash_assets.extraction.sample_format import (
    NonFiniteHiddenStates,
    estimate_sample_nbytes,
    read_sample,
    sample_object_name,
)
from dflash_assets.storage.layout import FINGERPRINT_NAME, MANIFEST_NAME
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.store import StoreError
from dflash_assets.storage.uploader import UploadError
from dflash_assets.target.model import load_target_model
from dflash_assets_tests.support.extraction import (
    DEFAULT_LAYERS,
    MODEL_NAME,
    PREFIX,
    Extraction,
    make_samples,
    stored_objects,
)
from dflash_assets_tests.support.stores import Sampler, SlowLocalStore, WatchedStore, staged_disk_bytes
from dflash_assets_tests.support.targets import (
    BF16_ATOL,
    BF16_RTOL,
    TINY_LAYERS,
    reference_hidden_states,
)


def test_a_complete_run_stores_one_object_per_sample_equal_to_hf_hidden_states(store_url, target, tmp_path):
    store = open_store(store_url)
    samples = make_samples()
    extraction = Extraction(store, tmp_path / "staging")
    result = extraction.run(target, samples)

    names = [sample_object_name(s.sample_index) for s in samples]
    assert sorted(result.objects) == sorted(names)
    assert "hs_00000105.safetensors" not in result.objects  # the dropped row leaves a gap
    objects = stored_objects(store)
    assert sorted(objects) == sorted(names)
    for sample in samples:
        data = objects[sample_object_name(sample.sample_index)]
        assert result.objects[sample_object_name(sample.sample_index)] == len(data)
        stored = read_sample(data)
        assert stored.sample_index == sample.sample_index and stored.target_model == MODEL_NAME
        assert stored.target_layer_ids == DEFAULT_LAYERS and stored.hidden_size == 64
        assert stored.input_ids.tolist() == sample.input_ids and stored.loss_mask.tolist() == sample.loss_mask
        assert stored.hidden_states.shape == (sample.num_tokens, len(DEFAULT_LAYERS), 64)
        reference = reference_hidden_states(target, sample.input_ids)
        for slot, layer_id in enumerate(DEFAULT_LAYERS):
            torch.testing.assert_close(
                stored.hidden_states[:, slot],
                reference[layer_id + 1].bfloat16(),
                atol=BF16_ATOL,
                rtol=BF16_RTOL,
            )

    assert result.samples == len(samples) and result.extracted_now == len(samples)
    assert result.reused_from_store == 0 and result.reused_from_staging == 0
    assert result.tokens == sum(s.num_tokens for s in samples)
    assert result.bytes_stored == sum(len(b) for b in objects.values())
    assert result.computed_tokens >= result.tokens and 0 <= result.padding_fraction < 1
    assert result.samples_per_s > 0 and result.tokens_per_s > 0 and result.device == "cpu:0"
    assert 0 < result.peak_staging_bytes <= 64 * 2**20
    fingerprint = json.loads(store.get_bytes(f"{PREFIX}/{FINGERPRINT_NAME}"))
    assert fingerprint == extraction_fingerprint(MODEL_NAME, DEFAULT_LAYERS, 64) == result.fingerprint
    assert not extraction.staging_dir.exists(), "uploaded files are deleted locally, then the directory"


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_with_the_final_state_every_object_holds_what_the_lm_head_reads_and_one_layer_s_bytes_more(
    target, tmp_path, dtype
):
    """`final_hidden_states` is transformers' `hidden_states[-1]` (after the final norm), in the stored dtype,
    beside the layers as before: an object is 1 + 1/k times the layers' bytes."""
    from dflash_assets.extraction.object_size import sample_object_nbytes
    from dflash_assets_tests.support.targets import assert_within_e4m3_rounding

    samples = make_samples(5)
    with_final = Extraction(open_store(str(tmp_path / "with")), tmp_path / "staging-with")
    result = with_final.run(target, samples, final_state=True, hidden_state_dtype=dtype)
    without = Extraction(open_store(str(tmp_path / "without")), tmp_path / "staging-without")
    plain = without.run(target, samples, hidden_state_dtype=dtype)
    assert result.fingerprint["final_hidden_states"] is True
    assert "final_hidden_states" not in plain.fingerprint  # a range made before it keeps its fingerprint
    objects, plain_objects = stored_objects(with_final.store), stored_objects(without.store)
    layers = len(DEFAULT_LAYERS)
    for sample in samples:
        name = sample_object_name(sample.sample_index)
        stored, before = read_sample(objects[name]), read_sample(plain_objects[name])
        assert stored.metadata["final_hidden_states"] == "1" and before.metadata["final_hidden_states"] == "0"
        assert not before.has_final_state and torch.equal(stored.hidden_states, before.hidden_states)
        with torch.inference_mode():
            out = target(torch.tensor([sample.input_ids]), output_hidden_states=True)
        reference = out.hidden_states[-1][0]  # after the final norm: what the LM head reads
        if dtype == "bf16":
            torch.testing.assert_close(
                stored.final_hidden_states, reference.bfloat16(), atol=BF16_ATOL, rtol=BF16_RTOL
            )
        else:
            assert stored.final_hidden_states_scale.shape == (sample.num_tokens,)
            assert_within_e4m3_rounding(stored.final_dequantized(), reference, slack=1e-3)
        size = sample_object_nbytes(
            sample_index=sample.sample_index, num_tokens=sample.num_tokens, target_layer_ids=DEFAULT_LAYERS,
            target_model=MODEL_NAME, hidden_size=64, dtype=dtype, final_state=True,
        )  # fmt: skip
        assert len(objects[name]) == size == result.objects[name]
        # The tensors (the header aside): 1 + 1/k times the layers' bytes, the ids and mask as before.
        tensors, plain_tensors = _tensor_bytes(objects[name]), _tensor_bytes(plain_objects[name])
        layer_bytes = plain_tensors - 5 * sample.num_tokens
        assert tensors - 5 * sample.num_tokens == layer_bytes * (layers + 1) // layers


def _tensor_bytes(data: bytes) -> int:
    """A safetensors object's bytes past its header."""
    return len(data) - 8 - int.from_bytes(data[:8], "little")


def test_a_range_with_samples_to_extract_logs_the_targets_kernel_path(target, tmp_path):
    extraction = Extraction(LocalStore(tmp_path / "store"), tmp_path / "staging")
    extraction.run(target, make_samples(2), max_tokens_per_batch=64)
    kernels = [line for line in extraction.logs if "kernels: qwen3_5_text" in line]
    assert kernels and "gated-delta-net layers" in kernels[0], extraction.logs


def test_progress_lines_report_rate_eta_staging_uploads_and_device(target, tmp_path):
    extraction = Extraction(LocalStore(tmp_path / "store"), tmp_path / "staging")
    extraction.run(target, make_samples(6), max_tokens_per_batch=64)
    progress = [line for line in extraction.logs if "samples/s" in line and "ETA" in line]
    assert progress, extraction.logs
    for piece in (
        "cpu:0",
        "/6 samples",
        "tokens/s",
        "staging",
        "/ 64.0 MiB",
        "uploads in flight",
        "uploaded",
    ):
        assert piece in progress[-1]


def test_a_rerun_finds_every_object_in_the_store_and_uploads_nothing(target, tmp_path):
    store = LocalStore(tmp_path / "store")
    samples = make_samples(6)
    first = Extraction(store, tmp_path / "staging").run(target, samples)
    again = Extraction(store, tmp_path / "staging")
    second = again.run(target, samples)
    assert second.extracted_now == 0 and second.reused_from_store == 6 and second.computed_tokens == 0
    assert again.uploader.stats.uploaded == 0
    assert second.objects == first.objects


def test_resume_after_a_crash_uploads_each_missing_sample_once_and_matches_an_uninterrupted_run(
    store_url, target, tmp_path
):
    samples = make_samples()
    # Batches of one make every object byte-for-byte reproducible, whatever else is in the run.
    uninterrupted = Extraction(LocalStore(tmp_path / "reference"), tmp_path / "reference-staging")
    uninterrupted.run(target, samples, max_batch_size=1)
    expected = stored_objects(uninterrupted.store)

    # The state a run killed mid-way leaves behind: some objects uploaded, some finished files still
    # staged (one of them already uploaded just before the kill), a temp file of an interrupted
    # write, and a final-named file that is damaged.
    store = open_store(store_url)
    fingerprint = extraction_fingerprint(MODEL_NAME, DEFAULT_LAYERS, 64)
    store.put_bytes(f"{PREFIX}/{FINGERPRINT_NAME}", json.dumps(fingerprint).encode())
    in_store = [s.sample_index for s in samples[:3]]
    for index in in_store:
        name = sample_object_name(index)
        store.put_bytes(f"{PREFIX}/{name}", expected[name])
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / FINGERPRINT_NAME).write_text(json.dumps(fingerprint))
    staged = [s.sample_index for s in samples[3:5]]
    for index in [*staged, in_store[1]]:
        (staging / sample_object_name(index)).write_bytes(expected[sample_object_name(index)])
    temp_index, corrupt_index = samples[5].sample_index, samples[6].sample_index
    temp_name = f".{sample_object_name(temp_index)}.tmp-4242-deadbeef"
    (staging / temp_name).write_bytes(expected[sample_object_name(temp_index)][:100])
    (staging / sample_object_name(corrupt_index)).write_bytes(
        expected[sample_object_name(corrupt_index)][:-7]
    )

    resumed = Extraction(store, staging)
    result = resumed.run(target, samples, max_batch_size=1)

    assert result.reused_from_store == 3 and result.reused_from_staging == 2
    assert result.extracted_now == len(samples) - 5
    # Every missing sample needs one upload; exactly that many happened, so none was uploaded twice
    # and neither the temp file nor the already-uploaded staged copy was sent.
    assert resumed.uploader.stats.uploaded == len(samples) - 3
    assert stored_objects(store) == expected
    assert not any("tmp" in info.key for info in store.list(PREFIX + "/"))
    assert resumed.staged_files() == [] and not (staging / temp_name).exists()
    assert any("unusable" in line and str(corrupt_index) in line for line in resumed.logs)


def test_objects_made_under_another_fingerprint_are_deleted_manifest_first_never_mixed(target, tmp_path):
    store = WatchedStore(tmp_path / "store")
    samples = make_samples(5)
    Extraction(store, tmp_path / "staging").run(target, samples)
    store.put_bytes(f"{PREFIX}/{MANIFEST_NAME}", b'{"objects": {}}')

    changed = Extraction(store, tmp_path / "staging")
    result = changed.run(target, samples, layer_ids=[0, TINY_LAYERS - 2])

    assert result.extracted_now == 5 and result.reused_from_store == 0
    assert store.head(f"{PREFIX}/{MANIFEST_NAME}") is None
    for data in stored_objects(store).values():
        assert read_sample(data).target_layer_ids == [0, TINY_LAYERS - 2]
    assert any("WARNING" in line and "deleting them" in line for line in changed.logs)
    assert store.deletions and store.objects_deleted_under_a_manifest() == []  # un-committed first


def test_objects_without_a_fingerprint_are_not_trusted(target, tmp_path):
    store = LocalStore(tmp_path / "store")
    samples = make_samples(3)
    store.put_bytes(f"{PREFIX}/{sample_object_name(samples[0].sample_index)}", b"from some other tool")
    extraction = Extraction(store, tmp_path / "staging")
    result = extraction.run(target, samples)
    assert result.extracted_now == 3
    assert all(read_sample(data).target_model == MODEL_NAME for data in stored_objects(store).values())
    assert any("no fingerprint" in line for line in extraction.logs)


class FailingStore(LocalStore):
    """A local store whose uploads start failing for good after `healthy_puts` files."""

    def __init__(self, root: Path, healthy_puts: int):
        super().__init__(root)
        self.healthy_puts = healthy_puts

    @property
    def description(self) -> str:
        return f"flaky endpoint at {self.root}"

    def put_file(self, key: str, path: Path):
        if self.healthy_puts <= 0:
            raise StoreError(f"AccessDenied writing {key!r} to {self.description}")
        self.healthy_puts -= 1
        return super().put_file(key, path)


def test_a_store_failure_keeps_finished_files_staged_and_a_rerun_completes_exactly_once(target, tmp_path):
    samples = make_samples()
    staging = tmp_path / "staging"
    failing = Extraction(FailingStore(tmp_path / "store", healthy_puts=4), staging, max_in_flight=1)
    with pytest.raises(UploadError, match="flaky endpoint"):
        failing.run(target, samples, max_batch_size=2)
    left_behind = failing.staged_files()
    assert left_behind, "finished but unconfirmed files stay in staging"
    stored_before = set(stored_objects(LocalStore(tmp_path / "store")))
    assert len(stored_before) == 4
    assert not set(left_behind) & stored_before

    rerun = Extraction(LocalStore(tmp_path / "store"), staging)
    result = rerun.run(target, samples, max_batch_size=2)
    assert result.reused_from_store == 4 and result.reused_from_staging == len(left_behind)
    assert result.extracted_now == len(samples) - 4 - len(left_behind)
    assert rerun.uploader.stats.uploaded == len(samples) - 4
    assert len(result.objects) == len(samples)


def test_staged_bytes_stay_within_the_budget_because_space_is_reserved_before_writing(target, tmp_path):
    """Read off the disk, not the uploader's own counter: a store far slower than the forward, and a
    budget of two samples. Space reserved after a file is written would let the files pile up."""
    samples = make_samples(10)
    one_sample = estimate_sample_nbytes(90, len(DEFAULT_LAYERS), 64, len(MODEL_NAME))
    budget = 2 * one_sample
    staging = tmp_path / "staging"
    extraction = Extraction(
        SlowLocalStore(tmp_path / "store", delay_s=0.1), staging, staging_budget_bytes=budget
    )
    on_disk = {"peak": 0}

    def sample_disk() -> None:
        if staging.exists():
            on_disk["peak"] = max(on_disk["peak"], staged_disk_bytes(staging, samples_only=True))

    with Sampler(sample_disk) as sampler:
        result = extraction.run(target, samples)
    assert len(result.objects) == 10 and sampler.samples > 10
    assert 0 < on_disk["peak"] <= budget
    assert 0 < result.peak_staging_bytes <= budget


def test_a_non_finite_sample_fails_the_run_naming_it_and_leaves_no_object_for_it(target_dir, tmp_path):
    poisoned = load_target_model(target_dir, "cpu")
    with torch.no_grad():
        poisoned.model.embed_tokens.weight[7] = float("nan")
    samples = make_samples(4)
    bad = TokenizedSample(150, [3, 4, 7, 9, 10], [0, 1, 1, 1, 1])
    store = LocalStore(tmp_path / "store")
    with pytest.raises(NonFiniteHiddenStates, match="sample 150") as error:
        Extraction(store, tmp_path / "staging").run(poisoned, [*samples, bad])
    assert error.value.sample_index == 150
    assert store.head(f"{PREFIX}/{sample_object_name(150)}") is None
    assert not (tmp_path / "staging" / sample_object_name(150)).exists()

    result = Extraction(store, tmp_path / "staging").run(poisoned, [*samples, bad], drop_non_finite=True)
    assert list(result.dropped) == [150] and "non-finite" in result.dropped[150]
    assert sorted(result.objects) == sorted(sample_object_name(s.sample_index) for s in samples)


def test_duplicate_or_empty_samples_are_refused_before_any_work(target, tmp_path):
    store = LocalStore(tmp_path / "store")
    sample = make_samples(1)[0]
    with pytest.raises(ValueError, match=f"sample index {sample.sample_index} appears twice"):
        Extraction(store, tmp_path / "staging").run(target, [sample, sample])
    with pytest.raises(ValueError, match="sample 7 has no tokens"):
        Extraction(store, tmp_path / "staging").run(target, [TokenizedSample(7, [], [])])
    assert list(store.list("")) == []


def test_a_second_extraction_of_the_same_range_on_this_host_is_refused(target, tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    fd = os.open(staging / ".extract.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, b"pid 4242")
        with pytest.raises(PartitionBusy, match="pid 4242"):
            Extraction(LocalStore(tmp_path / "store"), staging).run(target, make_samples(2))
    finally:
        os.close(fd)
