"""Check routes files, and explain where a request would go.

    python -m orchestrator.routing check [routes.yaml ...]
    python -m orchestrator.routing explain [--routes routes.yaml] --text "..." \\
        [--model topic-static] [--priority batch] [--header x-tenant=acme] [--request-id ID]

`check` exits 1 and names the file, line and path of the first bad value of
each file that fails; use it in CI on every change to routes.yaml.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from classify_common.context import new_request_id
from orchestrator.routing.explain import explain, summarize
from orchestrator.routing.match import PRIORITIES, RequestFacts
from orchestrator.routing.table import RoutesFileError, load_routes


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
            parser.error(f"--header {header!r} is not NAME=VALUE")
        headers[name.lower()] = value
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
