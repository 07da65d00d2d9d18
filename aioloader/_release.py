"""Letting go of a batch of many Python objects a bounded stretch at a time.

A batch rebuilt in pieces (see :class:`~aioloader._codec.PieceDecoder`) costs about a fifth of
its rebuilding again to free: when the loop body drops the last reference to 64 000 short
strings, CPython frees every one of them there and then, on the loop (about 0.5 ms on the
2-core VM), and a service's requests wait behind it. So the consumer keeps one reference to
each such batch it delivers; a loop turn after the next batch is delivered, when that reference
is the only one left (the loop body moved on), the batch's lists and dicts are emptied from the
end, a step of about :data:`~aioloader._codec.DECODE_STEP_S` per turn.

Nothing anybody can still see is touched: a container is emptied only while this module holds
its only reference (``sys.getrefcount``), and only exact ``list`` and ``dict`` objects (no
subclass: no ``__del__``, no weak references). A batch the loop body kept (appended to a list,
say) is simply let go; so is an element still referenced elsewhere. Tuples cannot be emptied:
one is freed whole, like any other object.

Runs in: the event loop's thread only.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from . import _codec

#: The loop frees for at most about this long per turn: half a rebuild step, since nothing
#: waits for the freeing and the same turn may hold a rebuild step and a pipe read.
RELEASE_STEP_S = _codec.DECODE_STEP_S / 2

#: A flat list (of strings, numbers) shorter than this is freed whole, in 40 us or less on the
#: 2-core VM; a longer one loses this many elements per slice.
_CHUNK = 4096


class _Probe:
    def take(self, item: Any) -> int:
        return sys.getrefcount(item)


# What sys.getrefcount reads inside a method for an argument that nothing but the call refers
# to, handed over the way Releaser._take gets its items (an element just popped from a list).
# Measured rather than assumed: it differs between Python versions. Too high a figure would
# let the releaser empty a container someone else still holds, so it is checked too.
_SOLE = _Probe().take([object()].pop())
if not 1 <= _SOLE <= 2:  # pragma: no cover - an interpreter that counts differently
    _SOLE = 0  # never sure: nothing is emptied, every batch is freed the ordinary way


class Releaser:
    """Frees the batches that :meth:`delivered` hands it, a loop turn at a time."""

    def __init__(self) -> None:
        # The heavy batch delivered last: the loop body may still be using it.
        self._held: Any = None
        # Its predecessors, let go by the loop body (perhaps) once the next batch came.
        self._pending: list[Any] = []
        # Containers this releaser owns, being emptied (the last one first).
        self._work: list[Any] = []
        self._queued = False
        #: Batches emptied stepwise, and batches let go because they were still referenced
        #: (for tests and benchmarks).
        self.released = 0
        self.kept = 0

    def delivered(self, batch: Any, heavy: bool) -> None:
        """The consumer is about to return ``batch``; ``heavy``: it was rebuilt in pieces."""
        previous, self._held = self._held, (batch if heavy else None)
        if previous is None:
            return
        self._pending.append(previous)
        del previous
        self._queue()

    def end(self) -> None:
        """The epoch is over: the batch delivered last is the loop body's alone from now."""
        if self._held is not None:
            self._pending.append(self._held)
            self._held = None
            self._queue()

    def _queue(self) -> None:
        if self._queued:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: the references go now, freed the ordinary way
            self._pending.clear()
            self._work.clear()
            return
        self._queued = True
        # Behind the loop body's current step: it rebinds its variable to the new batch there.
        loop.call_soon(self._step)

    def _step(self) -> None:
        self._queued = False
        work = self._work
        while self._pending:
            self._take(self._pending.pop(), first=True)
        deadline = time.perf_counter() + RELEASE_STEP_S
        while work:
            container = work[-1]
            if not container:
                work.pop()
            elif type(container) is dict:
                self._take(container.popitem()[1])
            elif len(container) > _CHUNK and not _nested(container[-1]):
                del container[-_CHUNK:]
            else:
                self._take(container.pop())
            del container
            if time.perf_counter() >= deadline:
                break
        if work:
            self._queue()

    def _take(self, item: Any, first: bool = False) -> None:
        """``item``, a batch let go by the loop body (``first``) or an element just removed from
        a container being emptied: emptied in turn if that is worth it and nothing else refers
        to it; otherwise freed (or let go) when this returns."""
        if first:
            worth = type(item) in (list, dict)
        else:
            worth = (_nested(item) and len(item) > 1) or (type(item) is list and len(item) > _CHUNK)
        sole = worth and sys.getrefcount(item) <= _SOLE
        if sole:
            self._work.append(item)
        if first:
            self.released += sole
            self.kept += not sole


def _nested(obj: Any) -> bool:
    """Whether ``obj`` is an exact list or dict whose (first) element is a container."""
    kind = type(obj)
    if kind is list:
        return bool(obj) and type(obj[0]) in _CONTAINERS
    if kind is dict:
        return bool(obj) and type(next(iter(obj.values()))) in _CONTAINERS
    return False


_CONTAINERS = (list, dict, tuple)
