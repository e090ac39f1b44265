"""The OpenTelemetry SDK's environment variables, read once at start-up, flags winning.

Each value here is what the specification's variable means, checked when read:

    OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT   export_endpoint_is_set
    OTEL_EXPORTER_OTLP_PROTOCOL, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL   check_otlp_protocol
    OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG                      trace_sampling
    OTEL_BSP_MAX_QUEUE_SIZE, _SCHEDULE_DELAY, _EXPORT_TIMEOUT,
    _MAX_EXPORT_BATCH_SIZE                                            export_limits

Headers, TLS and the exporter's own timeout are read by the OTLP exporter itself;
OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES by `Resource.create`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from classify_common.settings import SettingsError
from classify_common.span_export import ExportLimits

TRACES_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACES_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
TRACES_TIMEOUT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
TRACES_CERTIFICATE_VARIABLES = (
    "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
)
TRACES_INSECURE_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE")
SERVICE_NAME_VARIABLE = "OTEL_SERVICE_NAME"
RESOURCE_ATTRIBUTES_VARIABLE = "OTEL_RESOURCE_ATTRIBUTES"
SAMPLER_VARIABLE = "OTEL_TRACES_SAMPLER"
SAMPLER_ARG_VARIABLE = "OTEL_TRACES_SAMPLER_ARG"
# The only OTLP transport installed.
GRPC_PROTOCOL = "grpc"
# The specification's default sampler.
DEFAULT_SAMPLER = "parentbased_always_on"
# Sampler name -> (follows the caller's decision, ratio when OTEL_TRACES_SAMPLER_ARG
# does not apply: None means it does).
_SAMPLERS: dict[str, tuple[bool, float | None]] = {
    "always_on": (False, 1.0),
    "always_off": (False, 0.0),
    "traceidratio": (False, None),
    "parentbased_always_on": (True, 1.0),
    "parentbased_always_off": (True, 0.0),
    "parentbased_traceidratio": (True, None),
}


class UnsupportedOtlpProtocol(SettingsError):
    """OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL asks for a transport that is not installed."""


@dataclass(frozen=True)
class TraceSampling:
    """Which new traces are kept; errors and time-outs are kept whatever this says."""

    # Share of traces kept, 0..1.
    ratio: float = 1.0
    # True: a caller's sampling decision wins over the ratio (parent-based).
    parent_based: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise SettingsError(f"{SAMPLER_ARG_VARIABLE}: {self.ratio} is outside 0..1")


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """The first of `names` set (to something other than blanks), and its value."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def export_endpoint_is_set(environ: Mapping[str, str]) -> bool:
    """Whether the environment names an OTLP endpoint for traces (the exporter reads it)."""
    return _first(environ, TRACES_ENDPOINT_VARIABLES) is not None


def exporter_timeout_seconds(environ: Mapping[str, str]) -> float | None:
    """OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT in seconds, None where unset.

    The specification gives it in milliseconds, as every other SDK reads it; the
    Python exporter reads it as seconds when left to itself, so 10000 (10 s) became
    2 h 46 min, for which one hung connection to the collector held the export thread
    while every span was dropped."""
    found = _first(environ, TRACES_TIMEOUT_VARIABLES)
    if found is None:
        return None
    name, text = found
    try:
        millis = float(text)
    except ValueError as exc:
        raise SettingsError(f"{name}: {text!r} is not a number of milliseconds") from exc
    if not 0 < millis < float("inf"):
        raise SettingsError(f"{name}: {text!r} is not a positive number of milliseconds")
    return millis / 1000


def check_otlp_protocol(environ: Mapping[str, str]) -> None:
    """Refuse a protocol other than gRPC: sending gRPC to an HTTP receiver would lose
    every span quietly, so a wrong setting stops the process at start-up instead."""
    found = _first(environ, TRACES_PROTOCOL_VARIABLES)
    if found is not None and found[1].lower() != GRPC_PROTOCOL:
        name, value = found
        raise UnsupportedOtlpProtocol(
            f"{name}: {value!r} is not supported; only {GRPC_PROTOCOL!r} is installed"
        )


def check_plaintext_endpoint(environ: Mapping[str, str], otlp_endpoint: str | None) -> None:
    """Refuse `--otlp-endpoint` (always plaintext) beside variables that ask for TLS:
    the exporter would send the spans, and OTEL_EXPORTER_OTLP_HEADERS (a collector's
    credentials, say), in the clear while the operator believed them encrypted."""
    if not otlp_endpoint:
        return
    certificate = _first(environ, TRACES_CERTIFICATE_VARIABLES)
    insecure = _first(environ, TRACES_INSECURE_VARIABLES)
    asked = certificate or (insecure if insecure and insecure[1].lower() == "false" else None)
    if asked is not None:
        raise SettingsError(
            f"--otlp-endpoint sends spans in plaintext, but {asked[0]} asks for TLS: set "
            "OTEL_EXPORTER_OTLP_ENDPOINT=https://host:port instead of the flag"
        )


def trace_sampling(environ: Mapping[str, str], flag_ratio: float | None) -> TraceSampling:
    """The sampling a process uses: `--trace-sample-ratio` when given (parent-based),
    else OTEL_TRACES_SAMPLER and its argument, else parent-based, keeping every trace."""
    if flag_ratio is not None:
        return TraceSampling(ratio=flag_ratio)
    name = environ.get(SAMPLER_VARIABLE, "").strip().lower() or DEFAULT_SAMPLER
    if name not in _SAMPLERS:
        allowed = ", ".join(_SAMPLERS)
        raise SettingsError(f"{SAMPLER_VARIABLE}: {name!r} is not one of {allowed}")
    parent_based, ratio = _SAMPLERS[name]
    if ratio is None:
        ratio = _number(environ, SAMPLER_ARG_VARIABLE, 1.0)
    return TraceSampling(ratio=ratio, parent_based=parent_based)


def export_limits(environ: Mapping[str, str]) -> ExportLimits:
    """The batch span processor's settings (OTEL_BSP_*), defaults where unset."""
    default = ExportLimits()
    try:
        return ExportLimits(
            queue_size=int(_number(environ, "OTEL_BSP_MAX_QUEUE_SIZE", default.queue_size)),
            delay_millis=int(_number(environ, "OTEL_BSP_SCHEDULE_DELAY", default.delay_millis)),
            timeout_millis=int(_number(environ, "OTEL_BSP_EXPORT_TIMEOUT", default.timeout_millis)),
            batch_size=int(_number(environ, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", default.batch_size)),
        )
    except ValueError as exc:
        raise SettingsError(f"OTEL_BSP_*: {exc}") from exc


def _number(environ: Mapping[str, str], name: str, default: float) -> float:
    text = environ.get(name, "").strip()
    if not text:
        return default
    try:
        return float(text)
    except ValueError as exc:
        raise SettingsError(f"{name}: {text!r} is not a number") from exc
