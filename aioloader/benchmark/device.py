"""``device``: host-to-device throughput (skipped without CUDA)."""

from __future__ import annotations

import asyncio

import torch
from torch.utils.data import DataLoader

from aioloader.benchmark._harness import (
    AIO,
    Config,
    RoundResult,
    Row,
    Timer,
    aio_class,
    alternate,
    loader_kwargs,
    plan,
    ratio_check,
    stall_of,
    throughput_rows,
)
from aioloader.benchmark.big import BigDataset


def bench_device(cfg: Config) -> list[Row]:
    """Host-to-device throughput: aioloader(device="cuda") vs torch(pin_memory) + .to(cuda)."""
    if not torch.cuda.is_available():
        cfg.progress("device: no CUDA device, skipped")
        return [Row("device", "skipped: no CUDA device", "higher", {}, note="needs a GPU")]
    warmup = 3
    batches = plan(cfg, 40, 12)
    ds = BigDataset((batches + warmup) * 64)
    kwargs = {**loader_kwargs(cfg, 64), "pin_memory": True}

    def one(name: str) -> RoundResult:
        timer = Timer(warmup, None)
        if name == AIO:

            async def drain() -> RoundResult:
                async with aio_class()(ds, device="cuda", **kwargs) as loader:
                    async for batch in loader:
                        batch.add_(1)  # a kernel on the consumer stream that reads the copy
                        timer.tick(batch)
                torch.cuda.synchronize()
                return timer.result(stall_of(loader))

            return asyncio.run(drain())
        for batch in DataLoader(ds, **kwargs):
            moved = batch.to("cuda", non_blocking=True)
            moved.add_(1)
            timer.tick(moved)
        torch.cuda.synchronize()
        return timer.result()

    res = alternate(cfg, one)
    rows = throughput_rows("device", " (batch 64, 38.5 MB to cuda)", res)
    ratio_check(rows[0], ">=", 1.0)
    return rows
