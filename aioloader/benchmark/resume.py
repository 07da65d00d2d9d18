"""``resume``: what being resumable costs: ``state_dict()`` per call, and throughput with it
called after every batch against without, in the same run (both aioloader; torch has no
``state_dict``)."""

from __future__ import annotations

import asyncio
import statistics
import time

from aioloader.benchmark._harness import AIO, Config, Row, aio_class, plan
from aioloader.benchmark.tiny import TinyDataset


async def _drain(n: int, workers: int, save: bool) -> tuple[float, float, int]:
    """(seconds for the epoch, seconds inside state_dict(), calls)."""
    ds = TinyDataset(n * 64)
    in_state = 0.0
    calls = 0
    async with aio_class()(ds, batch_size=64, num_workers=workers, shuffle=True) as loader:
        t0 = 0.0
        seen = 0
        async for _ in loader:
            seen += 1
            if seen == 10:  # warm-up: workers started, pipeline full
                t0 = time.perf_counter()
            if save:
                s = time.perf_counter()
                loader.state_dict()
                in_state += time.perf_counter() - s
                calls += 1
        return time.perf_counter() - t0, in_state, calls


def bench_resume(cfg: Config) -> list[Row]:
    batches = plan(cfg, 400, 120)
    plain: list[float] = []
    saved: list[float] = []
    per_call: list[float] = []
    for r in range(cfg.rounds):
        for save in (False, True):
            secs, in_state, calls = asyncio.run(_drain(batches + 10, cfg.workers, save))
            (saved if save else plain).append(batches / secs)
            if save:
                per_call.append(in_state / calls * 1e6)
        cfg.progress(f"round {r + 1}/{cfg.rounds}")
    base = statistics.median(plain)
    overhead = (base - statistics.median(saved)) / base * 100
    return [
        Row("resume", "batches/s (tiny, batch 64)", "higher", {AIO: plain}),
        Row(
            "resume",
            "batches/s (tiny, batch 64), state_dict() after every batch",
            "higher",
            {AIO: saved},
            note=f"{overhead:+.1f}% slower than without, same run (noise: compare the rounds)",
        ),
        Row(
            "resume",
            "state_dict() µs per call (shuffle=True, mid-epoch)",
            "lower",
            {AIO: per_call},
            note="includes encoding the epoch's RNG states on every call",
        ),
    ]
