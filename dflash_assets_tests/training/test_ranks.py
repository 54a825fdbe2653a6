"""What a real node's ranks meet first, tried with ranks on this machine (gloo): a non-finite gradient on
one rank, a resume on a node that sees fewer GPUs, a resume's downloads, ranks that disagree, kernels
compiled before the first timed collective, and which errors a restart can mend."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
import torch

from dflash_assets.storage.layout import CHECKPOINT_FILES
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.store import StoreConfigError, TransientStoreError
from dflash_assets.training.checkpoints import (
    CheckpointError,
    CheckpointManager,
    DataPosition,
    checkpoint_prefix,
    restore_rng_state,
)
from dflash_assets.training.data import OfflineData
from dflash_assets.training.distributed import SingleProcess
from dflash_assets.training.failures import restartable
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import DrafterTrainer, train_drafter
from dflash_assets_tests.support.drafter_fixtures import tiny_drafter_config, write_hidden_state_partition
from dflash_assets_tests.support.ranks import run_ranks

PARTITION = "00000000-00000099"
SETTINGS = {
    "mode": "offline",
    "lr": 3e-3,
    "num_anchors": 8,
    "global_batch_size": 4,
    "eval_samples": 3,
    "spec_eval_prompts": 0,
    "log_every_steps": 1,
    "checkpoint_every_minutes": None,
    "max_steps": 3,
    "device": "cpu",
}


@pytest.fixture(scope="module")
def offline_setup(tmp_path_factory, target_dir, capture, samples) -> dict[str, Any]:
    """Twelve samples' hidden states in a local store, and everything a rank needs to build its trainer
    (plain values: the ranks are processes of their own)."""
    root = tmp_path_factory.mktemp("ranks")
    store = open_store(str(root / "store"))
    objects = write_hidden_state_partition(store, PARTITION, samples, capture, str(target_dir), root / "x")
    return {
        "root": str(root),
        "target_dir": str(target_dir),
        "store": str(root / "store"),
        "objects": objects,
        "num_tokens": [s.num_tokens for s in samples],
    }


class CountingStore(LocalStore):
    """A local store that notes every download, one line per key, in a file per process."""

    def __init__(self, root: str, log_dir: str) -> None:
        super().__init__(root)
        self.log_path = Path(log_dir) / f"downloads-{id(self)}-{__import__('os').getpid()}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)

    def download(self, key: str, path: Path) -> Path:
        with open(self.log_path, "a") as log:
            log.write(key + "\n")
        return super().download(key, path)


def _downloads(log_dir: Path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in log_dir.glob("downloads-*.log"):
        for key in path.read_text().split():
            counts[key] = counts.get(key, 0) + 1
    return counts


def _trainer(collective: Any, setup: dict[str, Any], *, store=None, objects=None, **settings: Any):
    """One rank's trainer on the shared setup, in folders of its node (`setup["nodes"]`)."""
    nodes = setup.get("nodes") or ["node"] * collective.world_size
    node_dir = Path(setup["root"]) / setup.get("case", "case") / nodes[collective.rank]
    store = store or open_store(setup["store"])
    objects = objects if objects is not None else setup["objects"]
    data = OfflineData(
        store,
        objects,
        node_dir / f"cache-{collective.rank}",
        num_tokens=setup["num_tokens"][: len(objects)],
    )
    world = {
        "world_size": collective.world_size,
        "nodes": nodes,
        "devices": [f"cpu:{r}" for r in range(collective.world_size)],
        "target_devices": [[] for _ in range(collective.world_size)],
    }
    return DrafterTrainer(
        tiny_drafter_config(Path(setup["target_dir"])),
        TrainSettings(**{**SETTINGS, **settings}),
        data,
        store=store,
        run=setup.get("run", "ranks"),
        work_dir=node_dir / "work",
        checkpoint_dir=node_dir / "checkpoints",
        collective=collective,
        world=world,
    )


def _fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return {
        "finite": all(bool(torch.isfinite(t).all()) for t in weights.values()),
        "sums": {name: float(t.double().sum()) for name, t in weights.items()},
    }


# ------------------------------------------------------------------------ a non-finite gradient on one rank


