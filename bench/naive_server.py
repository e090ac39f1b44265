"""The naive model server the benchmarks compare with: one request, one forward pass.

No queue and no batching: each Classify call tokenizes its text and runs the model
on it alone, one call at a time on one thread, as the simplest model server would.
It uses the same torch threads as `python -m capability` (cpu_threads_per_worker), so
the comparison is of serving, not of thread counts.

    python bench/naive_server.py --port 0 [--device cpu] [--bundle build/models/topic-minilm/1]

Logs one JSON line `{"event": "serving", "port": N}` once it answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from ai.classify.v1 import classify_service_pb2 as pb  # noqa: E402
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc  # noqa: E402
from capability.bundle import load_bundle  # noqa: E402
from capability.workers.threads import cpu_threads_per_worker  # noqa: E402

DEFAULT_BUNDLE = REPO_ROOT / "build" / "models" / "topic-minilm" / "1"


class NaiveServicer(pb_grpc.ClassifyServiceServicer):
    """One request, one forward pass, on a single thread: no queue, no batching."""

    def __init__(self, bundle: Path, device: str) -> None:
        self._classifier = load_bundle(bundle, device).classifier
        self._device = ThreadPoolExecutor(max_workers=1)

    async def GetResult(self, request: pb.GetResultRequest, context: Any) -> pb.ClassifyResponse:  # noqa: N802
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the naive server keeps no results")
        raise AssertionError("abort raises")

    async def ClassifyBatch(  # noqa: N802
        self, request: pb.ClassifyBatchRequest, context: Any
    ) -> pb.ClassifyBatchResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the naive server answers one text")
        raise AssertionError("abort raises")

    async def Classify(self, request: pb.ClassifyRequest, context: Any) -> pb.ClassifyResponse:  # noqa: N802
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._device, self._classifier.classify, [request.text])
        scores = result.probabilities[0].tolist()
        labels = sorted(
            zip((label.name for label in self._classifier.labels), scores, strict=True),
            key=lambda pair: pair[1],
            reverse=True,
        )
        return pb.ClassifyResponse(
            labels=[pb.Label(name=name, score=score) for name, score in labels],
            confidence=labels[0][1],
            status=pb.RESULT_STATUS_DONE,
        )


async def serve(port: int, bundle: Path, device: str) -> None:
    if device == "cpu" or not torch.cuda.is_available():
        # The same threads as ours; its forwards run one at a time on a single executor
        # thread, the only thread that computes.
        torch.set_num_threads(cpu_threads_per_worker(cpu_workers=1))
    server = grpc.aio.server()
    pb_grpc.add_ClassifyServiceServicer_to_server(NaiveServicer(bundle, device), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(json.dumps({"event": "serving", "port": bound}), flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: any free)")
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, help="model bundle")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.bundle, args.device))


if __name__ == "__main__":
    main()
