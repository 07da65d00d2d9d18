"""``io``: 5 ms of waiting (not CPU) per sample, like a remote read."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset

from aioloader.benchmark._harness import (
    Config,
    Row,
    plan,
    ratio_check,
    simple,
)


class SleepDataset(Dataset[torch.Tensor]):
    """5 ms of waiting (not CPU) per sample, like a remote read."""

    def __init__(self, n: int, delay: float = 0.005) -> None:
        self.n = n
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.tensor([i])


def bench_io(cfg: Config) -> list[Row]:
    rows = simple(cfg, "io", SleepDataset, 32, plan(cfg, 16, 6), 2, label=" (batch 32)")
    ratio_check(rows[0], ">=", 1.0)
    return rows
