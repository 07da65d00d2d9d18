"""``loop-lag``: how late a 1 ms ``asyncio.sleep`` wakes while each loader runs."""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import time
from typing import Any

from torch.utils.data import DataLoader, Dataset

from aioloader.benchmark._harness import (
    AIO,
    TORCH,
    Config,
    Row,
    aio_class,
    loader_kwargs,
    plan,
    ratio_check,
    spin,
)
from aioloader.benchmark.cpu import JpegDataset, make_jpeg


def _spinner(seconds: float) -> None:
    spin(seconds)


async def _probe(stop: asyncio.Event, lags_ms: list[float]) -> None:
    """Sleep 1 ms in a loop and record how late each wake-up is."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags_ms.append((time.perf_counter() - t - 0.001) * 1e3)


async def _lag_variant(
    variant: str, ds: Dataset[Any], kwargs: dict[str, Any], warmup: int, floor_s: float
) -> list[float]:
    lags: list[float] = []
    stop = asyncio.Event()
    task: asyncio.Task[None] | None = None

    def begin() -> None:
        nonlocal task
        task = asyncio.create_task(_probe(stop, lags))

    if variant == "floor":
        # Two processes spinning stand in for two busy workers, with no loader at all.
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_spinner, args=(floor_s + 0.5,)) for _ in range(2)]
        for p in procs:
            p.start()
        await asyncio.sleep(0.1)
        begin()
        await asyncio.sleep(floor_s)
        stop.set()
        for p in procs:
            p.terminate()
            p.join()
    elif variant in ("torch-next", "torch-thread"):
        it = iter(DataLoader(ds, **kwargs))
        for _ in range(warmup):
            next(it)
        begin()
        if variant == "torch-next":
            for _ in it:  # next() runs on the loop's thread: this is the blocking case
                await asyncio.sleep(0)
        else:
            done = object()
            while await asyncio.to_thread(next, it, done) is not done:
                pass
        stop.set()
        del it
    else:
        async with aio_class()(ds, **kwargs) as loader:
            seen = 0
            async for _ in loader:
                seen += 1
                if seen == warmup:
                    begin()
        stop.set()
    if task is not None:
        await task
    return lags


def _pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def bench_loop_lag(cfg: Config) -> list[Row]:
    warmup = 4
    batches = plan(cfg, 40, 15)
    ds = JpegDataset((batches + warmup) * 32, make_jpeg())
    kwargs = loader_kwargs(cfg, 32)
    floor_s = plan(cfg, 15, 10) / 10
    variants = ["torch-next", "torch-thread", "aio", "floor"]
    stats: dict[str, dict[str, list[float]]] = {
        v: {"p50": [], "p99": [], "max": []} for v in variants
    }
    # A p99 over one short round swings by milliseconds on a shared machine: take more rounds
    # than the throughput workloads (each is ~10 s) and compare medians.
    rounds = max(cfg.rounds, 3 if cfg.quick else 5)
    for r in range(rounds):
        for v in variants:
            lags = asyncio.run(_lag_variant(v, ds, kwargs, warmup, floor_s))
            if not lags:
                continue
            stats[v]["p50"].append(_pct(lags, 0.50))
            stats[v]["p99"].append(_pct(lags, 0.99))
            stats[v]["max"].append(max(lags))
        cfg.progress(f"round {r + 1}/{rounds}")
    rows: list[Row] = []
    for q in ("p50", "p99", "max"):
        row = Row(
            "loop-lag",
            f"{q} lag ms, torch next() in coroutine",
            "lower",
            {TORCH: stats["torch-next"][q], AIO: stats["aio"][q]},
        )
        if q == "p99":
            ratio_check(row, "<=", 0.1)
        rows.append(row)
    rows.append(
        Row(
            "loop-lag",
            "p99 lag ms, torch via asyncio.to_thread",
            "lower",
            {TORCH: stats["torch-thread"]["p99"], AIO: stats["aio"]["p99"]},
        )
    )
    floor = Row(
        "loop-lag",
        "p99 lag ms, floor (2 spinning procs, no loader)",
        "lower",
        {TORCH: stats["floor"]["p99"], AIO: stats["aio"]["p99"]},
        note="torch column is the floor",
    )
    f, a = floor.median(TORCH), floor.median(AIO)
    floor.target = "<= floor + 1 ms"
    if f is not None and a is not None:
        floor.passed = a <= f + 1.0
    rows.append(floor)
    return rows
