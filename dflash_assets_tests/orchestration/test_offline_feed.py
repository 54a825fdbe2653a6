"""The offline feed against a real S3 server behind a request-counting proxy: `drafter_checkpoints` trained
for three epochs with the default cache budget downloads each hidden-state object once for the whole run
(at one rank and at two on one node, whose shares of each global batch move every epoch), without a HEAD
before its GET."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest

from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import aws_env, aws_env_set, create_bucket, make_dagster_home
from dflash_assets_tests.support.in_process import materialize_here

STORE_URL = "s3://feed-ranges/shared"
# Three epochs of the 44 training samples (4 held out) in global batches of 6: 8 steps an epoch.
THREE_EPOCHS = {
    "max_steps": 24,
    "global_batch_size": 6,
    "num_anchors": 16,
    "eval_samples": 4,
    "spec_eval_prompts": 0,
    "checkpoint_every_steps": 8,
    "log_every_steps": 4,
    "max_length": 256,
}
HIDDEN_STATE = re.compile(r"/hidden-states/[0-9-]+/hs_\d+\.safetensors$")


@pytest.fixture(scope="module")
def feed_ranges(tmp_path_factory, moto_endpoint, demo_ranges, demo_model_dir):
    root = tmp_path_factory.mktemp("feed")
    create_bucket(moto_endpoint, "feed-ranges")
    with aws_env_set(moto_endpoint):
        demo_ranges.copy_to(open_store(STORE_URL))
        keys = [info.key for info in open_store(STORE_URL).list("hidden-states/")]
    env = {
        **os.environ,
        "DFLASH_CACHE_DIR": str(demo_model_dir.parent),
        "DFLASH_SAMPLES_PER_PARTITION": "24",
        "DFLASH_STORE_URL": STORE_URL,
        "OMP_NUM_THREADS": "1",
    }
    return {"env": env, "root": root, "objects": [k for k in keys if k.endswith(".safetensors")]}


def _train_through(proxy, feed_ranges, tmp_path: Path, run: str, **extra_env: str):
    env = {
        **feed_ranges["env"],
        **aws_env(proxy.endpoint_url),
        "DAGSTER_HOME": make_dagster_home(tmp_path / "dagster"),
        "DFLASH_HOME": str(tmp_path / "home"),
        **extra_env,
    }
    proxy.reset_counters()
    done = materialize_here(
        "drafter_checkpoints", None, env, config={"drafter_checkpoints": {**THREE_EPOCHS, "run_name": run}}
    )
    assert done.success, done.output[-4000:]
    return done


@pytest.mark.parametrize(
    "ranks",
    [1, 2],
    ids=["one-rank", "two-ranks-on-one-node"],
)
def test_three_epochs_download_each_hidden_state_object_once_and_send_no_head_before_a_get(
    feed_ranges, faulty_proxy, tmp_path, ranks
):
    proxy = faulty_proxy()
    extra = {"DFLASH_TRAIN_NPROC_PER_NODE": "2", "DFLASH_DEVICES": "cpu:0,cpu:1"} if ranks == 2 else {}
    done = _train_through(proxy, feed_ranges, tmp_path, f"feed-{ranks}", **extra)

    assert done.metadata["steps"] == 24 and done.metadata["steps_per_epoch"] == 8
    gets = proxy.forwarded_paths("GET")
    per_object = Counter(path for path in gets if HIDDEN_STATE.search(path))
    assert len(per_object) == len(feed_ranges["objects"]) == 48  # the held-out four included
    assert set(per_object.values()) == {1}, per_object.most_common(3)
    heads = proxy.counters.by_method.get("HEAD", 0)
    assert heads * 10 <= len(gets), (heads, len(gets))
