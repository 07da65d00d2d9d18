"""Benchmark aioloader's AsyncDataLoader against torch's DataLoader.

Run ``python -m aioloader.benchmark --help``. Every measurement alternates the loaders
(torch, aioloader[, spdl]) round by round after in-round warm-up batches, and reports the median
of the rounds and the ratio aioloader/torch. All workloads are synthetic; their datasets live at
module level so they pickle by reference under ``spawn`` and ``forkserver``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import io
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ._bench_stream import measure_stream

TORCH = "torch"
AIO = "aioloader"
SPDL = "spdl"

WORKLOADS = ("tiny", "cpu", "io", "big", "skewed", "startup", "loop-lag", "device", "stream")

# --------------------------------------------------------------------------------------------
# Datasets (module level so that spawn/forkserver workers can import them by name).
# --------------------------------------------------------------------------------------------


class TinyDataset(Dataset[torch.Tensor]):
    """16 floats per sample and no work: measures pure per-batch overhead."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), float(i))


def make_jpeg(side: int = 320, seed: int = 0) -> bytes:
    """Encode one gradient-plus-noise RGB image; noise keeps the decoder honest (~1 ms at 320)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, side)
    img = np.add.outer(ramp, ramp)[..., None] / 2 + rng.integers(0, 64, (side, side, 3))
    buf = io.BytesIO()
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


class JpegDataset(Dataset[torch.Tensor]):
    """~1 ms of CPU per sample: decode the same JPEG with Pillow into a uint8 HWC tensor."""

    def __init__(self, n: int, jpeg: bytes) -> None:
        self.n = n
        self.jpeg = jpeg

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        import numpy as np
        from PIL import Image

        with Image.open(io.BytesIO(self.jpeg)) as im:
            arr = np.asarray(im.convert("RGB"))
        return torch.from_numpy(arr.copy())


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


class BigDataset(Dataset[torch.Tensor]):
    """3x224x224 float32 samples (~600 KB); a batch of 64 is ~38.5 MB."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((3, 224, 224), float(i))


def _spin(seconds: float) -> None:
    # A busy loop, not sleep: the straggler must hold a core, as real decode work does.
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


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
        _spin(self.cost(i))
        return torch.tensor([i])


STARTUP_ENTRIES = 1_200_000


class StartupDataset(Dataset[tuple[str, int]]):
    """An index of 1.2 million (path, label) tuples (~54 MB pickled), as an image folder has.

    Only ``serve`` entries are read per epoch: the point is what the loader does with the big
    dataset object at start-up, not throughput.
    """

    def __init__(self, entries: int, serve: int) -> None:
        self.items = [
            (f"/data/train/n{i % 1000:05d}/img_{i:08d}.JPEG", i % 1000) for i in range(entries)
        ]
        self.serve = serve

    def __len__(self) -> int:
        return self.serve

    def __getitem__(self, i: int) -> tuple[str, int]:
        return self.items[i]


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


def _aio_class() -> Any:
    try:
        from aioloader import AsyncDataLoader
    except ImportError as exc:  # the core may not be importable on a partial checkout
        raise SystemExit(f"aioloader.AsyncDataLoader is not importable: {exc}") from exc
    return AsyncDataLoader


def spdl_available() -> bool:
    try:
        importlib.import_module("spdl.dataloader")
    except Exception:  # any failure to import means "not installed" for our purposes
        return False
    return True


def _stall_of(loader: Any) -> float | None:
    # stats() is optional: the benchmark must keep working against a loader without it.
    stats = getattr(loader, "stats", None)
    if not callable(stats):
        return None
    value = getattr(stats(), "data_stall_fraction", None)
    return float(value) if isinstance(value, int | float) else None


class _Timer:
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
            self.samples += _batch_len(batch)
            self.t1 = time.perf_counter()

    def result(self, stall: float | None = None) -> RoundResult:
        if self.seen <= self.warmup:
            raise RuntimeError(f"loader produced {self.seen} batches, need > {self.warmup}")
        peak = float(self.sampler.stop()) if self.sampler is not None else None
        return RoundResult(self.t1 - self.t0, self.seen - self.warmup, self.samples, stall, peak)


