"""Live progress on the terminal: one steady status line (bar, done/total, rate, ETA, status) drawn by
`rich` from the same progress snapshots the Dagster UI gets, with every other line of output scrolling
above it.

Leaf module: no Dagster, no torch, nothing of this package but the unit formatting, so every stage
(extraction, training, the benchmark, regeneration) can report from its core code.

Producers, anywhere in a process, report snapshots; they cost a dict update and do nothing unless a
command has turned the terminal on::

    from dflash_assets import terminal

    terminal.report(terminal.ProgressSnapshot(
        task="target_completions 00000000-00009999",   # one line per task; the newest one is shown
        done=1234, total=10000, unit="samples",
        rate=23.1,                                     # units per second; None: not known yet
        eta_s=380.0,                                   # None: unknown; omitted: derived from rate
        status="waiting for the server",               # short free text after the figures
    ))
    terminal.finish("target_completions 00000000-00009999")   # its line goes away

or, for a loop over known units, let `TaskProgress` keep the count, rate and ETA::

    progress = terminal.TaskProgress("bench extraction", total=20, unit="measurements")
    for ...:
        progress.advance(status="round 2/5: capture")
    progress.finish()

A command turns it on around its work (`dflash-assets demo` and `bench` do)::

    with terminal.live_progress():
        ...   # reports draw the status line; print() and child processes' output scroll above it

When stderr is not a terminal (CI logs, pipes, files, `TERM=dumb`), `live_progress` draws nothing and
redirects nothing: a task that has run for `PLAIN_EVERY_S` since its first report, or since its last
such line, gets one plain line on stderr (`training run demo  42% 101/240 steps · 1.93 steps/s · ...`),
so a long step is not silent and a short one adds nothing to the log.

On a terminal, rich's `Live` draws the line on a duplicate of the terminal's descriptor, taken before
anything else can redirect fd 2 (Dagster's compute-log capture does, per step). Rich moves only what
goes through its own console above the line, and child processes write to fds 1 and 2 directly, so
this process's stdout/stderr (those that are the terminal) are routed through a pipe whose lines are
printed through that console: a log line never lands in the middle of the bar.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dflash_assets.storage.units import human_duration

if TYPE_CHECKING:
    from rich.console import RenderableType

REFRESH_S = 0.25  # redraw interval: smooth enough for a person, nothing for the CPU
PLAIN_EVERY_S = 30.0  # without a terminal: one line per running task this often
BAR_CELLS = 24  # the bar's width when the line has room; below MIN_BAR_CELLS the figures take it all
MIN_BAR_CELLS = 10


@dataclass(frozen=True)
class ProgressSnapshot:
    """One task's progress at a moment: what the status line shows for it."""

    task: str  # what is running, e.g. "hidden_state_partitions 00000000-00000099", "training run demo"
    done: float = 0
    total: float | None = None  # None: open-ended (done and rate only)
    unit: str = "it"  # samples, steps, tokens, rounds...
    rate: float | None = None  # units per second
    eta_s: float | None = None  # seconds left; None: derived from rate when both are known
    status: str = ""  # short free text: "loss 6.77", "waiting for a device", "evaluating"

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return max(0.0, min(1.0, self.done / self.total))

    @property
    def eta(self) -> float | None:
        if self.eta_s is not None:
            return self.eta_s
        if self.total is not None and self.rate:
            return max(0.0, (self.total - self.done) / self.rate)
        return None

    def figures(self) -> str:
        """`42% 101/240 steps · 1.93 steps/s · ETA 1m12s · loss 6.77` (what follows the bar)."""
        count = _number(self.done) + (f"/{_number(self.total)}" if self.total is not None else "")
        fraction = self.fraction
        parts = [f"{fraction:.0%} {count} {self.unit}" if fraction is not None else f"{count} {self.unit}"]
        if self.total is None and not self.done and self.rate is None:
            parts = []  # a state, not a count yet ("loading the target model")
        if self.rate is not None and self.rate >= 0.1:
            parts.append(f"{_rate(self.rate)} {self.unit}/s")
        elif self.rate:  # slow units read better the other way round: "42 s/step"
            parts.append(f"{_rate(1 / self.rate)} s/{self.unit.removesuffix('s')}")
        eta = self.eta
        if fraction is not None and fraction >= 1.0:
            parts.append("done")
        elif eta is not None:
            parts.append(f"ETA {human_duration(eta)}")
        if self.status:
            parts.append(self.status)
        return " · ".join(parts)


