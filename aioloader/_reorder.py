"""Reorder stage: releases results by ``send_idx``. Runs in: the event loop. Upstream: scheduler.

In order (``in_order=True``) an item is released only when every smaller ``send_idx`` has been
released or skipped; otherwise items are released as they arrive, smallest index first.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

__all__ = ("ReorderBuffer",)

_T = TypeVar("_T")


class ReorderBuffer(Generic[_T]):
    """An ``asyncio.PriorityQueue`` of ``(send_idx, item)`` plus the index to release next.

    Every ``send_idx`` below the end given to :meth:`close` is either :meth:`put` or :meth:`skip`
    exactly once; :meth:`get` raises ``StopAsyncIteration`` once all of them were released.
    """

    def __init__(self, in_order: bool) -> None:
        self._in_order = in_order
        self._pq: asyncio.PriorityQueue[tuple[int, _T]] = asyncio.PriorityQueue()
        self._arrived = asyncio.Event()
        self._next_idx = 0  # in order: the send_idx to release next
        self._skipped: set[int] = set()
        self._seen: set[int] = set()  # every index put or skipped this epoch: a repeat is a bug
        self._released = 0  # items released + indices skipped
        self._end: int | None = None
        self._failure: BaseException | None = None

    def __len__(self) -> int:
        """Items buffered and not yet released."""
        return self._pq.qsize()

    def _mark(self, idx: int) -> None:
        if idx in self._seen:
            raise RuntimeError(f"aioloader bug: send_idx {idx} arrived twice")
        if self._end is not None and idx >= self._end:
            raise RuntimeError(f"aioloader bug: send_idx {idx} arrived after the end {self._end}")
        self._seen.add(idx)
        self._arrived.set()

    def put(self, idx: int, item: _T) -> None:
        self._mark(idx)
        self._pq.put_nowait((idx, item))

    def skip(self, idx: int) -> None:
        """``idx`` produces nothing (an exhausted iterable worker); never wait for it."""
        self._mark(idx)
        if self._in_order:
            self._skipped.add(idx)
        else:
            self._released += 1

    def close(self, end: int) -> None:
        """No ``send_idx >= end`` will be put; the consumer stops after releasing the rest."""
        self._end = end
        self._arrived.set()

    def fail(self, exc: BaseException) -> None:
        """Make every later :meth:`get` raise ``exc`` at once (a fatal error ahead of all data)."""
        self._failure = exc
        self._arrived.set()

    def drain(self) -> list[_T]:
        """Remove and return every buffered item (used when an epoch is abandoned)."""
        items = []
        while not self._pq.empty():
            items.append(self._pq.get_nowait()[1])
        return items

    def _done(self) -> bool:
        if self._end is None:
            return False
        if self._in_order:
            return self._next_idx >= self._end
        return self._released >= self._end

    def _try_release(self) -> tuple[bool, _T | None]:
        if self._in_order:
            while self._next_idx in self._skipped:
                self._skipped.discard(self._next_idx)
                self._next_idx += 1
        if self._pq.empty():
            return False, None
        idx, item = self._pq.get_nowait()
        if self._in_order and idx != self._next_idx:
            self._pq.put_nowait((idx, item))  # the head is still missing
            return False, None
        self._next_idx = idx + 1 if self._in_order else self._next_idx
        self._released += 1
        return True, item

    async def get(self) -> _T:
        """Wait for the next item to release; ``StopAsyncIteration`` when all were released."""
        while True:
            if self._failure is not None:
                raise self._failure
            ok, item = self._try_release()
            if ok:
                return item  # type: ignore[return-value]
            if self._done():
                raise StopAsyncIteration
            self._arrived.clear()
            await self._arrived.wait()
