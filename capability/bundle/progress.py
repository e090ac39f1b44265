"""A one-line progress display on stderr for building and verifying bundles.

On a terminal the line is redrawn in place (at most ten times a second); elsewhere (CI
logs, pipes) one line is written per step, so the log stays readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_BAR_WIDTH = 24
_REDRAW_SECONDS = 0.1


class Progress:
    """Counts `done` of `total` units (bytes or steps) and shows it as a bar."""

    def __init__(
        self,
        title: str,
        total: int,
        *,
        unit: str = "steps",
        enabled: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.title = title
        self.total = max(total, 0)
        self.unit = unit
        self.enabled = enabled
        self.done = 0
        self._stream = stream if stream is not None else sys.stderr
        self._interactive = self._stream.isatty()
        self._detail = ""
        self._last_draw = 0.0
        self._started = time.perf_counter()

    def advance(self, amount: int, detail: str | None = None) -> None:
        """Count `amount` more units done; `detail` names what is being worked on."""
        self.done = min(self.done + amount, self.total) if self.total else self.done + amount
        changed = detail is not None and detail != self._detail
        if detail is not None:
            self._detail = detail
        if not self.enabled:
            return
        if self._interactive:
            now = time.perf_counter()
            if changed or now - self._last_draw >= _REDRAW_SECONDS:
                self._last_draw = now
                self._stream.write("\r\x1b[2K" + self._line())
                self._stream.flush()
        elif changed:
            self._stream.write(self._line() + "\n")
            self._stream.flush()

    def finish(self, summary: str) -> None:
        """Replace the bar with a closing line saying what was done and how long it took."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self._started
        prefix = "\r\x1b[2K" if self._interactive else ""
        self._stream.write(f"{prefix}{self.title}: {summary} ({elapsed:.1f} s)\n")
        self._stream.flush()

    def _line(self) -> str:
        fraction = self.done / self.total if self.total else 0.0
        filled = round(fraction * _BAR_WIDTH)
        bar = "#" * filled + "." * (_BAR_WIDTH - filled)
        return f"{self.title} [{bar}] {fraction:4.0%} {self._amount()}" + (
            f"  {self._detail}" if self._detail else ""
        )

    def _amount(self) -> str:
        if self.unit == "bytes":
            return f"{self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB"
        return f"{self.done}/{self.total} {self.unit}"