def _number(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,.1f}"


def _rate(rate: float) -> str:
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}" if rate >= 10 else f"{rate:.2f}"


# --------------------------------------------------------------------------------------------------
# The process's status line
# --------------------------------------------------------------------------------------------------


def status_line(snapshot: ProgressSnapshot, width: int) -> RenderableType:
    """What the status line shows for `snapshot` in `width` columns: the task, a bar when the total is
    known and the figures leave room for one, then the figures; cut with "…" when even those do not fit.
    """
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    figures = snapshot.figures()
    room = width - len(snapshot.task) - len(figures) - 4  # two spaces after the task, one before figures
    if snapshot.fraction is None or room < MIN_BAR_CELLS:
        return Text(f"{snapshot.task}  {figures}", no_wrap=True, overflow="ellipsis")
    line = Table.grid(padding=(0, 1))
    line.add_column(no_wrap=True)
    line.add_column(no_wrap=True)
    line.add_column(no_wrap=True)
    bar = ProgressBar(total=snapshot.total, completed=snapshot.done, width=min(BAR_CELLS, room))
    line.add_row(Text(snapshot.task + " "), bar, Text(figures))
    return line


class LiveProgress:
    """Draws the newest snapshot of the tasks still running as one line at the bottom of a terminal.

    Made by `live_progress()`. When `fd` is not a terminal it draws nothing and captures nothing; it
    writes a plain line per task every `plain_every_s` instead (None: nothing at all).
    """

    def __init__(
        self,
        fd: int = 2,
        *,
        capture_output: bool = True,
        refresh_s: float = REFRESH_S,
        plain_every_s: float | None = PLAIN_EVERY_S,
    ) -> None:
        self.active = _is_terminal(fd)
        self.plain_every_s = plain_every_s
        self._lock = threading.Lock()  # never held while calling rich, whose refresh thread takes it
        self._tasks: dict[str, tuple[float, ProgressSnapshot]] = {}  # task -> (reported at, snapshot)
        self._plain: dict[str, float] = {}  # task -> when it was first reported or last written
        self._plain_out = None
        self._capture: _OutputCapture | None = None
        encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
        if not self.active:
            if plain_every_s is not None:
                # Our own handle on the log, as below on a terminal: Dagster's per-step capture of
                # fd 2 would otherwise take the lines into a compute log only.
                with contextlib.suppress(OSError):
                    self._plain_out = os.fdopen(os.dup(fd), "w", encoding=encoding, errors="replace")
            return
        from rich.console import Console
        from rich.live import Live

        # Our own handle on the terminal: later redirections of fd 2 (compute-log capture) do not move it.
        self._tty = os.fdopen(os.dup(fd), "w", encoding=encoding, errors="replace")
        self._console = Console(file=self._tty, force_terminal=True, force_interactive=True, highlight=False)
        self._live = Live(
            console=self._console,
            get_renderable=self._render,
            refresh_per_second=1 / refresh_s,
            transient=True,  # the line goes away at the end; the output above it stays
            redirect_stdout=False,  # fds 1 and 2 are captured below, child processes included
            redirect_stderr=False,
        )
        if capture_output:
            self._capture = _OutputCapture([f for f in (1, 2) if _same_terminal(f, fd)], self.write_line)

    # -- reporting (thread-safe)

    def report(self, snapshot: ProgressSnapshot) -> None:
        if not self.active:
            self._report_plain(snapshot)
            return
        with self._lock:
            self._tasks[snapshot.task] = (time.monotonic(), snapshot)

    def _report_plain(self, snapshot: ProgressSnapshot) -> None:
        if self._plain_out is None:  # a terminal, or plain lines turned off
            return
        now = time.monotonic()
        with self._lock:
            since = self._plain.setdefault(snapshot.task, now)
            if now - since < self.plain_every_s:
                return
            self._plain[snapshot.task] = now
            with contextlib.suppress(OSError, ValueError):
                self._plain_out.write(f"{snapshot.task}  {snapshot.figures()}\n")
                self._plain_out.flush()

    def finish(self, task: str) -> None:
        with self._lock:
            self._plain.pop(task, None)
            self._tasks.pop(task, None)

    def write_line(self, text: str) -> None:
        """A line of output above the status line (what captured stdout/stderr lines become)."""
        if not self.active:
            sys.stderr.write(text.rstrip("\n") + "\n")
            return
        from rich.text import Text

        # Colours a child process wrote are kept; soft wrap: the terminal wraps a long line, rich not.
        self._console.print(Text.from_ansi(text.rstrip("\n")), soft_wrap=True)
        self._live.refresh()  # the line below the output shows the newest figures at once

    # -- drawing

    def shown(self) -> ProgressSnapshot | None:
        """The snapshot the status line shows now: the newest task's, with how many others run (None
        when no task is running)."""
        with self._lock:
            if not self._tasks:
                return None
            newest = max(self._tasks.values(), key=lambda item: item[0])[1]
            others = len(self._tasks) - 1
        return replace(newest, task=f"[+{others}] {newest.task}") if others else newest

    def _render(self) -> RenderableType:
        """Called by rich at each refresh."""
        from rich.console import Group

        # Rich measures fds 0-2, which may be our pipe now: the line is as wide as our own terminal, less
        # its last column (a line that fills it would leave the cursor waiting to wrap).
        self._console.width = max(20, _terminal_width(self._tty.fileno()) - 1)
        snapshot = self.shown()
        return Group() if snapshot is None else status_line(snapshot, self._console.width)

    # -- lifetime

    def start(self) -> LiveProgress:
        if self.active and not self._live.is_started:
            self._live.start()
            if self._capture is not None:
                self._capture.start()
        return self

    def close(self) -> None:
        if not self.active:
            with self._lock:
                if self._plain_out is not None:
                    with contextlib.suppress(OSError):
                        self._plain_out.close()
                    self._plain_out = None
            return
        if self._capture is not None:
            self._capture.close()  # every captured line is printed above the line before it goes
        self.active = False  # from now on, write_line goes to stderr
        self._live.stop()  # transient: the line is cleared, the cursor shown again
        self._tty.close()


