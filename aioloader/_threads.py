"""Blocking work off the event loop, on threads that are gone when the await returns.

Runs in: the event loop (the awaiting side) and one short-lived thread per call. The loop's
default executor is not used: its threads outlive the call, and a loader must leave no thread
behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ("run_off_loop",)

_T = TypeVar("_T")


async def run_off_loop(
    fn: Callable[[], _T], *, name: str, on_abandon: Callable[[_T], None] | None = None
) -> _T:
    """Run a blocking ``fn`` on a fresh thread and await it; the thread is gone when this returns.

    ``fn`` cannot be interrupted, so cancelling the caller waits for it to finish, hands its
    result to ``on_abandon`` (also off the loop) to release what it created, and only then
    re-raises the cancellation: nothing ``fn`` made outlives the cancelled caller.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[tuple[bool, Any]] = loop.create_future()

    def settle(outcome: tuple[bool, Any]) -> None:
        if not fut.done():
            fut.set_result(outcome)

    def target() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn())
        except BaseException as exc:
            outcome = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop closed while we worked: nobody is left to tell
            if outcome[0] and on_abandon is not None:
                on_abandon(outcome[1])

    thread = threading.Thread(target=target, name=f"aioloader-{name}", daemon=True)
    thread.start()
    cancelled: asyncio.CancelledError | None = None
    while True:
        try:
            ok, value = await asyncio.shield(fut)
            break
        except asyncio.CancelledError as exc:
            cancelled = exc
    # The thread's last act was to schedule `settle`: it is exiting, so the join is instant.
    thread.join()
    if cancelled is not None:
        if ok and on_abandon is not None:
            release = on_abandon
            with contextlib.suppress(asyncio.CancelledError):  # we are re-raising one anyway
                await run_off_loop(lambda: release(value), name=f"{name}-release")
        raise cancelled
    if ok:
        return value  # type: ignore[no-any-return]
    raise value
