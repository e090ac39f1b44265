r"""The `classify` command, built on this package's ClassifyClient.

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
and trace IDs (with `--json`, also that error as a JSON object on stdout), and
exits 1. Overload and unavailability are retried first, as the server's
RetryInfo says (classify_client.retry).

With `--file`, the lines are sent with ClassifyBatch (up to 1,024 per call) and
one line is printed per text, in order: its best label and score, PROCESSING,
or its error with the request ID to look it up by. It exits 1 when any text failed.
`--timeout` counts per call: the run's deadline is `--timeout` times the number
of calls, shared among them, so a long file is not cut short by a deadline meant
for one call; texts that still fail past it end with a `hint:` line.
A line ends at "\n" only (a "\r" before it is dropped), so the output lines up
with the file's lines; the file is UTF-8, with or without a byte-order mark.

Input it cannot use (a file it cannot read or that is not UTF-8, an empty
`--file`) is reported as one `error:` line, exit 1, before any call; Ctrl-C
ends it with `error: interrupted`, exit 130; a reader of its output that stops
early (`| head`) ends it quietly, exit 141.
"""

from __future__ import annotations

import argparse
import io
import ipaddress
import json
import math
import os
import re
import sys
import time
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from classify_client import (
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT_SECONDS,
    BatchItem,
    ClassifyClient,
    ClassifyError,
    StillProcessing,
    Unauthenticated,
    pb,
)
from classify_client._shared import (
    STILL_PROCESSING,
    batch_chunks,
    checked_batch_request_id,
    new_request_id,
    renumbered,
)
from classify_client.errors import RESULT_TRACE_ID
from classify_client.retry import MAX_TIMEOUT_SECONDS, is_connection_failure

LOCAL_KEY_FILE = Path(".run/api-key")
# After an UNAUTHENTICATED answer to a call that sent no key: run outside the checkout,
# the command finds no `.run/api-key` and says nothing of it otherwise.
NO_KEY_HINT = (
    f"hint: no API key was sent: pass --api-key or set CLASSIFY_API_KEY ({LOCAL_KEY_FILE} "
    "is read from the current directory, for a target on this machine only)"
)
# gRPC target schemes that name addresses, and those that name this machine only.
DNS_SCHEME = "dns:"
ADDRESS_SCHEMES = ("ipv4:", "ipv6:")
LOCAL_SCHEMES = ("unix:", "unix-abstract:")
# A gRPC target URI of any scheme: `scheme://...` (host:port has no `//` after its colon).
URI_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
BAR_WIDTH = 30
# The timeout a --file call is sent with once the run's deadline has passed.
SPENT_SECONDS = 0.001
# ErrorInfo metadata of a call a backend did not answer within its routes.yaml timeout.
BACKEND_TIMEOUT_METADATA = "backend_timeout_ms"
PRIORITIES = ("batch", "interactive")
# Characters of each text echoed on its `--file` output line.
ECHO_CHARS = 60
# Exit statuses: a failed call or text, or unusable input; Ctrl-C (128 + SIGINT, as
# shells report a command that SIGINT ended).
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
# Its output's reader went away: 128 + SIGPIPE, as a command SIGPIPE ended reports.
EXIT_BROKEN_PIPE = 141
# CLASSIFY_TLS values; unset or empty is off.
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"", "0", "false", "no", "off"})


class UnusableInput(Exception):
    """A file or value the command cannot use; reported as one `error:` line."""


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
        if response.truncated:
            lines.append(
                "text      truncated: longer than the model reads; its beginning was classified"
            )
    lines += [
        f"route     {response.route}{'  [fallback]' if response.fallback else ''}",
        f"request   {response.request_id}",
        f"trace     {response.trace_id}",
    ]
    return "\n".join(lines)


