"""Thread workers (``executor="thread"``): ``num_workers`` threads of this process load batches.

Runs in: the event loop (``submit``, the awaited methods) and the worker threads (loading).

For work that releases the GIL (Pillow decode, numpy, torch ops, file and network reads) or a
free-threaded Python, threads load batches without a second process: nothing is pickled, no
shared memory is needed, start-up is immediate and the batch is handed over as the object itself.

Each thread is one worker: torch's ``get_worker_info()`` returns that thread's own ``WorkerInfo``
(``id``, ``num_workers``, ``seed = base_seed + id``, the dataset, ``worker_method="thread"`` and
``rng``: a ``random.Random``, a ``torch.Generator`` and, with numpy, a ``numpy.random.Generator``
seeded from ``seed``). torch keeps ``WorkerInfo`` in one module global; :func:`install_thread_info`
makes ``get_worker_info`` read a thread-local value first (see there). The process-wide RNGs
(``random``, ``torch.manual_seed``, ``numpy.random``) are the main program's and are not
reseeded: a reproducible random augmentation draws from ``get_worker_info().rng``.

The contract, documented in docs/backends.md: all workers share the one dataset object (no copy
per worker, unlike processes), so ``__getitem__``/``__iter__``, ``collate_fn`` and
``worker_init_fn`` must be thread-safe; a ``worker_init_fn`` that reconfigures
``get_worker_info().dataset`` per worker (a process idiom) changes it for every thread.
Assignment of batches to workers is that of processes: round-robin with one queue per worker
(in order, and for iterables), one shared queue with ``in_order=False``.
"""

from __future__ import annotations

import copy
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import IterDataPipe, _DatasetKind, graph_settings
from torch.utils.data._utils import collate as torch_collate
from torch.utils.data._utils import worker as torch_worker

from . import _remote, _worker
from ._backend import Backend, Direct
from ._executor import CrashReport
from ._threads import JOIN_BOUND_S, release_threads, run_off_loop

__all__ = ("ThreadWorkers", "install_thread_info", "thread_local")

_local = threading.local()
_install_lock = threading.Lock()
_THREAD_LOCAL_NAME = "_aioloader_thread_worker_info"


def install_thread_info() -> None:
    """Make torch's ``get_worker_info()`` return the calling thread's ``WorkerInfo`` if it has one.

    torch reads ``WorkerInfo`` from a module global (one per process: right for process workers,
    wrong for threads). Users import ``get_worker_info`` by name, so replacing the function would
    miss their references; instead the one function object gets a body that reads a thread-local
    first and falls back to torch's global. Threads that set nothing, and every process worker,
    see exactly what they saw before. Idempotent; the cost is one attribute lookup per call.
    """
    with _install_lock:
        module_globals = torch_worker.__dict__
        if module_globals.get(_THREAD_LOCAL_NAME) is _local:
            return
        module_globals[_THREAD_LOCAL_NAME] = _local
        namespace: dict[str, Any] = {}
        source = (
            "def get_worker_info():\n"
            f"    return getattr({_THREAD_LOCAL_NAME}, 'info', _worker_info)\n"
        )
        # Compiled against torch's module globals, so _worker_info is torch's own global.
        exec(source, module_globals, namespace)
        torch_worker.get_worker_info.__code__ = namespace["get_worker_info"].__code__


def thread_local() -> threading.local:
    """The thread-local whose ``info`` (when set) ``get_worker_info()`` returns on this thread."""
    return _local


def _make_rng(seed: int) -> Any:
    """Per-thread generators for ``WorkerInfo.rng`` (torch's ``_RNG`` where torch has it)."""
    gen = torch.Generator()
    gen.manual_seed(seed)
    np_gen: Any = None
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np_gen = np.random.default_rng(seed)
    rng_cls = getattr(torch_worker, "_RNG", None)
    if rng_cls is not None:
        return rng_cls(random.Random(seed), gen, np_gen)
    from types import SimpleNamespace

    return SimpleNamespace(
        random_generator=random.Random(seed), torch_generator=gen, numpy_generator=np_gen
    )


