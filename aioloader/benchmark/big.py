"""``big``: 38.5 MB batches; throughput and the process tree's peak memory."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from aioloader.benchmark._harness import (
    Config,
    Row,
    alternate,
    loader_kwargs,
    per_loader,
    plan,
    ratio_check,
    run_once,
    throughput_rows,
)


class BigDataset(Dataset[torch.Tensor]):
    """3x224x224 float32 samples (~600 KB); a batch of 64 is ~38.5 MB."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 224, 224), float(i))


def bench_big(cfg: Config) -> list[Row]:
    warmup = 3
    batches = plan(cfg, 40, 15)
    ds = BigDataset((batches + warmup) * 64)
    kwargs = loader_kwargs(cfg, 64)
    res = alternate(cfg, lambda n: run_once(n, ds, kwargs, warmup))
    rows = throughput_rows("big", " (batch 64, 38.5 MB)", res)
    ratio_check(rows[0], ">=", 1.0)
    rows[0].target += " (stretch 1.2x)"
    # Separate rounds for memory: the sampler thread costs CPU that would skew throughput.
    cfg.progress("memory rounds")
    mem_batches = plan(cfg, 20, 8)
    mds = BigDataset((mem_batches + warmup) * 64)
    mres = alternate(cfg, lambda n: run_once(n, mds, kwargs, warmup, memory=True))
    mb = 1024.0 * 1024.0
    peak = Row(
        "big",
        "peak PSS of process tree, MB",
        "lower",
        per_loader(mres, lambda r: None if r.peak_pss is None else r.peak_pss / mb),
    )
    ratio_check(peak, "<=", 1.1)
    delta = Row(
        "big",
        "peak PSS above pre-loader baseline, MB",
        "lower",
        per_loader(
            mres,
            lambda r: (
                None if r.peak_pss is None or r.base_pss is None else (r.peak_pss - r.base_pss) / mb
            ),
        ),
        note="informational: what the loader itself adds",
    )
    return [*rows, peak, delta]