def format_item(item: BatchItem, text: str) -> str:
    """One `--file` output line: best label and score (marked when the text was cut or
    a fallback answered), PROCESSING, or the error."""
    echo = text if len(text) <= ECHO_CHARS else text[: ECHO_CHARS - 1] + "…"
    if item.error is not None:
        error = item.error
        work_trace = error.metadata.get(RESULT_TRACE_ID)
        work = f", work trace {work_trace}" if work_trace else ""
        return (
            f"error       {error.code.name}: {error_message(error)}  "
            f"(request {error.request_id or '-'}, trace {error.trace_id or '-'}{work})  "
            f"{echo!r}"
        )
    response = item.response
    assert response is not None
    if response.status == pb.RESULT_STATUS_PROCESSING:
        return f"processing  fetch with --result {response.request_id}  {echo!r}"
    best = response.labels[0]
    # The marks stand before the text, so that the text stays the line's last column.
    marks = "".join(
        f"[{mark}]  "
        for mark, shown in (("truncated", response.truncated), ("fallback", response.fallback))
        if shown
    )
    return f"{best.name:<10}  {best.score:5.3f}  {marks}{printable(echo)}"


def printable(text: str) -> str:
    """`text` with each character a terminal or a line reader would act on (a control
    character such as a vertical tab or a carriage return, U+2028 and U+2029, a
    direction override) written as its escape, so that output line n stays the answer
    to input line n; a backslash is doubled, so an escape is never the text's own.
    Other characters, CJK spaces and joiners included, are echoed as they are."""
    return "".join(_ECHOED.get(c) or _escaped(c) for c in text)


def _escaped(character: str) -> str:
    if unicodedata.category(character) in ("Cc", "Zl", "Zp") or character in _DIRECTION_MARKS:
        return repr(character)[1:-1] if character.isascii() else f"\\u{ord(character):04x}"
    return character


# Bidirectional embeddings, overrides and isolates: they reorder what follows on screen.
_DIRECTION_MARKS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_ECHOED = {"\\": "\\\\"}


def error_message(error: ClassifyError) -> str:
    """The error's message, where a StillProcessing's names the flag that fetches the
    result rather than the library call."""
    if isinstance(error, StillProcessing):
        return f"{STILL_PROCESSING}; fetch it later with --result {error.request_id}"
    return error.message


def format_error(error: ClassifyError) -> str:
    """The failed call's code and message, its violations, its IDs, and what the retries
    that came before it met (the notes retry.Attempts.give_up adds)."""
    lines = [f"error: {error.code.name}: {error_message(error)}"]
    lines += [f"  {v.field}: {v.description} [{v.rule}]" for v in error.violations]
    lines.append(f"request   {error.request_id or '-'}")
    lines.append(f"trace     {error.trace_id or '-'}")
    if work_trace := error.metadata.get(RESULT_TRACE_ID):
        # A kept result's failed work (GetResult): its trace is the one to open, the
        # poll's own says only that it was fetched.
        lines.append(f"work      {work_trace}  (the trace the result's work ran in)")
    lines += [f"retries   {note}" for note in getattr(error, "__notes__", ())]
    return "\n".join(lines)


