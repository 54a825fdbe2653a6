"""Both kinds of export as z-lab's own `dflash` package reads and runs them (`DFlashDraftModel`,
`DFlash2DraftModel`, `dflash_generate`): every weight loaded, the same block hidden states and drafts as
the project's drafter, and, decoding with the target, the target's own greedy output and our tau."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from dflash_assets.bench.zlab import load_zlab_drafter, zlab_generate
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.export import export_drafter, load_drafter
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.speculative import greedy_decode, speculative_decode
from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OnlineData
from dflash_assets.training.settings import TrainSettings
from dflash_assets.training.train import train_drafter
from dflash_assets_tests.drafter.test_export_remote_code import (
    FullPrecisionVerifier,
    block_ids,
    ours,
    prompts,
    target_context,
    trained_like,
)
from dflash_assets_tests.support.drafter_fixtures import load_capture, tiny_drafter_config

ARCHS = ["dflash", "dflash2"]


def of_arch(config: DrafterConfig, arch: str) -> DrafterConfig:
    return DrafterConfig(**{**config.__dict__, "arch": arch, "selector_rank": 32, "selector_top_k": 8})


@pytest.mark.parametrize("arch", ARCHS)
def test_both_kinds_of_export_load_in_zlab_dflash_with_every_weight_and_compute_what_ours_computes(
    target_dir: Path, target: torch.nn.Module, tmp_path: Path, arch: str
) -> None:
    config = of_arch(tiny_drafter_config(target_dir), arch)
    export_drafter(trained_like(config, seed=11), tmp_path)  # far from initialisation: every tensor counts
    drafter = load_drafter(tmp_path, target_model=target_dir)  # the export's bf16 weights, as z-lab reads
    zlab, info = load_zlab_drafter(tmp_path)
    assert type(zlab).__name__ == config.architecture
    assert {name: sorted(keys) for name, keys in info.items() if keys} == {}  # none missing/unexpected/off

    ids = torch.randint(0, 299, (27,), generator=torch.Generator().manual_seed(2))
    context, anchor = target_context(target, ids[:-1], config.target_layer_ids), int(ids[-1])
    size, length = config.block_size, context.shape[0]
    with torch.no_grad():
        hidden = zlab(
            position_ids=torch.arange(length + size)[None],
            noise_embedding=target.get_input_embeddings()(block_ids(anchor, size))[None],
            target_hidden=context.reshape(1, length, -1),
        )
        expected = ours(drafter, context, anchor)
        torch.testing.assert_close(hidden[0], expected, rtol=1e-4, atol=1e-4)
        # The drafts as z-lab proposes them: argmax for DFlash, the selector's walk for DFlash2.
        if arch == "dflash2":
            drafts = zlab.propose(hidden[:, 1:], torch.tensor([anchor]), target.lm_head, 0.0)[0][0]
        else:
            drafts = zlab.compute_logits(hidden[:, 1:], target.lm_head).argmax(dim=-1)[0]
        assert drafts.tolist() == drafter.propose(expected[1:], anchor).tolist()


def test_a_dflash2_export_carries_z_labs_config_fields_and_weight_names(target_dir: Path, tmp_path: Path):
    config = of_arch(tiny_drafter_config(target_dir), "dflash2")
    export_drafter(DFlashDrafter.from_target(config), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"]
    assert raw["auto_map"] == {"AutoModel": "modeling_dflash.DFlash2DraftModel"}
    dflash = raw["dflash_config"]
    fields = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    assert [dflash[key] for key in fields] == [2, 16, 32, 8]
    assert "output_multiplier" not in dflash and "final_logit_softcapping" not in dflash  # a Qwen target
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())  # noqa: SIM118 (not a dict)
        shapes = {name: list(handle.get_slice(name).get_shape()) for name in names}
    hidden, vocab = config.hidden_size, config.vocab_size
    # As z-lab's checkpoints name them: the codebooks without `.weight`.
    assert shapes["candidate_selector.predecessor_codebook"] == [vocab, 32]
    assert shapes["candidate_selector.successor_codebook"] == [vocab, 32]
    assert shapes["candidate_selector.hidden_projection.weight"] == [32, hidden]
    for layer in range(config.num_layers):
        for sublayer in ("attention_conv", "mlp_conv"):
            assert shapes[f"layers.{layer}.{sublayer}.base_kernel"] == [2, 2, hidden]
            assert shapes[f"layers.{layer}.{sublayer}.kernel_projection.weight"] == [
                2 * 2 * hidden // 16,
                hidden,
            ]
    dflash_names = {
        name for name in names if "_conv." not in name and not name.startswith("candidate_selector.")
    }
    export_drafter(DFlashDrafter.from_target(of_arch(config, "dflash")), tmp_path / "dflash")
    with safe_open(str(tmp_path / "dflash" / "model.safetensors"), framework="pt") as handle:
        assert dflash_names == set(handle.keys())  # noqa: SIM118 (the same backbone, named alike)


@pytest.fixture(scope="module", params=ARCHS)
def trained(request, tmp_path_factory: pytest.TempPathFactory, own_completions) -> dict:
    """A drafter of each architecture trained on the counting target's own answers, exported."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"zlab-{arch}")
    target_dir, samples = own_completions
    config = of_arch(tiny_drafter_config(target_dir), arch)
    settings = TrainSettings(
        mode="online", epochs=8, global_batch_size=8, lr=3e-3, num_anchors=16, eval_samples=0,
        spec_eval_prompts=0, log_every_steps=100, checkpoint_every_minutes=None,
    )  # fmt: skip
    result = train_drafter(
        config, settings, OnlineData(samples, load_capture(target_dir)),
        store=open_store(str(root / "store")), run="zlab", work_dir=root / "work",
    )  # fmt: skip
    export_drafter(result.model, root / "export")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return {
        "arch": arch,
        "target_dir": target_dir,
        "target": model,
        "export": root / "export",
        "config": config,
    }


