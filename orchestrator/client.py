"""Command-line client: classify a text through the orchestrator.

    python -m orchestrator.client "The striker scored twice in the final minutes"
    python -m orchestrator.client --top-k 2 --json "Shares fell after the earnings call"

Prints the labels with their scores, the model that answered, the route and
the request and trace IDs. On failure it prints the status code, each field
violation, and the request and trace IDs from the trailers, and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from classify_common.context import REQUEST_ID_HEADER, TRACE_ID_HEADER

DEFAULT_TARGET = "127.0.0.1:50051"
LOCAL_KEY_FILE = Path(".run/api-key")
DEFAULT_TIMEOUT_SECONDS = 10.0
BAR_WIDTH = 30
PRIORITIES = {"interactive": pb.PRIORITY_INTERACTIVE, "batch": pb.PRIORITY_BATCH}


def build_request(args: argparse.Namespace) -> pb.ClassifyRequest:
    request = pb.ClassifyRequest(
        text=args.text,
        model=args.model or "",
        request_id=args.request_id or "",
        priority=PRIORITIES[args.priority],
    )
    if args.top_k is not None:
        request.top_k = args.top_k
    if args.max_length is not None:
        request.max_length = args.max_length
    return request


def format_response(response: pb.ClassifyResponse) -> str:
    width = max((len(label.name) for label in response.labels), default=0)
    lines = [
        f"{label.name:<{width}}  {label.score:6.3f}  {'█' * round(label.score * BAR_WIDTH)}"
        for label in response.labels
    ]
    lines += [
        "",
        f"model     {response.model.name} (version {response.model.version})",
        f"route     {response.route}{'  [fallback]' if response.fallback else ''}",
        f"request   {response.request_id}",
        f"trace     {response.trace_id}",
    ]
    return "\n".join(lines)


def format_error(error: grpc.RpcError) -> str:
    call: grpc.Call = error  # type: ignore[assignment]
    lines = [f"error: {call.code().name}: {call.details()}"]
    status = rpc_status.from_call(call)
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            lines += [
                f"  {v.field}: {v.description} [{v.reason}]" for v in bad_request.field_violations
            ]
    trailers = {key: str(value) for key, value in call.trailing_metadata() or ()}
    lines.append(f"request   {trailers.get(REQUEST_ID_HEADER, '-')}")
    lines.append(f"trace     {trailers.get(TRACE_ID_HEADER, '-')}")
    return "\n".join(lines)


def credentials(flag: str | None) -> tuple[tuple[str, str], ...]:
    """`authorization` metadata from the flag, the environment or the local key file."""
    key = flag or os.environ.get("CLASSIFY_API_KEY")
    if key is None and LOCAL_KEY_FILE.is_file():
        key = LOCAL_KEY_FILE.read_text().strip()
    return (("authorization", f"Bearer {key}"),) if key else ()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.client", description="Classify a text."
    )
    parser.add_argument("text", help="the text to classify")
    parser.add_argument(
        "--target",
        default=os.environ.get("CLASSIFY_TARGET", DEFAULT_TARGET),
        help=f"orchestrator host:port [env CLASSIFY_TARGET; default {DEFAULT_TARGET}]",
    )
    parser.add_argument("--top-k", type=int, help="only the k best labels")
    parser.add_argument("--max-length", type=int, help="token budget (default 512)")
    parser.add_argument("--model", help="model name hint for routing")
    parser.add_argument("--priority", choices=sorted(PRIORITIES), default="interactive")
    parser.add_argument("--request-id", help="your own request ID")
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_SECONDS, help="deadline in seconds"
    )
    parser.add_argument("--json", action="store_true", help="print the response as JSON")
    parser.add_argument("--ca-file", help="CA to verify a TLS orchestrator [env CLASSIFY_CA_FILE]")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"API key [env CLASSIFY_API_KEY; else {LOCAL_KEY_FILE}, written by `make run`]",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ca_file = args.ca_file or os.environ.get("CLASSIFY_CA_FILE")
    channel = (
        grpc.secure_channel(args.target, grpc.ssl_channel_credentials(Path(ca_file).read_bytes()))
        if ca_file
        else grpc.insecure_channel(args.target)
    )
    with channel:
        stub = pb_grpc.ClassifyServiceStub(channel)
        try:
            response = stub.Classify(
                build_request(args), timeout=args.timeout, metadata=credentials(args.api_key)
            )
        except grpc.RpcError as error:
            print(format_error(error), file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(json_format.MessageToDict(response), indent=2, ensure_ascii=False))
    else:
        print(format_response(response))
    return 0


if __name__ == "__main__":
    sys.exit(main())
