"""What every workload shares: result rows, timing, memory sampling, running one loader.

Every measurement alternates the loaders (torch, aioloader[, spdl]) round by round after in-round
warm-up batches; the rows keep every round so the report can take medians and ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import statistics
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

TORCH = "torch"
AIO = "aioloader"
SPDL = "spdl"


def spin(seconds: float) -> None:
    # A busy loop, not sleep: the straggler must hold a core, as real decode work does.
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One metric of one workload: raw rounds per loader, medians, ratio and target."""

    workload: str
    metric: str
    better: str  # "higher" or "lower"
    rounds: dict[str, list[float]]
    target: str = ""
    passed: bool | None = None
    note: str = ""

    def median(self, name: str) -> float | None:
        vals = self.rounds.get(name)
        return statistics.median(vals) if vals else None

    def ratio(self, name: str = AIO) -> float | None:
        a, t = self.median(name), self.median(TORCH)
        if a is None or t is None or t == 0:
            return None
        return a / t

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "metric": self.metric,
            "better": self.better,
            "rounds": self.rounds,
            "median": {k: self.median(k) for k in self.rounds},
            "ratio_aioloader_over_torch": self.ratio(),
            "target": self.target,
            "passed": self.passed,
            "note": self.note,
        }


def ratio_check(row: Row, op: str, bound: float) -> None:
    """Set ``row.target``/``row.passed`` for a target on the aioloader/torch ratio."""
    row.target = f"{op} {bound:g}x"
    r = row.ratio()
    if r is not None:
        row.passed = r >= bound if op == ">=" else r <= bound


@dataclass
class RoundResult:
    """What one timed run of one loader produced."""

    seconds: float
    batches: int
    samples: int
    stall: float | None = None
    peak_pss: float | None = None  # bytes, whole process tree
    base_pss: float | None = None  # bytes, this process before the loader existed


@dataclass
class Config:
    workers: int
    rounds: int
    quick: bool
    loaders: list[str]
    progress: Callable[[str], None]
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Memory sampling
# --------------------------------------------------------------------------------------------


def tree_pss() -> int:
    """PSS of this process and all its descendants (RSS would count forked pages many times)."""
    import psutil

    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        try:
            total += int(proc.memory_full_info().pss)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue  # a worker that exits mid-sample holds nothing any more
    return total


class PssSampler:
    """Samples the process tree's PSS from a thread every ``interval`` seconds; keeps the peak.

    Reading smaps costs a few ms per process, so this thread is only run in dedicated memory
    rounds, never while throughput is timed.
    """

    def __init__(self, interval: float = 0.02) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # Started after the first batch, when workers exist: forking while this thread runs
        # would fork from a multi-threaded process.
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss())
            self._stop.wait(self.interval)

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.peak


# --------------------------------------------------------------------------------------------
# Running one loader
# --------------------------------------------------------------------------------------------


#: Extra arguments for every aioloader loader of the run (``--worker-nice``).
AIO_OPTIONS: dict[str, Any] = {}


def aio_class() -> Any:
    """``AsyncDataLoader``, with the run's :data:`AIO_OPTIONS` bound."""
    try:
        from aioloader import AsyncDataLoader
    except ImportError as exc:  # the core may not be importable on a partial checkout
        raise SystemExit(f"aioloader.AsyncDataLoader is not importable: {exc}") from exc
    if AIO_OPTIONS:
        return functools.partial(AsyncDataLoader, **AIO_OPTIONS)
    return AsyncDataLoader


def spdl_available() -> bool:
    try:
        importlib.import_module("spdl.dataloader")
    except Exception:  # any failure to import means "not installed" for our purposes
        return False
    return True


def stall_of(loader: Any) -> float | None:
    # stats() is optional: the benchmark must keep working against a loader without it.
    stats = getattr(loader, "stats", None)
    if not callable(stats):
        return None
    value = getattr(stats(), "data_stall_fraction", None)
    return float(value) if isinstance(value, int | float) else None


class Timer:
    """Counts batches after ``warmup`` of them; starts the clock when the warm-up ends."""

    def __init__(self, warmup: int, sampler: PssSampler | None) -> None:
        self.warmup = warmup
        self.sampler = sampler
        self.seen = 0
        self.samples = 0
        self.t0 = 0.0
        self.t1 = 0.0

    def tick(self, batch: Any) -> None:
        self.seen += 1
        if self.seen == 1 and self.sampler is not None:
            self.sampler.start()
        if self.seen == self.warmup:
            self.t0 = time.perf_counter()
        elif self.seen > self.warmup:
            self.samples += batch_len(batch)
            self.t1 = time.perf_counter()

    def result(self, stall: float | None = None) -> RoundResult:
        if self.seen <= self.warmup:
            raise RuntimeError(f"loader produced {self.seen} batches, need > {self.warmup}")
        peak = float(self.sampler.stop()) if self.sampler is not None else None
        return RoundResult(self.t1 - self.t0, self.seen - self.warmup, self.samples, stall, peak)


def batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, list | tuple) and batch:
        return batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_len(next(iter(batch.values())))
    return 1


def run_once(
    name: str, ds: Dataset[Any], kwargs: dict[str, Any], warmup: int, memory: bool = False
) -> RoundResult:
    """Build loader ``name`` over ``ds``, drain one epoch, time everything after ``warmup``."""
    base = float(tree_pss()) if memory else None
    timer = Timer(warmup, PssSampler() if memory else None)
    if name == AIO:
        res = asyncio.run(_aio_drain(ds, kwargs, timer))
    else:
        if name == SPDL:
            from spdl.dataloader import get_pytorch_dataloader

            loader: Iterable[Any] = get_pytorch_dataloader(ds, **kwargs)
        else:
            loader = DataLoader(ds, **kwargs)
        for batch in loader:
            timer.tick(batch)
        res = timer.result()
        # SPDL's loader copies the dataset into a shared-memory segment that it never unlinks
        # (the resource tracker then warns about it at exit): this run made it, so it ends it.
        segment = getattr(loader, "_shmem", None)
        del loader
        if segment is not None:
            with contextlib.suppress(OSError):
                segment.close()
                segment.unlink()
    res.base_pss = base
    return res


async def _aio_drain(ds: Dataset[Any], kwargs: dict[str, Any], timer: Timer) -> RoundResult:
    async with aio_class()(ds, **kwargs) as loader:
        async for batch in loader:
            timer.tick(batch)
        return timer.result(stall_of(loader))


def alternate(cfg: Config, fn: Callable[[str], RoundResult]) -> dict[str, list[RoundResult]]:
    """Run ``fn`` for every loader in turn (A B A B ...), ``cfg.rounds`` times."""
    out: dict[str, list[RoundResult]] = {n: [] for n in cfg.loaders}
    for r in range(cfg.rounds):
        for name in cfg.loaders:
            out[name].append(fn(name))
        cfg.progress(f"round {r + 1}/{cfg.rounds}")
    return out


def per_loader(
    res: dict[str, list[RoundResult]], f: Callable[[RoundResult], float | None]
) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for name, rounds in res.items():
        vals = [v for v in map(f, rounds) if v is not None]
        if vals:
            out[name] = vals
    return out


def throughput_rows(
    workload: str, label: str, res: dict[str, list[RoundResult]], unit: str = "samples"
) -> list[Row]:
    """Rows for samples/s (or batches/s) plus aioloader's stall fraction when it reports one."""
    if unit == "samples":
        row = Row(
            workload,
            f"samples/s{label}",
            "higher",
            per_loader(res, lambda r: r.samples / r.seconds),
        )
    else:
        row = Row(
            workload,
            f"batches/s{label}",
            "higher",
            per_loader(res, lambda r: r.batches / r.seconds),
        )
    rows = [row]
    stall = per_loader({AIO: res.get(AIO, [])}, lambda r: r.stall)
    if stall:
        rows.append(
            Row(
                workload,
                f"aioloader data-stall fraction{label}",
                "lower",
                stall,
                note="from loader.stats(); informational",
            )
        )
    return rows


def plan(cfg: Config, full: int, quick: int) -> int:
    return quick if cfg.quick else full


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


def loader_kwargs(cfg: Config, batch_size: int) -> dict[str, Any]:
    return {"batch_size": batch_size, "num_workers": cfg.workers}


def simple(
    cfg: Config,
    workload: str,
    make: Callable[[int], Dataset[Any]],
    batch_size: int,
    batches: int,
    warmup: int,
    label: str = "",
    unit: str = "samples",
) -> list[Row]:
    ds = make((batches + warmup) * batch_size)
    kwargs = loader_kwargs(cfg, batch_size)
    res = alternate(cfg, lambda n: run_once(n, ds, kwargs, warmup))
    return throughput_rows(workload, label, res, unit)


def aio_first_batches(ds: Dataset[Any], kwargs: dict[str, Any]) -> tuple[float, float]:
    """Seconds to aioloader's first batch, then to epoch 2's first batch; both epochs drained."""

    async def run() -> tuple[float, float]:
        first = second = -1.0
        t0 = time.perf_counter()
        async with aio_class()(ds, **kwargs) as loader:
            async for _ in loader:
                if first < 0:
                    first = time.perf_counter() - t0
            t1 = time.perf_counter()
            async for _ in loader:
                if second < 0:
                    second = time.perf_counter() - t1
        return first, second

    return asyncio.run(run())


def torch_first_batches(ds: Dataset[Any], kwargs: dict[str, Any]) -> tuple[float, float]:
    """Seconds to torch's first batch, then to epoch 2's first batch; both epochs drained."""
    t0 = time.perf_counter()
    dl = DataLoader(ds, **kwargs)
    it = iter(dl)
    next(it)
    first = time.perf_counter() - t0
    for _ in it:
        pass
    t0 = time.perf_counter()
    it = iter(dl)
    next(it)
    second = time.perf_counter() - t0
    for _ in it:
        pass
    return first, second
