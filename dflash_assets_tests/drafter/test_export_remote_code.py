"""The export loads through `AutoModel.from_pretrained(dir, trust_remote_code=True)`, as z-lab/dflash's
README loads a drafter, and computes what the project's own drafter computes: the same block hidden
states on the same inputs, and, decoding with the target in the loop, the same tokens and acceptance."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, DynamicCache

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.export import export_drafter, load_drafter
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.speculative import TargetVerifier, greedy_decode, speculative_decode
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OnlineData
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import train_drafter
from dflash_assets_tests.support.drafter_fixtures import (
    CYCLE_START,
    MASK_TOKEN_ID,
    load_capture,
    tiny_drafter_config,
)
from dflash_assets_tests.support.reference_dflash import ReferenceDrafter


def trained_like(config: DrafterConfig, seed: int) -> DFlashDrafter:
    """Weights far from initialisation, so every tensor shapes the output."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter.from_target(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(noise * 0.15 + 1.0 if parameter.ndim == 1 else noise * 0.15)
    return drafter.eval()


def with_window(config: DrafterConfig, window: int | None) -> DrafterConfig:
    if window is None:
        return config
    # The Qwen3.6 pattern: sliding layers, then a full one; a window the context exceeds, so it cuts.
    return DrafterConfig(**{**config.__dict__, "layer_types": ["sliding_attention", "full_attention"],
                            "sliding_window": window})  # fmt: skip


