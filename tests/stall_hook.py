"""Run a server module with a way to block its event loop from outside, for tests.

`python -m tests.stall_hook MODULE ARGS...` runs `python -m MODULE ARGS...` after
installing a SIGUSR2 handler that sleeps for as many seconds as the environment
variable STALL_SECONDS_ENV says. Python runs signal handlers in the main thread,
between two bytecodes of whatever it is doing, so the sleep blocks the server's
event loop there and then, as a slow synchronous call in a handler or a long
garbage-collection pause would, while gRPC core's own threads go on reading the
sockets and queueing the calls that arrive.

Only tests start servers this way; the servers themselves know nothing of it.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from types import FrameType

STALL_SECONDS_ENV = "CLASSIFY_TEST_STALL_SECONDS"
STALL_SIGNAL = signal.SIGUSR2


def _stall(signum: int, frame: FrameType | None) -> None:
    time.sleep(float(os.environ[STALL_SECONDS_ENV]))


def main() -> None:
    module, *arguments = sys.argv[1:]
    signal.signal(STALL_SIGNAL, _stall)
    sys.argv = [module, *arguments]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
