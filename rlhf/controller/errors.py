"""Errors raised on the driver when worker processes or cluster resources fail."""

from __future__ import annotations

from rlhf.errors import RLHFError


class WorkerError(RLHFError):
    """A rank failed while running a method; the message names job, role, rank, method and
    holds the remote traceback."""

    def __init__(self, message: str, *, job: str, role: str, rank: int | None, method: str,
                 remote_traceback: str = ""):
        super().__init__(message)
        self.job, self.role, self.rank, self.method = job, role, rank, method
        self.remote_traceback = remote_traceback


class WorkerDiedError(WorkerError):
    """A rank's process died (killed, out of memory, exited); the worker group was shut down."""


class ResourceError(RLHFError):
    """The cluster cannot host a resource pool; the message says what is missing."""
