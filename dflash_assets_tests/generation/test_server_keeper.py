"""`server_keeper` stops all of its server's tree: the part that left the server's process group (vLLM's
data-parallel supervisor makes a group of its own) and the orphans whose parent died before them, which
come to the keeper (its subreaper) instead of the host's init."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash_assets.generation.server_keeper import descendants, processes
from dflash_assets_tests.support.fake_vllm import alive

# A server whose tree is what a keeper must still find: a child in a session (and group) of its own, and a
# grandchild whose parent exits at once. It writes their pids and waits to be stopped.
SERVER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    escaped = subprocess.Popen(sleeper, start_new_session=True)
    middle = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys; p = subprocess.Popen(sys.argv[1:]); print(p.pid, flush=True)", *sleeper],
        stdout=subprocess.PIPE, text=True)
    orphan = int(middle.stdout.readline())
    middle.wait()
    with open(sys.argv[1], "w") as handle:
        handle.write(f"{escaped.pid} {orphan}\\n")
    time.sleep(600)
    """
)


@pytest.mark.slow  # starts processes; the escaped child waits out the keeper's 15 s grace
def test_the_keeper_stops_what_left_the_group_and_adopts_the_orphans(tmp_path):
    pids_file = tmp_path / "pids"
    keeper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash_assets.generation.server_keeper",
            "--",
            sys.executable,
            "-c",
            SERVER,
            str(pids_file),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert keeper.stdout is not None and "server pid" in keeper.stdout.readline()
        deadline = time.monotonic() + 30
        while not (pids_file.exists() and pids_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        escaped, orphan = (int(pid) for pid in Path(pids_file).read_text().split())
        table = processes()
        assert table[escaped][1] != table[keeper.pid][1]  # in a group the keeper's killpg never reaches
        deadline = time.monotonic() + 10  # the orphan's parent has exited: it comes to the keeper
        while processes().get(orphan, (0,))[0] != keeper.pid and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes()[orphan][0] == keeper.pid
        assert {escaped, orphan} <= set(descendants(keeper.pid, processes()))

        keeper.send_signal(signal.SIGTERM)  # the step asks: the range ended
        assert keeper.wait(timeout=60) == 0
        assert [pid for pid in (escaped, orphan) if alive(pid)] == []
    finally:
        if keeper.poll() is None:
            keeper.kill()
