"""AsyncDataLoader: torch's DataLoader API on an asyncio event loop. Runs in: the event loop.

The only module that wires the stages together::

    sampler -> scheduler task -> ProcessPoolExecutor workers -> ReorderBuffer -> consumer
               (send_idx, indices)   (Result bytes)            (by send_idx)

Invariant, per epoch: ``submitted - delivered - skipped == permits held <= max_in_flight``.
A permit returns when the *consumer receives* a batch (or an exhausted iterable worker's index is
skipped), not when a worker finishes it, so a straggler can never make the reorder buffer grow past
``max_in_flight`` batches.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import enum
import errno
import functools
import logging
import multiprocessing
import os
import pickle
import time
import warnings
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.context import BaseContext
from typing import Any, Generic, NamedTuple, TypeVar

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, _DatasetKind

from . import _transport, _worker
from ._device import DeviceStage
from ._errors import LoaderClosedError, LoaderTimeoutError, PoisonBatchError, WorkerCrashedError
from ._executor import CrashReport, WorkerPool
from ._reorder import ReorderBuffer
from ._threads import run_off_loop

__all__ = ("AsyncDataLoader", "LoaderStats")

_logger = logging.getLogger(__name__)

_T_co = TypeVar("_T_co", covariant=True)
_B = TypeVar("_B")

#: torch DataLoader attributes readable on AsyncDataLoader.
_TORCH_ATTRS = frozenset(
    {
        "dataset",
        "batch_size",
        "sampler",
        "batch_sampler",
        "num_workers",
        "collate_fn",
        "pin_memory",
        "drop_last",
        "timeout",
        "worker_init_fn",
        "multiprocessing_context",
        "generator",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
    }
)

#: Attributes torch's DataLoader forbids setting after construction; so do we.
_FROZEN_ATTRS = frozenset(
    {"batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"}
)


class LoaderStats(NamedTuple):
    """A snapshot of :meth:`AsyncDataLoader.stats`. Counters cover the loader's whole life."""

    #: Batches handed to the consumer.
    batches_delivered: int
    #: Samples in those batches (the sizes of their index batches).
    samples_delivered: int
    #: Seconds the consumer spent waiting in ``__anext__`` for data.
    wait_s: float
    #: ``wait_s`` over the time since the first batch was requested: 0 means never starved.
    data_stall_fraction: float
    #: Index batches submitted whose batch the consumer has not received yet.
    batches_in_flight: int
    #: Fraction of the workers' wall time spent loading batches.
    worker_busy_fraction: float
    #: Worker pools replaced after a worker died.
    worker_restarts: int
    #: Seconds from the latest epoch's first request to its first batch (None before one arrived).
    time_to_first_batch_s: float | None


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class _Direct(NamedTuple):
    """A batch loaded in this process (``num_workers=0``): no transport needed."""

    value: Any


_END = object()  # the device feeder's end-of-epoch marker


class _Failure(NamedTuple):
    """An exception to raise at this batch's position."""

    exc: BaseException


def _raise_remote(err: _worker.RemoteError) -> None:
    exc_type: Any = RuntimeError
    if err.exc_type is not None:
        try:
            exc_type = pickle.loads(err.exc_type)
        except Exception:
            exc_type = RuntimeError
    if exc_type in (StopIteration, StopAsyncIteration):
        # Raised from a coroutine these would be swallowed or mangled (PEP 479).
        raise RuntimeError(
            f"Caught {err.type_name} {err.where}: a map-style Dataset's __getitem__ or a "
            f"collate_fn must not raise {err.type_name}; raise IndexError for a bad index.\n"
            f"Original {err.exc_msg}"
        )
    wrapper = ExceptionWrapper.__new__(ExceptionWrapper)
    wrapper.exc_type = exc_type
    wrapper.exc_msg = err.exc_msg
    wrapper.where = err.where
    if exc_type is RuntimeError and err.type_name != "RuntimeError":
        wrapper.where = f"{err.where} (original type {err.type_name} cannot be rebuilt here)"
    wrapper.reraise()  # type: ignore[no-untyped-call]


