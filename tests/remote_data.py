"""Async map-style datasets for the remote-fetch tests (importable, so spawned workers load them).

Sample ``i`` is a dict with ``x = tensor([i])`` and facts about the call that produced it, read
by the tests: the worker, the process, how many calls of this process were in flight when it
started, and the attempt that answered.
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import get_worker_info

from aioloader import AsyncIterableDataset


class Latent:
    """Each call sleeps ``delay`` seconds (a store's latency) and reports its concurrency."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        self.n = n
        self.delay = delay
        self.running = 0
        self.calls: dict[int, int] = {}

    def __len__(self) -> int:
        return self.n

    async def answer(self, i: int) -> dict[str, Any]:
        return {}

    async def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.calls[i] = attempt = self.calls.get(i, 0) + 1
        self.running += 1
        seen = self.running
        try:
            await asyncio.sleep(self.delay)
            extra = await self.answer(i)
        finally:
            self.running -= 1
        info = get_worker_info()
        return {
            "x": torch.tensor([i]),
            "worker": -1 if info is None else info.id,
            "pid": os.getpid(),
            "in_flight": seen,
            "attempt": attempt,
            "io_thread": threading.current_thread().name,
            **extra,
        }


class Flaky(Latent):
    """The first ``failures`` calls of each index listed in ``bad`` raise ``error``."""

    def __init__(self, n: int, bad: set[int], failures: int, error: BaseException) -> None:
        super().__init__(n)
        self.bad = bad
        self.failures = failures
        self.error = error

    async def answer(self, i: int) -> dict[str, Any]:
        if i in self.bad and self.calls[i] <= self.failures:
            raise copy.copy(self.error)  # a fresh one each time: notes are per raise
        return {}


class Status(Exception):
    """An HTTP client's error: it carries the response's status (as aiohttp's and httpx's do)."""

    def __init__(self, status: int, url: str) -> None:
        super().__init__(f"{status} for {url}")
        self.status = status
        self.url = url

    def __reduce__(self) -> tuple[type[Status], tuple[int, str]]:
        return Status, (self.status, self.url)


class SlowFirstCall(Latent):
    """The first ``slow_calls`` calls of every index in ``slow`` take ``slow_s``; later calls
    are fast."""

    def __init__(
        self, n: int, slow: set[int], slow_s: float, delay: float = 0.002, slow_calls: int = 1
    ) -> None:
        super().__init__(n, delay)
        self.slow = slow
        self.slow_s = slow_s
        self.slow_calls = slow_calls
        self.cancelled: list[int] = []

    async def answer(self, i: int) -> dict[str, Any]:
        if i in self.slow and self.calls[i] <= self.slow_calls:
            try:
                await asyncio.sleep(self.slow_s)
            except asyncio.CancelledError:
                self.cancelled.append(i)
                raise
        return {}


class Hangs(Latent):
    """Index ``at`` never answers."""

    def __init__(self, n: int, at: int) -> None:
        super().__init__(n)
        self.at = at

    async def answer(self, i: int) -> dict[str, Any]:
        if i == self.at:
            await asyncio.Event().wait()
        return {}


class KillsOnce(Latent):
    """SIGKILLs its worker process the first time index ``at`` is fetched (``marker`` file)."""

    def __init__(self, n: int, at: int, marker: str) -> None:
        super().__init__(n, 0.001)
        self.at = at
        self.marker = marker

    async def answer(self, i: int) -> dict[str, Any]:
        if i == self.at and not os.path.exists(self.marker):  # noqa: ASYNC240 (a test's marker)
            Path(self.marker).touch()  # noqa: ASYNC240
            os.kill(os.getpid(), signal.SIGKILL)
        return {}


class Client:
    """Stands for a client session: counts the opens and closes of each process in a log file."""

    def __init__(self, log: str) -> None:
        self.log = log
        self.closed = False
        self._write("open")

    def _write(self, what: str) -> None:
        info = get_worker_info()
        worker = -1 if info is None else info.id
        with open(self.log, "a") as f:
            f.write(f"{what} {os.getpid()} {worker} {threading.current_thread().name}\n")

    async def close(self) -> None:
        await asyncio.sleep(0)
        self.closed = True
        self._write("close")


class WithClient(Latent):
    """Opens its client in ``__aenter__`` and closes it in ``__aexit__``; each call needs it."""

    def __init__(self, n: int, log: str) -> None:
        super().__init__(n)
        self.log = log
        self.client: Client | None = None

    async def __aenter__(self) -> WithClient:
        self.client = Client(self.log)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def answer(self, i: int) -> dict[str, Any]:
        if self.client is None or self.client.closed:
            raise RuntimeError("the dataset was called without an open client")
        return {}


def log_lines(path: str) -> list[list[str]]:
    try:
        return [line.split() for line in Path(path).read_text().splitlines()]
    except FileNotFoundError:
        return []


def values(batches: list[Any]) -> list[int]:
    return [int(v) for b in batches for v in b["x"].flatten()]


class Shards(AsyncIterableDataset[dict[str, Any]]):
    """``async def __aiter__``: each worker reads its share of ``shards`` shards of ``per_shard``
    samples, the next shard fetched in the background while the current one is read. Opens a
    client (``__aenter__``) that every read needs."""

    def __init__(self, shards: int, per_shard: int, delay: float = 0.005) -> None:
        self.shards, self.per_shard, self.delay = shards, per_shard, delay
        self.client: str | None = None

    async def __aenter__(self) -> Shards:
        self.client = "open"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.client = None

    async def _read(self, shard: int) -> list[int]:
        assert self.client == "open", "read without a client"
        await asyncio.sleep(self.delay)
        return list(range(shard * self.per_shard, (shard + 1) * self.per_shard))

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:  # type: ignore[override]
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        mine = list(range(wid, self.shards, nw))
        nxt = asyncio.ensure_future(self._read(mine[0])) if mine else None
        for k in range(len(mine)):
            assert nxt is not None
            items = await nxt
            nxt = asyncio.ensure_future(self._read(mine[k + 1])) if k + 1 < len(mine) else None
            for i in items:
                yield {"x": torch.tensor([i]), "worker": wid, "io": threading.current_thread().name}


class Exits(Latent):
    """``sys.exit(3)`` in ``__getitem__`` for index ``at``."""

    def __init__(self, n: int, at: int) -> None:
        super().__init__(n)
        self.at = at

    async def answer(self, i: int) -> dict[str, Any]:
        if i == self.at:
            raise SystemExit(3)
        return {}


class Peak(Latent):
    """Counts the most calls in flight in this process (in ``peak``, shared by its copies)."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n, delay)

    async def __getitem__(self, i: int) -> dict[str, Any]:
        sample = await super().__getitem__(i)
        return sample


def draw(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform with a random augmentation: a draw of the worker's seeded ``random``."""
    import random

    return {**sample, "draw": torch.tensor([random.random()])}


class Generations(AsyncIterableDataset[dict[str, Any]]):
    """Logs when an iterator's ``finally`` runs (``log`` file), to see abandoned ones closed."""

    def __init__(self, n: int, log: str) -> None:
        self.n, self.log = n, log

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:  # type: ignore[override]
        try:
            for i in range(self.n):
                await asyncio.sleep(0)
                yield {"x": torch.tensor([i])}
        finally:
            with open(self.log, "a") as f:  # noqa: ASYNC230 (a test's log)
                f.write("closed\n")