def _batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, list | tuple) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    return 1


def run_once(
    name: str, ds: Dataset[Any], kwargs: dict[str, Any], warmup: int, memory: bool = False
) -> RoundResult:
    """Build loader ``name`` over ``ds``, drain one epoch, time everything after ``warmup``."""
    base = float(tree_pss()) if memory else None
    timer = _Timer(warmup, PssSampler() if memory else None)
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
        del loader
    res.base_pss = base
    return res


async def _aio_drain(ds: Dataset[Any], kwargs: dict[str, Any], timer: _Timer) -> RoundResult:
    async with _aio_class()(ds, **kwargs) as loader:
        async for batch in loader:
            timer.tick(batch)
        return timer.result(_stall_of(loader))


def alternate(cfg: Config, fn: Callable[[str], RoundResult]) -> dict[str, list[RoundResult]]:
    """Run ``fn`` for every loader in turn (A B A B ...), ``cfg.rounds`` times."""
    out: dict[str, list[RoundResult]] = {n: [] for n in cfg.loaders}
    for r in range(cfg.rounds):
        for name in cfg.loaders:
            out[name].append(fn(name))
        cfg.progress(f"round {r + 1}/{cfg.rounds}")
    return out


def _per_loader(
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
            _per_loader(res, lambda r: r.samples / r.seconds),
        )
    else:
        row = Row(
            workload,
            f"batches/s{label}",
            "higher",
            _per_loader(res, lambda r: r.batches / r.seconds),
        )
    rows = [row]
    stall = _per_loader({AIO: res.get(AIO, [])}, lambda r: r.stall)
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


def _plan(cfg: Config, full: int, quick: int) -> int:
    return quick if cfg.quick else full


# --------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------


def _loader_kwargs(cfg: Config, batch_size: int) -> dict[str, Any]:
    return {"batch_size": batch_size, "num_workers": cfg.workers}


