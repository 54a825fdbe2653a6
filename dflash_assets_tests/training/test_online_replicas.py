"""Online training's target replicas over several devices each (`DFLASH_TARGET_TP`): a rank's target
devices in whole replicas, and only the first replica holding the LM head the verifier reads."""

import pytest
import torch

from dflash_assets.training.job import replica_captures, replica_devices


def test_a_ranks_target_devices_come_in_whole_replicas():
    assert replica_devices(["cuda:1", "cuda:2", "cuda:3", "cuda:4"], 2) == [
        ["cuda:1", "cuda:2"],
        ["cuda:3", "cuda:4"],
    ]
    with pytest.raises(ValueError, match="online_target_devices"):
        replica_devices(["cuda:1", "cuda:2", "cuda:3"], 2)


def test_only_the_first_replica_loads_the_lm_head_which_the_verifier_reads(demo_model_dir):
    captures = replica_captures(demo_model_dir, [["cpu:0"], ["cpu:1"], ["cpu:2"]], [1, 3, 5])
    heads = [capture.model.get_output_embeddings() is not None for capture in captures]
    assert heads == [True, False, False]
    ids = torch.randint(0, 1000, (2, 12))
    mask = torch.ones_like(ids)
    assert torch.equal(captures[0](ids, mask), captures[1](ids, mask))  # the same states without it
