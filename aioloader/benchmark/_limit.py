"""What the machine allows per batch: the bare round trip of the loader's own shape.

An event loop submits tasks to a ``ProcessPoolExecutor`` with the same number of workers and of
tasks in flight as the loader, and each task returns ``bytes`` of the batch's size. No sampler,
no dataset, no collate, no ordering, no tensors: what is left is the inter-process hop that every
batch of a process-based loader pays. A loader's batches/s as a fraction of this says how much of
the per-batch cost is the loader's own.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from aioloader.benchmark._harness import RoundResult

__all__ = ("LIMIT", "bare_round_trip")

#: The column name of the limit in the table and the JSON.
LIMIT = "limit"


def _reply(nbytes: int) -> bytes:
    return bytes(nbytes)


def _ready() -> None:
    return None


async def _drive(pool: ProcessPoolExecutor, nbytes: int, batches: int, warmup: int,
                 in_flight: int) -> RoundResult:  # fmt: skip
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Future[Any]] = set()
    sent = done = 0
    total = batches + warmup
    t0 = 0.0
    while done < total:
        while sent < total and len(pending) < in_flight:
            pending.add(loop.run_in_executor(pool, _reply, nbytes))
            sent += 1
        finished, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for f in finished:
            f.result()
        before, done = done, done + len(finished)
        if before < warmup <= done:
            t0 = time.perf_counter()
    return RoundResult(time.perf_counter() - t0, batches, batches)


def bare_round_trip(
    workers: int, nbytes: int, batches: int, warmup: int = 20, prefetch_factor: int = 2
) -> RoundResult:
    """One timed run: ``batches`` round trips of ``nbytes`` after ``warmup`` untimed ones, with
    ``workers * prefetch_factor`` in flight (the loader's default window)."""
    ctx = multiprocessing.get_context()  # the loaders' default start method
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        # Every worker up before the clock starts, as the loaders' warm-up batches ensure.
        for f in [pool.submit(_ready) for _ in range(workers * 4)]:
            f.result()
        return asyncio.run(_drive(pool, nbytes, batches, warmup, workers * prefetch_factor))