def _collate_tensors_here(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    # torch's collate stacks into shared memory whenever get_worker_info() is set; a thread's
    # batch never leaves this process, so hide this thread's info for the call.
    saved = getattr(_local, "info", None)
    _local.info = None
    try:
        return torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # type: ignore[no-any-return]
    finally:
        _local.info = saved


_COLLATE_MAP = {**torch_collate.default_collate_fn_map, torch.Tensor: _collate_tensors_here}


def _default_collate_in_thread(batch: Any) -> Any:
    """``default_collate`` with the same output, never allocating shared memory."""
    return torch_collate.collate(batch, collate_fn_map=_COLLATE_MAP)


class _ThreadState:
    """One worker thread's own state (kept in the thread-local :data:`_local`)."""

    def __init__(self, worker_id: int, dataset: Any) -> None:
        self.worker_id = worker_id
        #: The dataset this thread loads from: the shared one, or its own copy of a DataPipe.
        self.dataset = dataset
        self.fetcher: Any = None
        self.epoch = -1
        self.init_error: _worker.RemoteError | None = None


class ThreadWorkers:
    """``num_workers`` worker threads; implements :class:`~aioloader._backend.Backend`.

    A thread cannot die the way a process does, so there are no sentinels and no replacement:
    an exception from user code is that batch's error (with the worker's traceback, as from a
    process), and anything else is raised where it happens.
    """

    def __init__(
        self,
        *,
        dataset: Any,
        rank: int,
        world_size: int,
        num_workers: int,
        base_seed: int,
        is_iterable: bool,
        auto_collation: bool,
        collate_fn: Any,
        drop_last: bool,
        worker_init_fn: Any,
        pinned: bool,
    ) -> None:
        install_thread_info()
        self.num_workers = num_workers
        # fetch_in="workers": one event loop thread fetches for all worker threads (they share
        # the dataset, and so its client); each thread collates its own batches.
        self._remote: _remote.WorkerFetcher | None = None
        if isinstance(dataset, _remote.InWorkers):
            spec, dataset = dataset, dataset.dataset
            if collate_fn is torch_collate.default_collate:
                collate_fn = _default_collate_in_thread
            self._remote = _remote.WorkerFetcher(spec, auto_collation, collate_fn)
        self._dataset = dataset
        self._rank = rank
        self._world_size = world_size
        self._base_seed = base_seed
        self._kind = _DatasetKind.Iterable if is_iterable else _DatasetKind.Map
        self._auto_collation = auto_collation
        if collate_fn is torch_collate.default_collate:
            collate_fn = _default_collate_in_thread
        self._collate_fn = collate_fn
        self._drop_last = drop_last
        self._worker_init_fn = worker_init_fn
        self._pinned = pinned
        self._next_id = 0
        self._id_lock = threading.Lock()
        self._join_bound_s: float | None = None
        if pinned:
            self._executors = [
                ThreadPoolExecutor(
                    1,
                    thread_name_prefix=f"aioloader-thread-worker-{wid}",
                    initializer=self._init_thread,
                    initargs=(wid,),
                )
                for wid in range(num_workers)
            ]
        else:
            self._executors = [
                ThreadPoolExecutor(
                    num_workers,
                    thread_name_prefix="aioloader-thread-worker",
                    initializer=self._init_thread,
                    initargs=(None,),
                )
            ]

    def _init_thread(self, fixed_id: int | None) -> None:
        """Runs in: a new worker thread. Sets its WorkerInfo, runs worker_init_fn. Never raises."""
        if fixed_id is None:
            with self._id_lock:
                fixed_id = self._next_id
                self._next_id += 1
        state = _ThreadState(fixed_id, self._dataset)
        _local.state = state
        seed = self._base_seed + fixed_id
        try:
            if isinstance(self._dataset, IterDataPipe):
                # An IterDataPipe allows one live iterator at a time, and its sharding_filter
                # splits the stream by worker: each thread iterates its own copy, sharded as a
                # process worker's pickled copy is.
                with _worker.DATAPIPE_GRAPH_LOCK:
                    state.dataset = copy.deepcopy(self._dataset)
                    graph_settings.apply_sharding(
                        state.dataset,
                        self.num_workers * self._world_size,
                        fixed_id * self._world_size + self._rank,
                    )
        except BaseException:
            state.init_error = _worker.RemoteError.capture(
                f"in DataLoader worker thread {fixed_id} while copying the IterDataPipe"
            )
        _local.info = self._info(fixed_id, seed, state.dataset)
        if state.init_error is not None:
            return
        try:
            if self._worker_init_fn is not None:
                self._worker_init_fn(fixed_id)
        except BaseException:  # reported by every fetch of this worker, as from a process
            state.init_error = _worker.RemoteError.capture(
                f"in DataLoader worker thread {fixed_id}"
            )

    def _info(self, worker_id: int, seed: int, dataset: Any) -> Any:
        return _worker.make_worker_info(
            id=worker_id,
            num_workers=self.num_workers,
            seed=seed,
            dataset=dataset,
            rng=_make_rng(seed),
            worker_method="thread",
            rank=self._rank,
            world_size=self._world_size,
        )

    def submit(self, send_idx: int, indices: Any, epoch: int, worker_id: int | None) -> Future[Any]:
        ex = self._executors[worker_id if self._pinned and worker_id is not None else 0]
        return ex.submit(self._fetch, send_idx, indices, epoch)

    def _fetch(self, send_idx: int, indices: Any, epoch: int) -> _worker.Result:
        """Runs in: a worker thread. Never raises: user errors travel as a RemoteError."""
        start = time.perf_counter()
        state: _ThreadState = _local.state
        wid = state.worker_id
        pid = os.getpid()
        if state.init_error is not None:
            return _worker.Result(send_idx, epoch, wid, pid, state.init_error, 0.0)
        extra: _worker.Extra | None = None
        if type(indices) is _worker.Extra:
            extra, indices = indices, indices.indices
            if extra.seed is not None:
                # seeding="batch": this thread's info and generators get the batch's seed. The
                # process-wide RNGs belong to the main program and every thread: untouched.
                _local.info = self._info(wid, extra.seed, state.dataset)
        iterable = self._kind == _DatasetKind.Iterable
        data: object
        saved: Any = None
        try:
            if self._remote is not None:
                state.fetcher = self._remote
            if state.fetcher is None or (iterable and state.epoch != epoch):
                # Iterables: a fresh iterator per epoch, as torch (and process workers) do.
                state.epoch = epoch
                state.fetcher = None
                state.fetcher = _worker.make_fetcher(
                    iterable,
                    state.dataset,
                    self._auto_collation,
                    self._collate_fn,
                    self._drop_last,
                    extra.resume if extra is not None else None,
                    extra.shared_seed if extra is not None else None,
                )
            try:
                if isinstance(indices, _worker.Samples):  # an async source's samples
                    data = Direct(
                        state.dataset.collate(indices, self._collate_fn, self._auto_collation)
                    )
                else:
                    data = Direct(state.fetcher.fetch(indices))
            except StopIteration:
                if not iterable:
                    raise
                data = _worker.Exhausted(wid)
                saved = copy.deepcopy(_worker.capture_end_state(state.dataset, state.fetcher))
            else:
                if iterable:
                    # A copy: the iterator goes on changing its state after this batch.
                    saved = copy.deepcopy(_worker.capture_state(state.fetcher, state.dataset))
        except BaseException:
            where = f"in DataLoader worker thread {wid} while loading batch send_idx={send_idx}"
            data = _worker.RemoteError.capture(where)
        return _worker.Result(send_idx, epoch, wid, pid, data, time.perf_counter() - start, saved)

    def sentinels(self) -> list[int]:
        return []  # a thread cannot die the way a process does

    def crash_report(self, settle_s: float = 1.0) -> CrashReport:
        raise RuntimeError("aioloader bug: thread workers have no crashed workers")

    async def replace(self) -> Backend:
        raise RuntimeError("aioloader bug: thread workers are never replaced")

    async def shutdown(self, *, graceful: bool) -> None:
        """Drop queued batches and join the threads (a stuck call is waited for only a moment)."""
        if self._remote is not None:
            # First: it settles every request a worker thread waits for (one that never
            # answers included), so the threads can be joined.
            await run_off_loop(self._remote.close, name="aioloader-io-close")
        await release_threads(self._executors, 'worker (executor="thread")', self._join_bound_s)

    def abandon_stuck_calls(self) -> None:
        """The epoch timed out: calls still running at shutdown are waited for only a moment."""
        self._join_bound_s = JOIN_BOUND_S

    def kill_sync(self) -> None:
        # Threads cannot be killed: queued batches are dropped and each thread exits once the
        # call it is in returns.
        for ex in self._executors:
            ex.shutdown(wait=False, cancel_futures=True)
        if self._remote is not None:
            self._remote.close(timeout=0)  # waits for nothing: its thread ends on its own

    def kill_at_exit(self) -> None:
        self.kill_sync()  # starts nothing, waits for nothing
