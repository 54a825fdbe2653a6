"""`hidden_state_partitions` with the target split over two devices (`DFLASH_TARGET_TP=2`), through the
CLI a user types, on the demo target (gated-delta-net + attention) and a real S3 server: two rank
processes, each leasing one of `cpu:0,cpu:1`, whose objects equal the one-device capture's within bf16
precision; a rank or the `dagster` process killed mid-range ends them all, and the rerun keeps every
stored sample."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from dagster import AssetKey

from dflash_assets.extraction.sample_format import read_sample
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import aws_env, aws_env_set, create_bucket, make_dagster_home, open_instance
from dflash_assets_tests.support.cli import dagster, materialize_args, run_cli
from dflash_assets_tests.support.in_process import materialize_here

KEY = "00000000-00000023"
HS_PREFIX = f"hidden-states/{KEY}"
TOK_PREFIX = f"tokenized-completions/{KEY}"
RANK_MODULE = "dflash_assets.extraction.rank"
LAUNCHER_MODULE = "dflash_assets.training.launcher"
DEVICES = ("cpu:0", "cpu:1")


def processes_running(module: str, environment: str) -> list[int]:
    """Pids of live processes running `python -m <module>` whose environment holds `environment` (a
    marker of this test's runs, so other workers' processes never count)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and module.encode() in command and environment.encode() in env:
            pids.append(int(entry.name))
    return pids


