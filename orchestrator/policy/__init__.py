"""Call policy: retries with backoff, the retry budget, outlier ejection."""

from orchestrator.policy.budget import RetryBudget, RetryBudgetSettings
from orchestrator.policy.outliers import OutlierDetector, OutlierSettings
from orchestrator.policy.retries import RetryPolicy, backoff_seconds

__all__ = [
    "OutlierDetector",
    "OutlierSettings",
    "RetryBudget",
    "RetryBudgetSettings",
    "RetryPolicy",
    "backoff_seconds",
]
