"""``tiny``: no work per sample, so the figures are pure per-batch overhead."""

from __future__ import annotations

import dataclasses

import torch
from torch.utils.data import Dataset

from aioloader.benchmark._harness import (
    AIO,
    Config,
    RoundResult,
    Row,
    alternate,
    loader_kwargs,
    plan,
    ratio_check,
    run_once,
    throughput_rows,
)
from aioloader.benchmark._limit import LIMIT, bare_round_trip


class TinyDataset(Dataset[torch.Tensor]):
    """16 floats per sample and no work: measures pure per-batch overhead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


def fraction_of_limit(workload: str, label: str, rounds: dict[str, list[float]]) -> Row:
    """aioloader's figure over the bare round trip's, round by round (taken side by side)."""
    pairs = zip(rounds.get(AIO, []), rounds.get(LIMIT, []), strict=False)
    row = Row(
        workload,
        f"aioloader as a fraction of the bare round trip{label}",
        "higher",
        {AIO: [a / lim for a, lim in pairs if lim]},
        target=">= 0.6",
        note="bare round trip: asyncio + ProcessPoolExecutor, bytes of the batch's size",
    )
    f = row.median(AIO)
    row.passed = None if f is None else f >= 0.6
    return row


def bench_tiny(cfg: Config) -> list[Row]:
    rows: list[Row] = []
    # The limit runs as one more "loader" of every round, so that all see the same load.
    with_limit = dataclasses.replace(cfg, loaders=[*cfg.loaders, LIMIT])
    warmup = 30
    for bs, full, quick in ((1, 600, 200), (64, 400, 120)):
        batches = plan(cfg, full, quick)
        ds = TinyDataset((batches + warmup) * bs)
        kwargs = loader_kwargs(cfg, bs)
        nbytes = bs * 16 * 4  # the batch's tensor: bs x 16 float32

        def one(name: str, ds: TinyDataset = ds, kwargs: dict[str, int] = kwargs,
                nbytes: int = nbytes, batches: int = batches) -> RoundResult:  # fmt: skip
            if name == LIMIT:
                return bare_round_trip(cfg.workers, nbytes, batches, warmup)
            return run_once(name, ds, kwargs, warmup)

        res = alternate(with_limit, one)
        label = f" (batch {bs})"
        got = throughput_rows("tiny", label, res, unit="batches")
        ratio_check(got[0], ">=", 3.0)
        rows += [*got, fraction_of_limit("tiny", label, got[0].rounds)]
    return rows
