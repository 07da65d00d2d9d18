"""``stream``: end-to-end latency of a paced async source, and throughput.

A producer stamps events at a fixed rate (event ``i`` is *produced* at ``t0 + i / rate``, whether
or not anyone reads it yet, so a reader that falls behind shows as latency). Latency is the time
from an event's production to the consumer receiving the batch that holds it.

* aioloader: the async source is the loader's dataset, batches close at ``batch_size`` or
  ``max_batch_latency`` after their first event; with the default ``transform_in="auto"``,
  while the source keeps the loader waiting, windows whose transform is cheap are transformed
  and collated on the loader's event loop, with no process hop; the others in the workers.
* ``aio-workers`` (paced rates, with workers): the same with ``transform_in="workers"``: every
  window is transformed and collated in a worker process.
* torch, the nearest equivalent: an ``IterableDataset`` over the same async source, run on its
  own event loop in a bridge thread that hands events over through a queue; ``num_workers=0``
  (a worker process per consumer would each read the stream); batches close by size only.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from aioloader import AsyncDataLoader
from aioloader.benchmark._harness import Config, Row, aio_class, plan, ratio_check
from aioloader.benchmark._limit import LIMIT, bare_round_trip
from aioloader.benchmark.tiny import fraction_of_limit

__all__ = ("COLUMNS", "PacedSource", "bench_stream", "measure_stream")

AIO_WORKERS = "aio-workers"
#: Table columns this workload adds beside torch and aioloader.
COLUMNS = (AIO_WORKERS,)

FEATURES = 16


class PacedSource:
    """``n`` events at ``rate`` per second (None: as fast as they are read): ``(seq, t_produced)``.

    A producer task fills a queue on schedule, independently of the reader; the stamp is the
    scheduled time, so a late producer counts as latency too.
    """

    def __init__(self, n: int, rate: float | None) -> None:
        self.n = n
        self.rate = rate

    async def __aiter__(self) -> AsyncIterator[tuple[int, float]]:
        if self.rate is None:
            for i in range(self.n):
                yield i, time.perf_counter()
            return
        events: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
        producer = asyncio.get_running_loop().create_task(self._produce(events, self.rate))
        try:
            for _ in range(self.n):
                yield await events.get()
        finally:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await producer

    async def _produce(self, events: asyncio.Queue[tuple[int, float]], rate: float) -> None:
        t0 = time.perf_counter()
        i = 0
        while i < self.n:
            now = time.perf_counter()
            due = min(self.n, int((now - t0) * rate) + 1)
            while i < due:
                events.put_nowait((i, t0 + i / rate))
                i += 1
            # The next event's time, but wake at least every millisecond at high rates.
            await asyncio.sleep(max(0.0, min(t0 + i / rate - time.perf_counter(), 0.001)))


def to_sample(event: tuple[int, float]) -> dict[str, Any]:
    """The per-event CPU work: a small feature vector (same for both loaders)."""
    seq, t = event
    return {
        "seq": seq,
        "t": torch.tensor(t, dtype=torch.float64),
        "x": torch.full((FEATURES,), float(seq)),
    }


class _Bridged(IterableDataset[dict[str, Any]]):
    """torch's side: the async source run by a thread's event loop, read through a queue."""

    def __init__(self, source: PacedSource) -> None:
        self.source = source

    def __iter__(self) -> Iterator[dict[str, Any]]:
        q: queue.Queue[Any] = queue.Queue(maxsize=1024)
        done = object()

        async def pump() -> None:
            async for event in self.source:
                while True:  # never block the pump's loop: the producer runs on it
                    try:
                        q.put_nowait(event)
                        break
                    except queue.Full:
                        await asyncio.sleep(0.0005)
            q.put(done)

        thread = threading.Thread(target=asyncio.run, args=(pump(),), name="bench-bridge")
        thread.start()
        try:
            while (item := q.get()) is not done:
                yield to_sample(item)
        finally:
            thread.join()


def _latencies(batch: dict[str, Any], now: float, warmup: int) -> list[float]:
    keep = batch["seq"] >= warmup
    return (now - batch["t"][keep]).tolist()  # type: ignore[no-any-return]


class _Rate:
    """Events per second after the first batch (a loader's start-up is the ``startup``
    workload's to measure, and torch's ``num_workers=0`` has none)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.events = 0

    def batch(self, size: int) -> None:
        if self.first is None:
            self.first = time.perf_counter()
        else:
            self.events += size

    def rate(self) -> float:
        if self.first is None or not self.events:
            return 0.0
        return self.events / (time.perf_counter() - self.first)


def _latencies_torch(
    n: int, rate: float | None, batch_size: int, warmup: int
) -> tuple[list[float], float]:
    """Each counted event's latency, and events/s after the first batch."""
    loader = DataLoader(_Bridged(PacedSource(n, rate)), batch_size=batch_size, num_workers=0)
    lat: list[float] = []
    steady = _Rate()
    for batch in loader:
        lat += _latencies(batch, time.perf_counter(), warmup)
        steady.batch(len(batch["seq"]))
    return lat, steady.rate()


