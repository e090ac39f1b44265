"""The `classify` command (classify_client.cli) against real in-process servers: one
output line per input line, an `error:` line (never a traceback) for input it cannot
use, JSON errors with `--json`, and the request ID of every failed call.

The command runs in a worker thread (`asyncio.to_thread`), as the servers share the
test session's event loop; Ctrl-C is sent to it as its own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from capability.metrics import MODEL_TEXTS_TOTAL
from capability.server import CapabilityServer
from classify_client import ClassifyClient, ClassifyError, pb
from classify_client._shared import BatchItem
from classify_client.aio import AsyncClassifyClient
from classify_client.cli import (
    UnusableInput,
    api_key,
    error_json,
    failed_past_the_deadline,
    format_error,
    format_item,
    main,
)
from classify_client.gen.ai.classify.v1 import classify_service_pb2_grpc as pb_grpc
from orchestrator.metrics import PROCESSING_TOTAL
from orchestrator.server import OrchestratorServer
from tests.conftest import STRIKER, closed_port, metric_sum, wait_until
from tests.unit.capability.test_serving import device_occupied
from tests.unit.client.test_client import (
    CLIENT_MADE_REQUEST_ID,
    KEY,
    front_door,
    scripted_server,
    target,
)
from tests.unit.test_tls import make_certificates, tls_front_door

SHORT = "Shares fell after the earnings call"
# The command as a process of its own, in this virtualenv.
COMMAND = (sys.executable, "-m", "classify_client")


@pytest.fixture(autouse=True)
def bare_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No CLASSIFY_* variables and no `.run/api-key` of the repository's own stack."""
    for name in (
        "CLASSIFY_API_KEY",
        "CLASSIFY_TARGET",
        "CLASSIFY_CA_FILE",
        "CLASSIFY_CERT_FILE",
        "CLASSIFY_KEY_FILE",
        "CLASSIFY_TLS",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The command's exit status, stdout and stderr."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


async def run_against(
    server: OrchestratorServer, capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, str, str]:
    status = await asyncio.to_thread(main, ["--target", target(server), *argv])
    out, err = capsys.readouterr()
    return status, out, err


def nowhere() -> str:
    return f"127.0.0.1:{closed_port()}"


@pytest.mark.parametrize(
    ("flag", "make", "problem"),
    [
        ("--file", lambda path: None, "cannot read --file {path}: No such file or directory"),
        ("--file", Path.mkdir, "cannot read --file {path}: Is a directory"),
        (
            "--ca-file",
            lambda path: None,
            "cannot read the CA file {path}: No such file or directory",
        ),
        ("--ca-file", Path.mkdir, "cannot read the CA file {path}: Is a directory"),
    ],
)
def test_a_file_it_cannot_read_is_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, flag: str, make: object, problem: str
) -> None:
    path = tmp_path / "given"
    make(path)  # type: ignore[operator]
    text = () if flag == "--file" else (STRIKER,)
    assert run(capsys, "--target", nowhere(), flag, str(path), *text) == (
        1,
        "",
        f"error: {problem.format(path=path)}\n",
    )


@pytest.mark.parametrize("mark", [b"", b"\xef\xbb\xbf"], ids=["plain", "after-a-bom"])
def test_a_file_that_is_not_utf8_is_one_error_line_naming_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, mark: bytes
) -> None:
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(mark + "first\nun café\n".encode("latin-1"))
    assert run(capsys, "--target", nowhere(), "--file", str(latin1)) == (
        1,
        "",
        f"error: --file {latin1} is not UTF-8 text: line 2 holds the byte 0xe9\n",
    )


def test_stdin_that_is_not_utf8_is_one_error_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\n")))
    assert run(capsys, "--target", nowhere(), "--file", "-") == (
        1,
        "",
        "error: --file - (stdin) is not UTF-8 text: line 1 holds the byte 0xe9\n",
    )


@pytest.mark.parametrize("content", [b"", b"\xef\xbb\xbf"], ids=["empty", "bom-only"])
def test_a_file_without_lines_is_an_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, content: bytes
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_bytes(content)
    assert run(capsys, "--target", nowhere(), "--file", str(empty)) == (
        1,
        "",
        f"error: --file {empty} has no lines to classify\n",
    )


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5", "1e10", "31536001"])
def test_a_timeout_that_is_not_finite_and_above_zero_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["--target", nowhere(), "--timeout", value, STRIKER])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"error: argument --timeout: {value!r} must be a number of seconds above 0 and at "
        "most 31536000 (one year)\n"
    )


