"""``backends``: ``tiny``, ``cpu``, ``big`` and start-up on every executor, beside torch.

Columns: torch's DataLoader (worker processes), aioloader with ``executor="process"``,
``"thread"`` and ``RayWorkers()`` (a local Ray cluster started here with ``ray.init`` when ray is
installed, its start time reported as a row). Not part of the default suite: run it with
``--workload backends``. Start-up is measured in this process (Ray cannot run in the forked
children the ``startup`` workload uses): construction to first batch over the 1.2-million-entry
dataset, and the second epoch's first batch with persistent workers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from torch.utils.data import Dataset

from aioloader.benchmark._harness import (
    AIO,
    TORCH,
    Config,
    RoundResult,
    Row,
    aio_first_batches,
    alternate,
    loader_kwargs,
    plan,
    run_once,
    throughput_rows,
    torch_first_batches,
)
from aioloader.benchmark.big import BigDataset
from aioloader.benchmark.cpu import JpegDataset, make_jpeg
from aioloader.benchmark.startup import StartupDataset
from aioloader.benchmark.tiny import TinyDataset

THREAD = "aioloader-thread"
RAY = "aioloader-ray"

#: Extra table columns this workload adds, in order.
COLUMNS = (THREAD, RAY)


def _ray_ready(cfg: Config) -> tuple[bool, float | None]:
    """Start a local Ray cluster once (or use the connected one): (available, seconds)."""
    try:
        import ray
    except ImportError:
        cfg.progress("backends: ray is not installed, its column is skipped")
        return False, None
    if ray.is_initialized():
        return True, None
    t0 = time.perf_counter()
    # address="local": a new cluster, never one a stale /tmp/ray file points at.
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    return True, time.perf_counter() - t0


def _executors(has_ray: bool) -> dict[str, Any]:
    out: dict[str, Any] = {AIO: "process", THREAD: "thread"}
    if has_ray:
        from aioloader.ray import RayWorkers

        # No CPU reservation: the actors share the machine's cores as processes would.
        out[RAY] = RayWorkers(num_cpus=0)
    return out


def _runner(
    executors: dict[str, Any], ds: Dataset[Any], kwargs: dict[str, Any], warmup: int
) -> Callable[[str], RoundResult]:
    def one(name: str) -> RoundResult:
        if name == TORCH:
            return run_once(TORCH, ds, kwargs, warmup)
        return run_once(AIO, ds, {**kwargs, "executor": executors[name]}, warmup)

    return one


def _first_batches(
    executors: dict[str, Any], name: str, ds: Dataset[Any], workers: int
) -> tuple[float, float]:
    """Seconds to the first batch, then ms to epoch 2's first batch (persistent workers)."""
    kwargs: dict[str, Any] = {"batch_size": 64, "num_workers": workers, "persistent_workers": True}
    if name == TORCH:
        first, second = torch_first_batches(ds, kwargs)
    else:
        first, second = aio_first_batches(ds, {**kwargs, "executor": executors[name]})
    return first, second * 1e3


def bench_backends(cfg: Config) -> list[Row]:
    has_ray, init_s = _ray_ready(cfg)
    executors = _executors(has_ray)
    names = [TORCH, *executors]
    sub = dataclasses.replace(cfg, loaders=names)
    rows: list[Row] = []
    if init_s is not None:
        rows.append(
            Row("backends", "ray.init() s (local cluster)", "lower", {RAY: [init_s]}, note="once")
        )
    # tiny: per-batch overhead (for Ray, one actor round trip per batch).
    for bs, full, quick in ((1, 300, 100), (64, 200, 60)):
        warmup = 20
        n = plan(cfg, full, quick)
        ds: Dataset[Any] = TinyDataset((n + warmup) * bs)
        res = alternate(sub, _runner(executors, ds, loader_kwargs(cfg, bs), warmup))
        rows += throughput_rows("backends tiny", f" (batch {bs})", res, unit="batches")[:1]
    # cpu: Pillow decode, which releases the GIL for most of its time.
    jpeg = make_jpeg()
    n = plan(cfg, 30, 10)
    ds = JpegDataset((n + 4) * 32, jpeg)
    res = alternate(sub, _runner(executors, ds, loader_kwargs(cfg, 32), 4))
    rows += throughput_rows("backends cpu", " (batch 32, JPEG decode)", res)[:1]
    # big: 38.5 MB batches (shared memory, the same process, Ray's object store).
    n = plan(cfg, 30, 10)
    ds = BigDataset((n + 3) * 64)
    res = alternate(sub, _runner(executors, ds, loader_kwargs(cfg, 64), 3))
    rows += throughput_rows("backends big", " (batch 64, 38.5 MB)", res)[:1]
    # start-up over the 1.2-million-entry dataset, in this process.
    sds = StartupDataset(int(cfg.extra.get("startup_entries", 1_200_000)), serve=64 * 4)
    first: dict[str, list[float]] = {}
    second: dict[str, list[float]] = {}
    for r in range(cfg.rounds):
        for name in names:
            f, s = _first_batches(executors, name, sds, cfg.workers)
            first.setdefault(name, []).append(f)
            second.setdefault(name, []).append(s)
        cfg.progress(f"start-up round {r + 1}/{cfg.rounds}")
    rows.append(
        Row(
            "backends startup",
            f"first batch s, {cfg.workers} workers (default start method)",
            "lower",
            first,
            note="in this process, not a fresh one",
        )
    )
    rows.append(Row("backends startup", "epoch-2 first batch ms, persistent", "lower", second))
    return rows
