"""``remote``: samples read from a real HTTP object store, with and without a JPEG decode step.

The store (:mod:`aioloader.benchmark._store`) runs in its own process on loopback with a set
first-byte latency; every sample is one ``GET`` of one object. Batch 32; each run is bounded in
time (after every worker's first batch), not in samples, so that 90 samples/s and 3 000 are each
measured for about as long. Columns, all in the same rounds (A B C ... A B C ...):

* ``limit``: the store's limit, a bare asyncio + aiohttp client with as many requests in flight
  as the loaders below (``64``), no loader, no decode;
* ``decode-limit`` (decode runs only): ``min(workers, cores)`` processes decoding the store's
  JPEGs back to back, nothing fetched: the machine's decode limit;
* ``torch``, ``torch-8``, ``torch-32``: torch's ``DataLoader`` over a dataset whose
  ``__getitem__`` reads with ``urllib`` (synchronous, one request in flight per worker), at
  ``num_workers`` = ``--workers`` (2), 8 and 32;
* ``torch-async``: what an informed torch user writes, 2 workers, a ``__getitems__`` that runs
  the batch's 32 requests at once on an event loop and aiohttp session of the worker's own;
* ``spdl``: SPDL's pipeline (if ``spdl`` is installed), an async fetch stage (64 at once), a
  decode stage (2 threads), ``aggregate(32)``, collate;
* ``aioloader``: ``num_workers=2, fetch_in="workers"``: the async dataset runs in each worker on
  the worker's event loop, ``source_concurrency=32`` each, decoded there;
* ``aio-loop-0`` / ``aio-loop-2``: the async dataset on the consumer's loop
  (``source_concurrency=64``), decoded by ``transform`` on the fetch thread (0 workers) or in 2
  workers.

Decode: Pillow decodes the JPEG and resizes it to 224x224 (what a training pipeline feeds a
model; it also keeps a batch at 4.8 MB whatever the object's size), then a uint8 tensor. Without
decode a sample is the object's bytes as a uint8 tensor.

Rows per configuration: samples/s; the fraction of the limit (the lower of the store's limit and,
with decode, the decode limit), round by round; the ratio to torch at 2 workers; the process
tree's peak PSS (one separate round per column, sampled every 0.1 s); the store's CPU while the
limit ran (it must not be the bound). Default: 20 ms, 100 KB, with and without decode;
``--remote-grid`` runs latency 5/20/100 ms x objects 10 KB/100 KB/1 MB x decode or not.
"""

from __future__ import annotations

import asyncio
import gc
import io
import os
import statistics
import time
import urllib.request
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from aioloader.benchmark._harness import (
    AIO,
    SPDL,
    TORCH,
    Config,
    PssSampler,
    RoundResult,
    Row,
    aio_class,
    batch_len,
    spdl_available,
)
from aioloader.benchmark._limit import LIMIT

__all__ = ("COLUMNS", "bench_remote", "measure_remote")

DECODE_LIMIT = "decode-limit"
TORCH_8 = "torch-8"
TORCH_32 = "torch-32"
TORCH_ASYNC = "torch-async"
AIO_LOOP_0 = "aio-loop-0"
AIO_LOOP_2 = "aio-loop-2"
#: Table columns this workload adds beside torch, aioloader, spdl and limit, in order.
COLUMNS = (
    DECODE_LIMIT,
    TORCH_8,
    TORCH_32,
    TORCH_ASYNC,
    AIO_LOOP_0,
    AIO_LOOP_2,
    "no-tail",
    "hedge-off",
    "hedge-on",
    "hedge-frozen",
)

BATCH = 32
IN_FLIGHT = 64  # requests at once: the limit, the loop modes, SPDL; 2 x 32 for the workers
SIDE = 224
LATENCIES_MS = (5, 20, 100)
SIZES = (10_000, 100_000, 1_000_000)
#: Length of every dataset: far more than a time-bounded run reads (indices wrap on the store).
LENGTH = 10_000_000
OBJECTS = 512


