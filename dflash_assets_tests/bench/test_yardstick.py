"""`scripts/yardstick.py`, the drafter side by side through the product alone: a variant's name is its run
config, a name that is not one is refused in one line before anything loads, and `train` then `table` on
the demo ranges materialise `drafter_checkpoints` and `drafter_evaluations` and list the variant beside the
free floor with its curve, z-lab's `dflash_generate` agreeing with the product's loop."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_assets.evaluation.runs import run_manifest
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import make_dagster_home
from dflash_assets_tests.support.scripts import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "yardstick.py"
VARIANT = "dflash2-dpace-8"
STEPS, EVALS, PROMPTS, NEW_TOKENS = 2, 2, 2, 8


@pytest.fixture(scope="module")
def yardstick():
    yield load_script("yardstick", register=True)
    sys.modules.pop("yardstick", None)


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("dflash2-dpace-16", ("dflash2", "dpace", 16, 0.0)),
        ("dflash-decay-16", ("dflash", "decay", 16, 0.0)),
        ("dflash2-dpace-8-kl0.5", ("dflash2", "dpace", 8, 0.5)),
        ("dflash2-dpace-16-kl1", ("dflash2", "dpace", 16, 1.0)),
    ],
)
def test_a_variant_name_is_its_architecture_loss_block_and_distillation_weight(yardstick, name, fields):
    variant = yardstick.parse_variant(name)
    assert (variant.arch, variant.loss, variant.block_size, variant.distill_weight) == fields
    assert variant.train_config() == {
        "run_name": name,
        "drafter_arch": fields[0],
        "loss": fields[1],
        "block_size": fields[2],
        "distill_weight": fields[3],
    }


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("dflash2-dpace", "is not <arch>-<loss>-<block>[-kl<w>]"),
        ("dflash2-dpace-16-kl0.5-x", "is not <arch>-<loss>-<block>[-kl<w>]"),
        ("dflash3-dpace-16", "architecture 'dflash3' is not one of dflash, dflash2"),
        ("dflash2-ce-16", "loss 'ce' is not one of dpace, decay"),
        ("dflash2-dpace-1", "block '1' is not a whole number of 2 or more"),
        ("dflash2-dpace-x", "block 'x'"),
        ("dflash2-dpace-16-kl0", "'kl0' is not kl<w>, the distillation weight w in (0, 1]"),
        ("dflash2-dpace-16-kl1.5", "'kl1.5' is not kl<w>"),
        ("dflash2-dpace-16-klx", "'klx' is not kl<w>"),
        ("dflash2-dpace-16-0.5", "'0.5' is not kl<w>"),
    ],
)
def test_a_name_that_is_not_a_variant_says_which_part_is_wrong(yardstick, name, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        yardstick.parse_variant(name)


def test_the_flags_become_the_run_config_and_the_curve_has_evals_points(yardstick):
    args = yardstick.parser().parse_args(
        ["train", "dflash2-dpace-8-kl0.5", "--steps", "480", "--evals", "4", "--batch", "16", "--lr", "3e-4"]
    )
    assert yardstick.train_config(yardstick.parse_variant(args.variants[0]), args) == {
        "run_name": "dflash2-dpace-8-kl0.5",
        "drafter_arch": "dflash2",
        "loss": "dpace",
        "block_size": 8,
        "distill_weight": 0.5,
        "max_steps": 480,
        "checkpoint_every_steps": 120,
        "global_batch_size": 16,
        "lr": 3e-4,
    }  # what no flag gives is left to the user's settings: no num_anchors, no spec_eval_prompts


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["train", "dflash3-dpace-16", "--steps", "2"], "variant 'dflash3-dpace-16': architecture"),
        (["train", VARIANT, "--steps", "2", "--sets", "held_out,code"], "code is not a prompt set here"),
        (["train", VARIANT, "--steps", "0"], "--steps 0 must be 1 or more"),
    ],
)
def test_a_wrong_flag_is_one_line_before_anything_loads(yardstick, monkeypatch, capsys, argv, says):
    monkeypatch.setenv("DFLASH_EVAL_SETS", "chat=sharegpt-first-turn[17000:]")  # read by no one here
    assert yardstick.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("yardstick train: ") and says in err and len(err.splitlines()) == 1


def _yardstick(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def measured(tmp_path_factory, demo_ranges, demo_model_dir):
    """The shared demo ranges in a store of its own, then `train` of one variant (2 steps, a checkpoint each,
    held_out measured on 2 prompts, z-lab's loop beside) and `table`, as a user runs them."""
    root = tmp_path_factory.mktemp("yardstick")
    store_url = str(root / "store")
    demo_ranges.copy_to(open_store(store_url))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "DFLASH_"))},
        "DAGSTER_HOME": make_dagster_home(root / "dagster-home"),
        "DFLASH_HOME": str(root / "home"),
        "DFLASH_CACHE_DIR": str(demo_model_dir.parent),
        "DFLASH_SAMPLES_PER_PARTITION": "24",  # the demo ranges' keys
        "DFLASH_STORE_URL": store_url,
        "DFLASH_MAX_LENGTH": "256",
        "OMP_NUM_THREADS": "1",
    }
    argv = (
        "train", VARIANT, "--steps", str(STEPS), "--evals", str(EVALS), "--batch", "6", "--anchors", "16",
        "--curve-prompts", "2", "--prompts", str(PROMPTS), "--new-tokens", str(NEW_TOKENS), "--zlab",
        "--threads", "1",
    )  # fmt: skip
    trained = _yardstick(*argv, env=env)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    table = _yardstick("table", env=env)
    assert table.returncode == 0, table.stderr[-3000:]
    store = open_store(store_url)
    return {"train": trained.stdout, "table": table.stdout, "store": store, "env": env, "argv": argv}


