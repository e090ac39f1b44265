"""Stop signals before a server's own handlers exist: imported first by each server's
`__main__`, before anything heavy.

A server installs its handlers when it starts serving (classify_common.serving), but
its imports come first and take seconds (torch; CUDA on a GPU). A SIGTERM or Ctrl-C in
them killed the process without a word, or, for a container's first process, which
the kernel shields from signals it does not handle, was ignored: the server went on
to start and serve, and the pod waited out its grace period to be killed. Here they
end it at once, with exit status 0, as a stop during the rest of the start does.
Here too, a process's stop when the process that started it dies
(`stop_when_parent_dies`, `stop_with_launcher`). Only the standard library: this
must be quick to import.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from types import FrameType

# prctl(2): the signal this process gets when its parent dies.
PR_SET_PDEATHSIG = 1
# The process ID of the process that started this server and stops it (`make run`'s
# tools/run_stack.py), when it asks the server to stop with it (stop_with_launcher).
LAUNCHER_PID_VARIABLE = "CLASSIFY_LAUNCHER_PID"


def _stop(signum: int, frame: FrameType | None) -> None:
    # NOTE: not sys.exit: its SystemExit, raised inside whatever runs, can be caught and
    # cleared there (torch's C++ start-up swallows errors from importing numpy), and
    # the server then went on to serve. Nothing is bound or started yet to clean up.
    sys.stderr.flush()
    os._exit(0)


def stop_on_signals_until_serving() -> None:
    """Exit on SIGINT, SIGTERM or SIGHUP from now until the server installs its own
    handlers (which replace these). A SIGHUP the process was started to ignore
    (nohup) stays ignored."""
    for stop_signal in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if stop_signal == signal.SIGHUP and signal.getsignal(stop_signal) == signal.SIG_IGN:
            continue
        signal.signal(stop_signal, _stop)


def stop_when_parent_dies(parent: int) -> bool:
    """Have the kernel send this process SIGTERM (a server drains on it) when its parent
    dies; False if process `parent` is no longer its parent (it died before this ran,
    and no signal will come). For a process whose parent stops it: a parent killed
    (SIGKILL, the OOM killer) left it running, serving its port with no one to stop it.
    Linux only (prctl); elsewhere nothing, and True."""
    if not sys.platform.startswith("linux"):
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_PDEATHSIG): {os.strerror(error)}")
    return os.getppid() == parent


def stop_with_launcher() -> None:
    """Stop when the process named by LAUNCHER_PID_VARIABLE, which started this one,
    dies (SIGTERM: the server drains), and exit at once if it already has; nothing
    without the variable. Taken out of the environment as it is read, so that the
    processes this one starts (an orchestrator's workers) do not read it: their parent
    is this process, and they stop with it by their own means.

    Asked by the launcher rather than done by it between fork and exec (a preexec_fn):
    the launcher runs gRPC's threads by then, and code run in a child forked from a
    threaded process can deadlock on a lock one of them held."""
    launcher = os.environ.pop(LAUNCHER_PID_VARIABLE, "")
    if launcher.isdigit() and not stop_when_parent_dies(int(launcher)):
        sys.exit(f"the process that started this server ({launcher}) has exited")