@pytest.mark.parametrize("flag", ["--ca-file", "--cert-file", "--key-file", "--file"])
def test_an_empty_file_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    """`--ca-file "$CA"` with CA unset read as no flag at all: TLS off, and the API key
    sent in the clear."""
    with pytest.raises(SystemExit) as refused:
        main(["--target", nowhere(), flag, "", STRIKER])
    assert refused.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"error: argument {flag}: an empty path: name the file, or leave the flag out\n"
    )


async def test_empty_file_variables_count_as_unset(
    orchestrator: OrchestratorServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A template's `${CA:-}` set CLASSIFY_CA_FILE to "", which was read as a path (the
    current folder): `error: cannot read a file .: Is a directory`."""
    for name in ("CLASSIFY_CA_FILE", "CLASSIFY_CERT_FILE", "CLASSIFY_KEY_FILE"):
        monkeypatch.setenv(name, "")
    status, out, err = await run_against(orchestrator, capsys, "--timeout", "20", STRIKER)
    assert (status, err) == (0, "")
    assert out.startswith("sports")


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (("--model", "topic-\udcff", STRIKER), "--model"),
        (("--result", "req-\udcff"), "--result"),
    ],
)
def test_a_model_or_result_id_that_is_not_utf8_is_one_error_line(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], problem: str
) -> None:
    """Bytes that are not UTF-8 on the command line (`--model $'\\xff'`) ended in a
    traceback."""
    assert run(capsys, "--target", nowhere(), *argv) == (
        1,
        "",
        f"error: {problem} is not UTF-8 text\n",
    )


def test_a_closed_stdin_is_one_error_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`classify --file - <&-`: Python sets sys.stdin to None, and the read ended in an
    AttributeError's traceback."""
    monkeypatch.setattr(sys, "stdin", None)
    assert run(capsys, "--target", nowhere(), "--file", "-") == (
        1,
        "",
        "error: cannot read --file - (stdin): it is closed\n",
    )