def rank_environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def wait_until(condition, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


class RankWatch:
    """The most rank processes, and device leases held by ranks, seen at once while a run goes on."""

    def __init__(self, marker: str, lock_dir: Path) -> None:
        self.marker, self.lock_dir = marker, lock_dir
        self.most, self.most_leases, self.pids = 0, 0, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from dflash_assets.target.devices import describe_holder

        while not self._stop.is_set():
            pids = processes_running(RANK_MODULE, self.marker)
            self.most = max(self.most, len(pids))
            self.pids |= set(pids)
            # the lock files say who holds each device (the lease itself is the flock)
            held = [d for d in DEVICES if "target rank" in describe_holder(self.lock_dir, d)]
            self.most_leases = max(self.most_leases, len(held))
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def leases_free(env: dict[str, str]) -> bool:
    from dflash_assets.target.devices import free_devices

    lock_dir = Path(env["DFLASH_CACHE_DIR"]) / "device-leases"
    free, _ = free_devices(list(DEVICES), lock_dir)
    return len(free) == len(DEVICES)


def nothing_left(marker: str) -> bool:
    return not processes_running(RANK_MODULE, marker) and not processes_running(LAUNCHER_MODULE, marker)


def _digests(store_url: str) -> dict[str, str]:
    store = open_store(store_url)
    return {
        info.key.rsplit("/", 1)[-1]: hashlib.sha256(store.get_bytes(info.key)).hexdigest()
        for info in store.list(HS_PREFIX + "/hs_")
    }


def largest_difference(reference_url: str, url: str) -> float:
    """Every object against the one-device capture: the same ids, mask and metadata, hidden states equal
    within bf16 precision; returns the largest absolute difference."""
    reference, store = open_store(reference_url), open_store(url)
    names = sorted(_digests(reference_url))
    assert names == sorted(_digests(url))
    worst = 0.0
    for name in names:
        expected = read_sample(reference.get_bytes(f"{HS_PREFIX}/{name}"))
        got = read_sample(store.get_bytes(f"{HS_PREFIX}/{name}"))
        assert torch.equal(got.input_ids, expected.input_ids), name
        assert torch.equal(got.loss_mask, expected.loss_mask), name
        assert got.metadata == expected.metadata, name
        torch.testing.assert_close(got.hidden_states, expected.hidden_states, atol=1e-3, rtol=2**-7)
        difference = (got.hidden_states.float() - expected.hidden_states.float()).abs().max().item()
        worst = max(worst, difference)
    return worst


@pytest.fixture(scope="module")
def split(tmp_path_factory, moto_endpoint, demo_ranges, demo_model_dir):
    """The one-device capture of a range (conftest's `demo_ranges`, copied into a bucket) and an
    environment that captures it again over two devices."""
    root = tmp_path_factory.mktemp("target-split")
    bucket = "target-split"
    create_bucket(moto_endpoint, bucket)
    marker = f"target-split-{os.getpid()}-{root.name}"
    env = {
        **os.environ,
        **aws_env(moto_endpoint),
        "DFLASH_HOME": str(root / "home"),
        "DFLASH_CACHE_DIR": str(demo_model_dir.parent),
        "DFLASH_SAMPLES_PER_PARTITION": "24",
        "DFLASH_MAX_TOKENS_PER_BATCH": demo_ranges.env["DFLASH_MAX_TOKENS_PER_BATCH"],  # the same batches
        "DAGSTER_HOME": make_dagster_home(root / "dagster-home"),
        "DFLASH_DEVICES": ",".join(DEVICES),
        "DFLASH_TARGET_TP": "2",
        "DFLASH_TARGET_TP_TIMEOUT_S": "60",
        "OMP_NUM_THREADS": "1",
        "DFLASH_TEST_MARKER": marker,  # inherited by every process the runs start
    }
    with aws_env_set(moto_endpoint):
        reference = f"s3://{bucket}/one-device"
        demo_ranges.copy_to(open_store(reference))
        yield {"env": env, "bucket": bucket, "reference": reference, "marker": marker, "root": root}


def _fresh(split, name: str) -> dict[str, str]:
    url = f"s3://{split['bucket']}/{name}"
    source, target = open_store(split["reference"]), open_store(url)
    for info in source.list(TOK_PREFIX + "/"):
        target.put_bytes(info.key, source.get_bytes(info.key))
    return {**split["env"], "DFLASH_STORE_URL": url}


def _metadata(env: dict[str, str]) -> dict:
    with open_instance(env["DAGSTER_HOME"]) as instance:
        event = instance.get_latest_materialization_event(AssetKey("hidden_state_partitions"))
        return {name: value.value for name, value in event.asset_materialization.metadata.items()}


def test_a_range_captured_over_two_devices_equals_the_one_device_capture_within_bf16(split, demo_model_dir):
    env = _fresh(split, "tp2")
    watch = RankWatch(split["marker"], Path(env["DFLASH_CACHE_DIR"]) / "device-leases")
    try:
        code, output = run_cli(materialize_args("hidden_state_partitions", KEY), env)
    finally:
        watch.stop()
    assert code == 0, output[-4000:]
    assert watch.most == 2  # two rank processes at once, one per device
    assert watch.most_leases == 2  # each leased a device of its own: the range took two
    assert wait_until(lambda: nothing_left(split["marker"]), 10)
    assert leases_free(env)
    assert "capturing over 2 devices" in output and "cpu:0,cpu:1" in output

    url = env["DFLASH_STORE_URL"]
    worst = largest_difference(split["reference"], url)
    print(f"largest |TP=2 - one device| over the range's objects: {worst:.3g}")
    metadata = _metadata(env)
    assert metadata["device"] == "cpu:0,cpu:1" and metadata["extracted_now"] == 24
    assert sorted(read_manifest(open_store(url), HS_PREFIX)["objects"]) == sorted(_digests(url))

    # one object against an independent reference: Hugging Face's own output_hidden_states[i + 1]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir).eval()
    name = sorted(_digests(url))[5]
    sample = read_sample(open_store(url).get_bytes(f"{HS_PREFIX}/{name}"))
    with torch.inference_mode():
        out = model(sample.input_ids.long()[None], output_hidden_states=True)
    for j, layer in enumerate(sample.target_layer_ids):
        expected = out.hidden_states[layer + 1][0].to(torch.bfloat16)
        torch.testing.assert_close(sample.hidden_states[:, j], expected, atol=1e-3, rtol=2**-7)


@pytest.mark.parametrize("killed", ["rank 1", "rank 0"])
def test_a_rank_killed_mid_range_ends_every_rank_and_the_rerun_keeps_every_stored_sample(split, killed):
    env = _fresh(split, f"killed-{killed.replace(' ', '')}")
    # rank 1 dies at its 4th forward (a follower's crash point), rank 0 at its 4th (extraction's)
    fault = "target_rank_command@4" if killed == "rank 1" else "extract_forward@4"
    code, output = run_cli(
        materialize_args("hidden_state_partitions", KEY), {**env, "DFLASH_FAULT_POINTS": fault}
    )
    assert code != 0, output[-3000:]
    assert "target ranks (capture) failed" in output and "Materialise the range again" in output
    assert f"{killed} (exitcode -9" in output  # the first rank to die is named, with how it died
    assert wait_until(lambda: nothing_left(split["marker"]), 30)  # the survivor was stopped too
    assert leases_free(env)
    store = open_store(env["DFLASH_STORE_URL"])
    assert read_manifest(store, HS_PREFIX) is None
    stored_before = _digests(env["DFLASH_STORE_URL"])

    code, output = run_cli(materialize_args("hidden_state_partitions", KEY), env)
    assert code == 0, output[-4000:]
    after = _digests(env["DFLASH_STORE_URL"])
    assert {name: after[name] for name in stored_before} == stored_before  # every stored sample kept
    metadata = _metadata(env)
    assert metadata["reused_from_store"] == len(stored_before)
    assert metadata["extracted_now"] + metadata["reused_from_store"] + metadata["reused_from_staging"] == 24
    assert metadata["extracted_now"] < 24  # the killed run's work was kept
    largest_difference(split["reference"], env["DFLASH_STORE_URL"])
    assert wait_until(lambda: nothing_left(split["marker"]), 10) and leases_free(env)


def test_the_dagster_process_killed_alone_takes_its_ranks_along_and_the_rerun_finishes(split, faulty_proxy):
    env = _fresh(split, "parent-killed")
    proxy = faulty_proxy()
    proxy.throttle(latency_s=0.3)  # uploads crawl: the range is still running when the kill comes
    slow = {**env, "AWS_ENDPOINT_URL_S3": proxy.endpoint_url, "DFLASH_UPLOAD_MAX_IN_FLIGHT": "1"}
    process = dagster(materialize_args("hidden_state_partitions", KEY), slow)
    store = open_store(env["DFLASH_STORE_URL"])
    try:
        ranks_up = wait_until(lambda: len(processes_running(RANK_MODULE, split["marker"])) == 2, 120)
        assert ranks_up, "the two ranks never ran"
        assert wait_until(lambda: len(list(store.list(HS_PREFIX + "/hs_"))) >= 2, 120)
        ranks = processes_running(RANK_MODULE, split["marker"])
        assert sorted(rank_environment(pid)["RANK"] for pid in ranks) == ["0", "1"]
        os.kill(process.pid, signal.SIGKILL)  # the `dagster` process alone, not its group
        process.wait()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert wait_until(lambda: nothing_left(split["marker"]), 30), "a rank or launcher outlived the run"
    assert wait_until(lambda: leases_free(env), 10)
    stored_before = _digests(env["DFLASH_STORE_URL"])
    assert 0 < len(stored_before) < 24

    code, output = run_cli(materialize_args("hidden_state_partitions", KEY), env)
    assert code == 0, output[-4000:]
    after = _digests(env["DFLASH_STORE_URL"])
    assert {name: after[name] for name in stored_before} == stored_before
    largest_difference(split["reference"], env["DFLASH_STORE_URL"])


def test_a_target_family_without_a_tensor_parallel_plan_fails_before_any_device_is_leased(split, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = tmp_path / "gpt2-target"
    GPT2LMHeadModel(
        GPT2Config(n_layer=8, n_embd=32, n_head=2, vocab_size=1536, bos_token_id=0, eos_token_id=0)
    ).save_pretrained(model_dir)
    cache = tmp_path / "cache"
    env = {**_fresh(split, "no-plan"), "DFLASH_TARGET_MODEL": str(model_dir), "DFLASH_CACHE_DIR": str(cache)}
    run = materialize_here("hidden_state_partitions", KEY, env)
    assert not run.success
    assert "no tensor-parallel plan for model type 'gpt2'" in run.output
    assert "DFLASH_TARGET_TP=1" in run.output  # what to do instead
    assert not (cache / "device-leases").exists() or not list((cache / "device-leases").iterdir())
    assert not processes_running(RANK_MODULE, split["marker"])


ONLINE = {"max_steps": 2, "global_batch_size": 2, "num_anchors": 8, "eval_samples": 2, "spec_eval_prompts": 0}
ONLINE |= {"max_length": 128, "checkpoint_every_steps": 2}


def test_online_training_runs_its_target_replica_over_two_devices_of_its_own(split, tmp_path):
    env = {
        **split["env"],
        "DFLASH_STORE_URL": split["reference"],  # both demo ranges, tokenized
        "DAGSTER_HOME": make_dagster_home(tmp_path / "dagster-home"),
        "DFLASH_HOME": str(tmp_path / "home"),
        "DFLASH_TRAIN_MODE": "online",
        "DFLASH_DEVICES": "cpu:0,cpu:1,cpu:2",
    }
    config = {**ONLINE, "run_name": "online-split", "online_target_devices": 2}
    run = materialize_here("drafter_checkpoints", None, env, config={"drafter_checkpoints": config})
    assert run.success, run.output[-4000:]
    assert "1 target replica(s), each over 2 devices: [['cpu:1', 'cpu:2']]" in run.output
    assert run.metadata["steps"] == 2 and run.metadata["target_devices"] == "cpu:1, cpu:2"

    odd = {**config, "run_name": "online-odd", "online_target_devices": 1}
    run = materialize_here("drafter_checkpoints", None, env, config={"drafter_checkpoints": odd})
    assert not run.success
    assert "set the run config `online_target_devices` to a multiple of 2 (it is 1" in run.output


def test_regeneration_in_process_with_the_target_over_two_devices_answers_as_one_device(split, tmp_path):
    key = "00000000-00000005"
    env = {
        **split["env"],
        "DFLASH_SAMPLES_PER_PARTITION": "6",
        "DFLASH_COMPLETIONS": "target",
        "DFLASH_GENERATE_MAX_NEW_TOKENS": "8",
        "DAGSTER_HOME": make_dagster_home(tmp_path / "dagster-home"),
        "DFLASH_HOME": str(tmp_path / "home"),
    }
    answers = {}
    for tp in ("1", "2"):
        url = f"s3://{split['bucket']}/regenerated-tp{tp}"
        run = materialize_here(
            "target_completions", key, {**env, "DFLASH_TARGET_TP": tp, "DFLASH_STORE_URL": url}
        )
        assert run.success, run.output[-4000:]
        answers[tp] = open_store(url).get_bytes(f"target-completions/{key}/completions.jsonl")
    assert "launching 2 target ranks (regeneration)" in run.output
    assert "generating 6 conversations with the target split over cpu:0, cpu:1" in run.output
    assert answers["2"] == answers["1"]  # greedy: the same tokens, byte for byte
    assert wait_until(lambda: nothing_left(split["marker"]), 10) and leases_free(env)