class _ThreadBackend:
    """``num_workers=0``: batches load on one thread of this process, off the event loop.

    As in torch's single-process mode, ``get_worker_info()`` is None and errors keep their original
    exception object.
    """

    num_workers = 1

    def __init__(self, loader: AsyncDataLoader[Any]) -> None:
        self._kind = _DatasetKind.Iterable if loader._is_iterable else _DatasetKind.Map
        self._dataset = loader.dataset
        self._auto_collation = loader.batch_sampler is not None
        self._collate_fn = loader.collate_fn
        self._drop_last = loader.drop_last
        self._epoch = -1
        self._fetcher: Any = None
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="aioloader-fetch")

    def submit(self, send_idx: int, indices: Any, epoch: int, worker_id: int | None) -> Future[Any]:
        return self._ex.submit(self._fetch, send_idx, indices, epoch)

    def _fetch(self, send_idx: int, indices: Any, epoch: int) -> _worker.Result:
        start = time.perf_counter()
        if self._epoch != epoch:
            self._epoch = epoch
            self._fetcher = _DatasetKind.create_fetcher(  # type: ignore[no-untyped-call]
                self._kind, self._dataset, self._auto_collation, self._collate_fn, self._drop_last
            )
        try:
            data: Any = _Direct(self._fetcher.fetch(indices))
        except StopIteration:
            if self._kind != _DatasetKind.Iterable:
                raise RuntimeError(
                    "the Dataset's __getitem__ or the collate_fn raised StopIteration; "
                    "raise IndexError for a bad index instead"
                ) from None
            data = _worker.Exhausted(0)
        return _worker.Result(send_idx, 0, os.getpid(), data, time.perf_counter() - start)

    async def shutdown(self, *, graceful: bool) -> None:
        self._ex.shutdown(wait=False, cancel_futures=True)
        # The thread may be inside user code; joining waits for that call to return.
        await run_off_loop(lambda: self._ex.shutdown(wait=True), name="fetch-join")


