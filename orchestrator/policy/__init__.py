"""Call policy: retries with backoff, the retry budget, outlier ejection."""

from orchestrator.policy.budget import RetryBudget, RetryBudgetSettings
from orchestrator.policy.outliers import OutlierDetector, OutlierSettings
from orchestrator.policy.retries import (
    GiveUp,
    RetryAfter,
    RetryDecision,
    RetryPolicy,
    backoff_seconds,
)

__all__ = [
    "GiveUp",
    "OutlierDetector",
    "OutlierSettings",
    "RetryAfter",
    "RetryBudget",
    "RetryBudgetSettings",
    "RetryDecision",
    "RetryPolicy",
    "backoff_seconds",
]
