"""The product's asset graph, for every combination of the settings that shape it, is the snapshot
`scripts/write_asset_graph_snapshot.py` wrote (`asset_graph.json` beside this file): a setting that
silently changes an asset, a dependency, a pool, a tag, a check or the executor fails here, and so does a
new setting read while the graph is built that the snapshot does not cover. Each message says how to
regenerate it when the change is meant."""

import json

import pytest

from dflash_assets_tests.conftest import REPO
from dflash_assets_tests.support.scripts import load_script

snapshot = load_script("write_asset_graph_snapshot")
REGENERATE = (
    f"if the change is meant, run `{snapshot.COMMAND}`, review the diff of "
    f"{snapshot.SNAPSHOT.relative_to(REPO)} and commit it"
)


@pytest.fixture(scope="module")
def current() -> dict:
    return snapshot.current_snapshot()


def test_the_graph_of_every_combination_of_the_settings_that_shape_it_is_the_snapshot(current):
    recorded = json.loads(snapshot.SNAPSHOT.read_text())
    differing = sorted(
        name for name in current.keys() | recorded.keys() if current.get(name) != recorded.get(name)
    )
    assert not differing, (
        f"the asset graph differs from the snapshot for {len(differing)} of {len(current)} combinations of "
        f"the settings that shape it, first `{differing[0]}`; {REGENERATE}"
    )
    assert snapshot.as_text(current) == snapshot.SNAPSHOT.read_text(), (
        f"the snapshot is not as written; {REGENERATE}"
    )


def test_building_the_code_location_reads_no_setting_the_snapshot_leaves_out():
    read = snapshot.settings_read_while_building()
    covered = {*snapshot.GRAPH_SETTINGS, *snapshot.K8S_PLACEMENT}
    unknown = read - covered - set(snapshot.NOT_GRAPH_SETTINGS)
    assert not unknown, (
        f"building the code location reads {', '.join(sorted(unknown))}: add each to GRAPH_SETTINGS (with "
        "the values worth covering) or NOT_GRAPH_SETTINGS (with the reason) in "
        f"scripts/write_asset_graph_snapshot.py; {REGENERATE}"
    )
    assert covered <= read, (
        f"the snapshot varies {sorted(covered - read)}, which building the graph never reads"
    )


def test_the_snapshot_holds_what_each_setting_changes(current):
    """Not a second snapshot: that the one above records the differences that matter at all."""
    dataset = current["DFLASH_COMPLETIONS=dataset DFLASH_EXECUTOR=local"]
    target = current["DFLASH_COMPLETIONS=target DFLASH_EXECUTOR=local"]
    served = current[
        "DFLASH_COMPLETIONS=target DFLASH_EXECUTOR=local DFLASH_GENERATE_URL=http://127.0.0.1:8000/v1"
    ]
    # vLLM started by the range runs on the range's leased device, even where a URL is also set.
    started = current[
        "DFLASH_COMPLETIONS=target DFLASH_EXECUTOR=local DFLASH_GENERATE_URL=http://127.0.0.1:8000/v1 "
        "DFLASH_GENERATE_ENGINE=vllm"
    ]
    # The four assets either way; only with `target` answers does tokenized_completions read them.
    assert sorted(dataset["assets"]) == sorted(target["assets"])
    assert dataset["assets"]["tokenized_completions"]["deps"] == []
    assert target["assets"]["tokenized_completions"]["deps"] == ["target_completions"]
    assert (
        target["assets"]["target_completions"]["pool"],
        served["assets"]["target_completions"]["pool"],
        started["assets"]["target_completions"]["pool"],
    ) == ("gpu", None, "gpu")
    placed = next(
        graph
        for name, graph in current.items()
        if name.startswith("DFLASH_COMPLETIONS=dataset DFLASH_EXECUTOR=k8s DFLASH_K8S")
    )
    limits = placed["assets"]["drafter_checkpoints"]["op_tags"]["dagster-k8s/config"]["container_config"][
        "resources"
    ]
    assert limits["limits"] == {"ephemeral-storage": "2Ti", "nvidia.com/gpu": "8"}
    assert {graph["executor"] for graph in current.values()} == {
        "multi_or_in_process_executor",
        "k8s",
        "celery",
    }
    # drafter_evaluations: a partition for the run's held-out rows, and one for each set named.
    sets = [graph["assets"]["drafter_evaluations"]["partitions"] for graph in current.values()]
    named = "StaticPartitionsDefinition:held_out,chat,code"
    assert set(sets) == {"StaticPartitionsDefinition:held_out", named}
    # completions x executor x generation URL x generation engine x evaluation sets x Kubernetes placement
    assert len(current) == 2 * 3 * 2 * 2 * 2 * 2
