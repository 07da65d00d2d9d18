"""Async sources and transforms for the streaming tests, importable by spawn/forkserver workers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from torch.utils.data import get_worker_info


class Counting:
    """Yields ``tensor([i])`` for i < n (endless if n is None); counts what it yielded.

    ``gate_after``: after that many samples, waits for ``gate`` before going on. ``fail_at``:
    raises ValueError instead of yielding that sample. ``acked`` records each ``ack`` call.
    """

    def __init__(
        self,
        n: int | None,
        *,
        gate_after: int | None = None,
        fail_at: int | None = None,
        ack_error: BaseException | None = None,
    ) -> None:
        self.n = n
        self.gate_after = gate_after
        self.gate = asyncio.Event()
        self.fail_at = fail_at
        self.ack_error = ack_error
        self.yielded = 0
        self.acked: list[list[int]] = []
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        try:
            i = 0
            while self.n is None or i < self.n:
                if i == self.gate_after:
                    await self.gate.wait()
                if i == self.fail_at:
                    raise ValueError(f"source broke at sample {i}")
                self.yielded += 1
                yield torch.tensor([i])
                i += 1
        finally:
            self.closed = True

    async def ack(self, samples: list[torch.Tensor]) -> None:
        await asyncio.sleep(0)
        if self.ack_error is not None:
            raise self.ack_error
        self.acked.append([int(s) for s in samples])


class AsyncMap:
    """Map-style, ``async def __getitem__``: sample i is ``tensor([i])``. Tracks concurrency."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.running = 0
        self.max_running = 0

    def __len__(self) -> int:
        return self.n

    async def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            for _ in range(3):
                await asyncio.sleep(0)
            return torch.tensor([i])
        finally:
            self.running -= 1


class AsyncMapBatched(AsyncMap):
    """Also has ``async def __getitems__``, which the loader must prefer; counts its calls."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.batched_calls = 0

    async def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        self.batched_calls += 1
        return [torch.tensor([i]) for i in indices]


class SyncRange(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def with_worker(sample: torch.Tensor) -> dict[str, Any]:
    """A transform that says where it ran: worker id (-1 outside a worker) and thread name."""
    info = get_worker_info()
    return {
        "x": sample,
        "worker": -1 if info is None else info.id,
        "main_thread": threading.current_thread() is threading.main_thread(),
    }


class KillOnce:
    """A transform that SIGKILLs its worker the first time it sees sample ``at``."""

    def __init__(self, at: int, marker: str) -> None:
        self.at = at
        self.marker = marker

    def __call__(self, sample: torch.Tensor) -> torch.Tensor:
        if int(sample) == self.at and not os.path.exists(self.marker):
            with open(self.marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        return sample


def not_a_sample(sample: torch.Tensor) -> object:
    return object()


def noisy(sample: torch.Tensor) -> torch.Tensor:
    """A random augmentation: reproducible only if the worker's RNG is seeded per batch."""
    return sample + torch.rand(1)


class SwallowsCancel:
    """Four samples, then waits; cancelled there it goes on yielding (as some clients do)."""

    def __init__(self) -> None:
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        try:
            for i in range(4):
                yield torch.tensor([i])
            with contextlib.suppress(asyncio.CancelledError):  # a badly behaved client library
                await asyncio.Event().wait()
            i = 4
            while True:
                yield torch.tensor([i])
                i += 1
        finally:
            self.closed = True


class Slow:
    """Yields ``tensor([i])`` for i < n, ``gap`` seconds apart; ``produced[i]`` is when (monotonic
    clock, the same in every process of the machine)."""

    def __init__(self, n: int, gap: float) -> None:
        self.n = n
        self.gap = gap
        self.produced: list[float] = []

    async def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        for i in range(self.n):
            if i:
                await asyncio.sleep(self.gap)
            self.produced.append(time.monotonic())
            yield torch.tensor([i])


def stamped(sample: torch.Tensor) -> dict[str, Any]:
    """A transform that says when it ran (monotonic clock) and in which process."""
    return {"x": sample, "at": time.monotonic(), "pid": os.getpid()}


class FailAt:
    """A transform that raises ``error`` on sample ``at``; the others pass through."""

    def __init__(self, at: int, error: BaseException) -> None:
        self.at = at
        self.error = error

    def __call__(self, sample: torch.Tensor) -> torch.Tensor:
        if int(sample) == self.at:
            raise self.error
        return sample


class KillAlways:
    """A transform that SIGKILLs its worker every time it sees sample ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, sample: torch.Tensor) -> torch.Tensor:
        if int(sample) == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return sample


class Yielding:
    """Yields ``tensor([i])`` for i < n, handing control to the loop before each one (as a
    client whose data is already buffered does): fast, but the reader's buffer runs dry often."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        for i in range(self.n):
            await asyncio.sleep(0)
            yield torch.tensor([i])
