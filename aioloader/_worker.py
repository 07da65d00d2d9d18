"""Worker side: set-up and fetches. Runs in: worker processes (imports neither asyncio nor CUDA).

Each worker process is initialised once by :func:`init` (the executor's ``initializer``), which
receives the dataset, ``collate_fn`` and ``worker_init_fn`` exactly once. Tasks then carry only
``(send_idx, indices, epoch)``. Every task returns a :class:`Result`; errors from user code travel
back as a :class:`RemoteError` inside it, so an exception the main process could not rebuild
never breaks the process pool.

User code must not end the worker with ``sys.exit()``: any ``BaseException`` it raises
(``SystemExit``, ``KeyboardInterrupt``, ``GeneratorExit``, ...) is caught like an ``Exception``
and reported to the consumer as a ``RuntimeError`` naming it, at the batch it broke.
"""

from __future__ import annotations

import _thread
import atexit
import contextlib
import dataclasses
import gc
import os
import pickle
import random
import select
import signal
import struct
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import util as mp_util
from typing import Any, NamedTuple

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import IterDataPipe, MapDataPipe, _DatasetKind, graph_settings
from torch.utils.data._utils import collate as torch_collate
from torch.utils.data._utils import signal_handling
from torch.utils.data._utils import worker as torch_worker

from . import _ahead, _buffers, _channel, _codec, _payload, _remote

try:
    # Imported with this module, in the main process, so that forked workers inherit it: every
    # worker seeds numpy's global generator as torch's workers do, and importing numpy.random
    # there took 17 ms of each worker's start.
    import numpy.random as _np_random
except ImportError:  # numpy is optional, as for torch
    _np_random = None  # type: ignore[assignment]

__all__ = (
    "Exhausted",
    "Extra",
    "RemoteError",
    "Result",
    "SampleCollator",
    "Samples",
    "WorkerSpec",
    "fetch",
    "init",
    "prefeed",
)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs besides the payload; small, pickled with each process start."""

    num_workers: int
    base_seed: int
    is_iterable: bool
    auto_collation: bool
    drop_last: bool
    main_pid: int
    #: Added to each worker's niceness (lower CPU priority than the event loop's process), or
    #: ``"idle"``: the worker runs under ``SCHED_IDLE``.
    nice: int | str
    #: spawn/forkserver: (payload file, shared tensors); fork: None (see ``objects``).
    payload_file: tuple[_payload.PayloadFile, list[torch.Tensor]] | None
    #: fork only: (dataset, collate_fn, worker_init_fn), inherited through fork without pickling.
    objects: tuple[Any, Any, Any] | None
    #: iterable datasets get one single-worker pool per worker id; map-style workers draw an id.
    fixed_worker_id: int | None
    #: This process's rank and world size in data-parallel training (``get_worker_info()``).
    rank: int = 0
    world_size: int = 1
    #: Tasks written ahead to a pinned worker (fetch_in="workers": all of its prefetch_factor
    #: batches, whose requests it starts as soon as it reads them).
    lane_depth: int = 2


class Samples(list[Any]):
    """A task's samples, already read by the main process (an async source): collate these.

    Submitted in place of an index batch, so the executors, the recovery and the reorder buffer
    carry it unchanged. Its repr is short: it names a batch in error messages.

    ``ahead``: ``(key, count)`` when the window's first ``count`` samples were also sent ahead to
    the worker it is pinned to, under ``key`` (see :meth:`SampleCollator.prefeed`), while the
    window was still filling. The samples themselves still travel whole, so a worker that does
    not hold those results (a replacement after a crash, any mix-up) transforms them all again.
    """

    ahead: tuple[tuple[int, int], int] | None = None

    def __repr__(self) -> str:
        return f"<{len(self)} samples from an async source>"

    def __reduce__(self) -> tuple[Any, tuple[bytes, Any]]:
        # Plain pickle copies tensors inline. The executor's queue would otherwise use torch's
        # shared-memory reduction: one segment and one fd per sample tensor, moved in place.
        data = pickle.dumps(list(self), protocol=pickle.HIGHEST_PROTOCOL)
        return _load_samples, (data, self.ahead)


def _load_samples(data: bytes, ahead: Any = None) -> Samples:
    samples = Samples(pickle.loads(data))
    if ahead is not None:
        samples.ahead = ahead
    return samples


class SampleCollator:
    """The dataset a worker holds for an async source: the source itself never leaves the loop.

    ``get_worker_info().dataset`` is this object. ``transform`` runs per sample, then
    ``collate_fn`` on the list (or on the one sample when ``batch_size=None``). Samples of a window
    still filling may be transformed ahead (:meth:`prefeed`); each process (or the loading thread
    with ``num_workers=0``) keeps those results until the window's task arrives.
    """

    def __init__(self, transform: Any) -> None:
        self.transform = transform
        # (epoch, send_idx) -> the transformed samples sent ahead so far, or what raised.
        self._ahead: dict[tuple[int, int], list[Any] | BaseException] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"transform": self.transform}  # results kept ahead belong to one process

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.transform = state["transform"]
        self._ahead = {}

    def prefeed(self, key: tuple[int, int], samples: list[Any]) -> None:
        """Transform more samples of the open window ``key`` ahead of its task. Never raises:
        an error is kept, and raised when the task arrives, at the batch's position."""
        transform = self.transform
        if transform is None:
            return  # nothing to do ahead; the task collates its samples as they are
        ahead = self._ahead
        done = ahead.get(key)
        if done is None:
            # A new window. Windows of earlier epochs whose task never came (the epoch was left
            # early) are forgotten now.
            for old in [k for k in ahead if k[0] != key[0]]:
                del ahead[old]
            done = ahead[key] = []
        if isinstance(done, BaseException):
            return
        try:
            for s in samples:
                done.append(transform(s))
        except BaseException as exc:  # SystemExit from user code too: it belongs to the batch
            ahead[key] = exc

    def collate(self, samples: list[Any], collate_fn: Any, auto_collation: bool) -> Any:
        transform = self.transform
        if transform is not None:
            ahead = getattr(samples, "ahead", None)
            done = self._ahead.pop(ahead[0], None) if ahead is not None else None
            if isinstance(done, BaseException):
                raise done
            # Results kept for fewer or more samples than went ahead (a replacement worker after
            # a crash holds none): transform every sample again.
            kept = done if done is not None and len(done) == ahead[1] else []  # type: ignore[index]
            samples = kept + [transform(s) for s in samples[len(kept) :]]
        try:
            if auto_collation:
                return collate_fn(samples)
            return collate_fn(samples[0])
        except TypeError as exc:
            if transform is None and "default_collate" in str(exc):
                exc.add_note(
                    "aioloader: the async source yielded samples that collate_fn cannot batch; "
                    "pass transform= (a function run per sample in the workers) that turns each "
                    "one into tensors, numbers or containers of them, or a collate_fn of your own"
                )
            raise


