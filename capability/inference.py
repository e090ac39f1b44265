"""The inference engine: one model, one device, one thread that owns both.

Every call that touches the device (loading, warm-up, forward passes) runs on
the engine's single worker thread, so the event loop never blocks on the model
and nothing else touches the device. A reload builds the new version on that
thread, warms it up, then swaps one reference: calls already running finish on
the old version, later calls see the new one, and a failed load leaves the old
version serving.

This serves a batch of one per call; the capability issue replaces the single
thread with per-device workers behind bounded, batching queues.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from capability.metrics import CapabilityMetrics
from capability.model import (
    ClassifyBatchResult,
    LabelSpec,
    ModelLoadError,
    TextClassifier,
    load_minilm_classifier,
)
from classify_common.errors import ModelNotFound, ModelNotReady, ReloadRefused

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
# Hex digits of the weights' SHA-256 that name a version: enough to tell
# versions apart, short enough to read in a log line.
VERSION_HEX_DIGITS = 12


@dataclass(frozen=True)
class ServedModel:
    """A loaded, warmed-up model version and where it came from."""

    name: str
    version: str
    source: Path
    classifier: TextClassifier
    loaded_at: datetime
    load_seconds: float

    @property
    def labels(self) -> tuple[LabelSpec, ...]:
        return self.classifier.labels


@dataclass(frozen=True)
class Classification:
    """Scores for one text, best first, and the model version that produced them."""

    scores: tuple[tuple[str, float], ...]
    model: ServedModel
    token_count: int
    truncated: bool


def resolve_device(setting: str) -> torch.device:
    """Map the `device` setting to a torch device: auto picks cuda:0 when present."""
    if setting == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def weights_version(model_dir: Path) -> str:
    digest = hashlib.sha256()
    with (model_dir / WEIGHTS_FILE).open("rb") as weights:
        for chunk in iter(lambda: weights.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:VERSION_HEX_DIGITS]


def load_served_model(name: str, source: Path, device: torch.device) -> ServedModel:
    """Read, build and warm up one version (blocking; runs on the device thread)."""
    started = time.perf_counter()
    version = weights_version(source)
    classifier = load_minilm_classifier(source, device=device)
    classifier.warm_up()
    return ServedModel(
        name=name,
        version=version,
        source=source,
        classifier=classifier,
        loaded_at=datetime.now(UTC),
        load_seconds=time.perf_counter() - started,
    )


class InferenceEngine:
    def __init__(
        self, model_name: str, source: Path, device: torch.device, metrics: CapabilityMetrics
    ) -> None:
        self.model_name = model_name
        self.source = source
        self.device = device
        self._metrics = metrics
        self._device_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"device-{device}"
        )
        self._served: ServedModel | None = None
        # Created on first use so it binds to the running event loop.
        self._reload_lock: asyncio.Lock | None = None

    @property
    def served(self) -> ServedModel | None:
        return self._served

    async def load(self) -> ServedModel:
        """Load and warm up the model from `source`, then start serving it."""
        loop = asyncio.get_running_loop()
        model = await loop.run_in_executor(
            self._device_thread, load_served_model, self.model_name, self.source, self.device
        )
        previous, self._served = self._served, model
        if previous is not None:
            self._metrics.model_info.remove(previous.name, previous.version, str(self.device))
        self._metrics.model_info.labels(model.name, model.version, str(self.device)).set(1)
        self._metrics.model_load_seconds.labels(model.name).set(model.load_seconds)
        log.info(
            "model ready",
            extra={
                "model": model.name,
                "version": model.version,
                "device": str(self.device),
                "load_seconds": round(model.load_seconds, 3),
            },
        )
        return model

    def model(self, name: str) -> ServedModel:
        """The serving version of `name`; NOT_FOUND or not-ready errors otherwise."""
        if name != self.model_name:
            raise ModelNotFound(f"model {name!r} is not served here", model=name)
        if self._served is None:
            raise ModelNotReady(f"model {name!r} is still loading", model=name)
        return self._served

    async def classify(self, text: str, max_length: int | None) -> Classification:
        served = self.model(self.model_name)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(
            self._device_thread, self._run_model, served, text, max_length
        )
        probabilities: Sequence[float] = result.probabilities[0].tolist()
        ranked = sorted(
            zip((label.name for label in served.labels), probabilities, strict=True),
            key=lambda pair: pair[1],
            reverse=True,
        )
        return Classification(
            scores=tuple(ranked),
            model=served,
            token_count=result.token_counts[0],
            truncated=result.truncated[0],
        )

    def _run_model(
        self, served: ServedModel, text: str, max_length: int | None
    ) -> ClassifyBatchResult:
        # On the device thread: the forward pass and its count happen together.
        result = served.classifier.classify([text], max_length)
        self._metrics.model_forwards.labels(served.name).inc()
        return result

    async def reload(self, name: str) -> tuple[ServedModel, str]:
        """Load `name` again from its source; returns (new model, previous version)."""
        previous = self.model(name)
        if self._reload_lock is None:
            self._reload_lock = asyncio.Lock()
        async with self._reload_lock:
            try:
                model = await self.load()
            except (ModelLoadError, OSError) as exc:
                raise ReloadRefused(
                    f"reload of {name!r} refused, version {previous.version} keeps serving: {exc}",
                    model=name,
                ) from exc
        return model, previous.version

    def close(self) -> None:
        self._device_thread.shutdown(wait=True, cancel_futures=True)
