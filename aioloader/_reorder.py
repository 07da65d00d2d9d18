"""Reorder stage: releases results by ``send_idx``. Runs in: the event loop. Upstream: scheduler.

In order (``in_order=True``) an item is released only when every smaller ``send_idx`` has been
released or skipped; otherwise items are released as they arrive, smallest index first.

Memory is bounded by the batches in flight, not by the length of the epoch: an endless stream
runs in constant memory. Only indices that arrived and were not yet released are remembered,
plus (out of order) those released ahead of the oldest one still outstanding.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

__all__ = ("ReorderBuffer",)

_T = TypeVar("_T")


class ReorderBuffer(Generic[_T]):
    """An ``asyncio.PriorityQueue`` of ``(send_idx, item)`` plus the index to release next.

    Every ``send_idx`` below the end given to :meth:`close` is either :meth:`put` or :meth:`skip`
    exactly once; :meth:`get` raises ``StopAsyncIteration`` once all of them were released. An
    index that arrives twice is a bug and raises ``RuntimeError`` at once.
    """

    def __init__(self, in_order: bool, *, start: int = 0, done: set[int] | None = None) -> None:
        """``start``/``done``: a resumed epoch, whose indices below ``start`` and in ``done`` were
        delivered before; they count as released and are never waited for."""
        self._in_order = in_order
        self._pq: asyncio.PriorityQueue[tuple[int, _T]] = asyncio.PriorityQueue()
        self._arrived = asyncio.Event()
        # Every index below _low was released or skipped; _pending holds those that arrived and
        # were not released yet; _ahead (out of order only) those released while a smaller one
        # is still outstanding. All three stay within the in-flight window.
        self._low = start
        self._pending: set[int] = set()
        self._ahead: set[int] = set(done or ())
        self._skipped: set[int] = set()  # in order: skipped indices not yet passed
        self._released = start + len(self._ahead)  # items released + indices skipped
        self._end: int | None = None
        self._failure: BaseException | None = None
        #: The ``send_idx`` of the item :meth:`get` returned last.
        self.last_idx = -1

    def __len__(self) -> int:
        """Items buffered and not yet released."""
        return self._pq.qsize()

    def _mark(self, idx: int) -> None:
        if idx < self._low or idx in self._pending or idx in self._ahead:
            raise RuntimeError(f"aioloader bug: send_idx {idx} arrived twice")
        if self._end is not None and idx >= self._end:
            raise RuntimeError(f"aioloader bug: send_idx {idx} arrived after the end {self._end}")
        self._pending.add(idx)
        self._arrived.set()

    def _retire(self, idx: int) -> None:
        """``idx`` left the buffer (released or skipped): forget it once the window passes it."""
        self._pending.discard(idx)
        self._released += 1
        if idx == self._low:
            self._low += 1
            while self._low in self._ahead:
                self._ahead.discard(self._low)
                self._low += 1
        else:
            self._ahead.add(idx)

    def holds(self, idx: int) -> bool:
        """Whether ``idx`` arrived and was not released yet."""
        return idx in self._pending

    def put(self, idx: int, item: _T) -> None:
        self._mark(idx)
        self._pq.put_nowait((idx, item))

    def skip(self, idx: int) -> None:
        """``idx`` produces nothing (an exhausted iterable worker); never wait for it."""
        self._mark(idx)
        if self._in_order:
            self._skipped.add(idx)
        else:
            self._retire(idx)

    def close(self, end: int) -> None:
        """No ``send_idx >= end`` will be put; the consumer stops after releasing the rest."""
        self._end = end
        self._arrived.set()

    def fail(self, exc: BaseException) -> None:
        """Make every later :meth:`get` raise ``exc`` at once (a fatal error ahead of all data).

        The first failure wins: a later one (the epoch being torn down) does not replace it.
        """
        if self._failure is None:
            self._failure = exc
        self._arrived.set()

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def drain(self) -> list[_T]:
        """Remove and return every buffered item (used when an epoch is abandoned)."""
        items = []
        while not self._pq.empty():
            items.append(self._pq.get_nowait()[1])
        return items

    def _done(self) -> bool:
        if self._end is None:
            return False
        return self._released >= self._end

    def _try_release(self) -> tuple[bool, _T | None]:
        if self._in_order:
            while self._low in self._skipped:
                self._skipped.discard(self._low)
                self._retire(self._low)
        if self._pq.empty():
            return False, None
        idx, item = self._pq.get_nowait()
        if self._in_order and idx != self._low:
            self._pq.put_nowait((idx, item))  # the head is still missing
            return False, None
        self._retire(idx)
        self.last_idx = idx
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
