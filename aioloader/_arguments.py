"""The loader's own arguments, checked in one place. Runs in: the caller's thread.

torch's ``DataLoader`` checks the arguments the two loaders share (the constructor builds one and
keeps it). What is aioloader's alone is checked here, by ``AsyncDataLoader.__init__`` and again
by every epoch's plan, since each is a settable attribute: the same check and message both times.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from torch.utils.data import IterableDataset

from ._records import StreamInput
from ._remote import InWorkers, check_no_client, check_policy
from ._stream import check_latency, source_kind

__all__ = (
    "check_executor",
    "check_int",
    "check_own_settings",
    "check_transform_in",
    "check_worker_nice",
    "stream_input",
)


def check_int(name: str, value: object, lo: int, hi: int | None, what: str) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) in ``[lo, hi]``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
    if not ok or (hi is not None and value > hi):  # type: ignore[operator]
        raise ValueError(f"{name} should be {what}, got {value!r}")


_EXECUTORS = ("process", "thread")


def check_transform_in(value: object) -> None:
    if value not in (None, "workers", "auto"):
        raise ValueError(
            "transform_in should be 'workers' (a window's transform and collate_fn always run in "
            "a worker process), 'auto' (a paced stream's cheap windows run on this event loop, "
            f"with no process hop) or None (the default: 'auto'), got {value!r}"
        )


def check_worker_nice(value: object) -> None:
    if value is None:  # adaptive (_priority)
        return
    if value == "idle":
        if not hasattr(os, "SCHED_IDLE"):
            raise ValueError(
                "worker_nice='idle' needs the SCHED_IDLE scheduling policy, which this platform "
                "lacks (Linux has it); pass an int from 0 to 19 instead"
            )
        return
    check_int(
        "worker_nice",
        value,
        0,
        19,
        "an int from 0 (the main process's priority) to 19, 'idle' (SCHED_IDLE), or None "
        "(adaptive)",
    )


def check_own_settings(
    *,
    seeding: object,
    worker_nice: object,
    device_prefetch: object,
    max_worker_restarts: object,
    executor: object,
    num_workers: int,
    multiprocessing_context: object,
) -> None:
    """aioloader's own settable arguments (torch checks its own), by the constructor and again
    by every epoch's plan: one place, one message each."""
    check_int("max_worker_restarts", max_worker_restarts, 0, None, "a non-negative int")
    check_executor(executor, num_workers, multiprocessing_context, worker_nice)
    check_worker_nice(worker_nice)
    check_int(
        "device_prefetch",
        device_prefetch,
        1,
        None,
        "a positive int (batches kept ready on the device ahead of the consumer)",
    )
    if seeding not in ("worker", "batch"):
        raise ValueError(
            f"seeding should be 'worker' (torch's: each worker seeded once) or 'batch' "
            f"(seeded before every batch from the epoch and send_idx), got {seeding!r}"
        )


def check_executor(
    executor: object, num_workers: int, multiprocessing_context: object, worker_nice: object
) -> None:
    """Reject an unknown executor, and arguments that only mean something for processes."""
    if isinstance(executor, str):
        if executor not in _EXECUTORS:
            raise ValueError(
                f"executor should be 'process', 'thread' or aioloader.ray.RayWorkers(...), "
                f"got {executor!r}"
            )
        name = executor
    elif callable(getattr(executor, "start", None)) and callable(
        getattr(executor, "validate", None)
    ):
        name = str(getattr(executor, "name", type(executor).__name__))
        executor.validate(  # type: ignore[attr-defined]
            num_workers=num_workers, multiprocessing_context=multiprocessing_context
        )
    else:
        raise TypeError(
            "executor should be 'process', 'thread' or an executor object such as "
            f"aioloader.ray.RayWorkers(...), got {type(executor).__name__}"
        )
    if name == "process":
        return
    if multiprocessing_context is not None and num_workers > 0:
        raise ValueError(
            f"multiprocessing_context chooses how worker processes start; executor={name!r} "
            "starts no worker processes: drop multiprocessing_context (or use "
            "executor='process')"
        )
    if worker_nice is not None and num_workers > 0:
        raise ValueError(
            f"worker_nice sets the priority of worker processes; executor={name!r} has none: "
            "drop worker_nice (or use executor='process')"
        )


