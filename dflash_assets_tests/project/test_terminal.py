"""Live progress on a terminal: one steady status line with done/total, rate and ETA, other output
scrolling above it whole; and when the output is not a terminal, nothing drawn, only a plain line now
and then for a task that runs long (CI logs stay short)."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from dflash_assets import terminal
from dflash_assets.terminal import LiveProgress, ProgressSnapshot, status_line

CLEAR = "\r\x1b[2K"

# A command as `dflash-assets demo` runs: reports from its own code, its own prints, and a child
# process writing to the inherited stdout/stderr (as Dagster's compute-log `tail` does).
SCRIPT = textwrap.dedent(
    """
    import subprocess, sys, time
    from dflash_assets import terminal

    with terminal.live_progress():
        for step in range(1, 21):
            loss = f"loss {9 - step * 0.25:.2f}"
            terminal.report(terminal.ProgressSnapshot(
                "training run demo", done=step, total=20, unit="steps", rate=8.0, status=loss
            ))
            if step % 5 == 0:
                print(f"step {step} on stdout")
                subprocess.run([sys.executable, "-c", "print('a child process line')"])
                print("a line on stderr", file=sys.stderr)
            time.sleep(0.04)
        terminal.finish("training run demo")
        terminal.report(terminal.ProgressSnapshot("a task still running when the block ends", 1, 2))
        print("the last words, without a newline", end="", flush=True)
    print()
    print("after the block")
    """
)


def run_in_a_terminal(script: str) -> str:
    """Run `script` with stdout and stderr on a pseudo-terminal; everything it drew, as text."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # 24 rows of 120 columns
    env = {name: value for name, value in os.environ.items() if name not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm"
    process = subprocess.Popen([sys.executable, "-c", script], stdout=child, stderr=child, env=env)
    os.close(child)
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child side closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=60) == 0
    os.close(main)
    return b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")


def screen(drawn: str) -> list[str]:
    """The lines a terminal holds after showing `drawn` (scrolled-off ones included): text, carriage
    returns, newlines (the pty's CR LF read as one), erasing a line and moving up are applied; colours
    and the cursor's visibility change nothing on the screen."""
    lines, row, col = [""], 0, 0
    for token in re.findall(r"\x1b\[[0-9;?]*[A-Za-z]|\r|\n|[^\x1b\r\n]+", drawn):
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif token.endswith("K"):  # erase in line: 2 the whole line, else from the cursor on
            lines[row] = "" if token == "\x1b[2K" else lines[row][:col]
        elif token.endswith("A"):  # cursor up
            row = max(0, row - int(token[2:-1] or 1))
        elif not token.startswith("\x1b"):
            text = lines[row].ljust(col)
            lines[row] = text[:col] + token + text[col + len(token) :]
            col += len(token)
    return lines


def without_colours(drawn: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", drawn)


def test_a_terminal_shows_a_steady_status_line_and_output_scrolls_above_it_whole() -> None:
    drawn = run_in_a_terminal(SCRIPT)
    status = [part for part in without_colours(drawn).split(CLEAR) if part.startswith("training run demo")]
    assert any("25% 5/20 steps · 8.00 steps/s · ETA 2s · loss 7.75" in line for line in status)
    assert any("100% 20/20 steps · 8.00 steps/s · done · loss 4.00" in line for line in status)
    assert all("━" in line for line in status)  # the bar
    assert all("\n" not in line for line in status)  # redrawn in place, never a new line of its own
    # What stays on the terminal is the output alone, every line whole and in order, never glued to the
    # status line, which is gone at the end.
    each_fifth_step = ["step {} on stdout", "a child process line", "a line on stderr"]
    output = [line.format(step) for step in (5, 10, 15, 20) for line in each_fifth_step]
    last = ["the last words, without a newline", "after the block"]
    assert [line for line in screen(drawn) if line.strip()] == [*output, *last]


def test_without_a_terminal_nothing_is_drawn_and_the_output_is_untouched() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "\x1b" not in done.stdout + done.stderr and "\r" not in done.stdout + done.stderr
    assert "steps" not in done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        line for step in (5, 10, 15, 20) for line in (f"step {step} on stdout", "a child process line")
    ] + ["the last words, without a newline", "after the block"]
    assert done.stderr.splitlines() == ["a line on stderr"] * 4