def request_int(text: str) -> int:
    """--top-k, --max-length: an integer the request's int32 field can hold (a larger
    one crashed the command with protobuf's "Value out of range"); the service checks
    the rest of its bounds and names them."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not -(2**31) <= value < 2**31:
        raise argparse.ArgumentTypeError(f"{text} does not fit a 32-bit integer")
    return value


def never_reached_a_server(error: ClassifyError) -> bool:
    """Whether no attempt of the call reached a server: every one failed to connect
    (gRPC's own UNAVAILABLE: no ErrorInfo, no trace ID), the last perhaps still waiting
    for the server when the deadline passed. Every answer of this service carries a
    trace ID and an ErrorInfo reason."""
    attempts = (*error.attempt_errors, error)
    return (
        not any(attempt.trace_id for attempt in attempts)
        and (is_connection_failure(error) or error.code == grpc.StatusCode.DEADLINE_EXCEEDED)
        and any(is_connection_failure(attempt) for attempt in attempts)
        and all(is_connection_failure(attempt) for attempt in error.attempt_errors)
    )


def unreachable_hint(target: str, error: ClassifyError) -> str:
    """After a call that never reached a server."""
    waited = (
        "; the client waited for it to come up until the deadline"
        if error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        else ""
    )
    return (
        f"hint: no server answered at {target}: nothing listens there, or it cannot be "
        f"reached (DNS, firewall, load balancer, TLS){waited}"
    )


def deadline_hint(what_failed: str, timeout: float) -> str:
    """After `--file` texts failed because the deadline passed."""
    return (
        f"hint: {what_failed} failed past the deadline: "
        f"--timeout ({timeout:g} s) counts per ClassifyBatch call of up to 1,024 "
        "lines; raise it for a slow service"
    )


def failed_past_the_deadline(error: ClassifyError | None) -> bool:
    """A deadline that passed, not a result that is kept (StillProcessing says how to
    fetch that), nor a backend's own timeout in the service's routes (ErrorInfo
    `backend_timeout_ms`), which no --timeout raises."""
    return (
        error is not None
        and error.code == grpc.StatusCode.DEADLINE_EXCEEDED
        and not isinstance(error, StillProcessing)
        and BACKEND_TIMEOUT_METADATA not in error.metadata
    )


def item_json(item: BatchItem) -> dict[str, Any]:
    if item.response is not None:
        return {"response": json_format.MessageToDict(item.response)}
    assert item.error is not None
    return error_json(item.error)


def error_json(error: ClassifyError) -> dict[str, Any]:
    """A failed call's or text's error, as `--json` prints it."""
    return {
        "error": {
            "code": error.code.name,
            "message": error_message(error),
            "reason": error.reason,
            "requestId": error.request_id,
            "traceId": error.trace_id,
            **(
                {"resultTraceId": error.metadata[RESULT_TRACE_ID]}
                if RESULT_TRACE_ID in error.metadata
                else {}
            ),
            "violations": [
                {"field": v.field, "rule": v.rule, "description": v.description}
                for v in error.violations
            ],
        }
    }


def api_key(flag: str | None, target: str) -> str | None:
    """The API key from the flag, the environment or the local key file, without the
    whitespace around it: a key pasted or echoed into a variable often ends in a
    newline, and gRPC refuses to send a header value that holds one. The local key
    file is `make run`'s, for the stack on this machine: it is not sent to a target
    elsewhere, in plaintext by default, because the command ran in a checkout."""
    if flag is not None and not flag.strip():
        # Dropped, the call went out without a key, or with CLASSIFY_API_KEY's (an
        # empty one too: `--api-key "$UNSET_VARIABLE"`).
        raise UnusableInput("--api-key is blank: give the key, or leave the flag out")
    for given in (flag, os.environ.get("CLASSIFY_API_KEY")):
        if given and given.strip():
            return given.strip()
    if not is_loopback(target) or not LOCAL_KEY_FILE.is_file():
        return None
    try:
        # utf-8-sig: an editor that saves a byte-order mark put it in the key, which
        # then held "a character a header cannot carry".
        return LOCAL_KEY_FILE.read_text(encoding="utf-8-sig").strip() or None
    except (OSError, UnicodeError) as error:
        raise UnusableInput(f"cannot read the key file {LOCAL_KEY_FILE}: {error}") from error


def is_loopback(target: str) -> bool:
    """Whether `target` (host:port, or a gRPC URI such as dns:///host:port,
    ipv4:127.0.0.1:port or unix:path) names this machine: a Unix socket, or by a
    loopback address or `localhost` (every address, where an ipv4:/ipv6: URI lists
    several). Anything else is not: a query or fragment (gRPC dials what comes
    before it, and `dns:///192.0.2.2:1?x=/127.0.0.1:1` was taken for loopback by
    its last part), a DNS server named in the URI (`dns://server/localhost:1`), or
    another scheme, whose resolver decides the address (`xds:///...`)."""
    if "?" in target or "#" in target:
        return False
    if target.startswith(LOCAL_SCHEMES):
        return True
    if target.startswith(DNS_SCHEME):
        address = target.removeprefix(DNS_SCHEME)
        if address.startswith("//"):
            if not address.startswith("///"):
                return False
            address = address.removeprefix("///")
        return is_loopback_address(address)
    if target.startswith(ADDRESS_SCHEMES):
        addresses = target.split(":", 1)[1]
        return all(is_loopback_address(one) for one in addresses.split(","))
    if URI_SCHEME.match(target):
        return False
    return is_loopback_address(target)


def is_loopback_address(address: str) -> bool:
    """Whether `address` (host:port, [v6]:port, or a host alone) is `localhost` or a
    loopback address."""
    if address.startswith("["):
        host = address[1:].split("]", 1)[0]
    elif address.count(":") == 1:
        host = address.split(":", 1)[0]
    else:
        host = address  # no port, or an IPv6 address without brackets
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def timeout_seconds(value: str) -> float:
    """`--timeout`: seconds above 0 and at most MAX_TIMEOUT_SECONDS (inf, 0 or less, or
    past what gRPC's deadline can hold would only end the call at once with
    DEADLINE_EXCEEDED)."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds") from None
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_SECONDS):
        raise argparse.ArgumentTypeError(
            f"{value!r} must be a number of seconds above 0 and at most "
            f"{MAX_TIMEOUT_SECONDS} (one year)"
        )
    return seconds


