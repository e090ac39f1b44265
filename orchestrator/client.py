"""Command-line client: classify a text, or a file of texts, through the orchestrator.

    python -m orchestrator.client "The striker scored twice in the final minutes"
    python -m orchestrator.client --top-k 2 --json "Shares fell after the earnings call"
    python -m orchestrator.client --file headlines.txt     # one text per line; - is stdin

Prints the labels with their scores, the model that answered, the route and
the request and trace IDs. On failure it prints the status code, each field
violation, and the request and trace IDs from the trailers, and exits 1.

With `--file`, the lines are sent with ClassifyBatch (up to 1,024 per call) and
one line is printed per text, in order: its best label and score, or its error
with the request ID to look it up by. It exits 1 when any text failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from google.protobuf import json_format
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from classify_common.context import REQUEST_ID_HEADER, TRACE_ID_HEADER

DEFAULT_TARGET = "127.0.0.1:50051"
LOCAL_KEY_FILE = Path(".run/api-key")
DEFAULT_TIMEOUT_SECONDS = 10.0
BAR_WIDTH = 30
PRIORITIES = {"interactive": pb.PRIORITY_INTERACTIVE, "batch": pb.PRIORITY_BATCH}
# Items per ClassifyBatch call (the contract's limit).
BATCH_ITEMS = 1024
# Characters of each text echoed on its `--file` output line.
ECHO_CHARS = 60


def build_request(args: argparse.Namespace, text: str | None = None) -> pb.ClassifyRequest:
    request = pb.ClassifyRequest(
        text=args.text if text is None else text,
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


def format_item(result: pb.ClassifyBatchResult, text: str) -> str:
    """One `--file` output line: best label and score, PROCESSING, or the error."""
    echo = text if len(text) <= ECHO_CHARS else text[: ECHO_CHARS - 1] + "…"
    if result.HasField("error"):
        return f"error       {format_status(result.error)}  {echo!r}"
    response = result.response
    if response.status == pb.RESULT_STATUS_PROCESSING:
        return f"processing  poll GetResult with request {response.request_id}  {echo!r}"
    best = response.labels[0]
    return f"{best.name:<10}  {best.score:5.3f}  {echo}"


def format_status(status: status_pb2.Status) -> str:
    """`CODE: message` and each field violation, with the request ID, on one line."""
    code = next((c.name for c in grpc.StatusCode if c.value[0] == status.code), str(status.code))
    parts = [f"{code}: {status.message}"]
    request_id = "-"
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            request_id = info.metadata.get(REQUEST_ID_HEADER, request_id)
    parts.append(f"(request {request_id})")
    return "  ".join(parts)


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
    parser.add_argument("text", nargs="?", help="the text to classify")
    parser.add_argument(
        "--file", help="classify each line of this file (- for stdin) with ClassifyBatch"
    )
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
    args = parser.parse_args(argv)
    if (args.text is None) == (args.file is None):
        parser.error("give either a text or --file")
    return args


def read_lines(path: str) -> list[str]:
    """The texts of a `--file`: one per line, without line endings."""
    source = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return source.splitlines()


def chunks(texts: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(texts), BATCH_ITEMS):
        yield texts[start : start + BATCH_ITEMS]


def classify_file(stub: pb_grpc.ClassifyServiceStub, args: argparse.Namespace) -> int:
    """Send the file's lines with ClassifyBatch; print one line (or JSON object) per text."""
    failed = 0
    for texts in chunks(read_lines(args.file)):
        request = pb.ClassifyBatchRequest(items=[build_request(args, text) for text in texts])
        try:
            response = stub.ClassifyBatch(
                request, timeout=args.timeout, metadata=credentials(args.api_key)
            )
        except grpc.RpcError as error:
            print(format_error(error), file=sys.stderr)
            return 1
        for result, text in zip(response.results, texts, strict=True):
            failed += result.HasField("error")
            if args.json:
                print(json.dumps(json_format.MessageToDict(result), ensure_ascii=False))
            else:
                print(format_item(result, text))
    return 1 if failed else 0


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
        if args.file is not None:
            return classify_file(stub, args)
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
