"""Check routes files, and explain where a request would go.

    python -m orchestrator.routing check [routes.yaml ...]
    python -m orchestrator.routing explain [--routes routes.yaml] --text "..." \\
        [--model topic-static] [--priority batch] [--header x-tenant=acme] [--request-id ID]

`check` exits 1 and names the file, line and path of the first bad value of
each file that fails; use it in CI on every change to routes.yaml. `explain` refuses
(exit status 2) a request the server would refuse, with the server's own rules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ai.classify.v1 import classify_service_pb2 as pb
from classify_common.context import new_request_id
from classify_common.errors import InvalidRequest
from classify_common.validation import validate_request
from orchestrator.routing.explain import explain, summarize
from orchestrator.routing.match import PRIORITIES, RequestFacts, metadata_problem
from orchestrator.routing.table import RoutesFileError, load_routes

# The flag that sets each field of the ClassifyRequest `explain` checks.
FLAGS = {"text": "--text", "model": "--model", "request_id": "--request-id"}


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.routing", description=__doc__.splitlines()[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="validate routes files")
    check.add_argument("files", nargs="*", type=Path, default=[Path("routes.yaml")])
    why = commands.add_parser("explain", help="show the route and backends a request would get")
    why.add_argument("--routes", type=Path, default=Path("routes.yaml"))
    why.add_argument("--text", required=True)
    why.add_argument("--model", default="")
    why.add_argument("--priority", choices=PRIORITIES, default="interactive")
    why.add_argument("--header", action="append", default=[], metavar="NAME=VALUE")
    why.add_argument("--request-id", default="")
    args = parser.parse_args()

    if args.command == "check":
        failed = 0
        for path in args.files:
            try:
                print(f"{path}: {summarize(load_routes(path))}")
            except RoutesFileError as error:
                print(error, file=sys.stderr)
                failed += 1
        return 1 if failed else 0

    try:
        table = load_routes(args.routes)
    except RoutesFileError as error:
        print(error, file=sys.stderr)
        return 1
    headers = {}
    for header in args.header:
        name, separator, value = header.partition("=")
        if not separator:
            why.error(f"--header {header!r} is not NAME=VALUE")
        if problem := metadata_problem(name.lower(), value):
            why.error(f"--header {header!r}: {problem}")
        headers[name.lower()] = value
    request = pb.ClassifyRequest(
        text=args.text,
        model=args.model,
        priority=pb.PRIORITY_BATCH if args.priority == "batch" else pb.PRIORITY_INTERACTIVE,
        request_id=args.request_id,
    )
    try:
        # The server's own rules: a request it would refuse is never routed, so where
        # it would go is no answer (an empty text was explained as routed).
        validate_request(request)
    except InvalidRequest as refused:
        why.error(
            "the server would refuse this request: "
            + "; ".join(f"{FLAGS.get(v.field, v.field)}: {v.message}" for v in refused.violations)
        )
    facts = RequestFacts(
        text_chars=len(args.text),
        model=args.model,
        priority=args.priority,
        request_id=args.request_id or new_request_id(),
        headers=headers,
    )
    print(explain(table, facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
