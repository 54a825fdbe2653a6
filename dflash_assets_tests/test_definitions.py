"""The code location loads: a broken import fails here in seconds."""

from dagster import AssetKey

from dflash_assets.definitions import defs


def test_the_definitions_load_with_the_three_assets_the_sensor_and_the_resources():
    repository = defs.get_repository_def()
    keys = {key.to_user_string() for key in repository.asset_graph.get_all_asset_keys()}
    assert keys == {"tokenized_completions", "hidden_state_partitions", "drafter_checkpoints"}
    assert {s.name for s in repository.sensor_defs} == {"failed_range_sensor"}
    assert set(defs.resources) >= {"store", "store_io_manager", "dataset", "target_model", "devices"}


def test_the_gpu_bound_assets_share_the_gpu_pool_and_ranges_share_one_partitioning():
    graph = defs.get_repository_def().asset_graph
    tokenized = graph.get(AssetKey("tokenized_completions"))
    hidden = graph.get(AssetKey("hidden_state_partitions"))
    assert hidden.partitions_def == tokenized.partitions_def
    keys = tokenized.partitions_def.get_partition_keys()
    assert keys[0] == "00000000-00000099" and len(keys) == 5  # 500 bundled conversations, 100 per range
    assets = {a.key.to_user_string(): a for a in defs.assets}
    assert assets["hidden_state_partitions"].op.pool == "gpu"
    assert assets["drafter_checkpoints"].op.pool == "gpu"
    assert assets["tokenized_completions"].op.pool is None
