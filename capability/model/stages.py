"""Where a batch's time goes on its device: marks between the stages of one forward.

On a CUDA device the marks are CUDA events, so a stage's times are when the
device did the work, not when the host queued it (kernel launches return at
once). On the CPU, host and device are one, and the marks read the monotonic
clock. Both give the same stages, so traces read the same on either.
"""

from __future__ import annotations

import time

import torch

# The stages between consecutive marks of `TextClassifier.run`, in order.
STAGES = ("batch_assemble", "h2d_copy", "cuda_launch", "postprocess")


class StageClock:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda_event" if device.type == "cuda" else "monotonic"
        self._events: list[torch.cuda.Event] = []
        self._monotonic: list[int] = []
        # Epoch and monotonic time of the first mark: spans need epoch times.
        self._anchor_epoch = 0
        self._anchor_monotonic = 0

    def mark(self) -> None:
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


class NoClock(StageClock):
    """Marks nothing: for callers that do not trace stages."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def mark(self) -> None:
        pass