def _simple(
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
    kwargs = _loader_kwargs(cfg, batch_size)
    res = alternate(cfg, lambda n: run_once(n, ds, kwargs, warmup))
    return throughput_rows(workload, label, res, unit)


def bench_tiny(cfg: Config) -> list[Row]:
    rows: list[Row] = []
    for bs, full, quick in ((1, 600, 200), (64, 400, 120)):
        got = _simple(
            cfg,
            "tiny",
            TinyDataset,
            bs,
            _plan(cfg, full, quick),
            30,
            label=f" (batch {bs})",
            unit="batches",
        )
        ratio_check(got[0], ">=", 1.5)
        rows += got
    return rows


def bench_cpu(cfg: Config) -> list[Row]:
    jpeg = make_jpeg()
    rows = _simple(
        cfg, "cpu", lambda n: JpegDataset(n, jpeg), 32, _plan(cfg, 40, 15), 4, label=" (batch 32)"
    )
    ratio_check(rows[0], ">=", 1.0)
    return rows


def bench_io(cfg: Config) -> list[Row]:
    rows = _simple(cfg, "io", SleepDataset, 32, _plan(cfg, 16, 6), 2, label=" (batch 32)")
    ratio_check(rows[0], ">=", 1.0)
    return rows


def bench_big(cfg: Config) -> list[Row]:
    warmup = 3
    batches = _plan(cfg, 40, 15)
    ds = BigDataset((batches + warmup) * 64)
    kwargs = _loader_kwargs(cfg, 64)
    res = alternate(cfg, lambda n: run_once(n, ds, kwargs, warmup))
    rows = throughput_rows("big", " (batch 64, 38.5 MB)", res)
    ratio_check(rows[0], ">=", 1.0)
    rows[0].target += " (stretch 1.2x)"
    # Separate rounds for memory: the sampler thread costs CPU that would skew throughput.
    cfg.progress("memory rounds")
    mem_batches = _plan(cfg, 20, 8)
    mds = BigDataset((mem_batches + warmup) * 64)
    mres = alternate(cfg, lambda n: run_once(n, mds, kwargs, warmup, memory=True))
    mb = 1024.0 * 1024.0
    peak = Row(
        "big",
        "peak PSS of process tree, MB",
        "lower",
        _per_loader(mres, lambda r: None if r.peak_pss is None else r.peak_pss / mb),
    )
    ratio_check(peak, "<=", 1.1)
    delta = Row(
        "big",
        "peak PSS above pre-loader baseline, MB",
        "lower",
        _per_loader(
            mres,
            lambda r: (
                None if r.peak_pss is None or r.base_pss is None else (r.peak_pss - r.base_pss) / mb
            ),
        ),
        note="informational: what the loader itself adds",
    )
    return [*rows, peak, delta]


def bench_skewed(cfg: Config) -> list[Row]:
    warmup = 8
    batches = _plan(cfg, 128, 48)
    ds = SkewedDataset((batches + warmup) * 8)
    kwargs = _loader_kwargs(cfg, 8)
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
    return [*rows, *rows_u, mixed]


def bench_device(cfg: Config) -> list[Row]:
    """Host-to-device throughput: aioloader(device="cuda") vs torch(pin_memory) + .to(cuda)."""
    if not torch.cuda.is_available():
        cfg.progress("device: no CUDA device, skipped")
        return [Row("device", "skipped: no CUDA device", "higher", {}, note="needs a GPU")]
    warmup = 3
    batches = _plan(cfg, 40, 12)
    ds = BigDataset((batches + warmup) * 64)
    kwargs = {**_loader_kwargs(cfg, 64), "pin_memory": True}

    def one(name: str) -> RoundResult:
        timer = _Timer(warmup, None)
        if name == AIO:

            async def drain() -> RoundResult:
                async with _aio_class()(ds, device="cuda", **kwargs) as loader:
                    async for batch in loader:
                        batch.add_(1)  # a kernel on the consumer stream that reads the copy
                        timer.tick(batch)
                torch.cuda.synchronize()
                return timer.result(_stall_of(loader))

            return asyncio.run(drain())
        for batch in DataLoader(ds, **kwargs):
            moved = batch.to("cuda", non_blocking=True)
            moved.add_(1)
            timer.tick(moved)
        torch.cuda.synchronize()
        return timer.result()

    res = alternate(cfg, one)
    rows = throughput_rows("device", " (batch 64, 38.5 MB to cuda)", res)
    ratio_check(rows[0], ">=", 1.0)
    return rows


def _spinner(seconds: float) -> None:
    _spin(seconds)


async def _probe(stop: asyncio.Event, lags_ms: list[float]) -> None:
    """Sleep 1 ms in a loop and record how late each wake-up is."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags_ms.append((time.perf_counter() - t - 0.001) * 1e3)


async def _lag_variant(
    variant: str, ds: Dataset[Any], kwargs: dict[str, Any], warmup: int, floor_s: float
) -> list[float]:
    lags: list[float] = []
    stop = asyncio.Event()
    task: asyncio.Task[None] | None = None

    def begin() -> None:
        nonlocal task
        task = asyncio.create_task(_probe(stop, lags))

    if variant == "floor":
        # Two processes spinning stand in for two busy workers, with no loader at all.
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_spinner, args=(floor_s + 0.5,)) for _ in range(2)]
        for p in procs:
            p.start()
        await asyncio.sleep(0.1)
        begin()
        await asyncio.sleep(floor_s)
        stop.set()
        for p in procs:
            p.terminate()
            p.join()
    elif variant in ("torch-next", "torch-thread"):
        it = iter(DataLoader(ds, **kwargs))
        for _ in range(warmup):
            next(it)
        begin()
        if variant == "torch-next":
            for _ in it:  # next() runs on the loop's thread: this is the blocking case
                await asyncio.sleep(0)
        else:
            done = object()
            while await asyncio.to_thread(next, it, done) is not done:
                pass
        stop.set()
        del it
    else:
        async with _aio_class()(ds, **kwargs) as loader:
            seen = 0
            async for _ in loader:
                seen += 1
                if seen == warmup:
                    begin()
        stop.set()
    if task is not None:
        await task
    return lags


def _pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def bench_loop_lag(cfg: Config) -> list[Row]:
    warmup = 4
    batches = _plan(cfg, 40, 15)
    ds = JpegDataset((batches + warmup) * 32, make_jpeg())
    kwargs = _loader_kwargs(cfg, 32)
    floor_s = _plan(cfg, 15, 10) / 10
    variants = ["torch-next", "torch-thread", "aio", "floor"]
    stats: dict[str, dict[str, list[float]]] = {
        v: {"p50": [], "p99": [], "max": []} for v in variants
    }
    for r in range(cfg.rounds):
        for v in variants:
            lags = asyncio.run(_lag_variant(v, ds, kwargs, warmup, floor_s))
            if not lags:
                continue
            stats[v]["p50"].append(_pct(lags, 0.50))
            stats[v]["p99"].append(_pct(lags, 0.99))
            stats[v]["max"].append(max(lags))
        cfg.progress(f"round {r + 1}/{cfg.rounds}")
    rows: list[Row] = []
    for q in ("p50", "p99", "max"):
        row = Row(
            "loop-lag",
            f"{q} lag ms, torch next() in coroutine",
            "lower",
            {TORCH: stats["torch-next"][q], AIO: stats["aio"][q]},
        )
        if q == "p99":
            ratio_check(row, "<=", 0.1)
        rows.append(row)
    rows.append(
        Row(
            "loop-lag",
            "p99 lag ms, torch via asyncio.to_thread",
            "lower",
            {TORCH: stats["torch-thread"]["p99"], AIO: stats["aio"]["p99"]},
        )
    )
    floor = Row(
        "loop-lag",
        "p99 lag ms, floor (2 spinning procs, no loader)",
        "lower",
        {TORCH: stats["floor"]["p99"], AIO: stats["aio"]["p99"]},
        note="torch column is the floor",
    )
    f, a = floor.median(TORCH), floor.median(AIO)
    floor.target = "<= floor + 1 ms"
    if f is not None and a is not None:
        floor.passed = a <= f + 1.0
    rows.append(floor)
    return rows


# --- start-up: each measurement in a fresh process -----------------------------------------
#
# A fresh interpreter per measurement costs ~3 s (import torch, build the 1.2M-entry list) and
# 36 of them would eat the whole time budget. Instead one "zygote" interpreter imports torch,
# builds the dataset once and forks a new process per measurement. The fork is taken before
# anything loader-related exists (no multiprocessing state, no forkserver, no threads, no event
# loop), so each measurement starts as a training script does right after building its dataset.


def _measure_startup(ds: StartupDataset, spec: dict[str, Any]) -> tuple[float, float]:
    """Time construction -> first batch, then the 2nd epoch's first batch (persistent)."""
    kwargs = {
        "batch_size": 64,
        "num_workers": spec["workers"],
        "multiprocessing_context": spec["method"],
        "persistent_workers": True,
    }
    if spec["loader"] == AIO:
        return asyncio.run(_child_aio(ds, kwargs))
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


async def _child_aio(ds: Dataset[Any], kwargs: dict[str, Any]) -> tuple[float, float]:
    first = second = -1.0
    t0 = time.perf_counter()
    async with _aio_class()(ds, **kwargs) as loader:
        async for _ in loader:
            if first < 0:
                first = time.perf_counter() - t0
        t1 = time.perf_counter()
        async for _ in loader:
            if second < 0:
                second = time.perf_counter() - t1
    return first, second


def _zygote_main(entries: int) -> int:
    """Build the dataset once; fork one measurement process per JSON request on stdin."""
    ds = StartupDataset(entries, serve=64 * 4)
    print("READY", flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.setsid()  # own process group: its workers and forkserver die with it below
            try:
                first, second = _measure_startup(ds, spec)
                out: dict[str, Any] = {"first_s": first, "epoch2_s": second}
            except BaseException as exc:  # report, never fall back into the zygote's loop
                out = {"error": repr(exc)}
            print("BENCH-RESULT " + json.dumps(out), flush=True)
            # Orderly shutdown of spawned workers takes ~1 s and is not measured here.
            os.killpg(0, signal.SIGKILL)
        os.waitpid(pid, 0)
    return 0


class _Zygote:
    """Parent-side handle on the zygote interpreter."""

    def __init__(self, entries: int) -> None:
        env = dict(os.environ)
        # The zygote must import this very package, wherever it was run from.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        code = (
            "import sys; from aioloader.benchmark import _zygote_main; "
            "sys.exit(_zygote_main(int(sys.argv[1])))"
        )
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (lives as long as self; close())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(entries)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._read("READY")

    def _read(self, prefix: str, timeout: float = 180.0) -> str:
        assert self.proc.stdout is not None
        # A stuck measurement must not hang the suite: kill the zygote, which ends the read.
        killer = threading.Timer(timeout, _kill_group, (self.proc.pid,))
        killer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
        finally:
            killer.cancel()
        self.err.seek(0)
        raise RuntimeError(f"start-up zygote died:\n{self.err.read()[-2000:]}")

    def measure(self, loader: str, method: str, workers: int) -> tuple[float, float]:
        assert self.proc.stdin is not None
        spec = {"loader": loader, "method": method, "workers": workers}
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        got = json.loads(self._read("BENCH-RESULT "))
        if "error" in got:
            raise RuntimeError(f"start-up measurement {spec} failed: {got['error']}")
        return float(got["first_s"]), float(got["epoch2_s"])

    def close(self) -> None:
        _kill_group(self.proc.pid)
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.err):
            if f is not None:
                f.close()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, signal.SIGKILL)


