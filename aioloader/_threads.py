"""Blocking work off the event loop, on threads that are gone when the await returns.

Runs in: the event loop (the awaiting side) and one short-lived thread per call. The loop's
default executor is not used: its threads outlive the call, and a loader must leave no thread
behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ("JOIN_BOUND_S", "release_threads", "run_off_loop")

#: How long a loader waits for its loading threads to finish the call they are in.
JOIN_BOUND_S = 1.0

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


async def release_threads(
    executors: Sequence[ThreadPoolExecutor], what: str, bound_s: float | None = None
) -> None:
    """Drop the executors' queued calls and wait for their threads to end: for as long as the
    calls they are in take, or, with ``bound_s`` (after a ``timeout``), at most that long.

    A thread inside a dataset's ``__getitem__`` cannot be interrupted: one still in a call after
    ``bound_s`` (a stuck read) is left to finish it in the background, with a ``RuntimeWarning``;
    its result is dropped, and the interpreter waits for it at exit.
    """
    threads: list[threading.Thread] = []
    for ex in executors:
        ex.shutdown(wait=False, cancel_futures=True)
        threads += list(getattr(ex, "_threads", ()))
    if bound_s is None:

        def join() -> None:
            for t in threads:
                t.join()

        await run_off_loop(join, name="loading-join")
        return
    deadline = time.monotonic() + bound_s
    # Polled on the loop: a helper thread joining them would itself be left behind on a timeout.
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    left = [t.name for t in threads if t.is_alive()]
    if left:
        warnings.warn(
            f"aioloader: {len(left)} {what} thread(s) still inside the dataset or collate_fn "
            f"{bound_s:g} s after the loader let go of them ({', '.join(left)}); a thread cannot "
            "be interrupted, so each finishes that call in the background and its batch is "
            "dropped (the interpreter waits for it at exit)",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    for t in threads:
        t.join()  # each has ended: instant