def prefeed(key: tuple[int, int], samples: Samples) -> None:
    """A lane post (no reply): transform samples of an open window ahead. Runs in: a worker."""
    dataset = _state.dataset
    if _state.init_error is not None or not isinstance(dataset, SampleCollator):
        return
    # Held like a batch: a worker killed by one of these samples is blamed on its window.
    slots, wid = _state.slots, _state.worker_id
    if slots is not None:
        _state.epoch_slots[wid] = key[0]
        slots[wid] = key[1]
    try:
        dataset.prefeed(key, samples)
    finally:
        if slots is not None:
            slots[wid] = -1


class Exhausted(NamedTuple):
    """An iterable-style worker ran dry this epoch (torch's ``_IterableDatasetStopIteration``)."""

    worker_id: int


class RemoteError(NamedTuple):
    """An exception from user code, in a form that always unpickles in the main process.

    The exception *type* is pickled separately: if the main process cannot rebuild it (a class that
    only exists in the worker), the consumer still gets the traceback text in a RuntimeError.
    """

    exc_type: bytes | None
    type_name: str
    exc_msg: str
    where: str

    @classmethod
    def capture(cls, where: str) -> RemoteError:
        """Capture the exception being handled. Call only inside an ``except`` block.

        A ``BaseException`` that is not an ``Exception`` (``SystemExit`` from ``sys.exit()``,
        ``KeyboardInterrupt``, ``GeneratorExit``) is recorded as a ``RuntimeError``: rebuilt as
        itself in the consumer it would not be caught by ``except Exception``, and a
        ``SystemExit`` would end ``asyncio.run()`` without a traceback. ``type_name`` and the
        message still name it, and the message keeps the worker's traceback.
        """
        exc = sys.exc_info()[1]
        if exc is not None and not isinstance(exc, Exception):
            name = type(exc).__name__
            text = "".join(traceback.format_exception(exc))
            msg = (
                f"Caught {name} {where}. A Dataset, IterableDataset, collate_fn or "
                f"worker_init_fn must not raise {name} (sys.exit() included): in a DataLoader "
                f"worker it is reported as a RuntimeError.\nOriginal {text}"
            )
            return cls(pickle.dumps(RuntimeError), name, msg, where)
        wrapper = ExceptionWrapper(where=where)  # type: ignore[no-untyped-call]
        exc_type = wrapper.exc_type
        try:
            type_bytes: bytes | None = pickle.dumps(exc_type)
        except Exception:
            type_bytes = None
        name = getattr(exc_type, "__name__", "Exception")
        return cls(type_bytes, name, wrapper.exc_msg, where)


class Result(NamedTuple):
    """What a task returns: ``data`` is :func:`~aioloader._codec.dumps_result` bytes, or not."""

    send_idx: int
    #: The epoch the task was submitted for (with persistent workers, tasks of an abandoned epoch
    #: can still finish, or crash, during the next one).
    epoch: int
    worker_id: int
    pid: int
    #: bytes | RemoteError | Exhausted from a worker; the main process swaps in the decoded batch.
    data: object
    busy_s: float
    #: Iterable datasets with ``state_dict``: ``(target, state)`` right after this batch.
    state: Any = None


class Extra(NamedTuple):
    """What a task carries besides its indices, when it carries anything (the rare case).

    Sent in place of the indices so every backend's ``submit`` keeps one signature.
    """

    indices: Any
    #: ``seeding="batch"``: seed ``random``, ``torch`` and numpy with this before the batch.
    seed: int | None = None
    #: Iterable datasets resuming: ``(target, state)`` to load before this worker's first batch.
    resume: Any = None
    #: An ``IterDataPipe``: the epoch's shared seed for its random DataPipes (shufflers).
    shared_seed: int | None = None


