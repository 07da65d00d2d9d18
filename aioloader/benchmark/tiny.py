"""``tiny``: no work per sample, so the figures are pure per-batch overhead."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from aioloader.benchmark._harness import (
    Config,
    Row,
    plan,
    ratio_check,
    simple,
)


class TinyDataset(Dataset[torch.Tensor]):
    """16 floats per sample and no work: measures pure per-batch overhead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


def bench_tiny(cfg: Config) -> list[Row]:
    rows: list[Row] = []
    for bs, full, quick in ((1, 600, 200), (64, 400, 120)):
        got = simple(
            cfg,
            "tiny",
            TinyDataset,
            bs,
            plan(cfg, full, quick),
            30,
            label=f" (batch {bs})",
            unit="batches",
        )
        ratio_check(got[0], ">=", 1.5)
        rows += got
    return rows
