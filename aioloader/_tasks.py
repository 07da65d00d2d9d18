"""Tasks the loader starts on the event loop, held until they finish. Runs in: the event loop.

The event loop keeps only weak references to its tasks. An epoch's tasks (its guard, start-up,
scheduler, recovery, cleanup, device feed and source reader) are otherwise reachable only through
the epoch, and a running epoch only through its iterator: when a consumer dropped the iterator
inside a reference cycle, the garbage collector, on whatever thread it ran, found the whole epoch
unreachable, destroyed its pending tasks and closed their coroutines on that thread, so the
cleanup that releases the workers never ran on the loop. Held here, the tasks keep the epoch
alive; dropping the iterator ends the epoch, and the tasks leave this set when they finish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ("start_task",)

_T = TypeVar("_T")

_running: set[asyncio.Task[Any]] = set()


def start_task(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, _T], *, name: str
) -> asyncio.Task[_T]:
    """``loop.create_task(coro)``, with the task strongly referenced until it is done."""
    task = loop.create_task(coro, name=name)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task
