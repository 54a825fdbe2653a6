"""A target over several devices, in the core: which targets can be split and how, loading straight onto
devices, and two real ranks (gloo, torch.distributed's launcher) capturing what one process captures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.target.model import layer_split_device_map, load_target_model
from dflash_assets.target.tensor_parallel import (
    TensorParallelUnsupported,
    check_tensor_parallel,
    read_config,
    valid_tp_sizes,
)


def test_the_demo_targets_heads_allow_two_devices_and_four_is_refused_naming_the_choices(demo_model_dir):
    config = read_config(demo_model_dir)  # 4 query heads, 2 key/value heads
    assert valid_tp_sizes(config, limit=8) == [1, 2]
    check_tensor_parallel(config, 2, stage="capture")
    with pytest.raises(TensorParallelUnsupported) as error:
        check_tensor_parallel(config, 4, stage="capture")
    assert "DFLASH_TARGET_TP=4 does not divide" in str(error.value)
    assert "num_key_value_heads=2" in str(error.value) and "Choose one of 1, 2" in str(error.value)


@pytest.mark.parametrize(
    ("stage", "instead"),
    [("capture", "DFLASH_TARGET_TP=1"), ("regeneration", "DFLASH_GENERATE_URL")],
)
def test_a_family_without_a_plan_is_refused_naming_its_model_type_and_what_to_do(tmp_path, stage, instead):
    from transformers import GPT2Config

    GPT2Config(n_layer=8, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(TensorParallelUnsupported) as error:
        check_tensor_parallel(read_config(tmp_path), 2, stage=stage)
    message = str(error.value)
    assert "no tensor-parallel plan for model type 'gpt2'" in message and instead in message
    check_tensor_parallel(read_config(tmp_path), 1, stage=stage)  # one device needs no plan


def test_a_replica_over_several_devices_splits_its_layers_in_contiguous_blocks(demo_model_dir):
    devices = [torch.device(f"cuda:{i}") for i in range(5)]
    device_map = layer_split_device_map(demo_model_dir, devices)
    layers = [device_map[f"model.layers.{i}"] for i in range(12)]
    assert layers == ["cuda:0"] * 3 + ["cuda:1"] * 3 + ["cuda:2"] * 2 + ["cuda:3"] * 2 + ["cuda:4"] * 2
    others = {name: device for name, device in device_map.items() if ".layers." not in name}
    assert others == {
        "model.embed_tokens": "cuda:0",
        "model.norm": "cuda:0",
        "model.rotary_emb": "cuda:0",
        "lm_head": "cuda:0",
    }


def test_a_target_is_placed_on_its_device_as_its_weights_are_read(demo_model_dir, monkeypatch):
    """Not loaded into host memory and moved after: eight ranks of one host would each hold the whole
    target there. transformers places each tensor as it reads it when given a `device_map`."""
    from transformers import AutoModelForCausalLM

    calls = []
    real = AutoModelForCausalLM.from_pretrained

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recording)
    load_target_model(demo_model_dir, "cpu:1")
    assert calls[-1]["device_map"] == torch.device("cpu")


def test_a_target_loads_onto_its_device_and_a_cpu_replica_over_two_leases_is_the_same_model(demo_model_dir):
    one = load_target_model(demo_model_dir, "cpu:0")
    two = load_target_model(demo_model_dir, ["cpu:0", "cpu:1"])  # both leases are the one CPU
    assert {p.device.type for p in one.parameters()} == {"cpu"} and not hasattr(two, "hf_device_map")
    ids = torch.randint(0, 1000, (2, 17))
    mask = torch.ones_like(ids)
    layers = [1, 3, 5]
    torch.testing.assert_close(
        HiddenStateCapture(two, layers)(ids, mask), HiddenStateCapture(one, layers)(ids, mask)
    )


RANKS_SCRIPT = """
import json, os, sys, torch
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.rank import FollowerForward
from dflash_assets.target.tensor_parallel import TargetGroup, is_sharded, load_target_shard
model_dir, out, layers = sys.argv[1], sys.argv[2], [1, 3, 5, 7, 9]
group = TargetGroup(torch.device("cpu"), timeout_s=60, heartbeat_s=0.2)
model = load_target_shard(model_dir, torch.device("cpu"), group.size, lm_head=False)  # as capture loads it
assert is_sharded(model) and model.get_output_embeddings() is None
capture = HiddenStateCapture(model, layers) if group.is_leader else FollowerForward(model, layers)
if group.is_leader:
    group.start_heartbeat()
    ids, mask = torch.load(out + ".in.pt")
    results = []
    for rows in (slice(0, 3), slice(3, 4)):  # two forwards, the second after the followers only heard pings
        if rows.start:
            import time; time.sleep(1.0)
        group.send("capture", ids[rows], mask[rows])
        results.append(capture(ids[rows], mask[rows]))
    group.stop_followers()
    torch.save(torch.cat(results), out)
