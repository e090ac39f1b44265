"""Human-readable answers about a route table: is it valid, and where would a request go."""

from __future__ import annotations

from orchestrator.routing.match import RequestFacts
from orchestrator.routing.table import RouteTable


def summarize(table: RouteTable) -> str:
    return f"ok ({len(table.routes)} routes, {len(table.backends)} backends)"


def explain(table: RouteTable, facts: RequestFacts) -> str:
    """Which route a request matches, why the ones before it did not, and the backends
    it would try in order."""
    lines = []
    chosen = table.select(facts)
    for index, route in enumerate(table.routes):
        failed = route.match.failed_conditions(facts)
        if route is chosen:
            lines.append(
                f"routes[{index}] {route.name}: MATCHES ({'; '.join(route.match.conditions())})"
            )
            break
        lines.append(f"routes[{index}] {route.name}: skipped, {'; '.join(failed)}")
    lines.append(
        f"backends tried in order (retry: up to {chosen.retry.max_attempts} attempts each):"
    )
    for position, backend in enumerate(chosen.backends, start=1):
        role = "primary" if position == 1 else "fallback"
        lines.append(
            f"  {position}. {backend.name} ({role}): model {backend.model}, "
            f"timeout {backend.timeout_seconds:g}s, replicas {', '.join(backend.targets)}"
        )
    if chosen.shadow is not None:
        shadow = chosen.shadow.backend
        lines.append(
            f"shadow: {shadow.name} (model {shadow.model}) also gets {chosen.shadow.percent}% "
            "of the answered calls, after the answer, for comparison"
        )
    return "\n".join(lines)
