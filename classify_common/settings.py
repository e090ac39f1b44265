"""Helpers for settings that come from flags, then environment variables, then defaults.

Each layer keeps its settings in one frozen dataclass that checks every value
when built; a bad value fails start-up with the flag and variable named.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path


class SettingsError(ValueError):
    """A setting has a value outside its bounds; the message names flag and variable."""


def add_setting(
    parser: argparse.ArgumentParser,
    flag: str,
    env: str,
    default: object,
    help_text: str,
    environ: Mapping[str, str],
    kind: type = str,
) -> None:
    """Add `flag`, defaulting to $`env`, else `default`; the help shows both."""
    parser.add_argument(
        flag,
        type=kind,
        default=kind(environ[env]) if env in environ else default,
        help=f"{help_text} [env {env}; default {default}]",
    )


def read_secret(path: Path | None) -> str | None:
    """A token from a file (surrounding whitespace dropped), or None without a file."""
    if path is None:
        return None
    secret = path.read_text(encoding="utf-8").strip()
    if not secret:
        raise SettingsError(f"{path} is empty")
    return secret


def check_range(value: float, low: float, high: float, flag: str, env: str) -> None:
    if not low <= value <= high:
        raise SettingsError(f"{flag} / {env}: {value} is outside {low:g}..{high:g}")


def check_port(value: int, flag: str, env: str, *, allow_disabled: bool = False) -> None:
    low = -1 if allow_disabled else 0
    if not low <= value <= 65535:
        extra = ", -1 disables it" if allow_disabled else ""
        raise SettingsError(
            f"{flag} / {env}: port {value} is outside 0..65535 (0 picks a free port{extra})"
        )