def object_url(base: str, i: int, count: int) -> str:
    """Object ``i % count`` of the store at ``base``: ``_store.object_key``'s form, written out so
    that this module (imported by the benchmark's CLI) does not import ``_store``, which then
    runs cleanly as ``python -m aioloader.benchmark._store``."""
    return f"{base}/objects/{i % count:08d}"


# --------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------


def raw_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def decode_tensor(data: bytes) -> torch.Tensor:
    """JPEG bytes -> 224x224x3 uint8 tensor (Pillow decode, bilinear resize)."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        rgb = im.convert("RGB").resize((SIDE, SIDE), Image.Resampling.BILINEAR)
    return torch.from_numpy(np.array(rgb))


def to_sample(data: bytes, decode: bool) -> torch.Tensor:
    return decode_tensor(data) if decode else raw_tensor(data)


# --------------------------------------------------------------------------------------------
# Datasets (module level: they pickle by reference under spawn and forkserver)
# --------------------------------------------------------------------------------------------


class UrllibDataset(Dataset[torch.Tensor]):
    """torch's way: a synchronous ``urllib`` read per ``__getitem__``."""

    def __init__(self, base: str, count: int, decode: bool) -> None:
        self.base, self.count, self.decode = base, count, decode

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int) -> torch.Tensor:
        url = object_url(self.base, i, self.count)
        with urllib.request.urlopen(url, timeout=60) as resp:
            return to_sample(resp.read(), self.decode)


class TorchAsyncDataset(Dataset[torch.Tensor]):
    """The informed torch user's workaround: ``__getitems__`` runs the batch's requests at once
    on an event loop and aiohttp session that each worker makes for itself (never closed: torch
    gives a dataset no hook at a worker's end)."""

    def __init__(self, base: str, count: int, decode: bool) -> None:
        self.base, self.count, self.decode = base, count, decode
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loop": None, "_session": None}

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        datas = self._loop.run_until_complete(self._fetch(indices))
        return [to_sample(d, self.decode) for d in datas]

    async def _fetch(self, indices: list[int]) -> list[bytes]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=BATCH))
        session = self._session

        async def one(i: int) -> bytes:
            async with session.get(object_url(self.base, i, self.count)) as r:
                r.raise_for_status()
                data: bytes = await r.read()
                return data

        return list(await asyncio.gather(*(one(i) for i in indices)))


class AsyncHttpDataset:
    """An async map-style dataset over the store, the way aioloader users write one: an aiohttp
    session opened in ``__aenter__`` (once per event loop that fetches) and closed in
    ``__aexit__``. ``out``: ``"decode"`` decodes in ``__getitem__`` (in the worker, with
    ``fetch_in="workers"``), ``"bytes"`` returns the object for a ``transform`` to decode,
    ``"tensor"`` returns its bytes as a uint8 tensor."""

    def __init__(self, base: str, count: int, *, out: str, limit: int) -> None:
        self.base, self.count, self.out, self.limit = base, count, out, limit
        self._session: Any = None
        self._entered = 0

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_session": None, "_entered": 0}

    def __len__(self) -> int:
        return LENGTH

    async def __aenter__(self) -> AsyncHttpDataset:
        import aiohttp

        if self._entered == 0:
            connector = aiohttp.TCPConnector(limit=self.limit)
            self._session = aiohttp.ClientSession(connector=connector)
        self._entered += 1
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._entered -= 1
        if self._entered == 0 and self._session is not None:
            session, self._session = self._session, None
            await session.close()

    async def __getitem__(self, i: int) -> Any:
        if self._session is None:
            raise RuntimeError("AsyncHttpDataset: enter it (async with) before fetching")
        url = object_url(self.base, i, self.count)
        async with self._session.get(url) as resp:
            resp.raise_for_status()
            data: bytes = await resp.read()
        if self.out == "decode":
            return decode_tensor(data)
        return data if self.out == "bytes" else raw_tensor(data)