def test_a_json_error_printed_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """The error's JSON was printed outside the handler for a closed pipe: a traceback
    and status 1, where an answer printed into the same pipe ends quietly with 141."""
    command = subprocess.Popen(
        [*COMMAND, "--target", nowhere(), "--timeout", "1", "--json", STRIKER],
        cwd=tmp_path,
        env={**os.environ, "CLASSIFY_API_KEY": KEY},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert command.stdout is not None
    command.stdout.close()  # as a reader that has gone
    _, err = command.communicate(timeout=60)
    assert (command.returncode, err) == (141, b"")


def test_a_call_no_server_answered_shows_the_request_id_it_was_sent_under(
    capsys: pytest.CaptureFixture[str],
) -> None:
    target = nowhere()
    status, out, err = run(capsys, "--target", target, "--timeout", "1", STRIKER)
    assert (status, out) == (1, "")
    (request_id,) = re.findall(r"^request   (\S+)$", err, re.MULTILINE)
    assert CLIENT_MADE_REQUEST_ID.fullmatch(request_id)
    # The retry waited for the server until the deadline; what each attempt met is shown.
    assert err.startswith("error: DEADLINE_EXCEEDED: ")
    assert re.search(r"^retries   gave up after 2 attempts in [01]\.\d\d s$", err, re.M)
    assert re.search(
        r"^retries   an earlier attempt failed: UNAVAILABLE: .*\(request " + request_id, err, re.M
    )
    # A DEADLINE_EXCEEDED read alone sends the on-call to a slow backend.
    assert err.endswith(
        "hint: no server answered at 127.0.0.1:"
        f"{target.rsplit(':', 1)[1]}: nothing listens there, or it cannot be reached "
        "(DNS, firewall, load balancer, TLS); the client waited for it to come up until "
        "the deadline\n"
    )


async def test_a_file_line_ends_at_newline_only_so_each_line_is_one_text(
    orchestrator: OrchestratorServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Each of these is a line break to str.splitlines(), and none of them to a file.
    breaks = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
    lines = tmp_path / "lines.txt"
    lines.write_text(f"{STRIKER}{breaks}end\n{SHORT}{breaks}\n", encoding="utf-8")
    status, out, err = await run_against(orchestrator, capsys, "--json", "--file", str(lines))
    assert (status, err) == (0, "")
    answers = [json.loads(line) for line in out.split("\n")[:-1]]
    assert [answer["response"]["status"] for answer in answers] == ["RESULT_STATUS_DONE"] * 2


async def test_output_the_terminal_cannot_encode_is_written_escaped_not_a_traceback(
    orchestrator: OrchestratorServer, tmp_path: Path
) -> None:
    """A redirected stdout on Windows is cp1252, which has no bar character (█)."""
    done = await asyncio.to_thread(
        subprocess.run,
        [*COMMAND, "--target", target(orchestrator), "--api-key", KEY, f"{STRIKER} \u4e2d"],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "cp1252"},
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, b"")
    assert b"\\u2588" in done.stdout  # the bars


async def test_output_that_cannot_be_written_is_one_error_line_not_a_traceback(
    orchestrator: OrchestratorServer, tmp_path: Path
) -> None:
    """A full disk (`> /dev/full`). Blank lines: each is refused on its own at once,
    and its refusal is a line of output like any answer."""
    blanks = tmp_path / "blanks.txt"
    blanks.write_text("\n" * 2000)
    command = [*COMMAND, "--target", target(orchestrator), "--api-key", KEY, "--file", str(blanks)]

    def run_into_a_full_disk() -> subprocess.CompletedProcess[bytes]:
        with open("/dev/full", "wb") as full:
            return subprocess.run(
                command, stdout=full, stderr=subprocess.PIPE, timeout=60, check=False
            )

    done = await asyncio.to_thread(run_into_a_full_disk)
    assert done.returncode == 1
    assert done.stderr == b"error: cannot write the output: No space left on device\n"


def test_a_file_for_a_server_that_is_down_fails_within_the_timeout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The run's deadline is --timeout times its calls; waited for whole, a server that
    was down held a 10,240-line file ten times --timeout."""
    lines = tmp_path / "lines.txt"
    lines.write_text(f"{SHORT}\n" * 3000)  # three calls
    place = nowhere()
    assert run(capsys, "--target", place, "--file", str(lines), "--timeout", "0.5") == (
        1,
        "",
        f"error: no server answered at {place} within --timeout (0.5 s): nothing listens "
        "there, or it cannot be reached (DNS, firewall, load balancer, TLS)\n",
    )


def test_a_one_call_file_for_a_server_that_is_down_gets_no_hint_to_raise_the_timeout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """No server answered, so none was slow: the hint to raise --timeout beside the one
    that nothing listens there sent the user the wrong way."""
    lines = tmp_path / "lines.txt"
    lines.write_text(f"{SHORT}\n")  # one call: sent without waiting for a connection
    place = nowhere()
    status, out, err = run(capsys, "--target", place, "--file", str(lines), "--timeout", "0.5")
    assert (status, out) == (1, "")
    assert err.splitlines()[-1].startswith(f"hint: no server answered at {place}: ")
    assert "raise it" not in err


async def test_a_file_line_past_the_first_call_is_named_by_its_place_in_the_file(
    orchestrator: OrchestratorServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Each call of up to 1,024 lines was numbered from 0 by the server: line 1,028's
    error named items[3], as line 4's did. Each error line carries both IDs. (Blank
    lines, refused before any model: the suite need not compute a thousand texts.)"""
    texts = [SHORT] + [""] * 1027 + ["   ", SHORT]
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(texts) + "\n")
    status, out, _ = await run_against(orchestrator, capsys, "--file", str(lines))
    assert status == 1
    output = out.splitlines()
    assert len(output) == 1030
    assert output[0].split()[0] == output[-1].split()[0] == "business"
    for index in range(1, 1029):
        line = output[index]
        assert line.startswith("error       INVALID_ARGUMENT: "), line
        assert f"items[{index}].text" in line, line
        assert re.search(r"\(request [0-9a-f-]+, trace [0-9a-f]{32}\)", line), line
    status, out, _ = await run_against(orchestrator, capsys, "--json", "--file", str(lines))
    assert status == 1
    fields = [
        violation["field"]
        for answer in map(json.loads, out.splitlines())
        if "error" in answer
        for violation in answer["error"]["violations"]
    ]
    assert fields == [f"items[{index}].text" for index in range(1, 1029)]


