"""One worker per device, and the pool that dispatches requests to them."""

from capability.batching import TextResult
from capability.workers.admission import TextRequest
from capability.workers.pool import WorkerPool, discover_devices
from capability.workers.worker import DeviceWorker, ModelReplica

__all__ = [
    "DeviceWorker",
    "ModelReplica",
    "TextRequest",
    "TextResult",
    "WorkerPool",
    "discover_devices",
]