async def _latencies_aio(
    n: int,
    rate: float | None,
    batch_size: int,
    latency_s: float,
    workers: int,
    warmup: int,
    transform_in: str | None = None,
) -> tuple[list[float], float]:
    lat: list[float] = []
    loader: AsyncDataLoader[Any]
    async with aio_class()(
        PacedSource(n, rate),
        batch_size=batch_size,
        num_workers=workers,
        max_batch_latency=latency_s,
        transform=to_sample,
        transform_in=transform_in,
    ) as loader:
        steady = _Rate()
        async for batch in loader:
            lat += _latencies(batch, time.perf_counter(), warmup)
            steady.batch(len(batch["seq"]))
        return lat, steady.rate()


def pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def measure_stream(
    *,
    rates: list[float],
    seconds: float,
    max_events: int,
    unpaced_events: int | None = None,
    batch_size: int,
    latency_s: float,
    workers: int,
    rounds: int,
    progress: Callable[[str], None],
) -> dict[str, dict[str, list[float]]]:
    """``{metric: {"torch"|"aioloader": [one value per round]}}``; loaders alternate per round.
    Each paced run reads at most ``max_events``, each unpaced one ``unpaced_events`` (by default
    as many)."""
    out: dict[str, dict[str, list[float]]] = {}

    def add(metric: str, name: str, value: float) -> None:
        out.setdefault(metric, {"torch": [], "aioloader": []}).setdefault(name, []).append(value)

    names = ("torch", "aioloader", AIO_WORKERS) if workers else ("torch", "aioloader")

    for r in range(rounds):
        for rate in rates:
            # The first 0.2 s warm up (a worker's first batch), and are not counted.
            warmup = int(rate * 0.2)
            n = min(max_events, warmup + max(batch_size * 2, int(rate * seconds)))
            for name in names:
                if name == "torch":
                    lat, _ = _latencies_torch(n, rate, batch_size, warmup)
                else:
                    where = "workers" if name == AIO_WORKERS else None
                    lat, _ = asyncio.run(
                        _latencies_aio(n, rate, batch_size, latency_s, workers, warmup, where)
                    )
                add(f"p50 latency ms @{rate:g}/s", name, pct(lat, 0.5) * 1e3)
                add(f"p99 latency ms @{rate:g}/s", name, pct(lat, 0.99) * 1e3)
        # Long enough that the first few batches (the pipeline filling) do not set the rate.
        n = unpaced_events or max_events
        for aio_workers in (workers, 0):
            metric = f"events/s, unpaced source, aioloader num_workers={aio_workers}"
            for name in ("torch", "aioloader"):
                if name == "torch":
                    _, per_s = _latencies_torch(n, None, batch_size, 0)
                else:
                    _, per_s = asyncio.run(
                        _latencies_aio(n, None, batch_size, latency_s, aio_workers, 0)
                    )
                add(metric, name, per_s)
            if aio_workers:
                # The shape's limit: one round trip per batch through the same number of worker
                # processes, the events' collated size (seq, time, 16 floats each) coming back.
                trips = max(1, n // batch_size)
                res = bare_round_trip(aio_workers, batch_size * (8 + 8 + FEATURES * 4), trips)
                add(metric, LIMIT, trips * batch_size / res.seconds)
        progress(f"round {r + 1}/{rounds}")
    return out


def bench_stream(cfg: Config) -> list[Row]:
    """Produce-to-delivery latency of a paced async source, and unpaced throughput."""
    batch_size, window_s = 64, 0.01
    measured = measure_stream(
        rates=[100.0, 1000.0, 10000.0],
        seconds=0.5 if cfg.quick else 3.0,
        max_events=plan(cfg, 30000, 4000),
        unpaced_events=plan(cfg, 120000, 20000),
        batch_size=batch_size,
        latency_s=window_s,
        workers=cfg.workers,
        rounds=cfg.rounds,
        progress=cfg.progress,
    )
    note = f"batch_size={batch_size}; aioloader max_batch_latency={window_s * 1e3:g} ms"
    rows = []
    for metric, rounds in measured.items():
        better = "higher" if metric.startswith("events/s") else "lower"
        row = Row("stream", metric, better, dict(rounds), note=note)
        in_workers, t = row.median(AIO_WORKERS), row.median("torch")
        if in_workers is not None and t:
            ratio = in_workers / t
            row.note = f"{note}; {AIO_WORKERS} (transform_in='workers') / torch = {ratio:.2f}x"
        if metric == "p99 latency ms @100/s":
            ratio_check(row, "<=", 0.1)  # size-or-time windows against size-only batches
        elif metric.endswith("@10000/s"):
            ratio_check(row, "<=", 1.0)  # a fast stream: at or below torch's latency
        elif LIMIT in rounds:
            ratio_check(row, ">=", 1.5)
        rows.append(row)
        if LIMIT in rounds:
            label = f" (unpaced, num_workers={cfg.workers})"
            rows.append(fraction_of_limit("stream", label, rounds))
    return rows