class _StackWithoutSource:
    """Stands in for the ``traceback`` module inside torch's device modules while a worker seeds
    (see :func:`manual_seed`): ``format_stack`` names each frame's file, line and function but
    reads no source file; everything else is the real module's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(traceback, name)

    @staticmethod
    def format_stack(f: Any = None, limit: int | None = None) -> list[str]:
        frame = sys._getframe(1) if f is None else f
        lines: list[str] = []
        while frame is not None and (limit is None or len(lines) < limit):
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}\n')
            frame = frame.f_back
        lines.reverse()
        return lines


_stack_without_source = _StackWithoutSource()
#: torch's device modules that queue seeds with the caller's stack (an attribute that is not
#: there is skipped).
_LAZY_SEEDING = ("cuda", "xpu", "mtia")
_seed_lock = threading.Lock()
# A fork while another thread seeds would copy the lock held, and the stand-ins installed, into
# the child: forks wait for the seeding to end.
os.register_at_fork(
    before=_seed_lock.acquire,
    after_in_parent=_seed_lock.release,
    after_in_child=_seed_lock.release,
)


def manual_seed(seed: int) -> None:
    """``torch.manual_seed(seed)``, with cheaper stacks recorded for the device seeds it queues.

    For each accelerator backend that is not initialised yet (CUDA, XPU, MTIA), torch queues the
    seed, to apply it if the backend starts later, together with ``traceback.format_stack()`` of
    the caller, which it prints only if that deferred call fails. Reading the source lines for
    those stacks took 180 us a call warm, and 4-8 ms in a freshly forked worker: half of its
    start-up, on the way to its first batch. Here the stacks name each frame's file, line and
    function without its source line; what torch seeds and queues is unchanged.
    """
    with _seed_lock:  # two callers must not save each other's stand-ins as the originals
        swapped = []
        for name in _LAZY_SEEDING:
            module = getattr(torch, name, None)
            if module is not None and getattr(module, "traceback", None) is traceback:
                swapped.append(module)
        try:
            for module in swapped:
                module.traceback = _stack_without_source
            torch.manual_seed(seed)
        finally:
            for module in swapped:
                module.traceback = traceback


def seed_all(seed: int) -> None:
    """Seed ``random``, torch and numpy (if importable) from one 64-bit ``seed``."""
    random.seed(seed)
    manual_seed(seed)
    np = sys.modules.get("numpy")  # only if the dataset uses it: importing numpy costs ~50 ms
    if np is not None:
        np.random.seed([seed & 0xFFFFFFFF, seed >> 32])


def capture_state(fetcher: Any, dataset: Any) -> Any:
    """An iterable dataset's resumable state: its iterator's ``state_dict()``, else its own.

    ``(target, state)``, or ``(target, state, True)`` once the iterator ran dry while it built a
    short last batch: the state is then the one the dataset left for its next iterator (it may
    have reset its position), and a resumed epoch must not iterate it again (torchdata saves
    the fetcher's ``ended`` too).
    """
    it = getattr(fetcher, "dataset_iter", None)
    if callable(getattr(it, "state_dict", None)):
        state: tuple[Any, ...] = ("iterator", it.state_dict())  # type: ignore[union-attr]
    elif callable(getattr(dataset, "state_dict", None)):
        state = ("dataset", dataset.state_dict())
    else:
        return None
    return (*state, True) if getattr(fetcher, "ended", False) else state


def capture_end_state(dataset: Any, fetcher: Any = None) -> Any:
    """An iterable dataset's own state once a worker's iterator ran dry, or None.

    What the next epoch starts from where the dataset lives on (``num_workers=0``, persistent
    workers): its next iterator is a new one, so an iterator's position is not part of it. But
    what loading the spent iterator's state does (restore the worker's RNG, say) carries over
    into the next epoch, as torchdata's resume does: ``("spent", dataset's or None, iterator's)``
    when ``fetcher``'s iterator (not the dataset itself) has a state.
    """
    own = dataset.state_dict() if callable(getattr(dataset, "state_dict", None)) else None
    it = getattr(fetcher, "dataset_iter", None)
    if it is not None and it is not dataset and callable(getattr(it, "state_dict", None)):
        return ("spent", own, it.state_dict())
    return ("dataset", own) if own is not None else None


#: Walking a DataPipe graph (to seed, shard or copy it) swaps class-wide pickling hooks, so two
#: threads doing it at once break each other's walk: thread workers hold this while they do.
DATAPIPE_GRAPH_LOCK = threading.Lock()


def make_fetcher(
    iterable: bool,
    dataset: Any,
    auto_collation: bool,
    collate_fn: Any,
    drop_last: bool,
    resume: Any = None,
    shared_seed: int | None = None,
) -> Any:
    """torch's fetcher for the dataset kind; an iterable one after loading ``resume`` (a
    :func:`capture_state` value) into the dataset or into its new iterator, and, for an
    ``IterDataPipe``, after seeding its random DataPipes with the epoch's ``shared_seed``."""
    if not iterable:
        return _DatasetKind.create_fetcher(  # type: ignore[no-untyped-call]
            _DatasetKind.Map, dataset, auto_collation, collate_fn, drop_last
        )
    if resume is not None and resume[0] == "fetcher":
        return resume[1]  # num_workers=0: made when the epoch began (see AsyncDataLoader)
    if shared_seed is not None and isinstance(dataset, IterDataPipe):
        # As torch does in every worker and in the main process: one seed per epoch, the same in
        # every worker, so a shuffler orders the whole stream once and sharding splits that order.
        rng = torch.Generator()
        rng.manual_seed(shared_seed)
        with DATAPIPE_GRAPH_LOCK:
            graph_settings.apply_random_seed(dataset, rng)
    kind = resume[0] if resume is not None else None
    if kind in ("dataset", "spent") and resume[1] is not None:
        dataset.load_state_dict(resume[1])  # before iter(): the new iterator starts from it
    if kind == "spent":
        # An epoch's end (capture_end_state): load the spent iterator's state into an iterator
        # made for that, for what loading it does (as torchdata does), then start a new one.
        iter(dataset).load_state_dict(resume[2])
    fetcher = _DatasetKind.create_fetcher(  # type: ignore[no-untyped-call]
        _DatasetKind.Iterable, dataset, auto_collation, collate_fn, drop_last
    )
    if kind == "iterator":
        fetcher.dataset_iter.load_state_dict(resume[1])
    if kind in ("dataset", "iterator") and len(resume) > 2 and resume[2]:
        fetcher.ended = True  # ran dry before the state was taken: the next fetch ends
    return fetcher


