"""Letting go of a batch of many Python objects a bounded stretch at a time.

A batch rebuilt in pieces (see :class:`~aioloader._codec.PieceDecoder`) costs about a fifth of
its rebuilding again to free: when the loop body drops the last reference to 64 000 short
strings, CPython frees every one of them there and then, on the loop (about 0.5 ms on the
2-core VM), and a service's requests wait behind it. So the consumer keeps one reference to
each such batch it delivers; a loop turn after the next batch is delivered, when that reference
is the only one left (the loop body moved on), the batch's lists and dicts are emptied from the
end, a step of about :data:`RELEASE_STEP_S` per turn.

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


def _local_sole() -> int:
    x = object()
    return sys.getrefcount(x)


# What sys.getrefcount reads for an object that nothing but one local variable refers to:
# every check below is made on such a local, with no Python call between (an argument's count
# depends on how the call was made: a frame-evaluation hook such as torch.compile's adds one).
# Measured rather than assumed, as it differs between Python versions (2 up to 3.13). Too high
# a figure would let the releaser empty a container someone else still holds, so it is checked.
_SOLE = _local_sole()
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
        pending = self._pending
        while pending:
            batch = pending.pop()
            # Its references: ``batch`` alone, if the loop body has let go of it.
            if type(batch) in (list, dict) and sys.getrefcount(batch) <= _SOLE:
                work.append(batch)
                self.released += 1
            else:
                self.kept += 1
            del batch  # still referenced elsewhere: that owner frees it
        deadline = time.perf_counter() + RELEASE_STEP_S
        while work:
            container = work[-1]
            if not container:
                work.pop()
                continue
            if type(container) is dict:
                item = container.popitem()[1]
            elif len(container) > _CHUNK and type(container[-1]) not in _CONTAINERS:
                del container[-_CHUNK:]  # a long flat list: a slice at a time
                item = None
            else:
                item = container.pop()
            del container
            # Emptied in turn if that is worth it and ``item`` is its only reference; otherwise
            # freed (or, held elsewhere, let go) here.
            if _worth(item) and sys.getrefcount(item) <= _SOLE:
                work.append(item)
            del item
            if time.perf_counter() >= deadline:
                break
        if work:
            self._queue()


def _worth(obj: Any) -> bool:
    """Whether emptying ``obj`` stepwise pays: a list or dict of containers, or a long list."""
    return (_nested(obj) and len(obj) > 1) or (type(obj) is list and len(obj) > _CHUNK)


def _nested(obj: Any) -> bool:
    """Whether ``obj`` is an exact list or dict whose (first) element is a container."""
    kind = type(obj)
    if kind is list:
        return bool(obj) and type(obj[0]) in _CONTAINERS
    if kind is dict:
        return bool(obj) and type(next(iter(obj.values()))) in _CONTAINERS
    return False


_CONTAINERS = (list, dict, tuple)
