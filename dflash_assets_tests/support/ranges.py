"""The ranges several test files read, materialised once per test run, in the process of the xdist worker
that asks first (the CLI a user types is tested by the files about it).

Two ranges of the bundled conversations (24 rows each) are tokenized and extracted with the demo
target into a local store under a SQLite instance of their own. Every xdist worker of the run shares
them (a lock file decides who builds; the others wait and read); tests treat them as read-only and copy
what they change into a store of their own.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.store import ObjectStore
from dflash_assets_tests.conftest import open_instance
from dflash_assets_tests.support.in_process import environment, materialize_here
from dflash_assets_tests.support.shared import exclusive

RANGE_KEYS = ("00000000-00000023", "00000024-00000047")
SAMPLES_PER_RANGE = 24
# Progress snapshots and observations every 0.2 s, so even these short runs record several.
EXTRACT_CONFIG = {"progress_every_s": 0.2, "observe_every_s": 0.2}


@dataclass(frozen=True)
class DemoRanges:
    root: Path
    store_url: str
    dagster_home: str
    env: dict[str, str]  # the environment the ranges were materialised under
    keys: tuple[str, ...] = RANGE_KEYS
    registered_ranges: int = 0  # ranges `dflash-assets ranges` registered in the instance

    @property
    def store(self) -> ObjectStore:
        return open_store(self.store_url)

    def copy_to(
        self, target: ObjectStore, prefixes: tuple[str, ...] = ("tokenized-completions", "hidden-states")
    ) -> None:
        """Copy the stored ranges (objects and manifests) into `target` under the same keys."""
        source = self.store
        for prefix in prefixes:
            for info in source.list(prefix + "/"):
                target.put_bytes(info.key, source.get_bytes(info.key))


def materialise_demo_ranges(root: Path, demo_model_dir: Path, dagster_yaml: str) -> DemoRanges:
    """Build the shared ranges under `root` unless another worker already has; return them."""
    with exclusive(root.with_suffix(".lock")):
        done = root / "done.json"
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            cache = root / "cache"
            shutil.copytree(demo_model_dir, cache / demo_model_dir.name)
            dagster_home = root / "dagster-home"
            dagster_home.mkdir(parents=True)
            # The repo's instance, without the first-visit dialog that would cover the UI's pages.
            (dagster_home / "dagster.yaml").write_text(dagster_yaml + "\nnux:\n  enabled: false\n")
            env = {
                **os.environ,
                "DAGSTER_HOME": str(dagster_home),
                "DFLASH_HOME": str(root / "home"),
                "DFLASH_CACHE_DIR": str(cache),
                "DFLASH_STORE_URL": str(root / "store"),
                "DFLASH_SAMPLES_PER_PARTITION": str(SAMPLES_PER_RANGE),
                "DFLASH_MAX_TOKENS_PER_BATCH": "1024",  # several batches per range
                "DFLASH_COMPLETIONS": "dataset",
                "OMP_NUM_THREADS": "1",
            }
            for name in [n for n in list(env) if n.startswith("AWS_")]:
                env.pop(name)  # a local store: no S3 settings leak in from the test's environment
            with environment(env), open_instance(env["DAGSTER_HOME"]) as instance:
                from dflash_assets.orchestration.partitions import dataset_range_keys, register_sample_ranges

                registered = len(dataset_range_keys())  # what `dflash-assets ranges` registers
                register_sample_ranges(instance)
            for key in RANGE_KEYS:
                run = materialize_here(
                    "tokenized_completions,hidden_state_partitions",
                    key,
                    env,
                    config={"hidden_state_partitions": EXTRACT_CONFIG},
                )
                assert run.success, run.output[-4000:]
            done.write_text(json.dumps({"env": env, "registered": registered}))
        recorded = json.loads(done.read_text())
    env = recorded["env"]
    return DemoRanges(
        root=root,
        store_url=env["DFLASH_STORE_URL"],
        dagster_home=env["DAGSTER_HOME"],
        env=env,
        registered_ranges=recorded["registered"],
    )
