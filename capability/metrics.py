"""Capability-server metrics beyond the per-RPC ones every server has."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

MODEL_FORWARD_TOTAL = "classify_model_forward_total"
MODEL_LOAD_SECONDS = "classify_model_load_seconds"
MODEL_INFO = "classify_model_info"


class CapabilityMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.model_forwards = Counter(
            MODEL_FORWARD_TOTAL,
            "Forward passes the model ran for requests (warm-up excluded).",
            ["model"],
            registry=registry,
        )
        self.model_load_seconds = Gauge(
            MODEL_LOAD_SECONDS,
            "Seconds the serving version took to read, build and warm up.",
            ["model"],
            registry=registry,
        )
        self.model_info = Gauge(
            MODEL_INFO,
            "1 for the model version serving now, labelled with version and device.",
            ["model", "version", "device"],
            registry=registry,
        )
