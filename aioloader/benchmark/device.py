"""``device``: the host-to-device path, with the copy as the bottleneck (skipped without CUDA).

The dataset hands out ready batches from memory (``batch_size=None``: no collate, no worker hop),
so what is timed is pinning and the copy to the GPU. Three rows:

* **pinned batches**: the batches already live in page-locked memory, so pinning is a no-op and the
  copy engine alone bounds the rate. ``limit`` is a plain loop of ``.to("cuda",
  non_blocking=True)`` over the same pinned tensors on the same device: the most the link moves.
* **pageable batches**: ordinary host tensors, pinned per batch (a host copy) and then copied;
  ``limit`` is a plain loop of ``.pin_memory().to("cuda", non_blocking=True)``.
* **overlap**: every step runs a kernel of about one copy's duration on the consumer's stream (timed
  there with CUDA events) over the batch. aioloader copies batch k+1 on a side stream while the
  kernel runs on batch k, so a step costs about max(copy, kernel); torch's copy is queued on the
  consumer's own stream, so a step costs copy + kernel. The row reports seconds per step, with
  ``limit`` the kernel alone (no copy at all).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from aioloader.benchmark._harness import (
    AIO,
    TORCH,
    Config,
    Row,
    aio_class,
    plan,
)
from aioloader.benchmark._limit import LIMIT

#: One batch: 64 MiB of float32, large enough that per-batch overheads are small against the copy.
BATCH_BYTES = 64 << 20
#: Distinct host buffers the dataset cycles through (the copy source; the GPU side is fresh).
BUFFERS = 4


class ReadyBatches(Dataset[torch.Tensor]):
    """Item i is ready batch ``i % BUFFERS``: nothing to load, collate or move between processes."""

    def __init__(self, length: int, pinned: bool) -> None:
        self.length = length
        n = BATCH_BYTES // 4
        self.buffers = [torch.full((n,), float(i)) for i in range(BUFFERS)]
        if pinned:
            self.buffers = [b.pin_memory() for b in self.buffers]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.buffers[index % BUFFERS]


def _gbps(batches: int, seconds: float) -> float:
    return batches * BATCH_BYTES / seconds / 1e9


def _step(batch: torch.Tensor, sleep_cycles: int) -> None:
    """The consumer's work on one batch, queued on the current (consumer) stream."""
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)  # type: ignore[no-untyped-call]
    batch.add_(1)  # reads (and writes) the copy: a step that depends on the batch's arrival


def _aio_run(ds: ReadyBatches, warmup: int, sleep_cycles: int) -> tuple[float, int]:
    async def drain() -> tuple[float, int]:
        seen, t0 = 0, 0.0
        async with aio_class()(ds, batch_size=None, num_workers=0, device="cuda") as loader:
            async for batch in loader:
                _step(batch, sleep_cycles)
                seen += 1
                if seen == warmup:
                    await asyncio.to_thread(torch.cuda.synchronize)
                    t0 = time.perf_counter()
            await asyncio.to_thread(torch.cuda.synchronize)
        return time.perf_counter() - t0, seen - warmup

    return asyncio.run(drain())


def _timed(batches: Iterator[torch.Tensor], warmup: int, sleep_cycles: int) -> tuple[float, int]:
    """Run the consumer's step on each device batch: seconds and batches after ``warmup``."""
    seen, t0 = 0, 0.0
    for batch in batches:
        _step(batch, sleep_cycles)
        seen += 1
        if seen == warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, seen - warmup


def _torch_run(ds: ReadyBatches, warmup: int, sleep_cycles: int) -> tuple[float, int]:
    loader = DataLoader(ds, batch_size=None, num_workers=0, pin_memory=True)
    return _timed((b.to("cuda", non_blocking=True) for b in loader), warmup, sleep_cycles)


