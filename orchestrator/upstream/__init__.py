"""Calling capability servers: channels, replica choice, deadlines, error translation."""

from orchestrator.upstream.pool import BackendPool, UpstreamPools

__all__ = ["BackendPool", "UpstreamPools"]
