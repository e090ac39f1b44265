"""`make run` starts both servers, and the call the README shows is answered."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, closed_port
from tests.unit.test_readme import MAKEFILE, README, VENV_PYTHON, make_prerequisites, shell_commands

# `make run` prints this once both servers report SERVING.
READY_LINE = "Ready. In another terminal:"
STACK_READY_TIMEOUT_SECONDS = 180.0


def test_make_run_serves_the_call_the_readme_shows(tmp_path: Path, model_root: Path) -> None:
    """`make run` is `setup bundles`, then tools/run_stack.py: the suite has done the
    setup, the model_root fixture builds the bundles, and this runs the script."""
    assert make_prerequisites("run") == ["setup", "bundles"]
    assert re.search(r"^run:.*\n\t\$\(PY\) tools/run_stack\.py$", MAKEFILE.read_text(), re.M)
    readme_call = next(
        words for words in shell_commands(README.read_text()) if words[0] == VENV_PYTHON
    )

    capability_port, orchestrator_port = closed_port(), closed_port()
    environment = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "PYTHONUNBUFFERED": "1",
        "CAPABILITY_PORT": str(capability_port),
        "CAPABILITY_METRICS_PORT": "-1",
        "CAPABILITY_MODEL_ROOT": str(model_root),
        "CAPABILITY_DEVICE": "cpu",
        "CAPABILITY_WATCH_SECONDS": "0",
        "ORCHESTRATOR_PORT": str(orchestrator_port),
        "ORCHESTRATOR_METRICS_PORT": "-1",
    }
    environment.pop("ORCHESTRATOR_ROUTES_FILE", None)
    # routes.yaml names the default capability port: run_stack gives the orchestrator
    # a copy that names CAPABILITY_PORT.
    shutil.copy(REPO_ROOT / "routes.yaml", tmp_path / "routes.yaml")
    stack_log = tmp_path / "make-run.log"
    # In tmp_path, so its .run/ (key, keys file, internal token) is the test's own.
    with stack_log.open("w") as log:
        stack = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "tools" / "run_stack.py")],
            cwd=tmp_path,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + STACK_READY_TIMEOUT_SECONDS
        while READY_LINE not in stack_log.read_text():
            assert stack.poll() is None, stack_log.read_text()
            assert time.monotonic() < deadline, stack_log.read_text()
            time.sleep(0.2)
        # The call the README shows is the one `make run` prints, with the port it
        # was given instead of the default.
        printed_call = [*readme_call[:3], "--target", f"127.0.0.1:{orchestrator_port}"]
        printed_call += readme_call[3:]
        assert " ".join(printed_call) in stack_log.read_text().replace('"', "")
        # One copy per capability port: a second stack on other ports keeps to its own.
        assert sorted(path.name for path in (tmp_path / ".run").glob("routes*.yaml")) == [
            f"routes-{capability_port}.yaml"
        ]

        result = subprocess.run(
            [sys.executable, *printed_call[1:]],
            cwd=tmp_path,  # the client reads the key from .run/api-key here
            env=environment,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        first_line, *rest = result.stdout.splitlines()
        assert first_line.split()[0] == "sports"
        assert any(line.startswith("model     topic-minilm") for line in rest)
    finally:
        # As a closed terminal stops it (Ctrl-C and SIGTERM take the same path): the
        # servers run in sessions of their own, so the hangup reaches this script only,
        # which it killed, leaving both servers running.
        stack.send_signal(signal.SIGHUP)
        stack.wait(timeout=60)
    assert stack.returncode == 0, stack_log.read_text()
    for port in (capability_port, orchestrator_port):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