def target_context(target: torch.nn.Module, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """[L, K, H]: the target's layers at every position (raw decoder outputs, hidden_states[i + 1])."""
    with torch.no_grad():
        states = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    return torch.stack([states[i + 1][0] for i in layer_ids], dim=1)


def block_ids(anchor: int, size: int) -> torch.Tensor:
    block = torch.full((size,), MASK_TOKEN_ID)
    block[0] = anchor
    return block


def ours(drafter: DFlashDrafter, context: torch.Tensor, anchor: int) -> torch.Tensor:
    """The project's drafter on one block after `context` [C, K, H]: hidden states [S, H]."""
    size, length = drafter.config.block_size, context.shape[0]
    with torch.no_grad():
        hidden = drafter(
            block_ids(anchor, size).view(1, 1, size), (length + torch.arange(size)).view(1, 1, size),
            context[None], torch.arange(length)[None], torch.tensor([[length]]),
        )  # fmt: skip
    return hidden[0, 0]


@pytest.mark.parametrize("window", [None, 12])
def test_automodel_with_remote_code_computes_what_load_drafter_computes(
    target_dir: Path, target: torch.nn.Module, tmp_path: Path, window: int | None
) -> None:
    config = with_window(tiny_drafter_config(target_dir), window)
    export_drafter(trained_like(config, seed=3), tmp_path)
    remote = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(remote).__name__ == "DFlashDraftModel"
    assert type(remote).__module__.startswith("transformers_modules.")  # the file in the directory
    reloaded = load_drafter(tmp_path, target_model=target_dir)

    ids = torch.randint(0, MASK_TOKEN_ID, (31,), generator=torch.Generator().manual_seed(5))
    context, anchor = target_context(target, ids[:-1], config.target_layer_ids), int(ids[-1])
    expected = ours(reloaded, context, anchor)  # [S, H]
    size, length = config.block_size, context.shape[0]
    noise = target.get_input_embeddings()(block_ids(anchor, size))[None]  # the target's own embedding
    target_hidden = context.reshape(1, length, -1)  # [1, C, K*H]
    with torch.no_grad():
        # z-lab's call: positions of the context, then of the block.
        hidden = remote(position_ids=torch.arange(length + size)[None], noise_embedding=noise,
                        target_hidden=target_hidden)  # fmt: skip
        block_only = remote(position_ids=(length + torch.arange(size))[None], noise_embedding=noise,
                            target_hidden=target_hidden)  # fmt: skip
    torch.testing.assert_close(hidden[0], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block_only, hidden)
    # And the drafts, through the target's LM head, are what the independent reader drafts.
    reference = ReferenceDrafter(tmp_path).draft_logits(
        context, anchor, target.get_input_embeddings(), target.lm_head
    )
    torch.testing.assert_close(target.lm_head(hidden[0, 1:]), reference, rtol=1e-4, atol=1e-4)


def test_the_draft_cache_gives_what_recomputing_the_whole_context_gives(
    target_dir: Path, target: torch.nn.Module, tmp_path: Path
) -> None:
    config = with_window(tiny_drafter_config(target_dir), 12)
    export_drafter(trained_like(config, seed=4), tmp_path)
    remote = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.randint(0, MASK_TOKEN_ID, (40,), generator=torch.Generator().manual_seed(6))
    context = target_context(target, ids, config.target_layer_ids).reshape(1, 40, -1)
    embed, size = target.get_input_embeddings(), config.block_size

    def block(anchor_position: int) -> torch.Tensor:
        return embed(block_ids(int(ids[anchor_position]), size))[None]

    with torch.no_grad():
        # As z-lab's dflash_generate drives it: the cache keeps the context's keys, cropped to it after
        # each block; the next block brings only the new context.
        cache = DynamicCache()
        remote(position_ids=torch.arange(25 + size)[None], noise_embedding=block(25),
               target_hidden=context[:, :25], past_key_values=cache, use_cache=True)  # fmt: skip
        cache.crop(-size)  # drop the block's keys (transformers 5 crops by a negative count)
        cached = remote(position_ids=torch.arange(25, 32 + size)[None], noise_embedding=block(32),
                        target_hidden=context[:, 25:32], past_key_values=cache, use_cache=True)  # fmt: skip
        whole = remote(position_ids=torch.arange(32 + size)[None], noise_embedding=block(32),
                       target_hidden=context[:, :32])  # fmt: skip
    torch.testing.assert_close(cached, whole, rtol=1e-5, atol=1e-5)


def test_the_exported_config_keeps_the_engines_fields_and_adds_the_auto_map(
    target_dir: Path, tmp_path: Path
) -> None:
    config = tiny_drafter_config(target_dir)
    export_drafter(trained_like(config, seed=1), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert (tmp_path / "modeling_dflash.py").is_file()
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"]["mask_token_id"] == MASK_TOKEN_ID
    assert raw["dflash_config"]["mask_token"] == "<|MASK|>"  # the tiny target's tokenizer names no id 299
    assert raw["dflash_config"]["target_layer_ids"] == config.target_layer_ids
    assert DrafterConfig.load(tmp_path).mask_token == "<|MASK|>"
    source = (tmp_path / "modeling_dflash.py").read_text()
    assert "dflash_assets" not in source.replace("dflash-assets", "").split('"""', 2)[2]  # standalone


# -- decoding with the target in the loop


class FullPrecisionVerifier(TargetVerifier):
    """The project's verifier without its bf16 rounding of the context (what a bf16 engine is fed): the
    remote code takes the target's states as they come, so both drafters see the very same numbers."""

    @torch.no_grad()
    def run(self, ids, cache):  # noqa: ANN001, ANN201 (the parent's signature)
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        output = self.model(
            input_ids=input_ids, output_hidden_states=True, use_cache=True, **{self._cache_argument: cache}
        )
        hidden = torch.stack([output.hidden_states[i + 1][0] for i in self.target_layer_ids], dim=1)
        return output.logits[0].argmax(dim=-1).cpu(), hidden


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(rng.randrange(8, 16))] for _ in range(count)]