def file_path(value: str) -> str:
    """A file flag's value: not empty (`--ca-file "$CA"` with CA unset would otherwise
    read as no flag, and TLS off would send the API key in the clear)."""
    if not value.strip():
        raise argparse.ArgumentTypeError("an empty path: name the file, or leave the flag out")
    return value


def file_variable(name: str) -> str | None:
    """A file variable's value; an empty one is an unset one (a template's `${X:-}`), as
    for CLASSIFY_TARGET."""
    return os.environ.get(name, "").strip() or None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="classify", description="Classify a text.")
    parser.add_argument("text", nargs="?", help="the text to classify")
    parser.add_argument(
        "--file",
        type=file_path,
        help="classify each line of this file (- for stdin) with ClassifyBatch",
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
        # An empty variable is an unset one (a template's `${TARGET:-}`).
        default=os.environ.get("CLASSIFY_TARGET", "").strip() or DEFAULT_TARGET,
        help=f"orchestrator host:port [env CLASSIFY_TARGET; default {DEFAULT_TARGET}]",
    )
    parser.add_argument("--top-k", type=request_int, help="only the k best labels")
    parser.add_argument("--max-length", type=request_int, help="token budget (default 512)")
    parser.add_argument("--model", default="", help="model name hint for routing")
    parser.add_argument("--priority", choices=PRIORITIES, default="interactive")
    parser.add_argument("--request-id", default="", help="your own request ID")
    parser.add_argument(
        "--timeout",
        type=timeout_seconds,
        default=DEFAULT_TIMEOUT_SECONDS,
        help="deadline in seconds, retries and --wait polling included; with --file, "
        "per ClassifyBatch call of up to 1,024 lines (the run has it times the calls, "
        "shared)",
    )
    parser.add_argument("--json", action="store_true", help="print the response as JSON")
    parser.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="TLS, verified with the system's trusted CAs [env CLASSIFY_TLS=1 or 0]",
    )
    parser.add_argument(
        "--ca-file",
        type=file_path,
        help="TLS, verified with this CA bundle instead [env CLASSIFY_CA_FILE]",
    )
    parser.add_argument(
        "--cert-file",
        type=file_path,
        help="client certificate (PEM), for a front door that asks for one "
        "[env CLASSIFY_CERT_FILE]",
    )
    parser.add_argument(
        "--key-file",
        type=file_path,
        help="the client certificate's private key (PEM) [env CLASSIFY_KEY_FILE]",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"API key [env CLASSIFY_API_KEY; else, for a loopback --target, {LOCAL_KEY_FILE}, "
        "written by `make run`]",
    )
    args = parser.parse_args(argv)
    if sum(given is not None for given in (args.text, args.file, args.result)) != 1:
        parser.error("give one of: a text, --file or --result")
    if args.tls is None:
        setting = os.environ.get("CLASSIFY_TLS", "").strip().lower()
        if setting not in TRUE_WORDS | FALSE_WORDS:
            parser.error(f"CLASSIFY_TLS={setting!r}: use 1 or 0 (true/false, yes/no, on/off)")
        args.tls = setting in TRUE_WORDS
    return args


