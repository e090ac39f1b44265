"""routes.yaml: schema, loading, route selection, and the live watcher."""

from orchestrator.routing.match import RequestFacts, RouteMatch
from orchestrator.routing.table import (
    Backend,
    Route,
    RoutesFileError,
    RouteTable,
    Shadow,
    load_routes,
)

__all__ = [
    "Backend",
    "RequestFacts",
    "Route",
    "RouteMatch",
    "RouteTable",
    "RoutesFileError",
    "Shadow",
    "load_routes",
]
