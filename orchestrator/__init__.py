"""Orchestration layer: the public front door (see server.py for the wiring)."""