# A log, not a terminal: a long task now and then, a short one never, and fd 2 taken by a step's
# compute-log capture half-way (as Dagster does) does not swallow the lines.
PLAIN_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from dflash_assets import terminal

    started = time.monotonic()
    with terminal.live_progress(plain_every_s=0.3):
        terminal.report(terminal.ProgressSnapshot("a short task", done=1, total=2, unit="steps"))
        terminal.finish("a short task")
        for step in range(1, 41):
            if step == 10:
                sys.stderr.flush()
                os.dup2(os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT), 2)
            terminal.report(terminal.ProgressSnapshot(
                "training run demo", done=step, total=40, unit="steps", rate=25.0, status=f"loss {step}"
            ))
            time.sleep(0.04)
        terminal.finish("training run demo")
    print(f"after the block {time.monotonic() - started:.3f}")
    """
)


def test_without_a_terminal_a_long_task_says_where_it_is_every_so_often_on_plain_lines(tmp_path) -> None:
    captured = tmp_path / "compute-log"
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_SCRIPT, str(captured)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("after the block ")
    elapsed = float(done.stdout.split()[-1])
    lines = done.stderr.splitlines()
    # At least 1.6 s of steps, a line every 0.3 s at most and none in the first 0.3 s, in order.
    assert 2 <= len(lines) <= elapsed / 0.3, (elapsed, lines)
    assert all(
        re.fullmatch(r"training run demo  \d+% \d+/40 steps · 25\.0 steps/s · (ETA \d+s|done) · loss \d+", x)
        for x in lines
    ), lines
    steps = [int(line.split("/40")[0].split()[-1]) for line in lines]
    assert steps == sorted(steps) and steps[0] >= 5 and max(steps) > 10  # some after fd 2 was taken
    assert "short" not in done.stderr + captured.read_text()
    assert "\x1b" not in done.stderr and "\r" not in done.stderr


def test_the_figures_say_done_of_total_rate_and_eta_or_what_is_known() -> None:
    snapshot = ProgressSnapshot("hidden_state_partitions 00000000-00000099", 42, 100, "samples", 3.5)
    assert snapshot.figures() == "42% 42/100 samples · 3.50 samples/s · ETA 17s"
    assert ProgressSnapshot("x", 1234, 2934, "samples", 23.14, eta_s=725).figures() == (
        "42% 1,234/2,934 samples · 23.1 samples/s · ETA 12m05s"
    )
    assert ProgressSnapshot("x", 7, None, "rows").figures() == "7 rows"
    slow = ProgressSnapshot("x", 1, 4, "steps", 1 / 312)
    assert slow.figures() == "25% 1/4 steps · 312 s/step · ETA 15m36s"
    assert ProgressSnapshot("x", status="loading the target model on cpu").figures() == (
        "loading the target model on cpu"
    )
    assert ProgressSnapshot("x", 0, 10, "steps", status="waiting for a device").figures() == (
        "0% 0/10 steps · waiting for a device"
    )
    line = drawn(snapshot, width=120)
    assert line.startswith("hidden_state_partitions 00000000-00000099  ━") and len(line) <= 120
    assert line.count("━") == 10  # 42 % of the bar's 24 cells
    assert line.endswith(" 42% 42/100 samples · 3.50 samples/s · ETA 17s")
    ascii_line = drawn(snapshot, width=120, encoding="ascii")  # an ASCII terminal gets an ASCII bar
    assert ascii_line.startswith("hidden_state_partitions 00000000-00000099  ---------- ")
    narrow = drawn(snapshot, width=60)  # no room for a bar: the figures, cut to the width
    assert narrow.startswith("hidden_state_partitions 00000000-00000099  42% 42/100")
    assert "━" not in narrow and len(narrow) == 60 and narrow.endswith("…")


def drawn(snapshot: ProgressSnapshot, width: int, encoding: str = "utf-8") -> str:
    """The status line a terminal of `width` columns and `encoding` shows for `snapshot`, rendered the
    way rich's `Live` renders it (colours left out)."""
    console = Console(file=io.TextIOWrapper(io.BytesIO(), encoding=encoding), width=width, color_system=None)
    lines = console.render_lines(status_line(snapshot, width), console.options, pad=False)
    assert len(lines) == 1, lines  # one line, never wrapped
    return "".join(segment.text for segment in lines[0])