def read_lines(path: str) -> list[str]:
    """The texts of a `--file` (`-`: stdin), one per line: see split_lines. Read as bytes
    and decoded here, so that stdin is UTF-8 whatever the locale says."""
    name = "- (stdin)" if path == "-" else path
    if path == "-" and sys.stdin is None:
        raise UnusableInput(f"cannot read --file {name}: it is closed")
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as error:
        raise UnusableInput(f"cannot read --file {name}: {error.strerror or error}") from error
    try:
        source = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        # NOTE: error.start counts in error.object, which is past a byte-order mark.
        line = error.object.count(b"\n", 0, error.start) + 1
        byte = error.object[error.start]
        raise UnusableInput(
            f"--file {name} is not UTF-8 text: line {line} holds the byte 0x{byte:02x}"
        ) from error
    texts = split_lines(source)
    if not texts:
        # NOTE: the server refuses an empty batch (INVALID_ARGUMENT); say why here.
        raise UnusableInput(f"--file {name} has no lines to classify")
    return texts


def split_lines(source: str) -> list[str]:
    r"""One text per line: split at "\n" alone, dropping a "\r" before it (CRLF files).
    NOTE: not str.splitlines(), which also splits at \v, \f, \x1c-\x1e, \x85,
    U+2028 and U+2029, so that one line would become several texts and the output
    would no longer line up with the file."""
    if not source:
        return []
    lines = source.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line starts no new one
    return [line.removesuffix("\r") for line in lines]


def classify_file(client: ClassifyClient, texts: list[str], args: argparse.Namespace) -> int:
    """Send the texts with ClassifyBatch, a call at a time; print one line (or JSON
    object) per text as each call is answered. Printed at the end of the whole run, a
    100 MB file held every request and answer at once (1.08 GB) and `| head -1` read
    nothing until the last call was back.

    `--timeout` counts per call: the run's deadline is that times their number (a 10 s
    default for a whole 4,000-line file failed its last 1,440 lines), shared, so that a
    slow call may take time the quicker ones left (a deadline of its own for each call
    failed a first call that took 1.5 s of 1, and with it the whole run). A call after
    the first that fails as a whole is the error of its texts and of those after it."""
    chunks = list(batch_chunks(texts))
    if len(chunks) > 1 and not client.wait_for_connection(args.timeout):
        # Waited for within the run's deadline, a server that was down held a
        # 10,240-line file ten times --timeout.
        raise UnusableInput(
            f"no server answered at {args.target} within --timeout ({args.timeout:g} s): "
            "nothing listens there, or it cannot be reached (DNS, firewall, load "
            "balancer, TLS)"
        )
    deadline = time.monotonic() + min(args.timeout * len(chunks), MAX_TIMEOUT_SECONDS)
    # One name for every call of the run, as one classify_batch gives its calls.
    request_id = checked_batch_request_id(args.request_id) or new_request_id()
    failed = late = 0
    # A call that reached no server (it went after the first call): the hint is that
    # nothing answered, not to raise --timeout for a slow service.
    unreached: ClassifyError | None = None
    for number, chunk in enumerate(chunks):
        chunk_texts = [texts[index] for index in chunk]
        try:
            items = client.classify_batch(
                chunk_texts,
                top_k=args.top_k,
                max_length=args.max_length,
                model=args.model,
                priority=args.priority,
                request_id=request_id,
                # Spent, the run's deadline still makes a call (the client refuses a
                # timeout of 0), which fails at once: DEADLINE_EXCEEDED, as the rest.
                timeout=max(deadline - time.monotonic(), SPENT_SECONDS),
                wait=args.wait,
            )
        except ClassifyError as error:
            if number == 0:
                raise  # refused whole before any answer: one error, as for one text
            chunk_texts = texts[chunk[0] :]
            items = [BatchItem(error=error)] * len(chunk_texts)
        else:
            # The server numbered the items of its one call from 0; the user's lines
            # are numbered across the file (line 1,028 is items[1027], not items[3]).
            items = [
                BatchItem(error=renumbered(item.error, f"items[{position}]", f"items[{index}]"))
                if item.error is not None and position != index
                else item
                for position, (item, index) in enumerate(zip(items, chunk, strict=True))
            ]
        for item, text in zip(items, chunk_texts, strict=True):
            if args.json:
                print(json.dumps(item_json(item), ensure_ascii=False))
            else:
                print(format_item(item, text))
        failed += sum(not item.ok for item in items)
        for item in items:
            if item.error is not None and never_reached_a_server(item.error):
                unreached = unreached or item.error
            elif failed_past_the_deadline(item.error):
                late += 1
        if len(chunk_texts) > len(chunk):
            break  # this call's error was also that of the texts after it
    if unreached is not None:
        print(unreachable_hint(args.target, unreached), file=sys.stderr)
    if late:
        texts_failed = f"{late} text{'s' if late != 1 else ''}"
        print(deadline_hint(texts_failed, args.timeout), file=sys.stderr)
    return 0 if not failed else EXIT_FAILED


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


