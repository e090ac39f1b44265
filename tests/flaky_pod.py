"""A capability pod that passes its health checks but fails its calls until it recovers.

A pod whose port refuses connections, or that reports NOT_SERVING, is passed
by without a failed call (its channel is in TRANSIENT_FAILURE), so it cannot
show outlier ejection. This one accepts connections and reports SERVING,
answers every ClassifyService call UNAVAILABLE while `failing` (INVALID_ARGUMENT
naming a field while `refusing_field` is set), and after that
passes each call on as it came (raw bytes and metadata) to a real capability
server, so its answers are real ones; with `load_report` set, it sends that
LoadReport with them instead of the capability's (a pod reporting a long queue);
with `answering` cleared, its calls wait until it is set again (a stalled pod);
with `delay_seconds`, each call waits that long before it is passed on (a slow
pod); with `max_receive_bytes`, gRPC itself refuses a larger request message, as it
does past a server's limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from classify_common.context import LOAD_REPORT_TRAILER

CLASSIFY_SERVICE = "ai.classify.v1.ClassifyService"
# Headers gRPC sets itself on the forwarded call.
_OWN_HEADERS = ("grpc-", ":", "user-agent")

Handler = Callable[[bytes, grpc.aio.ServicerContext[bytes, bytes]], Awaitable[bytes]]


class FlakyPod(grpc.GenericRpcHandler):
    def __init__(
        self,
        capability_port: int,
        host: str = "127.0.0.1",
        *,
        failing: bool = True,
        max_receive_bytes: int | None = None,
    ) -> None:
        self.failing = failing
        # When set, the LoadReport trailer the pod sends with every answer in place of
        # the capability's own (a pod that reports a long queue, say).
        self.load_report: bytes | None = None
        # When set, every ClassifyService call is refused INVALID_ARGUMENT with one field
        # violation on this field (a capability that finds the request itself wrong).
        self.refusing_field: str | None = None
        # When set, every ClassifyService call is refused DEADLINE_UNREACHABLE before any
        # work (a capability whose queue is too long for the call's time).
        self.refusing_unreachable = False
        # Cleared: calls wait here (the pod stalls) until it is set.
        self.answering = asyncio.Event()
        self.answering.set()
        # Seconds each call waits before it is passed on.
        self.delay_seconds = 0.0
        # ClassifyService calls that reached the pod, and those it answered OK.
        self.calls = 0
        self.answered = 0
        self._host = host
        self._upstream = grpc.aio.insecure_channel(f"127.0.0.1:{capability_port}")
        limit = () if max_receive_bytes is None else (max_receive_bytes,)
        self._server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", size) for size in limit]
        )
        self._server.add_generic_rpc_handlers((self,))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    async def start(self, port: int = 0) -> None:
        """Serve on `port` (0: any free one) and report SERVING."""
        self.port = self._server.add_insecure_port(f"{self._host}:{port}")
        await self._server.start()
        await self.set_serving(True)

    async def set_serving(self, serving: bool) -> None:
        """What its health check reports: NOT_SERVING as a pod draining on SIGTERM does."""
        status = health_pb2.HealthCheckResponse
        await self._health.set(CLASSIFY_SERVICE, status.SERVING if serving else status.NOT_SERVING)

    async def stop(self) -> None:
        await self._server.stop(grace=None)
        await self._upstream.close()

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[bytes, bytes] | None:
        method: str = handler_call_details.method
        if not method.startswith(f"/{CLASSIFY_SERVICE}/"):
            return None
        return grpc.unary_unary_rpc_method_handler(self._handler(method))

    def _handler(self, method: str) -> Handler:
        forward: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = self._upstream.unary_unary(method)

        async def handle(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
            self.calls += 1
            await self.answering.wait()
            await asyncio.sleep(self.delay_seconds)
            if self.failing:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "this pod is failing")
            if self.refusing_field is not None:
                await context.abort_with_status(rpc_status.to_status(self._refusal()))
            if self.refusing_unreachable:
                await context.abort_with_status(rpc_status.to_status(_unreachable()))
            metadata = [
                (key, value)
                for key, value in context.invocation_metadata() or ()
                if not key.startswith(_OWN_HEADERS)
            ]
            try:
                response: bytes = await forward(
                    request, timeout=context.time_remaining(), metadata=metadata
                )
            except grpc.aio.AioRpcError as error:
                await context.abort(error.code(), error.details() or "")
            self.answered += 1
            if self.load_report is not None:
                context.set_trailing_metadata(((LOAD_REPORT_TRAILER, self.load_report),))
            return response

        return handle

    def _refusal(self) -> status_pb2.Status:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=self.refusing_field, reason="planted.rule", description="planted refusal"
        )
        detail = any_pb2.Any()
        detail.Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        return status_pb2.Status(
            code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
            message="planted refusal",
            details=[detail],
        )


def _unreachable() -> status_pb2.Status:
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason="DEADLINE_UNREACHABLE", domain="classify"))
    return status_pb2.Status(
        code=grpc.StatusCode.DEADLINE_EXCEEDED.value[0],
        message="planted: the queue is too long for the time left",
        details=[info],
    )
