"""Settings come from flags, then environment variables, then defaults, and are checked at start."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from capability.batching.settings import DEFAULT_MAX_BATCH_SIZE
from capability.config import CapabilitySettings
from capability.server import internal_gate
from capability.server import main as capability_main
from classify_common.settings import SettingsError, read_secret
from orchestrator.config import OrchestratorSettings
from orchestrator.server import OrchestratorServer
from tests.hostile_files import OVERSIZE_YAML_COMMENT, TOO_DEEP_YAML, nested_aliases


def test_defaults_are_the_documented_ports() -> None:
    assert CapabilitySettings.from_args([], environ={}).port == 50052
    orchestrator = OrchestratorSettings.from_args(["--api-keys-file", "keys.yaml"], environ={})
    assert orchestrator.port == 50051
    assert orchestrator.routes_file == Path("routes.yaml")
    assert orchestrator.auth == "required"


@pytest.mark.parametrize("settings", [CapabilitySettings, OrchestratorSettings])
def test_help_lists_every_flag_with_its_text_as_written(
    settings: type[CapabilitySettings] | type[OrchestratorSettings],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--help` prints and exits 0 (a "%" in a help text once crashed argparse's
    formatting of the capability's help), naming every flag and keeping a "%"."""
    with pytest.raises(SystemExit) as exited:
        settings.from_args(["--help"], environ={})
    assert exited.value.code == 0
    printed = " ".join(capsys.readouterr().out.split())
    for each in settings.declared():
        assert each.flag in printed
    if settings is CapabilitySettings:
        assert "0: 80% of the device" in printed


def test_auth_is_required_unless_switched_off_explicitly() -> None:
    with pytest.raises(
        SettingsError, match="--api-keys-file / ORCHESTRATOR_API_KEYS_FILE is needed"
    ):
        OrchestratorSettings.from_args([], environ={})
    assert OrchestratorSettings.from_args(["--auth", "disabled"], environ={}).auth == "disabled"


def test_more_than_one_orchestrator_process_needs_a_redis_state_url() -> None:
    with pytest.raises(
        SettingsError,
        match=re.escape(
            "--processes / ORCHESTRATOR_PROCESSES 2 needs shared state: "
            "set --state-url / ORCHESTRATOR_STATE_URL to a redis:// URL"
        ),
    ):
        OrchestratorSettings.from_args(["--auth", "disabled", "--processes", "2"], environ={})
    with pytest.raises(
        SettingsError,
        match=r"^--state-url / ORCHESTRATOR_STATE_URL: not a redis:// or rediss:// URL$",
    ):
        OrchestratorSettings.from_args(
            ["--auth", "disabled"], environ={"ORCHESTRATOR_STATE_URL": "http://r:6379"}
        )
    shared = OrchestratorSettings.from_args(
        ["--auth", "disabled", "--processes", "auto", "--state-url", "rediss://r:6380/0"],
        environ={},
    )
    assert shared.processes == len(os.sched_getaffinity(0))


def test_fewer_processes_sharing_redis_than_serve_the_port_are_refused() -> None:
    """Each process grants 1/N of a tenant's bucket while Redis does not answer: 2 of 4
    would have granted the tenant twice its rate."""
    with pytest.raises(SettingsError) as refused:
        OrchestratorSettings.from_args(
            ["--auth", "disabled", "--processes", "4", "--state-processes", "2"],
            environ={"ORCHESTRATOR_STATE_URL": "redis://127.0.0.1:6379"},
        )
    assert str(refused.value) == (
        "--state-processes / ORCHESTRATOR_STATE_PROCESSES 2 is fewer than --processes / "
        "ORCHESTRATOR_PROCESSES 4: it counts every process sharing the Redis, on all hosts "
        "(0: --processes)"
    )
    more = OrchestratorSettings.from_args(
        ["--auth", "disabled", "--processes", "4", "--state-processes", "12"],
        environ={"ORCHESTRATOR_STATE_URL": "redis://127.0.0.1:6379"},
    )
    assert (more.processes, more.state_processes) == (4, 12)