def open_client(args: argparse.Namespace) -> ClassifyClient:
    files = {
        "the CA file": args.ca_file or file_variable("CLASSIFY_CA_FILE"),
        "the certificate file": args.cert_file or file_variable("CLASSIFY_CERT_FILE"),
        "the key file": args.key_file or file_variable("CLASSIFY_KEY_FILE"),
    }
    ca_file, cert_file, key_file = files.values()
    key = api_key(args.api_key, args.target)
    try:
        return ClassifyClient(
            args.target,
            api_key=key,
            tls=args.tls,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
            timeout=args.timeout,
        )
    except OSError as error:
        what = next((name for name, path in files.items() if path == error.filename), "a file")
        raise UnusableInput(f"cannot read {what} {error.filename}: {error.strerror}") from error
    except ValueError as error:  # a key no header can carry, half a client certificate
        raise UnusableInput(str(error)) from error


def require_utf8(value: str, what: str) -> None:
    """A command-line argument that was not UTF-8 reaches Python with stand-ins for its
    bytes, which no request can carry."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise UnusableInput(f"{what} is not UTF-8 text") from error


def run(args: argparse.Namespace) -> int:
    """Read the input, then make the call(s) and print the outcome."""
    if args.file is not None:
        try:
            checked_batch_request_id(args.request_id)
        except ValueError as error:
            raise UnusableInput(f"--request-id: {error}") from error
    texts = read_lines(args.file) if args.file is not None else None
    for value, what in (
        (args.text, "the text"),
        (args.request_id, "--request-id"),
        (args.model, "--model"),
        (args.result, "--result"),
    ):
        if value is not None:
            require_utf8(value, what)
    with open_client(args) as client:
        if texts is not None:
            return classify_file(client, texts, args)
        response = classify_one(client, args)
    if args.json:
        print(json.dumps(json_format.MessageToDict(response), indent=2, ensure_ascii=False))
    else:
        print(format_response(response))
    return 0


def run_and_report(args: argparse.Namespace) -> int:
    """`run`, with its refusals and failures reported (their `error:` lines and hints)."""
    try:
        return run(args)
    except UnusableInput as problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_FAILED
    except ClassifyError as error:
        if args.json:
            indent = None if args.file is not None else 2  # as the answers print
            print(json.dumps(error_json(error), indent=indent, ensure_ascii=False))
        print(format_error(error), file=sys.stderr)
        if isinstance(error, Unauthenticated) and api_key(args.api_key, args.target) is None:
            print(NO_KEY_HINT, file=sys.stderr)
        if never_reached_a_server(error):
            print(unreachable_hint(args.target, error), file=sys.stderr)
        if (
            args.file is not None
            and failed_past_the_deadline(error)
            and not never_reached_a_server(error)  # no server to be slow: no timeout hint
        ):
            print(deadline_hint("the first call", args.timeout), file=sys.stderr)
        return EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for stream in (sys.stdout, sys.stderr):
        # A text or label the output's encoding cannot hold (a redirected stdout on
        # Windows is cp1252) is written escaped, not a UnicodeEncodeError traceback.
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    try:
        # NOTE: the reports are inside this try too: a `--json` error printed into a
        # closed pipe ended in a traceback.
        status = run_and_report(args)
        sys.stdout.flush()  # here, where a failure to write is reported, not at exit
        return status
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went (`| head`): nothing more to say, and nowhere to say it.
        # stdout points at /dev/null from here, so the interpreter's last flush at
        # exit does not fail on the closed pipe too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as error:
        # The output cannot be written (a full disk: `> /dev/full`); every other
        # OSError is reported as UnusableInput where it happens.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        print(f"error: cannot write the output: {error.strerror or error}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
