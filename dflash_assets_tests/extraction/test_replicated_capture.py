"""Online training's target replicas: a batch split across replicas gives what one replica gives."""

import torch

from dflash_assets.extraction.capture import HiddenStateCapture, ReplicatedCapture
from dflash_assets.target.batching import pad_batch
from dflash_assets.target.model import load_target_model


def test_a_batch_split_across_replicas_equals_one_replica_in_the_original_row_order(demo_model_dir):
    layers = [1, 3, 5, 7, 9]
    replicas = [HiddenStateCapture(load_target_model(demo_model_dir, "cpu"), layers) for _ in range(3)]
    sequences = [[1 + (7 * i + j) % 1500 for j in range(5 + 3 * i)] for i in range(7)]
    input_ids, mask = pad_batch(sequences, 0)

    single = replicas[0](input_ids, mask)
    split = ReplicatedCapture(replicas, "cpu")(input_ids, mask)
    assert split.shape == single.shape == (7, input_ids.shape[1], 5, 64)
    for row, sequence in enumerate(sequences):
        n = len(sequence)
        torch.testing.assert_close(split[row, :n], single[row, :n], atol=1e-5, rtol=1e-5)


def test_more_replicas_than_rows_leaves_the_spare_replicas_idle(demo_model_dir):
    replicas = [HiddenStateCapture(load_target_model(demo_model_dir, "cpu"), [2, 4]) for _ in range(3)]
    input_ids, mask = pad_batch([[5, 6, 7]], 0)
    out = ReplicatedCapture(replicas, "cpu")(input_ids, mask)
    torch.testing.assert_close(out, replicas[1](input_ids, mask))
