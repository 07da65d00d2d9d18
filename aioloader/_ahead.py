"""Look-ahead in a worker whose dataset fetches asynchronously (``fetch_in="workers"``).

Runs in: a worker process. A worker runs its tasks one at a time, in order; for an async
dataset that would leave one batch's requests in flight at a time. Instead the worker's task
reader (the lane's call queue, ``_procpool``) hands every task to :data:`start` as soon as it
reads it, so that batch's requests begin at once, and while a task waits for its requests
:func:`wait` keeps reading the tasks that arrive. The two sides meet here, in a module that
imports neither of them.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as _wait_all
from typing import Any

__all__ = ("reader", "start", "wait")

#: Set by the worker (``_worker.setup``) when its dataset fetches asynchronously: called with
#: ``(fn, args)`` of every task the reader takes, before the task runs.
start: Callable[[Callable[..., Any], tuple[Any, ...]], None] | None = None

#: Set by the worker's task reader: reads the tasks waiting now and passes each to
#: :data:`start`; returns the descriptor to watch for the next ones, or -1 when there is none.
reader: Callable[[], int] | None = None


def wait(fut: Future[Any], wake_fd: int) -> None:
    """Block until ``fut`` is done, reading arriving tasks meanwhile. ``wake_fd`` becomes
    readable whenever a fetch finishes (its bytes are drained here)."""
    if reader is None:
        _wait_all([fut])
        return
    poller = select.poll()
    poller.register(wake_fd, select.POLLIN)
    lane_fd = reader()
    if lane_fd >= 0:
        poller.register(lane_fd, select.POLLIN)
    while not fut.done():
        for fd, _ in poller.poll():
            if fd == wake_fd:
                try:
                    while _drain(wake_fd):
                        pass
                except OSError:
                    pass
            elif fd == lane_fd:
                now = reader()
                if now != lane_fd:  # the lane closed
                    poller.unregister(lane_fd)
                    lane_fd = now
                    if lane_fd >= 0:
                        poller.register(lane_fd, select.POLLIN)


def _drain(fd: int) -> bool:
    try:
        return len(os.read(fd, 4096)) == 4096
    except BlockingIOError:
        return False
