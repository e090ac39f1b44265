"""One request from a client through two real processes: orchestrator, then capability."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from classify_common.nodes import NODES
from tests.conftest import (
    BUDGETED_MODEL,
    REPO_ROOT,
    STACK_API_KEY,
    STATIC_ONLY_FLAGS,
    STRIKER,
    ProcessStarter,
    Stack,
    processing_routes,
    stack_starter,
)

CLASSIFY_METHOD = "/ai.classify.v1.ClassifyService/Classify"


@pytest.fixture(scope="module")
def cli_stack(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    """One default stack for the command-line client's tests: they only call it, so
    they share it instead of starting one each (about 5 s a stack)."""
    starter = ProcessStarter(tmp_path_factory.mktemp("cli-stack"))
    try:
        yield stack_starter(starter.work_dir, model_root, starter)(api_key=STACK_API_KEY)
    finally:
        starter.stop_all()


def rpc_log_line(lines: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    matches = [
        line
        for line in lines
        if line.get("event") == "rpc"
        and line.get("method") == CLASSIFY_METHOD
        and line.get("request_id") == request_id
    ]
    assert len(matches) == 1, f"expected one access-log line for {request_id}: {lines}"
    return matches[0]


def test_request_crosses_both_processes_with_one_request_id_and_one_trace(
    stack: Stack,
) -> None:
    orchestrator, capability = stack.orchestrator, stack.capability
    with grpc.insecure_channel(f"127.0.0.1:{orchestrator.port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        response, call = stub.Classify.with_call(
            pb.ClassifyRequest(text=STRIKER, request_id="e2e-1"),
            timeout=30,
            metadata=(("authorization", f"Bearer {STACK_API_KEY}"),),
        )
        stub.Classify(
            pb.ClassifyRequest(text=STRIKER, request_id="e2e-no-deadline"),
            metadata=(("authorization", f"Bearer {STACK_API_KEY}"),),
        )

    assert response.labels[0].name == "sports"
    assert response.status == pb.RESULT_STATUS_DONE
    # Both processes run on the default loop (classify_common/event_loop.py).
    assert orchestrator.ready["event_loop"] == capability.ready["event_loop"] == "uvloop"
    assert response.route == "default"
    assert response.fallback is False
    assert response.model.name == "topic-minilm"
    assert response.request_id == "e2e-1"
    assert dict(call.trailing_metadata())["x-trace-id"] == response.trace_id

    # Both processes logged the call under the same request ID and trace ID.
    front_lines = orchestrator.read_logs()
    front = rpc_log_line(front_lines, "e2e-1")
    back = rpc_log_line(capability.read_logs(), "e2e-1")
    assert front["code"] == back["code"] == "OK"
    assert front["trace_id"] == back["trace_id"] == response.trace_id

    # One line per service, with what the call did and where its time went.
    assert front["route"] == "default"
    assert (front["model"], front["model_version"]) == ("topic-minilm", response.model.version)
    assert (front["attempts"], front["fallback"]) == (1, False)
    # response_send ends after the line is written: it is in the trace and the metric.
    assert set(front["timings_ms"]) == {
        n.name for n in NODES if n.service == "orchestrator" and n.name != "response_send"
    }
    assert (back["model"], back["batch_size"], back["worker"]) == ("topic-minilm", 1, "cpu:0")
    assert set(back["timings_ms"]) == {n.name for n in NODES if n.service == "capability"}
    assert front["duration_ms"] >= front["timings_ms"]["upstream_call"] >= back["duration_ms"]
    # What each deadline left when the handler began: the client's 30 s at the front
    # door; at the capability, the backend's 5 s timeout, the shorter of the two.
    assert 25_000 < front["time_left_on_arrival_ms"] <= 30_000
    assert 0 < back["time_left_on_arrival_ms"] <= 5_000
    assert "time_left_on_arrival_ms" not in rpc_log_line(front_lines, "e2e-no-deadline")
    # Neither the text nor the key is ever logged.
    for line in (front, back):
        assert "striker" not in json.dumps(line).lower()
        assert STACK_API_KEY not in json.dumps(line)


def run_client(target_port: int, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "classify_client",
            "--target",
            f"127.0.0.1:{target_port}",
            *args,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CLASSIFY_API_KEY": STACK_API_KEY},
    )


def test_command_line_client_prints_sports_for_the_striker_sentence(
    cli_stack: Stack,
) -> None:
    orchestrator = cli_stack.orchestrator
    result = run_client(orchestrator.port, STRIKER)
    assert result.returncode == 0, result.stderr
    first_line, *rest = result.stdout.splitlines()
    assert first_line.split()[0] == "sports"
    assert any(line.startswith("model     topic-minilm") for line in rest)
    assert any(line.startswith("request   ") and len(line.split()[1]) == 32 for line in rest)


def test_command_line_client_reports_violations_and_ids_on_a_reject(
    cli_stack: Stack,
) -> None:
    orchestrator = cli_stack.orchestrator
    result = run_client(orchestrator.port, "--top-k", "0", "--request-id", "cli-reject", "   ")
    assert result.returncode == 1
    assert result.stderr.startswith("error: INVALID_ARGUMENT")
    assert (
        "  text: must contain at least one non-whitespace character [text.not_blank]"
        in result.stderr
    )
    assert "  top_k: " in result.stderr
    assert "request   cli-reject" in result.stderr


def test_command_line_client_classifies_a_file_with_one_line_per_text(
    cli_stack: Stack, tmp_path: Path
) -> None:
    orchestrator = cli_stack.orchestrator
    texts = tmp_path / "texts.txt"
    shares = "Shares fell sharply after the bank cut its profit forecast"
    texts.write_text(f"{STRIKER}\n   \n{shares}\n")
    result = run_client(orchestrator.port, "--file", str(texts))
    assert result.returncode == 1, result.stderr  # the blank line is refused
    striker, blank, business = result.stdout.splitlines()
    assert striker.split()[0] == "sports"
    assert striker.split("  ")[-1].startswith("The striker scored twice")
    assert blank.startswith("error       INVALID_ARGUMENT: ")
    assert "items[1].text" in blank
    assert re.search(r"\(request [0-9a-f-]+, trace [0-9a-f]{32}\)", blank), blank
    assert business.split()[0] == "business"


def test_command_line_client_says_processing_with_the_request_id_and_wait_polls_to_done(
    start_stack: Callable[..., Stack],
) -> None:
    stack = start_stack(
        api_key=STACK_API_KEY, routes=processing_routes, capability_flags=STATIC_ONLY_FLAGS
    )
    port = stack.orchestrator.port
    pending = run_client(port, "--model", BUDGETED_MODEL, "--request-id", "cli-pending", STRIKER)
    fetched = run_client(port, "--result", "cli-pending", "--wait")
    waited = run_client(port, "--model", BUDGETED_MODEL, "--wait", STRIKER)

    assert pending.returncode == 0, pending.stderr
    first_line, *rest = pending.stdout.splitlines()
    assert first_line.startswith("PROCESSING  ")
    assert "request cli-pending" in pending.stdout
    assert "--result cli-pending" in pending.stdout
    assert "request   cli-pending" in rest
    assert not any(line.startswith("model ") for line in rest)
    for done in (fetched, waited):
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[0] == "sports"
    assert "request   cli-pending" in fetched.stdout.splitlines()