async def test_a_file_with_a_byte_order_mark_and_crlf_echoes_each_text_as_written(
    orchestrator: OrchestratorServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lines = tmp_path / "windows.txt"
    lines.write_bytes(f"\ufeff{SHORT}\r\n{STRIKER[:40]}\r\n".encode())
    status, out, err = await run_against(orchestrator, capsys, "--file", str(lines))
    assert (status, err) == (0, "")
    shares, striker = out.split("\n")[:-1]
    assert shares.split("  ")[-1] == SHORT
    assert striker.split("  ")[-1] == STRIKER[:40]


async def test_json_prints_a_failed_call_as_a_json_error(
    orchestrator: OrchestratorServer, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = await run_against(
        orchestrator, capsys, "--json", "--request-id", "cli-json-1", "   "
    )
    assert status == 1
    error = json.loads(out)["error"]
    assert (error["code"], error["reason"], error["requestId"], len(error["traceId"])) == (
        "INVALID_ARGUMENT",
        "INVALID_REQUEST",
        "cli-json-1",
        32,
    )
    assert [(v["field"], v["rule"]) for v in error["violations"]] == [("text", "text.not_blank")]
    assert err.startswith("error: INVALID_ARGUMENT: ")
    assert "hint:" not in err


@pytest.mark.parametrize("source", ["environment", "flag"])
async def test_an_api_key_with_surrounding_whitespace_is_sent_without_it(
    capability: CapabilityServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    source: str,
) -> None:
    flag: tuple[str, ...] = ()
    if source == "environment":
        monkeypatch.setenv("CLASSIFY_API_KEY", f"{KEY}\n")
    else:
        flag = ("--api-key", f" {KEY}\n")
    async with front_door(capability, tmp_path) as server:
        status, out, err = await run_against(server, capsys, *flag, STRIKER)
    assert (status, err) == (0, "")
    assert out.split()[0] == "sports"


async def test_wait_past_the_timeout_says_to_fetch_the_result_with_the_result_flag(
    capability: CapabilityServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.setenv("CLASSIFY_API_KEY", KEY)
    async with (
        front_door(capability, tmp_path, budget="200ms") as server,
        device_occupied(capability.pool.workers[0]),
    ):
        status, out, err = await run_against(
            server, capsys, "--wait", "--timeout", "1", "--request-id", "cli-late-1", STRIKER
        )
    assert (status, out) == (1, "")
    assert err.split("\n")[0] == (
        "error: DEADLINE_EXCEEDED: the result was still PROCESSING when the deadline came; "
        "fetch it later with --result cli-late-1"
    )


async def test_ctrl_c_ends_the_command_with_an_error_line_and_status_130(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    async with (
        front_door(capability, tmp_path, budget="200ms") as server,
        device_occupied(capability.pool.workers[0]),
    ):
        # NOTE: subprocess, not asyncio's: it starts the child with vfork, so none of
        # gRPC's fork handlers runs in a copy of this process and its live servers.
        # A test run started in the background by a non-interactive shell (`make test
        # &`) ignores SIGINT, and a child inherits an ignored signal: the command then
        # ran on, as a shell's background job rightly does, until its call's backend
        # timed out. Handled here while the child starts, it starts with the default.
        ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            command = await asyncio.to_thread(
                subprocess.Popen,
                [*COMMAND, "--target", target(server), "--wait", "--timeout", "60", STRIKER],
                cwd=tmp_path,
                env={**os.environ, "CLASSIFY_API_KEY": KEY},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        finally:
            signal.signal(signal.SIGINT, ignored)
        # Answered PROCESSING: the command is now polling GetResult.
        await wait_until(
            lambda: (
                command.poll() is not None
                or metric_sum(server.registry, PROCESSING_TOTAL, route="default") == 1
            ),
            "the command's call answered PROCESSING",
        )
        assert command.returncode is None, command.communicate()
        command.send_signal(signal.SIGINT)
        out, err = await asyncio.to_thread(command.communicate, timeout=60)
    # The whole of stderr on a failure: a server error's line alone (its trace ID)
    # said nothing of what the command had been answered instead.
    assert (command.poll(), out, err.decode().splitlines()[-1]) == (
        130,
        b"",
        "error: interrupted",
    ), err.decode()
    assert b"Traceback" not in err


async def test_output_piped_into_a_reader_that_stops_early_ends_quietly(
    capability: CapabilityServer, tmp_path: Path
) -> None:
    """`classify --file ... | head -1`: the reader goes after one line, the command's
    next writes find the pipe closed; it ends with 141 (SIGPIPE's status) and no
    traceback. Each call's lines are printed as it is answered: the run stops there,
    where it used to send every call before it printed a line."""
    lines = tmp_path / "many.txt"
    lines.write_text("".join(f"{STRIKER} ({number})\n" for number in range(3000)))
    computed = metric_sum(capability.registry, MODEL_TEXTS_TOTAL, model="topic-static")
    async with front_door(capability, tmp_path, model="topic-static") as server:
        command = await asyncio.to_thread(
            subprocess.Popen,
            [*COMMAND, "--target", target(server), "--file", str(lines), "--timeout", "60"],
            cwd=tmp_path,
            env={**os.environ, "CLASSIFY_API_KEY": KEY},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert command.stdout is not None
        assert command.stderr is not None
        first = await asyncio.to_thread(command.stdout.readline)
        command.stdout.close()  # as `head -1` exits
        status = await asyncio.to_thread(command.wait, 60)
        err = await asyncio.to_thread(command.stderr.read)
    assert first.decode().startswith("sports")
    assert (status, err) == (141, b"")
    # The first call's 1,024, its lines more than the pipe holds: none after it.
    computed = metric_sum(capability.registry, MODEL_TEXTS_TOTAL, model="topic-static") - computed
    assert computed < 3000


async def test_a_file_lines_control_characters_are_echoed_as_escapes(
    orchestrator: OrchestratorServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Echoed raw, a vertical tab or U+2028 in a text broke "output line n answers input
    line n" for a reader that splits lines as Python does."""
    lines = tmp_path / "lines.txt"
    lines.write_text(
        f"{SHORT}\x0bmore\u2028end\n{STRIKER[:30]} \\x0b\u3000\u202eend\n", encoding="utf-8"
    )
    status, out, err = await run_against(orchestrator, capsys, "--file", str(lines))
    assert (status, err) == (0, "")
    assert len(out.splitlines()) == 2
    first, second = out.splitlines()
    assert first.endswith(f"{SHORT}\\x0bmore\\u2028end")
    # A backslash of the text's own is doubled; an ideographic space is text, echoed.
    assert second.endswith(f"{STRIKER[:30]} \\\\x0b\u3000\\u202eend")


@pytest.mark.parametrize(
    ("setting", "flag", "answered"),
    [("0", (), True), ("false", (), True), ("1", ("--no-tls",), True), ("1", (), False)],
)
async def test_classify_tls_is_read_as_on_or_off_and_the_flag_wins(
    orchestrator: OrchestratorServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    setting: str,
    flag: tuple[str, ...],
    answered: bool,
) -> None:
    """`CLASSIFY_TLS=false` (anything but empty or 0) turned TLS on, and nothing could
    turn it off again."""
    monkeypatch.setenv("CLASSIFY_TLS", setting)
    # A TLS call to this plaintext server fails however long it is given: it was given
    # 20 s of retries, the suite's slowest CLI test.
    seconds = "20" if answered else "2"
    status, _, _ = await run_against(orchestrator, capsys, *flag, "--timeout", seconds, STRIKER)
    assert (status == 0) is answered


def test_a_classify_tls_value_that_is_neither_on_nor_off_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLASSIFY_TLS", "maybe")
    with pytest.raises(SystemExit) as usage:
        run(capsys, STRIKER)
    assert usage.value.code == 2
    assert "CLASSIFY_TLS='maybe': use 1 or 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (("--api-key", "ck_k\u00e9y", STRIKER), "error: the API key holds a character"),
        (("--api-key", "ck_one\ntwo", STRIKER), "error: the API key holds a character"),
        (("--request-id", "no spaces", "--file", "-"), "error: --request-id: request_id"),
    ],
)
def test_a_key_or_batch_request_id_no_header_can_carry_is_one_error_line(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: tuple[str, ...],
    problem: str,
) -> None:
    """The key was INTERNAL from gRPC (a bug, by the error table) and a log line; a
    ClassifyBatch's request ID was left out without a word."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{STRIKER}\n"))
    status, out, err = run(capsys, "--target", nowhere(), *argv)
    assert (status, out) == (1, "")
    assert err.startswith(problem)
    assert len(err.splitlines()) == 1


async def test_the_command_presents_a_client_certificate_from_its_flags(
    capability: CapabilityServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    make_certificates(tmp_path)
    ca = tmp_path / "ca.pem"
    async with tls_front_door(tmp_path, capability.port, tls_client_ca_file=ca) as server:
        status, out, err = await run_against(
            server,
            capsys,
            "--ca-file",
            str(ca),
            "--cert-file",
            str(tmp_path / "client.pem"),
            "--key-file",
            str(tmp_path / "client.key"),
            STRIKER,
        )
    assert (status, err) == (0, "")
    assert out.split()[0] == "sports"
    status, _, err = run(capsys, "--cert-file", str(tmp_path / "client.pem"), STRIKER)
    assert (status, err) == (1, "error: a client certificate needs both cert_file and key_file\n")


def test_the_local_key_file_is_sent_only_to_a_target_on_this_machine(tmp_path: Path) -> None:
    """`.run/api-key` is `make run`'s key for the local stack; it went to any --target
    the command was pointed at from a checkout, in plaintext by default."""
    (tmp_path / ".run").mkdir()
    (tmp_path / ".run" / "api-key").write_text("ck_local\n")
    for here in (
        "127.0.0.1:50051",
        "localhost:50051",
        "[::1]:50051",
        "dns:///localhost:1",
        "ipv4:127.0.0.1:50051",
        "ipv6:[::1]:50051",
        "unix:/tmp/classify.sock",
    ):
        assert api_key(None, here) == "ck_local"
    for elsewhere in (
        "classify.example.com:443",
        "10.0.0.7:50051",
        "dns:///classify:50051",
        "ipv4:127.0.0.1:50051,10.0.0.7:50051",
        # gRPC dials what comes before a query or fragment: the key went to 192.0.2.2.
        "dns:///192.0.2.2:50051?x=/127.0.0.1:1",
        "192.0.2.2:50051#/127.0.0.1:1",
        "dns://192.0.2.53/localhost:1",  # another DNS server says what localhost is
        "xds:///127.0.0.1:5",  # another resolver decides the address
    ):
        assert api_key(None, elsewhere) is None, elsewhere
    assert api_key("ck_given", "classify.example.com:443") == "ck_given"
    # An empty flag (`--api-key "$UNSET"`) is refused, not taken for no flag.
    with pytest.raises(UnusableInput, match="--api-key is blank"):
        api_key("", "127.0.0.1:50051")


def test_a_local_key_file_saved_with_a_byte_order_mark_is_read_without_it(
    tmp_path: Path,
) -> None:
    (tmp_path / ".run").mkdir()
    (tmp_path / ".run" / "api-key").write_text("\ufeffck_local\r\n", encoding="utf-8")
    assert api_key(None, "127.0.0.1:50051") == "ck_local"


def test_a_blank_api_key_flag_is_one_error_line_not_a_call_without_a_key(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It was dropped without a word, and the call went out with no key."""
    status, out, err = run(capsys, "--api-key", "   ", STRIKER)
    assert (status, out) == (1, "")
    assert err == "error: --api-key is blank: give the key, or leave the flag out\n"


async def test_a_call_refused_for_want_of_a_key_says_where_a_key_comes_from(
    capability: CapabilityServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Run outside the checkout, the command finds no `.run/api-key` and sent none: the
    refusal alone did not say so. A wrong key gets no hint (one was sent)."""
    async with front_door(capability, tmp_path) as server:
        status, _, err = await run_against(server, capsys, STRIKER)
        wrong_status, _, wrong_err = await run_against(
            server, capsys, "--api-key", "ck_wrong", STRIKER
        )
    assert status == wrong_status == 1
    lines = err.splitlines()
    assert lines[0].startswith("error: UNAUTHENTICATED")
    assert lines[-1].startswith("hint: no API key was sent: pass --api-key or set CLASSIFY_API_KEY")
    assert "hint:" not in wrong_err


def test_tls_files_that_cannot_work_are_one_error_line_before_any_call(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """gRPC logged native errors in the handshake and the call failed UNAVAILABLE."""
    make_certificates(tmp_path)
    not_pem = tmp_path / "not-pem.txt"
    not_pem.write_text("not a certificate\n")
    status, out, err = run(capsys, "--target", nowhere(), "--ca-file", str(not_pem), STRIKER)
    assert (status, out) == (1, "")
    assert err.startswith(f"error: ca_file {not_pem} holds no usable PEM CA certificate")
    assert len(err.splitlines()) == 1
    pair = ("--cert-file", str(tmp_path / "client.pem"), "--key-file", str(tmp_path / "ca.key"))
    status, out, err = run(capsys, "--target", nowhere(), "--tls", *pair, STRIKER)
    assert (status, out) == (1, "")
    assert "are not a PEM certificate and its private key" in err
    assert len(err.splitlines()) == 1


class SlowBatches(pb_grpc.ClassifyServiceServicer):
    """Answers each ClassifyBatch call after the next of `delays` (seconds), every item
    DONE with one label."""

    def __init__(self, delays: list[float]) -> None:
        self.delays = delays
        self.calls = 0

    async def Classify(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    async def GetResult(  # noqa: N802 - the gRPC method's name
        self, request: pb.GetResultRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    async def ClassifyBatch(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyBatchResponse:
        delay = self.delays[min(self.calls, len(self.delays) - 1)]
        self.calls += 1
        await asyncio.sleep(delay)
        done = pb.ClassifyResponse(
            status=pb.RESULT_STATUS_DONE, labels=[pb.Label(name="sports", score=0.9)]
        )
        return pb.ClassifyBatchResponse(
            results=[pb.ClassifyBatchResult(response=done) for _ in request.items]
        )


def slow_batches(delays: list[float]) -> contextlib.AbstractAsyncContextManager[str]:
    """The address of a SlowBatches server."""
    return scripted_server(SlowBatches(delays))


async def test_the_timeout_of_a_file_is_each_batch_calls_so_a_long_file_is_not_cut_short(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Three calls of 0.4 s each under `--timeout 1`: one deadline for the whole file
    failed the third call's line DEADLINE_EXCEEDED, without a word of why."""
    lines = tmp_path / "lines.txt"
    lines.write_text(f"{SHORT}\n" * 2049)
    async with slow_batches([0.4]) as address:
        status = await asyncio.to_thread(
            main, ["--target", address, "--timeout", "1", "--file", str(lines)]
        )
    out, err = capsys.readouterr()
    assert (status, err) == (0, "")
    assert [line.split()[0] for line in out.splitlines()] == ["sports"] * 2049


async def test_texts_failed_past_the_deadline_end_with_a_hint_about_the_timeout(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lines = tmp_path / "lines.txt"
    lines.write_text(f"{SHORT}\n" * 1025)
    async with slow_batches([0, 5]) as address:
        status = await asyncio.to_thread(
            main, ["--target", address, "--timeout", "0.5", "--file", str(lines)]
        )
    out, err = capsys.readouterr()
    assert status == 1
    assert [line.split()[:2] for line in out.splitlines()[1023:]] == [
        ["sports", "0.900"],
        ["error", "DEADLINE_EXCEEDED:"],
    ]
    assert err == (
        "hint: 1 text failed past the deadline: --timeout (0.5 s) counts per "
        "ClassifyBatch call of up to 1,024 lines; raise it for a slow service\n"
    )


class StopsAfterOneBatch(SlowBatches):
    """Answers the first ClassifyBatch call, then its server stops (`gone` is set once
    it has)."""

    def __init__(self) -> None:
        super().__init__([0])
        self.server: grpc.aio.Server | None = None
        self.gone = asyncio.Event()

    async def ClassifyBatch(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyBatchResponse:
        # Stopping with a grace: this call is still answered, no later one is taken in.
        assert self.server is not None
        stopping = asyncio.ensure_future(self.server.stop(grace=5))
        stopping.add_done_callback(lambda _: self.gone.set())
        await asyncio.sleep(0.05)
        return await super().ClassifyBatch(request, context)


async def test_a_server_lost_after_the_first_call_gets_the_unreachable_hint_not_the_timeouts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The texts after the server went failed DEADLINE_EXCEEDED, having waited for it to
    come back; the hint said to raise --timeout for a slow service, though no server
    was there to be slow."""
    lines = tmp_path / "lines.txt"
    lines.write_text(f"{SHORT}\n" * 1025)
    servicer = StopsAfterOneBatch()
    server = grpc.aio.server()
    pb_grpc.add_ClassifyServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    servicer.server = server
    await server.start()
    place = f"127.0.0.1:{port}"
    try:
        status = await asyncio.to_thread(
            main, ["--target", place, "--timeout", "1", "--file", str(lines)]
        )
    finally:
        await server.stop(grace=0)
    out, err = capsys.readouterr()
    assert servicer.gone.is_set()
    assert status == 1
    last = out.splitlines()[1024]
    assert last.split()[:2] == ["error", "DEADLINE_EXCEEDED:"], last
    assert err.splitlines()[-1].startswith(f"hint: no server answered at {place}: "), err
    assert "raise it" not in err


class RefusingFrontDoor(pb_grpc.ClassifyServiceServicer):
    """Answers every Classify UNAVAILABLE with an ErrorInfo reason and no trace ID, as a
    server (or a proxy that speaks the service's errors) that was reached does."""

    async def Classify(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(reason="MODEL_UNAVAILABLE", domain="test"))
        status = status_pb2.Status(
            code=grpc.StatusCode.UNAVAILABLE.value[0], message="no model", details=[info]
        )
        await context.abort_with_status(rpc_status.to_status(status))
        raise AssertionError("abort_with_status returns only by raising")

    async def GetResult(  # noqa: N802 - the gRPC method's name
        self, request: pb.GetResultRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")

    async def ClassifyBatch(  # noqa: N802 - the gRPC method's name
        self, request: pb.ClassifyBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClassifyBatchResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not scripted")


async def test_a_server_that_answered_gets_no_hint_that_none_did(
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ClassifyServiceServicer_to_server(RefusingFrontDoor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        status = await asyncio.to_thread(
            main, ["--target", f"127.0.0.1:{port}", "--timeout", "1", STRIKER]
        )
    finally:
        await server.stop(grace=0)
    out, err = capsys.readouterr()
    assert (status, out) == (1, "")
    assert err.startswith("error: UNAVAILABLE: no model\n")
    assert "hint:" not in err


def test_a_kept_results_failed_work_shows_the_trace_it_ran_in() -> None:
    """GetResult of a result whose work failed names the work's trace in
    `result_trace_id`, the one to open in Jaeger (the poll's own trace shows only the
    fetch): the command printed neither it nor, with --json, a field for it."""
    failed = ClassifyError(
        "the model server could not be reached",
        code=grpc.StatusCode.UNAVAILABLE,
        reason="MODEL_UNAVAILABLE",
        request_id="kept-1",
        trace_id="poll-trace",
        metadata={"result_trace_id": "work-trace"},
    )
    assert format_error(failed).splitlines()[1:] == [
        "request   kept-1",
        "trace     poll-trace",
        "work      work-trace  (the trace the result's work ran in)",
    ]
    assert error_json(failed)["error"]["resultTraceId"] == "work-trace"
    line = format_item(BatchItem(error=failed), "a headline")
    assert "(request kept-1, trace poll-trace, work trace work-trace)" in line


def test_a_backend_timeout_in_the_services_routes_gets_no_hint_to_raise_the_timeout() -> None:
    """The service says so in the ErrorInfo (`backend_timeout_ms`): raising --timeout
    would change nothing."""
    own = ClassifyError("deadline", code=grpc.StatusCode.DEADLINE_EXCEEDED)
    backends = ClassifyError(
        "backend hung did not answer within its 300 ms timeout",
        code=grpc.StatusCode.DEADLINE_EXCEEDED,
        reason="DEADLINE_EXPIRED",
        metadata={"backend": "hung", "backend_timeout_ms": "300"},
    )
    assert (failed_past_the_deadline(own), failed_past_the_deadline(backends)) == (True, False)


async def test_a_cut_text_is_said_to_be_truncated(
    orchestrator: OrchestratorServer, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = await run_against(orchestrator, capsys, " ".join([STRIKER] * 250))
    assert status == 0
    said = "\ntext      truncated: longer than the model reads; its beginning was classified\n"
    assert said in out
    status, out, _ = await run_against(orchestrator, capsys, STRIKER)
    assert (status, "truncated" in out) == (0, False)


async def test_file_lines_mark_a_cut_text_and_leave_the_text_last(
    orchestrator: OrchestratorServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lines = tmp_path / "lines.txt"
    lines.write_text(f"{' '.join([STRIKER] * 250)}\n{STRIKER}\n", encoding="utf-8")
    status, out, err = await run_against(orchestrator, capsys, "--file", str(lines))
    assert (status, err) == (0, "")
    cut, whole = out.split("\n")[:-1]
    assert cut.split("  ")[-2:] == ["[truncated]", STRIKER[:59] + "…"]
    assert "[" not in whole
    assert whole.split("  ")[-1] == STRIKER[:59] + "…"


def test_a_file_line_answered_by_a_fallback_says_so() -> None:
    answer = pb.ClassifyResponse(
        status=pb.RESULT_STATUS_DONE,
        labels=[pb.Label(name="sports", score=0.5)],
        fallback=True,
        truncated=True,
    )
    assert format_item(BatchItem(response=answer), "text") == (
        "sports      0.500  [truncated]  [fallback]  text"
    )


def test_a_number_no_request_can_carry_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--top-k 99999999999 crashed the command with protobuf's "Value out of range"."""
    with pytest.raises(SystemExit) as exited:
        main(["--target", nowhere(), "--top-k", "99999999999", STRIKER])
    assert exited.value.code == 2
    assert capsys.readouterr().err.endswith(
        "error: argument --top-k: 99999999999 does not fit a 32-bit integer\n"
    )


@pytest.mark.parametrize(
    ("target", "port"),
    [
        ("127.0.0.1:99999", "99999"),
        ("[::1]:65536", "65536"),
        ("dns:///localhost:70000", "70000"),
        ("ipv4:127.0.0.1:50051,127.0.0.1:0", "0"),
    ],
    ids=["host", "ipv6", "dns", "list"],
)
def test_a_target_port_out_of_range_is_refused_naming_the_target(target: str, port: str) -> None:
    """gRPC takes the port modulo 65536: 127.0.0.1:99999 was dialled as 127.0.0.1:34463,
    and the command waited out its deadline on a port nobody named."""
    refused = subprocess.run(
        [*COMMAND, "--target", target, "--timeout", "30", STRIKER],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert refused.stderr == f"error: target {target!r}: port {port} is outside 1..65535\n"
    for client in (ClassifyClient, AsyncClassifyClient):
        with pytest.raises(ValueError, match=r"^target .*: port \d+ is outside 1\.\.65535$"):
            client(target)