def test_processes_sharing_redis_without_a_redis_are_refused() -> None:
    with pytest.raises(
        SettingsError,
        match=r"^--state-processes / ORCHESTRATOR_STATE_PROCESSES 4 counts the processes "
        r"sharing --state-url / ORCHESTRATOR_STATE_URL's Redis, and none is set$",
    ):
        OrchestratorSettings.from_args(["--auth", "disabled", "--state-processes", "4"], environ={})
    alone = OrchestratorSettings.from_args(
        ["--auth", "disabled", "--state-processes", "1"], environ={}
    )
    assert alone.state_processes == 1


# The query keys a --state-url may hold, as a refusal of another lists them.
REDIS_QUERY_KEYS = (
    "client_name, db, health_check_interval, legacy_responses, password, socket_keepalive, "
    "socket_read_size, ssl_ca_path, ssl_cert_reqs, ssl_certfile, ssl_check_hostname, "
    "ssl_ciphers, ssl_exclude_verify_flags, ssl_include_verify_flags, ssl_keyfile, "
    "ssl_min_version, ssl_password, username"
)


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis://:hunter2@r:99999/0", "its port is not a number from 0 to 65535"),
        ("redis://:hunter2@r:port/0", "its port is not a number from 0 to 65535"),
        ("redis://:hunter2@/0", "it names no host"),
        ("redis://:hunter2@[::1:6379/0", "not a valid URL"),
        ("http://:hunter2@r:6379", "not a redis:// or rediss:// URL"),
        # Taken here, then a ValueError traceback from redis-py's from_url at start.
        ("redis://:hunter2@r:6379?db=x", "its 'db' query value is not valid"),
        (
            "rediss://:hunter2@r:6380/0?socket_read_size=abc",
            "its 'socket_read_size' query value is not valid",
        ),
        # Taken here, then a TypeError traceback from redis-py's connection at start.
        (
            "redis://:hunter2@r:6379/0?db=1&sokcet_timeout=hunter2",
            "its query key 'sokcet_timeout' is not one the orchestrator takes "
            f"({REDIS_QUERY_KEYS})",
        ),
        (
            "redis://:hunter2@r:6379/0?decode_responses=false",
            "its query key 'decode_responses' is not one the orchestrator takes "
            f"({REDIS_QUERY_KEYS})",
        ),
        (
            "redis://:hunter2@r:6379/0?ssl_cert_reqs=none",
            "its query key 'ssl_cert_reqs' is for rediss:// (TLS) only",
        ),
        # Taken, and the URL's value won over the orchestrator's own.
        (
            "redis://:hunter2@r:6379/0?db=1&socket_timeout=1.5",
            "its query key 'socket_timeout' sets what the orchestrator sets itself: "
            "--state-timeout-ms bounds each command",
        ),
        (
            "rediss://:hunter2@r:6380/0?protocol=3",
            "its query key 'protocol' sets what the orchestrator sets itself: it speaks RESP2, "
            "which needs no HELLO round trip",
        ),
        (
            "rediss://:hunter2@r:6380/0?ssl_ca_certs=/etc/ca.pem",
            "its query key 'ssl_ca_certs' sets what the orchestrator sets itself: give the CA "
            "with --state-ca-file, which is checked at start",
        ),
    ],
)
def test_a_state_url_that_cannot_work_is_refused_without_repeating_its_password(
    url: str, problem: str
) -> None:
    """A bad port was a traceback from urllib at start; the URL, password and all, was
    repeated in the refusal of a wrong scheme."""
    with pytest.raises(SettingsError) as refused:
        OrchestratorSettings.from_args(["--auth", "disabled", "--state-url", url], environ={})
    assert str(refused.value) == f"--state-url / ORCHESTRATOR_STATE_URL: {problem}"


@pytest.mark.parametrize(
    "url",
    [
        "redis://:hunter2@r:6379?db=2&socket_keepalive=true",
        "redis://r:6379/0?username=classify&password=hunter2&client_name=front-door",
        "rediss://r:6380/0?ssl_certfile=c.pem&ssl_keyfile=c.key&ssl_check_hostname=false",
    ],
)
def test_a_state_url_query_redis_py_reads_is_taken(url: str) -> None:
    settings = OrchestratorSettings.from_args(
        ["--auth", "disabled", "--state-url", url], environ={}
    )
    assert settings.state_url == url


