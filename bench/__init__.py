"""Benchmarks (`make bench`): model quality, the capability server, the front door."""
