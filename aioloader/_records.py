"""The records that cross stages, and the narrow interfaces between the loader and its epochs.

Runs in: the event loop. Imports no stage: the loader (``_loader``) builds a :class:`Plan` once per
``async for`` and hands it, with its :class:`Counters` and itself as the epoch's :class:`Host`, to
the epoch (``_epoch``), which wires the stages (``_scheduler``/``_stream`` -> the backend ->
``_reorder`` -> ``_consumer``, with ``_recovery`` beside them). Each stage reads the plan, never
the loader, so a setter called while an epoch runs reaches the next epoch, not this one half-way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ._remote import FetchPolicy
from ._worker import Extra

if TYPE_CHECKING:
    import asyncio

    import torch

    from ._backend import Backend, Launcher

__all__ = (
    "Counters",
    "Failure",
    "Flight",
    "Host",
    "LoaderStats",
    "Plan",
    "PoolKeeper",
    "StreamInput",
)


class Failure(NamedTuple):
    """An exception to raise at this batch's position."""

    exc: BaseException


class Flight(NamedTuple):
    """One submitted index batch: its indices, the worker it is pinned to, its future."""

    indices: Any
    worker_id: int | None
    future: Future[Any] | None
    #: ``seeding="batch"``: the batch's seed, sent with it (again on a resubmission).
    seed: int | None = None
    #: An iterable worker's first batch of a resumed epoch: the dataset state to load first.
    resume: Any = None
    #: An ``IterDataPipe``'s shared seed for the epoch (sent with every batch: any worker, a
    #: replacement after a crash included, may start its epoch's iterator with this one).
    shared_seed: int | None = None

    def task(self) -> Any:
        """What the backend is given as the indices."""
        if self.seed is None and self.resume is None and self.shared_seed is None:
            return self.indices
        return Extra(self.indices, self.seed, self.resume, self.shared_seed)


class StreamInput:
    """A loader's async source and how it is read; validated once, in the loader's constructor."""

    def __init__(
        self,
        source: Any,
        kind: str,
        *,
        max_batch_latency: float | None,
        source_concurrency: int,
        batch_size: int | None,
        transformed: bool = False,
        policy: FetchPolicy | None = None,
        transform_in: str = "auto",
    ) -> None:
        self.source = source
        #: ``"auto"``: a paced stream's cheap windows may be loaded on the loop (``_looplane``).
        self.transform_in = transform_in
        #: How an async map-style dataset's calls are made (timeouts, retries, hedging).
        self.policy = policy if policy is not None else FetchPolicy()
        #: A ``transform`` runs per sample in the workers: worth starting on a window early.
        self.transformed = transformed
        self.kind = kind
        self.max_batch_latency = max_batch_latency
        self.source_concurrency = source_concurrency
        self.batch_size = batch_size
        ack = getattr(source, "ack", None)
        self.ack: Callable[[list[Any]], Any] | None = ack if callable(ack) else None


@dataclass(frozen=True, slots=True)
class Plan:
    """What one epoch runs from: the loader's settings when its ``async for`` began, checked.

    Built by the loader in ``__aiter__``; a bad value set on the loader since construction fails
    there, with torch's error, rather than inside a running epoch.
    """

    num_workers: int
    #: Batches submitted and not yet received, at most: ``prefetch_factor * num_workers`` (1
    #: without workers).
    max_in_flight: int
    in_order: bool
    timeout: float
    batch_size: int | None
    drop_last: bool
    seeding: str
    #: Batches go to workers round-robin (torch's order), not to a shared queue.
    pinned_workers: bool
    is_iterable: bool
    #: Workers kept between epochs (``persistent_workers`` with ``num_workers > 0``).
    persistent: bool
    pin_memory: bool
    pin_memory_device: str
    device: Any
    device_prefetch: int
    max_worker_restarts: int
    #: torch's sampler of index batches (or of indices, when batching is off).
    index_sampler: Any
    #: A ``batch_sampler`` was given: its lists are the batches as they are.
    batch_sampler_given: bool
    #: The sampler is a one-shot iterator (an empty later epoch is then an error).
    one_shot_sampler: bool
    stream: StreamInput | None
    #: What the workers get: the dataset (or an async source's per-sample transform), ...
    worker_dataset: Any
    collate_fn: Any
    worker_init_fn: Callable[[int], None] | None
    mp_context: BaseContext
    executor: str | Launcher
    #: Niceness added to each worker process.
    worker_nice: int | str | None
    #: This process's place in data-parallel training, as the workers' ``get_worker_info()``.
    rank: int
    world_size: int
    #: Tasks written ahead to each pinned worker (``WorkerSpec.lane_depth``).
    lane_depth: int
    #: What the epoch's base seed (and an IterDataPipe's shared seed) are drawn from.
    generator: torch.Generator | None
    #: The dataset's ``repr`` and the length torch's ``len()`` promised for an IterableDataset
    #: (its warning when more samples come; torch reads it when the iterator is created).
    dataset_repr: str
    len_promised: int | None


