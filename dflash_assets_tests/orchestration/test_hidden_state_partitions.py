"""`hidden_state_partitions` end to end on a real Dagster instance, the demo model and a real S3 server:
exactly-once under SIGKILL, fault injection, backpressure and one device per run."""

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from dagster import AssetCheckKey, AssetKey, AssetRecordsFilter

from dflash_assets.extraction.sample_format import read_sample
from dflash_assets.storage.layout import MANIFEST_NAME
from dflash_assets.storage.manifest import changed_since_commit, read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import (
    TEST_SECRET_ACCESS_KEY,
    aws_env,
    aws_env_set,
    create_bucket,
    make_dagster_home,
    open_instance,
)
from dflash_assets_tests.support.cli import dagster as _dagster
from dflash_assets_tests.support.cli import kill_when as _kill_when
from dflash_assets_tests.support.cli import materialize_args
from dflash_assets_tests.support.cli import run_cli as _run_cli
from dflash_assets_tests.support.in_process import environment, materialize_here
from dflash_assets_tests.support.secrets import SECRET_ENV, assert_no_secret
from dflash_assets_tests.support.stores import staging_of

KEY = "00000000-00000023"  # 24 samples per range keeps each run to seconds
HS_PREFIX = f"hidden-states/{KEY}"
TOK_PREFIX = f"tokenized-completions/{KEY}"


def _materialize_args(asset: str, partition: str = KEY, config: dict | None = None) -> list[str]:
    return materialize_args(asset, partition, config)


def _object_digests(store_url: str) -> dict[str, str]:
    store = open_store(store_url)
    return {
        info.key.rsplit("/", 1)[-1]: hashlib.sha256(store.get_bytes(info.key)).hexdigest()
        for info in store.list(HS_PREFIX + "/")
        if not info.key.rsplit("/", 1)[-1].startswith("_")
    }


def _assert_matches_reference(pipeline, url: str) -> None:
    """Same objects as the uninterrupted run, nothing extra. A sample a rerun extracted again sits in
    a different batch than in the reference run; batched capture equals lone capture only up to
    bf16 rounding (test_capture), so such an object may differ in its last bits, never in its ids,
    mask, metadata or beyond that rounding."""
    digests = _object_digests(url)
    assert sorted(digests) == sorted(pipeline["reference"])
    reference_store, store = open_store(pipeline["base"]), open_store(url)
    for name, digest in digests.items():
        if digest == pipeline["reference"][name]:
            continue
        expected = read_sample(reference_store.get_bytes(f"{HS_PREFIX}/{name}"))
        got = read_sample(store.get_bytes(f"{HS_PREFIX}/{name}"))
        assert torch.equal(got.input_ids, expected.input_ids), name
        assert torch.equal(got.loss_mask, expected.loss_mask), name
        assert got.metadata == expected.metadata, name
        torch.testing.assert_close(got.hidden_states, expected.hidden_states, atol=1e-3, rtol=2**-7)


def _copy_tokenized(source_url: str, target_url: str) -> None:
    source, target = open_store(source_url), open_store(target_url)
    for info in source.list(TOK_PREFIX + "/"):
        target.put_bytes(info.key, source.get_bytes(info.key))


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, moto_endpoint, demo_ranges, demo_model_dir):
    """One tokenized range and an uninterrupted extraction of it (conftest's `demo_ranges`, copied into a
    bucket): the reference every test compares to. Reruns here go to an instance of this module's own."""
    root = tmp_path_factory.mktemp("pipeline")
    bucket = "hs-pipeline"
    create_bucket(moto_endpoint, bucket)
    env = {
        **os.environ,
        **aws_env(moto_endpoint),
        "DFLASH_HOME": str(root / "home"),
        "DFLASH_CACHE_DIR": str(demo_model_dir.parent),
        "DFLASH_SAMPLES_PER_PARTITION": "24",
        "DFLASH_MAX_TOKENS_PER_BATCH": demo_ranges.env["DFLASH_MAX_TOKENS_PER_BATCH"],
        "DAGSTER_HOME": make_dagster_home(root / "dagster-home"),
        "OMP_NUM_THREADS": "1",
        **SECRET_ENV,  # besides AWS's: none may show up anywhere
    }
    # The test process itself reads the store too: the same variables a user would set.
    with aws_env_set(moto_endpoint):
        base = f"s3://{bucket}/reference"
        env["DFLASH_STORE_URL"] = base
        demo_ranges.copy_to(open_store(base))
        yield {
            "env": env,
            "bucket": bucket,
            "base": base,
            "reference": _object_digests(base),
            "reference_instance": demo_ranges.dagster_home,
            "root": root,
            "model_dir": demo_model_dir,
        }


