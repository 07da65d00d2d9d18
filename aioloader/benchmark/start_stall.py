"""How long the event loop stalls while a loader's workers start.

Run ``python -m aioloader.benchmark.start_stall``. A probe sleeps 1 ms on the loop, in a loop,
while an :class:`~aioloader.AsyncDataLoader` over the start-up workload's dataset (a list of
``(path, label)`` tuples held in memory) starts its workers and takes its first batch; the script
prints the probe's longest lateness and how many wakes were more than 5 ms late, per start method
and worker count.

Workers start on a helper thread, but a fork holds the interpreter lock while it copies the
process's page tables, and under spawn/forkserver pickling the dataset holds it in single C steps
(the pickler's memo table growing or freed): the loop cannot run meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Sequence

from aioloader import AsyncDataLoader
from aioloader.benchmark.loop_lag import _probe
from aioloader.benchmark.startup import StartupDataset

__all__ = ("measure_start_stall",)


async def _measure(ds: StartupDataset, method: str, workers: int) -> dict[str, float]:
    lags: list[float] = []
    stop = asyncio.Event()
    probe = asyncio.create_task(_probe(stop, lags))
    try:
        await asyncio.sleep(0.05)  # the probe's own rhythm first
        before = len(lags)
        t0 = time.perf_counter()
        async with AsyncDataLoader(
            ds, batch_size=64, num_workers=workers, multiprocessing_context=method
        ) as loader:
            async for _ in loader:
                first = time.perf_counter() - t0
                break
            stop.set()
            await asyncio.wait_for(probe, 10)
    finally:
        stop.set()
        probe.cancel()
    during = lags[before:] or [0.0]
    return {
        "first_batch_ms": first * 1e3,
        "max_stall_ms": max(during),
        "stalls_over_5ms": float(sum(lag > 5.0 for lag in during)),
    }


def measure_start_stall(
    entries: int, methods: Sequence[str], workers: Sequence[int]
) -> list[dict[str, object]]:
    """One start per (method, workers): the first batch's time and the loop's stalls meanwhile."""
    ds = StartupDataset(entries, serve=64 * 4)
    rows: list[dict[str, object]] = []
    for method in methods:
        for n in workers:
            row: dict[str, object] = {"method": method, "workers": n}
            row.update(asyncio.run(_measure(ds, method, n)))
            rows.append(row)
    return rows


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m aioloader.benchmark.start_stall", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--entries", type=int, default=1_200_000, help="dataset entries held")
    parser.add_argument("--methods", default="fork,forkserver", help="start methods, comma list")
    parser.add_argument("--workers", default="2,4", help="worker counts, comma list")
    args = parser.parse_args(argv)
    rows = measure_start_stall(
        args.entries, args.methods.split(","), [int(w) for w in args.workers.split(",")]
    )
    print(f"dataset: {args.entries} entries; process {_rss_mb():.0f} MB")
    print("method      workers  first batch ms  longest stall ms  stalls > 5 ms")
    for r in rows:
        print(
            f"{r['method']:<11} {r['workers']:>7}  {r['first_batch_ms']:>14.0f}"
            f"  {r['max_stall_ms']:>16.1f}  {r['stalls_over_5ms']:>13.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