def _plain_run(ds: ReadyBatches, warmup: int, pin: bool, copy: bool,
               sleep_cycles: int) -> tuple[float, int]:  # fmt: skip
    """The machine's limit: the same copies (and kernels) in a bare loop, no loader at all."""
    resident = torch.empty(BATCH_BYTES // 4, device="cuda")

    def batches() -> Iterator[torch.Tensor]:
        for i in range(len(ds)):
            if not copy:
                yield resident
                continue
            src = ds[i]
            yield (src.pin_memory() if pin else src).to("cuda", non_blocking=True)

    return _timed(batches(), warmup, sleep_cycles)


def _rounds(
    cfg: Config,
    label: str,
    ds: ReadyBatches,
    warmup: int,
    sleep_cycles: int,
    limit: Callable[[], tuple[float, int]],
    value: Callable[[float, int], float],
) -> dict[str, list[float]]:
    """``cfg.rounds`` alternating rounds of torch, aioloader and ``limit``: ``value(seconds,
    batches)`` of each."""
    rounds: dict[str, list[float]] = {n: [] for n in (TORCH, AIO, LIMIT)}
    for r in range(cfg.rounds):
        for name, run in rounds.items():
            if name == AIO:
                secs, n = _aio_run(ds, warmup, sleep_cycles)
            elif name == TORCH:
                secs, n = _torch_run(ds, warmup, sleep_cycles)
            else:
                secs, n = limit()
            run.append(value(secs, n))
        cfg.progress(f"{label} round {r + 1}/{cfg.rounds}")
    return rounds


def _kernel_ms(sleep_cycles: int, repeats: int = 20) -> float:
    """Median duration of one consumer step's kernel, timed on the consumer stream by events."""
    resident = torch.empty(BATCH_BYTES // 4, device="cuda")
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        _step(resident, sleep_cycles)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return float(times[len(times) // 2])


def _calibrate(target_ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` whose step takes about ``target_ms`` on this GPU."""
    cycles = 1_000_000
    for _ in range(4):
        ms = _kernel_ms(cycles, repeats=5)
        cycles = max(1, int(cycles * target_ms / max(ms, 1e-3)))
    return cycles


def bench_device(cfg: Config) -> list[Row]:
    """GB/s of ``device="cuda"`` against torch and a bare copy loop; the copy/compute overlap."""
    if not torch.cuda.is_available():
        cfg.progress("device: no CUDA device, skipped")
        return [Row("device", "skipped: no CUDA device", "higher", {}, note="needs a GPU")]
    cfg.progress(f"device: {device_info()}")
    warmup = 5
    batches = plan(cfg, 200, 40)
    rows: list[Row] = []
    for pinned in (True, False):
        ds = ReadyBatches(batches + warmup, pinned)
        rounds = _rounds(
            cfg,
            "pinned" if pinned else "pageable",
            ds,
            warmup,
            0,
            functools.partial(_plain_run, ds, warmup, pin=not pinned, copy=True, sleep_cycles=0),
            lambda secs, n: _gbps(n, secs),
        )
        kind = "pinned" if pinned else "pageable, pinned per batch"
        row = Row("device", f"GB/s ({kind}; 64 MiB batches)", "higher", rounds)
        limit = row.median(LIMIT)
        aio = row.median(AIO)
        if limit and aio:
            row.target = ">= 0.9 of limit"
            row.passed = aio / limit >= 0.9
            row.note = f"aioloader / limit = {aio / limit:.2f}"
        rows.append(row)
        del ds

    # Overlap: a kernel of about one pinned copy's duration per step.
    ds = ReadyBatches(batches + warmup, pinned=True)
    secs, n = _plain_run(ds, warmup, pin=False, copy=True, sleep_cycles=0)
    copy_ms = secs / n * 1e3
    cycles = _calibrate(copy_ms)
    kernel_ms = _kernel_ms(cycles)
    rounds = _rounds(
        cfg,
        "overlap",
        ds,
        warmup,
        cycles,
        functools.partial(_plain_run, ds, warmup, pin=False, copy=False, sleep_cycles=cycles),
        lambda secs, n: secs / n * 1e3,
    )
    row = Row("device", "ms per step (copy + kernel on the batch)", "lower", rounds)
    aio = row.median(AIO)
    if aio:
        # 1.0: the copy hides entirely behind the kernel; 0.0: they run one after the other.
        hidden = (copy_ms + kernel_ms - aio) / min(copy_ms, kernel_ms)
        row.target = "copy hidden >= 0.8"
        row.passed = hidden >= 0.8
        row.note = (
            f"copy {copy_ms:.2f} ms, kernel {kernel_ms:.2f} ms (events on the consumer stream); "
            f"share of the copy hidden behind the kernel: aioloader {hidden:.2f}"
        )
        t = row.median(TORCH)
        if t:
            row.note += f", torch {(copy_ms + kernel_ms - t) / min(copy_ms, kernel_ms):.2f}"
    rows.append(row)
    return rows


def device_info() -> dict[str, Any]:
    """The GPU, its driver and CUDA version, for the record in docs/benchmarks.md."""
    if not torch.cuda.is_available():
        return {}
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
    }
