"""Predicts how long a batch takes, learned online from the batches a worker runs.

Batch latency is modelled as `a + b·B + c·B·T` (B texts padded to T tokens):
a fixed launch cost, a per-text cost, and a per-token cost. The fit is
least squares over past batches with exponential forgetting, so it follows a
device that warms up, throttles or shares its cores.

Costs cannot be negative, and the fit keeps them so by least squares over the
terms that stay non-negative (every subset of the three is tried when the
free fit has a negative one). Setting a negative term to zero instead, as this
did before, bends the others out of true: short headlines pad to about the
same length, the per-text and per-token terms then trade off, and the free fit
of a served topic-minilm had a per-text cost of -1 ms; zeroed, it predicted a
batch of 31 texts 17% slower than the same data said (scratch log of the fit
under `make bench-overload`'s 256 callers, 2026-12-02), so that admission
and the batch's deadline check, which read this fit, refused texts early.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

# Weight kept by past observations at each new one: ~200 batches of memory.
FORGETTING = 0.995
# Ridge term keeping the 3x3 system solvable before varied shapes are seen.
RIDGE = 1e-6


def _features(batch_size: int, padded_tokens: int) -> np.ndarray:
    return np.array([1.0, float(batch_size), float(batch_size * padded_tokens)])


# Every proper non-empty subset of the three terms, for the non-negative fit.
_TERM_SUBSETS = [subset for size in (1, 2) for subset in itertools.combinations(range(3), size)]


def _solve_subset(
    gram: list[list[float]], moment: list[float], subset: tuple[int, ...]
) -> list[float]:
    """The least-squares coefficients of the terms in `subset` (one or two), the others
    held at zero, in plain floats: numpy's call overhead is most of a 2x2 solve."""
    if len(subset) == 1:
        (i,) = subset
        return [moment[i] / (gram[i][i] + RIDGE)]
    i, j = subset
    a, b, d = gram[i][i] + RIDGE, gram[i][j], gram[j][j] + RIDGE
    determinant = a * d - b * b
    return [
        (d * moment[i] - b * moment[j]) / determinant,
        (a * moment[j] - b * moment[i]) / determinant,
    ]


def non_negative_fit(gram: np.ndarray, moment: np.ndarray, squares: float) -> np.ndarray:
    """Least-squares coefficients, none negative, from the (weighted) normal equations
    `gram`, `moment` and the sum of squared observations `squares`.

    The free solution when it has no negative term; else the best of the fits over
    each smaller subset of the terms (the others held at zero) whose coefficients are
    all non-negative: with three terms that is six small solves, and it is the exact
    non-negative least-squares solution.
    """
    solution = np.linalg.solve(gram + RIDGE * np.eye(3), moment)
    if (solution >= 0).all():
        return solution
    rows, sums = gram.tolist(), moment.tolist()
    best, best_residual = [0.0, 0.0, 0.0], squares
    for subset in _TERM_SUBSETS:
        part = _solve_subset(rows, sums, subset)
        if min(part) < 0:
            continue
        candidate = [0.0, 0.0, 0.0]
        for index, value in zip(subset, part, strict=True):
            candidate[index] = value
        # Weighted sum of squared residuals: y·y - 2·β·(Xᵀy) + β·(XᵀX)·β.
        residual = squares - 2 * sum(c * m for c, m in zip(candidate, sums, strict=True))
        residual += sum(
            candidate[i] * rows[i][j] * candidate[j] for i in range(3) for j in range(3)
        )
        if residual < best_residual:
            best, best_residual = candidate, residual
    return np.array(best)


class ServiceTimeModel:
    """Thread-safe: the device thread records, the event loop predicts."""

    def __init__(self) -> None:
        self._gram = np.zeros((3, 3))
        self._moment = np.zeros(3)
        self._squares = 0.0
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
            self._squares = FORGETTING * self._squares + seconds * seconds
            self._observations += 1
            self._coefficients = non_negative_fit(self._gram, self._moment, self._squares)

    def predict(self, batch_size: int, padded_tokens: int) -> float:
        """Seconds a batch of this shape is expected to take (0 before any observation)."""
        with self._lock:
            coefficients = self._coefficients
        return float(coefficients @ _features(batch_size, padded_tokens))