def _fresh_store(pipeline, name: str) -> str:
    url = f"s3://{pipeline['bucket']}/{name}"
    _copy_tokenized(pipeline["base"], url)
    return url


def test_a_range_stores_one_object_per_sample_equal_to_the_target_and_passes_its_check(pipeline):
    store = open_store(pipeline["base"])
    manifest = read_manifest(store, HS_PREFIX)
    tokenized = read_manifest(store, TOK_PREFIX)
    assert len(pipeline["reference"]) == len(tokenized["sample_indices"]) == len(manifest["sample_indices"])
    assert sorted(pipeline["reference"]) == sorted(manifest["objects"])

    # an independent reference: Hugging Face's own output_hidden_states[i + 1]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pipeline["model_dir"]).eval()
    name = sorted(manifest["objects"])[3]
    sample = read_sample(store.get_bytes(f"{HS_PREFIX}/{name}"))
    with torch.inference_mode():
        out = model(sample.input_ids.long()[None], output_hidden_states=True)
    for j, layer in enumerate(sample.target_layer_ids):
        expected = out.hidden_states[layer + 1][0].to(torch.bfloat16)
        torch.testing.assert_close(sample.hidden_states[:, j], expected, atol=1e-3, rtol=2**-7)
    assert sample.target_layer_ids == [1, 3, 5, 7, 9]  # the DFlash rule for 12 layers, k = 5

    this_range = AssetRecordsFilter(asset_key=AssetKey("hidden_state_partitions"), asset_partitions=[KEY])
    with open_instance(pipeline["reference_instance"]) as instance:
        event = instance.fetch_materializations(this_range, limit=1).records[0].event_log_entry
        metadata = event.asset_materialization.metadata
        check = instance.event_log_storage.get_latest_asset_check_execution_by_key(
            [AssetCheckKey(AssetKey("hidden_state_partitions"), "range_complete")]
        )
        run = instance.get_run_by_id(event.run_id)
        observations = instance.fetch_observations(this_range, limit=100).records
    assert metadata["samples"].value == len(pipeline["reference"])
    assert metadata["device"].value == "cpu"
    assert 0 <= metadata["padding_fraction"].value < 0.5
    assert metadata["tokens_per_s"].value > 0
    assert list(check.values())[0].status.value == "SUCCEEDED"

    # Progress at a glance: observations of the range's partition, and the run's progress tag.
    assert observations and {o.partition_key for o in observations} == {KEY}
    latest = {k: v.value for k, v in observations[0].asset_observation.metadata.items()}
    samples = len(pipeline["reference"])
    assert latest["fraction_done"] == 1.0 and latest["status"] == "done"
    assert latest["samples_done"] == latest["samples_total"] == samples
    assert latest["samples_per_s"] > 0 and latest["tokens_per_s"] > 0
    assert latest["eta_s"] == 0 and latest["uploads_in_flight"] == 0 and latest["staging_bytes"] == 0
    assert latest["uploaded_bytes"] == sum(metadata_sizes(pipeline)) and latest["device"] == "cpu"
    assert latest["run"] == event.run_id
    fractions = [o.asset_observation.metadata["fraction_done"].value for o in reversed(observations)]
    assert fractions == sorted(fractions)  # progress only moves forward
    assert run.tags["dflash/progress"].startswith(f"100% {samples}/{samples} · ")
    assert run.tags["dflash/progress"].endswith("/s · done")


