"""The classify-client wheel, installed alone into a fresh virtualenv, against the stack.

`make dist` builds the wheel; a new virtualenv gets it and its declared
dependencies (at the versions this repository pins) and nothing of the
repository; a script run there classifies a text and a batch, follows PROCESSING
answers to DONE, and is retried after a rate-limit refusal's RetryInfo, and the
wheel's `classify` command answers. The orchestrator's own counters confirm what
the script saw.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from orchestrator.metrics import PROCESSING_TOTAL, RATE_LIMITED_TOTAL
from orchestrator.security import new_key
from tests.conftest import (
    BUDGETED_MODEL,
    LIMITED_TENANT,
    REPO_ROOT,
    STACK_API_KEY,
    STATIC_ONLY_FLAGS,
    STRIKER,
    Stack,
    processing_routes,
    run_make,
)
from tests.system.test_metrics_scrape import samples, value

DIST_DIR = REPO_ROOT / "build" / "dist"
# The wheel's declared dependencies, installed at the versions the lock pins.
DEPENDENCIES = ("grpcio", "protobuf", "googleapis-common-protos")
LIMITED_KEY = new_key()

# Run by the fresh virtualenv's interpreter, outside the repository:
# argv = target, key, rate-limited key, striker text, budgeted model hint.
SCRIPT = """
import importlib.util, json, sys
import classify_client
from classify_client import ClassifyClient, pb

target, key, limited_key, text, budgeted = sys.argv[1:]
seen = {
    "client_file": classify_client.__file__,
    "repository_packages": [
        name for name in ("classify_common", "orchestrator", "ai", "buf")
        if importlib.util.find_spec(name) is not None
    ],
}
status = pb.ResultStatus.Name
with ClassifyClient(target, api_key=key, timeout=60) as client:
    one = client.classify(text, top_k=2)
    seen["one"] = [status(one.status), one.labels[0].name, len(one.labels)]
    items = client.classify_batch([text, "   ", text])
    seen["batch"] = [
        item.response.labels[0].name if item.response else type(item.error).__name__
        for item in items
    ]
    seen["batch_error_fields"] = [v.field for v in items[1].error.violations]
    pending = client.classify(text, model=budgeted)
    fetched = client.get_result(pending.request_id, wait=True)
    followed = client.classify(text, model=budgeted, wait=True)
    seen["pending"] = [status(pending.status), len(pending.labels)]
    seen["fetched"] = [status(fetched.status), fetched.labels[0].name,
                       fetched.request_id == pending.request_id]
    seen["followed"] = [status(followed.status), followed.labels[0].name]
retries = []
with ClassifyClient(target, api_key=limited_key, on_retry=retries.append, timeout=60) as client:
    seen["limited"] = [client.classify(text).labels[0].name for _ in range(2)]
seen["retries"] = [
    {
        "method": r.method,
        "attempt": r.attempt,
        "error": type(r.error).__name__,
        "code": r.error.code.name,
        "retry_after": r.error.retry_after_seconds,
        "delay": r.delay_seconds,
    }
    for r in retries
]
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def client_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a fresh virtualenv holding the wheel and its dependencies only."""
    built = run_make("dist")
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = DIST_DIR.glob("classify_client-*.whl")
    venv = tmp_path_factory.mktemp("client-venv")
    # Without pip of its own (installing it takes about 6 s): this interpreter's pip
    # installs into the new one (`--python`), about 3 s faster than its own would.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    pins = [f"{name}=={metadata.version(name)}" for name in DEPENDENCIES]
    installed = subprocess.run(
        [*(sys.executable, "-m", "pip", "--python", python), "install", "--quiet", wheel, *pins],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    return python


def run_script(python: Path, stack: Stack, cwd: Path) -> dict[str, Any]:
    result = subprocess.run(
        [
            str(python),
            "-c",
            SCRIPT,
            f"127.0.0.1:{stack.orchestrator.port}",
            STACK_API_KEY,
            LIMITED_KEY,
            STRIKER,
            BUDGETED_MODEL,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    seen: dict[str, Any] = json.loads(result.stdout)
    return seen


def test_the_wheel_alone_classifies_follows_processing_and_retries_after_retry_info(
    client_python: Path, start_stack: Callable[..., Stack], tmp_path: Path
) -> None:
    stack = start_stack(
        api_key=STACK_API_KEY,
        rate_limited_key=LIMITED_KEY,
        routes=processing_routes,
        capability_flags=STATIC_ONLY_FLAGS,
    )
    seen = run_script(client_python, stack, tmp_path)
    scrape = samples(stack.orchestrator)

    assert Path(seen["client_file"]).is_relative_to(client_python.parent.parent)
    assert seen["repository_packages"] == []
    assert seen["one"] == ["RESULT_STATUS_DONE", "sports", 2]
    assert seen["batch"][:2] == ["sports", "InvalidRequest"]
    assert seen["batch_error_fields"] == ["items[1].text"]
    # Both budgeted calls were answered PROCESSING, then followed with GetResult.
    assert seen["pending"] == ["RESULT_STATUS_PROCESSING", 0]
    assert seen["fetched"] == ["RESULT_STATUS_DONE", "sports", True]
    assert seen["followed"] == ["RESULT_STATUS_DONE", "sports"]
    assert value(scrape, PROCESSING_TOTAL, route="budgeted") == 2
    # The second call at once was refused with a RetryInfo and tried again no
    # sooner than it said; the server refused it once only, so the retry found a
    # token in the tenant's bucket.
    assert seen["limited"] == ["sports", "sports"]
    (retry,) = seen["retries"]
    assert retry | {"retry_after": None, "delay": None} == {
        "method": "Classify",
        "attempt": 1,
        "error": "RateLimited",
        "code": "RESOURCE_EXHAUSTED",
        "retry_after": None,
        "delay": None,
    }
    assert 0 < retry["retry_after"] <= retry["delay"]
    assert value(scrape, RATE_LIMITED_TOTAL, tenant=LIMITED_TENANT) == 1

    # The wheel's `classify` command, from the same virtualenv.
    command = subprocess.run(
        [str(client_python.parent / "classify"), "--top-k", "1", STRIKER],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            "PATH": "/usr/bin:/bin",
            "CLASSIFY_TARGET": f"127.0.0.1:{stack.orchestrator.port}",
            "CLASSIFY_API_KEY": STACK_API_KEY,
        },
    )
    assert command.returncode == 0, command.stderr
    assert command.stdout.split()[0] == "sports"
