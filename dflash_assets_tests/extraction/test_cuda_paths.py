"""The CUDA paths, which the CPU suite cannot reach: bf16 capture, pinned overlapped copies, and a real
out-of-memory from the CUDA allocator halving a batch. Skipped without a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.host_transfer import HostTransfer
from dflash_assets.extraction.sample_format import read_sample, sample_object_name
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.target.model import load_target_model
from dflash_assets_tests.support.extraction import Extraction, make_samples, stored_objects
from dflash_assets_tests.support.targets import reference_hidden_states, save_tiny_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LAYERS = [1, 4, 8]
# A bf16 forward against the float32 reference: ~0.5 % relative error on the CPU; 3 % leaves room for
# other bf16 kernels. (The tiny target's neighbouring layers differ by less than that, so the layer
# convention itself is pinned by the exact CPU tests in test_capture.py.)
BF16_FORWARD_RTOL = 0.03


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_target(tmp_path_factory.mktemp("cuda-target"))


@pytest.fixture(scope="module")
def cpu_reference(target_dir: Path) -> torch.nn.Module:
    return load_target_model(target_dir, "cpu")


@pytest.fixture(scope="module")
def cuda_target(target_dir: Path) -> torch.nn.Module:
    return load_target_model(target_dir, "cuda:0")


def test_the_target_loads_in_bf16_on_cuda_and_captures_the_same_layers_as_the_cpu_reference(
    cuda_target, cpu_reference
):
    assert next(cuda_target.parameters()).dtype == torch.bfloat16
    tokens = torch.randint(1, 500, (57,), generator=torch.Generator().manual_seed(5)).tolist()
    captured = HiddenStateCapture(cuda_target, LAYERS)(
        torch.tensor([tokens]), torch.ones(1, 57, dtype=torch.long)
    )
    assert captured.dtype == torch.bfloat16 and captured.device.type == "cuda"
    reference = reference_hidden_states(cpu_reference, tokens)
    for slot, layer_id in enumerate(LAYERS):
        assert relative_error(captured[0, :, slot].cpu(), reference[layer_id + 1]) < BF16_FORWARD_RTOL


def test_a_batch_reaches_pinned_host_memory_with_non_finite_rows_flagged():
    captured = torch.randn(3, 10, 2, 8, device="cuda:0", dtype=torch.bfloat16)
    captured[1, 4, 0, 0] = float("nan")
    captured[2, 9, 1, 1] = float("inf")  # padding of a row with 8 real tokens
    batch = HostTransfer("cuda:0").start(captured, [10, 10, 8]).wait()
    assert batch.hidden.values.is_pinned() and batch.hidden.values.device.type == "cpu"
    assert batch.suspect == [False, True, False]
    assert torch.equal(batch.hidden.values, captured.cpu())


def test_an_fp8_batch_is_quantised_on_the_device_and_copies_half_the_bytes_into_pinned_memory():
    captured = torch.randn(3, 10, 2, 8, device="cuda:0", dtype=torch.bfloat16) * 1000
    captured[1, 4, 0, 0] = float("nan")
    batch = HostTransfer("cuda:0", "fp8").start(captured, [10, 10, 8]).wait()
    assert batch.hidden.values.dtype == torch.float8_e4m3fn and batch.hidden.values.is_pinned()
    assert batch.hidden.scale.is_pinned() and batch.hidden.scale.shape == (3, 10, 2)
    assert batch.suspect == [False, True, False]
    assert batch.hidden.nbytes < 0.6 * captured.numel() * captured.element_size()
    cpu_quantised = HostTransfer("cpu", "fp8").start(captured.cpu(), [10, 10, 8]).wait()
    torch.testing.assert_close(batch.sample(0).dequantize(), cpu_quantised.sample(0).dequantize())


def test_extraction_on_cuda_stores_every_sample_as_the_cpu_reference_computes_it(
    cuda_target, cpu_reference, tmp_path
):
    samples = make_samples(10)
    extraction = Extraction(LocalStore(tmp_path / "store"), tmp_path / "staging")
    result = extraction.run(cuda_target, samples, layer_ids=LAYERS, max_tokens_per_batch=512)
    assert result.samples == len(samples) and result.peak_device_memory_bytes
    objects = stored_objects(extraction.store)
    for sample in samples:
        stored = read_sample(objects[sample_object_name(sample.sample_index)])
        reference = reference_hidden_states(cpu_reference, sample.input_ids)
        for slot, layer_id in enumerate(LAYERS):
            assert relative_error(stored.hidden_states[:, slot], reference[layer_id + 1]) < BF16_FORWARD_RTOL


def test_fp8_extraction_on_cuda_stores_states_within_e4m3_rounding_of_the_cpu_reference(
    cuda_target, cpu_reference, tmp_path
):
    samples = make_samples(6)
    extraction = Extraction(LocalStore(tmp_path / "store"), tmp_path / "staging")
    extraction.run(cuda_target, samples, layer_ids=LAYERS, max_tokens_per_batch=512, hidden_state_dtype="fp8")
    objects = stored_objects(extraction.store)
    for sample in samples:
        stored = read_sample(objects[sample_object_name(sample.sample_index)])
        assert stored.hidden_state_dtype == "fp8"
        reference = reference_hidden_states(cpu_reference, sample.input_ids)
        for slot, layer_id in enumerate(LAYERS):
            # e4m3 rounding (~2-3 % RMS per row) on top of the bf16 forward's own difference
            assert relative_error(stored.dequantized()[:, slot], reference[layer_id + 1]) < 0.06


def test_a_real_out_of_memory_halves_the_batch_and_every_sample_is_still_stored(cuda_target, tmp_path):
    # A layer allocates 256 MiB per row of the batch; the allocator is capped so that four rows fit and
    # eight do not. The OutOfMemoryError comes from the CUDA caching allocator itself.
    per_row = 256 * 2**20
    device = torch.device("cuda:0")

    def allocate_per_row(module, args, kwargs):
        rows = (args[0] if args else kwargs["hidden_states"]).shape[0]
        scratch = torch.empty(rows * per_row, dtype=torch.uint8, device=device)
        del scratch

    samples = [TokenizedSample(s.sample_index, s.input_ids[:2] * 20, [1] * 40) for s in make_samples(8)]
    handle = cuda_target.model.layers[2].register_forward_pre_hook(allocate_per_row, with_kwargs=True)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    allowed = torch.cuda.memory_reserved(device) + 6 * per_row  # 4 rows + room for the rest; not 8
    torch.cuda.set_per_process_memory_fraction(allowed / total, device)
    try:
        extraction = Extraction(LocalStore(tmp_path / "store"), tmp_path / "staging")
        result = extraction.run(cuda_target, samples, layer_ids=LAYERS, max_tokens_per_batch=4096)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        handle.remove()
        torch.cuda.empty_cache()
    assert any("out of memory" in line and "splitting the batch" in line for line in extraction.logs)
    assert sorted(result.objects) == sorted(sample_object_name(s.sample_index) for s in samples)
    assert extraction.uploader.stats.uploaded == len(samples)