def bench_startup(cfg: Config) -> list[Row]:
    loaders = [n for n in cfg.loaders if n != SPDL]  # spdl is compared on throughput only
    combos: list[tuple[str, int]] = (
        [("fork", 2), ("fork", 4)]
        if cfg.quick
        else [(m, w) for m in ("fork", "spawn", "forkserver") for w in (2, 4)]
    )
    zygote = _Zygote(int(cfg.extra.get("startup_entries", STARTUP_ENTRIES)))
    first: dict[tuple[str, int], dict[str, list[float]]] = {c: {} for c in combos}
    second: dict[tuple[str, int], dict[str, list[float]]] = {c: {} for c in combos}
    try:
        for name in loaders:  # warm-up: first-use costs, page cache
            zygote.measure(name, "fork", 2)
        for r in range(cfg.rounds):
            for combo in combos:
                for name in loaders:
                    f, s = zygote.measure(name, combo[0], combo[1])
                    first[combo].setdefault(name, []).append(f)
                    second[combo].setdefault(name, []).append(s * 1e3)
            cfg.progress(f"round {r + 1}/{cfg.rounds}")
    finally:
        zygote.close()
    rows: list[Row] = []
    for method, w in combos:
        row = Row("startup", f"first batch s, {method}, {w} workers", "lower", first[(method, w)])
        if method == "fork":
            ratio_check(row, "<=", 1.0)
        elif w == 4:
            ratio_check(row, "<=", 0.5)
        rows.append(row)
    for method in ("spawn", "forkserver"):
        if (method, 2) in first and (method, 4) in first:
            lo, hi = first[(method, 2)], first[(method, 4)]
            growth = Row(
                "startup",
                f"first batch 4w/2w, {method}",
                "lower",
                {
                    n: [b / a for a, b in zip(lo[n], hi[n], strict=True)]
                    for n in loaders
                    if n in lo and n in hi
                },
                note="flat = 1.0; ratio column compares the growths",
            )
            g = growth.median(AIO)
            growth.target = "aioloader <= 1.25"
            growth.passed = None if g is None else g <= 1.25
            rows.append(growth)
    for method, w in combos:
        row = Row(
            "startup",
            f"epoch-2 first batch ms, {method}, {w}w, persistent",
            "lower",
            second[(method, w)],
        )
        e = row.median(AIO)
        row.target = "aioloader < 10 ms"
        row.passed = None if e is None else e < 10.0
        rows.append(row)
    return rows


