"""The speculative evaluation never kills a training run: before the target is loaded the trainer checks
the memory, then evaluates beside the drafter, on a spare leased device, after moving the optimiser
state to the host, or skips with a warning naming the setting. Decided from made-up memory figures."""

from __future__ import annotations

import contextlib
import gc
import json
import struct
import weakref
from pathlib import Path

import pytest
import torch

from dflash_assets.drafter.config import DrafterConfig, drafter_shape
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OnlineData
from dflash_assets.training.memory import (
    SKIP_SETTING,
    evaluation_target_bytes,
    offload_optimizer_state,
    optimizer_state_bytes,
    place_speculative_evaluation,
    training_memory,
)
from dflash_assets.training.settings import TrainSettings

GB = 10**9
GIB = 2**30


# -- the decision, from figures alone


@pytest.mark.parametrize(
    ("free", "offloadable", "spare", "action", "device"),
    [
        (80 * GB, 20 * GB, None, "here", "cuda:0"),
        (30 * GB, 20 * GB, ("cuda:1", 80 * GB), "spare", "cuda:1"),
        (30 * GB, 40 * GB, None, "offload", "cuda:0"),
        (30 * GB, 40 * GB, ("cuda:1", 10 * GB), "offload", "cuda:0"),  # the spare is too small
        (30 * GB, 10 * GB, ("cuda:1", 10 * GB), "skip", None),
        (55 * GB, 0, None, "skip", None),  # exactly the estimate leaves no headroom
    ],
)
def test_the_target_goes_where_it_fits_in_the_documented_order(free, offloadable, spare, action, device):
    placement = place_speculative_evaluation(
        needed_bytes=55 * GB,
        drafter_device="cuda:0",
        free_bytes=free,
        offloadable_bytes=offloadable,
        spare=spare,
    )
    assert (placement.action, placement.device) == (action, device)


def test_a_skip_says_why_and_names_the_setting_that_turns_the_evaluation_off():
    placement = place_speculative_evaluation(
        needed_bytes=55 * GB, drafter_device="cuda:0", free_bytes=14 * GB, offloadable_bytes=0, spare=None
    )
    assert placement.action == "skip"
    assert SKIP_SETTING in placement.message and "DFLASH_DEVICES" in placement.message
    assert "training goes on" in placement.message and "cuda:0" in placement.message


# -- the estimates, at the issue's shape