def test_train_materialises_the_run_and_its_evaluation_under_the_variants_name(measured):
    store = measured["store"]
    manifest = run_manifest(store, VARIANT)
    assert (manifest["drafter_arch"], manifest["loss"], manifest["block_size"]) == ("dflash2", "dpace", 8)
    assert manifest["steps"] == STEPS and manifest["distill_weight"] == 0.0
    # A checkpoint every steps // evals steps, each evaluated; step 0 is the fresh drafter.
    assert [point["step"] for point in manifest["curve"]] == [0, 1, 2]
    assert all(point["tau"] >= 1.0 and point["teacher_forced_tau"] >= 1.0 for point in manifest["curve"])
    assert manifest["curve"][-1]["tau"] == manifest["acceptance_length_tau"]
    record = json.loads(bytes(store.get_bytes(f"evaluations/{VARIANT}/held_out/evaluation.json")))
    assert (record["prompts"], record["max_new_tokens"], record["lossless_prompts"]) == (
        PROMPTS,
        NEW_TOKENS,
        2,
    )
    assert re.search(r"drafter_checkpoints +\(all ranges\) +ok", measured["train"])
    assert f"held_out: τ {record['tau']:.3f}, prompt lookup {record['floor_tau']:.3f}" in measured["train"]


def test_z_labs_dflash_generate_agrees_with_the_products_loop_on_the_same_prompts(measured):
    found = re.search(
        r"held_out by z-lab's dflash_generate: τ ([\d.]+) \(the product's loop ([\d.]+)\); "
        r"[\d.]+x the prompt-lookup floor's [\d.]+; "
        r"(\d+)/(\d+) outputs equal the target's own \(the product's (\d+)/(\d+)\)",
        measured["train"],
    )
    assert found, measured["train"][-2000:]
    zlab, product = float(found[1]), float(found[2])
    assert zlab == pytest.approx(product, rel=0.02)
    assert found.groups()[2:] == (str(PROMPTS),) * 4  # every output the target's own, by either loop


def test_the_table_is_compare_markdown_with_each_runs_curve(measured):
    lines = measured["table"].splitlines()
    assert lines[0].startswith("| run | set | prompts | τ | floor τ |") and lines[1].startswith("|---|")
    row = lines[2].split(" | ")
    assert (row[0], row[1], row[2]) == (f"| {VARIANT}", "held_out", str(PROMPTS))
    assert row[7:10] == ["dflash2", "dpace", "8"] and row[11] == str(STEPS)
    curve = next(line for line in lines if line.startswith(f"- {VARIANT}: "))
    three = r"[\d.]+ / [\d.]+ / [\d.]+"
    assert re.fullmatch(rf"- {VARIANT}: steps 0 / 1 / 2: τ {three}; teacher-forced τ {three}", curve), curve


def test_reproduce_sets_only_what_the_user_left_unset_and_measures_the_users_sets_beside_its_own(yardstick):
    added = yardstick.reproduce_settings(
        {"DFLASH_MAX_LENGTH": "4096", "DFLASH_EVAL_SETS": "code=/data/code.jsonl", "DFLASH_HOME": "/h"}
    )
    assert "DFLASH_MAX_LENGTH" not in added and "DFLASH_HOME" not in added  # the user's win
    assert added["DFLASH_DATASET"] == str(yardstick.KEPT_DATA) and yardstick.KEPT_DATA.exists()
    assert added["DFLASH_COMPLETIONS"] == "dataset" and added["DFLASH_TRAIN_UNTIL_FLAT"] == "1"
    assert added["DFLASH_EVAL_SETS"] == "code=/data/code.jsonl,sharegpt_later=sharegpt-first-turn[16000:]"
    # A user who already names the later set keeps their reference for it.
    mine = {"DFLASH_EVAL_SETS": "sharegpt_later=sharegpt-first-turn[15000:]"}
    assert "DFLASH_EVAL_SETS" not in yardstick.reproduce_settings(mine)


