"""The `classify` command, built on this package's ClassifyClient.

    python -m classify_client "The striker scored twice in the final minutes"
    python -m classify_client --top-k 2 --json "Shares fell after the earnings call"
    python -m classify_client --file headlines.txt     # one text per line; - is stdin
    python -m classify_client --wait "..."             # follow PROCESSING to DONE
    python -m classify_client --result REQUEST_ID      # fetch a PROCESSING answer's result

Prints the labels with their scores, the model that answered, the route and
the request and trace IDs. An answer that is still PROCESSING (the route's time
budget ran out while the model worked) is shown as such, with the request ID
to fetch it by; `--wait` polls GetResult until it is DONE, within `--timeout`.
On failure it prints the status code, each field violation, and the request
and trace IDs, and exits 1. Overload and unavailability are retried first, as
the server's RetryInfo says (classify_client.retry).

With `--file`, the lines are sent with ClassifyBatch (up to 1,024 per call) and
one line is printed per text, in order: its best label and score, PROCESSING,
or its error with the request ID to look it up by. It exits 1 when any text failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from classify_client import (
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT_SECONDS,
    BatchItem,
    ClassifyClient,
    ClassifyError,
    pb,
)

LOCAL_KEY_FILE = Path(".run/api-key")
BAR_WIDTH = 30
PRIORITIES = ("batch", "interactive")
# Characters of each text echoed on its `--file` output line.
ECHO_CHARS = 60


def format_response(response: pb.ClassifyResponse) -> str:
    if response.status == pb.RESULT_STATUS_PROCESSING:
        lines = [
            "PROCESSING  the route's time budget ran out while the model was working;",
            f"            the result is kept under request {response.request_id}: fetch it with",
            f"            --result {response.request_id}, or call again with --wait",
        ]
    else:
        width = max((len(label.name) for label in response.labels), default=0)
        lines = [
            f"{label.name:<{width}}  {label.score:6.3f}  {'█' * round(label.score * BAR_WIDTH)}"
            for label in response.labels
        ]
    lines.append("")
    if response.status != pb.RESULT_STATUS_PROCESSING:
        lines.append(f"model     {response.model.name} (version {response.model.version})")
    lines += [
        f"route     {response.route}{'  [fallback]' if response.fallback else ''}",
        f"request   {response.request_id}",
        f"trace     {response.trace_id}",
    ]
    return "\n".join(lines)


def format_item(item: BatchItem, text: str) -> str:
    """One `--file` output line: best label and score, PROCESSING, or the error."""
    echo = text if len(text) <= ECHO_CHARS else text[: ECHO_CHARS - 1] + "…"
    if item.error is not None:
        error = item.error
        return (
            f"error       {error.code.name}: {error.message}  "
            f"(request {error.request_id or '-'})  {echo!r}"
        )
    response = item.response
    assert response is not None
    if response.status == pb.RESULT_STATUS_PROCESSING:
        return f"processing  fetch with --result {response.request_id}  {echo!r}"
    best = response.labels[0]
    return f"{best.name:<10}  {best.score:5.3f}  {echo}"


def format_error(error: ClassifyError) -> str:
    lines = [f"error: {error.code.name}: {error.message}"]
    lines += [f"  {v.field}: {v.description} [{v.rule}]" for v in error.violations]
    lines.append(f"request   {error.request_id or '-'}")
    lines.append(f"trace     {error.trace_id or '-'}")
    return "\n".join(lines)


def item_json(item: BatchItem) -> dict[str, Any]:
    if item.response is not None:
        return {"response": json_format.MessageToDict(item.response)}
    error = item.error
    assert error is not None
    return {
        "error": {
            "code": error.code.name,
            "message": error.message,
            "reason": error.reason,
            "requestId": error.request_id,
            "traceId": error.trace_id,
            "violations": [
                {"field": v.field, "rule": v.rule, "description": v.description}
                for v in error.violations
            ],
        }
    }


def api_key(flag: str | None) -> str | None:
    """The API key from the flag, the environment or the local key file."""
    key = flag or os.environ.get("CLASSIFY_API_KEY")
    if key is None and LOCAL_KEY_FILE.is_file():
        key = LOCAL_KEY_FILE.read_text().strip()
    return key or None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="classify", description="Classify a text.")
    parser.add_argument("text", nargs="?", help="the text to classify")
    parser.add_argument(
        "--file", help="classify each line of this file (- for stdin) with ClassifyBatch"
    )
    parser.add_argument(
        "--result", metavar="REQUEST_ID", help="fetch the result of a PROCESSING answer"
    )
    parser.add_argument(
        "--wait",
        action="store_true",
        help="follow a PROCESSING answer with GetResult until it is DONE (within --timeout)",
    )
    parser.add_argument(
        "--target",
        default=os.environ.get("CLASSIFY_TARGET", DEFAULT_TARGET),
        help=f"orchestrator host:port [env CLASSIFY_TARGET; default {DEFAULT_TARGET}]",
    )
    parser.add_argument("--top-k", type=int, help="only the k best labels")
    parser.add_argument("--max-length", type=int, help="token budget (default 512)")
    parser.add_argument("--model", default="", help="model name hint for routing")
    parser.add_argument("--priority", choices=PRIORITIES, default="interactive")
    parser.add_argument("--request-id", default="", help="your own request ID")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help="deadline in seconds, retries and --wait polling included",
    )
    parser.add_argument("--json", action="store_true", help="print the response as JSON")
    parser.add_argument("--ca-file", help="CA to verify a TLS orchestrator [env CLASSIFY_CA_FILE]")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"API key [env CLASSIFY_API_KEY; else {LOCAL_KEY_FILE}, written by `make run`]",
    )
    args = parser.parse_args(argv)
    if sum(given is not None for given in (args.text, args.file, args.result)) != 1:
        parser.error("give one of: a text, --file or --result")
    return args


def read_lines(path: str) -> list[str]:
    """The texts of a `--file`: one per line, without line endings."""
    source = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    return source.splitlines()


def classify_file(client: ClassifyClient, args: argparse.Namespace) -> int:
    """Send the file's lines with ClassifyBatch; print one line (or JSON object) per text."""
    texts = read_lines(args.file)
    items = client.classify_batch(
        texts,
        top_k=args.top_k,
        max_length=args.max_length,
        model=args.model,
        priority=args.priority,
        wait=args.wait,
    )
    for item, text in zip(items, texts, strict=True):
        if args.json:
            print(json.dumps(item_json(item), ensure_ascii=False))
        else:
            print(format_item(item, text))
    return 0 if all(item.ok for item in items) else 1


def classify_one(client: ClassifyClient, args: argparse.Namespace) -> pb.ClassifyResponse:
    if args.result is not None:
        return client.get_result(args.result, wait=args.wait)
    return client.classify(
        args.text,
        top_k=args.top_k,
        max_length=args.max_length,
        model=args.model,
        priority=args.priority,
        request_id=args.request_id,
        wait=args.wait,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with ClassifyClient(
        args.target,
        api_key=api_key(args.api_key),
        ca_file=args.ca_file or os.environ.get("CLASSIFY_CA_FILE"),
        timeout=args.timeout,
    ) as client:
        try:
            if args.file is not None:
                return classify_file(client, args)
            response = classify_one(client, args)
        except ClassifyError as error:
            print(format_error(error), file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(json_format.MessageToDict(response), indent=2, ensure_ascii=False))
    else:
        print(format_response(response))
    return 0


if __name__ == "__main__":
    sys.exit(main())
