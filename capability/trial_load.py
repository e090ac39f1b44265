"""Load one bundle version the way a capability server would, then let it go.

For `python -m capability.bundle verify --load`: a bundle whose hashes all match
can still be refused by a server (a label count the head does not score, a name
that is not its model folder's, a warm-up that fails or gives non-finite scores),
and a team should learn that before it deploys. So the version goes through the
server's own path, one CPU worker's `WorkerPool.load`: the whole of load_bundle,
the name check, and the worker's warm-up shapes, refused with the server's
messages. The ledger measures the small warm-up (a check, not a capacity plan),
and the batching settings are the defaults, not a model config's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from capability.batching import BatchingSettings
from capability.bundle import LoadedBundle
from capability.config import DEFAULT_MEMORY_THRESHOLD
from capability.metrics import CapabilityMetrics
from capability.workers import WorkerPool

# Nothing is served, so nothing is cached: the cache would only hold the warm-up.
_NO_RESULT_CACHE = (0, 0, 0)


def load_as_server(directory: Path, trusted_signers: Path | None = None) -> LoadedBundle:
    """Load the version in `directory` (`<model root>/<model>/<version>`) as a server
    started on its model root would, on one CPU worker, and release it; the loaded
    version, or the server's refusal (a ModelLoadError naming the file at fault)."""
    # Resolved: a relative `1` or `.` has no parent folder name to check the model's by.
    return asyncio.run(_load_and_release(Path(directory).resolve(), trusted_signers))


async def _load_and_release(directory: Path, trusted_signers: Path | None) -> LoadedBundle:
    pool = WorkerPool(
        [torch.device("cpu")],
        CapabilityMetrics(CollectorRegistry()),
        memory_threshold=DEFAULT_MEMORY_THRESHOLD,
        memory_warm_up="small",
        trusted_signers=trusted_signers,
        result_cache=_NO_RESULT_CACHE,
    )
    try:
        # The server serves a version under its model folder's name (lifecycle.py).
        return await pool.load(directory, BatchingSettings(), expected_name=directory.parent.name)
    finally:
        await pool.close()
