"""Live progress on the terminal: one steady status line (bar, done/total, rate, ETA, status) redrawn
from the same progress snapshots the Dagster UI gets, with every other line of output scrolling above it.

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
so a long step is not silent and a short one adds nothing to the log. On a terminal it
takes a duplicate of the terminal's descriptor before anything else can redirect fd 2 (Dagster's
compute-log capture does, per step), and routes this process's stdout/stderr (those that are the
terminal) through a pipe it reads, so a log line never lands in the middle of the bar.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from dflash_assets.storage.units import human_duration

REFRESH_S = 0.25  # redraw interval: smooth enough for a person, nothing for the CPU
PLAIN_EVERY_S = 30.0  # without a terminal: one line per running task this often
_CLEAR_LINE = "\r\x1b[2K"


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

    def line(self, width: int, unicode: bool = True) -> str:
        """The status line, at most `width` characters: task, bar (when the total is known), figures."""
        text = self.figures()
        fraction = self.fraction
        room = width - len(self.task) - 3 - len(text) - 1  # what the figures leave for a bar
        cells = min(24, room) if fraction is not None and room >= 10 else 0  # the figures come first
        if cells:
            filled = int(round(fraction * cells))
            full, empty = ("█", "░") if unicode else ("#", "-")
            text = f"{full * filled}{empty * (cells - filled)} {text}"
        line = f"{self.task}  {text}"
        return line if len(line) < width else line[: max(0, width - 2)] + "…"


def _number(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{int(value):,}" if float(value).is_integer() else f"{value:,.1f}"


def _rate(rate: float) -> str:
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.1f}" if rate >= 10 else f"{rate:.2f}"


# --------------------------------------------------------------------------------------------------
# The process's status line
# --------------------------------------------------------------------------------------------------


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
        self.refresh_s = refresh_s
        self.plain_every_s = plain_every_s
        self._plain: dict[str, float] = {}  # task -> when it was first reported or last written
        self._plain_out = None
        self._lock = threading.RLock()
        self._tasks: dict[str, tuple[float, ProgressSnapshot]] = {}  # task -> (reported at, snapshot)
        self._drawn = ""
        self._dirty = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._saved: dict[int, int] = {}  # redirected fd -> a duplicate of what it was
        self._pipe_read: int | None = None
        self._pending = b""
        encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
        self._unicode = "utf" in encoding.lower()
        if not self.active:
            if plain_every_s is not None:
                # Our own handle on the log, as below on a terminal: Dagster's per-step capture of
                # fd 2 would otherwise take the lines into a compute log only.
                with contextlib.suppress(OSError):
                    self._plain_out = os.fdopen(os.dup(fd), "w", encoding=encoding, errors="replace")
            return
        # Our own handle on the terminal: later redirections of fd 2 (compute-log capture) do not move it.
        self._tty = os.fdopen(os.dup(fd), "w", encoding=encoding, errors="replace")
        if capture_output:
            self._capture([f for f in (1, 2) if _same_terminal(f, fd)])

    # -- reporting (thread-safe)

    def report(self, snapshot: ProgressSnapshot) -> None:
        if not self.active:
            self._report_plain(snapshot)
            return
        with self._lock:
            self._tasks[snapshot.task] = (time.monotonic(), snapshot)
            self._dirty = True

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
        if not self.active:
            with self._lock:
                self._plain.pop(task, None)
            return
        with self._lock:
            if self._tasks.pop(task, None) is not None:
                self._dirty = True

    def write_line(self, text: str) -> None:
        """A line of output above the status line (what captured stdout/stderr lines become)."""
        with self._lock:
            if not self.active:
                sys.stderr.write(text.rstrip("\n") + "\n")
                return
            self._tty.write(_CLEAR_LINE + text.rstrip("\n") + "\n")
            self._drawn = ""
            self._redraw(force=True)

    # -- drawing

    def current_line(self) -> str:
        """What the status line shows now ("" when no task is running)."""
        with self._lock:
            if not self._tasks:
                return ""
            width = max(20, shutil.get_terminal_size((100, 24)).columns - 1)
            newest = max(self._tasks.values(), key=lambda item: item[0])[1]
            others = len(self._tasks) - 1
            if others:
                newest = replace(newest, task=f"[+{others}] {newest.task}")
            return newest.line(width, self._unicode)

    def _redraw(self, force: bool = False) -> None:
        with self._lock:
            if not self.active:
                return
            line = self.current_line()
            if not force and not self._dirty and line == self._drawn:
                return
            self._dirty = False
            self._tty.write(_CLEAR_LINE + line)
            self._tty.flush()
            self._drawn = line

    # -- output capture: lines scroll above the status line

    def _capture(self, fds: list[int]) -> None:
        if not fds:
            return
        _flush_std_streams()
        read_end, write_end = os.pipe()
        for fd in fds:
            self._saved[fd] = os.dup(fd)
            os.dup2(write_end, fd)
        os.close(write_end)
        self._pipe_read = read_end

    def _release(self) -> None:
        """Give stdout/stderr back to the terminal."""
        _flush_std_streams()  # outside the lock: a full pipe drains only through the pump, which takes it
        with self._lock:
            for fd, saved in self._saved.items():
                os.dup2(saved, fd)
                os.close(saved)
            self._saved.clear()

    def _pump(self, timeout: float) -> bool:
        """Move captured output to the terminal, line by line; False once the pipe has no writer left."""
        assert self._pipe_read is not None
        ready, _, _ = select.select([self._pipe_read], [], [], timeout)
        if not ready:
            return True
        chunk = os.read(self._pipe_read, 65536)
        if not chunk:
            return False
        self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        for raw in lines:
            # A carriage-return redraw (another program's progress bar) keeps its last state only.
            parts = raw.decode("utf-8", "replace").split("\r")
            self.write_line(next((part for part in reversed(parts) if part.strip()), ""))
        return True

    def _run(self) -> None:
        pipe_open = self._pipe_read is not None
        last_full = time.monotonic()
        try:
            while True:
                stopping = self._stop.is_set()
                if pipe_open:
                    pipe_open = self._pump(0.05 if stopping else self.refresh_s)
                elif stopping:
                    return
                else:
                    self._stop.wait(self.refresh_s)
                if stopping and not pipe_open:
                    return
                # Now and then a full redraw repairs the line if something wrote to the terminal directly.
                full = time.monotonic() - last_full >= 1.0
                if full:
                    last_full = time.monotonic()
                self._redraw(force=full)
        except BaseException:
            # Never leave writers blocked on a pipe nobody reads: give the terminal back first.
            self._release()
            raise

    # -- lifetime

    def start(self) -> LiveProgress:
        if self.active and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="terminal-progress", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        if not self.active:
            with self._lock:
                if self._plain_out is not None:
                    with contextlib.suppress(OSError):
                        self._plain_out.close()
                    self._plain_out = None
            return
        self._release()  # our write ends close: the pump sees the end of the pipe once child processes exit
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)  # a child still holding the pipe must not hang the command
        with self._lock:
            if self._pending:
                self.write_line(self._pending.decode("utf-8", "replace"))
                self._pending = b""
            self._tasks.clear()
            self._tty.write(_CLEAR_LINE)
            self._tty.flush()
            self.active = False
            self._tty.close()
        if self._pipe_read is not None and (self._thread is None or not self._thread.is_alive()):
            os.close(self._pipe_read)
            self._pipe_read = None


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


def is_live() -> bool:
    """True while a status line is drawn on a terminal."""
    live = _current
    return live is not None and live.active


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
