"""Admission, bounded deadline-aware queues, the batching loop and service-time prediction."""

from capability.batching.batcher import Batcher
from capability.batching.outcome import BatchOutcome, LeftOut, TextResult
from capability.batching.queue import (
    PRIORITY_BATCH,
    PRIORITY_INTERACTIVE,
    Admission,
    PendingRequest,
    RequestQueue,
)
from capability.batching.service_time import ServiceTimeModel
from capability.batching.settings import BatchingSettings
from capability.batching.wait import WaitPredictor

__all__ = [
    "PRIORITY_BATCH",
    "PRIORITY_INTERACTIVE",
    "Admission",
    "BatchOutcome",
    "Batcher",
    "BatchingSettings",
    "LeftOut",
    "PendingRequest",
    "RequestQueue",
    "ServiceTimeModel",
    "TextResult",
    "WaitPredictor",
]
