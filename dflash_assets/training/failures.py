"""Which errors a restart of the ranks can mend, and which it would only meet again.

A launched run restarts every rank from the last committed checkpoint when one fails
(`DFLASH_TRAIN_MAX_RESTARTS`). That helps when the cause was outside the run: a store that was briefly
unreachable or throttling, a dropped connection, a peer rank that died (the others then fail inside a
collective). It cannot help an error the run's own data, settings or code make: the same step would fail
again after every restart, spending the restarts (and hours of a node) on it. So the default is
deterministic, and only errors known to come from outside end in a restart.
"""

from __future__ import annotations

import errno

# Words in a collective's error when a peer went away or stopped answering (gloo's and NCCL's own
# messages; older torch raises them as plain RuntimeError).
_PEER_WORDS = (
    "connection closed by peer",
    "connection reset",
    "connection refused",
    "broken pipe",
    "socket timeout",
    "timed out",
    "watchdog",
    "nccl communicator was aborted",
    "remote process exited",
)
# A local condition that a restart on the same node cannot change.
_LOCAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT}


def _causes(error: BaseException):
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _from_outside(error: BaseException) -> bool:
    from dflash_assets.storage.store import StoreError

    if isinstance(error, StoreError):
        return error.transient  # throttling, 5xx, dropped connections; not a missing bucket or key
    if isinstance(error, ConnectionError | TimeoutError):
        return True
    if isinstance(error, OSError):
        return (
            error.errno not in _LOCAL_ERRNOS
            and error.errno is not None
            and not isinstance(
                error, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError
            )
        )
    try:
        from torch.distributed import DistError
    except ImportError:  # a torch built without distributed
        DistError = ()  # noqa: N806
    if DistError and isinstance(error, DistError):
        return True
    return isinstance(error, RuntimeError) and any(word in str(error).lower() for word in _PEER_WORDS)


def restartable(error: BaseException) -> bool:
    """Whether restarting the ranks can mend `error`: it, or an error it was raised from, came from
    outside the run (the store, the network, a peer rank). Everything else is deterministic."""
    return any(_from_outside(cause) for cause in _causes(error))


def kind(error: BaseException) -> str:
    """'transient' or 'deterministic', for messages."""
    return "transient" if restartable(error) else "deterministic"