else:
    ran = group.follow({"capture": lambda ids, mask: capture(ids, mask)})
    assert ran == 2, ran
group.close()
"""


def test_capture_loads_the_target_without_its_lm_head_and_captures_the_same_layers(demo_model_dir):
    ids = torch.tensor([[5, 9, 14, 3, 7, 21, 8, 2]])
    whole = load_target_model(demo_model_dir, "cpu")
    headless = load_target_model(demo_model_dir, "cpu", lm_head=False)
    names = [name for name, _ in headless.named_parameters()]
    assert not [name for name in names if "lm_head" in name]
    assert sum(p.numel() for p in whole.parameters()) - sum(p.numel() for p in headless.parameters()) == (
        whole.config.vocab_size * whole.config.hidden_size
    )
    layers = [1, 3, 5]
    expected = HiddenStateCapture(whole, layers)(ids, torch.ones_like(ids))
    assert torch.equal(HiddenStateCapture(headless, layers)(ids, torch.ones_like(ids)), expected)


def test_a_follower_runs_the_forward_through_the_last_captured_layer_and_keeps_no_capture_buffer(
    demo_model_dir,
):
    """Only rank 0 fills the [B, T, K, H] buffer; a follower allocating it too would hold memory its rank
    never uses (at the real width, 5 layers x 5120 of every token of the batch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dflash_assets.extraction.rank import FollowerForward

    class LargestTensor(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for value in result if isinstance(result, tuple | list) else [result]:
                if isinstance(value, torch.Tensor):
                    self.largest = max(self.largest, value.numel())
            return result

    model = load_target_model(demo_model_dir, "cpu", lm_head=False)
    layers = [1, 3, 5, 7, 9]
    ran: list[int] = []
    handles = [
        layer.register_forward_pre_hook(lambda module, args, i=i: ran.append(i))
        for i, layer in enumerate(model.layers)
    ]
    ids = torch.randint(0, 1000, (4, 64))
    try:
        with LargestTensor() as follower:
            FollowerForward(model, layers)(ids, torch.ones_like(ids))
        followed = list(ran)
        ran.clear()
        with LargestTensor() as leader:
            HiddenStateCapture(model, layers)(ids, torch.ones_like(ids))
    finally:
        for handle in handles:
            handle.remove()
    buffer = 4 * 64 * len(layers) * model.config.hidden_size
    assert followed == ran == list(range(10))  # through layer 9, the last captured, and no further
    assert leader.largest >= buffer > follower.largest


@pytest.mark.slow  # two ranks under torch.distributed's launcher
def test_two_ranks_capture_what_one_process_captures_to_float32_precision(demo_model_dir, tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 1500, (4, 40))
    mask = torch.ones_like(ids)
    mask[1, :12] = 0  # a left-padded row
    out = tmp_path / "captured.pt"
    torch.save((ids, mask), str(out) + ".in.pt")
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(script),
    ]
    result = subprocess.run(
        [*command, str(demo_model_dir), str(out)], env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    split = torch.load(out)

    one = HiddenStateCapture(load_target_model(demo_model_dir, "cpu"), [1, 3, 5, 7, 9])
    whole = torch.cat([one(ids[:3], mask[:3]), one(ids[3:], mask[3:])])
    real = mask.bool()
    difference = (split - whole).abs()[real].max().item()
    print(json.dumps({"largest_float32_difference": difference}))
    torch.testing.assert_close(split[real], whole[real], atol=1e-5, rtol=1e-5)
    assert Path(str(out) + ".in.pt").exists()


OUT_OF_MEMORY_SCRIPT = """
import sys, torch
from pathlib import Path
from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.rank import LeaderCapture, handlers
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.target.ranks import TargetRankJob, run_target_rank
from dflash_assets_tests.support.extraction import Extraction

job = TargetRankJob.from_json(Path(sys.argv[1]).read_text())
layers, root, failing = job.work["target_layer_ids"], Path(job.work["root"]), job.work["failing_rank"]
rank = int(__import__("os").environ["RANK"])


def fail_the_second_forward(model):
    forwards = []

    def hook(module, args):  # inside the forward: the other rank waits in one of its collectives
        forwards.append(1)
        if len(forwards) == 2 and rank == failing:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated on rank {rank} alone)")

    model.layers[3].register_forward_pre_hook(hook)


def lead(group, model, devices, link):
    fail_the_second_forward(model)
    samples = [TokenizedSample(100 + i, [5 + i] * 10, [1] * 10) for i in range(8)]  # batches of 4
    extraction = Extraction(LocalStore(root / "store"), root / "staging")
    try:
        capture = LeaderCapture(model, layers, group)
        extraction.run(model, samples, layer_ids=layers, capture=capture, max_tokens_per_batch=40)
    finally:
        for line in extraction.logs:
            link.log(line)
    return {}


def follower_handlers(model):
    fail_the_second_forward(model)
    return handlers(job)(model)


sys.exit(run_target_rank(job, lead, follower_handlers, lm_head=False))
"""


def _processes_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker.encode() in environ and state != "Z":
                pids.append(int(entry.name))
    return pids


@pytest.mark.slow  # two ranks under torch.distributed's launcher
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_rank_out_of_memory_mid_forward_stops_every_rank_at_once_instead_of_halving_the_batch_alone(
    demo_model_dir, tmp_path, failing_rank
):
    """Halving on one rank would pair its smaller forward's collectives with the others' leftovers of the
    failed one (a hang until the timeout, or wrong states): every rank stops instead, well before the
    group's timeout, the step hears which rank ran out and what to lower, and no process is left."""
    import datetime
    import time

    import torch.distributed as dist

    from dflash_assets.target.ranks import EVENTS_QUEUE, TargetRankJob

    timeout_s = 120.0
    step = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
    job = TargetRankJob(
        stage="capture",
        model_dir=str(demo_model_dir),
        tp=2,
        devices=["cpu:0", "cpu:1"],
        lock_dir=str(tmp_path / "locks"),
        holder="test",
        timeout_s=timeout_s,
        step=f"127.0.0.1:{step.port}",
        work={"target_layer_ids": [1, 3, 5, 7], "root": str(tmp_path), "failing_rank": failing_rank},
    )
    (tmp_path / "job.json").write_text(job.to_json())
    (tmp_path / "ranks.py").write_text(OUT_OF_MEMORY_SCRIPT)
    marker = f"dflash-oom-test-{os.getpid()}-{failing_rank}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "DFLASH_TEST_MARKER": marker}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "--max-restarts=0", str(tmp_path / "ranks.py"), str(tmp_path / "job.json")]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s + 60)
    seconds = time.monotonic() - started
    events = [
        json.loads(step.queue_pop(EVENTS_QUEUE, block=False)) for _ in range(step.queue_len(EVENTS_QUEUE))
    ]
    errors = [e["body"] for e in events if e["kind"] == "error"]
    lines = [e["body"] for e in events if e["kind"] == "log"]
    output = result.stdout[-2000:] + result.stderr[-3000:]
    assert result.returncode != 0, output
    assert not [line for line in lines if "splitting the batch" in line], lines
    assert errors and f"rank {failing_rank} of the target split over 2 devices ran out of memory" in errors[0]
    assert "cannot be halved on one rank alone" in errors[0] and "DFLASH_MAX_TOKENS_PER_BATCH" in errors[0]
    assert seconds < timeout_s / 2, f"ended after {seconds:.0f} s: a rank waited for the group's timeout"
    assert not _processes_with(marker)  # the launcher and both ranks are gone