# --- user dataset --------------------------------------------------------------------------


def load_factory(spec: str) -> Callable[[], Dataset[Any]]:
    """Resolve ``module:factory`` to a callable."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise SystemExit(f"--dataset wants module:factory, got {spec!r}")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise SystemExit(f"--dataset {spec!r} is not callable")
    return obj  # type: ignore[no-any-return]


def bench_dataset(cfg: Config) -> list[Row]:
    factory = load_factory(str(cfg.extra["dataset"]))
    ds: Dataset[Any] = factory()
    bs = int(cfg.extra["batch_size"])
    warmup = 2
    want = (int(cfg.extra["batches"]) + warmup) * bs
    size = len(ds)  # type: ignore[arg-type]
    if size < (warmup + 1) * bs:
        raise SystemExit(f"dataset has {size} samples; need at least {(warmup + 1) * bs}")
    if size > want:
        ds = Subset(ds, range(want))  # a fixed amount of work per round
    kwargs = _loader_kwargs(cfg, bs)
    res = alternate(cfg, lambda n: run_once(n, ds, kwargs, warmup))
    label = f" ({cfg.extra['dataset']}, batch {bs})"
    rows = throughput_rows("dataset", label, res)
    rows.insert(1, throughput_rows("dataset", label, res, unit="batches")[0])
    return rows


def bench_stream(cfg: Config) -> list[Row]:
    """Produce-to-delivery latency of a paced async source, and unpaced throughput."""
    batch_size, window_s = 64, 0.01
    measured = measure_stream(
        rates=[100.0, 1000.0, 10000.0],
        seconds=_plan(cfg, 3, 1),
        max_events=_plan(cfg, 30000, 10000),
        batch_size=batch_size,
        latency_s=window_s,
        workers=cfg.workers,
        rounds=cfg.rounds,
        progress=cfg.progress,
    )
    note = f"batch_size={batch_size}; aioloader max_batch_latency={window_s * 1e3:g} ms"
    rows = []
    for metric, rounds in measured.items():
        better = "higher" if metric.startswith("events/s") else "lower"
        row = Row("stream", metric, better, {TORCH: rounds[TORCH], AIO: rounds[AIO]}, note=note)
        if metric == "p99 latency ms @100/s":
            ratio_check(row, "<=", 0.1)  # size-or-time windows vs size-only
        rows.append(row)
    return rows


BENCHES: dict[str, Callable[[Config], list[Row]]] = {
    "tiny": bench_tiny,
    "cpu": bench_cpu,
    "io": bench_io,
    "big": bench_big,
    "skewed": bench_skewed,
    "startup": bench_startup,
    "loop-lag": bench_loop_lag,
    "device": bench_device,
    "stream": bench_stream,
    "dataset": bench_dataset,
}


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0 or abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def format_table(rows: Sequence[Row], loaders: Sequence[str]) -> str:
    head = ["workload", "metric", "better", *loaders, "ratio", "target", "result"]
    body = []
    for r in rows:
        ratio = r.ratio()
        result = "" if r.passed is None else ("pass" if r.passed else "MISS")
        body.append(
            [
                r.workload,
                r.metric,
                r.better,
                *(_fmt(r.median(n)) for n in loaders),
                "-" if ratio is None else f"{ratio:.2f}x",
                r.target,
                result,
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    try:
        import aioloader

        aio_version = str(getattr(aioloader, "__version__", "unknown"))
    except ImportError:
        aio_version = "unavailable"
    return {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "aioloader": aio_version,
        "spdl": spdl_available(),
    }


def write_plot(rows: Sequence[Row], path: str) -> None:
    """Bar chart of aioloader/torch per metric; green meets its target, red misses."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("--plot needs matplotlib: pip install 'aioloader[plot]'") from exc
    plotted = [r for r in rows if r.ratio() is not None]
    labels = [f"{r.workload}: {r.metric} ({r.better} better)" for r in plotted]
    ratios = [r.ratio() or 0.0 for r in plotted]
    colors = [
        "tab:gray" if r.passed is None else ("tab:green" if r.passed else "tab:red")
        for r in plotted
    ]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(plotted) + 1.2))
    ax.barh(range(len(plotted)), ratios, color=colors)
    ax.set_yticks(range(len(plotted)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("aioloader / torch (log; green = target met, red = missed, grey = no target)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m aioloader.benchmark", description=__doc__)
    p.add_argument(
        "--workload",
        action="append",
        default=[],
        help=f"workload(s) to run, repeatable or comma list: {', '.join(WORKLOADS)}",
    )
    p.add_argument("--quick", action="store_true", help="shorter rounds; suite under 1 minute")
    p.add_argument("--json", metavar="PATH", help="write raw rounds, medians and machine info")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the ratios")
    p.add_argument("--workers", type=int, default=2, help="num_workers for both loaders")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (at least 3)")
    p.add_argument(
        "--dataset",
        metavar="MODULE:FACTORY",
        help="benchmark your own dataset: FACTORY() returns a map-style Dataset",
    )
    p.add_argument("--batch-size", type=int, default=32, help="batch size for --dataset")
    p.add_argument("--batches", type=int, default=50, help="timed batches per round, --dataset")
    args = p.parse_args(argv)
    names = [n.strip() for w in args.workload for n in w.split(",") if n.strip()]
    if args.dataset and not names:
        names = ["dataset"]
    elif args.dataset:
        names.append("dataset")
    names = names or list(WORKLOADS)
    unknown = [n for n in names if n not in BENCHES or (n == "dataset" and not args.dataset)]
    if unknown:
        p.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    if args.rounds < 3:
        p.error("--rounds must be at least 3")
    if args.workers < 1:
        p.error("--workers must be at least 1")
    args.names = list(dict.fromkeys(names))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    _aio_class()  # fail fast, before minutes of torch-only runs
    loaders = [TORCH, AIO] + ([SPDL] if spdl_available() else [])
    started = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"  [{time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    cfg = Config(
        args.workers,
        args.rounds,
        args.quick,
        loaders,
        progress,
        {"dataset": args.dataset, "batch_size": args.batch_size, "batches": args.batches},
    )
    # One untimed pass of every loader first, so imports and first-use costs land nowhere.
    for name in loaders:
        run_once(name, TinyDataset(64), _loader_kwargs(cfg, 8), 1)
    rows: list[Row] = []
    for name in args.names:
        progress(f"workload {name}")
        rows += BENCHES[name](cfg)
    table = format_table(rows, loaders)
    print(table)
    elapsed = time.perf_counter() - started
    print(
        f"\n{len(rows)} rows in {elapsed:.0f}s; workers={args.workers}, rounds={args.rounds}, "
        f"cpus={os.cpu_count()}, torch {torch.__version__}"
    )
    if args.json:
        doc = {
            "machine": machine_info(),
            "argv": list(argv if argv is not None else sys.argv),
            "elapsed_s": elapsed,
            "loaders": loaders,
            "rows": [r.to_json() for r in rows],
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    if args.plot:
        write_plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    # Re-enter through the package so datasets pickle as aioloader.benchmark.X, not __main__.X.
    from aioloader import benchmark as _self

    raise SystemExit(_self.main())
