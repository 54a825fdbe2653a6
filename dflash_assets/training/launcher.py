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


class NetworkError(ValueError):
    """The ranks of a multi-node run could not reach each other as this host is configured."""


def interface_address(interface: str) -> str:
    """The IPv4 address of network interface `interface`, or a NetworkError naming the ones there are."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            answer = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
    except OSError as error:  # SIOCGIFADDR: no such interface, or no IPv4 address on it
        names = ", ".join(name for _, name in socket.if_nameindex())
        raise NetworkError(
            f"network interface {interface!r} has no IPv4 address here ({error.strerror}); this host has: "
            f"{names}. Set DFLASH_TRAIN_NETWORK_INTERFACE to the one the nodes share"
        ) from None
    return socket.inet_ntoa(answer[20:24])


def network_env(interface: str) -> dict[str, str]:
    """What binds gloo's and NCCL's sockets to `interface` (empty: their own choice)."""
    return {"GLOO_SOCKET_IFNAME": interface, "NCCL_SOCKET_IFNAME": interface} if interface else {}


def check_reachable(nnodes: int, interface: str) -> None:
    """A multi-node run without a chosen interface binds where this host's name resolves; when that is a
    loopback address (Debian and Ubuntu map the host name to 127.0.1.1), the other nodes' ranks could
    never connect, and would find out only at the collective timeout. Refuse it now, saying what to set."""
    if nnodes <= 1 or interface:
        return
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        address = ""
    if not address or address.startswith("127.") or address == "::1":
        raise NetworkError(
            f"this host's name {host!r} resolves to {address or 'nothing'}"
            f"{' (loopback)' if address else ''}: in a {nnodes}-node run the other nodes' ranks could not "
            "connect to this node's. Set DFLASH_TRAIN_NETWORK_INTERFACE to the interface the nodes share "
            "(`ip -br addr` lists them; `lo` only when every node runs on this one host)"
        )


def torchrun_arguments(
    rendezvous: Rendezvous,
    nproc_per_node: int,
    *,
    is_host: bool,
    entry: Sequence[str],
    local_addr: str = "",
) -> list[str]:
    """torchrun's arguments for this node's agent; `entry` is the rank's `-m module args...`; `local_addr`
    the address the other nodes reach this node's ranks at (empty: this host's name)."""
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
        *([f"--local-addr={local_addr}"] if local_addr else []),
        *entry,
    ]


def launcher_command(arguments: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "dflash_assets.training.launcher", *arguments]


def main(argv: Sequence[str] | None = None) -> None:
    from torch.distributed.run import main as torchrun

    from dflash_assets.target.ranks import die_with_parent

    die_with_parent()
    torchrun(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