def _train_with_an_inf_gradient_on_rank_1(collective, setup) -> dict[str, Any]:
    trainer = _trainer(collective, setup, spec_eval_prompts=2, spec_eval_max_new_tokens=6)

    def poison(grad: torch.Tensor) -> torch.Tensor:  # a finite loss, an inf gradient: rank 1, step 2
        return grad * float("inf") if collective.rank == 1 and trainer.step == 1 else grad

    trainer.model.fc.weight.register_hook(poison)
    around_step_2: dict[str, Any] = {}
    train_step = trainer.train_step

    def step(*args: Any, **kwargs: Any):
        if trainer.step == 1:
            around_step_2["before"] = _fingerprint(trainer.model)
        outcome = train_step(*args, **kwargs)
        if trainer.step == 1:
            around_step_2["after"] = _fingerprint(trainer.model)
        return outcome

    trainer.train_step = step
    trainer.resume()
    result = trainer.train()
    return {
        "skipped": result.skipped_nonfinite_steps,
        "steps": result.steps,
        "weights": _fingerprint(result.model),
        "around_step_2": around_step_2,
        "baseline": result.baseline,
    }


@pytest.mark.slow  # ranks in processes of their own
def test_a_finite_loss_with_an_inf_gradient_on_one_rank_is_skipped_on_every_rank_alike(offline_setup):
    setup = {**offline_setup, "case": "inf-gradient", "run": "inf-gradient"}
    ranks = run_ranks(_train_with_an_inf_gradient_on_rank_1, 2, setup)
    assert all(isinstance(rank, dict) for rank in ranks), ranks
    for rank in ranks:
        assert rank["skipped"] == 1 and rank["steps"] == SETTINGS["max_steps"]
        assert rank["weights"]["finite"]
        # The skipped step left every weight as it was (no NaN clipped into them, no half update).
        assert rank["around_step_2"]["after"] == rank["around_step_2"]["before"]
    assert ranks[0]["weights"]["sums"] == pytest.approx(ranks[1]["weights"]["sums"], rel=1e-9)

    # The curves count it: rank 0's TensorBoard scalar, and the run's figure.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store, logdir = open_store(setup["store"]), Path(setup["root"]) / "inf-gradient-curves"
    for info in store.list("checkpoints/inf-gradient/tensorboard/"):
        store.download(info.key, logdir / info.key.rsplit("/", 1)[-1])
    curves = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    curves.Reload()
    skipped = {event.step: event.value for event in curves.Scalars("train/skipped_nonfinite_steps")}
    assert skipped == {1: 0.0, 2: 1.0, 3: 1.0}

    # Evaluations are shared by the ranks, and their figures are one process's.
    alone = train_drafter(
        tiny_drafter_config(Path(setup["target_dir"])),
        TrainSettings(**{**SETTINGS, "max_steps": 1, "spec_eval_prompts": 2, "spec_eval_max_new_tokens": 6}),
        OfflineData(
            open_store(setup["store"]),
            setup["objects"],
            Path(setup["root"]) / "alone-cache",
            num_tokens=setup["num_tokens"],
        ),  # fmt: skip
        store=open_store(str(Path(setup["root"]) / "alone-store")),
        run="alone",
        work_dir=Path(setup["root"]) / "alone",
    )
    shared = ranks[0]["baseline"]
    assert shared == ranks[1]["baseline"]
    assert shared["teacher_forced"]["num_samples"] == alone.baseline["teacher_forced"]["num_samples"] == 3
    alone_loss = alone.baseline["teacher_forced"]["loss"]
    assert shared["teacher_forced"]["loss"] == pytest.approx(alone_loss, rel=1e-5)
    assert shared["speculative"]["prompts"] == alone.baseline["speculative"]["prompts"] == 2
    assert shared["speculative"]["tau"] == pytest.approx(alone.baseline["speculative"]["tau"])


