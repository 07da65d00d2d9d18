"""``skewed``: one straggler sample in 16; in-order vs ``in_order=False``."""

from __future__ import annotations

import os
import statistics

import torch
from torch.utils.data import Dataset

from aioloader.benchmark._harness import (
    AIO,
    TORCH,
    Config,
    Row,
    alternate,
    loader_kwargs,
    plan,
    ratio_check,
    run_once,
    spin,
    throughput_rows,
)


class SkewedDataset(Dataset[torch.Tensor]):
    """Mostly 0.2 ms of CPU per sample, but ``index % 16 == 7`` costs 20 ms (a straggler)."""

    FAST = 0.0002
    SLOW = 0.020

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    @classmethod
    def cost(cls, i: int) -> float:
        return cls.SLOW if i % 16 == 7 else cls.FAST

    def __getitem__(self, i: int) -> torch.Tensor:
        spin(self.cost(i))
        return torch.tensor([i])


def bench_skewed(cfg: Config) -> list[Row]:
    warmup = 8
    batches = plan(cfg, 128, 48)
    ds = SkewedDataset((batches + warmup) * 8)
    kwargs = loader_kwargs(cfg, 8)
    res = alternate(cfg, lambda n: run_once(n, ds, kwargs, warmup))
    # The bound no loader can beat: all the CPU work spread perfectly over the usable cores.
    mean_cost = statistics.fmean(SkewedDataset.cost(i) for i in range(16))
    cores = min(cfg.workers, os.cpu_count() or 1)
    limit = cores / mean_cost
    rows = throughput_rows("skewed", f" (batch 8; CPU limit {limit:.0f})", res)
    rows[0].note = "in order: both loaders assign batches round-robin"
    # Without an order promise aioloader feeds all workers from one queue (torch keeps
    # per-worker queues): the straggler no longer holds up the batches behind it.
    unordered = {**kwargs, "in_order": False}
    res_u = alternate(cfg, lambda n: run_once(n, ds, unordered, warmup))
    rows_u = throughput_rows("skewed", f" (batch 8, in_order=False; limit {limit:.0f})", res_u)
    ratio_check(rows_u[0], ">=", 1.3)
    # The comparison: a shared queue (aioloader, in_order=False) against torch's
    # default round-robin assignment, from the two alternating series above.
    mixed = Row(
        "skewed",
        "samples/s, aioloader in_order=False vs torch default",
        "higher",
        {TORCH: rows[0].rounds.get(TORCH, []), AIO: rows_u[0].rounds.get(AIO, [])},
        note="torch column: default in-order run; aioloader column: in_order=False run",
    )
    ratio_check(mixed, ">=", 1.3)
    # In order with seeding="batch": the worker no longer decides a batch's augmentations, so
    # aioloader keeps the order promise with one shared queue too (torch has no such mode).
    seeded = {**kwargs, "seeding": "batch"}
    res_s = alternate(cfg, lambda n: run_once(n, ds, seeded if n == AIO else kwargs, warmup))
    rows_s = throughput_rows(
        "skewed", f" (batch 8, in order, aioloader seeding='batch'; limit {limit:.0f})", res_s
    )
    rows_s[0].note = "torch column: its default (round-robin, per-worker seeds)"
    ratio_check(rows_s[0], ">=", 1.3)
    return [*rows, *rows_u, mixed, *rows_s]
