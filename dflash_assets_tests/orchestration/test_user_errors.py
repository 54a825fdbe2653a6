"""A wrong setting, flag, path or URL is one line naming it and what to do: no traceback, a non-zero exit,
nothing created where the command ran. In-process for the `dflash-assets` commands (the checks read the
environment when a command starts); as processes where the line is what a shell shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_assets import cli
from dflash_assets.orchestration.user_errors import (
    DRAFTER_ARCHS,
    DRAFTER_LOSSES,
    DRAFTER_SHAPES,
    EXECUTORS,
    LR_SCHEDULES,
    check_settings,
    loaded_by_a_shell_command,
)
from dflash_assets.settings import ALL_SETTINGS, SettingError
from dflash_assets_tests.conftest import REPO, make_dagster_home, open_instance


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No DFLASH_* setting from outside, a private DFLASH_HOME, and an empty working directory."""
    for setting in ALL_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster-home"))
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    return workdir


CASES = [
    (["ranges"], {"DFLASH_SAMPLES_PER_PARTITION": "abc"}, "DFLASH_SAMPLES_PER_PARTITION"),
    (["plan"], {"DFLASH_SAMPLES_PER_PARTITION": "abc"}, "DFLASH_SAMPLES_PER_PARTITION"),
    (["ranges"], {"DFLASH_DATASET": "{tmp}/missing.jsonl"}, "DFLASH_DATASET"),
    (["plan"], {"DFLASH_DATASET": "{tmp}/missing.jsonl"}, "DFLASH_DATASET"),
    (["ranges"], {"DFLASH_HIDDEN_STATE_DTYPE": "fp16"}, "DFLASH_HIDDEN_STATE_DTYPE"),
    (["plan"], {"DFLASH_HIDDEN_STATE_DTYPE": "fp16"}, "DFLASH_HIDDEN_STATE_DTYPE"),
    (["plan", "--device", "V100"], {}, "--device"),
    (["ranges", "--device", "V100"], {}, "--device"),
    (["ranges"], {"DFLASH_DEVICES": "gpu0"}, "DFLASH_DEVICES"),
    (["ranges"], {"DFLASH_STORE_URL": "s3:/nobucket"}, "DFLASH_STORE_URL"),
    (["plan"], {"DFLASH_STORE_URL": "gs://bucket/prefix"}, "DFLASH_STORE_URL"),
    (["ranges"], {"DFLASH_COMPLETIONS": "targets"}, "DFLASH_COMPLETIONS"),
    (["ranges"], {"DFLASH_DATASET_FORMAT": "alpaca"}, "DFLASH_DATASET_FORMAT"),
    (["plan"], {"DFLASH_DATASET": "hf://models/someone/chats"}, "DFLASH_DATASET"),
    (["ranges"], {"DFLASH_DATASET": "sharegpt[5:2]"}, "DFLASH_DATASET: 'sharegpt[5:2]' is an empty slice"),
    (["ranges"], {"DFLASH_TARGET_LAYER_IDS": "1,x,3"}, "DFLASH_TARGET_LAYER_IDS"),
    (["reap"], {"DFLASH_EXECUTOR": "slurm"}, "DFLASH_EXECUTOR"),
    (["reap"], {"DFLASH_EXECUTOR": "celery"}, "DFLASH_CELERY_BROKER_URL"),
    (["demo", "--steps", "0"], {}, "--steps"),
    (["plan", "--sample-rows", "many"], {}, "--sample-rows"),
    (["plan", "--gpu-result", "{tmp}/no-such.json"], {}, "--gpu-result"),
    (["ranges"], {"DFLASH_GIT_URL": "https://git.example.com/ml/dflash-assets"}, "DFLASH_GIT_URL"),
]


@pytest.mark.parametrize(("argv", "env", "named"), CASES, ids=[f"{c[0][0]}-{c[2]}" for c in CASES])
def test_a_wrong_setting_or_flag_is_one_line_naming_it_with_a_non_zero_exit_and_nothing_created(
    argv, env, named, clean_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
):
    tmp = str(clean_env.parent)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(tmp=tmp))
    try:
        status = cli.main([a.format(tmp=tmp) for a in argv])
    except SystemExit as exit_:  # argparse's own refusals
        status = exit_.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status not in (0, None)
    assert len(lines) == 1 and named in lines[0], err  # before any slow work: nothing else was printed
    assert "Traceback" not in err
    assert list(clean_env.iterdir()) == []
    assert not (clean_env.parent / "home").exists()  # nothing was set up elsewhere either


