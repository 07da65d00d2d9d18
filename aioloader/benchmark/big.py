"""``big``: 38.5 MB batches; throughput and the process tree's peak memory."""

from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ProcessPoolExecutor

import torch
from torch.utils.data import Dataset

from aioloader.benchmark._harness import (
    AIO,
    Config,
    RoundResult,
    Row,
    alternate,
    loader_kwargs,
    per_loader,
    plan,
    ratio_check,
    run_once,
    throughput_rows,
)
from aioloader.benchmark._limit import LIMIT


class BigDataset(Dataset[torch.Tensor]):
    """3x224x224 float32 samples (~600 KB); a batch of 64 is ~38.5 MB."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 224, 224), float(i))


def _build_batches(n: int, batches: int) -> tuple[float, float]:
    """In a process of the limit's pool: build ``batches`` batches of 64 samples, copying each
    sample into one reused batch buffer as it is made (what the loader's workers do at best);
    one batch untimed first. The (start, end) of the timed part, on the shared monotonic clock."""
    torch.set_num_threads(1)
    ds = BigDataset(n)
    buf = torch.empty((64, 3, 224, 224))
    for b in range(batches + 1):
        if b == 1:
            start = time.perf_counter()
        for k in range(64):
            buf[k].copy_(ds[(b * 64 + k) % n])
    return start, time.perf_counter()


def copy_limit(workers: int, batches: int) -> RoundResult:
    """The machine's limit for ``big``, one round: ``min(workers, cores)`` processes build
    samples and copy them into a reused buffer side by side, with no loader and nothing sent
    anywhere. Run as one more "loader" of every round, so it sees the same load as the loaders."""
    procs = min(workers, os.cpu_count() or 1)
    each = max(1, batches // procs)
    with ProcessPoolExecutor(procs) as pool:
        spans = list(pool.map(_build_batches, [64 * (each + 1)] * procs, [each] * procs))
    seconds = max(end for _, end in spans) - min(start for start, _ in spans)
    return RoundResult(seconds, each * procs, 64 * each * procs)


def bench_big(cfg: Config) -> list[Row]:
    warmup = 3
    batches = plan(cfg, 40, 15)
    ds = BigDataset((batches + warmup) * 64)
    kwargs = loader_kwargs(cfg, 64)
    with_limit = dataclasses.replace(cfg, loaders=[*cfg.loaders, LIMIT])

    def one(name: str) -> RoundResult:
        if name == LIMIT:
            return copy_limit(cfg.workers, batches)
        return run_once(name, ds, kwargs, warmup)

    res = alternate(with_limit, one)
    rows = throughput_rows("big", " (batch 64, 38.5 MB)", res)
    ratio_check(rows[0], ">=", 1.3)
    pairs = zip(res.get(AIO, []), res.get(LIMIT, []), strict=False)
    frac = Row(
        "big",
        "aioloader samples/s as a fraction of the copy limit",
        "higher",
        {AIO: [a.samples / a.seconds / (lim.samples / lim.seconds) for a, lim in pairs]},
        note="copy limit: as many processes as workers (at most one per core) building the "
        "samples and copying each into a reused buffer, no loader; round by round",
    )
    f = frac.median(AIO)
    frac.target = ">= 0.8"
    frac.passed = None if f is None else f >= 0.8
    rows.append(frac)
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
    ratio_check(peak, "<=", 1.0)
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
