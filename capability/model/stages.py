"""Where a batch's time goes on its device: marks between the stages of one forward.

On a CUDA device the marks are CUDA events, so a stage's times are when the
device did the work, not when the host queued it (kernel launches return at
once). On the CPU, host and device are one, and the marks read the monotonic
clock. Both give the same stages, so traces read the same on either.

A forward is marked at five named points (`Mark`); `StageClock.marks()` gives
them back as a `StageMarks`, whose fields bound the four STAGES.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal, get_args

import torch

# The stages between consecutive marks of `TextClassifier.run`, in order.
STAGES = ("batch_assemble", "h2d_copy", "cuda_launch", "postprocess")

# The points of one forward that are marked, in the order they happen.
Mark = Literal["started", "assembled", "copied", "forwarded", "done"]
MARKS: tuple[Mark, ...] = get_args(Mark)


@dataclass(frozen=True)
class StageMarks:
    """Epoch nanoseconds at the marks of one forward: each stage runs from one to the next."""

    started: int  # the batch is handed to the model
    assembled: int  # batch_assemble ends: the texts are padded into one batch on the host
    copied: int  # h2d_copy ends: the batch is on the device
    forwarded: int  # cuda_launch ends: the scores are computed
    done: int  # postprocess ends: the scores are back on the host

    def stages(self) -> tuple[tuple[str, int, int], ...]:
        """(stage, start ns, end ns) for each of STAGES, in order."""
        bounds = (self.started, self.assembled, self.copied, self.forwarded, self.done)
        return tuple(zip(STAGES, bounds, bounds[1:], strict=False))


class StageClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda_event" if device.type == "cuda" else "monotonic"
        self._names: list[Mark] = []
        self._events: list[torch.cuda.Event] = []
        self._monotonic: list[int] = []
        # Epoch and monotonic time of the first mark: spans need epoch times.
        self._anchor_epoch = 0
        self._anchor_monotonic = 0

    def mark(self, name: Mark) -> None:
        """Record the point `name` of the forward now (on a GPU, when the device gets there)."""
        self._names.append(name)
        if not self._events and not self._monotonic:
            self._anchor_epoch, self._anchor_monotonic = time.time_ns(), time.monotonic_ns()
        if self.kind == "cuda_event":
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
            self._events.append(event)
        else:
            self._monotonic.append(time.monotonic_ns())

    def epoch_ns(self) -> tuple[int, ...]:
        """Each mark as epoch nanoseconds.

        CUDA marks are placed by the device's own timeline from the first one,
        which the host records on an idle stream (the previous batch's scores were
        copied back, which waits for the stream), so the two clocks start together.
        """
        if self.kind == "cuda_event":
            if not self._events:
                return ()
            self._events[-1].synchronize()
            first = self._events[0]
            return tuple(
                self._anchor_epoch + int(first.elapsed_time(event) * 1_000_000)
                for event in self._events
            )
        return tuple(self._anchor_epoch + (m - self._anchor_monotonic) for m in self._monotonic)

    def marks(self) -> StageMarks | None:
        """The forward's marks by name; None unless each was made once, in order."""
        if tuple(self._names) != MARKS:
            return None
        return StageMarks(*self.epoch_ns())


class NoClock(StageClock):
    """Marks nothing: for callers that do not trace stages."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def mark(self, name: Mark) -> None:
        pass
