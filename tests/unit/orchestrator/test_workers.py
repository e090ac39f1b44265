"""What the supervisor hands each of its --processes workers."""

from __future__ import annotations

from classify_common.serving import METRICS_DISABLED
from orchestrator.workers import one_worker_of
from tests.conftest import orchestrator_settings


def test_each_worker_gets_its_share_of_the_sets_limits_rounded_up() -> None:
    settings = orchestrator_settings(
        processes=3,
        state_url="redis://127.0.0.1:6379/0",
        concurrency_min_limit=32,
        concurrency_max_limit=1024,
        upstream_calls_in_flight=2,
        metrics_port=9100,
    )
    worker = one_worker_of(settings, 50051)
    assert (worker.processes, worker.port, worker.metrics_port) == (1, 50051, METRICS_DISABLED)
    assert (worker.concurrency_min_limit, worker.concurrency_max_limit) == (11, 342)
    assert worker.upstream_calls_in_flight == 1
    assert worker.concurrency().max_limit == 342


def test_a_single_call_in_flight_is_not_divided_to_none() -> None:
    settings = orchestrator_settings(
        processes=4,
        state_url="redis://127.0.0.1:6379/0",
        concurrency_min_limit=1,
        concurrency_max_limit=1,
        upstream_calls_in_flight=1,
    )
    worker = one_worker_of(settings, 50051)
    assert (worker.concurrency_min_limit, worker.concurrency_max_limit) == (1, 1)
    assert worker.upstream_calls_in_flight == 1