class AsyncDataLoader(Generic[_T_co]):
    """Loads batches like ``torch.utils.data.DataLoader``, as an async iterator.

    Every argument of torch's ``DataLoader`` is accepted with the same meaning, default and
    validation errors. Each ``async for`` over the loader is one epoch. Use it as an async context
    manager (or call :meth:`aclose`) so worker processes are released deterministically.

    Args:
        device: ``"cuda"``, ``"cuda:N"`` or a ``torch.device`` to receive batches already on the
            GPU: each batch is pinned and copied with ``non_blocking=True`` on a side stream of one
            dedicated thread, and is safe to use on the consumer's current stream as delivered.
            ``None`` or ``"cpu"`` keeps batches on the host.
        device_prefetch: Batches kept ready on the device (or pinned) ahead of the consumer, so
            the copy of the next batch overlaps the compute on this one.
        worker_nice: Niceness added to each worker process (0-19). Workers run at a lower CPU
            priority than the process that runs the event loop, so on a busy machine the loop
            (and the training step) wake promptly; 0 keeps torch's equal priority.
        max_worker_restarts: Worker pools the loader may replace per epoch after a worker process
            dies; the batches in flight are resubmitted, so no sample is lost or repeated.
            0 fails at the first crash, as torch does. An index batch that kills its worker twice
            raises :class:`~aioloader.PoisonBatchError` regardless.

    Example::

        async with AsyncDataLoader(dataset, batch_size=32, shuffle=True, num_workers=4) as loader:
            for epoch in range(3):
                async for batch in loader:
                    ...
    """

    def __init__(
        self,
        dataset: Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | BaseContext | None = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        device: str | torch.device | None = None,
        device_prefetch: int = 2,
        max_worker_restarts: int = 3,
        worker_nice: int = 5,
    ) -> None:
        # torch's own constructor does the validation, picks the default samplers and collate_fn,
        # and starts nothing: workers start only when it is iterated, which we never do.
        torch_loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            collate_fn=collate_fn,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context,
            generator=generator,
            prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
            in_order=in_order,
        )
        if num_workers > 0 and torch_loader.prefetch_factor == 0:
            # torch accepts this and then fails with a bare AssertionError when iterated.
            raise ValueError(
                "prefetch_factor must be at least 1 with num_workers > 0: it is the number of "
                "batches each worker loads ahead"
            )
        _check_int("max_worker_restarts", max_worker_restarts, 0, None, "a non-negative int")
        _check_int(
            "worker_nice", worker_nice, 0, 19, "an int from 0 (the main process's priority) to 19"
        )
        _check_int(
            "device_prefetch",
            device_prefetch,
            1,
            None,
            "a positive int (batches kept ready on the device ahead of the consumer)",
        )
        self.worker_nice = worker_nice
        with warnings.catch_warnings():
            # Validates `device` now; torch's pin_memory warnings come per epoch, as in torch.
            warnings.simplefilter("ignore")
            DeviceStage(pin_memory=pin_memory, device=device, pin_memory_device=pin_memory_device)
        self.device = device
        self.device_prefetch = device_prefetch
        object.__setattr__(self, "_torch", torch_loader)
        self._is_iterable = isinstance(torch_loader.dataset, IterableDataset)
        # Which worker loads a batch decides its random augmentations (each worker's RNG is one
        # stream seeded base_seed + worker_id). In order, batches go to workers round-robin as in
        # torch, so a fixed generator reproduces torch's batches exactly. in_order=False gives up
        # that determinism anyway, so there all workers share one queue and a slow batch never
        # holds up the ones queued behind it on the same worker.
        self._pinned_workers = self._is_iterable or in_order
        self.max_worker_restarts = max_worker_restarts
        self._state = _State.OPEN
        self._epoch_no = 0
        self._current: _Epoch | None = None
        self._persistent_pool: WorkerPool | None = None
        # An abandoned epoch left tasks running on the persistent pool: close it without waiting.
        self._persistent_pool_busy = False
        self._persistent_seed: int | None = None
        self._pool_lock: asyncio.Lock | None = None
        self._cleanups: set[asyncio.Task[None]] = set()
        self._initialized = True
        # stats
        self._batches = 0
        self._samples = 0
        self._wait_s = 0.0
        self._first_request: float | None = None
        self._busy_s = 0.0
        self._restarts = 0
        self._ttfb: float | None = None

    # ---------------------------------------------------------------- torch-compatible attributes

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_initialized", False) and name in _FROZEN_ATTRS:
            raise ValueError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized"
            )
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        # dataset, batch_size, sampler, collate_fn, ...: read from the torch DataLoader that
        # validated them, so they hold exactly what torch would (defaults filled in).
        if name in _TORCH_ATTRS:
            return getattr(self._torch, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def _index_sampler(self) -> Any:
        return self._torch._index_sampler

    def __len__(self) -> int:
        """Batches per epoch, as ``len()`` of torch's DataLoader (an estimate for iterables)."""
        return len(self._torch)

    def __repr__(self) -> str:
        return (
            f"<AsyncDataLoader dataset={type(self.dataset).__name__} "
            f"batch_size={self.batch_size} num_workers={self.num_workers} "
            f"state={self._state.value}>"
        )

    # -------------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> AsyncDataLoader[_T_co]:
        if self._state is _State.CLOSED:
            raise LoaderClosedError(
                "this loader was closed; create a new AsyncDataLoader to iterate again"
            )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __aiter__(self) -> _EpochIterator[Any]:
        """Start an epoch. A previous epoch still running on this loader is ended first."""
        if self._state is _State.CLOSED:
            raise LoaderClosedError(
                "this loader was closed; create a new AsyncDataLoader to iterate again"
            )
        self._abandon_current()
        if self.pin_memory and self.pin_memory_device:
            warnings.warn(
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device,ignore pin_memory_device='{self.pin_memory_device}'.",
                stacklevel=2,
            )
        if self.pin_memory and not torch.accelerator.is_available():
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=2,
            )
        persistent = self.persistent_workers and self.num_workers > 0
        if persistent and self._persistent_seed is not None:
            base_seed = self._persistent_seed  # torch draws it once for persistent workers
        else:
            # As torch: the workers' base seed is drawn from `generator` before the sampler draws.
            base_seed = int(
                torch.empty((), dtype=torch.int64).random_(generator=self.generator).item()
            )
            if persistent:
                self._persistent_seed = base_seed
        epoch = _Epoch(self, self._epoch_no, base_seed)
        self._epoch_no += 1
        handle: _EpochIterator[Any] = _EpochIterator(epoch)
        self._current = epoch
        return handle

    def _abandon_current(self) -> None:
        if self._current is not None:
            self._current.abandon()
            self._current = None

    def _spawn_cleanup(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro, name="aioloader-cleanup")
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _wait_cleanups(self) -> None:
        # asyncio.wait, not gather: cancelling the caller must not cancel the cleanups (a
        # cleanup cancelled before its first step would leave its workers running). A later
        # aclose() waits for them instead.
        while self._cleanups:
            await asyncio.wait(list(self._cleanups))

    async def aclose(self) -> None:
        """End any running epoch and stop every worker process and thread. Safe to call twice.

        Order: the scheduler stops submitting; buffered batches are dropped; worker processes
        exit (idle ones are asked, busy ones of an abandoned epoch are killed); the loader's
        helper threads are joined. Returns when all of it is gone.
        """
        self._state = _State.CLOSED
        self._abandon_current()
        await self._wait_cleanups()
        pool, self._persistent_pool = self._persistent_pool, None
        if pool is not None:
            await pool.shutdown(graceful=not self._persistent_pool_busy)

    def __del__(self) -> None:
        pool = getattr(self, "_persistent_pool", None)
        if pool is not None:
            warnings.warn(
                f"{self!r} was not closed; use `async with` or `await loader.aclose()`",
                ResourceWarning,
                stacklevel=2,
            )
            pool._kill_sync()

    # ----------------------------------------------------------------------------------- pools

    def _mp_context(self) -> BaseContext:
        ctx = self.multiprocessing_context
        return ctx if ctx is not None else multiprocessing.get_context()

    def _make_spec(self, base_seed: int) -> _worker.WorkerSpec:
        """Runs in: a helper thread (pickling a large dataset takes a while)."""
        ctx = self._mp_context()
        objects = (self.dataset, self.collate_fn, self.worker_init_fn)
        payload = None
        if ctx.get_start_method() != "fork":
            payload = _transport.dump_payload(objects)
            objects_or_none = None
        else:
            objects_or_none = objects
        return _worker.WorkerSpec(
            num_workers=self.num_workers,
            base_seed=base_seed,
            is_iterable=self._is_iterable,
            auto_collation=self.batch_sampler is not None,
            drop_last=self.drop_last,
            main_pid=os.getpid(),
            nice=self.worker_nice,
            payload_file=payload,
            objects=objects_or_none,
            fixed_worker_id=None,
        )

    async def _new_pool(self, base_seed: int) -> WorkerPool:
        return await WorkerPool.start(
            functools.partial(self._make_spec, base_seed), self._mp_context(), self._pinned_workers
        )

    async def _acquire_pool(self, base_seed: int) -> tuple[Any, bool]:
        """(pool, owned by the epoch). Persistent workers: the loader's pool, started once."""
        if self.num_workers == 0:
            return _ThreadBackend(self), True
        if not self.persistent_workers:
            return await self._new_pool(base_seed), True
        if self._pool_lock is None:
            self._pool_lock = asyncio.Lock()
        async with self._pool_lock:
            if self._persistent_pool is None:
                self._persistent_pool = await self._new_pool(base_seed)
            return self._persistent_pool, False

    def _one_shot_sampler(self) -> bool:
        return any(
            isinstance(s, collections.abc.Iterator) for s in (self.sampler, self.batch_sampler)
        )

    # ----------------------------------------------------------------------------------- stats

    def stats(self) -> LoaderStats:
        """Counters since construction; cheap enough to call every batch."""
        now = time.perf_counter()
        elapsed = (now - self._first_request) if self._first_request is not None else 0.0
        cur = self._current
        workers = max(1, self.num_workers)
        return LoaderStats(
            batches_delivered=self._batches,
            samples_delivered=self._samples,
            wait_s=self._wait_s,
            data_stall_fraction=(self._wait_s / elapsed) if elapsed > 0 else 0.0,
            batches_in_flight=cur.in_flight_count() if cur is not None else 0,
            worker_busy_fraction=min(1.0, self._busy_s / (elapsed * workers)) if elapsed else 0.0,
            worker_restarts=self._restarts,
            time_to_first_batch_s=self._ttfb,
        )