class _OutputCapture:
    """Routes fds 1 and 2 (those that are the terminal) through a pipe and hands each line that comes
    out to `write_line`, so output of this process and of its child processes scrolls above the line."""

    def __init__(self, fds: list[int], write_line: Callable[[str], None]) -> None:
        self._fds = fds
        self._write_line = write_line
        self._saved: dict[int, int] = {}  # redirected fd -> a duplicate of what it was
        self._pipe_read: int | None = None
        self._pending = b""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the reader (on an error) and close() may both give fds back

    def start(self) -> None:
        if not self._fds:
            return
        _flush_std_streams()
        read_end, write_end = os.pipe()
        for fd in self._fds:
            self._saved[fd] = os.dup(fd)
            os.dup2(write_end, fd)
        os.close(write_end)
        self._pipe_read = read_end
        self._thread = threading.Thread(target=self._run, name="terminal-output", daemon=True)
        self._thread.start()

    def _release(self) -> None:
        """Give stdout/stderr back to the terminal."""
        _flush_std_streams()  # outside the lock: a full pipe drains only through the reader
        with self._lock:
            for fd, saved in self._saved.items():
                os.dup2(saved, fd)
                os.close(saved)
            self._saved.clear()

    def _run(self) -> None:
        assert self._pipe_read is not None
        try:
            while chunk := os.read(self._pipe_read, 65536):  # b"" once no writer is left
                self._pending += chunk
                *lines, self._pending = self._pending.split(b"\n")
                for raw in lines:
                    # A carriage-return redraw (another program's progress bar) keeps its last state only.
                    parts = raw.decode("utf-8", "replace").split("\r")
                    self._write_line(next((part for part in reversed(parts) if part.strip()), ""))
        except BaseException:
            # Never leave writers blocked on a pipe nobody reads: give the terminal back first.
            self._release()
            raise

    def close(self) -> None:
        if self._thread is None:
            return
        self._release()  # our write ends close: the reader sees the end of the pipe once child processes exit
        self._thread.join(timeout=2.0)  # a child still holding the pipe must not hang the command
        if self._thread.is_alive():
            return  # the reader goes on until that child exits; what it reads then goes to stderr
        if self._pending:  # a last line without its newline
            self._write_line(self._pending.decode("utf-8", "replace"))
            self._pending = b""
        assert self._pipe_read is not None
        os.close(self._pipe_read)
        self._pipe_read = self._thread = None


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


