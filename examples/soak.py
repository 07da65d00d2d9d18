"""Soak: hours of small-batch load compressed into minutes, watching for slow leaks.

Run: python examples/soak.py [--batches 100000] [--workers 2] [--report-every 10000]

Consumes ``--batches`` small batches over many epochs, switching between persistent and
non-persistent workers, in-order and unordered delivery, with an early ``break`` now and then,
and prints the main process's RSS/PSS, child processes, threads, open fds and aioloader files in
/dev/shm every ``--report-every`` batches. The last line compares the first and last readings.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time

import psutil
import torch
from torch.utils.data import Dataset

from aioloader import AsyncDataLoader


class Small(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 5_000

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((16,), float(i)), "y": torch.tensor(i % 10)}


def reading() -> dict[str, float]:
    proc = psutil.Process()
    mem = proc.memory_full_info()
    shm = (
        [f for f in os.listdir("/dev/shm") if f.startswith(f"aioloader-{os.getpid()}-")]
        if os.path.isdir("/dev/shm")
        else []
    )
    return {
        "rss_mb": mem.rss / 2**20,
        "pss_mb": mem.pss / 2**20,
        "children": len(proc.children(recursive=True)),
        "threads": threading.active_count(),
        "fds": proc.num_fds(),
        "shm": len(shm),
    }


async def soak(total: int, workers: int, every: int) -> None:
    ds = Small()
    done = 0
    epoch = 0
    t0 = time.perf_counter()
    first: dict[str, float] | None = None
    last: dict[str, float] = {}
    next_report = 0
    while done < total:
        persistent = epoch % 2 == 0
        async with AsyncDataLoader(
            ds,
            batch_size=8,
            shuffle=True,
            num_workers=workers,
            persistent_workers=persistent,
            in_order=epoch % 3 != 2,
        ) as loader:
            for sub in range(3):
                async for batch in loader:
                    assert batch["x"].shape == (8, 16) or batch["x"].shape[0] < 8
                    done += 1
                    if done >= next_report:
                        last = reading()
                        first = first or last
                        rate = done / (time.perf_counter() - t0)
                        print(
                            f"{done:>8} batches  {rate:7.0f}/s  rss {last['rss_mb']:7.1f} MB  "
                            f"pss {last['pss_mb']:7.1f} MB  children {last['children']:.0f}  "
                            f"threads {last['threads']:.0f}  fds {last['fds']:.0f}  "
                            f"shm {last['shm']:.0f}",
                            flush=True,
                        )
                        next_report += every
                    if done >= total or (sub == 1 and done % 997 == 0):
                        break  # an abandoned epoch now and then
                if done >= total:
                    break
        epoch += 1
    after = reading()
    assert first is not None
    print(
        f"done: {done} batches in {time.perf_counter() - t0:.0f}s over {epoch} loaders; "
        f"RSS {first['rss_mb']:.1f} -> {after['rss_mb']:.1f} MB "
        f"({after['rss_mb'] - first['rss_mb']:+.1f}), "
        f"fds {first['fds']:.0f} -> {after['fds']:.0f}, "
        f"threads {first['threads']:.0f} -> {after['threads']:.0f}, "
        f"children after close {after['children']:.0f}, shm files {after['shm']:.0f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--report-every", type=int, default=10_000)
    args = parser.parse_args()
    asyncio.run(soak(args.batches, args.workers, args.report_every))