class Counters:
    """The loader's lifetime counters (``stats()``), added to by its epochs."""

    __slots__ = (
        "batches",
        "busy_s",
        "first_request",
        "restarts",
        "samples",
        "ttfb",
        "wait_s",
        "waiting_since",
    )

    def __init__(self) -> None:
        self.batches = 0
        self.samples = 0
        self.wait_s = 0.0
        self.busy_s = 0.0
        self.restarts = 0
        self.ttfb: float | None = None
        self.first_request: float | None = None
        #: When the consumer's wait for its current batch began (perf_counter); None: not
        #: waiting now.
        self.waiting_since: float | None = None

    def waited(self) -> float:
        """Seconds the consumer has waited for data, its wait in progress included."""
        since = self.waiting_since
        return self.wait_s + (time.perf_counter() - since if since is not None else 0.0)

    def note_request(self, now: float) -> None:
        """The first batch request of the loader's life (the start of the consumer's first
        wait, ``now``) starts the clock of its fractions."""
        if self.first_request is None:
            self.first_request = now


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


class PoolKeeper(Protocol):
    """What an epoch may do with its loader's persistent pool (``_pools.PersistentPool``): the
    epoch judges whether the pool came through healthy, the keeper holds the pool."""

    def keep(self, *, busy: bool) -> None:
        """The epoch ended with the pool healthy: it serves the next epoch."""
        ...

    def retire(self, pool: Backend) -> None:
        """The epoch ended with ``pool`` broken: the next epoch starts new workers."""
        ...

    def detach(self) -> Backend | None:
        """Take the kept pool away for the caller to kill (its event loop is going away)."""
        ...


class Host(Protocol):
    """What an epoch asks of the loader that started it: workers, and word of its end.

    The loader's :class:`PoolKeeper` keeps a persistent pool between epochs; everything else an
    epoch needs is in its :class:`Plan`.
    """

    async def acquire_backend(self, plan: Plan, base_seed: int) -> tuple[Backend, bool]:
        """(workers for the epoch, whether the epoch owns them): a persistent pool is the
        keeper's."""
        ...

    def pool_keeper(self) -> PoolKeeper:
        """The keeper of the loader's persistent pool."""
        ...

    def backend_replaced(self, old: Backend, new: Backend) -> None:
        """Crash recovery replaced ``old`` (a persistent pool is now ``new``)."""
        ...

    def epoch_ended(self, epoch: object) -> None:
        """The epoch reached a terminal phase."""
        ...

    def track_cleanup(self, task: asyncio.Task[None]) -> None:
        """``aclose()`` waits for this cleanup task."""
        ...

    def check_loop(self, loop: asyncio.AbstractEventLoop, what: str) -> None:
        """Refuse ``loop`` while another epoch of the loader runs on another live loop."""
        ...

    def favor_loop(self, on: bool) -> None:
        """The epoch's loop lane runs windows of an unpaced stream beside the workers (on), or
        no longer (off); calls come in pairs. The workers' priority may follow (``_priority``)."""
        ...

    def favor_pending(self) -> bool:
        """Whether the lowering asked for with :meth:`favor_loop` still waits to learn whether
        the machine is shared (False without an adaptive priority)."""
        ...