def _header_only_checkpoint(directory: Path, config: dict) -> Path:
    """A Qwen3.6-27B-shaped checkpoint directory whose safetensors file holds only its header: the
    estimates read tensor shapes, never weights (building 27B of them here would take 55 GB)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_5_text", **config))
    header, offset = {}, 0
    for name, tensor in model.state_dict().items():
        nbytes = tensor.numel() * 2
        header[name] = {
            "dtype": "BF16",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header).encode()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text", **config}))
    return directory


def test_at_the_27b_shape_the_estimates_give_the_issues_figures(tmp_path):
    from dflash_assets.bench.gpu import REAL_SHAPES

    hybrid = dict(REAL_SHAPES[1].config)
    hybrid["num_hidden_layers"] = 64
    hybrid["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)]
    target = _header_only_checkpoint(tmp_path / "qwen3.6-27b-shape", hybrid)
    needed = evaluation_target_bytes(target, "cuda", prompt_tokens=3008, new_tokens=64)
    assert 54 * GB < needed < 64 * GB  # ~54 GB of bf16 weights, plus a 3K-token prompt's decoding

    config = DrafterConfig(
        hidden_size=5120,
        vocab_size=248320,
        mask_token_id=248070,
        target_layer_ids=[1, 16, 31, 46, 61],
        target_num_hidden_layers=64,
        **drafter_shape({"hidden_size": 5120, "intermediate_size": 17408}, "dflash", 5),
    )
    memory = training_memory(config, max_length=3072, num_anchors=512)
    fp32_state = memory.weights + memory.gradients + memory.optimizer
    assert 26 * GB < fp32_state < 29 * GB  # "~27 GB of fp32 weights, gradients and AdamW state"
    # Between steps (gradients freed) the drafter and the target together exceed an 80 GB card.
    assert memory.between_steps_bytes + needed > 80 * GB


def test_the_optimiser_state_is_counted_whole_and_only_what_is_elsewhere_is_moved():
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    parameters = sum(p.numel() for p in model.parameters())
    # Two float32 moments per parameter, and one float32 step counter per parameter tensor.
    assert optimizer_state_bytes(optimizer) == 2 * 4 * parameters + 4 * 2
    same = {id(v) for s in optimizer.state.values() for v in s.values()}
    restore = offload_optimizer_state(optimizer, "cpu")  # already there: nothing is copied
    restore()
    assert {id(v) for s in optimizer.state.values() for v in s.values()} == same
    offload_optimizer_state(optimizer, "meta")  # anywhere else: every tensor moves (the CUDA test moves back)
    assert {v.device.type for s in optimizer.state.values() for v in s.values()} == {"meta"}


# -- the trainer, with made-up memory figures


class FakeMemory:
    """Made-up free memory per device; `cpu:1` is its own pool, as a second GPU would be."""

    def __init__(self, free: dict[str, int]):
        self.free = free
        self.asked: list[str] = []

    def free_bytes(self, device: str) -> int:
        self.asked.append(device)
        return self.free[device]

    def pool(self, device: str) -> str:
        return device


class SpareLease:
    def __init__(self, device: str | None):
        self.device, self.entered, self.released = device, 0, 0

    @contextlib.contextmanager
    def __call__(self):
        self.entered += 1
        try:
            yield self.device
        finally:
            self.released += 1


def _train(config, capture, samples, tmp_path, monkeypatch, memory, spare=None, load_error=None):
    """Four steps with a checkpoint at step 2: three speculative evaluations (baseline, 2, 4)."""
    import dflash_assets.training.checkpoint_evaluation as evaluation_module
    import dflash_assets.training.train as train_module

    loads: list[str] = []
    real_load = evaluation_module.load_target_model

    def counted_load(model_dir, device, *args, **kwargs):
        loads.append(str(device))
        if load_error is not None:
            raise load_error
        return real_load(model_dir, device, *args, **kwargs)

    monkeypatch.setattr(evaluation_module, "load_target_model", counted_load)
    monkeypatch.setattr(evaluation_module, "stop_token_ids_of", lambda target: set())  # no tokenizer here
    lines: list[str] = []
    reports: list[dict] = []
    trainer = train_module.DrafterTrainer(
        config,
        TrainSettings(
            mode="online",
            max_steps=4,
            checkpoint_every_steps=2,
            checkpoint_every_minutes=None,
            num_anchors=8,
            global_batch_size=4,
            eval_samples=2,
            spec_eval_prompts=1,
            spec_eval_max_new_tokens=4,
        ),
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="memory",
        work_dir=tmp_path / "work",
        log=lines.append,
        on_checkpoint=reports.append,
        device_memory=memory,
        spare_device=spare,
    )
    result = trainer.train()
    return result, reports, loads, lines


def test_when_the_target_fits_nowhere_the_evaluation_is_skipped_with_a_warning_and_training_finishes(
    config, capture, samples, tmp_path, monkeypatch
):
    memory = FakeMemory({"cpu": 1 * GIB // 1024})
    result, reports, loads, lines = _train(config, capture, samples, tmp_path, monkeypatch, memory)
    assert result.steps == 4 and result.final_loss is not None
    assert loads == [] and result.speculative is None and result.acceptance_length_tau is None
    assert [r["step"] for r in reports] == [0, 2, 4] and all(r["speculative"] is None for r in reports)
    warnings = [line for line in lines if line.startswith("WARNING") and SKIP_SETTING in line]
    assert len(warnings) == 3 and "cpu" in warnings[0]
    assert result.eval is not None  # the teacher-forced evaluation still ran


def test_when_the_drafters_device_is_full_the_target_is_loaded_on_a_spare_leased_device(
    config, capture, samples, tmp_path, monkeypatch
):
    memory = FakeMemory({"cpu": 1024, "cpu:1": 64 * GIB})
    spare = SpareLease("cpu:1")
    result, reports, loads, lines = _train(config, capture, samples, tmp_path, monkeypatch, memory, spare)
    assert loads == ["cpu:1"] * 3 and spare.entered == spare.released == 3
    assert all(r["speculative"] and r["speculative"]["mismatched"] == [] for r in reports)
    assert result.acceptance_length_tau is not None
    assert any("evaluating on the leased cpu:1" in line for line in lines)


def test_no_spare_device_and_no_room_skips_even_when_a_lease_was_tried(
    config, capture, samples, tmp_path, monkeypatch
):
    memory = FakeMemory({"cpu": 1024})
    spare = SpareLease(None)  # every other device is busy
    result, _, loads, lines = _train(config, capture, samples, tmp_path, monkeypatch, memory, spare)
    assert loads == [] and spare.entered == spare.released == 3 and result.steps == 4
    assert any("no other device" in line and SKIP_SETTING in line for line in lines)


def test_an_out_of_memory_while_loading_the_target_skips_the_evaluation_not_the_run(
    config, capture, samples, tmp_path, monkeypatch
):
    memory = FakeMemory({"cpu": 64 * GIB})  # the estimate says it fits; the device disagrees
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 54.00 GiB (simulated)")
    result, reports, loads, lines = _train(
        config, capture, samples, tmp_path, monkeypatch, memory, load_error=error
    )
    assert len(loads) == 3 and result.steps == 4 and result.speculative is None
    assert sum("ran out of memory" in line and SKIP_SETTING in line for line in lines) == 3


class WatchedRelease:
    """Each loaded target (a weak reference) and, at each release of the evaluation's memory, whether the
    target, or a tensor a failed evaluation allocated, was still referenced."""

    def __init__(self, monkeypatch, fail_evaluation: bool = False):
        import dflash_assets.training.checkpoint_evaluation as evaluation_module
        import dflash_assets.training.memory as memory_module

        self.loaded: list = []
        self.failed: list = []
        self.alive_at_release: list[tuple[bool, bool]] = []
        real_verifier, real_release = evaluation_module.TargetVerifier, memory_module._release_memory
        watch = self

        class Watched(real_verifier):
            def __init__(self, model, layer_ids):
                super().__init__(model, layer_ids)
                watch.loaded.append(weakref.ref(self))

            def run(self, ids, cache):
                if fail_evaluation:
                    activations = torch.empty(1 << 16)  # what the failed forward held
                    watch.failed.append(weakref.ref(activations))
                    raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
                return super().run(ids, cache)

        def release(device_type):
            gc.collect()  # a cycle would be collected on a GPU too; only a live reference keeps it
            self.alive_at_release.append(
                (
                    any(ref() is not None for ref in self.loaded),
                    any(ref() is not None for ref in self.failed),
                )
            )
            real_release(device_type)

        monkeypatch.setattr(evaluation_module, "TargetVerifier", Watched)
        monkeypatch.setattr(memory_module, "_release_memory", release)


@pytest.mark.parametrize("fail_evaluation", [False, True], ids=["evaluated", "out-of-memory mid-evaluation"])
def test_the_evaluations_target_is_no_longer_referenced_when_its_memory_is_released(
    config, capture, samples, tmp_path, monkeypatch, fail_evaluation
):
    """The caller's `with ... as` name outlives the block: were the target that name, it would be alive
    while the memory is released and the optimiser state comes back beside it (an out-of-memory then
    outside any handler, and the memory reserved until the next collection)."""
    watch = WatchedRelease(monkeypatch, fail_evaluation)
    memory = FakeMemory({"cpu": 64 * GIB})
    result, reports, loads, lines = _train(config, capture, samples, tmp_path, monkeypatch, memory)
    assert len(loads) == 3 and result.steps == 4
    assert watch.alive_at_release == [(False, False)] * 3
    if fail_evaluation:
        assert len(watch.failed) == 3 and result.speculative is None
        assert sum("the speculative evaluation ran out of memory" in line for line in lines) == 3
    else:
        assert all(r["speculative"] and r["speculative"]["mismatched"] == [] for r in reports)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: on the CPU the host is the device")
def test_on_cuda_the_optimiser_state_waits_in_host_memory_while_the_target_is_loaded(
    config, capture, samples, tmp_path, monkeypatch
):
    import dflash_assets.training.checkpoint_evaluation as evaluation_module
    import dflash_assets.training.train as train_module

    seen: list[set[str]] = []
    real = evaluation_module.TargetVerifier

    class Watching(real):
        def __init__(self, model, layer_ids):
            state = trainer.optimizer.state.values()
            seen.append({s[k].device.type for s in state for k in ("exp_avg", "exp_avg_sq") if k in s})
            super().__init__(model, layer_ids)

    monkeypatch.setattr(evaluation_module, "TargetVerifier", Watching)
    monkeypatch.setattr(evaluation_module, "stop_token_ids_of", lambda target: set())

    class CudaMemory(FakeMemory):
        def pool(self, device: str) -> str:
            return "host" if device == "cpu" else device

    memory = CudaMemory({"cuda:0": 0})  # nothing free: only the optimiser state's room helps
    trainer = train_module.DrafterTrainer(
        config,
        TrainSettings(
            mode="online",
            max_steps=2,
            checkpoint_every_steps=1,
            checkpoint_every_minutes=None,
            num_anchors=8,
            global_batch_size=4,
            eval_samples=2,
            spec_eval_prompts=1,
            spec_eval_max_new_tokens=4,
            device="cuda:0",
        ),
        OnlineData(samples, capture),
        store=open_store(str(tmp_path / "store")),
        run="offload",
        work_dir=tmp_path / "work",
        device_memory=memory,
    )
    # A target of one byte and no headroom: the tiny drafter's optimiser state is room enough.
    monkeypatch.setattr("dflash_assets.training.memory.evaluation_target_bytes", lambda *args, **kwargs: 1)
    monkeypatch.setattr("dflash_assets.training.memory.HEADROOM_BYTES", 0)
    trainer.train()
    assert {"cpu"} in seen  # during an evaluation after the first step
    moments = {s[k].device.type for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")}
    assert moments == {"cuda"}  # back where they were; AdamW's step counters stayed on the host throughout
