"""The serving path's floor, for the benchmarks: gRPC hops that do nothing else.

`python bench/echo_server.py --port 0` answers every Classify with one fixed answer
of the size a real one has; with `--upstream HOST:PORT` it passes each call on to
that server instead (one upstream call per request, with the caller's remaining
time) and returns its answer. One in front of the other, two of them are the two
gRPC hops of the stack with the contract's messages, the same event loop and the
same server options as our servers, and nothing else: no authentication,
validation, routing, coalescing, model, logs, metrics or traces.

`make bench-front-door` runs them beside the stack, so that the serving path's
CPU per request (topic-static, whose forward costs almost nothing) reads against
what two bare hops cost on the same machine in the same minute: the per-request
cost figures move with the machine's speed from hour to hour, the ratio much less.

    python bench/echo_server.py --port 0 [--upstream 127.0.0.1:PORT]

Logs one JSON line `{"event": "serving", "port": N}` once it answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from ai.classify.v1 import classify_service_pb2 as pb  # noqa: E402
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc  # noqa: E402
from classify_common.event_loop import UVLOOP, loop_factory  # noqa: E402
from classify_common.serving import SERVER_OPTIONS  # noqa: E402

SERVICE = pb.DESCRIPTOR.services_by_name["ClassifyService"].full_name
# What topic-static answers, in shape and about in size.
FIXED_ANSWER = pb.ClassifyResponse(
    labels=[
        pb.Label(name=name, score=score)
        for name, score in (("sports", 0.7), ("business", 0.1), ("science", 0.1), ("world", 0.1))
    ],
    confidence=0.7,
    model=pb.ModelRef(name="topic-static", version="1"),
    request_id="00000000000000000000000000000000",
    trace_id="00000000000000000000000000000000",
    status=pb.RESULT_STATUS_DONE,
    route="default",
)


class EchoHop:
    """Classify answered at once, or passed on to `upstream` unchanged (its answer, or
    its failure's status)."""

    def __init__(self, upstream: pb_grpc.ClassifyServiceAsyncStub | None) -> None:
        self._upstream = upstream

    async def classify(self, request: pb.ClassifyRequest, context: Any) -> pb.ClassifyResponse:
        if self._upstream is None:
            return FIXED_ANSWER
        try:
            response: pb.ClassifyResponse = await self._upstream.Classify(
                request, timeout=context.time_remaining()
            )
        except grpc.aio.AioRpcError as failed:  # passed on as it came
            await context.abort(failed.code(), failed.details() or "")
            raise AssertionError("abort raises") from failed
        return response


async def start_echo(port: int, upstream: str | None) -> tuple[grpc.aio.Server, int]:
    """An echo hop started on `port` (0: any free one), and the port it bound."""
    channel = grpc.aio.insecure_channel(upstream) if upstream else None
    stub: pb_grpc.ClassifyServiceAsyncStub | None = (
        pb_grpc.ClassifyServiceStub(channel) if channel is not None else None
    )
    server = grpc.aio.server(options=SERVER_OPTIONS)
    # Registered as the generated code registers our servicers; Classify only.
    handler = grpc.unary_unary_rpc_method_handler(
        EchoHop(stub).classify,
        request_deserializer=pb.ClassifyRequest.FromString,
        response_serializer=pb.ClassifyResponse.SerializeToString,
    )
    server.add_registered_method_handlers(SERVICE, {"Classify": handler})
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def serve(port: int, upstream: str | None) -> None:
    server, bound = await start_echo(port, upstream)
    print(json.dumps({"event": "serving", "port": bound}), flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="gRPC port (0: any free)")
    parser.add_argument("--upstream", help="pass each call on to this server (HOST:PORT)")
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=loop_factory(UVLOOP)) as runner:
        runner.run(serve(args.port, args.upstream))


if __name__ == "__main__":
    main()