class _SpdlFetch:
    """SPDL's async fetch stage: one aiohttp session on the pipeline's event loop, closed on
    that loop once the requests in flight are done (:meth:`close`, before the pipeline stops)."""

    def __init__(self, base: str, count: int, decode: bool) -> None:
        self.base, self.count, self.decode = base, count, decode
        self.session: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.in_flight = 0
        self.idle = asyncio.Event()  # replaced on the pipeline's loop at the first call
        self.draining = False

    async def __call__(self, i: int) -> Any:
        import aiohttp

        if self.draining:  # the run is over: wait to be cancelled when the pipeline stops
            await asyncio.get_running_loop().create_future()
        if self.session is None:
            self.loop = asyncio.get_running_loop()
            connector = aiohttp.TCPConnector(limit=IN_FLIGHT)
            self.session = aiohttp.ClientSession(connector=connector)
            self.idle = asyncio.Event()
        self.in_flight += 1
        self.idle.clear()
        try:
            url = object_url(self.base, i, self.count)
            async with self.session.get(url) as r:
                r.raise_for_status()
                data: bytes = await r.read()
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self.idle.set()
        return data if self.decode else raw_tensor(data)

    async def _aclose(self) -> None:
        if self.in_flight:
            await self.idle.wait()
        await self.session.close()

    def close(self) -> None:
        self.draining = True
        if self.session is not None and self.loop is not None and not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._aclose(), self.loop).result(60)


# --------------------------------------------------------------------------------------------
# Timed runs
# --------------------------------------------------------------------------------------------


@dataclass
class Budget:
    """A run: untimed until ``warmup`` batches and ``warmup_s`` seconds since the first one, then
    at least ``seconds`` and ``min_batches``. The warm-up in seconds lets a loader drain what it
    fetched ahead while its first batch was awaited (SPDL's queues, a loader's prefetch): counted
    in a short window, that backlog would read as more than the store serves."""

    seconds: float
    warmup: int
    min_batches: int
    memory: bool = False
    warmup_s: float = 0.0


class _LoaderPss(PssSampler):
    """The process tree's PSS, less the store's process (a child too, but not the loader's)."""

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for proc in [me, *me.children(recursive=True)]:
                try:
                    if proc.pid in _NOT_LOADER or proc.ppid() in _NOT_LOADER:
                        continue
                    total += int(proc.memory_full_info().pss)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval)


#: Processes the memory rows leave out: the running store's.
_NOT_LOADER: set[int] = set()


class _Clock:
    def __init__(self, budget: Budget) -> None:
        self.b = budget
        self.sampler = _LoaderPss(0.1) if budget.memory else None
        self.seen = self.samples = self.warm = 0
        self.first = self.t0 = self.t1 = 0.0

    def tick(self, batch: Any) -> bool:
        """Count a batch; True when the run has what it needs."""
        self.seen += 1
        now = time.perf_counter()
        if self.seen == 1:
            self.first = now
            if self.sampler is not None:
                self.sampler.start()
        if not self.t0:
            if self.seen >= self.b.warmup and now - self.first >= self.b.warmup_s:
                self.t0 = now
                self.warm = self.seen
            return False
        self.samples += batch_len(batch)
        self.t1 = now
        timed = self.seen - self.warm
        return now - self.t0 >= self.b.seconds and timed >= self.b.min_batches

    def abort(self) -> None:
        """The run failed: stop the memory sampler's thread."""
        if self.sampler is not None:
            self.sampler.stop()

    def result(self) -> RoundResult:
        peak = float(self.sampler.stop()) if self.sampler is not None else None
        if not self.t0 or self.seen <= self.warm:
            raise RuntimeError(f"only {self.seen} batches: the run ended in its warm-up")
        return RoundResult(self.t1 - self.t0, self.seen - self.warm, self.samples, peak_pss=peak)


