"""``text``: batches of Python objects (a list of strings per sample), kept as a list.

What a text or tabular pipeline hands the loop: no tensors, tens of thousands of small objects
per batch, which the main process must rebuild. Two figures: throughput against torch, and how
late a 1 ms ``asyncio.sleep`` beside the consumer wakes (p99) against the floor (two spinning
processes and no loader), as in ``loop-lag``.
"""

from __future__ import annotations

import asyncio
from typing import Any

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
    throughput_rows,
)
from aioloader.benchmark.loop_lag import _lag_variant, _pct

#: Strings per sample: 32 samples make a batch of 64 000 strings (about 0.8 MB pickled).
STRINGS = 2000

_WORDS = ("alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda")


class TextDataset(Dataset[list[str]]):
    """Sample ``i``: a list of :data:`STRINGS` short strings (a tokenised document)."""

    def __init__(self, n: int, strings: int = STRINGS) -> None:
        self.n = n
        self.strings = strings

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[str]:
        w = _WORDS
        return [f"{w[(i + j) % 9]}{j}" for j in range(self.strings)]


def keep_list(batch: list[Any]) -> list[Any]:
    """``collate_fn``: the batch stays a list of samples (module level: it must pickle)."""
    return batch


def bench_text(cfg: Config) -> list[Row]:
    warmup = 4
    batches = plan(cfg, 40, 15)
    ds = TextDataset((batches + warmup) * 32)
    kwargs = {**loader_kwargs(cfg, 32), "collate_fn": keep_list}
    res = alternate(cfg, lambda n: run_once(n, ds, kwargs, warmup))
    # A batch is a list of lists of strings: count batches (a sample has no length to count).
    rows = throughput_rows("text", f" (batch 32 x {STRINGS} strings)", res, unit="batches")
    ratio_check(rows[0], ">=", 1.0)

    # Enough batches for a p99 of a few thousand 1 ms wake-ups (about 1-3 s per round).
    lag_ds = TextDataset((plan(cfg, 300, 120) + warmup) * 32)
    floor_s = plan(cfg, 15, 10) / 10
    variants = ("aio", "floor")
    p99: dict[str, list[float]] = {v: [] for v in variants}
    worst: dict[str, list[float]] = {v: [] for v in variants}
    rounds = max(cfg.rounds, 3 if cfg.quick else 5)
    for r in range(rounds):
        for v in variants:
            lags = asyncio.run(_lag_variant(v, lag_ds, kwargs, warmup, floor_s))
            if lags:
                p99[v].append(_pct(lags, 0.99))
                worst[v].append(max(lags))
        cfg.progress(f"text loop lag: round {r + 1}/{rounds}")
    lag = Row(
        "text",
        "p99 loop lag ms, floor (2 spinning procs, no loader)",
        "lower",
        {TORCH: p99["floor"], AIO: p99["aio"]},
        target="<= floor + 1 ms",
        note="torch column is the floor",
    )
    f, a = lag.median(TORCH), lag.median(AIO)
    if f is not None and a is not None:
        lag.passed = a <= f + 1.0
    rows.append(lag)
    rows.append(
        Row(
            "text",
            "max loop lag ms, floor (2 spinning procs, no loader)",
            "lower",
            {TORCH: worst["floor"], AIO: worst["aio"]},
            note="torch column is the floor; informational",
        )
    )
    return rows
