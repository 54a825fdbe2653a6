"""The extraction pipeline's parts: batch-wise host transfer, out-of-memory halving, staging durability."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.host_transfer import HostTransfer
from dflash_assets.extraction.sample_format import estimate_sample_nbytes, read_sample, sample_object_name
from dflash_assets.storage.layout import FINGERPRINT_NAME
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.staging import (
    BOOT_MARKER_NAME,
    StagingDirectory,
    current_boot_id,
)
from dflash_assets.storage.store import source_will_be_deleted
from dflash_assets.target.model import load_target_model
from dflash_assets_tests.support.extraction import DEFAULT_LAYERS as LAYERS
from dflash_assets_tests.support.extraction import PREFIX, Extraction, make_samples, stored_objects


def test_a_batch_goes_to_the_host_as_bf16_with_non_finite_rows_flagged_and_padding_ignored():
    captured = torch.randn(3, 6, 2, 4)
    captured[1, 2, 0, 3] = float("nan")
    captured[2, 5, 1, 1] = float("inf")  # row 2 has 4 real tokens: position 5 is padding
    batch = HostTransfer("cpu").start(captured, [6, 6, 4]).wait()
    assert batch.hidden.values.dtype == torch.bfloat16 and batch.hidden.scale is None
    assert batch.suspect == [False, True, False]
    assert batch.non_finite_count(1) == 1
    assert batch.sample(2).values.shape == (4, 2, 4)
    assert torch.equal(batch.sample(0).values, captured[0].bfloat16())


def test_an_fp8_batch_goes_to_the_host_quantised_with_a_scale_per_token_and_layer_and_the_same_flags():
    captured = torch.randn(3, 6, 2, 4) * 1000  # far beyond e4m3's 448: only the scale keeps it in range
    captured[1, 2, 0, 3] = float("nan")
    captured[2, 5, 1, 1] = float("inf")  # padding: never stored, never flagged
    batch = HostTransfer("cpu", "fp8").start(captured, [6, 6, 4]).wait()
    assert batch.hidden.values.dtype == torch.float8_e4m3fn and batch.hidden.scale.shape == (3, 6, 2)
    assert batch.suspect == [False, True, False]
    assert batch.non_finite_count(1) > 0 and batch.non_finite_count(0) == 0
    sample = batch.sample(0)
    assert sample.values.shape == (6, 2, 4) and sample.scale.shape == (6, 2)
    torch.testing.assert_close(sample.dequantize(), captured[0], rtol=2**-4, atol=0.0)


def test_a_batch_that_runs_out_of_memory_is_halved_until_it_fits_and_every_sample_is_stored_once(
    target_dir, tmp_path
):
    # The CUDA allocator raises torch.cuda.OutOfMemoryError from inside the forward; here a layer
    # raises it for batches of more than two rows, so the same recovery runs on the CPU.
    model = load_target_model(target_dir, "cpu")
    sizes: list[int] = []

    def fail_large_batches(module, args, kwargs):
        rows = (args[0] if args else kwargs["hidden_states"]).shape[0]
        sizes.append(rows)
        if rows > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    handle = model.model.layers[2].register_forward_pre_hook(fail_large_batches, with_kwargs=True)
    # Equal lengths, so the planner puts all six in one batch.
    samples = [TokenizedSample(s.sample_index, s.input_ids[:3] * 10, [1] * 30) for s in make_samples(6)]
    try:
        extraction = Extraction(LocalStore(tmp_path / "store"), tmp_path / "staging")
        result = extraction.run(model, samples, max_tokens_per_batch=4096)
    finally:
        handle.remove()
    assert sizes == [6, 3, 1, 2, 3, 1, 2]  # 6 fails, 3 fails, then 1 + 2; the other 3 likewise
    assert any("out of memory" in line and "splitting the batch" in line for line in extraction.logs)
    assert sorted(result.objects) == sorted(sample_object_name(s.sample_index) for s in samples)
    assert extraction.uploader.stats.uploaded == len(samples)

    reference = Extraction(LocalStore(tmp_path / "reference"), tmp_path / "reference-staging")
    reference.run(model, samples, max_tokens_per_batch=4096)
    expected = stored_objects(reference.store)
    for name, data in stored_objects(extraction.store).items():
        torch.testing.assert_close(
            read_sample(data).hidden_states.float(),
            read_sample(expected[name]).hidden_states.float(),
            atol=1e-2,
            rtol=2**-7,
        )


def test_the_halved_retry_runs_only_after_the_failed_forward_has_let_go_of_its_tensors(target_dir, tmp_path):
    """A retry inside the `except` block runs while the traceback holds the failed forward's frames and
    what they allocated: on a GPU each half would then fail too, down to "does not fit even alone"."""
    import weakref

    model = load_target_model(target_dir, "cpu")
    failed: list[weakref.ref] = []  # what each failed forward had allocated
    alive_at_next_forward: list[bool] = []

    def fail_large_batches(module, args, kwargs):
        alive_at_next_forward.append(any(ref() is not None for ref in failed))
        rows = (args[0] if args else kwargs["hidden_states"]).shape[0]
        activations = torch.empty(rows, 1 << 16)  # held by this frame when the error is raised
        if rows > 2:
            failed.append(weakref.ref(activations))
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    handle = model.model.layers[2].register_forward_pre_hook(fail_large_batches, with_kwargs=True)
    samples = [TokenizedSample(s.sample_index, s.input_ids[:3] * 10, [1] * 30) for s in make_samples(6)]
    try:
        extraction = Extraction(LocalStore(tmp_path / "store"), tmp_path / "staging")
        result = extraction.run(model, samples, max_tokens_per_batch=4096)
    finally:
        handle.remove()
    assert len(failed) == 3 and len(result.objects) == len(samples)  # 6 failed, then each 3 once
    assert alive_at_next_forward == [False] * 7


def test_a_sample_too_large_even_alone_fails_naming_it(target_dir, tmp_path):
    model = load_target_model(target_dir, "cpu")

    def always_fail(module, args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    handle = model.model.layers[0].register_forward_pre_hook(always_fail)
    sample = make_samples(1)[0]
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError, match=f"sample {sample.sample_index}"):
            Extraction(LocalStore(tmp_path / "store"), tmp_path / "staging").run(model, [sample])
    finally:
        handle.remove()


def test_staged_files_are_not_fsynced_but_store_objects_are(target, tmp_path, monkeypatch):
    if current_boot_id() is None:
        pytest.skip("no boot id on this platform: staged files are fsynced there")
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    samples = make_samples(4)
    Extraction(LocalStore(tmp_path / "store"), tmp_path / "staging").run(target, samples)
    staged_names = {sample_object_name(s.sample_index) for s in samples}
    # Each object's bytes were fsynced once, through its (linked) staging name, right before it was put
    # into the store; the writer itself never fsynced a staging file.
    file_syncs = [Path(p).name for p in synced if Path(p).name in staged_names]
    assert sorted(file_syncs) == sorted(staged_names)
    # Last of all, once per range: the partition directory, so every object's name is durable before
    # a manifest can be written.
    assert synced[-1] == str((tmp_path / "store").resolve() / PREFIX)


def test_staged_files_from_before_a_reboot_are_deleted_not_uploaded(tmp_path):
    fingerprint = {"format": "x", "target_model": "m", "target_layer_ids": [1], "hidden_size": 8}
    directory = tmp_path / "staging"
    directory.mkdir()
    staging = StagingDirectory(directory, fingerprint)
    warnings: list[str] = []
    staging.reconcile(warnings.append)
    (directory / "hs_00000001.safetensors").write_bytes(b"finished before the restart")
    (directory / BOOT_MARKER_NAME).write_text("another-boot\n")

    StagingDirectory(directory, fingerprint).reconcile(warnings.append)

    assert not (directory / "hs_00000001.safetensors").exists()
    assert (directory / FINGERPRINT_NAME).exists()
    assert any("before the machine restarted" in w for w in warnings)
    if current_boot_id() is not None:
        assert (directory / BOOT_MARKER_NAME).read_text().strip() == current_boot_id()


def test_staged_files_of_this_boot_are_kept(tmp_path):
    fingerprint = {"format": "x", "target_model": "m", "target_layer_ids": [1], "hidden_size": 8}
    directory = tmp_path / "staging"
    directory.mkdir()
    StagingDirectory(directory, fingerprint).reconcile(print)
    (directory / "hs_00000001.safetensors").write_bytes(b"finished by a killed run")
    StagingDirectory(directory, fingerprint).reconcile(print)
    assert (directory / "hs_00000001.safetensors").exists()


def test_a_local_store_links_a_file_the_caller_deletes_and_copies_any_other(tmp_path):
    store = LocalStore(tmp_path / "store")
    source = tmp_path / "staged.bin"
    source.write_bytes(b"x" * 1000)
    with source_will_be_deleted():
        store.put_file("a/linked", source)
    store.put_file("a/copied", source)
    assert os.stat(tmp_path / "store" / "a" / "linked").st_ino == os.stat(source).st_ino
    assert os.stat(tmp_path / "store" / "a" / "copied").st_ino != os.stat(source).st_ino
    assert store.get_bytes("a/linked") == store.get_bytes("a/copied") == b"x" * 1000
    replacement = tmp_path / "staged-again.bin"
    replacement.write_bytes(b"y" * 10)
    with source_will_be_deleted():
        store.put_file("a/linked", replacement)  # an existing object is replaced whole
    assert store.get_bytes("a/linked") == b"y" * 10 and source.read_bytes() == b"x" * 1000
    assert [info.key for info in store.list("a/")] == ["a/copied", "a/linked"]


def test_a_staging_budget_smaller_than_one_batch_still_lets_the_batch_through(target, tmp_path):
    # Six equal samples in one batch, and room for one at a time: each file must start writing (and so
    # uploading) before the next waits for room, or the batch would wait on its own reservations.
    samples = [TokenizedSample(s.sample_index, s.input_ids[:3] * 10, [1] * 30) for s in make_samples(6)]
    one_sample = estimate_sample_nbytes(30, len(LAYERS), 64, len("tiny-qwen3_5"))
    extraction = Extraction(
        LocalStore(tmp_path / "store"), tmp_path / "staging", staging_budget_bytes=one_sample
    )
    outcome: list[object] = []
    runner = threading.Thread(
        target=lambda: outcome.append(
            extraction.run(target, samples, layer_ids=LAYERS, max_tokens_per_batch=4096)
        ),
        daemon=True,
    )
    runner.start()
    runner.join(timeout=120)
    assert not runner.is_alive(), "extraction stalled on its own staging reservations"
    result = outcome[0]
    assert len(result.objects) == 6 and result.peak_staging_bytes <= one_sample