def test_reproduce_names_each_data_size_and_schedule_its_own_run(yardstick, monkeypatch):
    monkeypatch.delenv("DFLASH_LR_SCHEDULE", raising=False)
    assert yardstick.reproduce_variant().name == "default-recipe"
    assert yardstick.reproduce_variant(250).name == "default-recipe-250"
    monkeypatch.setenv("DFLASH_LR_SCHEDULE", "wsd")
    assert yardstick.reproduce_variant(250).name == "default-recipe-250-wsd"
    assert yardstick.reproduce_variant().name == "default-recipe-wsd"


def test_a_rerun_measures_only_what_is_missing(measured):
    """The same command again: the run is in the store and its held_out evaluation measured this export
    at these prompts and tokens, so nothing is decoded again (z-lab's loop, asked for, still runs)."""
    store, env = measured["store"], measured["env"]
    before = read_manifest(store, f"evaluations/{VARIANT}/held_out")
    again = _yardstick(*measured["argv"], env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "(measured before on this export)" in again.stdout
    assert "drafter_evaluations" not in again.stdout  # not materialised again
    assert read_manifest(store, f"evaluations/{VARIANT}/held_out") == before
    assert "held_out by z-lab's dflash_generate" in again.stdout


def test_the_plot_draws_every_measured_row_as_tau_and_its_floor(yardstick):
    import xml.etree.ElementTree as ElementTree

    rows = [
        {"run": "a", "set": "held_out", "conversations": 173, "prompts": 16, "tau": 1.33, "floor": 1.24},
        {"run": "b", "set": "held_out", "conversations": 913, "prompts": 64, "tau": 1.43, "floor": 1.41},
        {"run": "b", "set": "later", "conversations": 913, "prompts": 64, "tau": 1.39, "floor": 1.30},
        {"run": "c", "set": "later", "conversations": 237, "prompts": 64, "tau": 1.30, "floor": 1.30,
         "path": yardstick.DATASET_ANSWERS},
    ]  # fmt: skip
    svg = ElementTree.fromstring(yardstick.plot_svg(rows))
    circles = [c for c in svg.iter("{http://www.w3.org/2000/svg}circle")]
    filled = [c for c in circles if c.get("fill") not in (None, "none") and c.find("{*}title") is not None]
    assert [c.find("{*}title").text.split(":")[0] for c in filled] == ["a", "b", "b"]
    squares = [r for r in svg.iter("{http://www.w3.org/2000/svg}rect") if r.find("{*}title") is not None]
    assert [r.find("{*}title").text.split(":")[0] for r in squares] == ["c"]  # the dataset's answers
    assert "τ, the dataset's answers" in yardstick.plot_svg(rows)
    assert "the dataset's answers" not in yardstick.plot_svg(rows[:3])
    # Higher tau is drawn higher (smaller y), and 913 conversations to the right of 173.
    assert float(filled[1].get("cy")) < float(filled[0].get("cy"))
    assert float(filled[1].get("cx")) > float(filled[0].get("cx"))


def test_kept_references_seed_a_fresh_store_and_a_bad_one_is_named_and_left_out(yardstick, tmp_path, capsys):
    """`keep-references` writes the store's references gzipped; `train`/`reproduce` put them in a store
    that lacks them, so its evaluation of those prompts decodes only the drafter."""
    import gzip

    from dflash_assets.evaluation.runs import read_reference, write_reference

    made = open_store(str(tmp_path / "made"))
    reference = {"greedy": [[1, 2, 3], [4, 5]], "floors": {"8": {"tau": 1.25}}}
    write_reference(made, "a" * 32, reference)
    kept = tmp_path / "kept"
    assert yardstick.keep_references(made, kept) == 1
    assert yardstick.keep_references(made, kept) == 0  # kept already: not written again
    assert json.loads(gzip.decompress((kept / f"{'a' * 32}.json.gz").read_bytes())) == reference

    (kept / f"{'b' * 32}.json.gz").write_bytes(b"not gzip")
    fresh = open_store(str(tmp_path / "fresh"))
    assert yardstick.seed_references(fresh, kept) == 1
    assert read_reference(fresh, "a" * 32) == reference
    assert read_reference(fresh, "b" * 32) is None
    out = capsys.readouterr().out
    assert f"kept reference {kept / ('b' * 32 + '.json.gz')} does not read" in out
    assert yardstick.seed_references(fresh, kept) == 0  # in the store already


def test_the_kept_references_are_named_by_what_they_were_made_from(yardstick):
    """Each kept file's name is a 32-hex identity, and each holds a greedy output a prompt."""
    import gzip

    files = sorted(yardstick.KEPT_REFERENCES.glob("*.json.gz"))
    assert files  # reproduce's sets, made on a 2-core AVX2 machine (README.md beside them)
    readme = (yardstick.KEPT_REFERENCES / "README.md").read_text()
    for path in files:
        assert re.fullmatch(r"[0-9a-f]{32}\.json\.gz", path.name)
        assert path.name.removesuffix(".json.gz") in readme  # which set, target and machine made it
        reference = json.loads(gzip.decompress(path.read_bytes()))
        assert len(reference["greedy"]) == 64 and all(reference["floors"].values())
