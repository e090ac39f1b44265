"""Admission, bounded deadline-aware queues, dynamic batching and service-time prediction."""

from capability.batching.queue import (
    PRIORITY_BATCH,
    PRIORITY_INTERACTIVE,
    PendingRequest,
    RequestQueue,
)
from capability.batching.service_time import ServiceTimeModel
from capability.batching.settings import BatchingSettings

__all__ = [
    "PRIORITY_BATCH",
    "PRIORITY_INTERACTIVE",
    "BatchingSettings",
    "PendingRequest",
    "RequestQueue",
    "ServiceTimeModel",
]