def metadata_sizes(pipeline) -> list[int]:
    store = open_store(pipeline["base"])
    return list(read_manifest(store, HS_PREFIX)["objects"].values())


@pytest.mark.parametrize("crash", ["mid-forward", "mid-upload", "before-manifest"])
def test_a_run_killed_at_any_point_is_finished_by_a_rerun_exactly_once(pipeline, faulty_proxy, crash):
    url = _fresh_store(pipeline, f"crash-{crash}")
    env = {**pipeline["env"], "DFLASH_STORE_URL": url}
    store = open_store(url)
    if crash == "mid-forward":
        code, output = _run_cli(
            _materialize_args("hidden_state_partitions"), {**env, "DFLASH_FAULT_POINTS": "extract_forward@4"}
        )
        assert code != 0, output[-3000:]
        staging = staging_of(env, HS_PREFIX)
        finished = {i.key.rsplit("/", 1)[-1] for i in store.list(HS_PREFIX + "/hs_")}
        finished |= {p.name for p in staging.glob("hs_*.safetensors")}
        assert 0 < len(finished) < len(pipeline["reference"])  # died part-way, with work to keep
    elif crash == "before-manifest":
        code, output = _run_cli(
            _materialize_args("hidden_state_partitions"), {**env, "DFLASH_FAULT_POINTS": "before_manifest"}
        )
        assert code != 0, output[-3000:]
        assert len(list(store.list(HS_PREFIX + "/hs_"))) == len(pipeline["reference"])
    else:  # killed from outside while uploads crawl through a slow store
        proxy = faulty_proxy()
        proxy.throttle(latency_s=0.15)
        process = _dagster(
            _materialize_args("hidden_state_partitions"),
            {**env, "AWS_ENDPOINT_URL_S3": proxy.endpoint_url, "DFLASH_UPLOAD_MAX_IN_FLIGHT": "2"},
        )
        _kill_when(process, lambda: len(list(store.list(HS_PREFIX + "/hs_"))) >= 3)
        # A PUT the proxy had already taken still reaches the store after the kill: let it land first.
        deadline = time.monotonic() + 10
        while (c := proxy.counters).requests > c.forwarded + c.faults and time.monotonic() < deadline:
            time.sleep(0.05)
    assert read_manifest(store, HS_PREFIX) is None  # never committed by the killed run
    staging = staging_of(env, HS_PREFIX)
    stored_before = {i.key.rsplit("/", 1)[-1] for i in store.list(HS_PREFIX + "/hs_")}
    staged_before = {p.name for p in staging.glob("hs_*.safetensors")} - stored_before

    # The same command again, with nothing else: no daemon, no `dflash-assets reap`. Through a proxy
    # that counts what the rerun writes: only the objects the store lacked, then the commit.
    counting = faulty_proxy()
    code, output = _run_cli(
        _materialize_args("hidden_state_partitions"), {**env, "AWS_ENDPOINT_URL_S3": counting.endpoint_url}
    )
    assert code == 0, output[-4000:]
    total = len(pipeline["reference"])
    # Only the objects the store lacked, then the manifest (the killed run's fingerprint is still good, so
    # it is not written again). Counted as keys, not requests: on a loaded machine a PUT the client timed
    # out and retried reaches the proxy twice, which rewrites the same object and is not the product's
    # doing (CI saw 20 PUTs for 19 keys once).
    written = [path.rsplit("/", 1)[-1] for path in counting.forwarded_paths("PUT")]
    expected = set(pipeline["reference"]) - stored_before | {MANIFEST_NAME}
    assert set(written) == expected, (sorted(set(written) - expected), sorted(expected - set(written)))
    with open_instance(env["DAGSTER_HOME"]) as instance:
        metadata = instance.get_latest_materialization_event(
            AssetKey("hidden_state_partitions")
        ).asset_materialization.metadata
    assert metadata["reused_from_store"].value == len(stored_before)
    assert metadata["reused_from_staging"].value == len(staged_before)
    assert metadata["extracted_now"].value == total - len(stored_before) - len(staged_before)
    assert len(stored_before) + len(staged_before) > 0  # the killed run's work was there to reuse
    with open_instance(env["DAGSTER_HOME"]) as instance:
        runs = [r for r in instance.get_runs() if r.tags.get("dagster/partition") == KEY]
        killed, rerun = runs[1], runs[0]  # newest first
        assert rerun.is_success
        assert killed.is_failure  # not left STARTED, whatever killed it
        if crash == "mid-upload":  # the whole process group: only the rerun could tell
            assert killed.tags["dflash/superseded_by"] == rerun.run_id
            assert killed.tags["dagster/will_retry"] == "false"  # the rerun was its one re-launch
    _assert_matches_reference(pipeline, url)
    manifest = read_manifest(store, HS_PREFIX)
    assert sorted(manifest["objects"]) == sorted(pipeline["reference"])
    staging = staging_of(env, HS_PREFIX)
    assert not list(staging.glob("hs_*")) if staging.exists() else True


