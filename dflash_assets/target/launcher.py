"""torch.distributed's own launcher (`torch.distributed.run`, torchrun's elastic agent) for the ranks of a
target split over several devices: `python -m dflash_assets.target.launcher JOB.json`, torchrun that dies
with the process that started it (the Dagster step), so a killed step never leaves an agent or a rank
behind. It starts `TargetRankJob.tp` ranks of the stage's entry (`extraction/rank.py`,
`generation/rank.py`) on this host, never restarts one (a rank that dies ends them all: the step's next
run resumes from the store), and gives their rendezvous the job's timeout. Training's ranks have their own
launcher (`training/launcher.py`), the same torchrun with restarts and several nodes.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from dflash_assets.target.ranks import TargetRankJob, die_with_parent

STAGE_ENTRIES = {"capture": "dflash_assets.extraction.rank", "regeneration": "dflash_assets.generation.rank"}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def torchrun_arguments(job: TargetRankJob, job_file: str | Path, port: int) -> list[str]:
    """torchrun's arguments for the job's ranks on this host: one node, c10d rendezvous on loopback."""
    timeout = int(job.timeout_s)
    conf = f"is_host=1,join_timeout={timeout},close_timeout=60,read_timeout={timeout}"
    return [
        "--nnodes=1",
        f"--nproc-per-node={job.tp}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=target-{port}",
        f"--rdzv-conf={conf}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
        "-m",
        STAGE_ENTRIES[job.stage],
        str(job_file),
    ]


def launcher_command(job_file: str | Path) -> list[str]:
    return [sys.executable, "-m", "dflash_assets.target.launcher", str(job_file)]


def main(argv: Sequence[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun

    die_with_parent()
    arguments = list(sys.argv[1:] if argv is None else argv)
    if len(arguments) != 1:
        raise SystemExit("usage: python -m dflash_assets.target.launcher JOB.json")
    job = TargetRankJob.from_json(Path(arguments[0]).read_text())
    torchrun(torchrun_arguments(job, arguments[0], free_port()))


if __name__ == "__main__":
    main()