@pytest.fixture(scope="module")
def counting(tmp_path_factory: pytest.TempPathFactory, own_completions) -> dict:
    """A target whose greedy output a drafter learns in a few steps (conftest's `own_completions`: the
    counting target and conversations it answered itself), and such a drafter, exported."""
    root = tmp_path_factory.mktemp("counting")
    target_dir, samples = own_completions
    config = tiny_drafter_config(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    verifier = FullPrecisionVerifier(model, config.target_layer_ids)
    settings = TrainSettings(
        mode="online", epochs=8, global_batch_size=8, lr=3e-3, num_anchors=16, eval_samples=0,
        spec_eval_prompts=0, log_every_steps=100, checkpoint_every_minutes=None,
    )  # fmt: skip
    result = train_drafter(
        config, settings, OnlineData(samples, load_capture(target_dir)),
        store=open_store(str(root / "store")), run="counting", work_dir=root / "work",
    )  # fmt: skip
    export_drafter(result.model, root / "export")
    return {"target_dir": target_dir, "target": model, "verifier": verifier, "export": root / "export"}


@pytest.mark.slow  # `counting` trains a drafter first
def test_spec_generate_decodes_what_the_projects_speculative_decoding_decodes(counting: dict) -> None:
    remote = AutoModel.from_pretrained(counting["export"], trust_remote_code=True, dtype=torch.float32)
    ours_reloaded = load_drafter(counting["export"], target_model=counting["target_dir"])
    verifier, target = counting["verifier"], counting["target"]
    accepted_any = False
    for prompt in prompts(3, seed=11):
        prompt = [*prompt, CYCLE_START + 2]
        expected = speculative_decode(ours_reloaded, verifier, prompt, 40, set())
        stats = remote.spec_generate(
            target=target, input_ids=torch.tensor([prompt]), max_new_tokens=40, stop_token_ids=[],
            temperature=0.0, return_stats=True,
        )  # fmt: skip
        assert stats.output_ids[0, len(prompt) :].tolist() == expected.tokens
        assert expected.tokens == greedy_decode(verifier, prompt, 40, set())  # the target's own output
        assert stats.acceptance_lengths == expected.acceptance_lengths
        accepted_any |= max(expected.acceptance_lengths) > 1
    assert accepted_any  # the drafts mattered: equal acceptance is not just "every draft rejected"


@pytest.mark.slow  # `counting` trains a drafter first
def test_spec_generate_stops_after_a_stop_token_as_z_labs_does(counting: dict) -> None:
    remote = AutoModel.from_pretrained(counting["export"], trust_remote_code=True, dtype=torch.float32)
    prompt = [*prompts(1, seed=12)[0], CYCLE_START]
    greedy = greedy_decode(counting["verifier"], prompt, 30, set())
    stop = greedy[5]
    output = remote.spec_generate(counting["target"], torch.tensor([prompt]), 30, [stop], 0.0)
    assert output[0, len(prompt) :].tolist() == greedy[: greedy.index(stop) + 1]


def test_a_dflash2_export_loads_with_remote_code_and_drafts_through_its_selector_as_ours_does(
    target_dir: Path, target: torch.nn.Module, tmp_path: Path
) -> None:
    config = DrafterConfig(
        **{**tiny_drafter_config(target_dir).__dict__, "arch": "dflash2", "selector_rank": 16}
    )
    export_drafter(trained_like(config, seed=7), tmp_path)
    remote = AutoModel.from_pretrained(tmp_path, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(remote).__name__ == "DFlash2DraftModel"
    reloaded = load_drafter(tmp_path, target_model=target_dir)
    ids = torch.randint(0, MASK_TOKEN_ID, (29,), generator=torch.Generator().manual_seed(9))
    context, anchor = target_context(target, ids[:-1], config.target_layer_ids), int(ids[-1])
    expected = ours(reloaded, context, anchor)
    size, length = config.block_size, context.shape[0]
    noise = target.get_input_embeddings()(block_ids(anchor, size))[None]
    with torch.no_grad():
        hidden = remote(position_ids=torch.arange(length + size)[None], noise_embedding=noise,
                        target_hidden=context.reshape(1, length, -1))  # fmt: skip
        # Two float32 implementations of the same sums: equal to rounding (1e-5 failed by 1.1e-5 on one CPU).
        torch.testing.assert_close(hidden[0], expected, rtol=1e-4, atol=1e-4)
        drafts = remote.propose(hidden[0, 1:], anchor, target.lm_head, 0.0)
    assert drafts == reloaded.propose(expected[1:], anchor).tolist()