class TaskProgress:
    """Counts the units of one task and reports a snapshot at each step, with the rate and ETA measured
    since it began (for producers that have no snapshots of their own)."""

    def __init__(self, task: str, total: float | None, unit: str = "it", done: float = 0) -> None:
        self.task, self.total, self.unit, self.done = task, total, unit, done
        self._started, self._start_done = time.monotonic(), done
        self.status = ""
        self._report()

    @property
    def rate(self) -> float | None:
        elapsed = time.monotonic() - self._started
        done = self.done - self._start_done
        return done / elapsed if done > 0 and elapsed > 0 else None

    def snapshot(self) -> ProgressSnapshot:
        return ProgressSnapshot(self.task, self.done, self.total, self.unit, self.rate, status=self.status)

    def advance(self, count: float = 1, status: str | None = None) -> None:
        self.done += count
        if status is not None:
            self.status = status
        self._report()

    def set_status(self, status: str) -> None:
        self.status = status
        self._report()

    def _report(self) -> None:
        report(self.snapshot())

    def finish(self) -> None:
        finish(self.task)


_current: LiveProgress | None = None
_current_lock = threading.Lock()


def report(snapshot: ProgressSnapshot) -> None:
    """Show `snapshot` on the status line, if a command turned the terminal on; otherwise nothing."""
    live = _current
    if live is not None:
        live.report(snapshot)


def finish(task: str) -> None:
    """Take `task` off the status line (it ended, or its own summary line says the rest)."""
    live = _current
    if live is not None:
        live.finish(task)


@contextlib.contextmanager
def live_progress(
    *, capture_output: bool = True, plain_every_s: float | None = PLAIN_EVERY_S
) -> Iterator[LiveProgress]:
    """Draw reported progress on the terminal for the duration of the block (see the module docstring).
    Nested uses share the outer line."""
    global _current
    with _current_lock:
        outer = _current
        if outer is not None:
            live = outer
        else:
            live = LiveProgress(capture_output=capture_output, plain_every_s=plain_every_s).start()
            _current = live
    try:
        yield live
    finally:
        if outer is None:
            with _current_lock:
                _current = None
            live.close()


def _is_terminal(fd: int) -> bool:
    if os.environ.get("TERM") == "dumb" or os.name == "nt":
        return False
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _same_terminal(fd: int, terminal_fd: int) -> bool:
    """True when `fd` is the very terminal `terminal_fd` is (a redirected stdout is left alone)."""
    try:
        if not os.isatty(fd):
            return False
        a, b = os.fstat(fd), os.fstat(terminal_fd)
    except OSError:
        return False
    return (a.st_rdev, a.st_ino) == (b.st_rdev, b.st_ino)


def _terminal_width(fd: int) -> int:
    """Columns of the terminal on `fd`: `COLUMNS` when set, else the terminal's own (100 when it says 0)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    try:
        return os.get_terminal_size(fd).columns or 100
    except OSError:
        return 100
