"""`drafter_checkpoints` end to end: the `dagster` CLI a user types, a real S3 server, the demo target.
Train offline on the materialised ranges, kill the run, materialise again: it resumes exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dagster import AssetKey
from safetensors.torch import load_file

from dflash_assets.bench.zlab import load_zlab_drafter
from dflash_assets.drafter.export import load_drafter
from dflash_assets.storage.layout import CHECKPOINT_FILES
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import (
    aws_env,
    aws_env_set,
    create_bucket,
    make_dagster_home,
    open_instance,
)
from dflash_assets_tests.support.cli import dagster, materialize_args
from dflash_assets_tests.support.in_process import materialize_here
from dflash_assets_tests.support.s3_server import FaultyProxy
from dflash_assets_tests.support.secrets import SECRET_ENV, assert_no_secret

RANGES = ["00000000-00000023", "00000024-00000047"]
TRAIN = {
    "max_steps": 6,
    "checkpoint_every_steps": 2,
    "global_batch_size": 6,
    "num_anchors": 16,
    "eval_samples": 4,
    "spec_eval_prompts": 2,
    "spec_eval_max_new_tokens": 8,
    "log_every_steps": 1,
    "max_length": 256,
}


# For the tests of one setting's plumbing (online mode, devices, the mask token): one checkpoint.
SHORT = {**TRAIN, "max_steps": 2}
# The uninterrupted run's trajectory without its speculative decoding (minutes of the suite, and no part
# of the weights): for the runs whose weights or losses are compared with it.
SAME_STEPS = {**TRAIN, "spec_eval_prompts": 0}
# Data-parallel: two ranks launched with torch.distributed's launcher (gloo on the CPU).
TWO_RANKS = {"DFLASH_TRAIN_NPROC_PER_NODE": "2", "DFLASH_DEVICES": "cpu:0,cpu:1"}


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    dagster = Path(sys.executable).with_name("dagster")
    return subprocess.run([str(dagster), *args], env=env, capture_output=True, text=True, timeout=600)


def _materialize(
    asset: str,
    env: dict[str, str],
    partition: str | None = None,
    config: dict | None = None,
    in_process: bool = True,
):
    """The training step runs in this process under `env` (a run reads its settings when it starts), except
    where a test kills it: then through the `dagster` command, in a process of its own."""
    if not in_process:
        return _cli(materialize_args(asset, partition, config), env)
    run = materialize_here(asset, partition, env, config={asset: config} if config else None)
    return subprocess.CompletedProcess([asset], 0 if run.success else 1, stdout=run.output, stderr="")


@pytest.fixture(scope="module")
def ranges(tmp_path_factory, moto_endpoint, demo_ranges, demo_model_dir):
    """The shared tokenized and extracted ranges (conftest's `demo_ranges`) copied into a bucket, read
    by every training test here."""
    root = tmp_path_factory.mktemp("train")
    create_bucket(moto_endpoint, "train-ranges")
    env = {
        **os.environ,
        **aws_env(moto_endpoint),
        "DFLASH_HOME": str(root / "home"),
        "DFLASH_CACHE_DIR": str(demo_model_dir.parent),
        "DFLASH_SAMPLES_PER_PARTITION": "24",
        "DFLASH_STORE_URL": ranges_store_url(),
        "OMP_NUM_THREADS": "1",
        **SECRET_ENV,  # besides AWS's: none may show up anywhere
    }
    with aws_env_set(moto_endpoint):
        demo_ranges.copy_to(open_store(ranges_store_url()))
        yield {"env": env, "root": root, "model_dir": demo_model_dir}


def _train(
    ranges, tmp_path: Path, name: str, run: str, in_process: bool = True, train: dict = TRAIN, **extra_env
) -> tuple[subprocess.CompletedProcess, dict]:
    env = {
        **ranges["env"],
        "DAGSTER_HOME": make_dagster_home(tmp_path / name),
        "DFLASH_HOME": str(tmp_path / name),
        **extra_env,
    }
    done = _materialize("drafter_checkpoints", env, config={**train, "run_name": run}, in_process=in_process)
    return done, env


def _exported(run: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    store = open_store(ranges_store_url())
    local = tmp_path / f"export-{run}"
    for name in ("config.json", "model.safetensors", "README.md"):
        store.download(f"drafter/{run}/{name}", local / name)
    return load_file(str(local / "model.safetensors"))


def ranges_store_url() -> str:
    return "s3://train-ranges/shared"


@pytest.fixture(scope="module")
def offline_run(ranges, tmp_path_factory):
    """One uninterrupted offline training run (`offline-run`): what the first test checks, and the
    weights a killed and resumed run must end at."""
    tmp_path = tmp_path_factory.mktemp("offline")
    done, env = _train(ranges, tmp_path, "offline", "offline-run")
    return done, env


def test_offline_training_reads_every_materialised_range_and_exports_a_loadable_drafter(
    ranges, offline_run, tmp_path
):
    done, env = offline_run
    assert done.returncode == 0, done.stderr[-4000:]
    assert assert_no_secret(
        texts=[done.stdout, done.stderr],
        dagster_home=env["DAGSTER_HOME"],
        stores=[open_store(ranges_store_url())],
        directories=[env["DFLASH_HOME"]],
    )

    store = open_store(ranges_store_url())
    manifest = read_manifest(store, "checkpoints/offline-run")
    assert manifest["trained_partitions"] == RANGES
    assert manifest["steps"] == TRAIN["max_steps"]
    assert len(manifest["checkpoints"]) >= 3  # steps 2, 4, 6

    local = tmp_path / "export"
    for name in ("config.json", "model.safetensors", "README.md"):
        store.download(f"drafter/offline-run/{name}", local / name)
    drafter = load_drafter(local, target_model=ranges["model_dir"])
    config = json.loads((local / "config.json").read_text())
    # The default drafter: DFlash2 (DFLASH_DRAFTER_ARCH) at its recipes' block of 8, in z-lab's layout.
    assert config["architectures"] == ["DFlash2DraftModel"] and config["block_size"] == 8
    assert config["num_target_layers"] == 12  # the demo target's depth
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 5, 7, 9]
    assert config["dflash_config"]["mask_token_id"] == 3
    assert config["dflash_assets"]["trained_partitions"] == RANGES
    assert "tokenizer's mask_token" in config["dflash_assets"]["mask_token_source"]
    assert drafter.lm_head_weight.shape[0] == config["vocab_size"]
    _, loading = load_zlab_drafter(local)  # z-lab's own class: every weight it names, and nothing else
    assert {name: sorted(keys) for name, keys in loading.items() if keys} == {}
    card = (local / "README.md").read_text()
    assert "sglang.launch_server" in card and "[1, 3, 5, 7, 9]" in card
    assert config["dflash_config"]["mask_token"] == "<|mask|>"  # the demo tokenizer's token for id 3

    # Training curves in the store: TensorBoard reads a loss (and the rest) at every step the run made.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tensorboard"
    for info in store.list("checkpoints/offline-run/tensorboard/"):
        store.download(info.key, logdir / info.key.rsplit("/", 1)[-1])
    curves = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    curves.Reload()
    for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "sequences_per_step"):
        assert [e.step for e in curves.Scalars(f"train/{tag}")] == list(range(1, TRAIN["max_steps"] + 1)), tag
    assert [e.step for e in curves.Scalars("eval/tau_measured")] == [0, 2, 4, 6]

    # The whole directory, copied out of the store, loads with transformers' AutoModel and remote code.
    _check_automodel_export(store, "offline-run", tmp_path / "automodel", ranges["model_dir"])

    with open_instance(env["DAGSTER_HOME"]) as instance:
        event = instance.get_latest_materialization_event(AssetKey("drafter_checkpoints"))
        metadata = {k: v.value for k, v in event.asset_materialization.metadata.items()}
        observations = instance.fetch_observations(AssetKey("drafter_checkpoints"), limit=20).records
    assert metadata["steps"] == TRAIN["max_steps"]
    # Why it ended and whose weights it exported, in the UI and in the manifest beside the curve.
    ended = {"until_flat": False, "stop_reason": f"max_steps reached (cap {TRAIN['max_steps']})"}
    assert {**ended, "exported_step": TRAIN["max_steps"]} == {
        k: metadata[k] for k in (*ended, "exported_step")
    }
    assert {**ended, "exported_step": TRAIN["max_steps"]} == {
        k: manifest[k] for k in (*ended, "exported_step")
    }
    # The figures the UI shows are the ones the export and the run's manifest carry.
    metrics = config["dflash_assets"]["metrics"]
    assert metadata["acceptance_length_tau"] == pytest.approx(metrics["acceptance_length_tau"])
    assert metadata["acceptance_length_tau"] == pytest.approx(manifest["acceptance_length_tau"])
    assert metadata["baseline_acceptance_length_tau"] == pytest.approx(
        manifest["baseline_acceptance_length_tau"]
    )
    assert f"{metrics['acceptance_length_tau']:.3f}" in card
    assert metadata["spec_matches_target_greedy"] is True
    # tau per bucket of held-out prompt lengths (the demo's are all short), in the UI and in the card.
    by_length = metadata["tau_by_context_length"]
    assert list(by_length) == ["under_2k"] and metrics["tau_by_context_length"] == by_length
    assert metadata["spec_tau_under_2k"] == pytest.approx(metadata["acceptance_length_tau"])
    assert "tau measured on prompts of < 2K tokens" in card
    drafted = range(1, config["block_size"])  # every drafted position of the block (DFlash2: 8)
    assert {f"accuracy_pos_{p:02d}" for p in drafted} <= set(metadata)
    assert metadata["drafter_uri"] == "s3://train-ranges/shared/drafter/offline-run"
    assert len(observations) >= 4  # the untrained baseline, then one per checkpoint, for the UI's plots
    observed = observations[0].asset_observation.metadata
    assert {"eval_loss", "eval_teacher_forced_tau", "spec_acceptance_length_tau"} <= set(observed)


def _check_automodel_export(store, run: str, local: Path, target_dir: Path) -> None:
    """`AutoModel.from_pretrained(dir, trust_remote_code=True)` on a copy of drafter/<run>/ drafts what
    z-lab's own `dflash` package computes from the same directory (an implementation independent of
    ours, for either architecture)."""
    from transformers import AutoModel, AutoModelForCausalLM

    for info in store.list(f"drafter/{run}/"):
        store.download(info.key, local / info.key.rsplit("/", 1)[-1])
    assert (local / "modeling_dflash.py").is_file()
    remote = AutoModel.from_pretrained(local, trust_remote_code=True, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids = torch.randint(4, 1000, (25,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = target(input_ids=ids[None, :-1], output_hidden_states=True).hidden_states
        context = torch.stack([states[i + 1][0] for i in remote.target_layer_ids], dim=1)  # [24, K, H]
        block = torch.full((remote.block_size,), remote.mask_token_id)
        block[0] = ids[-1]
        hidden = remote(
            position_ids=torch.arange(24 + remote.block_size)[None],
            noise_embedding=target.get_input_embeddings()(block)[None],
            target_hidden=context.reshape(1, 24, -1),
        )
        zlab, _ = load_zlab_drafter(local)
        expected = zlab(
            position_ids=torch.arange(24 + remote.block_size)[None],
            noise_embedding=target.get_input_embeddings()(block)[None],
            target_hidden=context.reshape(1, 24, -1),
        )
    torch.testing.assert_close(
        target.lm_head(hidden[0, 1:]), target.lm_head(expected[0, 1:]), rtol=1e-4, atol=1e-4
    )


def test_a_killed_training_run_resumes_from_the_store_and_ends_at_the_same_weights(
    ranges, offline_run, tmp_path
):
    done, _ = offline_run  # the same settings, never interrupted
    assert done.returncode == 0, done.stderr[-4000:]

    # The user's default command: the fault point SIGKILLs the step's own process.
    killed, env = _train(
        ranges, tmp_path, "killed", "resumed", in_process=False, train=SAME_STEPS,
        DFLASH_FAULT_POINTS="train_step@5",
    )  # fmt: skip
    assert killed.returncode != 0
    assert read_manifest(open_store(ranges_store_url()), "checkpoints/resumed") is None
    resumed = _materialize(
        "drafter_checkpoints", env, config={**SAME_STEPS, "run_name": "resumed"}, in_process=False
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming run resumed from" in resumed.stdout + resumed.stderr

    straight, again = _exported("offline-run", tmp_path), _exported("resumed", tmp_path)
    assert straight.keys() == again.keys()
    for name in straight:
        assert torch.equal(straight[name], again[name]), name  # bitwise on CPU


def test_two_trainings_with_the_default_run_name_on_two_stores_keep_to_their_own(
    ranges, offline_run, tmp_path
):
    """One user (one DFLASH_HOME), two stores, the default run name for both. The first is killed after
    its checkpoint at step 4; the second, on other data, writes a step 4 of its own; the first then
    resumes from its own step 4 and ends at the uninterrupted run's weights. Each store holds only its
    own run."""
    done, _ = offline_run  # the first's settings and data, never interrupted
    assert done.returncode == 0, done.stderr[-4000:]
    other_url = "s3://train-ranges/other"
    shared, other = open_store(ranges_store_url()), open_store(other_url)
    for prefix in (f"tokenized-completions/{RANGES[1]}/", f"hidden-states/{RANGES[1]}/"):
        for info in shared.list(prefix):
            other.put_bytes(info.key, shared.get_bytes(info.key))
    user = {
        **ranges["env"],
        "DAGSTER_HOME": make_dagster_home(tmp_path / "dagster-home"),
        "DFLASH_HOME": str(tmp_path / "home"),
    }
    first, second = user, {**user, "DFLASH_STORE_URL": other_url}
    assert "run_name" not in TRAIN  # both take the default name, `drafter`

    # The fault point kills the process the step runs in: the `dagster` command's, not this one.
    dies = {**first, "DFLASH_FAULT_POINTS": "train_step@5"}
    killed = _materialize("drafter_checkpoints", dies, config=SAME_STEPS, in_process=False)
    assert killed.returncode != 0 and read_manifest(shared, "checkpoints/drafter") is None
    finished = _materialize("drafter_checkpoints", second, config={**SAME_STEPS, "max_steps": 4})
    assert finished.returncode == 0, finished.stderr[-4000:]
    resumed = _materialize("drafter_checkpoints", first, config=SAME_STEPS)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming run drafter from" in resumed.stdout + resumed.stderr

    straight, again = _exported("offline-run", tmp_path), _exported("drafter", tmp_path)
    assert all(torch.equal(straight[name], again[name]) for name in straight)  # its own step 4, not theirs
    assert read_manifest(shared, "checkpoints/drafter")["trained_partitions"] == RANGES
    assert read_manifest(other, "checkpoints/drafter")["trained_partitions"] == [RANGES[1]]


def test_offline_training_without_materialised_ranges_says_which_asset_to_materialise(ranges, tmp_path):
    env = {
        **ranges["env"],
        "DFLASH_STORE_URL": "s3://train-ranges/empty",
        "DAGSTER_HOME": make_dagster_home(tmp_path / "empty"),
        "DFLASH_HOME": str(tmp_path / "empty"),
    }
    done = _materialize("drafter_checkpoints", env, config={**TRAIN, "run_name": "nothing"})
    assert done.returncode != 0
    assert "materialise hidden_state_partitions" in done.stdout + done.stderr


def test_hidden_states_captured_from_other_layers_are_refused_naming_the_partition(ranges, tmp_path):
    # Two ranks: the error reaches the step from the rank that met it, and no restart is spent on it.
    other_layers = {"DFLASH_TARGET_LAYER_IDS": "2,4,6,8,10", **TWO_RANKS}
    done, _ = _train(ranges, tmp_path, "mismatch", "mismatch", **other_layers)
    assert done.returncode != 0
    output = done.stdout + done.stderr
    # The first object read names its partition (held-out samples are read first, for the baseline).
    assert any(f"(partition {key}," in output for key in RANGES)
    assert "[1, 3, 5, 7, 9]" in output and "[2, 4, 6, 8, 10]" in output
    assert "the training ranks stopped: rank " in output and "restart 1 of" not in output


def test_a_global_batch_smaller_than_the_world_size_is_named_before_the_ranks_start(ranges, tmp_path):
    # The setting as a user exports it (run config would win over it).
    one_sequence = {k: v for k, v in SHORT.items() if k != "global_batch_size"}
    one_sequence.update(max_steps=1, eval_samples=0, spec_eval_prompts=0)
    done, _ = _train(
        ranges,
        tmp_path,
        "idle",
        "idle-rank",
        train=one_sequence,
        DFLASH_TRAIN_GLOBAL_BATCH_SIZE="1",
        **TWO_RANKS,
    )
    output = done.stdout + done.stderr
    assert "the global batch of 1 sequence(s) a step" in output and "smaller than the world size 2" in output
    assert output.index("smaller than the world size 2") < output.index("launching 2 rank(s)")
    assert done.returncode == 0, output[-4000:]  # it trains: rank 1 only waits


def test_a_multi_node_run_on_a_host_whose_name_resolves_to_loopback_is_refused_before_any_launch(
    ranges, tmp_path
):
    env = {
        **ranges["env"],
        "DAGSTER_HOME": make_dagster_home(tmp_path / "loopback"),
        "DFLASH_HOME": str(tmp_path / "loopback"),
        "DFLASH_TRAIN_NNODES": "2",
    }
    started = time.monotonic()
    done = _materialize("drafter_checkpoints", env, config={**SHORT, "run_name": "loopback"})
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "resolves to 127." in output and "(loopback)" in output
    assert "DFLASH_TRAIN_NETWORK_INTERFACE" in output
    assert "waiting for 1 more node" not in output and time.monotonic() - started < 120


def test_the_last_decoder_layer_as_a_target_layer_is_refused_naming_the_setting_and_why(ranges, tmp_path):
    last = "DFLASH_TARGET_LAYER_IDS=[1, 3, 5, 7, 11]: layer 11 is the last of the target's 12 decoder layers"
    for asset, partition in (("hidden_state_partitions", RANGES[0]), ("drafter_checkpoints", None)):
        env = {
            **ranges["env"],
            "DAGSTER_HOME": make_dagster_home(tmp_path / asset),
            "DFLASH_HOME": str(tmp_path / asset),
            "DFLASH_TARGET_LAYER_IDS": "1,3,5,7,11",
        }
        config = {**TRAIN, "run_name": "last-layer"} if partition is None else None
        done = _materialize(asset, env, partition, config)
        assert done.returncode != 0
        output = done.stdout + done.stderr
        assert last in output and "hidden_states[12] is its output after the final norm" in output, asset
    # Refused before anything was touched: the range's committed objects are still there.
    assert read_manifest(open_store(ranges_store_url()), f"hidden-states/{RANGES[0]}") is not None


@pytest.fixture(scope="module")
def online_run(ranges, tmp_path_factory):
    """One short online run with the target sharing the drafter's device and an explicit mask token:
    two settings' plumbing checked on one run."""
    tmp_path = tmp_path_factory.mktemp("online")
    return _train(
        ranges,
        tmp_path,
        "online",
        "online-run",
        train=SHORT,
        DFLASH_TRAIN_MODE="online",
        DFLASH_MASK_TOKEN_ID="1530",
    )