if dataclasses.is_dataclass(torch_worker.WorkerInfo):

    @dataclasses.dataclass(frozen=True, slots=True)
    class WorkerInfo(torch_worker.WorkerInfo):
        """torch's ``WorkerInfo`` plus this process's data-parallel ``rank`` and ``world_size``."""

        rank: int = 0
        world_size: int = 1

    def make_worker_info(**fields: Any) -> Any:
        return WorkerInfo(**fields)

    def _with_seed(info: Any, seed: int) -> Any:
        return dataclasses.replace(info, seed=seed)

else:  # torch before 2.10: a plain class that takes any keyword

    def make_worker_info(**fields: Any) -> Any:
        return torch_worker.WorkerInfo(**fields)

    def _with_seed(info: Any, seed: int) -> Any:
        fields = {k: v for k, v in vars(info).items() if not k.startswith("_")}
        fields["seed"] = seed
        return torch_worker.WorkerInfo(**fields)


class _State:
    worker_id: int = -1
    fetcher: Any = None
    dataset: Any = None
    collate_fn: Any = None
    #: Map-style batches with default_collate in a process worker: see fetch_streamed().
    streamed: bool = False
    init_error: RemoteError | None = None
    epoch: int = -1
    spec: WorkerSpec | None = None
    #: fetch_in="workers" for an IterableDataset with ``__aiter__``: what torch's fetcher reads.
    iterable: Any = None
    slots: Any = None  # shared array: send_idx each worker is working on, -1 when idle
    epoch_slots: Any = None  # shared array: the epoch of that task


_state = _State()


def _watch_parent(main_pid: int) -> None:
    """Exit when the main process dies, even by SIGKILL: a worker never outlives its loader.

    A pidfd becomes readable when the process exits; this works for forkserver workers too, whose
    parent is the fork server rather than the main process.
    """
    try:
        pidfd = os.pidfd_open(main_pid)
    except (AttributeError, OSError):
        pidfd = -1
    while True:
        if pidfd >= 0:
            select.select([pidfd], [], [])
        else:
            time.sleep(1.0)
            try:
                os.kill(main_pid, 0)
                continue
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        os._exit(1)


def _fast_exit() -> None:
    # Interpreter finalisation would free the whole dataset object by object (spawned workers
    # holding a large dataset took 0.5-1.1 s to exit that way) only for the kernel to drop the
    # memory anyway.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _loading() -> tuple[int, int]:
    """``(epoch, send_idx)`` of the batch this worker loads now (send_idx -1: none)."""
    wid = _state.worker_id
    return int(_state.epoch_slots[wid]), int(_state.slots[wid])


def _buffer_patience() -> float:
    """How long this worker may wait for a pool buffer now, in seconds.

    While another worker loads an earlier batch of the same epoch, the consumer can give a
    buffer back without this worker's batch: wait up to :data:`~aioloader._buffers.
    WAIT_FOR_BUFFER_S`. The earliest batch being loaded may be the one the consumer waits for,
    holding its last batch: it waits only a moment (:data:`~aioloader._buffers.
    WAIT_FOR_BUFFER_FIRST_S`), then takes a fresh segment.
    """
    return _buffers.WAIT_FOR_BUFFER_S if _behind() else _buffers.WAIT_FOR_BUFFER_FIRST_S


def _behind() -> bool:
    """Whether another worker loads an earlier batch of this worker's epoch."""
    slots, epochs, wid = _state.slots, _state.epoch_slots, _state.worker_id
    mine, epoch = slots[wid], epochs[wid]
    return any(w != wid and 0 <= slots[w] < mine and epochs[w] == epoch for w in range(len(slots)))


def _collate_tensors(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    """torch's tensor collation, steered: batches that travel inline skip shared memory.

    Inside a worker torch's ``collate_tensor_fn`` allocates every stacked batch in a fresh
    shared-memory segment. A small batch is copied into the result bytes anyway
    (:data:`~aioloader._codec.INLINE_TENSOR_BYTES`), so the segment is pure cost; for those
    torch's function runs as it would outside a worker. Large batches go into one of the pool's
    reused buffers when this worker has one free, else into a fresh segment as torch does (see
    :func:`~aioloader._codec.collate_into_buffer`).
    """
    elem = batch[0]
    if sum(x.numel() for x in batch) * elem.element_size() >= _codec.INLINE_TENSOR_BYTES:
        if all(x.shape == elem.shape and x.dtype == elem.dtype for x in batch):
            stacked = _codec.collate_into_buffer(batch)
            if stacked is not None:
                return stacked
        return torch_collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)  # type: ignore[no-any-return]
    return _stack_unshared(batch)


