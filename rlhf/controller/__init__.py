"""Single controller on Ray: resource pools, worker groups, and per-method dispatch."""

from rlhf.controller.colocate import ColocatedWorker, WorkerContext
from rlhf.controller.dispatch import Dispatch, register
from rlhf.controller.errors import ResourceError, WorkerDiedError, WorkerError
from rlhf.controller.resource_pool import ResourcePool
from rlhf.controller.worker_group import PendingCall, RoleView, WorkerGroup
from rlhf.parallel.layout import Layout

__all__ = [
    "ColocatedWorker", "Dispatch", "Layout", "PendingCall", "ResourceError", "ResourcePool",
    "RoleView", "WorkerContext", "WorkerDiedError", "WorkerError", "WorkerGroup", "register",
]
