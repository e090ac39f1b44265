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

The normal equations are solved with each term scaled to unit size first. Raw,
their entries span eleven orders of magnitude (B·T reaches 16,384 and its square
1.6e8, against a weight of about 200 for the launch term), and when the recent
batches all have one shape, as a steady load of `ClassifyBatch` x64 of headlines
gives, the system is singular but for the ridge: solved raw, the fit came out as
1 ms + 3.5 ms a text + 0.41 ms a text-token, predicting 0.59 s for the very
shape that every one of the last 400 batches had run in about 2.5 ms, and the
batcher refused a burst of texts as unable to end in time (a scratch dump of
the fit under `ab_env.py`, 2026-12-05). Scaled, the ridge is the same small
share of every term, and a single shape is predicted at what it took.

It is plain Python floats, not numpy: the system is 3x3, and numpy's call
overhead was most of the cost. A prediction took 4.6 µs and a refit 61 µs on
the 2-core machine; the serving loop predicts several times per request
(admission, the load report, forming batches) and the device thread refits,
holding the GIL, after every batch.
"""

from __future__ import annotations

import itertools
import math
import threading

# Weight kept by past observations at each new one: ~200 batches of memory.
FORGETTING = 0.995
# Ridge keeping the 3x3 system solvable while the batches have too few shapes to
# tell the terms apart, as a share of each term's (scaled, so unit) weight.
RIDGE = 1e-6

Vector = tuple[float, float, float]
# A symmetric 3x3 matrix, row by row.
Matrix = list[list[float]]

# Every proper non-empty subset of the three terms, for the non-negative fit.
_TERM_SUBSETS = [subset for size in (1, 2) for subset in itertools.combinations(range(3), size)]


def _solve_all(gram: Matrix, moment: list[float]) -> list[float]:
    """The free least-squares coefficients of all three terms (Cramer's rule on the
    ridged normal equations)."""
    (a, b, c), (_, e, f), (_, _, i) = gram
    a, e, i = a + RIDGE, e + RIDGE, i + RIDGE
    # Cofactors of the symmetric matrix [[a, b, c], [b, e, f], [c, f, i]].
    c00, c01, c02 = e * i - f * f, c * f - b * i, b * f - c * e
    c11, c12, c22 = a * i - c * c, b * c - a * f, a * e - b * b
    determinant = a * c00 + b * c01 + c * c02
    m0, m1, m2 = moment
    return [
        (c00 * m0 + c01 * m1 + c02 * m2) / determinant,
        (c01 * m0 + c11 * m1 + c12 * m2) / determinant,
        (c02 * m0 + c12 * m1 + c22 * m2) / determinant,
    ]


def _solve_subset(gram: Matrix, moment: list[float], subset: tuple[int, ...]) -> list[float]:
    """The least-squares coefficients of the terms in `subset` (one or two), the others
    held at zero."""
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


def non_negative_fit(gram: Matrix, moment: list[float], squares: float) -> Vector:
    """Least-squares coefficients, none negative, from the (weighted) normal equations
    `gram`, `moment` and the sum of squared observations `squares`.

    Each term is scaled to unit weight (the diagonal of `gram` to 1) and the result
    scaled back; a positive scale keeps a coefficient's sign and the residuals, so
    the non-negative fit is the same problem in either units.
    """
    scale = [math.sqrt(gram[i][i]) or 1.0 for i in range(3)]
    unit_gram = [[gram[i][j] / (scale[i] * scale[j]) for j in range(3)] for i in range(3)]
    unit_moment = [moment[i] / scale[i] for i in range(3)]
    fit = _non_negative_unit_fit(unit_gram, unit_moment, squares)
    return fit[0] / scale[0], fit[1] / scale[1], fit[2] / scale[2]


def _non_negative_unit_fit(gram: Matrix, moment: list[float], squares: float) -> Vector:
    """non_negative_fit on terms already scaled to unit weight.

    The free solution when it has no negative term; else the best of the fits over
    each smaller subset of the terms (the others held at zero) whose coefficients are
    all non-negative: with three terms that is six small solves, and it is the exact
    non-negative least-squares solution.
    """
    free = _solve_all(gram, moment)
    if min(free) >= 0:
        return free[0], free[1], free[2]
    best, best_residual = [0.0, 0.0, 0.0], squares
    for subset in _TERM_SUBSETS:
        part = _solve_subset(gram, moment, subset)
        if min(part) < 0:
            continue
        # Weighted sum of squared residuals: y·y - 2·β·(Xᵀy) + β·(XᵀX)·β, over the
        # subset's terms (the others are zero).
        terms = list(zip(subset, part, strict=True))
        residual = squares
        for i, beta_i in terms:
            residual -= 2 * beta_i * moment[i]
            for j, beta_j in terms:
                residual += beta_i * gram[i][j] * beta_j
        if residual < best_residual:
            best = [0.0, 0.0, 0.0]
            for index, value in terms:
                best[index] = value
            best_residual = residual
    return best[0], best[1], best[2]


class ServiceTimeModel:
    """Thread-safe: the device thread records, the event loop predicts."""

    def __init__(self) -> None:
        self._gram: Matrix = [[0.0] * 3 for _ in range(3)]
        self._moment = [0.0, 0.0, 0.0]
        self._squares = 0.0
        # Replaced whole by each refit, so a prediction reads one consistent fit
        # without taking the lock.
        self._coefficients: Vector = (0.0, 0.0, 0.0)
        self._observations = 0
        self._lock = threading.Lock()

    @property
    def observations(self) -> int:
        return self._observations

    def record(
        self,
        batch_size: int,
        padded_tokens: int,
        seconds: float,
        *,
        past_weight: float = FORGETTING,
    ) -> None:
        """Fit a batch of `batch_size` texts padded to `padded_tokens` that took
        `seconds`, the past observations kept at `past_weight` (FORGETTING; less when
        a probe has shown them stale, probe.py)."""
        x = (1.0, float(batch_size), float(batch_size * padded_tokens))
        with self._lock:
            gram, moment = self._gram, self._moment
            for row in range(3):
                for column in range(3):
                    gram[row][column] = past_weight * gram[row][column] + x[row] * x[column]
                moment[row] = past_weight * moment[row] + x[row] * seconds
            self._squares = past_weight * self._squares + seconds * seconds
            self._observations += 1
            self._coefficients = non_negative_fit(gram, moment, self._squares)

    def predict(self, batch_size: int, padded_tokens: int) -> float:
        """Seconds a batch of this shape is expected to take (0 before any observation)."""
        launch, per_text, per_token = self._coefficients
        return launch + batch_size * (per_text + per_token * padded_tokens)
