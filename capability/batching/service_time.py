"""Predicts how long a batch takes, learned online from the batches a worker runs.

Batch latency is modelled as `a + b·B + c·B·T` (B texts padded to T tokens):
a fixed launch cost, a per-text cost, and a per-token cost. The fit is
least squares over past batches with exponential forgetting, so it follows a
device that warms up, throttles or shares its cores.
"""

from __future__ import annotations

import threading

import numpy as np

# Weight kept by past observations at each new one: ~200 batches of memory.
FORGETTING = 0.995
# Ridge term keeping the 3x3 system solvable before varied shapes are seen.
RIDGE = 1e-6


def _features(batch_size: int, padded_tokens: int) -> np.ndarray:
    return np.array([1.0, float(batch_size), float(batch_size * padded_tokens)])


class ServiceTimeModel:
    """Thread-safe: the device thread records, the event loop predicts."""

    def __init__(self) -> None:
        self._gram = np.zeros((3, 3))
        self._moment = np.zeros(3)
        self._coefficients = np.zeros(3)
        self._observations = 0
        self._lock = threading.Lock()

    @property
    def observations(self) -> int:
        return self._observations

    def record(self, batch_size: int, padded_tokens: int, seconds: float) -> None:
        x = _features(batch_size, padded_tokens)
        with self._lock:
            self._gram = FORGETTING * self._gram + np.outer(x, x)
            self._moment = FORGETTING * self._moment + x * seconds
            self._observations += 1
            solution = np.linalg.solve(self._gram + RIDGE * np.eye(3), self._moment)
            # Costs cannot be negative; a negative term is noise in a short history.
            self._coefficients = np.maximum(solution, 0.0)

    def predict(self, batch_size: int, padded_tokens: int) -> float:
        """Seconds a batch of this shape is expected to take (0 before any observation)."""
        with self._lock:
            coefficients = self._coefficients
        return float(coefficients @ _features(batch_size, padded_tokens))