class _EpochIterator(Generic[_B]):
    """What ``async for`` holds. Dropping it (``break``) ends the epoch and frees its workers."""

    def __init__(self, epoch: _Epoch) -> None:
        self._epoch = epoch

    def __aiter__(self) -> _EpochIterator[_B]:
        return self

    async def __anext__(self) -> _B:
        result: _B = await self._epoch.next()
        return result

    async def aclose(self) -> None:
        """End this epoch now: cancel outstanding work and release its workers."""
        await self._epoch.aclose()

    def __del__(self) -> None:
        epoch = getattr(self, "_epoch", None)
        if epoch is not None:
            epoch.abandon()


class _Epoch:
    """One pass over the sampler: the scheduler task, the in-flight table and the reorder buffer."""

    def __init__(self, loader: AsyncDataLoader[Any], epoch_no: int, base_seed: int) -> None:
        self._loader = loader
        self._epoch_no = epoch_no
        self._base_seed = base_seed
        self._sampler_iter = iter(loader._index_sampler)
        self._reorder: ReorderBuffer[Any] = ReorderBuffer(loader.in_order)
        workers = loader.num_workers
        self._max_in_flight = loader.prefetch_factor * workers if workers > 0 else 1
        self._permits = asyncio.Semaphore(self._max_in_flight)
        # send_idx -> (indices, worker id for iterables, future); entries leave when results arrive.
        self._in_flight: dict[int, tuple[Any, int | None, Future[Any] | None]] = {}
        self._pool: Any = None
        self._owns_pool = False
        self._generation = 0  # bumped when a crashed pool is replaced; older futures are stale
        self._restarting: asyncio.Event | None = None
        self._watched: list[int] = []  # worker sentinels registered with the loop
        self._kills: Counter[int] = Counter()
        self._restarts = 0
        self._failed = False  # a fatal error was queued: submit nothing more
        # Iterable datasets: torch's round-robin over workers that are not exhausted.
        self._active = [True] * max(1, workers)
        self._next_worker = 0
        self._start_task: asyncio.Task[None] | None = None
        self._sched_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started_at: float | None = None
        self._yielded = 0
        self._finished = False  # end reached or abandoned: nothing runs any more
        # Device stage (pin_memory / device=): a feeder task moves batches from the reorder buffer
        # through the device thread into _ready, keeping up to device_prefetch batches ahead.
        self._stage: DeviceStage | None = None
        self._feed_task: asyncio.Task[None] | None = None
        self._device_slots: asyncio.Semaphore | None = None
        self._ready: asyncio.Queue[Any] = asyncio.Queue()
        # The reference-holding guard: the batch delivered last stays referenced until the
        # consumer asks for the next one, so its device memory is freed only after the consumer
        # has queued all its work on it (see _device.py).
        self._last_delivered: Any = None

    def in_flight_count(self) -> int:
        return len(self._in_flight) + len(self._reorder)

    # ---------------------------------------------------------------------------- start-up

    async def _start(self) -> None:
        try:
            pool, owned = await self._loader._acquire_pool(self._base_seed)
        except OSError as exc:
            if exc.errno == errno.EMFILE:
                raise _emfile_error(exc) from exc
            raise
        if self._finished:  # abandoned while the pool started
            if owned:
                await pool.shutdown(graceful=False)
            return
        self._pool, self._owns_pool = pool, owned
        self._watch(pool)
        loop = asyncio.get_running_loop()
        self._sched_task = loop.create_task(
            self._schedule(), name=f"aioloader-scheduler:{self._epoch_no}"
        )
        loader = self._loader
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # given once per epoch by __aiter__, as torch does
            stage = DeviceStage(
                pin_memory=loader.pin_memory,
                device=loader.device,
                pin_memory_device=loader.pin_memory_device,
            )
        if stage.active:
            # After the workers exist: starting CUDA and a thread must not precede a fork.
            stage.start()
            self._stage = stage
            self._device_slots = asyncio.Semaphore(loader.device_prefetch)
            self._feed_task = loop.create_task(
                self._feed_device(stage), name=f"aioloader-device-feed:{self._epoch_no}"
            )

    async def _ensure_started(self) -> None:
        if self._start_task is None:
            self._loop = asyncio.get_running_loop()
            self._started_at = time.perf_counter()
            if self._loader._first_request is None:
                self._loader._first_request = self._started_at
            self._start_task = self._loop.create_task(self._start(), name="aioloader-start")
        if not self._start_task.done():
            # shield: a consumer cancelled mid-start must not tear the start-up task apart;
            # abandon() cleans up whatever it produced.
            await asyncio.shield(self._start_task)
        self._start_task.result()

    # ---------------------------------------------------------------------------- scheduler

    async def _schedule(self) -> None:
        send_idx = 0
        try:
            while True:
                await self._permits.acquire()
                if self._restarting is not None:
                    await self._restarting.wait()
                if self._failed:
                    return
                if self._loader._pinned_workers:
                    wid = self._pick_worker()
                    if wid is None:
                        self._permits.release()
                        break
                else:
                    wid = None
                try:
                    indices = next(self._sampler_iter)
                    if not indices and self._loader.batch_sampler is not None:
                        raise IndexError(
                            f"the batch sampler yielded an empty batch (send_idx={send_idx}); "
                            "every batch needs at least one index"
                        )
                except StopIteration:
                    if send_idx == 0 and self._epoch_no > 0 and self._loader._one_shot_sampler():
                        self._reorder.put(send_idx, _Failure(_one_shot_error()))
                        send_idx += 1
                    else:
                        self._permits.release()
                    break
                except Exception as exc:  # the user's sampler failed: raise it at this position
                    self._reorder.put(send_idx, _Failure(exc))
                    send_idx += 1
                    break
                self._in_flight[send_idx] = (indices, wid, None)
                self._submit(send_idx)
                send_idx += 1
            self._reorder.close(send_idx)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug of ours: surface it rather than hang the consumer
            self._reorder.fail(exc)

    def _pick_worker(self) -> int | None:
        n = len(self._active)
        for _ in range(n):
            wid = self._next_worker
            self._next_worker = (self._next_worker + 1) % n
            if self._active[wid]:
                return wid
        return None

    def _submit(self, send_idx: int) -> None:
        indices, wid, _ = self._in_flight[send_idx]
        gen = self._generation
        try:
            fut = self._pool.submit(send_idx, indices, self._epoch_no, wid)
        except BrokenProcessPool:
            self._on_crash(gen)
            return
        except RuntimeError:
            # A persistent pool shut down under us (aclose() racing this epoch).
            if self._finished:
                return
            raise
        self._in_flight[send_idx] = (indices, wid, fut)
        loop = self._loop
        assert loop is not None

        def done(f: Future[Any]) -> None:  # runs in: the executor's manager thread
            # Unpickle here, not on the loop: receiving a shared-memory batch waits on a socket
            # handshake with the worker, which a busy worker can delay by milliseconds.
            received = _receive(f)
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
                loop.call_soon_threadsafe(self._on_done, send_idx, gen, f, received)

        fut.add_done_callback(done)

    def _on_done(self, send_idx: int, gen: int, fut: Future[Any], received: Any) -> None:
        if self._finished:
            return
        if gen != self._generation or fut.cancelled():
            return  # resubmitted to a replacement pool
        exc = fut.exception()
        if isinstance(exc, BrokenProcessPool):
            self._on_crash(gen)
            return
        self._in_flight.pop(send_idx, None)
        if exc is not None:
            self._reorder.put(send_idx, _Failure(exc))
            return
        res: _worker.Result = received
        self._loader._busy_s += res.busy_s
        if isinstance(res.data, _worker.Exhausted):
            self._active[res.data.worker_id] = False
            self._reorder.skip(send_idx)
            self._permits.release()
            return
        self._reorder.put(send_idx, res)

    # ---------------------------------------------------------------------------- crashes

    def _watch(self, pool: Any) -> None:
        """Watch the worker processes' sentinels on the loop: a death is noticed at once.

        The executor reports a dead worker too, but not always: a worker killed while writing a
        result larger than the pipe buffer leaves the executor's thread waiting for the rest of
        it, forever. Watching the processes directly does not depend on that thread.
        """
        if not isinstance(pool, WorkerPool) or self._loop is None:
            return
        self._unwatch()
        gen = self._generation
        for fd in pool.sentinels():
            self._loop.add_reader(fd, self._on_sentinel, gen)
            self._watched.append(fd)

    def _unwatch(self) -> None:
        loop = self._loop
        for fd in self._watched:
            if loop is not None and not loop.is_closed():
                loop.remove_reader(fd)
        self._watched.clear()

    def _on_sentinel(self, gen: int) -> None:
        self._unwatch()  # a finished process's sentinel stays readable
        self._on_crash(gen)

    def _on_crash(self, gen: int) -> None:
        """A worker of pool generation ``gen`` died. Acts once per pool."""
        if gen != self._generation or self._failed or self._finished:
            return
        self._unwatch()
        self._generation += 1  # every other future of the broken pool is now stale
        self._restarting = asyncio.Event()
        self._loader._spawn_cleanup(self._recover(self._pool))

    async def _recover(self, pool: Any) -> None:
        """Diagnose a crash, then either replace the pool and resubmit, or fail the epoch."""
        event = self._restarting
        assert event is not None
        try:
            report: CrashReport = await run_off_loop(pool.crash_report, name="diagnose")
            err = self._crash_error(report)
            if err is not None:
                _logger.debug("fatal worker crash: %s", err)
                self._failed = True
                self._reorder.fail(err)
                self._retire_pool(pool)
                return
            loader = self._loader
            self._restarts += 1
            loader._restarts += 1
            try:
                warnings.warn(
                    f"{self._describe(report)}; restarting the workers and resubmitting "
                    f"{len(self._in_flight)} batch(es) in flight (restart {self._restarts} of "
                    f"at most {loader.max_worker_restarts} this epoch)",
                    RuntimeWarning,
                    stacklevel=1,
                )
            except Warning as warning:
                # Warnings are errors in this process (-W error): the crash is one too, and
                # it must reach the consumer as the loader's error type, not as the warning.
                raise WorkerCrashedError(
                    f"{self._describe(report)} (not restarted: RuntimeWarning is an error here)",
                    worker_id=report.worker_id,
                    exitcode=report.exitcode,
                ) from warning
            pool.hand_over_payload()
            await pool.shutdown(graceful=False)
            new = await WorkerPool.start(lambda: pool.spec, pool._ctx, pool._per_worker)
            if self._finished:
                await new.shutdown(graceful=False)
                return
            if loader._persistent_pool is pool:
                loader._persistent_pool = new
            self._pool = new
            self._watch(new)
            self._restarting = None
            for send_idx in sorted(self._in_flight):
                self._submit(send_idx)
        except BaseException as exc:
            self._failed = True
            self._reorder.fail(exc)
        finally:
            self._restarting = None
            event.set()

    def _describe(self, report: CrashReport) -> str:
        msg = f"DataLoader {report.describe()}"
        held = report.send_idx
        if held is not None and held in self._in_flight:
            msg += f" while loading batch send_idx={held} (indices {self._in_flight[held][0]!r})"
        return msg

    def _crash_error(self, report: CrashReport) -> WorkerCrashedError | None:
        """The error to fail the epoch with, or None if the workers may be restarted."""
        loader = self._loader
        msg = self._describe(report)
        held = report.send_idx if report.send_idx in self._in_flight else None
        indices = self._in_flight[held][0] if held is not None else None
        if held is not None:
            self._kills[held] += 1
        if loader._is_iterable:
            return WorkerCrashedError(
                f"{msg}. An IterableDataset worker's position in its stream dies with it, so "
                "it is not restarted (its samples would be lost or repeated).",
                worker_id=report.worker_id,
                exitcode=report.exitcode,
            )
        if held is not None and self._kills[held] >= 2:
            return PoisonBatchError(
                f"{msg}. This index batch killed its worker twice: one of these samples crashes "
                "the process that loads it (look for a native crash or out-of-memory kill).",
                worker_id=report.worker_id,
                exitcode=report.exitcode,
                indices=indices,
            )
        if self._restarts >= loader.max_worker_restarts:
            return WorkerCrashedError(
                f"{msg}. The workers were already restarted {self._restarts} time(s) this epoch "
                f"(max_worker_restarts={loader.max_worker_restarts}).",
                worker_id=report.worker_id,
                exitcode=report.exitcode,
                indices=indices,
            )
        return None

    def _retire_pool(self, pool: Any) -> None:
        """Take a broken pool out of service (and out of the loader, if it was persistent)."""
        if self._loader._persistent_pool is pool:
            self._loader._persistent_pool = None
            self._owns_pool = True
        if self._owns_pool:
            self._owns_pool = False
            self._loader._spawn_cleanup(pool.shutdown(graceful=False))

    # ---------------------------------------------------------------------------- consumer

    async def next(self) -> Any:
        loader = self._loader
        if self._finished:
            if loader._state is _State.CLOSED:
                raise LoaderClosedError(
                    "this loader was closed; create a new AsyncDataLoader to iterate again"
                )
            raise StopAsyncIteration
        t0 = time.perf_counter()
        try:
            await self._ensure_started()
        except BaseException:
            await self.aclose()
            raise
        self._last_delivered = None
        timeout = loader.timeout
        try:
            if timeout > 0:
                try:
                    async with asyncio.timeout(timeout):
                        value = await self._next_value()
                except TimeoutError:
                    raise LoaderTimeoutError(
                        f"DataLoader timed out after {timeout} seconds"
                    ) from None
            else:
                value = await self._next_value()
        except (StopAsyncIteration, WorkerCrashedError, LoaderTimeoutError):
            await self.aclose()
            raise
        finally:
            loader._wait_s += time.perf_counter() - t0
        if self._yielded == 0 and self._started_at is not None:
            loader._ttfb = time.perf_counter() - self._started_at
        self._yielded += 1
        loader._batches += 1
        self._check_iterable_len()
        if self._stage is not None:
            self._last_delivered = value
        return value

    async def _next_value(self) -> Any:
        """The next batch, decoded (and pinned/moved when the device stage is on)."""
        if self._stage is None:
            item = await self._reorder.get()
            self._permits.release()
            return self._decode(item)
        ready = await self._ready.get()
        assert self._device_slots is not None
        self._device_slots.release()
        if isinstance(ready, _Failure):
            raise ready.exc
        if ready is _END:
            raise StopAsyncIteration
        return ready

    async def _feed_device(self, stage: DeviceStage) -> None:
        """Runs in: a task. reorder buffer -> decode -> device thread -> _ready, in order."""
        slots = self._device_slots
        assert slots is not None
        while True:
            await slots.acquire()
            try:
                item = await self._reorder.get()
            except StopAsyncIteration:
                self._ready.put_nowait(_END)
                return
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # fatal (worker crash): the consumer raises it
                self._ready.put_nowait(_Failure(exc))
                return
            self._permits.release()
            try:
                value = await stage.process(self._decode(item))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # this batch's error; the epoch goes on, as in torch
                value = _Failure(exc)
            self._ready.put_nowait(value)

    def _decode(self, item: Any) -> Any:
        if isinstance(item, _Failure):
            raise item.exc
        res: _worker.Result = item
        data = res.data
        value: Any
        if isinstance(data, _Direct):
            value = data.value
        elif isinstance(data, _worker.RemoteError):
            _raise_remote(data)
        elif isinstance(data, _Failure):
            raise data.exc
        else:
            raise RuntimeError(f"aioloader bug: unexpected result {type(data).__name__}")
        self._loader._samples += _batch_len(value, self._loader)
        return value

    def _check_iterable_len(self) -> None:
        loader = self._loader
        promised = loader._torch._IterableDataset_len_called
        if loader._is_iterable and promised is not None and self._yielded > promised:
            msg = (
                f"Length of IterableDataset {loader.dataset} was reported to be {promised}"
                f"(when accessing len(dataloader)), but {self._yielded} samples have been fetched. "
            )
            if loader.num_workers > 0:
                msg += (
                    "For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                    "for examples."
                )
            warnings.warn(msg, UserWarning, stacklevel=3)

    # ---------------------------------------------------------------------------- shutdown

    def abandon(self) -> None:
        """End the epoch without waiting (break, GC, a new epoch). Cleanup runs as a task."""
        if self._finished:
            return
        self._finished = True
        self._unwatch()
        if self._loader._current is self:
            self._loader._current = None
        self._last_delivered = None
        for t in (self._sched_task, self._start_task, self._feed_task):
            if t is not None and not t.done():
                t.cancel()
        for _, _, fut in self._in_flight.values():
            if fut is not None:
                fut.cancel()
        buffered = self._reorder.drain()
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # garbage-collected outside the loop: clean up synchronously
            if self._owns_pool and isinstance(self._pool, WorkerPool):
                self._pool._kill_sync()
            return
        self._loader._spawn_cleanup(self._cleanup(buffered))

    async def _cleanup(self, buffered: Sequence[Any]) -> None:
        for t in (self._sched_task, self._start_task, self._feed_task):
            if t is not None:
                with contextlib.suppress(BaseException):
                    await t
        if self._stage is not None:
            await self._stage.aclose()
        while not self._ready.empty():  # prefetched pinned/device batches: drop them now
            self._ready.get_nowait()
        del buffered  # decoded already: dropping them frees their shared memory
        pool, owned = self._pool, self._owns_pool
        self._owns_pool = False
        if pool is not None and owned:
            await pool.shutdown(graceful=not self._in_flight)
        elif pool is not None:
            # Tasks of an abandoned epoch keep a persistent pool busy until they finish; an
            # epoch that ran to its end drained them (each worker's queue is first in, first out).
            self._loader._persistent_pool_busy = bool(self._in_flight)

    async def aclose(self) -> None:
        self.abandon()
        await self._loader._wait_cleanups()