def test_the_defaults_and_every_documented_choice_pass_the_checks(clean_env: Path, monkeypatch):
    check_settings()
    from dflash_assets.drafter.config import DRAFTER_SHAPES as CORE_SHAPES

    assert set(DRAFTER_SHAPES) == {"auto", *CORE_SHAPES, "target"}
    from dflash_assets.drafter.config import ARCHITECTURES
    from dflash_assets.drafter.objective import LOSSES

    assert set(DRAFTER_ARCHS) == set(ARCHITECTURES) and set(DRAFTER_LOSSES) == set(LOSSES)
    from dflash_assets.training.settings import LR_SCHEDULES as CORE_SCHEDULES

    assert set(LR_SCHEDULES) == set(CORE_SCHEDULES)
    from dflash_assets.orchestration.execution.executor import code_location_executor

    monkeypatch.setenv("DFLASH_CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
    for executor in EXECUTORS:
        monkeypatch.setenv("DFLASH_EXECUTOR", executor)
        check_settings()
        code_location_executor()  # each one the checks let through is one the code location builds


def test_every_dataset_source_and_layout_the_manual_documents_passes_the_checks(clean_env: Path, monkeypatch):
    sources = ["bundled", "data/chats", "data/train-*.parquet", "s3://bucket/chats/", "s3://bucket/a.jsonl"]
    sources += ["data/chats.json", "sharegpt", "sharegpt[0:17000]", "sharegpt[17000:]"]
    sources += ["hf://datasets/someone/chats", "hf://datasets/someone/chats@v1/data/*.parquet"]
    for dataset in sources:
        monkeypatch.setenv("DFLASH_DATASET", dataset)
        for layout in ("auto", "messages", "sharegpt"):
            monkeypatch.setenv("DFLASH_DATASET_FORMAT", layout)
            check_settings()


def test_a_repository_url_with_credentials_is_refused_without_echoing_them(clean_env: Path, monkeypatch):
    monkeypatch.setenv("DFLASH_GIT_URL", "https://oauth2:glpat-not-for-logs@gitlab.com/ml/dflash-assets")
    with pytest.raises(SettingError) as error:
        check_settings()
    assert "DFLASH_GIT_URL must not carry credentials" in str(error.value)
    assert "glpat-not-for-logs" not in str(error.value)


def test_every_bad_value_is_named_in_the_one_message(clean_env: Path, monkeypatch):
    monkeypatch.setenv("DFLASH_MAX_LENGTH", "0")
    monkeypatch.setenv("DFLASH_TRAIN_MODE", "offlin")
    monkeypatch.setenv("DFLASH_RUN_NAME", "a/b")
    with pytest.raises(SettingError) as error:
        check_settings()
    message = str(error.value)
    assert all(name in message for name in ("DFLASH_MAX_LENGTH", "DFLASH_TRAIN_MODE", "DFLASH_RUN_NAME"))
    assert "\n" not in message


def _shell(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_console_script_prints_a_store_url_typo_as_one_line_and_creates_nothing(clean_env: Path):
    env = {**os.environ, "DFLASH_STORE_URL": "s3:/nobucket"}
    done = _shell([str(Path(sys.executable).with_name("dflash-assets")), "ranges"], env, clean_env)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "dflash-assets ranges: DFLASH_STORE_URL='s3:/nobucket' is not a well-formed s3:// URL: write "
        "s3://<bucket>/<prefix>"
    ]
    assert list(clean_env.iterdir()) == []


def test_dagster_and_dg_commands_end_with_one_line_for_a_bad_setting_key_or_asset_selection(clean_env: Path):
    make_dagster_home(Path(os.environ["DAGSTER_HOME"]))
    binaries = Path(sys.executable).parent
    materialize = [str(binaries / "dagster"), "asset", "materialize", "-m", "dflash_assets.definitions"]
    launch = [str(binaries / "dg"), "launch"]  # run where the project is, as a user would
    cases = [
        # Met while the code location loads.
        (materialize + ["--select", "tokenized_completions"], "00000000-00000099",
         {"DFLASH_HIDDEN_STATE_DTYPE": "fp16"}, "DFLASH_HIDDEN_STATE_DTYPE"),
        # A range past the bundled data's 500 rows: refused, and not registered.
        (materialize + ["--select", "tokenized_completions"], "00000900-00000999", {}, "its last range is"),
        (launch + ["--assets", "tokenized_completions"], "00000900-00000999", {}, "its last range is"),
    ]  # fmt: skip
    for args, key, extra, named in cases:
        cwd = REPO if args[0].endswith("dg") else clean_env
        done = _shell([*args, "--partition", key], {**os.environ, **extra}, cwd)
        ours = [line for line in done.stderr.splitlines() if line.startswith("dflash-assets:")]
        assert done.returncode != 0
        assert len(ours) == 1 and named in ours[0], done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert list(clean_env.iterdir()) == []
    with open_instance(os.environ["DAGSTER_HOME"]) as instance:
        assert "00000900-00000999" not in instance.get_dynamic_partitions("sample_ranges")


def _loaded_under(*words: str) -> bool:
    """`loaded_by_a_shell_command` while the command `words` (program first) runs, as click runs it."""
    import click

    context = None
    for word in words:
        context = click.Context(click.Group(word), info_name=word, parent=context)
    with context:
        return loaded_by_a_shell_command()


def test_the_one_line_hook_is_for_commands_typed_at_a_shell_not_servers_workers_or_imports():
    # Where the code location's error would end a command a person typed: one line.
    assert _loaded_under("dagster", "asset", "materialize")
    assert _loaded_under("python -m dagster", "job", "execute")
    assert _loaded_under("dg", "launch")
    # Long-lived processes, launched runs and steps, and commands that report a failed load themselves
    # keep their own hook (the excepthook is process-wide).
    for command in [
        ("dagster", "api", "grpc"),
        ("dagster", "code-server", "start"),
        ("dagster", "api", "execute_run"),
        ("dagster", "api", "execute_step"),
        ("dagster", "dev"),
        ("dagster-daemon", "run"),
        ("dagster-webserver",),
        ("dagster", "definitions", "validate"),
        ("dg", "check", "defs"),
        ("dg", "list", "defs"),
    ]:
        assert not _loaded_under(*command), command
    assert not loaded_by_a_shell_command()  # an import from Python, as here
