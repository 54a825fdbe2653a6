"""Write the asset-graph snapshot: what each combination of the settings that shape the code location
makes of the product's graph.

`definitions.product_definitions` reads some settings when it builds the graph: which assets there are,
their dependencies, pools and Kubernetes tags, the executor. The snapshot holds, for every combination
of the values below, each asset's key, dependencies, kinds, pool, op tags, group, owners and partitions,
the checks, the sensors' targets and the executor; a test fails when the code makes anything else of
one, or when building the graph reads a setting not named below. After a change that should change the
graph (a new setting, pool or tag), run from the repository root and review the diff:

    python scripts/write_asset_graph_snapshot.py          # rewrite the snapshot
    python scripts/write_asset_graph_snapshot.py --check  # exit 1 if it is out of date

The snapshot is dflash_assets_tests/project/asset_graph.json.

Your own assets (`dflash_assets/defs/`) are not in it: the snapshot is the product's contract.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SNAPSHOT = REPO / "dflash_assets_tests" / "project" / "asset_graph.json"
COMMAND = "python scripts/write_asset_graph_snapshot.py"

# Every setting that shapes the graph, with the values covered, its default first: every choice of a
# setting with choices; for a free value, its default and one other. The Kubernetes placement settings
# only fill values into the same tag, so they vary together (their defaults, or all three set).
GRAPH_SETTINGS: dict[str, list[str]] = {
    "DFLASH_COMPLETIONS": ["dataset", "target"],
    "DFLASH_EXECUTOR": ["local", "k8s", "celery"],
    "DFLASH_GENERATE_URL": ["", "http://127.0.0.1:8000/v1"],
    "DFLASH_GENERATE_ENGINE": ["", "vllm"],  # vllm keeps the gpu pool a URL gives up
    # drafter_evaluations' partitions: `held_out` and the sets named.
    "DFLASH_EVAL_SETS": ["", "chat=sharegpt[17000:],code=/data/code.jsonl"],
}
K8S_PLACEMENT: dict[str, str] = {
    "DFLASH_K8S_TRAIN_GPUS": "8",
    "DFLASH_K8S_STAGING_SIZE": "2Ti",
    "DFLASH_K8S_NODE_SELECTOR": "cloud.example.com/gpu=h200",
    "DFLASH_TARGET_TP": "2",  # a GPU step's pod asks for the target's devices
}
# Read while the graph is built, but shaping nothing the snapshot holds.
NOT_GRAPH_SETTINGS: dict[str, str] = {
    "DFLASH_CELERY_BROKER_URL": "where the Celery executor queues steps, not what they are (and a secret)",
    "DFLASH_GIT_URL": "where the UI's code links point (test_code_location.py)",
    "DFLASH_GIT_REF": "where the UI's code links point (test_code_location.py)",
}
# The Celery executor needs a broker URL to be built; never connected to.
BROKER = {"DFLASH_CELERY_BROKER_URL": "redis://127.0.0.1:6379/0"}


def build_environment() -> dict[str, str]:
    """No `DFLASH_*` variable of the shell that runs this (a README's `DFLASH_COMPLETIONS=target`, say)
    but the broker's: each combination starts from the defaults."""
    return {**{name: "" for name in os.environ if name.startswith("DFLASH_")}, **BROKER}


def combinations() -> Iterator[dict[str, str]]:
    """Every combination of the covered values, as the environment variables it sets ("" = unset)."""
    names = list(GRAPH_SETTINGS)
    for values in itertools.product(*GRAPH_SETTINGS.values()):
        for placed in (False, True):
            yield {
                **dict(zip(names, values, strict=True)),
                **{name: value if placed else "" for name, value in K8S_PLACEMENT.items()},
            }


def combination_name(combination: dict[str, str]) -> str:
    return " ".join(f"{name}={value}" for name, value in combination.items() if value) or "defaults"


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` set in this process's environment ("" removes the variable), restored after."""
    previous = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value:
                os.environ[name] = value
            else:
                os.environ.pop(name, None)
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _tag_value(value: object) -> object:
    """An op tag as written in the code: Dagster keeps a dict tag (the Kubernetes config) as JSON text."""
    if isinstance(value, str) and value.startswith(("{", "[")):
        with contextlib.suppress(ValueError):
            return json.loads(value)
    return value


def _partitions(partitions) -> str:
    """Dynamic partitions by their name, static ones by their keys."""
    name = getattr(partitions, "name", None)
    return f"{type(partitions).__name__}:{name if name else ','.join(partitions.get_partition_keys())}"


def describe(definitions) -> dict:
    """What the snapshot holds of one `Definitions`."""
    repository = definitions.get_repository_def()
    graph = repository.asset_graph
    assets = {}
    for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string()):
        node = graph.get(key)
        op = node.assets_def.op
        partitions = node.partitions_def
        assets[key.to_user_string()] = {
            "deps": sorted(parent.to_user_string() for parent in node.parent_keys),
            "group": node.group_name,
            "kinds": sorted(node.kinds),
            "owners": list(node.owners),
            "partitions": None if partitions is None else _partitions(partitions),
            "pool": op.pool,
            "op_tags": {name: _tag_value(value) for name, value in sorted(op.tags.items())},
            "tags": {
                name: value
                for name, value in sorted(node.tags.items())
                if not name.startswith("dagster/kind/")
            },
        }
    checks = {}
    for check_key in sorted(graph.asset_check_keys, key=lambda k: k.to_user_string()):
        spec = graph.get_check_spec(check_key)
        checks[check_key.to_user_string()] = {
            "blocking": spec.blocking,
            "additional_deps": sorted(dep.asset_key.to_user_string() for dep in spec.additional_deps),
        }
    sensors = {}
    for sensor in sorted(repository.sensor_defs, key=lambda s: s.name):
        targets = []
        if sensor.has_jobs:
            job = repository.get_job(sensor.job_name)
            targets = sorted(key.to_user_string() for key in job.asset_layer.selected_asset_keys)
        sensors[sensor.name] = {"targets": targets, "default_status": sensor.default_status.value}
    return {
        "executor": definitions.executor.name,
        "assets": assets,
        "checks": checks,
        "sensors": sensors,
        "resources": sorted(definitions.resources or {}),
    }


def current_snapshot() -> dict:
    """The snapshot as the code makes it now, every combination built in this process."""
    from dflash_assets.definitions import product_definitions

    snapshot = {}
    with environment(build_environment()):
        for combination in combinations():
            with environment(combination):
                snapshot[combination_name(combination)] = describe(product_definitions())
    return snapshot


def settings_read_while_building() -> set[str]:
    """Every `DFLASH_*` setting read while the code location of each combination is built (the
    product's graph and everything `build_definitions` adds to it)."""
    from dflash_assets.definitions import build_definitions
    from dflash_assets.settings import Setting

    read: set[str] = set()
    readers = {"get": Setting.get, "is_set": Setting.is_set}  # every read of a setting goes through these

    def recording(reader):
        def read_and_record(setting: Setting):
            read.add(setting.name)
            return reader(setting)

        return read_and_record

    for name, reader in readers.items():
        setattr(Setting, name, recording(reader))
    try:
        with environment(build_environment()):
            for combination in combinations():
                with environment(combination):
                    build_definitions().get_repository_def()
    finally:
        for name, reader in readers.items():
            setattr(Setting, name, reader)
    return read


def as_text(snapshot: dict) -> str:
    """JSON, one line per field of an asset, check or sensor: a changed tag is one changed line."""

    def write(value: object, depth: int, indent: str) -> str:
        if not isinstance(value, dict) or not value or depth == 0:
            return json.dumps(value, separators=(", ", ": "))
        inner = indent + " "
        fields = [f"{inner}{json.dumps(k)}: {write(v, depth - 1, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(fields) + "\n" + indent + "}"

    return write(snapshot, 4, "") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if the snapshot differs")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(REPO))
    text = as_text(current_snapshot())
    if args.check:
        if not SNAPSHOT.exists() or SNAPSHOT.read_text() != text:
            print(f"{SNAPSHOT.relative_to(REPO)} is out of date: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    SNAPSHOT.write_text(text)
    print(f"wrote {SNAPSHOT.relative_to(REPO)}: {len(json.loads(text))} combinations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