_SPARSE_LAYOUTS = frozenset(
    {torch.sparse_coo, torch.sparse_csr, torch.sparse_bsr, torch.sparse_csc, torch.sparse_bsc}
)


def _stack_unshared(batch: list[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
    """torch's ``collate_tensor_fn`` as it runs outside a worker: no shared-memory segment.

    torch picks the segment by ``get_worker_info()``; clearing that for the call would be seen
    by the worker's other threads (an async dataset's fetches on the ``aioloader-io`` thread
    read it to shard), so the one branch it steers is taken here instead.
    """
    elem = batch[0]
    if elem.is_nested or elem.layout in _SPARSE_LAYOUTS:
        # torch raises its own error for these before it looks at get_worker_info().
        return torch_collate.collate_tensor_fn(batch)  # type: ignore[no-any-return]
    return torch.stack(batch, 0)


_COLLATE_FN_MAP = {**torch_collate.default_collate_fn_map, torch.Tensor: _collate_tensors}


def _default_collate_small_inline(batch: Any) -> Any:
    """``default_collate`` with :func:`_collate_tensors`: same output, no segment for small ones."""
    return torch_collate.collate(batch, collate_fn_map=_COLLATE_FN_MAP)


def _streamable(sample: object) -> bool:
    # What fetch_streamed copies straight into a batch; anything else goes to default_collate.
    # Lazy conjugate/negative views too: torch's collation in a worker fails on them, and copy_
    # would quietly succeed.
    return (
        isinstance(sample, torch.Tensor)
        and _codec.is_plain_cpu_tensor(sample)
        and not sample.is_nested
        and not sample.is_conj()
        and not sample.is_neg()
    )


def _stream_tensors(dataset: Any, it: Iterator[Any], first: torch.Tensor, n: int) -> Any:
    # fetch_streamed for samples that are one tensor each: the same outcome, less Python per
    # sample (a large batch's build time is mostly these copies: 14 -> 10.4 ms for the
    # benchmark's 38.5 MB batch, the time of a bare loop of the same copies).
    shape, dtype = first.shape, first.dtype
    batch = _codec.batch_buffer((n, *shape), dtype)
    rows = batch.unbind(0)  # every row's view at once
    rows[0].copy_(first)
    del first
    for k in range(1, n):
        sample = dataset[next(it)]
        if not _fits(sample, shape, dtype):
            # A pool buffer taken here is freed at the task's end (release_unsent): only
            # tensors of the result are sent to the main process.
            return _default_collate_small_inline([*rows[:k], sample, *(dataset[i] for i in it)])
        rows[k].copy_(sample)
        del sample
    return batch


def _fits(sample: Any, shape: torch.Size, dtype: torch.dtype) -> bool:
    return (
        type(sample) is torch.Tensor
        and sample.shape == shape
        and sample.dtype == dtype
        and _streamable(sample)
    )


def fetch_streamed(dataset: Any, indices: list[Any] | tuple[Any, ...]) -> Any:
    """``default_collate([dataset[i] for i in indices])`` in a worker, large tensors copied into
    the batch as soon as each sample is read.

    Applies when the samples are plain CPU tensors, or tuples holding some (``(image, label)``),
    whose batch is too large to travel inline: each such tensor is copied into its batch buffer
    and dropped, so the worker never holds the samples and the batch at once (torch's worker
    does, twice a batch at its peak). The other members of a tuple are kept and collated at the
    end. The dataset sees the same calls in the same order, and the batch is bit-identical to
    ``default_collate``'s in a worker (contiguous, in shared memory; for tuples a list, as
    there). At the first sample that does not fit the first one's layout (another shape, dtype
    or length, not a plain tensor) every sample goes to ``default_collate`` instead, the ones
    already copied rebuilt from views of the batch, so its result, or its exception, is the one
    it gives without streaming.
    """
    collate = _default_collate_small_inline
    n = len(indices)
    if n == 0:
        return collate([])
    it = iter(indices)
    first = dataset[next(it)]
    in_tuple = type(first) is tuple
    if (
        not in_tuple
        and _streamable(first)
        and n * first.numel() * first.element_size() >= _codec.INLINE_TENSOR_BYTES
    ):
        return _stream_tensors(dataset, it, first, n)
    members = first if in_tuple else (first,)
    # Per member: its batch buffer if it is streamed, else None (kept, collated at the end).
    bufs: list[torch.Tensor | None] = [
        _codec.batch_buffer((n, *m.shape), m.dtype)
        if _streamable(m) and n * m.numel() * m.element_size() >= _codec.INLINE_TENSOR_BYTES
        else None
        for m in members
    ]
    if all(b is None for b in bufs):
        return collate([first, *(dataset[i] for i in it)])
    kept: list[list[Any]] = [[] for _ in bufs]

    def fits(sample: Any) -> bool:
        if in_tuple and (type(sample) is not tuple or len(sample) != len(bufs)):
            return False
        return all(
            b is None or (_streamable(m) and m.shape == b.shape[1:] and m.dtype == b.dtype)
            for b, m in zip(bufs, sample if in_tuple else (sample,), strict=True)
        )

    def rebuilt(k: int) -> Any:  # sample k as default_collate would have had it
        got = [kept[j][k] if b is None else b[k] for j, b in enumerate(bufs)]
        return tuple(got) if in_tuple else got[0]

    sample = first
    del first, members
    for k in range(n):
        if k:
            sample = dataset[next(it)]
            if not fits(sample):
                # A pool buffer taken here is freed at the task's end (release_unsent): only
                # tensors of the result are sent to the main process.
                done = [rebuilt(j) for j in range(k)]
                return collate([*done, sample, *(dataset[i] for i in it)])
        for j, (b, m) in enumerate(zip(bufs, sample if in_tuple else (sample,), strict=True)):
            if b is None:
                kept[j].append(m)
            else:
                b[k].copy_(m)
        del sample
    if not in_tuple:
        return bufs[0]
    # default_collate collates each member's samples as a tuple, in order.
    return [collate(tuple(kept[j])) if b is None else b for j, b in enumerate(bufs)]


def _streams(indices: Any) -> bool:
    # torch's map-style fetcher with default_collate, as fetch_streamed replaces it: a dataset
    # with __getitems__ reads a batch at once, and other index containers go to torch as is.
    dataset = _state.dataset
    return (
        _state.streamed
        and isinstance(indices, list | tuple)
        and not (hasattr(dataset, "__getitems__") and dataset.__getitems__)
    )


_COLLATE_NO_SHM_MAP = {
    **torch_collate.default_collate_fn_map,
    torch.Tensor: _stack_unshared,
}


def _default_collate_no_shm(batch: Any) -> Any:
    """``default_collate`` as outside a worker: no batch in shared memory (Ray actors)."""
    return torch_collate.collate(batch, collate_fn_map=_COLLATE_NO_SHM_MAP)


#: Whether ``gc.freeze()`` only relinks the collector's lists (3.11-3.13, with the GIL), so that
#: freezing writes to no object. Measured here on 3.11, 3.12 and 3.13: 0 MB copied by the freeze in
#: a forked child of a process holding a million lists, 62-64 MB by a collection without it. The
#: free-threaded build marks every object, and 3.14's incremental collector rewrites every
#: object's header, when freezing: unmeasured there, so left alone.
_FREEZE_IS_FREE = sys.version_info < (3, 14) and not sysconfig.get_config_var("Py_GIL_DISABLED")


def _freeze_inherited() -> None:
    """Keep what this worker inherited out of the cyclic garbage collector's reach.

    A full collection walks every object it tracks and writes to each one's header; in a forked
    worker that copies every page holding an inherited object into the worker (measured after
    one epoch of a script that imports torch: 11 000 page faults, 44 MB, and 150 ms of CPU per
    worker, at the worker's first imports or in the middle of an epoch). Frozen, the inherited
    objects are skipped; what the worker allocates is collected as usual. The price: an
    inherited object that becomes cyclic garbage in the worker is never collected there (its
    memory, and a descriptor it holds, stay until the worker exits). ``gc.unfreeze()`` in a
    ``worker_init_fn`` undoes this.
    """
    if _FREEZE_IS_FREE:
        gc.freeze()


def _freeze_setup() -> None:
    """Before ``worker_init_fn``, freeze what the worker's set-up made too: the dataset unpickled
    (spawn, forkserver) and the modules that brought in. They live as long as the worker; every
    full collection would walk them again, holding the GIL while it does (about 110 ms for a
    process that imported torch on a busy 2-core machine, against 7 ms with its objects frozen):
    long enough to stall an async dataset's requests on the worker's io loop and to set the pace
    of the slowest batches. A ``gc.unfreeze()`` in ``worker_init_fn`` still undoes both freezes.
    (Nothing here may count the frozen objects: ``gc.get_freeze_count()`` walks them all, which
    in a forked worker also copies their pages.)"""
    if _FREEZE_IS_FREE:
        gc.freeze()


def init(
    spec: WorkerSpec,
    id_counter: Any,
    slots: Any,
    epoch_slots: Any,
    pid_slots: Any,
    channels: Sequence[_channel.FdChannel] | None = None,
    ready_slots: Any = None,
    start_errors: Any = None,
) -> None:
    """Executor initializer: seed, set worker info, run worker_init_fn. Never raises.

    ``ready_slots[worker_id]`` is set to 1 once this is done (the pool starts its second wave of
    workers then, see ``WorkerPool``), 2 if it failed: the failure is then also written to this
    worker's part of ``start_errors`` (see :func:`write_start_error`), for a worker that gets no
    batch to report it with (a shared queue the other workers emptied).

    A failure (any ``BaseException`` from user code, ``SystemExit`` included) is stored and
    reported by every later fetch, so the consumer sees the original exception type (see
    :meth:`RemoteError.capture`) instead of a broken pool.
    """
    _freeze_inherited()
    signal_handling._set_worker_signal_handlers()  # type: ignore[attr-defined]
    if spec.nice == "idle":
        # Only on a core nothing else wants: a busy worker never delays the loop's thread by a
        # scheduler tick (a niceness only weighs the shares). Threads started later inherit it.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif spec.nice:
        # Loading is background work: when a core is contended, the event loop should win it.
        os.nice(int(spec.nice))
    torch.set_num_threads(1)
    # A bare thread: threading.Thread.start() waits until the new thread runs, 2-4 ms of a
    # forked worker's start while the other workers take the cores.
    _thread.start_new_thread(_watch_parent, (spec.main_pid,))
    atexit.register(_fast_exit)
    # Keyboard interrupts are the main process's to handle; a worker must not die of the same ^C.
    # The pool started this process with SIGINT blocked (_procpool._sigint_blocked), so a ^C
    # during its start-up is pending: ignoring the signal first discards it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    if spec.fixed_worker_id is not None:
        worker_id = spec.fixed_worker_id
    else:
        with id_counter.get_lock():
            worker_id = id_counter.value
            id_counter.value += 1
    pid_slots[worker_id] = os.getpid()
    if channels is not None:
        _codec.set_worker_channel(channels[worker_id])
    _state.slots = slots
    _state.epoch_slots = epoch_slots
    if channels is not None and slots is not None:
        _buffers.set_buffer_wait(_buffer_patience, _loading, _behind)

    def objects() -> tuple[Any, Any, Any]:
        if spec.objects is not None:
            return spec.objects
        assert spec.payload_file is not None
        return _payload.load_payload(*spec.payload_file)  # type: ignore[no-any-return]

    setup(spec, worker_id, objects, freeze=True)
    if ready_slots is not None:
        failed = _state.init_error is not None
        if failed and start_errors is not None:
            write_start_error(start_errors, worker_id, _state.init_error)
        ready_slots[worker_id] = 2 if failed else 1


#: Bytes per worker in a pool's ``start_errors`` array (a longer traceback loses its middle).
START_ERROR_BYTES = 4096


def write_start_error(buf: Any, worker_id: int, err: RemoteError | None) -> None:
    """Write ``err`` into worker ``worker_id``'s part of ``buf``: a length, then its pickle."""
    assert err is not None
    data = pickle.dumps(err)
    room = START_ERROR_BYTES - 4
    # Too long: the first line ("Caught ValueError in DataLoader worker process 3.") and the end
    # of the traceback (the frames that raised, and the error itself) are what matter.
    head, _, tail = err.exc_msg.partition("\n")
    while len(data) > room and tail:
        tail = tail[len(tail) // 2 :] if len(tail) > 1 else ""
        data = pickle.dumps(err._replace(exc_msg=f"{head[:1000]}\n[...]\n{tail}"))
    if len(data) <= room:
        offset = worker_id * START_ERROR_BYTES
        buf[offset + 4 : offset + 4 + len(data)] = data
        buf[offset : offset + 4] = struct.pack("<I", len(data))


def read_start_error(buf: Any, worker_id: int) -> RemoteError | None:
    """What :func:`write_start_error` wrote for ``worker_id``, if anything. Runs in: main."""
    offset = worker_id * START_ERROR_BYTES
    (size,) = struct.unpack("<I", bytes(buf[offset : offset + 4]))
    if size == 0:
        return None
    err: RemoteError = pickle.loads(bytes(buf[offset + 4 : offset + 4 + size]))
    return err


def setup(
    spec: WorkerSpec,
    worker_id: int,
    objects: Any,
    *,
    shm_collate: bool = True,
    freeze: bool = False,
) -> None:
    """This process's worker state: seeds, ``WorkerInfo``, ``worker_init_fn``. Never raises.

    Shared by process workers (:func:`init`) and Ray actors. ``objects()`` returns the dataset,
    ``collate_fn`` and ``worker_init_fn``. ``shm_collate=False``: ``default_collate`` never
    builds batches in shared memory (a Ray actor's results travel through Ray's object store).
    ``freeze``: freeze what the set-up made before ``worker_init_fn`` (see :func:`_freeze_setup`).
    A failure is stored and reported by every later fetch (see :func:`init`).
    """
    _state.worker_id = worker_id
    _state.spec = spec
    try:
        dataset, collate_fn, worker_init_fn = objects()
        remote: _remote.InWorkers | None = None
        if isinstance(dataset, _remote.InWorkers):  # fetch_in="workers": an async dataset
            remote, dataset = dataset, dataset.dataset
        seed = spec.base_seed + worker_id
        random.seed(seed)
        manual_seed(seed)
        if _np_random is not None:
            _np_random.seed(torch_worker._generate_state(spec.base_seed, worker_id))  # type: ignore[no-untyped-call]
        torch_worker._worker_info = make_worker_info(
            id=worker_id,
            num_workers=spec.num_workers,
            seed=seed,
            dataset=dataset,
            rank=spec.rank,
            world_size=spec.world_size,
        )
        _state.dataset = dataset
        if collate_fn is torch_collate.default_collate:
            collate_fn = _default_collate_small_inline if shm_collate else _default_collate_no_shm
        _state.collate_fn = collate_fn
        if isinstance(dataset, (IterDataPipe, MapDataPipe)):
            # A DataPipe's sharding_filter splits the data between workers (and ranks), as
            # torch's workers set it (its _sharding_worker_init_fn): ranks first, then workers.
            graph_settings.apply_sharding(
                dataset,
                spec.num_workers * spec.world_size,
                worker_id * spec.world_size + spec.rank,
            )
        _state.streamed = (
            remote is None
            and not spec.is_iterable
            and spec.auto_collation
            and collate_fn is _default_collate_small_inline
        )
        if freeze:
            _freeze_setup()
        if worker_init_fn is not None:
            worker_init_fn(worker_id)
        if remote is not None:
            fetcher = _remote.WorkerFetcher(remote, spec.auto_collation, collate_fn)
            # Closes the dataset's client when the worker exits normally (a killed worker's
            # sockets are closed by the kernel).
            mp_util.Finalize(fetcher, fetcher.close, exitpriority=10)
            if spec.is_iterable:  # torch's iterable fetcher reads it through a sync view
                _state.iterable = _remote.AsyncIterView(dataset, fetcher, remote.transform)
            else:
                _state.fetcher = fetcher
                _ahead.start = _look_ahead
        elif not spec.is_iterable:
            _state.fetcher = make_fetcher(
                False, dataset, spec.auto_collation, collate_fn, spec.drop_last
            )
    except BaseException:  # SystemExit from user code too: this process must live on
        _state.init_error = RemoteError.capture(f"in DataLoader worker process {worker_id}")


def _attributed(epoch: int, send_idx: int) -> None:
    """This worker's slot names the batch it works on now (what a crash is blamed on)."""
    slots = _state.slots
    if slots is not None:
        # The epoch first: a reader that sees this send_idx sees its epoch too.
        _state.epoch_slots[_state.worker_id] = epoch
        slots[_state.worker_id] = send_idx


def _unattributed() -> None:
    """Requests of more than one batch are in flight: a crash now is blamed on no batch (its
    batches are fetched again all the same; a poison sample then ends in WorkerCrashedError
    after max_worker_restarts, never in a PoisonBatchError naming another batch)."""
    slots = _state.slots
    if slots is not None and slots[_state.worker_id] >= 0:
        slots[_state.worker_id] = -1


def _look_ahead(fn: Any, args: tuple[Any, ...]) -> None:
    """Begin the requests of a batch task as soon as the worker reads it (see ``_ahead``)."""
    fetcher = _state.fetcher
    if fn is not fetch or type(fetcher) is not _remote.WorkerFetcher or _state.init_error:
        return
    send_idx, indices, epoch = args
    if type(indices) is Extra:
        indices = indices.indices
    if fetcher.start((epoch, send_idx), indices):
        _unattributed()


def fetch(send_idx: int, indices: Any, epoch: int) -> Result:
    """Load and collate one batch (or collate :class:`Samples`). Runs in: a worker process."""
    # Tagged: large tensors' descriptors go ahead on this worker's channel (see _channel).
    return load(
        send_idx, indices, epoch, lambda batch: _codec.dumps_result(batch, (epoch, send_idx))
    )


def load(send_idx: int, indices: Any, epoch: int, encode: Any) -> Result:
    """Load and collate one batch; ``encode(batch)`` becomes ``Result.data``. Never raises."""
    start = time.perf_counter()
    wid = _state.worker_id
    if _state.init_error is not None:
        return Result(send_idx, epoch, wid, os.getpid(), _state.init_error, 0.0)
    spec = _state.spec
    assert spec is not None
    extra: Extra | None = None
    if type(indices) is Extra:
        extra, indices = indices, indices.indices
        if extra.seed is not None:
            seed_all(extra.seed)
            # torch.initial_seed() == get_worker_info().seed holds in this mode too.
            info = torch_worker._worker_info
            if info is not None:
                torch_worker._worker_info = _with_seed(info, extra.seed)
    state: Any = None
    where = f"in DataLoader worker process {wid} while loading batch send_idx={send_idx}"
    slots = _state.slots
    _attributed(epoch, send_idx)
    try:
        if spec.is_iterable:
            if _state.epoch != epoch:
                # A new epoch: a fresh iterator over this worker's replica, as torch does.
                _state.epoch = epoch
                _state.fetcher = None
                _state.fetcher = make_fetcher(
                    True,
                    _state.iterable if _state.iterable is not None else _state.dataset,
                    spec.auto_collation,
                    _state.collate_fn,
                    spec.drop_last,
                    extra.resume if extra is not None else None,
                    extra.shared_seed if extra is not None else None,
                )
            try:
                batch = _state.fetcher.fetch(indices)
            except StopIteration:
                end = capture_end_state(_state.dataset, _state.fetcher)
                elapsed = time.perf_counter() - start
                return Result(send_idx, epoch, wid, os.getpid(), Exhausted(wid), elapsed, end)
            state = capture_state(_state.fetcher, _state.dataset)
        elif isinstance(indices, Samples):
            batch = _state.dataset.collate(indices, _state.collate_fn, spec.auto_collation)
        elif type(_state.fetcher) is _remote.WorkerFetcher:
            fetcher = _state.fetcher
            if slots is not None and fetcher.in_flight() > 0:
                # Requests of earlier-read batches run too: a crash now (a native client's)
                # may be any of theirs, so it is blamed on none (see _unattributed).
                slots[wid] = -1
            batch = fetcher.fetch(
                indices, (epoch, send_idx), collating=lambda: _attributed(epoch, send_idx)
            )
        elif _streams(indices):
            batch = fetch_streamed(_state.dataset, indices)
        else:
            batch = _state.fetcher.fetch(indices)
        try:
            data: object = encode(batch)
        except Exception as exc:
            exc.add_note(
                f"aioloader: the batch loaded for send_idx={send_idx} cannot be pickled to send it "
                "back to the main process; return tensors, numbers, strings and containers of them."
            )
            raise
    except BaseException:
        # Not only Exception: a SystemExit (sys.exit() in __getitem__) would otherwise travel
        # back as itself and end the consumer's asyncio.run(). Workers ignore SIGINT, so a
        # KeyboardInterrupt here is user code's too.
        data = RemoteError.capture(where)
        if spec.is_iterable and _state.fetcher is not None:
            # Where the iterator stands after the error: a resume goes on from there too.
            with contextlib.suppress(Exception):
                state = capture_state(_state.fetcher, _state.dataset)
    finally:
        _codec.release_unsent()
        if slots is not None:
            slots[wid] = -1
    return Result(send_idx, epoch, wid, os.getpid(), data, time.perf_counter() - start, state)
