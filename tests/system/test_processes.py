"""Several orchestrator processes on one port (--processes), sharing a real Redis."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from ai.classify.v1 import classify_service_pb2 as pb
from ai.classify.v1 import classify_service_pb2_grpc
from classify_common.metrics import RPC_REQUESTS_TOTAL
from orchestrator.config import DEFAULT_CONCURRENCY
from orchestrator.metrics import (
    API_KEYS_FILE_REFUSED,
    API_KEYS_RELOADS_TOTAL,
    BACKEND_CONCURRENCY_LIMIT,
    RATE_LIMITED_TOTAL,
)
from orchestrator.security import hash_key
from orchestrator.state.connection import STATE_OPERATIONS_TOTAL
from orchestrator.workers import LOOP_HEARTBEAT, WORKERS
from tests.conftest import (
    REPO_ROOT,
    STACK_API_KEY,
    STRIKER,
    RedisServer,
    ServerProcess,
    Stack,
    wait_until,
)
from tests.system.test_metrics_scrape import Scrape, samples, value

CLASSIFY = "/ai.classify.v1.ClassifyService/Classify"
BURST = 12


def start_workers(
    start_stack: Callable[..., Stack], redis_server: RedisServer, keys_file: Path, processes: int
) -> Stack:
    """The stack with its orchestrator as `processes` workers on one port, sharing Redis;
    `keys_file` accepts STACK_API_KEY for tenant `stack`."""
    return start_stack(
        api_key=STACK_API_KEY,
        orchestrator_flags=(
            *("--processes", str(processes), "--state-url", redis_server.url),
            # Long: on a busy test machine a Redis round trip can take longer than the
            # default, and the check would then fall back to the process's own bucket.
            *("--state-timeout-ms", "5000"),
            *("--api-keys-file", str(keys_file), "--keys-poll-seconds", "0.1"),
        ),
    )


def keys_with_limit(tmp_path: Path, burst: int | None = None) -> Path:
    path = tmp_path / "limited-keys.yaml"
    text = f"keys:\n  - {{id: s, sha256: {hash_key(STACK_API_KEY)}, tenant: stack, role: user}}\n"
    if burst is not None:
        text += f"tenants:\n  stack: {{rate_per_second: 0.001, burst: {burst}}}\n"
    path.write_text(text)
    return path


async def classify_on_new_connection(port: int) -> grpc.StatusCode:
    """One Classify on a connection of its own (so the kernel picks a worker for it)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = classify_service_pb2_grpc.ClassifyServiceStub(channel)
        try:
            await stub.Classify(
                pb.ClassifyRequest(text=STRIKER),
                metadata=(("authorization", f"Bearer {STACK_API_KEY}"),),
                wait_for_ready=True,
                timeout=30,
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def worker_pids(orchestrator: ServerProcess) -> dict[int, int]:
    """Worker index -> pid of its latest process, from the "worker serving" log lines."""
    return {
        int(line["worker"]): int(line["pid"])
        for line in orchestrator.log_lines()
        if line.get("event") == "worker serving"
    }


async def every_worker_logged(orchestrator: ServerProcess, processes: int) -> dict[int, int]:
    """The workers' pids, once each has logged "worker serving" (the lines of several
    processes reach the log file in their own time)."""
    await wait_until(lambda: len(worker_pids(orchestrator)) == processes, "every worker's line")
    return worker_pids(orchestrator)


async def test_a_tenants_rate_is_shared_and_metrics_add_up_across_processes(
    start_stack: Callable[..., Stack], redis_server: RedisServer, tmp_path: Path
) -> None:
    keys = keys_with_limit(tmp_path, BURST)
    stack = start_workers(start_stack, redis_server, keys, 3)
    await every_worker_logged(stack.orchestrator, 3)
    port = stack.orchestrator.port
    codes = [await classify_on_new_connection(port) for _ in range(BURST + 6)]
    assert codes == [grpc.StatusCode.OK] * BURST + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 6
    # One /metrics for the set: the workers' counts added up.
    scrape = samples(stack.orchestrator)
    assert value(scrape, STATE_OPERATIONS_TOTAL, operation="rate_limit", outcome="ok") == BURST + 6
    assert value(scrape, RPC_REQUESTS_TOTAL, method=CLASSIFY, code="OK") == BURST
    assert value(scrape, RATE_LIMITED_TOTAL, tenant="stack") == 6
    assert value(scrape, WORKERS) == 3
    # Each worker holds its third of the backend's adaptive limit (--concurrency-max-limit
    # for the set, rounded up), so the three together hold what one process would.
    share = -(-DEFAULT_CONCURRENCY.max_limit // 3)
    workers = [
        worker_samples(int(line["metrics_port"]))
        for line in stack.orchestrator.log_lines()
        if line.get("event") == "worker serving"
    ]
    for own in workers:
        assert value(own, BACKEND_CONCURRENCY_LIMIT, backend="topic-minilm") == share
    assert value(scrape, BACKEND_CONCURRENCY_LIMIT, backend="topic-minilm") == 3 * share
    # Samples whose sum means nothing: the set started when its first worker did, and
    # each worker has the same fd limit.
    starts = [value(own, "process_start_time_seconds") for own in workers]
    assert value(scrape, "process_start_time_seconds") == min(starts)
    assert value(scrape, "process_max_fds") == value(workers[0], "process_max_fds")
    # Each worker's loop beats (the supervisor's liveness check reads it); the set's is
    # the stalest worker's.
    beats = [value(own, LOOP_HEARTBEAT) for own in workers]
    assert all(time.time() - beat < 30 for beat in beats)
    assert value(scrape, LOOP_HEARTBEAT) <= max(beats)
    await a_key_revoked_in_the_file_is_refused_by_every_worker(stack, keys, tmp_path)


async def a_key_revoked_in_the_file_is_refused_by_every_worker(
    stack: Stack, keys: Path, tmp_path: Path
) -> None:
    """Each worker watches the keys file itself (on the same stack as the test above, to
    spare the suite a start): a revoked key was accepted until every orchestrator
    restarted, and a worker restarted alone read the edit while the others kept the
    old keys. The tenant is past its rate here, so a key in force is RESOURCE_EXHAUSTED."""
    port = stack.orchestrator.port
    staging = tmp_path / "limited-keys.yaml.new"
    staging.write_text("keys: [{id: broken}]\n")
    staging.replace(keys)
    await wait_until(
        lambda: value(samples(stack.orchestrator), API_KEYS_RELOADS_TOTAL, outcome="failed") == 3,
        "every worker refused the broken edit",
    )
    # A yes or no for the set, as for one process (summed, it read 3).
    assert value(samples(stack.orchestrator), API_KEYS_FILE_REFUSED) == 1
    in_force = await classify_on_new_connection(port)
    assert in_force == grpc.StatusCode.RESOURCE_EXHAUSTED  # the keys in force stay
    staging.write_text(
        f"keys:\n  - {{id: other, sha256: {hash_key('ck_another')}, tenant: t, role: user}}\n"
    )
    staging.replace(keys)
    await wait_until(
        lambda: value(samples(stack.orchestrator), API_KEYS_RELOADS_TOTAL, outcome="ok") == 3,
        "every worker applied the edit",
    )
    assert value(samples(stack.orchestrator), API_KEYS_FILE_REFUSED) == 0
    codes = {await classify_on_new_connection(port) for _ in range(8)}
    assert codes == {grpc.StatusCode.UNAUTHENTICATED}


def worker_samples(metrics_port: int) -> Scrape:
    """One worker's own /metrics (on the loopback port its "worker serving" line names)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as page:
        text = page.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_more_than_one_process_without_redis_is_refused_naming_the_settings() -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--processes", "2", "--auth", "disabled"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "--processes / ORCHESTRATOR_PROCESSES 2 needs shared state" in refused.stderr
    assert "set --state-url / ORCHESTRATOR_STATE_URL to a redis:// URL" in refused.stderr
    assert "Traceback" not in refused.stderr