@pytest.mark.parametrize(
    ("settings", "argv"),
    [
        (CapabilitySettings, ["--max-wait", "5"]),
        (CapabilitySettings, ["--metrics", "-1"]),
        (OrchestratorSettings, ["--auth", "disabled", "--state-proc", "4"]),
    ],
)
def test_a_flag_cut_short_is_refused_not_taken_as_the_flag_it_begins(
    settings: type[CapabilitySettings] | type[OrchestratorSettings],
    argv: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """argparse's prefix matching took `--max-wait 5` as --max-wait-ms 5."""
    with pytest.raises(SystemExit) as exited:
        settings.from_args(argv, environ={})
    assert exited.value.code == 2
    assert f"error: unrecognized arguments: {argv[-2]} {argv[-1]}" in capsys.readouterr().err


def test_environment_overrides_default_and_flag_overrides_environment() -> None:
    environ = {"CAPABILITY_PORT": "6000", "CAPABILITY_DEVICE": "cpu"}
    assert CapabilitySettings.from_args([], environ=environ).port == 6000
    from_flag = CapabilitySettings.from_args(["--port", "7000"], environ=environ)
    assert from_flag.port == 7000
    assert from_flag.device == "cpu"


def test_out_of_range_port_names_flag_and_variable() -> None:
    with pytest.raises(SettingsError, match=r"--port / ORCHESTRATOR_PORT: port 70000"):
        OrchestratorSettings.from_args(
            ["--auth", "disabled"], environ={"ORCHESTRATOR_PORT": "70000"}
        )


def test_unknown_device_is_refused() -> None:
    with pytest.raises(SettingsError, match="--device / CAPABILITY_DEVICE: 'tpu'"):
        CapabilitySettings.from_args(["--device", "tpu"], environ={})


@pytest.fixture
def two_cuda_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a machine with cuda:0 and cuda:1 reports itself (the names are checked
    before any device is touched)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("device", ["cuda:00", "cuda:\u0660", "cuda:+1", "cuda: 1", "cuda:1,cuda:"])
@pytest.mark.usefixtures("two_cuda_devices")
def test_a_cuda_device_torch_cannot_read_is_refused_naming_the_flag(device: str) -> None:
    """str.isdigit took `cuda:00` and other scripts' digits; torch.device then refused
    them with a RuntimeError traceback at start."""
    bad = device.split(",")[-1].strip()
    with pytest.raises(SettingsError) as refused:
        CapabilitySettings.from_args(["--device", device], environ={})
    assert str(refused.value) == (
        f"--device / CAPABILITY_DEVICE: {bad!r} is not cuda:N (N a device index in the "
        "digits 0-9, without a leading zero)"
    )


@pytest.mark.usefixtures("two_cuda_devices")
def test_a_cuda_device_named_twice_is_refused() -> None:
    """Two workers on one device passed sharded's rule of two devices."""
    with pytest.raises(SettingsError) as refused:
        CapabilitySettings.from_args(
            ["--device", "cuda:0,cuda:0", "--residency", "sharded"], environ={}
        )
    assert str(refused.value) == (
        "--device / CAPABILITY_DEVICE: 'cuda:0' is named twice (one worker per device)"
    )
    taken = CapabilitySettings.from_args(["--device", "cuda:1, cuda:0"], environ={})
    assert taken.device == "cuda:1, cuda:0"


def test_grace_period_is_bounded() -> None:
    with pytest.raises(SettingsError, match="--grace-seconds / CAPABILITY_GRACE_SECONDS"):
        CapabilitySettings(grace_seconds=301)


def test_worker_count_is_bounded() -> None:
    with pytest.raises(SettingsError, match="--cpu-workers / CAPABILITY_CPU_WORKERS"):
        CapabilitySettings.from_args([], environ={"CAPABILITY_CPU_WORKERS": "0"})


def test_models_flag_is_a_comma_separated_list() -> None:
    settings = CapabilitySettings.from_args(["--models", "topic-minilm, topic-static"], environ={})
    assert settings.models == ("topic-minilm", "topic-static")


def test_per_model_settings_file_overrides_batching_and_names_bad_keys(tmp_path: Path) -> None:
    config = tmp_path / "models.yaml"
    config.write_text(
        "topic-static:\n  max_batch_size: 16\n  max_wait_ms: 2\n  precision: bf16\n  graph: eager\n"
    )
    settings = CapabilitySettings(model_config=config).with_model_config()
    static = settings.per_model["topic-static"]
    assert static.batching.max_batch_size == 16
    assert settings.default_serving().batching.max_batch_size == DEFAULT_MAX_BATCH_SIZE != 16
    assert static.batching.max_wait_seconds == 0.002
    assert static.precision == "bf16"
    assert static.graph == "eager"
    assert settings.default_serving().graph == "torchscript"
    config.write_text("topic-static:\n  graph: jit\n")
    with pytest.raises(SettingsError, match=r":2: topic-static\.graph: graph 'jit' is not one of"):
        CapabilitySettings(model_config=config).with_model_config()
    config.write_text("topic-static:\n  max_batch: 64\n")
    with pytest.raises(SettingsError, match=r"topic-static\.max_batch: unknown key"):
        CapabilitySettings(model_config=config).with_model_config()
    config.write_text("topic-static:\n  max_batch_size: 0\n")
    refused = r"topic-static\.max_batch_size: max_batch_size 0 is outside 1\.\.1024"
    with pytest.raises(SettingsError, match=refused):
        CapabilitySettings(model_config=config).with_model_config()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (nested_aliases(), r"{path}:3:5: anchor &l0: YAML anchors and aliases"),
        (TOO_DEEP_YAML, r"{path}:3:\d+: mappings and lists nest deeper than 32"),
        (OVERSIZE_YAML_COMMENT, r"{path}: \d+ bytes, over the 262144-byte limit"),
    ],
)
def test_model_config_past_the_reading_bounds_is_refused(
    tmp_path: Path, extra: str, message: str
) -> None:
    config = tmp_path / "models.yaml"
    config.write_text("topic-static:\n  max_batch_size: 64\n" + extra)
    expected = "^--model-config / CAPABILITY_MODEL_CONFIG: " + message
    with pytest.raises(SettingsError, match=expected.format(path=re.escape(str(config)))):
        CapabilitySettings(model_config=config).with_model_config()


