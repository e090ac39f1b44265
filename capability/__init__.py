"""Capability layer: stateless gRPC model servers (see server.py for the wiring)."""
