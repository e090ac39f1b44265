"""routes.yaml: schema, loading and route selection."""

from orchestrator.routing.table import Backend, Route, RoutesFileError, RouteTable, load_routes

__all__ = ["Backend", "Route", "RouteTable", "RoutesFileError", "load_routes"]
