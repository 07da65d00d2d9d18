"""The executor protocol every backend implements, and the in-process one (``num_workers=0``).

Runs in: the event loop (``submit``, the awaited methods) with blocking work on helper threads.

The scheduler, the recovery and the consumer know a backend only through :class:`Backend`:

* it is started from a :class:`~aioloader._worker.WorkerSpec`, so the dataset crosses to the
  workers once, not with every task;
* ``submit(send_idx, indices, epoch, worker_id)`` returns a ``concurrent.futures.Future`` of a
  :class:`~aioloader._worker.Result`, or raises ``BrokenProcessPool`` when a worker has died;
* a dead worker is reported by its sentinel becoming readable and by :meth:`Backend.crash_report`,
  which names the worker, its exit code and the ``(epoch, send_idx)`` it held;
* :meth:`Backend.replace` starts an identical set of workers after a crash; :meth:`shutdown` and
  :meth:`kill_sync` release everything.

Process workers are :class:`~aioloader._executor.WorkerPool`; :class:`ThreadBackend` below loads
batches on one thread of this process (``num_workers=0``);
:class:`~aioloader._threadworkers.ThreadWorkers` runs ``num_workers`` worker threads
(``executor="thread"``), and :class:`~aioloader.ray.RayPool` one Ray actor per worker. A crash of
a backend that has no processes (a Ray actor) takes the same path: its futures fail with
``BrokenProcessPool``, its sentinel is any fd that becomes readable on the death (a pipe), and
``crash_report`` names the worker and the batch it held.

An executor other than processes and threads is a :class:`Launcher` passed as
``AsyncDataLoader(executor=...)``: it checks the loader's arguments and starts a backend from the
worker spec and the objects every worker needs.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch
from torch.utils.data import _DatasetKind

from . import _worker
from ._executor import CrashReport
from ._threads import JOIN_BOUND_S, release_threads

__all__ = ("Backend", "Direct", "Launcher", "ThreadBackend")


class Backend(Protocol):
    """What the epoch needs from a set of workers. See the module docstring."""

    num_workers: int

    def submit(
        self, send_idx: int, indices: Any, epoch: int, worker_id: int | None
    ) -> Future[Any]: ...

    def sentinels(self) -> list[int]: ...

    # Optional: ``prefeed(worker_id, key, samples) -> bool`` sends samples of a window still
    # filling ahead to its worker (see _stream and SampleCollator.prefeed); backends without it
    # get whole windows only.

    def crash_report(self, settle_s: float = 1.0) -> CrashReport: ...

    async def replace(self) -> Backend: ...

    async def shutdown(self, *, graceful: bool) -> None: ...

    def kill_sync(self) -> None: ...

    def kill_at_exit(self) -> None:
        """Stop what can be stopped without starting a thread or waiting (the interpreter is
        finalizing: Python 3.11 waits for ever for a thread started now, 3.12+ refuses)."""
        ...


class Launcher(Protocol):
    """Starts a backend of another kind (``AsyncDataLoader(executor=launcher)``)."""

    #: Names the executor in the loader's error messages.
    name: str

    def validate(self, *, num_workers: int, multiprocessing_context: Any) -> None:
        """Raise ``ValueError`` for loader arguments that make no sense with this executor."""
        ...

    async def start(
        self, spec: _worker.WorkerSpec, objects: tuple[Any, Any, Any], pinned: bool
    ) -> Backend:
        """Start ``spec.num_workers`` workers over ``objects`` (dataset, collate_fn,
        worker_init_fn); ``pinned``: tasks name their worker (round-robin), else any one does."""
        ...


class Direct:
    """A batch loaded in this process, or received from a worker and rebuilt here. ``value`` is
    the batch itself; ``buffers`` the pool buffers it holds (see
    :func:`~aioloader._buffers.delivered`); ``pieces``: it was rebuilt in pieces, a batch of
    many Python objects (see :mod:`aioloader._release`)."""

    __slots__ = ("buffers", "pieces", "value")

    def __init__(self, value: Any, buffers: tuple[Any, ...] = (), pieces: bool = False) -> None:
        self.value = value
        self.buffers = buffers
        self.pieces = pieces


class ThreadBackend:
    """``num_workers=0``: batches load on one thread of this process, off the event loop.

    As in torch's single-process mode, ``get_worker_info()`` is None and errors keep their original
    exception object. A ``BaseException`` that is not an ``Exception`` (``SystemExit`` from a
    dataset) is turned into a ``RuntimeError`` naming it: raised in the consumer it would end
    ``asyncio.run`` with no traceback.
    """

    num_workers = 1

    def __init__(
        self,
        *,
        dataset: Any,
        is_iterable: bool,
        auto_collation: bool,
        collate_fn: Any,
        drop_last: bool,
    ) -> None:
        self._kind = _DatasetKind.Iterable if is_iterable else _DatasetKind.Map
        self._dataset = dataset
        self._auto_collation = auto_collation
        self._collate_fn = collate_fn
        self._drop_last = drop_last
        self._epoch = -1
        self._fetcher: Any = None
        self._ex = ThreadPoolExecutor(1, thread_name_prefix="aioloader-fetch")
        self._join_bound_s: float | None = None

    def submit(self, send_idx: int, indices: Any, epoch: int, worker_id: int | None) -> Future[Any]:
        return self._ex.submit(self._fetch, send_idx, indices, epoch)

    def prefeed(self, worker_id: int | None, key: tuple[int, int], samples: Any) -> bool:
        """Transform samples of an open window ahead, on the loading thread (see ``_stream``)."""
        collator = self._dataset
        if not isinstance(collator, _worker.SampleCollator):
            return False
        try:
            self._ex.submit(collator.prefeed, key, samples)
        except RuntimeError:  # shut down: the window's task will not run either
            return False
        return True

    def _fetch(self, send_idx: int, indices: Any, epoch: int) -> _worker.Result:
        extra: _worker.Extra | None = None
        if type(indices) is _worker.Extra:
            extra, indices = indices, indices.indices
        if extra is not None and extra.seed is not None:
            # seeding="batch" in the main process: the batch sees its own seed, and the
            # process's random state is given back afterwards (the training step uses it too).
            with _rng_restored():
                _worker.seed_all(extra.seed)
                return self._load(send_idx, indices, epoch, extra)
        return self._load(send_idx, indices, epoch, extra)

    def _load(
        self, send_idx: int, indices: Any, epoch: int, extra: _worker.Extra | None
    ) -> _worker.Result:
        start = time.perf_counter()
        if self._epoch != epoch:
            self._epoch = epoch
            self._fetcher = None
            self._fetcher = _worker.make_fetcher(
                self._kind == _DatasetKind.Iterable,
                self._dataset,
                self._auto_collation,
                self._collate_fn,
                self._drop_last,
                extra.resume if extra is not None else None,
                extra.shared_seed if extra is not None else None,
            )
        state: Any = None
        try:
            if isinstance(indices, _worker.Samples):  # an async source's samples
                data: Any = Direct(
                    self._dataset.collate(indices, self._collate_fn, self._auto_collation)
                )
            else:
                data = Direct(self._fetcher.fetch(indices))
            if self._kind == _DatasetKind.Iterable:
                # A copy: the dataset goes on changing its own state after this batch.
                state = copy.deepcopy(_worker.capture_state(self._fetcher, self._dataset))
        except StopAsyncIteration:
            # Raised to the consumer it would read as the end of the epoch: a silent truncation.
            raise RuntimeError(
                "the Dataset or the collate_fn raised StopAsyncIteration; raise IndexError for a "
                "bad index instead"
            ) from None
        except StopIteration:
            if self._kind != _DatasetKind.Iterable:
                raise RuntimeError(
                    "the Dataset's __getitem__ or the collate_fn raised StopIteration; "
                    "raise IndexError for a bad index instead"
                ) from None
            data = _worker.Exhausted(0)
            state = copy.deepcopy(_worker.capture_end_state(self._dataset, self._fetcher))
        except Exception:
            raise
        except BaseException as exc:
            raise RuntimeError(
                f"Caught {type(exc).__name__} while loading batch send_idx={send_idx} "
                "(num_workers=0): a Dataset or collate_fn must not raise it; it is re-raised "
                "as RuntimeError so it cannot end the event loop"
            ) from exc
        return _worker.Result(
            send_idx, epoch, 0, os.getpid(), data, time.perf_counter() - start, state
        )

    def sentinels(self) -> list[int]:
        return []  # a thread cannot die the way a process does

    def crash_report(self, settle_s: float = 1.0) -> CrashReport:
        raise RuntimeError("aioloader bug: a thread backend has no crashed workers")

    async def replace(self) -> Backend:
        raise RuntimeError("aioloader bug: a thread backend is never replaced")

    def abandon_stuck_calls(self) -> None:
        """The epoch timed out: a call still running at shutdown is waited for only a moment."""
        self._join_bound_s = JOIN_BOUND_S

    async def shutdown(self, *, graceful: bool) -> None:
        await release_threads([self._ex], "loading (num_workers=0)", self._join_bound_s)

    def kill_sync(self) -> None:
        # A thread cannot be killed: queued batches are dropped and the thread exits once the
        # call it is in returns.
        self._ex.shutdown(wait=False, cancel_futures=True)

    def kill_at_exit(self) -> None:
        self.kill_sync()  # starts nothing, waits for nothing


@contextlib.contextmanager
def _rng_restored() -> Iterator[None]:
    """Give ``random``'s, torch's and numpy's global states back on exit."""
    py = random.getstate()
    pt = torch.get_rng_state()
    np = sys.modules.get("numpy")
    npst = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        random.setstate(py)
        torch.set_rng_state(pt)
        if np is not None and npst is not None:
            np.random.set_state(npst)
