"""Call policy: retries with backoff, the retry budget, and model fallback."""

from orchestrator.policy.budget import RetryBudget, RetryBudgetSettings
from orchestrator.policy.retries import RetryPolicy, backoff_seconds

__all__ = ["RetryBudget", "RetryBudgetSettings", "RetryPolicy", "backoff_seconds"]