def _extract(pipeline, url: str, endpoint: str, **store_config) -> tuple[int, str, dict]:
    """Run the range against `endpoint`, in this process (what is tested is the store, not processes);
    returns an exit code as the CLI's, the output and the run's metadata."""
    env = {**pipeline["env"], "DFLASH_STORE_URL": url, "AWS_ENDPOINT_URL_S3": endpoint}
    run = materialize_here("hidden_state_partitions", KEY, env, resource_config={"store": store_config})
    return (0 if run.success else 1), run.output, run.metadata


FAST_RETRIES = {"upload_backoff_s": 0.01}


def test_a_store_failing_a_share_of_requests_still_yields_identical_results(pipeline, faulty_proxy):
    url = _fresh_store(pipeline, "flaky")
    proxy = faulty_proxy(seed=7)
    proxy.fail_share(0.2, "500", methods=["PUT"], path_contains="/hs_")  # the uploader's objects
    # One attempt per request inside boto3, so each failure reaches the uploader's own retries.
    code, output, metadata = _extract(pipeline, url, proxy.endpoint_url, s3_max_attempts=1, **FAST_RETRIES)
    assert code == 0, output[-4000:]
    assert proxy.counters.faults > 0
    assert metadata["upload_retries"] == proxy.counters.injected_500 > 0
    assert _object_digests(url) == pipeline["reference"]


def test_dropped_connections_after_the_store_received_the_object_are_retried_to_the_same_result(
    pipeline, faulty_proxy
):
    url = _fresh_store(pipeline, "drops")
    proxy = faulty_proxy(seed=3)
    proxy.fail_share(0.15, "drop", methods=["PUT"], after_forward=True)
    code, output, _ = _extract(pipeline, url, proxy.endpoint_url, **FAST_RETRIES)
    assert code == 0, output[-4000:]
    assert proxy.counters.dropped > 0
    assert _object_digests(url) == pipeline["reference"]


