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
service part does not: a text's own batch takes that long whenever it starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from ai.classify.v1 import classify_service_pb2 as pb


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

    def wait_at(self, now: float) -> float:
        """Predicted seconds from sending a short text now to its answer."""
        return max(self.queue_wait - (now - self.received_at), 0.0) + self.service


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
    )