def test_the_newest_task_is_shown_and_a_finished_one_goes_away(tmp_path: Path) -> None:
    main, child = pty.openpty()
    live = LiveProgress(fd=child, capture_output=False)
    try:
        live.report(ProgressSnapshot("extraction 00000000-00000099", 10, 100, "samples"))
        live.report(ProgressSnapshot("training demo", 3, 6, "steps"))
        assert live.shown().task == "[+1] training demo"
        live.finish("training demo")
        assert live.shown().task == "extraction 00000000-00000099"
        live.finish("extraction 00000000-00000099")
        assert live.shown() is None
    finally:
        live.close()
        os.close(main)
        os.close(child)


@pytest.mark.slow  # several seconds of CPU: the full suite's, not the quick loop's
def test_training_draws_every_step_with_its_loss_on_the_status_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from dflash_assets.storage.open_store import open_store
    from dflash_assets.training.data import OnlineData
    from dflash_assets.training.settings import TrainSettings
    from dflash_assets.training.train import DrafterTrainer, train_drafter
    from dflash_assets_tests.support.drafter_fixtures import (
        build_tiny_target,
        counting_samples,
        load_capture,
        tiny_drafter_config,
    )

    target_dir = build_tiny_target(tmp_path / "target")
    # The evaluation of the untrained weights takes a while before the first step (with a real target,
    # tens of seconds): the rate and ETA count the steps, not that wait.
    evaluate, evaluations = DrafterTrainer.evaluate, []

    def slow_first_evaluation(self):
        if not evaluations:
            time.sleep(3.0)
        evaluations.append(self.step)
        return evaluate(self)

    monkeypatch.setattr(DrafterTrainer, "evaluate", slow_first_evaluation)
    main, child = pty.openpty()
    drawn: list[bytes] = []
    reader = threading.Thread(target=lambda: _drain(main, drawn), daemon=True)
    reader.start()
    live = LiveProgress(fd=child, capture_output=False, refresh_s=0.01).start()
    monkeypatch.setattr(terminal, "_current", live)  # what live_progress() sets, on this terminal
    snapshots: list[ProgressSnapshot] = []
    settings = TrainSettings(
        mode="online", max_steps=5, global_batch_size=4, num_anchors=8, eval_samples=2, spec_eval_prompts=0,
        log_every_steps=1, checkpoint_every_minutes=None,
    )  # fmt: skip
    try:
        train_drafter(
            tiny_drafter_config(target_dir), settings,
            OnlineData(counting_samples(10), load_capture(target_dir)),
            store=open_store(str(tmp_path / "store")), run="live", work_dir=tmp_path / "w",
            on_progress=snapshots.append,
        )  # fmt: skip
        time.sleep(0.1)
    finally:
        live.close()
        os.close(child)
        reader.join(timeout=5)
        os.close(main)

    steps = [s.done for s in snapshots if s.status.startswith("epoch")]
    assert steps == [1, 2, 3, 4, 5] and {s.total for s in snapshots} == {5}
    first = next(s for s in snapshots if s.status.startswith("epoch"))
    assert evaluations[0] == 0 and first.rate > 1 / 2.5, first  # 1 step in well under the 3 s wait
    assert all(s.task == "training live" and s.unit == "steps" for s in snapshots)
    assert any(s.status.startswith("evaluating 2 held-out samples") for s in snapshots)
    text = b"".join(drawn).decode("utf-8", "replace").replace("\r\n", "\n")
    rate = r"(?:[\d.,]+ steps/s|[\d.,]+ s/step)"  # a loaded machine may be slow
    figures = rf"\d+% [1-5]/5 steps · {rate} · ETA \S+ · epoch \d/\d · loss \d"
    assert re.search(f"training live .*{figures}", without_colours(text))
    assert not "".join(screen(text)).strip()  # closing clears the line


def _drain(fd: int, into: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            return
        if not chunk:
            return
        into.append(chunk)