def test_a_checkpoint_with_a_non_finite_weight_is_never_committed(tmp_path, config):
    from dflash_assets.drafter.model import DFlashDrafter
    from dflash_assets.training.schedule import build_optimizer

    store = open_store(str(tmp_path / "store"))
    model = DFlashDrafter.from_target(config)
    settings = TrainSettings(**SETTINGS)
    optimizer = build_optimizer(model, settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    manager = CheckpointManager(store, "nan-run", tmp_path / "local")
    with pytest.raises(FloatingPointError, match=r"weight fc\.weight is not finite at step 4"):
        manager.save(
            step=4,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            data_position=DataPosition(),
            config=config,
            settings=settings.to_dict(),
        )
    manager.close()
    assert list(store.list("checkpoints/")) == []


# ------------------------------------------------------------ the gradient reduction and out-of-memory redos

# 12 samples, 5 held out: steps of 6 and 1 sequences. On 2 ranks: 3 each in the first (a budget of two
# sequences a micro-batch: 2 + 1), then one rank has no sample at all.
REDUCTION = {"eval_samples": 5, "global_batch_size": 6, "max_steps": 2}


def _two_sequence_budget(setup: dict[str, Any]) -> int:
    from dflash_assets.drafter.objective import estimate_step_bytes

    config = tiny_drafter_config(Path(setup["target_dir"]))
    return estimate_step_bytes(config, 2, max(setup["num_tokens"]), SETTINGS["num_anchors"])


def _train_with_out_of_memory_on_rank_1(collective, setup) -> dict[str, Any]:
    """A short run; on rank 1, in step 1, an out-of-memory error raised inside a backward: in the reducing
    micro-batch (`reducing`), in one before it (`accumulating`), or anywhere with one sequence a
    micro-batch (`unfit`)."""
    import torch.distributed as dist

    import dflash_assets.training.distributed as distributed

    distributed.BUCKET_CAP_MB = 0.01  # the tiny drafter's gradients in many buckets, reduced one by one
    all_reduce, reductions = dist.all_reduce, [0]

    def counted_all_reduce(*args: Any, **kwargs: Any) -> Any:
        reductions[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted_all_reduce  # this rank's process only
    where = setup["out_of_memory"]
    budget = 1 if where == "unfit" else _two_sequence_budget(setup)
    trainer = _trainer(collective, setup, **REDUCTION, micro_batch_bytes=budget)
    lines: list[str] = []
    trainer.log = lines.append
    failed: dict[str, Any] = {}
    backwards: list[bool] = []  # in step 1 on this rank: whether each micro-batch was the reducing one
    during_backward: list[int] = []  # all-reduces begun in step 1 by the time its backward reaches layer 0
    accumulate, in_step = trainer._accumulate, []

    def accumulating(*args: Any) -> Any:
        in_step.append(True)
        reductions[0] = 0
        try:
            return accumulate(*args)
        finally:
            in_step.pop()

    trainer._accumulate = accumulating

    def fail_once(grad: torch.Tensor) -> torch.Tensor:
        if trainer.step == 0 and in_step:
            during_backward.append(reductions[0])
            reducing = getattr(trainer, "_in_reduction", None)
            backwards.append(reducing)
            wanted = {"reducing": reducing, "accumulating": not reducing, "unfit": True}.get(where, False)
            if collective.rank == 1 and not failed and wanted:
                failed["launched"] = trainer.gradients.launched
                raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return grad

    # The first layer's MLP: late in the backward, when the later layers' buckets are being reduced.
    trainer.model.layers[0].mlp.down_proj.weight.register_hook(fail_once)
    trainer.resume()
    try:
        result = trainer.train()
    except torch.OutOfMemoryError as error:
        return {"error": str(error), "failed": failed}
    return {
        "weights": _fingerprint(result.model)["sums"],
        "failed": failed,
        "backwards": backwards,
        "reduced_during_backward": max(during_backward),
        "buckets": len(trainer.gradients.module.reducer._get_zeros_like_grad_buckets())
        if hasattr(trainer, "gradients")
        else None,
        "warnings": [line for line in lines if "out of memory" in line],
    }


@pytest.fixture(scope="module")
def one_process_weights(offline_setup) -> dict[str, float]:
    """The weights one process reaches on the same samples: what every world size must reach."""
    setup = {**offline_setup, "case": "reduction-alone", "run": "reduction-alone"}
    trainer = _trainer(SingleProcess(), setup, **REDUCTION, micro_batch_bytes=_two_sequence_budget(setup))
    trainer.resume()
    return _fingerprint(trainer.train().model)["sums"]


@pytest.mark.slow  # ranks in processes of their own
@pytest.mark.parametrize("out_of_memory", ["none", "reducing", "accumulating"])
def test_two_ranks_reach_one_process_s_weights_whatever_their_micro_batches_empty_shares_or_redos(
    offline_setup, one_process_weights, out_of_memory
):
    setup = {**offline_setup, "case": f"reduction-{out_of_memory}", "out_of_memory": out_of_memory}
    ranks = run_ranks(_train_with_out_of_memory_on_rank_1, 2, {**setup, "run": setup["case"]})
    assert all("weights" in rank for rank in ranks), ranks
    for rank in ranks:
        assert rank["weights"] == pytest.approx(one_process_weights, rel=1e-4, abs=1e-5)
    assert ranks[0]["weights"] == pytest.approx(ranks[1]["weights"], rel=1e-9)
    one, other = ranks[1], ranks[0]
    if out_of_memory == "none":
        # The sum over the ranks overlaps the backward: buckets of the later layers are being reduced
        # while the backward is still on the first.
        assert one["reduced_during_backward"] > 0 and other["reduced_during_backward"] > 0
        assert one["backwards"] == other["backwards"] == [False, True] and not one["warnings"]
    elif out_of_memory == "reducing":
        # Rank 1 failed part-way through its reducing backward (some buckets reduced, not all); it finished
        # them with zeros and both ranks redid the step, rank 1 with one sequence a micro-batch.
        assert 0 < one["failed"]["launched"] < one["buckets"]
        assert one["backwards"] == [False, True, False, False, True]
        assert other["backwards"] == [False, True, False, True]
        assert "redone on every rank" in one["warnings"][0]
    else:
        # Out of memory before its reducing micro-batch: rank 1 redid its own share alone.
        assert one["backwards"] == [False, False, False, True]
        assert other["backwards"] == [False, True]
        assert "redone on every rank" not in one["warnings"][0]


@pytest.mark.slow  # ranks in processes of their own
def test_a_sequence_that_does_not_fit_alone_on_one_rank_stops_every_rank_alike(offline_setup):
    setup = {**offline_setup, "case": "reduction-unfit", "run": "reduction-unfit", "out_of_memory": "unfit"}
    ranks = run_ranks(_train_with_out_of_memory_on_rank_1, 2, setup)
    assert all("error" in rank for rank in ranks), ranks
    assert ranks[1]["error"].startswith("one sequence does not fit on cpu (step 1")
    assert ranks[0]["error"].startswith("one sequence does not fit on 1 other rank(s) (step 1")


# ---------------------------------------------------------------------------------------- resuming


class _FakeCuda:
    """torch.cuda as a node with fewer visible GPUs than the checkpoint's saver had."""

    def __init__(self, visible: int, current: int) -> None:
        self.visible, self.current = visible, current
        self.set: list[torch.Tensor] = []

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return self.visible

    def current_device(self) -> int:
        return self.current

    def set_rng_state(self, state: torch.Tensor, device: str = "cuda") -> None:
        self.set.append(state)


def test_rng_states_saved_on_8_gpus_restore_where_fewer_are_visible():
    torch_state = torch.get_rng_state()
    saved = [torch.full((8,), i, dtype=torch.uint8) for i in range(8)]  # a 8-GPU node's per-device list
    import random

    state = {"torch": torch_state, "python": random.getstate(), "cuda": saved}
    on_two = _FakeCuda(visible=2, current=1)
    restore_rng_state(state, cuda=on_two)  # was an IndexError in set_rng_state_all
    assert [int(s[0]) for s in on_two.set] == [1]  # this rank's device, not every visible one
    one_state = _FakeCuda(visible=1, current=0)
    restore_rng_state({**state, "cuda": saved[5]}, cuda=one_state)  # the current format: one state
    assert [int(s[0]) for s in one_state.set] == [5]
    past_the_list = _FakeCuda(visible=4, current=3)
    restore_rng_state({**state, "cuda": saved[:2]}, cuda=past_the_list)
    assert [int(s[0]) for s in past_the_list.set] == [0]


def _resume_on_two_nodes(collective, setup) -> dict[str, Any]:
    store = CountingStore(setup["store"], setup["downloads"])
    trainer = _trainer(collective, setup, store=store, max_steps=4, checkpoint_every_steps=2)
    trainer.resume()
    return {"resumed_from": trainer.resumed_from, "weights": _fingerprint(trainer.model)["sums"]}


@pytest.mark.slow  # ranks in processes of their own
def test_a_resume_fetches_each_checkpoint_object_once_per_node_and_keeps_no_copy_but_rank_0_s(offline_setup):
    root = Path(offline_setup["root"])
    setup = {**offline_setup, "case": "resume", "run": "resume", "downloads": str(root / "downloads")}
    first_setup = {**setup, "case": "resume-first"}
    first = _trainer(SingleProcess(), first_setup, max_steps=2, checkpoint_every_steps=2)
    first.resume()
    first.train()
    assert not (root / "resume-first" / "node" / "checkpoints").exists()  # committed: no local copy kept

    nodes = ["node-a", "node-a", "node-b"]
    ranks = run_ranks(_resume_on_two_nodes, 3, {**setup, "nodes": nodes}, nodes=nodes)
    assert all(isinstance(rank, dict) for rank in ranks), ranks
    assert {rank["resumed_from"] for rank in ranks} == {2}
    assert ranks[0]["weights"] == ranks[1]["weights"] == ranks[2]["weights"]
    downloads = _downloads(root / "downloads")
    prefix = checkpoint_prefix("resume", 2)
    # node-a's rank 0 and node-b's first rank each fetched every file once; node-a's rank 1 read rank 0's.
    assert {name: downloads.get(f"{prefix}/{name}") for name in CHECKPOINT_FILES} == dict.fromkeys(
        CHECKPOINT_FILES, 2
    )
    assert (root / "resume" / "node-a" / "checkpoints" / "step_00000002").is_dir()  # rank 0's own
    assert not (root / "resume" / "node-b" / "checkpoints" / "step_00000002").exists()
    assert not list(root.glob("resume/*/work/rank-*")) and not list(root.glob("resume/**/rank-*/checkpoints"))


# ------------------------------------------------------------------------------- ranks that disagree


def _disagree(collective, setup) -> list[str]:
    messages = []
    trainer = _trainer(collective, setup)
    if collective.rank == 1:
        with torch.no_grad():
            trainer.model.fc.weight.add_(1e-3)
    try:
        trainer.check_ranks_agree()
    except ValueError as error:
        messages.append(str(error))
    objects = setup["objects"][:-1] if collective.rank == 1 else setup["objects"]
    try:
        _trainer(collective, setup, objects=objects).check_ranks_agree()
    except ValueError as error:
        messages.append(str(error))
    return messages


@pytest.mark.slow  # ranks in processes of their own
def test_ranks_whose_initial_weights_or_data_differ_are_named_before_the_first_step(offline_setup):
    ranks = run_ranks(_disagree, 2, {**offline_setup, "case": "disagree"})
    for messages in ranks:  # every rank stops, with the same words
        assert len(messages) == 2, messages
        assert messages[0].startswith("rank 1's weights differ from rank 0's at the start (first: fc.weight")
        assert messages[1].startswith("rank 1 lists 8 training samples")
        assert "where rank 0 lists 9" in messages[1]


# ----------------------------------------------------------------- compiled before the first timed collective


class _Recording(SingleProcess):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce_sum")
        return tensor

    def all_gather_object(self, value: Any, *, long: bool = False) -> list[Any]:
        self.calls.append("all_gather_object (long)" if long else "all_gather_object")
        return [value]

    def long_barrier(self) -> None:
        self.calls.append("long_barrier")


def test_kernels_are_compiled_before_the_first_timed_collective_and_the_ranks_then_meet_with_the_long_timeout(
    offline_setup, monkeypatch
):
    import dflash_assets.training.train as train_module

    collective = _Recording()
    trainer = _trainer(collective, {**offline_setup, "case": "warm-up"}, max_steps=1, eval_samples=0)
    trainer.compiles = lambda: True  # what a GPU with flex attention reports; the CPU runs the same steps
    forwards: list[tuple[str, bool, int]] = []
    loss = train_module.dflash_loss

    def counted(model, batch, anchors, gamma, **kwargs):
        kind = "warm-up" if set(batch.sample_indices) == {-1} else "step"
        forwards.append((kind, torch.is_grad_enabled(), len(batch.sample_indices)))
        collective.calls.append(f"forward {kind}")
        return loss(model, batch, anchors, gamma, **kwargs)

    monkeypatch.setattr(train_module, "dflash_loss", counted)
    trainer.resume()
    trainer.train()
    timed = ("all_reduce_sum", "all_gather_object")
    first_timed = min(i for i, call in enumerate(collective.calls) if call in timed)
    assert collective.calls[:3] == ["forward warm-up"] * 2 + ["long_barrier"]
    assert first_timed == 3
    # What compiles apart (drafter/model.py): with gradients (training) or without (evaluation, speculative
    # drafting). Flex attention packs a micro-batch's sequences into one row, so one warm-up of several
    # sequences each covers every batch size (test_flex_compile counts the graphs).
    warm_ups = {(grad, sequences) for kind, grad, sequences in forwards if kind == "warm-up"}
    assert warm_ups == {(True, 2), (False, 2)}


# -------------------------------------------------------------------------------- which errors restart


@pytest.mark.parametrize(
    ("error", "restarts"),
    [
        (TransientStoreError("503 SlowDown"), True),
        (ConnectionResetError("reset"), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4312"), True),
        (torch.distributed.DistBackendError("NCCL watchdog timed out"), True),
        (CheckpointError("checkpoint s3://b/c cannot be downloaded"), False),
        (StoreConfigError("bucket 'x' does not exist"), False),
        (ValueError("hidden states of layers [1, 2] but the drafter wants [1, 3]"), False),
        (IndexError("list index out of range"), False),
        (KeyError("model.layers.0"), False),
        (torch.OutOfMemoryError("CUDA out of memory"), False),
        (OSError(errno.ENOSPC, "No space left on device"), False),
        (FileNotFoundError(errno.ENOENT, "no such file"), False),
    ],
)
def test_only_errors_from_outside_the_run_restart_its_ranks(error, restarts):
    assert restartable(error) is restarts


def test_an_error_raised_from_a_transient_one_restarts():
    try:
        try:
            raise TransientStoreError("GET timed out")
        except TransientStoreError as cause:
            raise CheckpointError("checkpoint s3://b/c cannot be downloaded") from cause
    except CheckpointError as error:
        assert restartable(error)


# ----------------------------------------------------------------------------- threads and their devices


def test_a_background_thread_makes_its_device_current_before_it_runs_the_target(monkeypatch, target_dir):
    """CUDA's current device is per thread and starts at 0: the replica threads and the thread running the
    target ahead set theirs (on a GPU node, kernels without an explicit device would run on GPU 0)."""
    import threading

    import dflash_assets.extraction.capture as capture_module
    from dflash_assets.extraction.capture import ReplicatedCapture
    from dflash_assets.target.devices import current_device, thread_on_device
    from dflash_assets_tests.support.drafter_fixtures import load_capture

    set_to: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: set_to.append((threading.current_thread().name, d))
    )
    entered: list[torch.device] = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Recorder)
    thread_on_device("cuda:1")()
    with current_device("cuda:3"):
        pass
    with current_device("cpu:1"):  # a CPU lease: nothing to set
        pass
    assert [d for _, d in set_to] == [torch.device("cuda:1")] and entered == [torch.device("cuda:3")]

    # Each replica runs its forward with its own device current, on a thread of its own.
    replicas: list[tuple[str, torch.device]] = []
    real = capture_module.current_device

    def noted(device):
        replicas.append((threading.current_thread().name, torch.device(device)))
        return real(device)

    monkeypatch.setattr(capture_module, "current_device", noted)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    ReplicatedCapture([load_capture(target_dir), load_capture(target_dir)], "cpu")(ids, torch.ones_like(ids))
    assert len(replicas) == 2 and all(name.startswith("target-replica") for name, _ in replicas)


def test_what_the_node_cache_keeps_and_what_each_epoch_reads_again_is_said_before_the_first_step(
    offline_setup, tmp_path
):
    store = open_store(offline_setup["store"])
    sizes = sorted(size for _, size in offline_setup["objects"])
    lines: list[str] = []
    for budget in (sum(sizes[:3]), 16 * 2**30):
        DrafterTrainer(
            tiny_drafter_config(Path(offline_setup["target_dir"])),
            TrainSettings(**{**SETTINGS, "eval_samples": 0}),
            OfflineData(
                store,
                offline_setup["objects"],
                tmp_path / f"cache-{budget}",
                num_tokens=offline_setup["num_tokens"],
                cache_budget_bytes=budget,
            ),  # fmt: skip
            store=store,
            run="cache-note",
            work_dir=tmp_path / f"work-{budget}",
            log=lines.append,
        )
    notes = [line for line in lines if line.startswith("offline cache:")]
    assert len(notes) == 2
    assert (
        "of 12 hidden-state objects" in notes[0] and "are read from the store again every epoch" in notes[0]
    )
    assert "cache_budget_bytes" in notes[0]
    assert notes[1].startswith("offline cache: 12 of 12") and "downloaded once for the run" in notes[1]