@pytest.mark.slow  # trains a drafter of each kind first
def test_zlab_dflash_generate_decodes_the_target_s_greedy_output_and_measures_our_tau(trained: dict) -> None:
    target = trained["target"]
    zlab, _ = load_zlab_drafter(trained["export"])
    drafter = load_drafter(trained["export"], target_model=trained["target_dir"])
    verifier = FullPrecisionVerifier(target, trained["config"].target_layer_ids)
    ours_lengths, zlab_lengths = [], []
    for number, prompt in enumerate(prompts(6, seed=8)):
        prompt = [*prompt, 260 + number % 8]  # into the cycle the target continues
        greedy = greedy_decode(verifier, prompt, 24, set())
        decoded, lengths = zlab_generate(zlab, target, prompt, 24)
        result = speculative_decode(drafter, verifier, prompt, 24, set())
        assert decoded == greedy == result.tokens  # lossless in both loops
        zlab_lengths += lengths
        ours_lengths += result.acceptance_lengths
    ours_tau, zlab_tau = (sum(n) / len(n) for n in (ours_lengths, zlab_lengths))
    assert ours_tau > 1.2  # the drafter learned the cycle: it is accepted, not just correct
    # One drafter, one target, the same prompts: the two loops measure the same tau (the rounds may
    # split differently where a near-tie in the target's float32 states flips a draft).
    assert zlab_tau == pytest.approx(ours_tau, rel=0.1), (ours_lengths, zlab_lengths)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_drafter_for_a_real_model_loads_in_zlab_dflash_and_decodes_its_greedy_output(
    smollm2_dir: Path, tmp_path: Path, arch: str
) -> None:
    """SmolLM2-135M-Instruct as the target: its tokenizer names every row, so the mask token is a reserved
    special token; the export of either kind loads in z-lab's classes with every weight, and decoding with
    z-lab's `dflash_generate` gives the target's own greedy answer to a chat prompt."""
    from transformers import AutoTokenizer

    config = DrafterConfig.from_target(smollm2_dir, num_layers=2, arch=arch)
    assert (config.mask_token_id, config.mask_token) == (16, "<empty_output>")
    export_drafter(trained_like(config, seed=3), tmp_path)
    zlab, info = load_zlab_drafter(tmp_path)
    assert type(zlab).__name__ == config.architecture
    assert {name: sorted(keys) for name, keys in info.items() if keys} == {}

    target = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    verifier = FullPrecisionVerifier(target, config.target_layer_ids)
    stop = {tokenizer.eos_token_id}
    greedy = greedy_decode(verifier, prompt, 16, stop)
    assert tokenizer.decode(greedy).startswith("The capital of France is Paris.")
    decoded, lengths = zlab_generate(zlab, target, prompt, 16, sorted(stop))
    assert decoded == greedy and sum(lengths) == len(greedy) - 1


@pytest.mark.parametrize("arch", ARCHS)
def test_a_drafter_for_a_gemma_family_target_decodes_its_greedy_output_in_both_loops(
    demo_model_dir: Path, tmp_path: Path, arch: str
) -> None:
    """Another family than Qwen's: a gemma3_text target scales its embeddings inside the embedding module
    (by sqrt(hidden)), mixes sliding-window and full attention layers, soft-caps its logits, and ends a
    turn on a token its generation config names. The drafter embeds raw rows, as z-lab's `dflash_generate`
    and the engines feed it; both loops give the target's own greedy output."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from dflash_assets.drafter.speculative import TargetVerifier, stop_token_ids_of

    config = Gemma3TextConfig(
        vocab_size=1536, hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=8, max_position_embeddings=2048,
        query_pre_attn_scalar=32, final_logit_softcapping=30.0,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2, eos_token_id=[1, 2],
    )  # fmt: skip
    torch.manual_seed(0)
    gemma = Gemma3ForCausalLM(config).eval()
    assert float(gemma.get_input_embeddings().embed_scale) == 8.0  # sqrt(64): inside the module
    target_dir = tmp_path / "gemma"
    gemma.save_pretrained(target_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (demo_model_dir / name).exists():
            (target_dir / name).write_bytes((demo_model_dir / name).read_bytes())
    drafter_config = DrafterConfig.from_target(target_dir, num_layers=2, arch=arch)
    assert drafter_config.final_logit_softcapping == 30.0
    export_drafter(trained_like(drafter_config, seed=5), tmp_path / "export")
    zlab, info = load_zlab_drafter(tmp_path / "export")
    assert {name: sorted(keys) for name, keys in info.items() if keys} == {}
    stop = stop_token_ids_of(str(target_dir))
    assert {1, 2} <= stop  # the generation config's end-of-turn ids
    verifier = TargetVerifier(gemma, drafter_config.target_layer_ids)
    for prompt in prompts(3, seed=4):
        greedy = greedy_decode(verifier, prompt, 24, stop)
        decoded, _ = zlab_generate(zlab, gemma, prompt, 24, sorted(stop))
        ours = speculative_decode(
            load_drafter(tmp_path / "export", target_model=target_dir), verifier, prompt, 24, stop
        )
        assert decoded == greedy == ours.tokens