def test_online_training_runs_the_target_beside_the_trainer_on_the_tokenized_ranges(online_run):
    done, env = online_run
    assert done.returncode == 0, done.stderr[-4000:]
    assert "target replicas on cpu; drafter on cpu" in done.stdout + done.stderr  # one device, shared
    manifest = read_manifest(open_store(ranges_store_url()), "checkpoints/online-run")
    assert manifest["mode"] == "online"
    assert manifest["trained_partitions"] == RANGES
    with open_instance(env["DAGSTER_HOME"]) as instance:
        event = instance.get_latest_materialization_event(AssetKey("drafter_checkpoints"))
        metadata = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    assert metadata["mode"] == "online" and metadata["steps"] == SHORT["max_steps"]
    assert metadata["target_devices"] == metadata["device"] == "cpu"
    assert metadata["loss"] > 0


def test_online_ranks_each_own_their_target_replicas_on_devices_of_their_own(ranges, tmp_path):
    # Two drafter ranks, each with two target replicas on devices it leases for itself: six devices.
    env = {
        **ranges["env"],
        "DAGSTER_HOME": make_dagster_home(tmp_path / "multi"),
        "DFLASH_HOME": str(tmp_path / "m"),
        "DFLASH_TRAIN_MODE": "online",
        "DFLASH_TRAIN_NPROC_PER_NODE": "2",
        "DFLASH_DEVICES": ",".join(f"cpu:{i}" for i in range(6)),
    }
    done = _materialize(
        "drafter_checkpoints",
        env,
        config={**SHORT, "spec_eval_prompts": 0, "run_name": "multi-device", "online_target_devices": 2},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    with open_instance(env["DAGSTER_HOME"]) as instance:
        event = instance.get_latest_materialization_event(AssetKey("drafter_checkpoints"))
        metadata = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    assert metadata["world_size"] == 2 and metadata["steps"] == SHORT["max_steps"]
    drafters = [r["device"] for r in metadata["rank_devices"]]
    targets = metadata["target_devices"].split(", ")  # rank 0's replicas
    assert len(targets) == 2 and not set(targets) & set(drafters)
    assert f"target replicas on {metadata['target_devices']}; drafter on {drafters[0]}" in done.stdout


def test_an_explicit_mask_token_id_reaches_the_export(online_run):
    done, _ = online_run
    assert done.returncode == 0, done.stderr[-4000:]
    assert "mask token 1530: explicit setting" in done.stdout + done.stderr
    store = open_store(ranges_store_url())
    config = json.loads(store.get_bytes("drafter/online-run/config.json"))
    assert config["dflash_config"]["mask_token_id"] == 1530


def _curves(run: str, tmp_path: Path):
    """The run's event files in the store, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = open_store(ranges_store_url())
    logdir = tmp_path / f"tensorboard-{run}"
    for info in store.list(f"checkpoints/{run}/tensorboard/"):
        store.download(info.key, logdir / info.key.rsplit("/", 1)[-1])
    curves = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    curves.Reload()
    return curves


def _losses(run: str, tmp_path: Path) -> dict[int, float]:
    """Per-step training loss as TensorBoard reads the run's event files in the store."""
    return {event.step: event.value for event in _curves(run, tmp_path).Scalars("train/loss")}


def _assert_same_weights(one: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> None:
    """Equal up to float reduction order: the bf16 export of float32 weights that differ in their last
    bits rounds a handful of elements one bf16 step apart."""
    assert one.keys() == other.keys()
    for name in one:
        a, b = one[name].float(), other[name].float()
        assert (a - b).norm() <= 1e-3 * b.norm().clamp_min(1e-12), name


def _committed_checkpoints(run: str) -> dict[str, bytes]:
    """Every object of the run's committed checkpoints, by key."""
    store = open_store(ranges_store_url())
    return {
        info.key: store.get_bytes(info.key)
        for info in store.list(f"checkpoints/{run}/step_")
        if store.head(info.key.rsplit("/", 1)[0] + "/_complete.json") is not None
    }


def _training_processes(marker: Path) -> list[str]:
    """Launchers and ranks whose command line names a path under `marker` (this test's own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(marker) in command and "dflash_assets.training" in command:
            found.append(f"{entry.name}: {command[:200]}")
    return found


def _rank_pid(marker: Path, rank: int) -> int | None:
    for line in _training_processes(marker):
        pid = int(line.split(":", 1)[0])
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if "dflash_assets.training.rank" in line and f"RANK={rank}".encode() in environ:
            return pid
    return None


def _wait_until(condition, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def two_ranks_run(ranges, tmp_path_factory):
    """The uninterrupted run's settings, trained by two ranks (world size 2), its objective named: D-PACE,
    the default the uninterrupted run trains with."""
    tmp_path = tmp_path_factory.mktemp("ranks")
    return _train(
        ranges, tmp_path, "ranks", "two-ranks", train=SAME_STEPS, DFLASH_DRAFTER_LOSS="dpace", **TWO_RANKS
    )


def test_the_default_objective_is_d_pace_at_any_world_size_and_not_the_paper_s_fixed_decay(
    ranges, offline_run, two_ranks_run, tmp_path
):
    decay, _ = _train(ranges, tmp_path, "decay", "decay-run", train=SAME_STEPS, DFLASH_DRAFTER_LOSS="decay")
    assert decay.returncode == 0, decay.stderr[-4000:]
    assert offline_run[0].returncode == 0 and two_ranks_run[0].returncode == 0
    default, dpace, fixed = (_curves(run, tmp_path) for run in ("offline-run", "two-ranks", "decay-run"))

    def per_step(curves, tag: str) -> dict[int, float]:
        return {event.step: event.value for event in curves.Scalars(f"train/{tag}")}

    steps = list(range(1, TRAIN["max_steps"] + 1))
    assert sorted(per_step(default, "loss")) == steps
    # The default at one rank is D-PACE at two, step for step (its normaliser is global) ...
    assert per_step(dpace, "loss") == pytest.approx(per_step(default, "loss"), rel=1e-4)
    # ... and not the fixed decay: the same weights and batch at step 1 (the plain cross-entropy logged
    # beside the loss agrees) weighed otherwise.
    assert per_step(fixed, "ce")[1] == pytest.approx(per_step(default, "ce")[1], rel=1e-5)
    for step in steps:
        assert per_step(fixed, "loss")[step] != pytest.approx(per_step(default, "loss")[step], rel=1e-3)
    # D-PACE's target, the expected accepted length, is logged at every step of both.
    assert all(value >= 1.0 for value in per_step(default, "expected_tau").values())
    assert sorted(per_step(fixed, "expected_tau")) == steps
    card = open_store(ranges_store_url()).get_bytes("drafter/decay-run/README.md").decode()
    assert "the paper's fixed position weights exp(-(p-1)/7)" in card
    assert (
        "D-PACE position weights (alpha 0.5)"
        in open_store(ranges_store_url()).get_bytes("drafter/offline-run/README.md").decode()
    )


def test_two_ranks_make_one_process_s_steps_and_export_the_same_weights(offline_run, two_ranks_run, tmp_path):
    one, _ = offline_run
    two, env = two_ranks_run
    assert one.returncode == 0, one.stderr[-4000:]
    assert two.returncode == 0, two.stderr[-4000:]
    assert "launching 2 rank(s) on node" in two.stdout + two.stderr

    steps = list(range(1, TRAIN["max_steps"] + 1))
    alone, ranks = _losses("offline-run", tmp_path), _losses("two-ranks", tmp_path)
    assert sorted(alone) == sorted(ranks) == steps
    assert ranks == pytest.approx(alone, rel=1e-4)  # each global batch's loss, summed over both ranks
    _assert_same_weights(_exported("offline-run", tmp_path), _exported("two-ranks", tmp_path))

    with open_instance(env["DAGSTER_HOME"]) as instance:
        event = instance.get_latest_materialization_event(AssetKey("drafter_checkpoints"))
        metadata = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    assert metadata["world_size"] == 2
    assert [r["device"] for r in metadata["rank_devices"]] == ["cpu:0", "cpu:1"]
    assert len(metadata["rank_step_seconds"]) == 2 and metadata["tokens_per_s"] > 0
    assert [w["world_size"] for w in metadata["trained_world_sizes"]] == [2]
    # TensorBoard: every rank's step time at every step (stragglers), and where each rank ran.
    curves = _curves("two-ranks", tmp_path)
    for rank in (0, 1):
        assert [e.step for e in curves.Scalars(f"ranks/step_s_rank_{rank}")] == steps
    placement = curves.Tensors("ranks/placement")[0].tensor_proto.string_val[0].decode()
    assert placement.startswith("world size 2: rank 0 ") and "cpu:0" in placement and "cpu:1" in placement
    card = open_store(ranges_store_url()).get_bytes("drafter/two-ranks/README.md").decode()
    assert "| trained at world sizes | 2 ranks (steps 1-6 on" in card


def _copy_run(source: str, target: str) -> None:
    store = open_store(ranges_store_url())
    for info in store.list(f"checkpoints/{source}/"):
        if "/step_" in info.key or "/tensorboard/" in info.key:
            store.put_bytes(info.key.replace(f"/{source}/", f"/{target}/", 1), store.get_bytes(info.key))


def test_a_checkpoint_written_at_one_world_size_continues_the_same_trajectory_at_another(
    ranges, offline_run, two_ranks_run, tmp_path, moto_endpoint
):
    assert offline_run[0].returncode == 0 and two_ranks_run[0].returncode == 0
    _copy_run("offline-run", "one-then-two")  # copies: the uninterrupted runs stay as they are
    _copy_run("two-ranks", "two-then-one")
    committed = {run: _committed_checkpoints(run) for run in ("one-then-two", "two-then-one")}
    longer = {**SAME_STEPS, "max_steps": TRAIN["max_steps"] + 2}

    # The two ranks resume through a proxy that notes every request: the node fetches each object of
    # the checkpoint once (rank 0; rank 1 reads its copy), and no rank keeps a copy of its own.
    with FaultyProxy(moto_endpoint) as proxy:
        to_two, _ = _train(
            ranges, tmp_path, "to-two", "one-then-two", train=longer, AWS_ENDPOINT_URL_S3=proxy.endpoint_url,
            **TWO_RANKS,
        )  # fmt: skip
        gets = proxy.forwarded_paths("GET")
    resumed = f"/train-ranges/shared/checkpoints/one-then-two/step_{TRAIN['max_steps']:08d}/"
    fetched = {path.removeprefix(resumed): gets.count(path) for path in gets if path.startswith(resumed)}
    assert fetched == dict.fromkeys([*CHECKPOINT_FILES, "_complete.json"], 1)
    assert not [path for path in (tmp_path / "to-two").rglob("*") if path.name.startswith(("rank-", "step_"))]
    to_one, _ = _train(ranges, tmp_path, "to-one", "two-then-one", train=longer)
    assert to_two.returncode == 0, to_two.stderr[-4000:]
    assert to_one.returncode == 0, to_one.stderr[-4000:]
    assert "trained so far at world size 1, now 2" in to_two.stdout + to_two.stderr
    assert "trained so far at world size 2, now 1" in to_one.stdout + to_one.stderr

    continued = {run: _losses(run, tmp_path) for run in ("one-then-two", "two-then-one")}
    assert sorted(continued["one-then-two"]) == list(range(1, longer["max_steps"] + 1))
    assert continued["one-then-two"] == pytest.approx(continued["two-then-one"], rel=1e-4)
    _assert_same_weights(_exported("one-then-two", tmp_path), _exported("two-then-one", tmp_path))
    for run, objects in committed.items():
        after = _committed_checkpoints(run)
        assert {key: after[key] for key in objects} == objects, run  # not one committed object rewritten
        assert len(after) > len(objects)  # the continuation committed its own
    card = open_store(ranges_store_url()).get_bytes("drafter/one-then-two/README.md").decode()
    assert "1 rank (steps 1-6 on" in card and "2 ranks (steps 7-8 on" in card


def test_a_killed_rank_is_restarted_and_a_dagster_process_killed_alone_takes_every_rank_with_it(
    ranges, tmp_path
):
    """From the shell, as a user meets them: a rank killed mid-run, then the `dagster` process killed
    alone (not its group). The first costs a restart from the last checkpoint, the second the whole job:
    no launcher, rank or lease is left, and the same command resumes without rewriting a checkpoint."""
    env = {**ranges["env"], "DAGSTER_HOME": make_dagster_home(tmp_path / "instance"),
           "DFLASH_HOME": str(tmp_path / "home"), **TWO_RANKS}  # fmt: skip
    faults = {**TRAIN, "eval_samples": 0, "spec_eval_prompts": 0, "max_steps": 16, "run_name": "killed"}
    args = materialize_args("drafter_checkpoints", None, faults)  # the user's command: a step process
    process = dagster(args, env)
    store = open_store(ranges_store_url())

    def committed_step(step: int) -> bool:
        return store.head(f"checkpoints/killed/step_{step:08d}/_complete.json") is not None

    _wait_until(lambda: committed_step(2), "the first committed checkpoint")
    rank_1 = _rank_pid(tmp_path, 1)
    assert rank_1 is not None, _training_processes(tmp_path)
    os.kill(rank_1, signal.SIGKILL)
    # A new rank 1, started by the launcher: looked for while it runs, not at one instant after a later
    # checkpoint, which a loaded machine once missed (the suite beside a training run found no rank 1).
    _wait_until(lambda: _rank_pid(tmp_path, 1) not in (None, rank_1), "a new rank 1 started by the launcher")
    _wait_until(lambda: committed_step(6), "a checkpoint after the ranks' restart")

    process.kill()  # the parent alone: its step, the launcher and both ranks must follow it
    output, _ = process.communicate()
    assert "a rank died; the launcher started every rank again (restart 1 of 3)" in output
    _wait_until(lambda: not _training_processes(tmp_path), "the launcher and both ranks to die with it", 15)
    from dflash_assets.target.devices import describe_holder, try_lease_device

    lock_dir = Path(env["DFLASH_CACHE_DIR"]) / "device-leases"

    def leases_free() -> bool:  # a dying process unmaps its memory before it closes its files
        for device in ("cpu:0", "cpu:1"):
            with try_lease_device([device], lock_dir=lock_dir) as free:
                if free != device:
                    return False
        return True

    _wait_until(leases_free, f"the ranks' leases to be released ({describe_holder(lock_dir, 'cpu:0')})", 15)

    committed = _committed_checkpoints("killed")
    again = subprocess.run([str(Path(sys.executable).with_name("dagster")), *args], env=env,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resuming run killed from" in again.stdout + again.stderr
    assert read_manifest(store, "checkpoints/killed")["steps"] == faults["max_steps"]
    after = _committed_checkpoints("killed")
    assert {key: after[key] for key in committed} == committed
    _wait_until(lambda: not _training_processes(tmp_path), "every launcher and rank to end", 10)


def test_a_node_joins_with_train_join_and_the_two_nodes_make_one_process_s_steps(
    ranges, offline_run, tmp_path
):
    """Without Celery: the step's node publishes its launch in the store (`DFLASH_TRAIN_NNODES=2`), and a
    second node, with a home, devices and name of its own, joins it with `dflash-assets train-join`."""
    assert offline_run[0].returncode == 0
    run = "joined-nodes"
    first = {
        **ranges["env"],
        "DAGSTER_HOME": make_dagster_home(tmp_path / "first"),
        "DFLASH_HOME": str(tmp_path / "first"),
        "DFLASH_NODE": "node-a",
        "DFLASH_DEVICES": "cpu:0",
        "DFLASH_TRAIN_NNODES": "2",
        "DFLASH_TRAIN_NETWORK_INTERFACE": "lo",
    }
    # One host plays both nodes: each leases a device of its own (they share the host's lease files), and
    # they talk over loopback.
    second = {
        **ranges["env"],
        "DFLASH_HOME": str(tmp_path / "second"),
        "DFLASH_NODE": "node-b",
        "DFLASH_DEVICES": "cpu:1",
        "DFLASH_TRAIN_NETWORK_INTERFACE": "lo",
    }
    joiner = subprocess.Popen(
        [str(Path(sys.executable).with_name("dflash-assets")), "train-join", "--run", run, "--wait-s", "300"],
        env=second,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        done = _materialize(
            "drafter_checkpoints", first, config={**SAME_STEPS, "run_name": run}, in_process=False
        )
        joined, _ = joiner.communicate(timeout=120)
    finally:
        if joiner.poll() is None:
            joiner.kill()
    assert done.returncode == 0, done.stderr[-4000:]
    assert joiner.returncode == 0, joined[-4000:]
    assert f"node node-b joins run {run}" in joined
    alone, nodes = _losses("offline-run", tmp_path), _losses(run, tmp_path)
    assert nodes == pytest.approx(alone, rel=1e-4) and sorted(nodes) == list(range(1, TRAIN["max_steps"] + 1))
    with open_instance(first["DAGSTER_HOME"]) as instance:
        event = instance.get_latest_materialization_event(AssetKey("drafter_checkpoints"))
        metadata = {k: v.value for k, v in event.asset_materialization.metadata.items()}
    assert metadata["world_size"] == 2
    assert sorted(r["node"] for r in metadata["rank_devices"]) == ["node-a", "node-b"]
    # The published launch is gone once the run is over: a later train-join waits for a new one.
    assert open_store(ranges_store_url()).head(f"config/training-launch/{run}.json") is None


def test_a_dflash2_drafter_trained_by_the_asset_decodes_losslessly_in_z_labs_loop(ranges, tmp_path):
    """`DFLASH_DRAFTER_ARCH=dflash2` from the shell's settings to the export in the store, which z-lab's own
    `DFlash2DraftModel` loads whole and `dflash_generate` decodes into the target's greedy output."""
    from dflash_assets.bench.zlab import load_zlab_drafter, zlab_generate
    from dflash_assets.drafter.speculative import TargetVerifier, greedy_decode
    from dflash_assets.target.model import load_target_model

    done, env = _train(ranges, tmp_path, "dflash2", "dflash2-run", train=SHORT, DFLASH_DRAFTER_ARCH="dflash2")
    assert done.returncode == 0, done.stderr[-4000:]
    store, local = open_store(ranges_store_url()), tmp_path / "export-dflash2"
    for info in store.list("drafter/dflash2-run/"):
        store.download(info.key, local / info.key.rsplit("/", 1)[-1])
    config = json.loads((local / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert "DFlash2 (`DFlash2DraftModel`)" in (local / "README.md").read_text()
    zlab, info = load_zlab_drafter(local)
    assert {name: keys for name, keys in info.items() if keys} == {}
    target = load_target_model(ranges["model_dir"], "cpu")
    verifier = TargetVerifier(target, config["dflash_config"]["target_layer_ids"])
    for prompt in ([3, 17, 40, 9, 11], [5, 6, 7, 100, 21, 13, 2]):
        tokens, rounds = zlab_generate(zlab, target, prompt, 12)
        assert tokens == greedy_decode(verifier, prompt, 12, set()) and sum(rounds) == len(tokens) - 1
