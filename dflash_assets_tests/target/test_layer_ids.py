"""The last decoder layer is never a target layer: an explicit DFLASH_TARGET_LAYER_IDS naming it is refused
with the reason, and DFlash's rule never picks it."""

from __future__ import annotations

import pytest

from dflash_assets.target.layer_ids import dflash_target_layer_ids, resolve_target_layer_ids


def test_an_explicit_last_layer_is_refused_naming_the_setting_and_why() -> None:
    with pytest.raises(ValueError) as error:
        resolve_target_layer_ids({"num_hidden_layers": 12}, [1, 5, 11])
    message = str(error.value)
    assert message.startswith("DFLASH_TARGET_LAYER_IDS=[1, 5, 11]: layer 11 is the last of the target's 12")
    assert "hidden_states[12] is its output after the final norm" in message
    assert "before layer 12" in message and "never runs" in message
    assert "layers in 0..10" in message and "DFlash rule ends at N-3 = 9" in message
    assert resolve_target_layer_ids({"num_hidden_layers": 12}, [1, 5, 10]) == [1, 5, 10]  # N-2 is fine


def test_a_multimodal_config_counts_the_text_models_layers() -> None:
    config = {"text_config": {"num_hidden_layers": 64}}
    with pytest.raises(ValueError, match="layer 63 is the last of the target's 64 decoder layers"):
        resolve_target_layer_ids(config, [1, 16, 31, 46, 63])


def test_the_dflash_rule_never_picks_the_last_layer() -> None:
    picked = 0
    for num_layers in range(1, 130):
        for num_draft_layers in range(1, 9):
            try:
                ids = dflash_target_layer_ids(num_layers, num_draft_layers)
            except ValueError as error:  # too shallow: said, naming the setting
                assert "DFLASH_TARGET_LAYER_IDS" in str(error), (num_layers, num_draft_layers)
                continue
            picked += 1
            assert max(ids) <= num_layers - 2 and ids == sorted(set(ids)) and min(ids) >= 0, ids
            if num_draft_layers > 1:
                assert max(ids) == num_layers - 3  # the rule's last layer is N-3
    assert picked > 900  # nearly every (N, k) has a rule answer; the rest are too shallow


def test_one_draft_layer_on_a_two_layer_target_would_be_the_last_layer_and_is_refused() -> None:
    # N // 2 = 1 = N-1: the one case where the rule itself lands on the last layer.
    refused = r"the DFlash rule gives \[1\].*layer 1 is the last.*layers in 0\.\.0"
    with pytest.raises(ValueError, match=refused):
        dflash_target_layer_ids(2, 1)
    assert resolve_target_layer_ids({"num_hidden_layers": 2}, [0], num_draft_layers=1) == [0]
