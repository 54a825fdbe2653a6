"""torch.distributed's own launcher (`torch.distributed.run`, torchrun's elastic agent) for a training run's
ranks on one node: the command, and `python -m dflash_assets.training.launcher <torchrun arguments>`,
which is torchrun that dies with the process that started it (the Dagster step, or a node's join task),
so a killed step never leaves an agent restarting ranks nobody waits for.

The ranks of every node meet through c10d rendezvous at `rdzv_host:rdzv_port` (served by the agent on
the step's node, `is_host`). When a rank dies, the agents stop the others and start them all again, up
to `max_restarts` times, after a new rendezvous within `join_timeout_s`; each restart resumes from the
last committed checkpoint. Past that the launcher fails, naming the rank and how it ended.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Rendezvous:
    host: str  # where the other nodes reach the step's node
    port: int
    run_id: str  # the same on every node of one launch
    nnodes: int
    join_timeout_s: float
    max_restarts: int


def free_port(host: str = "") -> int:
    """A port nobody listens on now (the rendezvous binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def torchrun_arguments(
    rendezvous: Rendezvous, nproc_per_node: int, *, is_host: bool, entry: Sequence[str]
) -> list[str]:
    """torchrun's arguments for this node's agent; `entry` is the rank's `-m module args...`."""
    conf = ",".join(
        [
            f"is_host={'1' if is_host else '0'}",
            f"join_timeout={int(rendezvous.join_timeout_s)}",
            "close_timeout=60",
            "read_timeout=60",
        ]
    )
    return [
        f"--nnodes={rendezvous.nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous.host}:{rendezvous.port}",
        f"--rdzv-id={rendezvous.run_id}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={rendezvous.max_restarts}",
        "--monitor-interval=0.5",
        *entry,
    ]


def launcher_command(arguments: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "dflash_assets.training.launcher", *arguments]


def main(argv: Sequence[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun

    from dflash_assets.training.rank import die_with_parent

    die_with_parent()
    torchrun(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