def test_when_the_store_goes_down_the_run_fails_naming_the_endpoint_and_loses_no_finished_sample(
    pipeline, faulty_proxy
):
    url = _fresh_store(pipeline, "outage")
    proxy = faulty_proxy()
    proxy.throttle(latency_s=0.05)
    store = open_store(url)

    def outage_after_a_few_uploads():
        deadline = time.monotonic() + 120
        while len(list(store.list(HS_PREFIX + "/hs_"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        proxy.go_down()

    watcher = threading.Thread(target=outage_after_a_few_uploads, daemon=True)
    watcher.start()
    code, output, _ = _extract(
        pipeline,
        url,
        proxy.endpoint_url,
        s3_max_attempts=1,
        upload_max_attempts=2,
        upload_max_in_flight=2,
        **FAST_RETRIES,
    )
    watcher.join(timeout=60)
    assert code != 0
    assert proxy.endpoint_url in output
    assert TEST_SECRET_ACCESS_KEY not in output
    proxy.go_up()

    uploaded = {i.key.rsplit("/", 1)[-1] for i in store.list(HS_PREFIX + "/hs_")}
    staging = staging_of(pipeline["env"], HS_PREFIX, url)
    staged = {p.name for p in staging.glob("hs_*.safetensors")}
    assert read_manifest(store, HS_PREFIX) is None
    assert staged, "finished samples that could not be uploaded stay in local staging"

    code, output, metadata = _extract(pipeline, url, proxy.endpoint_url, **FAST_RETRIES)
    assert code == 0, output[-4000:]
    assert metadata["reused_from_staging"] == len(staged - uploaded)
    assert metadata["reused_from_store"] == len(uploaded)
    _assert_matches_reference(pipeline, url)


def test_a_slow_store_pauses_extraction_instead_of_letting_staging_outgrow_its_budget(pipeline, faulty_proxy):
    url = _fresh_store(pipeline, "slow")
    proxy = faulty_proxy()
    proxy.throttle(latency_s=0.05, bytes_per_s=2_000_000)
    budget = 300_000  # a handful of demo samples
    staging = staging_of(pipeline["env"], HS_PREFIX, url)
    observed = [0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            # a file can be uploaded and deleted between the listing and its stat
            with contextlib.suppress(FileNotFoundError):
                observed.append(sum(p.stat().st_size for p in staging.glob("*hs_*")))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    code, output, metadata = _extract(
        pipeline, url, proxy.endpoint_url, staging_max_bytes=budget, upload_max_in_flight=2
    )
    done.set()
    watcher.join()
    assert code == 0, output[-4000:]
    assert max(observed) <= budget, max(observed)
    assert metadata["peak_staging_bytes"] <= budget
    assert metadata["peak_staging_bytes"] > budget // 2  # the budget was actually what held it back
    assert max(observed) > 0
    assert _object_digests(url) == pipeline["reference"]


def test_two_ranges_started_at_once_from_two_shells_get_different_devices(pipeline, faulty_proxy, tmp_path):
    env = {
        **pipeline["env"],
        "DFLASH_STORE_URL": f"s3://{pipeline['bucket']}/two-devices",
        "DFLASH_DEVICES": "cpu:0,cpu:1",
        "DFLASH_CACHE_DIR": pipeline["env"]["DFLASH_CACHE_DIR"],
    }
    proxy = faulty_proxy()
    proxy.throttle(latency_s=0.1)
    second = "00000024-00000047"
    for key in (KEY, second):  # both ranges are tokenized in the shared store
        source, target = open_store(pipeline["base"]), open_store(env["DFLASH_STORE_URL"])
        for info in source.list(f"tokenized-completions/{key}/"):
            target.put_bytes(info.key, source.get_bytes(info.key))
    code, output = _run_cli(["instance", "concurrency", "set", "gpu", "2"], env)
    assert code == 0, output
    slow = {**env, "AWS_ENDPOINT_URL_S3": proxy.endpoint_url, "DFLASH_UPLOAD_MAX_IN_FLIGHT": "2"}
    runs = [_dagster(_materialize_args("hidden_state_partitions", key), slow) for key in (KEY, second)]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    devices = []
    for output in outputs:
        line = next(line for line in output.splitlines() if "leased device" in line)
        devices.append(line.split("leased device ")[1].split(";")[0])
    assert sorted(devices) == ["cpu:0", "cpu:1"]


def _reap(env: dict[str, str]) -> str:
    done = subprocess.run(
        [str(Path(sys.executable).with_name("dflash-assets")), "reap"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_two_asset_range_finishes_while_dead_runs_are_reaped_and_says_whom_it_waits_for(
    pipeline, faulty_proxy, tmp_path
):
    from dflash_assets.orchestration.execution.recovery import reap_dead_runs
    from dflash_assets.target.devices import lease_device

    url = _fresh_store(pipeline, "two-assets")
    env = {**pipeline["env"], "DFLASH_STORE_URL": url, "DAGSTER_HOME": make_dagster_home(tmp_path / "dh")}
    store = open_store(url)

    # A dead run: its whole process group killed mid-extraction, so it stays STARTED.
    proxy = faulty_proxy()
    proxy.throttle(latency_s=0.15)
    slow = {**env, "AWS_ENDPOINT_URL_S3": proxy.endpoint_url, "DFLASH_UPLOAD_MAX_IN_FLIGHT": "2"}
    doomed = _dagster(_materialize_args("hidden_state_partitions"), slow)
    _kill_when(doomed, lambda: len(list(store.list(HS_PREFIX + "/hs_"))) >= 2)

    # Another range, both assets in one run, while the device is busy (held here as another run
    # would hold it) and the reaper runs again and again, as the sensor would: here, in this process
    # against the same instance, and last as `dflash-assets reap` from the shell.
    second = "00000024-00000047"
    lock_dir = Path(env["DFLASH_CACHE_DIR"]) / "device-leases"
    output: list[str] = []
    reaped: list[str] = []

    def reap_here(instance) -> None:
        reap_dead_runs(instance, reaped.append)

    with open_instance(env["DAGSTER_HOME"]) as instance:
        with lease_device(["cpu"], lock_dir=lock_dir, holder="run held-by-another-run"):
            live = _dagster(_materialize_args("tokenized_completions,hidden_state_partitions", second), env)
            lines = iter(live.stdout.readline, "")
            reader = threading.Thread(target=lambda: output.extend(lines), daemon=True)
            reader.start()
            deadline = time.monotonic() + 240
            while "waiting for a device" not in "".join(output):
                assert live.poll() is None, "".join(output)[-4000:]
                assert time.monotonic() < deadline, "the run never waited for the device"
                reap_here(instance)  # the first step's process has exited: the run must survive
                time.sleep(0.2)
            reap_here(instance)
        while live.poll() is None:
            reap_here(instance)
            time.sleep(0.2)
    reaped.append(_reap(env))
    reader.join(timeout=60)
    text = "".join(output)
    assert live.returncode == 0, text[-4000:]
    assert "held-by-another-run" in text  # it said whom it waited for

    with open_instance(env["DAGSTER_HOME"]) as instance:
        runs = {r.tags["dagster/partition"]: r for r in instance.get_runs()}
        dead, alive = runs[KEY], runs[second]
        logs = instance.all_logs(alive.run_id)
        events = [e.dagster_event.event_type_value for e in logs if e.dagster_event]
    assert dead.is_failure and "is gone" in "".join(reaped + [text])
    assert alive.is_success and "PIPELINE_FAILURE" not in events
    # The recorded worker is the process the shell started (the run worker), not a step's process.
    assert alive.tags["dflash/run_worker"].split("@")[1].split(":")[0] == str(live.pid)
    assert read_manifest(store, f"hidden-states/{second}") is not None


def flip_tensor_bytes(data: bytes, tensor: str = "hidden_states", count: int = 16) -> bytes:
    """The object with `count` bytes in the middle of `tensor`'s data flipped in their lowest bit: same
    size, same header, values still finite (bf16 mantissa bits), so nothing but a checksum tells."""
    header_length = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + header_length])[tensor]["data_offsets"]
    middle = 8 + header_length + (start + end) // 2
    flipped = bytearray(data)
    for offset in range(middle, middle + count):
        flipped[offset] ^= 0x01
    return bytes(flipped)


def _check_then_train(env: dict[str, str]) -> dict:
    """Runs the range check alone with training after it (as the UI's "Execute" of the check would, then a
    job that trains), then training alone, in this process under `env`; what each run's steps did."""
    from dagster import AssetSelection, DagsterEventType, Definitions, define_asset_job

    from dflash_assets.definitions import build_definitions
    from dflash_assets.orchestration.partitions import SAMPLE_RANGES

    check = AssetCheckKey(AssetKey("hidden_state_partitions"), "range_complete")
    training = {AssetKey("drafter_checkpoints")}
    report = {}
    with environment(env), open_instance(env["DAGSTER_HOME"]) as instance:
        # A job over the ranges' partitions holding the check and training (drafter_evaluations, partitioned
        # by prompt set, shares no partitions with the ranges: there is no single global asset job).
        evaluations = AssetSelection.assets("drafter_evaluations")
        ranges_and_training = AssetSelection.all() - evaluations - evaluations.checks()
        jobs = [define_asset_job("check_then_train", ranges_and_training, partitions_def=SAMPLE_RANGES)]
        defs = Definitions.merge(build_definitions(), Definitions(jobs=jobs))
        job = defs.resolve_job_def("check_then_train")
        for name, checks, key in [("check_then_training", {check}, KEY), ("training", set(), None)]:
            subset = job.get_subset(asset_selection=training, asset_check_selection=checks)
            result = subset.execute_in_process(partition_key=key, instance=instance, raise_on_error=False)
            events = result.all_events
            report[name] = {
                "success": result.success,
                "started": [e.step_key for e in events if e.event_type == DagsterEventType.STEP_START],
                "checks": [
                    {
                        "passed": e.event_specific_data.passed,
                        "problems": e.event_specific_data.metadata["problems"].value,
                    }
                    for e in events
                    if e.event_type == DagsterEventType.ASSET_CHECK_EVALUATION
                ],  # fmt: skip
                "failures": [
                    e.event_specific_data.error.to_string()
                    for e in events
                    if e.event_type == DagsterEventType.STEP_FAILURE
                ],
                "logs": [record.message for record in instance.all_logs(result.run_id)],
            }
    return report


def test_an_object_corrupted_after_its_commit_fails_the_check_blocks_training_and_is_redone(pipeline):
    url = f"s3://{pipeline['bucket']}/corrupted"
    source, store = open_store(pipeline["base"]), open_store(url)
    for prefix in (TOK_PREFIX, HS_PREFIX):
        for info in source.list(prefix + "/"):
            store.put_bytes(info.key, source.get_bytes(info.key))
    manifest = read_manifest(store, HS_PREFIX)
    name = sorted(manifest["objects"])[5]
    key = f"{HS_PREFIX}/{name}"
    store.put_bytes(key, flip_tensor_bytes(store.get_bytes(key)))
    assert read_sample(store.get_bytes(key)).hidden_states.isfinite().all()  # it decodes: only bytes differ

    env = {**pipeline["env"], "DFLASH_STORE_URL": url}
    report = _check_then_train(env)
    checked = report["check_then_training"]
    # The check fails naming the object, and being blocking, the training after it never starts.
    assert [c["passed"] for c in checked["checks"]] == [False]
    assert name in checked["checks"][0]["problems"] and "checksum" in checked["checks"][0]["problems"]
    assert not checked["success"] and "drafter_checkpoints" not in checked["started"]
    # Training alone refuses the range before reading a byte of it, naming the object and the fix.
    trained = report["training"]
    assert not trained["success"] and trained["started"] == ["drafter_checkpoints"]
    assert name in trained["failures"][0]
    assert f"materialise hidden_state_partitions --partition {KEY} again" in trained["failures"][0]

    # The same materialisation as ever repairs the range: the changed object alone is extracted again.
    code, output, _ = _extract(pipeline, url, env["AWS_ENDPOINT_URL_S3"])
    assert code == 0, output[-4000:]
    assert name in output  # the warning names it
    with open_instance(env["DAGSTER_HOME"]) as instance:
        metadata = instance.get_latest_materialization_event(
            AssetKey("hidden_state_partitions")
        ).asset_materialization.metadata
        evaluation = instance.event_log_storage.get_latest_asset_check_execution_by_key(
            [AssetCheckKey(AssetKey("hidden_state_partitions"), "range_complete")]
        )
    assert metadata["extracted_now"].value == 1
    assert metadata["reused_from_store"].value == len(pipeline["reference"]) - 1
    assert list(evaluation.values())[0].status.value == "SUCCEEDED"
    assert changed_since_commit(store, HS_PREFIX, read_manifest(store, HS_PREFIX)) == {}
    _assert_matches_reference(pipeline, url)
    # Neither the failing check, the refused training nor the repair wrote a secret anywhere.
    assert assert_no_secret(
        texts=[json.dumps(report), output],
        dagster_home=env["DAGSTER_HOME"],
        stores=[store],
        directories=[env["DFLASH_HOME"]],
    ) > len(pipeline["reference"])
