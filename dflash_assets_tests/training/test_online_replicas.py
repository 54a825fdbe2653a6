"""Online training's target replicas over several devices each (`DFLASH_TARGET_TP`): a rank's target
devices in whole replicas."""

import pytest

from dflash_assets.training.job import replica_devices


def test_a_ranks_target_devices_come_in_whole_replicas():
    assert replica_devices(["cuda:1", "cuda:2", "cuda:3", "cuda:4"], 2) == [
        ["cuda:1", "cuda:2"],
        ["cuda:3", "cuda:4"],
    ]
    with pytest.raises(ValueError, match="online_target_devices"):
        replica_devices(["cuda:1", "cuda:2", "cuda:3"], 2)