def test_incomplete_tls_settings_are_refused_with_the_flags_named(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    with pytest.raises(SettingsError, match="give both the certificate and the key"):
        CapabilitySettings(tls_cert_file=pem)
    # Set by variable, as a chart does: the refusal names the variables too.
    with pytest.raises(SettingsError) as by_variable:
        CapabilitySettings.from_args([], environ={"CAPABILITY_TLS_KEY_FILE": str(pem)})
    assert str(by_variable.value).startswith(
        "--tls-cert-file / CAPABILITY_TLS_CERT_FILE, --tls-key-file / CAPABILITY_TLS_KEY_FILE, "
        "--tls-client-ca-file / CAPABILITY_TLS_CLIENT_CA_FILE: give both"
    )
    with pytest.raises(SettingsError, match="a client CA needs a certificate and key too"):
        CapabilitySettings(tls_client_ca_file=pem)
    with pytest.raises(SettingsError, match=r"--upstream-ca-file .*needs the CA file too"):
        OrchestratorSettings(auth="disabled", upstream_cert_file=pem)


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--log-level", "LOUD"], {}, "--log-level / CAPABILITY_LOG_LEVEL: 'LOUD' is not DEBUG"),
        ([], {"CAPABILITY_PORT": "abc"}, "--port / CAPABILITY_PORT: 'abc' is not valid"),
        (["--device", "cuda:0"], {}, "--device / CAPABILITY_DEVICE: 'cuda:0': this machine has"),
        (["--residency", "foo"], {}, "--residency / CAPABILITY_RESIDENCY: 'foo' is not"),
        (
            [],
            {"CAPABILITY_OTLP_ENDPOINT": "jaeger"},
            "--otlp-endpoint / CAPABILITY_OTLP_ENDPOINT: 'jaeger' is not valid: give host:port, "
            "with the port",
        ),
        (
            [],
            {"CAPABILITY_OTLP_ENDPOINT": "http://jaeger:4317"},
            "--otlp-endpoint / CAPABILITY_OTLP_ENDPOINT: 'http://jaeger:4317' is not valid: "
            "give host:port without a scheme",
        ),
        (
            [],
            {"CAPABILITY_OTLP_ENDPOINT": "jaeger:99999"},
            "--otlp-endpoint / CAPABILITY_OTLP_ENDPOINT: 'jaeger:99999' is not valid: "
            "the port '99999' is not a number from 1 to 65535",
        ),
        (
            [],
            {"CAPABILITY_OTLP_ENDPOINT": "::1:4317"},
            "--otlp-endpoint / CAPABILITY_OTLP_ENDPOINT: '::1:4317' is not valid: "
            "an IPv6 host goes in brackets",
        ),
    ],
    ids=[
        "log-level",
        "port-variable",
        "cuda-without-cuda",
        "residency",
        "otlp-without-port",
        "otlp-with-scheme",
        "otlp-port-out-of-range",
        "otlp-bare-ipv6",
    ],
)
def test_a_capability_setting_it_cannot_use_stops_the_start_with_one_line(
    argv: list[str],
    environ: dict[str, str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As the orchestrator's: `error:` and the flag and variable, exit status 2, no
    traceback (a CUDA device named on a machine without one: this machine's)."""
    if "cuda" in message and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        capability_main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith(f"python -m capability: error: {message}"), err
    assert "Traceback" not in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("endpoint", ["jaeger:4317", "10.0.0.7:4317", "[::1]:4317"])
def test_an_otlp_endpoint_with_its_port_is_taken_as_written(endpoint: str) -> None:
    settings = CapabilitySettings.from_args(["--otlp-endpoint", endpoint], environ={})
    assert settings.otlp_endpoint == endpoint


def test_log_levels_are_checked_and_read_in_any_case() -> None:
    assert (
        OrchestratorSettings.from_args(
            ["--auth", "disabled", "--log-level", "debug"], environ={}
        ).log_level
        == "DEBUG"
    )
    with pytest.raises(SettingsError, match="--log-level / ORCHESTRATOR_LOG_LEVEL: 'LOUD'"):
        OrchestratorSettings.from_args(
            ["--auth", "disabled"], environ={"ORCHESTRATOR_LOG_LEVEL": "loud"}
        )


@pytest.mark.parametrize(
    ("settings", "name", "text", "value"),
    [
        (CapabilitySettings, "log_level", " debug ", "DEBUG"),
        (CapabilitySettings, "graph", "eager ", "eager"),
        (CapabilitySettings, "device", " cpu", "cpu"),
        (CapabilitySettings, "default_model", "topic-static\t", "topic-static"),
        (OrchestratorSettings, "concurrency_limit", "off\r", "off"),
        (OrchestratorSettings, "port", " 7070 ", 7070),
    ],
)
def test_a_word_is_read_without_the_spaces_around_it_as_a_number_is(
    settings: type[CapabilitySettings | OrchestratorSettings], name: str, text: str, value: object
) -> None:
    """A number's spaces went (int() and float() drop them) and a word's stayed: a
    variable with a trailing space or a carriage return from an env file, `off\r`, was
    refused as not `off`, while the port beside it was taken."""
    fixed = ["--auth", "disabled"] if settings is OrchestratorSettings else []
    flag = "--" + name.replace("_", "-")
    variable = settings.ENV_PREFIX + name.upper()
    by_flag = settings.from_args([*fixed, flag, text], environ={})
    by_variable = settings.from_args(fixed, environ={variable: text})
    assert getattr(by_flag, name) == getattr(by_variable, name) == value


def test_a_default_model_the_server_does_not_serve_is_refused_naming_those_it_does() -> None:
    settings = CapabilitySettings.from_args(["--default-model", "nosuch"], environ={})
    with pytest.raises(SettingsError) as refused:
        settings.check_default_model(("topic-static",))
    assert str(refused.value) == (
        "--default-model / CAPABILITY_DEFAULT_MODEL: 'nosuch' is not served here "
        "(served: topic-static)"
    )


def test_a_secret_file_it_cannot_use_is_refused_naming_its_flag_and_variable(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "absent"
    settings = OrchestratorSettings.from_args(
        ["--auth", "disabled", "--internal-token-file", str(missing)], environ={}
    )
    with pytest.raises(SettingsError) as unreadable:
        read_secret(settings, "internal_token_file")
    assert str(unreadable.value) == (
        "--internal-token-file / ORCHESTRATOR_INTERNAL_TOKEN_FILE: cannot read "
        f"{missing}: No such file or directory"
    )
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    capability = CapabilitySettings.from_args(["--internal-token-file", str(empty)], environ={})
    with pytest.raises(
        SettingsError,
        match=r"^--internal-token-file / CAPABILITY_INTERNAL_TOKEN_FILE: .* is empty$",
    ):
        read_secret(capability, "internal_token_file")
    assert read_secret(CapabilitySettings.from_args([], environ={}), "internal_token_file") is None


@pytest.mark.parametrize(
    ("token", "shown"),
    [("abc\ndef", "'\\n'"), ("tökén", "'ö'"), ("abc\tdef", "'\\t'"), ("abc def", "' '")],
    ids=["line-break", "non-ascii", "tab", "space"],
)
def test_an_internal_token_no_grpc_header_can_carry_stops_both_servers_at_start(
    tmp_path: Path, token: str, shown: str
) -> None:
    """gRPC refuses such a token as a header value in every call (each request failed
    INTERNAL while the servers reported SERVING): the start refuses it instead."""
    path = tmp_path / "token"
    path.write_text(token + "\n", encoding="utf-8")
    orchestrator = OrchestratorSettings.from_args(
        ["--auth", "disabled", "--internal-token-file", str(path)], environ={}
    )
    with pytest.raises(SettingsError) as refused:
        OrchestratorServer(orchestrator)
    assert str(refused.value) == (
        f"--internal-token-file / ORCHESTRATOR_INTERNAL_TOKEN_FILE: the token holds {shown}: "
        "a gRPC header value carries only printable ASCII characters, without spaces"
    )
    capability = CapabilitySettings.from_args(["--internal-token-file", str(path)], environ={})
    with pytest.raises(
        SettingsError, match=r"^--internal-token-file / CAPABILITY_INTERNAL_TOKEN_FILE: "
    ):
        internal_gate(capability)


def test_a_password_file_keeps_spaces_and_non_ascii_characters(tmp_path: Path) -> None:
    """Redis carries any byte in a password: only the token must fit a header."""
    path = tmp_path / "password"
    path.write_text("pass wörd\n", encoding="utf-8")
    settings = OrchestratorSettings.from_args(
        ["--auth", "disabled", "--state-password-file", str(path)], environ={}
    )
    assert read_secret(settings, "state_password_file") == "pass wörd"


def test_a_byte_size_that_is_not_finite_is_refused_by_flag_and_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`inf` raised OverflowError past both parsers: a traceback, exit status 1. And a
    flag's refusal named the parsing function ("invalid parse_byte_size value")."""
    with pytest.raises(SettingsError, match=r"^--device-memory-budget / CAPABILITY_DEVICE_MEM"):
        CapabilitySettings.from_args([], environ={"CAPABILITY_DEVICE_MEMORY_BUDGET": "inf"})
    with pytest.raises(SystemExit) as exited:
        CapabilitySettings.from_args(["--result-cache-bytes", "1e400"], environ={})
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.endswith(
        "error: argument --result-cache-bytes: '1e400' is not valid: '1e400' is not a finite "
        "size in bytes (e.g. 1073741824, 512MiB, 2GiB) (also settable as "
        "CAPABILITY_RESULT_CACHE_BYTES)\n"
    )
