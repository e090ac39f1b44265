"""A last resort for a test that hangs past pytest-timeout's alarm.

pytest-timeout (the `signal` method, 300 s a test) raises once, in the main
thread. That alarm can be lost: raised inside a callback of the event loop,
it is reported to the loop's exception handler and the loop runs on; raised
in one fixture's teardown, it ends that teardown, and the next one may hang
as well with no alarm left. Either way the suite waits, silently, until CI's
own limit kills it, with nothing printed about where it stood.

This timer, one per test, fires MARGIN_SECONDS past the test's own timeout
(its setup, call and teardown together): it prints the test's ID, every
thread's stack and every unfinished asyncio task's stack to stderr, and ends
the run at once (servers the test started are left to the machine). It is off
where pytest-timeout is: a timeout of 0, the plugin not loaded, a debugger.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import sys
import threading
from collections.abc import Iterator

import pytest

# Time past a test's timeout for pytest-timeout's alarm to end it: past this, it did not.
MARGIN_SECONDS = 120.0
# The exit status of a run ended by this watchdog.
HUNG_EXIT_STATUS = 3


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    limit = hang_limit(item)
    if limit is None:
        return (yield)
    watchdog = threading.Timer(limit, report_hang_and_exit, args=(item, limit))
    watchdog.daemon = True
    watchdog.start()
    try:
        return (yield)
    finally:
        watchdog.cancel()


def hang_limit(item: pytest.Item) -> float | None:
    """Seconds after which `item` counts as hung: its pytest-timeout timeout (its
    marker's, else --timeout, else the ini's) and MARGIN_SECONDS; None where there is
    no timeout to enforce."""
    config = item.config
    if config.getoption("usepdb", False) or config.getoption("trace", False):
        return None
    marker = item.get_closest_marker("timeout")
    seconds: object = marker.args[0] if marker is not None and marker.args else None
    if seconds is None:
        seconds = config.getoption("timeout", None)
    if seconds is None:
        try:
            seconds = config.getini("timeout")
        except ValueError:  # pytest-timeout is not loaded
            return None
    try:
        timeout = float(str(seconds))
    except ValueError:
        return None
    return timeout + MARGIN_SECONDS if timeout > 0 else None


def report_hang_and_exit(item: pytest.Item, limit: float) -> None:
    # Output is captured while a test runs (fd 2 included): give the terminal back.
    capture = item.config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    err = sys.stderr
    err.write(f"\n\nHUNG: {item.nodeid} still running after {limit:.0f}s\n\nThreads:\n")
    err.flush()
    faulthandler.dump_traceback(file=err, all_threads=True)
    err.write("\nUnfinished asyncio tasks:\n")
    # NOTE: read from this thread while the loop's is stuck: racy, and good enough
    # for a report written once on the way out. The registry of all tasks is private.
    tasks = getattr(asyncio.tasks, "_all_tasks", ())
    for task in list(tasks):
        if task.done():
            continue
        try:
            task.print_stack(file=err)
        except Exception as exc:  # a task finishing under us: say so, go on
            err.write(f"  {task!r}: stack not read ({exc!r})\n")
    err.flush()
    os._exit(HUNG_EXIT_STATUS)