def _check_int(name: str, value: object, lo: int, hi: int | None, what: str) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) in ``[lo, hi]``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
    if not ok or (hi is not None and value > hi):  # type: ignore[operator]
        raise ValueError(f"{name} should be {what}, got {value!r}")


def _one_shot_error() -> ValueError:
    return ValueError(
        "the sampler (or batch_sampler) is a one-shot iterator that an earlier epoch used up, "
        "so this epoch would be empty; pass something iterable again each epoch (a list, a "
        "torch.utils.data.Sampler) instead of an iterator"
    )


def _emfile_error(exc: BaseException) -> RuntimeError:
    err = RuntimeError(
        "Too many open files: each batch in shared memory holds a file descriptor until it is "
        "freed. Raise the limit (`ulimit -n 65536` in the shell, or resource.setrlimit("
        "resource.RLIMIT_NOFILE, ...)), keep fewer batches alive, or call "
        "torch.multiprocessing.set_sharing_strategy('file_system') at the start of the program."
    )
    err.__cause__ = exc
    return err


def _batch_len(value: Any, loader: AsyncDataLoader[Any]) -> int:
    if loader.batch_size is None:
        return 1
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return int(value.shape[0])
    if isinstance(value, (list, tuple)) and value:
        return _batch_len(value[0], loader)
    if isinstance(value, dict) and value:
        return _batch_len(next(iter(value.values())), loader)
    return int(loader.batch_size)


def _receive(fut: Future[Any]) -> Any:
    """Rebuild a finished task's batch. Runs in: the executor's manager thread (or a fetch thread).

    Returns the :class:`~aioloader._worker.Result` with its ``data`` decoded into ``_Direct`` (or a
    ``_Failure`` to raise at the batch's position), or None if the task did not complete.
    """
    if fut.cancelled() or fut.exception() is not None:
        return None
    res: _worker.Result = fut.result()
    if not isinstance(res.data, bytes):
        return res
    try:
        return res._replace(data=_Direct(_transport.loads_result(res.data)))
    except (OSError, RuntimeError) as exc:
        # At the descriptor limit, receiving a batch's fd fails with EMFILE, or with
        # multiprocessing's "received 0 items of ancdata" when the fd was dropped.
        if getattr(exc, "errno", None) == errno.EMFILE or "ancdata" in str(exc):
            return res._replace(data=_Failure(_emfile_error(exc)))
        return res._replace(data=_Failure(exc))
    except Exception as exc:
        return res._replace(data=_Failure(exc))
