"""The error kinds of thinblock, in one place.

Two families, as in dm persistent-data: a block operation that cannot be done
(no space, out of range, not supported, read-only) is an ordinary result and
carries an errno, so every frontend maps it to its own wire error once.
Everything else (bad names, missing pools, corrupt metadata) is a
ThinblockError with a message meant for a person.
"""

from __future__ import annotations

import errno
from typing import TypeGuard

# The layer below is full (a full host disk, a quota): an ordinary ENOSPC result.
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def is_no_space(exc: BaseException) -> TypeGuard[OSError]:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS


class ThinblockError(Exception):
    """A failure explained in plain words (CLI prints it and exits 1)."""


class UsageError(ThinblockError):
    """The request lacks or misuses something the caller must give (pool create
    without --size): the command line was wrong, and the CLI exits 2 as argparse does."""


class OutputClosed(ThinblockError):
    """Whoever read a job's output stream went away (EPIPE: `export ... - | head`).
    Not a failure to report: the command ends quietly with 128+SIGPIPE, as a tool
    killed by SIGPIPE does, whether the job ran in it or in a server."""


class UncleanCloseError(ThinblockError):
    """A pool closed without its final commit (a fenced client, a failing store): it
    is left marked unclean, and the next open recovers it as after a crash."""


class CorruptionError(ThinblockError):
    """The metadata is not in a state thinblock ever writes."""


class LeasesLost(ThinblockError):
    """A server per volume stopped because another took the lease of a volume it served
    (on Ceph: after its lease lapsed, or by fencing it off). Its worker is not restarted."""


class PoolBusyError(ThinblockError):
    """Another process holds the pool open for writing."""


class OpError(OSError):
    """A block operation failed; `errno` says how (ENOSPC, EINVAL, ...)."""

    code = errno.EIO

    def __init__(self, message: str) -> None:
        super().__init__(self.code, message)


class NoSpaceError(OpError):
    """The pool has too few free blocks for the whole request; nothing changed."""

    code = errno.ENOSPC


class FreedSpacePending(NoSpaceError):
    """The space a request needs was freed in the open transaction: usable after two
    commits (Volume re-plans the request after them; never reaches a frontend)."""


class GrantNeeded(FreedSpacePending):
    """An owner per volume needs more of the pool's free space than its grants hold:
    Volume takes a grant outside the pool lock, then re-plans (core/owner.py)."""


class RangeError(OpError):
    """The request reaches outside the volume."""

    code = errno.EINVAL


class NotSupportedError(OpError):
    """The request cannot be done the way it was asked (e.g. fast zero)."""

    code = errno.ENOTSUP


class ReadOnlyError(OpError):
    """A write-type request to something opened or created read-only."""

    code = errno.EPERM


class CommitError(OpError):
    """A commit could not be written; nothing in memory changed and it is retried.

    ENOSPC when the layer below is full, EIO for anything else."""

    def __init__(self, pool_path: str, cause: BaseException) -> None:
        super().__init__(f"commit of pool {pool_path} failed ({cause}); what it would have written stays pending")
        self.errno = errno.ENOSPC if is_no_space(cause) else errno.EIO