def _drain_sync(batches: Iterable[Any], budget: Budget) -> RoundResult:
    clock = _Clock(budget)
    try:
        for batch in batches:
            if clock.tick(batch):
                break
    except BaseException:
        clock.abort()
        raise
    return clock.result()


def run_torch(base: str, count: int, decode: bool, workers: int, budget: Budget) -> RoundResult:
    with warnings.catch_warnings():
        # "This DataLoader will create 32 worker processes": the row's point.
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        ds = UrllibDataset(base, count, decode)
        it = iter(DataLoader(ds, batch_size=BATCH, num_workers=workers))
    try:
        return _drain_sync(it, budget)
    finally:
        del it  # shuts the workers down


def run_torch_async(
    base: str, count: int, decode: bool, workers: int, budget: Budget
) -> RoundResult:
    ds = TorchAsyncDataset(base, count, decode)
    it = iter(DataLoader(ds, batch_size=BATCH, num_workers=workers))
    try:
        return _drain_sync(it, budget)
    finally:
        del it


def run_spdl(base: str, count: int, decode: bool, budget: Budget) -> RoundResult:
    from spdl.pipeline import PipelineBuilder

    fetch = _SpdlFetch(base, count, decode)
    source: Any = range(LENGTH)
    builder: Any = PipelineBuilder().add_source(source).pipe(fetch, concurrency=IN_FLIGHT)
    if decode:
        builder = builder.pipe(decode_tensor, concurrency=2)
    pipeline = builder.aggregate(BATCH).pipe(default_collate).add_sink(4).build(num_threads=2)
    with pipeline.auto_stop(timeout=60):
        try:
            return _drain_sync(pipeline.get_iterator(timeout=120), budget)
        finally:
            fetch.close()


