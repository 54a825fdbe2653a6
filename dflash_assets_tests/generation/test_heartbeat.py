"""Never silent: while no conversation of a range has finished (a batch of long prompts answers all at
once, minutes later on a CPU), its progress says how many tokens the target has made so far, how many rows
are in flight and which engine answers."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from dflash_assets.conversations.datasets import bundled_dataset_path
from dflash_assets.generation.in_process import InProcessEngine
from dflash_assets.generation.regenerate import completions_fingerprint, regenerate_range
from dflash_assets.generation.settings import GenerationSettings
from dflash_assets.storage.local_store import LocalStore
from dflash_assets.storage.uploader import Uploader
from dflash_assets.target.model import load_target_model

pytestmark = pytest.mark.slow  # a range of the demo target's answers


def test_a_range_whose_first_batch_is_still_decoding_says_the_tokens_made_so_far(
    demo_model_dir: Path, tmp_path
):
    from transformers import AutoTokenizer

    settings = GenerationSettings(max_new_tokens=24)
    model = load_target_model(demo_model_dir, "cpu")
    engine = InProcessEngine(model, AutoTokenizer.from_pretrained(demo_model_dir), settings, device="cpu")
    with open(bundled_dataset_path()) as handle:
        # First turns only: one batch answers every row at once, at its end.
        rows = []
        for index, line in zip(range(6), handle, strict=False):
            messages = json.loads(line)["messages"]
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            rows.append((index, messages[: first + 1]))
    lines: list[str] = []
    store = LocalStore(tmp_path / "store")
    with Uploader(store) as uploader:
        result = regenerate_range(
            rows=rows,
            open_engine=lambda: contextlib.nullcontext(engine),
            store=store,
            prefix="target-completions/00000000-00000005",
            staging_dir=tmp_path / "staging",
            uploader=uploader,
            fingerprint=completions_fingerprint("demo", settings),
            log=lines.append,
            progress_every_s=0.0,  # a line at every tick: each forward of the target
        )
    assert result.records == 6
    beats = [line for line in lines if "no conversation finished yet" in line]
    made = [
        int(line.split(": ", 2)[2].split(" tokens generated so far")[0].replace(",", "")) for line in beats
    ]
    assert len(beats) >= 10, lines[:5]  # one batch of 6 rows: every decoding step ticked
    assert made == sorted(made) and made[-1] > made[0] > 0  # the count grows as the batch decodes
    assert all("rows in flight" in line and "engine in-process" in line for line in beats)
    assert engine.stats.tokens_in_flight == 0  # answered: counted as finished from then on
