"""AsyncDataLoader: torch's DataLoader API on an asyncio event loop. Runs in: the event loop.

The loader validates its arguments (through torch's own DataLoader), owns the workers that
outlive an epoch (``persistent_workers=True``) and starts epochs. The data flow of one epoch::

    sampler -> _scheduler -> backend (_executor processes | _backend thread) -> _reorder
            -> _consumer (-> _device) -> the async for body

with its phases and crash handling in ``_epoch`` and ``_recovery``.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import copy
import dataclasses
import enum
import logging
import multiprocessing
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine, Iterable
from multiprocessing.context import BaseContext
from typing import Any, Generic, Literal, NoReturn, Protocol, Self

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    IterDataPipe,
    Sampler,
)
from typing_extensions import TypeVar

from . import _notebook, _worker
from ._arguments import check_int, check_own_settings, check_transform_in, stream_input
from ._attrs import TorchAttributes, check_prefetch_factor
from ._backend import Backend, Launcher
from ._bridge import SyncDataLoader
from ._checkpoint import Order, Pending, batching, epoch_seeds, make_state, resumed_progress
from ._device import DeviceStage
from ._epoch import Epoch
from ._errors import EpochEndedError, LoaderClosedError
from ._phase import Phase
from ._pools import PersistentPool, start_pool, thread_backend
from ._priority import PriorityMonitor
from ._records import Counters, LoaderStats, Plan, PoolKeeper
from ._remote import FetchPolicy
from ._resume import Position, Progress, Start

__all__ = ("AsyncDataLoader", "AsyncMapDataset", "LoaderStats")

#: The batch type: what ``collate_fn`` returns (``Any`` with torch's default collation).
_B = TypeVar("_B", default=Any)
_E = TypeVar("_E")


class AsyncMapDataset(Protocol):
    """A map-style dataset whose ``__getitem__`` is ``async def`` (e.g. fetching over HTTP)."""

    def __getitem__(self, index: Any, /) -> Awaitable[Any]: ...

    def __len__(self) -> int: ...


_logger = logging.getLogger(__name__)


class _State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class AsyncDataLoader(TorchAttributes, Generic[_B]):
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
        worker_nice: Niceness added to each worker process (0-19), fixed. The default (None)
            adapts it: workers run at torch's priority (nice 0) while the event loop's lateness
            stays within its bound or other processes compete for the cores, and at nice 5 while
            the workers themselves make the loop late (see docs/service.md). ``"idle"``: the
            workers run under Linux's ``SCHED_IDLE``, only on a core nothing else wants: the
            loop never waits for one of them, and any other busy process, the consumer's own
            threads included, can starve them. Worker processes only.
        max_worker_restarts: Worker pools the loader may replace per epoch after a worker process
            dies; the batches in flight are resubmitted, so no sample is lost or repeated.
            0 fails at the first crash, as torch does. An index batch that kills its worker twice
            raises :class:`~aioloader.PoisonBatchError` regardless.
        seeding: ``"worker"`` (torch's): each worker seeds ``random``, torch and numpy once, with
            ``base_seed + worker_id``, so random augmentations depend on which worker loaded a
            batch. ``"batch"``: they are seeded before every batch from ``(base_seed, epoch,
            send_idx)``, so the same ``generator`` gives bit-identical batches for any
            ``num_workers`` and after a resume, and in-order loading may use one shared queue
            (a slow batch no longer holds up the batches queued behind it on its worker).
        rank: This process's place in data-parallel training, shown to workers as
            ``get_worker_info().rank`` (for sharding an ``IterableDataset``). Give it with
            ``world_size``. Default: ``torch.distributed``'s when it is initialised, else 0.
        world_size: The number of data-parallel processes, shown to workers as
            ``get_worker_info().world_size``. Default: ``torch.distributed``'s, else 1.
        executor: How the ``num_workers`` workers run (see docs/backends.md). ``"process"``
            (default): worker processes, as torch. ``"thread"``: worker threads of this process,
            each with its own ``get_worker_info()``, for work that releases the GIL; the dataset
            is shared, not copied, and must be thread-safe. ``aioloader.ray.RayWorkers(...)``:
            one Ray actor per worker, anywhere in a Ray cluster. ``num_workers=0`` loads in this
            process whatever the executor.
        transform: Async sources only: a picklable callable applied to each sample before
            ``collate_fn``: in the workers (or the ``num_workers=0`` thread), or on this event
            loop for cheap windows (see ``transform_in``).
        max_batch_latency: Async iterable sources only: seconds after a batch's first sample
            arrived at which the batch closes even if it holds fewer than ``batch_size`` samples.
            ``None`` (the default) closes batches by size alone.
        source_concurrency: Async map-style datasets: at most this many ``__getitem__`` (or
            ``__getitems__``) calls run at once: on the event loop (``fetch_in="loop"``), or in
            each worker, across the batches it has been sent (``fetch_in="workers"``).
        fetch_in: Async map-style datasets: where ``__getitem__`` runs. ``"workers"`` (the
            default when ``num_workers > 0``): in each worker, on an event loop of the
            worker's own, so fetching, ``transform`` and ``collate_fn`` happen in one process
            and no sample's bytes cross this event loop; the dataset must pickle. ``"loop"``
            (the default, and the only choice, with ``num_workers=0``): on this event loop;
            the samples then travel to the workers for ``transform`` and ``collate_fn``.
        fetch_policy: Async map-style datasets: a :class:`~aioloader.FetchPolicy` (per-call
            timeout, retries of transient failures, hedged calls). Default: ``FetchPolicy()``.
        transform_in: Async iterable sources: where a window's ``transform`` and
            ``collate_fn`` run. ``"auto"`` (what None, the default, means): where the workers
            measured the work as cheap, this event loop does it, in steps of at most about
            0.5 ms, with no process hop: as samples arrive while the source keeps the loader
            waiting (lower latency for a paced stream), and for an unpaced source while that
            measures faster than the workers (a machine whose cores are busy); otherwise the
            workers. ``"workers"``: always in
            a worker process, so a crash in them is a worker's. See docs/streaming.md. With
            ``num_workers=0`` everything runs in this process anyway, and it is always
            ``"auto"``.

    The dataset may be an **async source**: an async iterable (an ``async def`` generator, an
    object with ``__aiter__``), read on the event loop and batched by size or time, or a map-style
    dataset whose ``__getitem__``/``__getitems__`` is ``async def``. The source stays in this
    process (an async map-style dataset is fetched by the workers themselves when
    ``fetch_in="workers"``); its samples go to the workers for ``transform`` and
    ``collate_fn``, but for a paced stream's cheap windows, done on this event loop. A dataset
    with ``async def __aenter__``/``__aexit__`` is entered once in each event loop that fetches
    from it, before the first call, and exited when that loop's work ends (a worker's exit; the
    epoch's end on this loop): open its client there. A source with an ``ack(samples)`` method
    (plain or ``async``) is told, batch by batch in delivery order, which samples the consumer
    received, once the consumer asks for the next batch. See ``docs/streaming.md``.

    Example::

        async with AsyncDataLoader(dataset, batch_size=32, shuffle=True, num_workers=4) as loader:
            for epoch in range(3):
                async for batch in loader:
                    ...
    """

    def __init__(
        self,
        dataset: Dataset[Any] | AsyncIterable[Any] | AsyncMapDataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], _B] | None = None,
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
        worker_nice: int | Literal["idle"] | None = None,
        seeding: Literal["worker", "batch"] = "worker",
        rank: int | None = None,
        world_size: int | None = None,
        transform: Callable[[Any], Any] | None = None,
        max_batch_latency: float | None = None,
        source_concurrency: int = 16,
        executor: str | Launcher = "process",
        fetch_in: Literal["workers", "loop"] | None = None,
        fetch_policy: FetchPolicy | None = None,
        transform_in: Literal["workers", "auto"] | None = None,
    ) -> None:
        stream, remote = stream_input(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            sampler=sampler,
            batch_sampler=batch_sampler,
            transform=transform,
            max_batch_latency=max_batch_latency,
            source_concurrency=source_concurrency,
            num_workers=num_workers,
            fetch_in=fetch_in,
            fetch_policy=fetch_policy,
            transform_in=transform_in,
        )
        # torch's own constructor does the validation, picks the default samplers and collate_fn,
        # and starts nothing: workers start only when it is iterated, which we never do.
        torch_loader: DataLoader[Any] = DataLoader(
            # An async source passes torch's checks as a map-style dataset; its sampler is never
            # iterated (an async map-style dataset's is, and indexes it as torch would).
            dataset,  # type: ignore[arg-type]
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
        if num_workers > 0:
            check_prefetch_factor(torch_loader.prefetch_factor, num_workers)
        check_own_settings(
            seeding=seeding,
            worker_nice=worker_nice,
            device_prefetch=device_prefetch,
            max_worker_restarts=max_worker_restarts,
            executor=executor,
            num_workers=num_workers,
            multiprocessing_context=multiprocessing_context,
        )
        self.executor = executor
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither (then torch.distributed's)")
        if world_size is not None:
            check_int("world_size", world_size, 1, None, "a positive int")
            check_int("rank", rank, 0, world_size - 1, f"an int in [0, world_size={world_size})")
        self.worker_nice = worker_nice
        self.seeding = seeding
        self._rank_given: tuple[int, int] | None = None
        if rank is not None and world_size is not None:
            self._rank_given = (rank, world_size)
        with warnings.catch_warnings():
            # Validates `device` now; torch's pin_memory warnings come per epoch, as in torch.
            warnings.simplefilter("ignore")
            DeviceStage(pin_memory=pin_memory, device=device, pin_memory_device=pin_memory_device)
        self.device = device
        self.device_prefetch = device_prefetch
        self.transform = transform
        self.max_batch_latency = max_batch_latency
        self.source_concurrency = source_concurrency
        self.transform_in = transform_in
        self._stream = stream
        # fetch_in="workers": what the workers are sent instead of the bare dataset (see
        # _worker_dataset); None otherwise.
        self._remote = remote
        self._torch = torch_loader
        # An AsyncIterableDataset read on this loop is a stream (its windows go to the workers
        # as Samples), not an IterableDataset the workers iterate.
        self._is_iterable = isinstance(torch_loader.dataset, IterableDataset) and stream is None
        if remote is not None and self._is_iterable and executor == "thread":
            raise ValueError(
                "executor='thread' cannot iterate an IterableDataset's __aiter__ in its workers "
                "(get_worker_info() is per thread, and the iterator runs on another): use worker "
                "processes, or fetch_in='loop'"
            )
        self._is_datapipe = isinstance(torch_loader.dataset, IterDataPipe)
        self.max_worker_restarts = max_worker_restarts
        self._state = _State.OPEN
        self._epoch_no = 0  # epochs started: tags work for crash attribution, never reset
        # Resume: the epoch number the next epoch gets (load_state_dict sets it), the latest
        # epoch's progress, a loaded state waiting for the next epoch, and set_epoch's value.
        self._epoch_count = 0
        self._progress: Progress | None = None
        self._pending: Pending | None = None
        self._sampler_epoch: int | None = None
        # Running epochs; weak, so an epoch whose iterator was dropped can be collected (and so
        # release its workers) while the loader lives on.
        self._epochs: weakref.WeakSet[Epoch] = weakref.WeakSet()
        self._closing: asyncio.Task[None] | None = None
        # persistent_workers=True: the pool kept between epochs, and what it was started from.
        self._pool_owner = PersistentPool()
        # worker_nice=None: the workers' niceness follows the loop's lateness (_priority).
        self._priority: PriorityMonitor | None = None
        # A forked child (a worker, of this or a later loader) inherits this object; if garbage
        # collection frees it there, its pool is the parent's and must be left alone.
        self._pid = os.getpid()
        self._persistent_seed: int | None = None
        self._cleanups: set[asyncio.Task[None]] = set()  # epochs' cleanups; aclose() waits
        self._counters = Counters()  # stats(), added to by the epochs
        # What the epochs ask of this loader; they hold it (and so the loader) weakly.
        self._host = _Host(self)

    # ---------------------------------------------------------------- torch-compatible attributes

    def _torch_loader(self) -> DataLoader[Any]:
        return self._torch

    @property
    def _index_sampler(self) -> Any:
        return self._torch._index_sampler

    def __len__(self) -> int:
        """Batches per epoch, as ``len()`` of torch's DataLoader (an estimate for iterables)."""
        if self._stream is not None and self._stream.kind == "iterable":
            raise TypeError("an async iterable source has no len(): batches close by size or time")
        return len(self._torch)

    def __repr__(self) -> str:
        return (
            f"<AsyncDataLoader dataset={type(self.dataset).__name__} "
            f"batch_size={self.batch_size} num_workers={self.num_workers} "
            f"state={self._state.value}>"
        )

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # IPython's text for a cell's result, which its output history keeps: say so.
        printer.text(repr(self))
        _notebook.warn_if_kept(
            self, self, "await {}.aclose()", "async with AsyncDataLoader(...) as loader:"
        )

    def __iter__(self) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__!r} object is not iterable: it is an async iterable. Use "
            "`async for batch in loader:` inside a coroutine (or top-level `await` in a "
            "notebook), or `for batch in loader.sync():` in synchronous code"
        )

    def sync(self) -> SyncDataLoader[_B]:
        """This loader for synchronous code: ``for batch in loader.sync():``.

        The loader runs on an event loop in one background thread, with the same batches, order
        and errors. Closing the returned :class:`~aioloader.SyncDataLoader` (``with`` or
        ``close()``) closes this loader and ends that thread. Every call returns the same object;
        once bridged, iterate the loader only through it.
        """
        return SyncDataLoader._of(self)

    # -------------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Self:
        _require_asyncio()
        self._check_open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __aiter__(self) -> _EpochIterator[_B]:
        """Start an epoch.

        Without persistent workers each epoch has its own workers, so epochs may overlap (a
        validation loop nested in a training loop). With ``persistent_workers=True`` the workers
        are shared: a new epoch ends the one still running, whose consumer then gets
        :class:`~aioloader.EpochEndedError`.
        """
        self._check_open()
        _require_asyncio()
        plan = self._plan()
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # This process is a spawn/forkserver worker still importing the main module: the
            # script iterates a loader at import time. Say so in one line here, before the start
            # fails deep inside multiprocessing with a long traceback per worker.
            raise RuntimeError(
                "aioloader: a loader is iterated while a worker process imports the main module "
                "(spawn/forkserver start methods re-import it in every worker); create and "
                "iterate loaders only under `if __name__ == '__main__':`"
            )
        for message in self._pin_memory_warnings():
            warnings.warn(message, stacklevel=2)
        persistent = self._persistent
        if persistent:
            for older in list(self._epochs):
                older.end(
                    Phase.ENDED,
                    EpochEndedError(
                        f"epoch {older.epoch_no} was ended because epoch {self._epoch_no} started "
                        "on the same loader, and persistent_workers=True shares one set of "
                        "workers between epochs. Finish (or break out of) an epoch before the "
                        "next, or use persistent_workers=False (each epoch gets its own "
                        "workers) or a second loader for nested loops."
                    ),
                )
        pending, self._pending = self._pending, None
        progress = self._begin_progress(plan, pending)
        start = progress.start
        base_seed, shared_seed = epoch_seeds(
            start,
            plan.generator,
            resuming=pending is not None,
            datapipe=self._is_datapipe,
            kept_seed=self._persistent_seed if persistent else None,
            workers=plan.num_workers > 0,
        )
        if persistent:
            self._persistent_seed = base_seed
        fetcher = None
        if plan.num_workers == 0 and plan.is_iterable and plan.stream is None:
            # As torch (and torchdata) with num_workers=0: the dataset's iterator is made now, in
            # iter(loader), after the base seed was drawn; its first batch is loaded from it. A
            # state taken before that batch reads it (and the dataset) when it is taken.
            try:
                fetcher = _worker.make_fetcher(
                    True,
                    plan.worker_dataset,
                    plan.batch_sampler_given,
                    plan.collate_fn,
                    plan.drop_last,
                    progress.worker_states.get(0),
                    shared_seed,
                )
            except BaseException:
                self._pending = pending  # not started: the next `async for` resumes instead
                raise
            progress.start_fetcher = fetcher
        epoch = Epoch(
            plan,
            self._host,
            self._counters,
            self._epoch_no,
            base_seed,
            progress,
            replay=pending is not None,
            shared_seed=shared_seed,
        )
        if pending is not None and self._is_iterable:
            epoch.resume_states = dict(progress.worker_states)
        if fetcher is not None:
            epoch.resume_states[0] = ("fetcher", fetcher)
        self._epoch_no += 1
        self._epochs.add(epoch)
        return _EpochIterator(epoch, self)

    #: The pin_memory warnings were given (once per loader, as torch's persistent iterator does).
    _pin_warned = False

    def _pin_memory_warnings(self) -> list[str]:
        """torch's pin_memory warnings for the next epoch, the first time they apply only.

        The bridge gives them on its caller's thread, pointing at the caller's ``for`` line.
        """
        messages = []
        if self.pin_memory and self.pin_memory_device:
            messages.append(
                "pin_memory_device is deprecated, the current accelerator will be used as the "
                f"device,ignore pin_memory_device='{self.pin_memory_device}'."
            )
        if self.pin_memory and not torch.accelerator.is_available():
            messages.append(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used."
            )
        if self._pin_warned:
            return []
        self._pin_warned = bool(messages)
        return messages

    def _plan(self) -> Plan:
        """The settings the next epoch runs from, checked as torch checks them.

        Settable attributes (``num_workers``, ``prefetch_factor``, ``timeout``, ...) may have
        changed since construction; a bad value fails here, before anything starts.
        """
        workers = self.num_workers
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 0:
            raise ValueError(
                "num_workers option should be non-negative; use num_workers=0 to disable "
                "multiprocessing."
            )
        timeout = self.timeout
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            raise ValueError("timeout option should be non-negative")
        prefetch = self.prefetch_factor
        check_prefetch_factor(prefetch, workers)
        if self._remote is not None and workers == 0:
            raise ValueError(
                "fetch_in='workers' fetches in the worker processes, and num_workers is now 0: "
                "set num_workers > 0, or make the loader with fetch_in='loop'"
            )
        # aioloader's own settings are plain attributes: checked here as in the constructor.
        seeding = self.seeding
        check_own_settings(
            seeding=seeding,
            worker_nice=self.worker_nice,
            device_prefetch=self.device_prefetch,
            max_worker_restarts=self.max_worker_restarts,
            executor=self.executor,
            num_workers=workers,
            multiprocessing_context=self.multiprocessing_context,
        )
        DeviceStage(pin_memory=False, device=self.device)  # checks the device
        stream = self._stream
        if stream is not None:
            # transform, max_batch_latency and source_concurrency may have been set since.
            torch_iterable = isinstance(stream.source, IterableDataset)
            stream, _ = stream_input(
                stream.source,
                batch_size=stream.batch_size,
                shuffle=None,
                sampler=None,
                batch_sampler=None,
                transform=self.transform,
                max_batch_latency=self.max_batch_latency,
                source_concurrency=self.source_concurrency,
                num_workers=workers,
                fetch_in="loop" if stream.kind == "map" or torch_iterable else None,
                fetch_policy=stream.policy if stream.kind == "map" else None,
                transform_in=self.transform_in,
            )
        elif self._remote is not None:
            check_transform_in(self.transform_in)
            check_int(
                "source_concurrency",
                self.source_concurrency,
                1,
                None,
                "a positive int (requests in flight per worker)",
            )
            for name, value in (
                ("max_batch_latency", self.max_batch_latency),
                ("transform_in", self.transform_in if self.transform_in == "auto" else None),
            ):
                if value is not None:
                    raise ValueError(
                        f"{name} applies to a stream read on this event loop; this loader "
                        "fetches in the workers (fetch_in='workers')"
                    )
        elif (
            self.transform is not None
            or self.max_batch_latency is not None
            or self.transform_in not in (None, "workers")
        ):
            stream_input(  # raises: they apply to async sources only
                self.dataset,
                batch_size=None,
                shuffle=None,
                sampler=None,
                batch_sampler=None,
                transform=self.transform,
                max_batch_latency=self.max_batch_latency,
                source_concurrency=self.source_concurrency,
                num_workers=workers,
                fetch_in=None,
                fetch_policy=None,
                transform_in=self.transform_in,
            )
        in_order = bool(self.in_order)
        torch_loader = self._torch
        promised = torch_loader._IterableDataset_len_called if self._is_iterable else None
        in_flight = prefetch * workers if prefetch is not None and workers > 0 else 1
        if stream is not None and stream.kind == "map":
            # Fetched on this loop, where a batch costs latency, not CPU: enough batches in
            # flight to keep source_concurrency requests going (one more to cover the gap
            # while the consumer takes a batch), as a worker's look-ahead does.
            per_batch = self.batch_size or getattr(self.batch_sampler, "batch_size", None)
            if isinstance(per_batch, int) and per_batch > 0:
                in_flight = max(in_flight, -(-self.source_concurrency // per_batch) + 1)
            else:  # a batch sampler of unknown batch size: as torch's default prefetch
                in_flight = max(in_flight, 2)
        rank, world_size = self._rank_given or _distributed_rank()
        return Plan(
            num_workers=workers,
            max_in_flight=in_flight,
            in_order=in_order,
            timeout=timeout,  # as given: torch says "after 1 seconds" for timeout=1
            batch_size=self.batch_size,
            drop_last=bool(self.drop_last),
            seeding=seeding,
            # Which worker loads a batch decides its random augmentations (each worker's RNG is
            # one stream seeded base_seed + worker_id). In order, batches go to workers
            # round-robin as in torch, so a fixed generator reproduces torch's batches exactly.
            # in_order=False gives up that determinism anyway, so there all workers share one
            # queue and a slow batch never holds up the ones queued behind it on the same
            # worker. With seeding="batch" the worker does not matter, so in order needs no
            # round-robin.
            pinned_workers=self._is_iterable or (in_order and seeding == "worker"),
            is_iterable=self._is_iterable,
            persistent=self._persistent,
            pin_memory=bool(self.pin_memory),
            pin_memory_device=self.pin_memory_device,
            device=self.device,
            device_prefetch=self.device_prefetch,
            max_worker_restarts=self.max_worker_restarts,
            index_sampler=self._index_sampler,
            batch_sampler_given=self.batch_sampler is not None,
            one_shot_sampler=self._one_shot_sampler(),
            stream=stream,
            worker_dataset=self._worker_dataset(),
            collate_fn=self.collate_fn,
            worker_init_fn=self.worker_init_fn,
            mp_context=self._mp_context(),
            executor=self.executor,
            worker_nice=self.worker_nice,
            rank=rank,
            world_size=world_size,
            lane_depth=max(2, in_flight // max(1, workers)) if self._remote is not None else 2,
            generator=self.generator,
            dataset_repr=str(self.dataset) if promised is not None else "",
            len_promised=promised,
        )

    def _check_open(self) -> None:
        if self._state is _State.CLOSED:
            raise _closed_error()

    def _is_closed(self) -> bool:
        return self._state is _State.CLOSED

    # ----------------------------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """Where the consumer stands: load it into a new loader to go on from exactly here.

        Describes the batches the consumer has *received* (batches in flight or buffered are not
        counted: they are loaded again after a resume). Callable at any time: before the first
        epoch, between batches, after an epoch ended, right after :meth:`load_state_dict` (then
        it returns the loaded state). A plain dict, JSON-serialisable when the sampler's and the
        dataset's own states are; O(1) per batch to keep, and cheap to take.

        Raises:
            ValueError: an ``IterableDataset`` delivered batches this epoch but neither it nor
                its iterator has ``state_dict()``/``load_state_dict()``, so its position cannot
                be saved.
        """
        self._refuse_stream_resume("state_dict")
        if self._pending is not None:
            return self._pending.to_dict()
        p = self._progress
        if p is None or p.finished:
            return self._boundary_state(0 if p is None else p.epoch + 1)
        if p.iterable and p.stateless:
            raise ValueError(
                f"cannot save the position of {type(self.dataset).__name__}: an IterableDataset "
                "is resumed from its own state, so implement state_dict() and load_state_dict() "
                "on the dataset (or on the iterator its __iter__ returns), returning where it "
                "stands; aioloader saves it per worker after each delivered batch"
            )
        worker_states = p.worker_states
        if p.start_fetcher is not None and not p.position.count and not worker_states:
            # num_workers=0, nothing received yet: the epoch's iterator (and dataset) as they
            # are now, as torchdata reads them.
            state = _worker.capture_state(p.start_fetcher, self.dataset)
            worker_states = {0: copy.deepcopy(state)} if state is not None else {}
        return self._make_state(
            p.epoch, p.start, p.position, worker_states, p.last_worker, p.worker_batches
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``async for`` continue where ``state`` (from :meth:`state_dict`) stood.

        The batches delivered next are those the interrupted run would have delivered next:
        same indices, same order, none skipped or repeated; a state taken after an epoch ended
        starts the next epoch. Restores the ``generator``'s (and the sampler's) random state and
        the sampler's ``set_epoch``. Works across a change of ``num_workers`` for map-style
        datasets; an ``IterableDataset`` needs the same ``num_workers``.

        Raises:
            RuntimeError: an epoch of this loader is running (or was started with ``aiter()``
                and not finished): load before the next ``async for``.
            ValueError: ``state`` is not a state of this kind of loader.
        """
        if self._state is _State.CLOSED:
            raise _closed_error()
        self._refuse_stream_resume("load_state_dict")
        running = [e for e in list(self._epochs) if not e.terminal]
        if running:
            raise RuntimeError(
                f"load_state_dict() was called while epoch {running[0].epoch_no} of this loader "
                "is running (an `async for`, or an aiter() not yet exhausted); call it before the "
                "next `async for`, or break out of the running one first"
            )
        self._pending = Pending.parse(
            state,
            iterable=self._is_iterable,
            num_workers=self.num_workers,
            sampling={**self._batching(), "seeding": self.seeding},
            persistent=self._persistent,
        )
        if self._pending.persistent_seed is not None:
            self._persistent_seed = self._pending.persistent_seed
        # Persistent workers kept from an earlier epoch hold their replicas and RNGs as that
        # epoch left them, not as the state says: the next epoch starts new ones, as a new
        # loader would (torchdata's load_state_dict drops its iterator and workers too).
        self._pool_owner.invalidate()

    def _refuse_stream_resume(self, what: str) -> None:
        if self._stream is not None:
            raise ValueError(
                f"{what}() is not supported for an async source: its position is the source's "
                "own (an at-least-once source with ack(), such as RedisStreamSource, delivers "
                "again what was not acknowledged when it restarts)"
            )

    def set_epoch(self, epoch: int) -> None:
        """Call ``set_epoch(epoch)`` on the sampler and batch sampler that have it (e.g.
        ``DistributedSampler``, to reshuffle each epoch). Part of :meth:`state_dict`."""
        check_int("epoch", epoch, 0, None, "a non-negative int")
        self._order().set_epoch(epoch)
        self._sampler_epoch = epoch

    def _order(self) -> Order:
        return Order(self.sampler, self.batch_sampler, self._index_sampler, self.generator)

    def _carried_states(self, plan: Plan | None = None) -> dict[int, Any]:
        """Iterable datasets: the worker states the next epoch (of ``plan``, else of the
        settings as they are) starts from, where the dataset lives on between epochs (torch's
        behaviour, which a resume must reproduce).

        With ``num_workers=0`` that is the dataset itself, as it is now; with persistent workers,
        each replica as its iterator left it at the last epoch's end (when that epoch finished
        and its pool serves the next one). Fresh workers start from the dataset as pickled.
        """
        if not self._is_iterable:
            return {}
        if self.num_workers == 0:
            state = _worker.capture_end_state(self.dataset)
            return {0: copy.deepcopy(state)} if state is not None else {}
        p = self._progress
        if p is None or not p.finished or self._pool_owner.pool is None:
            return {}
        if plan is None:
            try:
                plan = self._plan()
            except (ValueError, TypeError):  # settings the next epoch refuses: no pool serves it
                return {}
        if not self._pool_owner.serves(plan, self._persistent_seed):
            return {}
        return dict(p.end_states)

    def _begin_progress(self, plan: Plan, pending: Pending | None) -> Progress:
        if pending is None:
            progress = Progress(
                self._epoch_count,
                self._order().snapshot(self._sampler_epoch),
                # num_workers=0: taken in __aiter__, once the epoch's own draws are done.
                worker_states=self._carried_states(plan) if self.num_workers else {},
                iterable=self._is_iterable,
            )
        else:
            progress = resumed_progress(pending, self._order(), iterable=self._is_iterable)
            if pending.start.sampler_epoch is not None:
                self._sampler_epoch = pending.start.sampler_epoch
        self._epoch_count = progress.epoch + 1
        self._progress = progress
        return progress

    def _boundary_state(self, epoch: int) -> dict[str, Any]:
        start = self._order().snapshot(self._sampler_epoch)
        return self._make_state(epoch, start, Position(), self._carried_states(), None)

    def _make_state(
        self,
        epoch: int,
        start: Start,
        position: Position,
        worker_states: dict[int, Any],
        last_worker: int | None,
        worker_batches: dict[int, int] | None = None,
    ) -> dict[str, Any]:
        return make_state(
            epoch=epoch,
            start=start,
            position=position,
            worker_states=worker_states,
            last_worker=last_worker,
            worker_batches=worker_batches,
            iterable=self._is_iterable,
            num_workers=self.num_workers,
            seeding=self.seeding,
            batching=self._batching(),
            persistent_seed=self._persistent_seed if self._persistent else None,
        )

    def _batching(self) -> dict[str, Any]:
        return batching(self.batch_size, self.drop_last, self.sampler)

    @property
    def _persistent(self) -> bool:
        return bool(self.persistent_workers) and self.num_workers > 0

    def _check_loop(self, loop: asyncio.AbstractEventLoop, what: str) -> None:
        """Refuse to run on ``loop`` while an epoch of this loader runs on another live loop.

        Consecutive loops (one ``asyncio.run`` after another) are fine: every epoch belongs to
        the loop that started it and ends with it. Two loops at once (threads) are not: epochs
        and ``aclose()`` would wait on each other's tasks across loops.
        """
        for epoch in list(self._epochs):
            other = epoch.loop
            if other is not None and other is not loop and not other.is_closed():
                raise RuntimeError(
                    f"aioloader: cannot {what} on this event loop while epoch {epoch.epoch_no} of "
                    "the same AsyncDataLoader is running on another event loop (another thread's "
                    "asyncio.run()). A loader serves one event loop at a time: finish or "
                    "aclose() it on the first loop, or create one loader per event loop."
                )

    def _track_cleanup(self, task: asyncio.Task[None]) -> None:
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def aclose(self) -> None:
        """End every running epoch and stop every worker process and thread. Safe to call twice.

        A consumer waiting for a batch gets :class:`~aioloader.LoaderClosedError`. Returns when
        every worker and helper thread is gone, also when called from several tasks at once. If
        this await is cancelled the shutdown goes on, and a later ``aclose()`` waits for it.
        """
        if self._closing is None:
            _require_asyncio()
            self._check_loop(asyncio.get_running_loop(), "aclose() the loader")
            self._state = _State.CLOSED
            for epoch in list(self._epochs):
                epoch.end(
                    Phase.ENDED,
                    LoaderClosedError(
                        "the loader was closed (aclose()) while this epoch was running"
                    ),
                )
            self._closing = asyncio.get_running_loop().create_task(
                self._close(), name="aioloader-close"
            )
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        cancelled: asyncio.CancelledError | None = None
        # asyncio.wait, not gather: a cancellation here must not cancel the cleanups.
        while self._cleanups:
            tasks = list(self._cleanups)
            try:
                await asyncio.wait(tasks)
            except asyncio.CancelledError as exc:  # asyncio.run exiting: finish regardless
                cancelled = exc
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    _logger.error("aioloader: an epoch's cleanup failed", exc_info=task.exception())
        if self._priority is not None:
            self._priority.pause()
        try:
            await self._pool_owner.close()
        except asyncio.CancelledError as exc:
            cancelled = exc
        if cancelled is not None:
            raise cancelled

    def __del__(self) -> None:
        owner: PersistentPool | None = getattr(self, "_pool_owner", None)
        pool = owner.pool if owner is not None else None
        if pool is not None and getattr(self, "_pid", None) == os.getpid():
            warnings.warn(
                f"{self!r} was not closed; use `async with` or `await loader.aclose()`",
                ResourceWarning,
                stacklevel=2,
            )
            if sys.is_finalizing():
                # No thread can start now (3.11 waits for it for ever, 3.12+ raises): kill the
                # processes here, without waiting for anything.
                pool.kill_at_exit()
                return
            # Killing and joining takes a while: never on the caller's thread (often the loop).
            threading.Thread(target=pool.kill_sync, name="aioloader-reap", daemon=True).start()

    # ----------------------------------------------------------------------------------- pools

    def _mp_context(self) -> BaseContext:
        ctx = self.multiprocessing_context
        return ctx if ctx is not None else multiprocessing.get_context()

    def _worker_dataset(self) -> Any:
        """What the workers hold: the dataset, or for an async source its per-sample transform
        (the source itself stays on the loop and need not pickle), or for ``fetch_in="workers"``
        the async dataset with how to call it."""
        if self._stream is not None:
            return _worker.SampleCollator(self.transform)
        if self._remote is not None:
            return dataclasses.replace(
                self._remote,
                dataset=self.dataset,
                concurrency=self.source_concurrency,
                transform=self.transform,
            )
        return self.dataset

    @property
    def fetch_in(self) -> str | None:
        """Where an async map-style dataset's ``__getitem__`` (or an ``IterableDataset``'s
        ``__aiter__``) runs: ``"workers"`` (each worker, on an event loop of its own) or
        ``"loop"`` (this event loop); None for other datasets. Fixed at construction."""
        if self._remote is not None:
            return "workers"
        if self._stream is not None and (
            self._stream.kind == "map" or isinstance(self.dataset, IterableDataset)
        ):
            return "loop"
        return None

    @property
    def fetch_policy(self) -> FetchPolicy | None:
        """Timeouts, retries and hedging of an async map-style dataset's calls; None for other
        datasets. Fixed at construction."""
        if self._remote is not None and not self._is_iterable:
            return self._remote.policy
        if self._stream is not None and self._stream.kind == "map":
            return self._stream.policy
        return None

    async def _acquire_backend(self, plan: Plan, base_seed: int) -> tuple[Backend, bool]:
        """(backend, owned by the epoch). Persistent workers: the pool owner's."""
        if plan.num_workers == 0:
            return thread_backend(plan), True
        if not plan.persistent:
            pool = await start_pool(plan, base_seed)
            self._watch_priority(pool)
            return pool, True
        pool = await self._pool_owner.acquire(plan, base_seed)
        self._watch_priority(pool)
        return pool, False

    def _watch_priority(self, backend: Backend) -> None:
        """worker_nice=None: renice ``backend``'s worker processes as the loop's lateness says,
        while an epoch of this loader runs (see _priority)."""
        pids = getattr(backend, "pids", None)
        if self.worker_nice is not None or pids is None:
            return
        if self._priority is None:
            ref = weakref.ref(self)
            self._priority = PriorityMonitor(_running_epochs(ref), _waited(ref))
        with contextlib.suppress(RuntimeError):  # no running loop: nothing to sample on
            self._priority.watch(pids)

    def _backend_replaced(self, old: Backend, new: Backend) -> None:
        """Crash recovery replaced ``old``: a persistent pool is now ``new``."""
        self._pool_owner.replaced(old, new)
        self._watch_priority(new)

    def _one_shot_sampler(self) -> bool:
        return any(
            isinstance(s, collections.abc.Iterator) for s in (self.sampler, self.batch_sampler)
        )

    # ----------------------------------------------------------------------------------- stats

    def stats(self) -> LoaderStats:
        """Counters since construction; cheap enough to call every batch."""
        c = self._counters
        now = time.perf_counter()
        elapsed = (now - c.first_request) if c.first_request is not None else 0.0
        workers = max(1, self.num_workers)
        return LoaderStats(
            batches_delivered=c.batches,
            samples_delivered=c.samples,
            wait_s=c.wait_s,
            data_stall_fraction=(c.wait_s / elapsed) if elapsed > 0 else 0.0,
            batches_in_flight=sum(e.in_flight_count() for e in list(self._epochs)),
            worker_busy_fraction=min(1.0, c.busy_s / (elapsed * workers)) if elapsed else 0.0,
            worker_restarts=c.restarts,
            time_to_first_batch_s=c.ttfb,
        )


class _Host:
    """The loader as its epochs see it (:class:`~aioloader._records.Host`).

    Holds the loader weakly, as the epochs hold this: an epoch's reference cycles must not keep
    a dropped loader, and its persistent workers, alive until a garbage collection.
    """

    __slots__ = ("__weakref__", "_ref")

    def __init__(self, loader: AsyncDataLoader[Any]) -> None:
        self._ref = weakref.ref(loader)

    def _loader(self) -> AsyncDataLoader[Any]:
        loader = self._ref()
        if loader is None:
            raise RuntimeError("aioloader bug: an epoch outlived its loader and its iterator")
        return loader

    async def acquire_backend(self, plan: Plan, base_seed: int) -> tuple[Backend, bool]:
        return await self._loader()._acquire_backend(plan, base_seed)

    def pool_keeper(self) -> PoolKeeper:
        return self._loader()._pool_owner

    def backend_replaced(self, old: Backend, new: Backend) -> None:
        self._loader()._backend_replaced(old, new)

    def epoch_ended(self, epoch: object) -> None:
        loader = self._ref()
        if loader is not None:
            loader._epochs.discard(epoch)  # type: ignore[arg-type]
            if loader._priority is not None and not _running_epochs(self._ref)():
                loader._priority.pause()

    def track_cleanup(self, task: asyncio.Task[None]) -> None:
        self._loader()._track_cleanup(task)

    def check_loop(self, loop: asyncio.AbstractEventLoop, what: str) -> None:
        self._loader()._check_loop(loop, what)

    def favor_loop(self, on: bool) -> None:
        loader = self._ref()
        if loader is not None and loader._priority is not None:
            loader._priority.favor_loop(on)

    def favor_pending(self) -> bool:
        loader = self._ref()
        return (
            loader is not None and loader._priority is not None and loader._priority.favor_pending()
        )


def _waited(ref: weakref.ref[AsyncDataLoader[Any]]) -> Callable[[], float]:
    """Seconds the consumer of the loader behind ``ref`` has waited for data (weakly)."""

    def waited() -> float:
        loader = ref()
        return loader._counters.waited() if loader is not None else 0.0

    return waited


def _running_epochs(ref: weakref.ref[AsyncDataLoader[Any]]) -> Callable[[], bool]:
    """Whether the loader behind ``ref`` has an epoch running (weakly: the loop's timer holds
    the priority monitor, which must not keep a dropped loader alive)."""

    def running() -> bool:
        loader = ref()
        return loader is not None and any(not e.terminal for e in list(loader._epochs))

    return running


class _EpochIterator(Generic[_E]):
    """What ``async for`` holds. Dropping it (``break``) ends the epoch and frees its workers.

    One task at a time may await ``__anext__``, as with an async generator: a second concurrent
    call raises ``RuntimeError`` (two tasks that each want every batch each run their own
    ``async for``; to share one epoch's batches, hand them out through an ``asyncio.Queue``).
    """

    def __init__(self, epoch: Epoch, loader: AsyncDataLoader[Any]) -> None:
        self._epoch = epoch
        self._loader = loader  # the epoch holds it weakly
        self._awaited = False
        self._pid = os.getpid()  # see AsyncDataLoader._pid

    def __aiter__(self) -> _EpochIterator[_E]:
        return self

    def __anext__(self) -> Coroutine[Any, Any, _E]:
        return _next(self, self._epoch.consumer.next())

    async def aclose(self) -> None:
        """End this epoch now: cancel outstanding work and release its workers."""
        epoch = self._epoch
        epoch.end(Phase.ENDED)
        await epoch.wait_cleanup()

    def end_now(self) -> None:
        """End this epoch; its cleanup releases the workers in the background (on this loop),
        and the loader's next epoch and ``aclose()`` wait for it."""
        self._epoch.end(Phase.ENDED)

    def __del__(self) -> None:
        epoch = getattr(self, "_epoch", None)
        if epoch is not None and getattr(self, "_pid", None) == os.getpid():
            epoch.end(Phase.ENDED)


async def _next(iterator: _EpochIterator[Any], step: Coroutine[Any, Any, Any]) -> Any:
    """One ``__anext__``: the iterator stays alive while it runs, but not in a traceback.

    ``anext(aiter(loader))`` holds the iterator only through this frame, so it must not be
    freed (and the epoch ended) before the batch arrives. An error's traceback, though, keeps
    this frame, and a notebook keeps the last traceback (``sys.last_traceback``): the reference
    is dropped before the error leaves, so an interrupted or failed cell releases its workers.
    """
    if iterator._awaited:
        step.close()
        raise RuntimeError(
            "aioloader: __anext__ is already being awaited on this epoch's iterator by another "
            "task; one iterator serves one consumer at a time. For every batch in each task, give "
            "each task its own `async for batch in loader` (without persistent workers, epochs "
            "run side by side); to split one epoch's batches between tasks, have one task "
            "iterate and put them on an asyncio.Queue."
        )
    iterator._awaited = True
    try:
        return await step
    except asyncio.CancelledError as exc:
        # An interrupt (a notebook's, an outer timeout): where the loader was waiting is not
        # the caller's business. Dropped here, and re-raised bare (which adds no frame), the
        # traceback shows the caller's frames only.
        exc.__traceback__ = None
        raise
    finally:
        iterator._awaited = False
        del iterator


def _require_asyncio() -> None:
    """Raise a clear error unless an asyncio event loop runs in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return
    trio: Any = sys.modules.get("trio")
    in_trio = trio is not None and trio.lowlevel.in_trio_run()
    library = "trio (through anyio's trio backend, or trio itself)" if in_trio else "none"
    raise RuntimeError(
        f"aioloader needs an asyncio event loop (asyncio.run, uvloop, anyio's asyncio backend or "
        f"a notebook's top-level await); event loop running here: {library}. Iterate the loader "
        "with `async for` in a coroutine that asyncio runs (under anyio: "
        "anyio.run(main, backend='asyncio')), or use `for batch in loader.sync():` in "
        "synchronous code"
    )


def _closed_error() -> LoaderClosedError:
    return LoaderClosedError(
        "this loader was closed; create a new AsyncDataLoader to iterate again"
    )


def _distributed_rank() -> tuple[int, int]:
    """``torch.distributed``'s rank and world size when it is initialised, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