def run_aio(
    base: str, count: int, decode: bool, workers: int, fetch_in: str, budget: Budget
) -> RoundResult | None:
    """aioloader; None when this loader has no ``fetch_in`` (or rejects the mode)."""

    async def go() -> RoundResult | None:
        clock = _Clock(budget)
        if fetch_in == "workers":
            out = "decode" if decode else "tensor"
            ds = AsyncHttpDataset(base, count, out=out, limit=IN_FLIGHT // 2)
            kwargs: dict[str, Any] = {"fetch_in": "workers", "source_concurrency": IN_FLIGHT // 2}
        else:
            # bytes from the loop, decoded by transform where the loader runs it
            ds = AsyncHttpDataset(base, count, out="bytes" if decode else "tensor", limit=IN_FLIGHT)
            kwargs = {"fetch_in": "loop", "source_concurrency": IN_FLIGHT}
            if decode:
                kwargs["transform"] = decode_tensor
        loader = aio_class()(ds, batch_size=BATCH, num_workers=workers, **kwargs)
        try:
            async with loader:
                async for batch in loader:
                    if clock.tick(batch):
                        break
        except BaseException:
            clock.abort()
            raise
        return clock.result()

    return asyncio.run(go())


def run_limit(base: str, count: int, budget: Budget) -> RoundResult:
    """The store's limit: IN_FLIGHT requests at once from a bare aiohttp client, no loader."""
    import aiohttp

    async def go() -> RoundResult:
        done = warm = 0
        first = t0 = 0.0
        stop = False
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=IN_FLIGHT)
        ) as session:

            async def worker(k: int) -> None:
                nonlocal done, warm, first, t0, stop
                i = k
                while not stop:
                    async with session.get(object_url(base, i, count)) as r:
                        r.raise_for_status()
                        await r.read()
                    i += IN_FLIGHT
                    done += 1
                    now = time.perf_counter()
                    first = first or now
                    if not t0:
                        # the loaders' warm-up: 'warmup' batches' worth and warmup_s seconds
                        if done >= budget.warmup * BATCH and now - first >= budget.warmup_s:
                            t0, warm = now, done
                    elif now - t0 >= budget.seconds:
                        stop = True

            await asyncio.gather(*(worker(k) for k in range(IN_FLIGHT)))
        timed = done - warm
        return RoundResult(time.perf_counter() - t0, timed // BATCH, timed)

    return asyncio.run(go())


def _decode_warm(jpegs: list[bytes]) -> None:
    torch.set_num_threads(1)
    decode_tensor(jpegs[0])  # Pillow imported, its decoder warm


def _decode_for(jpegs: list[bytes], start: float, seconds: float) -> int:
    """Decode back to back from ``start`` to ``start + seconds`` (the shared monotonic clock)."""
    time.sleep(max(0.0, start - time.perf_counter()))
    n, end = 0, start + seconds
    while time.perf_counter() < end:
        decode_tensor(jpegs[n % len(jpegs)])
        n += 1
    return n


def run_decode_limit(jpegs: list[bytes], workers: int, seconds: float) -> RoundResult:
    """min(workers, cores) processes decoding the store's JPEGs back to back over the same
    stretch of time (every process warm first), nothing fetched, nothing sent."""
    procs = min(workers, os.cpu_count() or 1)
    with ProcessPoolExecutor(procs) as pool:
        list(pool.map(_decode_warm, [jpegs] * procs * 2))
        start = time.perf_counter() + 0.2
        n = sum(pool.map(_decode_for, [jpegs] * procs, [start] * procs, [seconds] * procs))
    return RoundResult(seconds, n // BATCH, n)


# --------------------------------------------------------------------------------------------
# The workload
# --------------------------------------------------------------------------------------------


@dataclass
class Setting:
    latency_ms: float
    size: int
    decode: bool

    @property
    def label(self) -> str:
        mb = self.size >= 1_000_000
        size = f"{self.size // 1_000_000} MB" if mb else f"{self.size // 1000} KB"
        return f" ({self.latency_ms:g} ms, {size}{', decode' if self.decode else ''})"


def settings(grid: bool) -> list[Setting]:
    if not grid:
        return [Setting(20, 100_000, False), Setting(20, 100_000, True)]
    return [
        Setting(lat, size, dec) for lat in LATENCIES_MS for size in SIZES for dec in (False, True)
    ]


def columns(setting: Setting, with_spdl: bool) -> list[str]:
    cols = [LIMIT]
    if setting.decode:
        cols.append(DECODE_LIMIT)
    cols += [TORCH, TORCH_8]
    if setting.size < 1_000_000 or setting.decode:
        cols.append(TORCH_32)  # 32 workers x 2 batches of 32 MB ahead: too much memory here
    cols += [TORCH_ASYNC]
    if with_spdl:
        cols.append(SPDL)
    cols += [AIO, AIO_LOOP_0, AIO_LOOP_2]
    return cols


def measure_remote(
    setting: Setting,
    *,
    workers: int,
    rounds: int,
    seconds: float,
    with_spdl: bool,
    memory: bool,
    progress: Callable[[str], None],
    only: Iterable[str] | None = None,
    warmup_s: float | None = None,
) -> tuple[dict[str, list[RoundResult]], dict[str, float], float]:
    """Alternating rounds of every column on one store: ``(results, peak PSS bytes per column,
    the store's CPU cores while the limit ran, median)``. ``only``: these columns alone.
    ``warmup_s``: untimed seconds after each run's first batch (default: ``min(1, seconds)``)."""
    if warmup_s is None:
        warmup_s = min(1.0, seconds)
    from aioloader.benchmark._store import HttpStore, StoreConfig, make_jpegs

    cfg = StoreConfig(
        latency_ms=setting.latency_ms, size=setting.size, count=OBJECTS, jpeg=setting.decode
    )
    cols = columns(setting, with_spdl)
    if only is not None:
        keep = set(only)
        cols = [c for c in cols if c in keep]
    out: dict[str, list[RoundResult]] = {c: [] for c in cols}
    peaks: dict[str, float] = {}
    store_cpu: list[float] = []
    jpegs = make_jpegs(setting.size, cfg.jpeg_pool, cfg.seed) if setting.decode else []
    with HttpStore(cfg) as store:
        import psutil

        proc = psutil.Process(store.pid)
        base = store.url
        _NOT_LOADER.add(store.pid)

        def one(col: str, budget: Budget) -> RoundResult | None:
            if col == LIMIT:
                c0 = sum(proc.cpu_times()[:2])
                res = run_limit(base, OBJECTS, budget)
                store_cpu.append((sum(proc.cpu_times()[:2]) - c0) / max(res.seconds, 1e-9))
                return res
            if col == DECODE_LIMIT:
                return run_decode_limit(jpegs, workers, budget.seconds)
            if col in (TORCH, TORCH_8, TORCH_32):
                nw = {TORCH: workers, TORCH_8: 8, TORCH_32: 32}[col]
                return run_torch(base, OBJECTS, setting.decode, nw, _budget(budget, nw))
            if col == TORCH_ASYNC:
                return run_torch_async(
                    base, OBJECTS, setting.decode, workers, _budget(budget, workers)
                )
            if col == SPDL:
                return run_spdl(base, OBJECTS, setting.decode, budget)
            if col == AIO:
                return run_aio(
                    base, OBJECTS, setting.decode, workers, "workers", _budget(budget, workers)
                )
            nw = 0 if col == AIO_LOOP_0 else workers
            return run_aio(base, OBJECTS, setting.decode, nw, "loop", _budget(budget, nw))

        try:
            timed = Budget(seconds, warmup=2, min_batches=2, warmup_s=warmup_s)
            for r in range(rounds):
                for col in cols:
                    res = one(col, timed)
                    if res is not None:
                        out[col].append(res)
                progress(f"remote{setting.label}: round {r + 1}/{rounds}")
            if memory:
                mem = Budget(seconds, 2, 2, memory=True, warmup_s=warmup_s)
                for col in cols:
                    if col in (LIMIT, DECODE_LIMIT):
                        continue
                    res = one(col, mem)
                    if res is not None and res.peak_pss is not None:
                        peaks[col] = res.peak_pss
                progress(f"remote{setting.label}: memory round")
        finally:
            _NOT_LOADER.discard(store.pid)
    return out, peaks, statistics.median(store_cpu) if store_cpu else 0.0


def _budget(b: Budget, workers: int) -> Budget:
    """Every worker's first batch untimed, and every worker in the timed part at least once."""
    return Budget(
        b.seconds, max(b.warmup, workers), max(b.min_batches, workers), b.memory, b.warmup_s
    )


def _rate(r: RoundResult) -> float:
    return r.samples / r.seconds if r.seconds > 0 else 0.0


def rows_for(
    setting: Setting, res: dict[str, list[RoundResult]], peaks: dict[str, float], store_cpu: float
) -> list[Row]:
    label = setting.label
    rates = {c: [_rate(r) for r in rs] for c, rs in res.items() if rs}
    rows: list[Row] = []
    missing = ""
    if SPDL not in res:
        missing += "; spdl: not installed (pip install spdl), no SPDL column"
    speed = Row(
        "remote",
        f"samples/s{label}",
        "higher",
        rates,
        note=f"aioloader: num_workers=2, fetch_in='workers'{missing}",
    )
    if not setting.decode:
        speed.target = ">= 20x"
        r = speed.ratio()
        speed.passed = None if r is None else r >= 20
    rows.append(speed)
    # the bound: the store's limit, or the machine's decode limit if lower; round by round
    bound = list(rates.get(LIMIT, []))
    if setting.decode and rates.get(DECODE_LIMIT):
        bound = [min(a, b) for a, b in zip(bound, rates[DECODE_LIMIT], strict=False)]
    fractions = {
        c: [v / lim for v, lim in zip(vals, bound, strict=False) if lim]
        for c, vals in rates.items()
        if c not in (LIMIT, DECODE_LIMIT)
    }
    frac = Row(
        "remote",
        f"fraction of the limit{label}",
        "higher",
        {c: v for c, v in fractions.items() if v},
        note="limit: the store's (bare aiohttp client, 64 in flight)"
        + (" or the decode limit, whichever is lower" if setting.decode else ""),
    )
    # the targets: 2 workers with decode at 0.9 of the bound; no workers at 0.95 of the
    # store's limit
    who, bar = (AIO, 0.9) if setting.decode else (AIO_LOOP_0, 0.95)
    frac.target = f"{who} >= {bar:g}"
    f = frac.median(who)
    frac.passed = None if f is None else f >= bar
    rows.append(frac)
    torch_med = statistics.median(rates[TORCH]) if rates.get(TORCH) else None
    if torch_med:
        rows.append(
            Row(
                "remote",
                f"ratio to torch at 2 workers{label}",
                "higher",
                {
                    c: [v / torch_med for v in vals]
                    for c, vals in rates.items()
                    if c not in (LIMIT, DECODE_LIMIT)
                },
            )
        )
    async_med = statistics.median(rates[TORCH_ASYNC]) if rates.get(TORCH_ASYNC) else None
    if async_med:
        vs = Row(
            "remote",
            f"ratio to torch-async (the per-worker __getitems__ workaround){label}",
            "higher",
            {c: [v / async_med for v in rates[c]] for c in (AIO, SPDL, AIO_LOOP_2) if rates.get(c)},
            target="aioloader >= 1.4",
        )
        f = vs.median(AIO)
        vs.passed = None if f is None else f >= 1.4
        rows.append(vs)
    if peaks:
        mb = 1024.0 * 1024.0
        rows.append(
            Row(
                "remote",
                f"peak PSS of process tree, MB{label}",
                "lower",
                {c: [p / mb] for c, p in peaks.items()},
                note="one round per column, sampled every 0.1 s",
            )
        )
    rows.append(
        Row(
            "remote",
            f"store process CPU, cores, during the limit{label}",
            "lower",
            {LIMIT: [store_cpu]},
            note="under 1: the store is not the bound",
        )
    )
    return rows


def bench_remote(cfg: Config) -> list[Row]:
    grid = bool(cfg.extra.get("remote_grid"))
    with_spdl = SPDL in cfg.loaders or spdl_available()
    if not with_spdl:
        cfg.progress("remote: spdl is not installed (pip install spdl): no SPDL row")
    seconds = 1.0 if cfg.quick else 3.0
    rows: list[Row] = []
    for setting in settings(grid):
        res, peaks, store_cpu = measure_remote(
            setting,
            workers=cfg.workers,
            rounds=cfg.rounds,
            seconds=seconds,
            with_spdl=with_spdl,
            memory=True,
            progress=cfg.progress,
        )
        rows += rows_for(setting, res, peaks, store_cpu)
    rows += bench_tail(cfg)
    return rows


# --------------------------------------------------------------------------------------------
# The tail: 1 % of requests 20x slower, hedging off and on
# --------------------------------------------------------------------------------------------

HEDGE_OFF = "hedge-off"
HEDGE_ON = "hedge-on"
#: Hedging on, in a process whose objects were frozen out of garbage collection first.
HEDGE_FROZEN = "hedge-frozen"
NO_TAIL = "no-tail"  # the same store with no slow requests: the floor of this machine
#: The quantile hedging uses in this measurement (FetchPolicy.hedge).
TAIL_HEDGE = 0.9


def _batch_times(base: str, count: int, hedge: float | None, batches: int) -> list[float]:
    """Seconds each batch's requests took (the first request's start to the last answer), for
    an async dataset read by aioloader's fetcher with and without hedging; ``num_workers=0``,
    so the fetcher runs here and its calls can be timed (the workers run the same code)."""
    from aioloader import AsyncDataLoader, FetchPolicy
    from aioloader._remote import SampleFetcher

    times: list[float] = []
    original = SampleFetcher.samples

    async def timed(self: SampleFetcher, indices: Any, batched: bool) -> list[Any]:
        start = time.perf_counter()
        try:
            return await original(self, indices, batched)
        finally:
            times.append(time.perf_counter() - start)

    async def go() -> None:
        policy = FetchPolicy(hedge=hedge, hedge_min_calls=100) if hedge else FetchPolicy()
        # The client's pool has room for the hedged calls beside the others.
        ds = AsyncHttpDataset(base, count, out="tensor", limit=2 * IN_FLIGHT)
        loader = AsyncDataLoader(
            ds,
            batch_size=BATCH,
            num_workers=0,
            source_concurrency=IN_FLIGHT,
            fetch_policy=policy,
        )
        async with loader:
            seen = 0
            async for _ in loader:
                seen += 1
                if seen >= batches:
                    break

    SampleFetcher.samples = timed  # type: ignore[method-assign]
    try:
        asyncio.run(go())
    finally:
        SampleFetcher.samples = original  # type: ignore[method-assign]
    return times[20:]  # the first batches fill the latency history hedging reads


def bench_tail(cfg: Config) -> list[Row]:
    """p50 and p99 time per batch (20 ms latency, 10 KB objects, 1 % of requests 20x slower),
    hedging off and on; target: p99 at most 2x the p50 with hedging on."""
    from aioloader.benchmark._store import start_store

    batches = 60 if cfg.quick else 200
    cols = (NO_TAIL, HEDGE_OFF, HEDGE_ON, HEDGE_FROZEN)
    p50: dict[str, list[float]] = {c: [] for c in cols}
    p99: dict[str, list[float]] = {c: [] for c in cols}
    spread: dict[str, list[float]] = {c: [] for c in cols}
    count = 4096
    with start_store(
        latency_ms=20, size=10_000, count=count, slow_fraction=0.01, slow_factor=20
    ) as store:
        for r in range(cfg.rounds):
            for col, hedge in (
                (NO_TAIL, None),
                (HEDGE_OFF, None),
                (HEDGE_ON, TAIL_HEDGE),
                (HEDGE_FROZEN, TAIL_HEDGE),
            ):
                cfg.progress(f"remote tail: round {r + 1}/{cfg.rounds}, {col}")
                store.configure(slow_fraction=0.0 if col == NO_TAIL else 0.01)
                # A full garbage collection of this process (torch and the benchmark imported)
                # holds the loop for up to ~100 ms, every request in flight with it: frozen,
                # what was made before the run is left out of it (docs/remote.md, the tail).
                if col == HEDGE_FROZEN:
                    gc.freeze()
                try:
                    times = sorted(_batch_times(store.url, count, hedge, batches))
                finally:
                    if col == HEDGE_FROZEN:
                        gc.unfreeze()
                mid = statistics.median(times) * 1e3
                high = times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3
                p50[col].append(mid)
                p99[col].append(high)
                spread[col].append(high / mid)
    label = " (20 ms, 10 KB, 1 % of requests 20x slower)"
    note = (
        f"aioloader, num_workers=0, FetchPolicy(hedge={TAIL_HEDGE}) for {HEDGE_ON}; "
        f"{HEDGE_FROZEN}: the same after gc.freeze(); {NO_TAIL}: no slow requests, no hedging "
        "(what the machine and store give at best)"
    )
    rows = [
        Row("remote", f"p50 ms per batch{label}", "lower", p50, note=note),
        Row("remote", f"p99 ms per batch{label}", "lower", p99, note=note),
        Row("remote", f"p99 / p50 per batch{label}", "lower", spread, note=note),
    ]
    on = rows[2].median(HEDGE_FROZEN)
    rows[2].target = f"{HEDGE_FROZEN} <= 2"
    rows[2].passed = None if on is None else on <= 2.0
    return rows
