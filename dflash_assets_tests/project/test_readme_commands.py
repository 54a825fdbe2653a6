"""The README's shell commands run as written after `scripts/up.sh`, against the demo's instance and store:
each succeeds, and none rewrites what the demo stored (the demo, a shell and the UI share one set of
defaults, so a shell continues the demo's ranges). `dg`, `dagster` and the UI see one asset graph.

The demo runs here on the bundled data's first 101 rows (the README's two ranges, the second of one
row), answers of at most 16 tokens and 2 training steps of 4 sequences, so it costs a minute, not the
demo's four. The README's training command (`dg launch --assets drafter_checkpoints`) is not run: the
demo's training here is not the demo's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from dflash_assets.cli import DEMO_EVALUATION
from dflash_assets.conversations.datasets import bundled_dataset_path
from dflash_assets_tests.conftest import REPO, make_dagster_home

pytestmark = pytest.mark.slow
README = REPO / "README.md"
DEMO_ROWS = 101
SCRIPTS_DAGSTER_HOME = "export DAGSTER_HOME=$PWD/.dagster_home"


def readme_shell_commands() -> list[str]:
    """The lines of the README's shell block under *Materialising*, as a user would paste them."""
    text = README.read_text()
    section = text[text.index("## Materialising") :]
    block = re.search(r"- \*\*Shell\*\*.*?```bash\n(.*?)```", section, re.S)
    assert block, "README's Materialising section has no shell block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def _clean_environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "AWS_", "VIRTUAL_ENV"))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _snapshot(store: Path) -> dict[str, tuple[str, int, int]]:
    """Every stored object of the ranges: content digest, inode and modification time."""
    found = {}
    for prefix in ("target-completions", "tokenized-completions", "hidden-states"):
        for path in sorted((store / prefix).rglob("*")):
            if path.is_file():
                stat = path.stat()
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                found[str(path.relative_to(store))] = (digest, stat.st_ino, stat.st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def after_up(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> dict:
    """`bash scripts/up.sh --no-ui` on an empty DFLASH_HOME (the demo model copied into its cache)."""
    root = tmp_path_factory.mktemp("after-up")
    dataset = root / "conversations.jsonl"
    with open(bundled_dataset_path()) as source:
        dataset.write_text("".join(line for _, line in zip(range(DEMO_ROWS), source, strict=False)))
    env = _clean_environment(
        DFLASH_HOME=str(root / "home"),
        DFLASH_CACHE_DIR=str(demo_model_dir.parent),
        DFLASH_DATASET=str(dataset),
        DFLASH_SAMPLES_PER_PARTITION="100",  # the bundled data's size (a file of one's own: 10,000)
        DFLASH_GENERATE_MAX_NEW_TOKENS="16",  # the demo target's 64 would cost 100 answers 4 times the CPU
        DFLASH_TRAIN_MAX_STEPS="2",
        DFLASH_TRAIN_GLOBAL_BATCH_SIZE="4",  # the bundled file's own default; a file of 101 rows gets 32
        DAGSTER_HOME=make_dagster_home(root / "dagster-home"),
    )
    done = subprocess.run(
        ["bash", "scripts/up.sh", "--no-ui"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return {"env": env, "store": root / "home" / "store", "demo_output": done.stdout}


def test_the_readme_commands_continue_the_demos_ranges_without_rewriting_any_object(after_up: dict):
    store = after_up["store"]
    before = _snapshot(store)
    assert any(key.startswith("target-completions/00000100-00000199/") for key in before)
    commands = readme_shell_commands()
    assert SCRIPTS_DAGSTER_HOME in commands[0]  # the scripts' instance, here the test's
    script = "\n".join(
        line.replace(SCRIPTS_DAGSTER_HOME, f"export DAGSTER_HOME={after_up['env']['DAGSTER_HOME']}")
        for line in commands
    )
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-xc", script],
        cwd=REPO,
        env=after_up["env"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    runs = [line for line in commands if line.startswith(("dg launch", "dagster asset materialize"))]
    assert output.count("RUN_SUCCESS") == len(runs) == 4, output[-3000:]

    after = _snapshot(store)
    changed = sorted(key for key in before if after.get(key, ("gone",))[0] != before[key][0])
    assert not changed, f"the README's commands changed what the demo stored: {changed[:5]}"
    rewritten = [
        key
        for key in before
        if not key.startswith("tokenized-completions/") and after[key][1:] != before[key][1:]
    ]
    assert not rewritten, f"rewritten in place: {rewritten[:5]}"  # a shard is tokenized again, same bytes
    assert "deleting them" not in output and "0 to generate" in output
    assert not [p for p in store.rglob("*") if p.is_dir() and not any(p.iterdir())]  # no empty folders


def test_the_demo_ends_with_its_drafter_beside_the_free_floor_on_the_held_out_prompts(after_up: dict):
    """The demo's own summary, from the `drafter_evaluations` it materialised after training: τ of the
    drafter and of prompt lookup on the run's held-out prompts, and the stored evaluation they come from."""
    output = after_up["demo_output"]
    assert re.search(r"drafter_evaluations\s+held_out\s+ok ", output), output[-3000:]
    line = re.search(
        r"held-out prompts: τ (\d+\.\d{3}) for the drafter, (\d+\.\d{3}) for prompt lookup \(no training\): "
        r"(\d+\.\d{2})x, (above|BELOW) the free floor; (\d+)/(\d+) outputs equal the target's own \((.+)\)",
        output,
    )
    assert line, output[-3000:]
    tau, floor, ratio = (float(line.group(i)) for i in (1, 2, 3))
    assert line.group(4) == ("above" if tau >= floor else "BELOW")
    assert ratio == pytest.approx(tau / floor, abs=0.01)
    assert line.group(5) == line.group(6) == str(DEMO_EVALUATION["prompts"])  # lossless, every prompt
    stored = Path(line.group(7))
    assert stored == after_up["store"] / "evaluations" / "drafter" / "held_out" / "evaluation.json"
    record = json.loads(stored.read_text())
    assert (f"{record['tau']:.3f}", f"{record['floor_tau']:.3f}") == (line.group(1), line.group(2))
    # One τ for the demo's drafter: the trainer's last held-out figure is the evaluation's.
    trained = re.search(r"acceptance length τ (\d+\.\d{3}) \(the fresh drafter", output)
    assert trained and trained.group(1) == line.group(1), output[-3000:]


def test_dg_the_dagster_cli_and_the_ui_load_one_code_location_with_one_asset_graph(tmp_path: Path):
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    module = pyproject["tool"]["dagster"]["module_name"]
    assert pyproject["tool"]["dg"]["project"]["code_location_target_module"] == module
    assert f"module_name: {module}" in (REPO / "workspace.yaml").read_text()  # the UI's (scripts/ui.sh)
    assert f"-m {module} " in "\n".join(readme_shell_commands())

    env = _clean_environment(
        DFLASH_HOME=str(tmp_path),
        DFLASH_COMPLETIONS="target",
        DAGSTER_HOME=make_dagster_home(tmp_path / "dagster-home"),
    )
    binaries = Path(sys.executable).parent
    version = subprocess.run([str(binaries / "dg"), "--version"], capture_output=True, text=True, env=env)
    import dagster

    assert version.returncode == 0 and version.stdout.split()[-1] == dagster.__version__  # one release line
    listed = subprocess.run(
        [str(binaries / "dg"), "list", "defs", "--json"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    by_dg = {a["asset_key"]: sorted(a["dependency_keys"]) for a in json.loads(listed.stdout)["assets"]}
    probe = (
        f"import json\nfrom {module} import defs\n"
        "graph = defs.get_repository_def().asset_graph\n"
        "print(json.dumps({k.to_user_string(): sorted(p.to_user_string() for p in graph.get(k).parent_keys)"
        " for k in graph.get_all_asset_keys()}))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert by_dg == json.loads(loaded.stdout) and "target_completions" in by_dg