def stream_input(
    dataset: Any,
    *,
    batch_size: int | None,
    shuffle: bool | None,
    sampler: Any,
    batch_sampler: Any,
    transform: Any,
    max_batch_latency: object,
    source_concurrency: object,
    num_workers: object,
    fetch_in: object,
    fetch_policy: object,
    transform_in: object = None,
) -> tuple[StreamInput | None, InWorkers | None]:
    """Validate the async-source arguments. Returns what the loop reads (an async iterable, or an
    async map-style dataset fetched on the loop) or what the workers fetch
    (``fetch_in="workers"``); both None when ``dataset`` is not an async source."""
    if inspect.isasyncgenfunction(dataset) or inspect.isgeneratorfunction(dataset):
        name = getattr(dataset, "__name__", "the generator function")
        raise TypeError(
            f"the dataset is the generator function {name} itself, not a stream: call it "
            f"(AsyncDataLoader({name}(...), ...)) to pass the generator it makes; an object "
            "whose `async def __aiter__` starts a new stream each time serves every epoch"
        )
    kind = source_kind(dataset)
    check_int(
        "source_concurrency",
        source_concurrency,
        1,
        None,
        "a positive int (async __getitem__ calls run at once)",
    )
    latency = check_latency(max_batch_latency)
    if fetch_in not in (None, "workers", "loop"):
        raise ValueError(
            "fetch_in should be 'workers' (each worker calls the async __getitem__ on an event "
            "loop of its own), 'loop' (this event loop calls it) or None (the default: 'workers' "
            f"when num_workers > 0), got {fetch_in!r}"
        )
    check_transform_in(transform_in)
    is_torch_iterable = kind == "iterable" and isinstance(dataset, IterableDataset)
    if transform_in == "auto" and kind != "iterable":
        raise ValueError(
            "transform_in='auto' applies to async iterable sources (a stream read on this event "
            f"loop) only, and {type(dataset).__name__} is not one"
        )
    if kind != "map":
        for name, value in (("fetch_in", fetch_in), ("fetch_policy", fetch_policy)):
            if name == "fetch_in" and is_torch_iterable:
                continue
            if value is not None:
                raise ValueError(
                    f"{name} applies to async map-style datasets (whose __getitem__ or "
                    "__getitems__ is async def)"
                    + (" and IterableDatasets with __aiter__" if name == "fetch_in" else "")
                    + f" only, and {type(dataset).__name__} is not one"
                )
    if kind is None:
        for name, value in (("transform", transform), ("max_batch_latency", latency)):
            if value is not None:
                raise ValueError(
                    f"{name} applies to async sources only (an async iterable, or a dataset "
                    f"whose __getitem__ is async def), and {type(dataset).__name__} is neither; "
                    "for a torch Dataset apply it in __getitem__ or collate_fn"
                )
        return None, None
    policy = check_policy(fetch_policy)
    if transform is not None and not callable(transform):
        raise TypeError(f"transform should be a callable applied to each sample, got {transform!r}")
    if kind == "map" and latency is not None:
        raise ValueError(
            "max_batch_latency applies to async iterable sources (a stream); an async map-style "
            "dataset's batches are fixed by its sampler"
        )
    if kind == "iterable":
        if shuffle:
            raise ValueError(
                "shuffle=True cannot apply to an async iterable source: it is a stream, read in "
                "arrival order and possibly endless, so there is no whole to shuffle. Shuffle "
                "in the producer, or batch by arrival and shuffle within a batch in collate_fn"
            )
        if sampler is not None or batch_sampler is not None:
            raise ValueError(
                "sampler and batch_sampler cannot apply to an async iterable source: it has no "
                "indices (batches are formed by batch_size and max_batch_latency)"
            )
    if kind == "map" or is_torch_iterable:
        # An async map-style dataset, or torch's IterableDataset with __aiter__ (each worker
        # iterates its own replica, sharded by get_worker_info() as torch's): by default the
        # workers fetch, each on an event loop of its own. (An async map-style dataset was
        # refused max_batch_latency above.)
        acks = callable(getattr(dataset, "ack", None))
        workers = isinstance(num_workers, int) and num_workers > 0
        if fetch_in is None:
            fetch_in = "workers" if workers and not acks and latency is None else "loop"
        if fetch_in == "workers":
            if not workers:
                reason = "needs num_workers > 0 (each worker fetches)"
            elif latency is not None:
                reason = "cannot close batches by time (max_batch_latency): a stream read here can"
            elif acks:
                reason = "cannot acknowledge samples (ack()): they are read on this event loop"
            elif transform_in == "auto":
                reason = (
                    "reads it in the workers, so transform_in='auto' (windows loaded on this "
                    "event loop) cannot apply"
                )
            else:
                check_no_client(dataset)
                concurrency = int(source_concurrency)  # type: ignore[call-overload]
                return None, InWorkers(dataset, policy, concurrency, transform)
            raise ValueError(
                f"fetch_in='workers' for {type(dataset).__name__} {reason}; use "
                "fetch_in='loop' to read it on this event loop"
            )
    stream = StreamInput(
        dataset,
        kind,
        max_batch_latency=latency,
        source_concurrency=int(source_concurrency),  # type: ignore[call-overload]
        batch_size=batch_size,
        transformed=transform is not None,
        policy=policy,
        # None: the lane where it can be (an async iterable read here), else the workers.
        transform_in=str(transform_in or ("auto" if kind == "iterable" else "workers")),
    )
    return stream, None
