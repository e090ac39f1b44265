"""What each capability replica last said about its load, and the wait it implies now.

Capability servers send a LoadReport (queue depth, predicted queue wait,
predicted service time, device busy share) as the `classify-load-bin` trailer
of every answer, the way gRPC's ORCA load reports travel. The orchestrator
keeps the latest per replica and, before sending a request, compares the wait
it implies with the request's remaining time: a request that would only miss
its deadline in the queue is refused (or sent to the route's fallback) at
once, before it costs either process anything more.

A report ages: the queue it describes drains while no new report arrives (for
example because every request was refused on the strength of it), so the
queue part of the wait counts down from when the report was received. The
service part is trusted for REPORT_LIFETIME_SECONDS after the queue has
drained, and then the report is not: the batch it sized was sized by the queue
of then (a deep queue's report says "a full batch"), and a replica restarted
at the same address is another. Trusted for ever, one report of a slow batch
kept every call with a shorter deadline from the replica, and so kept any new
report from coming; past it, the next call goes, and brings one.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from ai.classify.v1 import classify_service_pb2 as pb

# Seconds a report's service time is trusted once its queue wait has run out.
REPORT_LIFETIME_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    queue_depth: int
    # Seconds before a short text's own batch would start, and that batch's seconds.
    queue_wait: float
    service: float
    busy_share: float
    # Most texts in one batch on the replica; 0 when it did not say.
    max_batch_size: int
    received_at: float  # event-loop time
    # Seconds the replica spent on the call that carried the report; 0 when it did
    # not say.
    handled: float = 0.0
    # Most texts the replica's queue for the model holds; 0 when it did not say.
    queue_capacity: int = 0

    def wait_at(self, now: float) -> float:
        """Predicted seconds from sending a short text now to its answer (0 once the
        report is too old to say: see the module docstring)."""
        queue_left = self.queue_wait - (now - self.received_at)
        if queue_left < -REPORT_LIFETIME_SECONDS:
            return 0.0
        return max(queue_left, 0.0) + self.service


def read_load_report(raw: bytes, received_at: float) -> ReplicaLoad | None:
    """The report in a `classify-load-bin` trailer; None when it cannot be read (an
    older capability server, or a damaged trailer: no report is better than a wrong one)."""
    report = pb.LoadReport()
    try:
        report.ParseFromString(raw)
    except DecodeError:
        return None
    return ReplicaLoad(
        queue_depth=report.queue_depth,
        queue_wait=report.predicted_queue_wait.ToNanoseconds() / 1e9,
        service=report.predicted_service.ToNanoseconds() / 1e9,
        busy_share=report.device_busy_share,
        max_batch_size=report.max_batch_size,
        received_at=received_at,
        handled=report.handled.ToNanoseconds() / 1e9,
        queue_capacity=report.queue_capacity,
    )
