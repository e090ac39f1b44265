"""Call policy: retries with backoff, and model fallback."""

from orchestrator.policy.retries import RetryPolicy, backoff_seconds

__all__ = ["RetryPolicy", "backoff_seconds"]
