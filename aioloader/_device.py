"""Device stage: pins each batch and, for a CUDA target, copies it to the GPU on a side stream.

Runs in: one dedicated thread (``aioloader-device_0``); ``process()`` and ``aclose()`` are awaited
on the event loop, ``start()`` is called on the event-loop thread. Upstream: ``_reorder`` (batches
in send_idx order). Downstream: the consumer. Imports nothing from the loader.

Per batch, on the device thread::

    pin_memory(batch)                      torch's own helper: tensors, containers, custom types
    t.to(device, non_blocking=True)        on the side stream, the thread's current stream: the copy
                                           does not queue behind compute; pinned makes it async
    event.record(side)                     marks "this batch's copies are done"
    t.record_stream(consumer)              the allocator learns the consumer stream uses t

then, back on the event-loop thread, before ``process()`` returns::

    consumer.wait_event(event)             queued on the GPU, the host does not block

so every kernel the consumer queues on its stream after receiving the batch runs after the copy.
``consumer`` is the current stream of the event-loop thread when ``start()`` was called.

One thread keeps batches in the order ``process()`` was called, with no reorder logic here.

Memory safety across the two streams has two parts:

* ``record_stream(consumer)``: a device tensor is allocated on the side stream, so without it the
  caching allocator would hand its block to the next copy as soon as Python frees it, while
  consumer kernels that read it may still be queued. With it, the block waits for the consumer
  work queued *at the moment of the free*.
* The reference-holding guard, kept by the loader: it holds each delivered batch until the
  consumer has asked for the next one. That moves the free, and so the moment ``record_stream``
  samples the consumer stream, to after the consumer has queued all of its step on that batch,
  including work on other streams it joined back into the consumer stream (DDP, AMP scalers,
  user streams). ``process()`` only has to return the batch for the loader to do this.

Objects that are neither tensors nor containers torch's ``pin_memory`` walks (for example a
custom batch class with ``pin_memory()``) are pinned by their own method but are *not* moved to
the device: this stage cannot reach the tensors inside them to call ``record_stream``, so moving
them would reintroduce the allocator race above. Move them in the training step with
``obj.to(device, non_blocking=True)``, which is asynchronous because they are pinned.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import copy
import enum
import functools
import logging
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch.utils.data._utils import pin_memory as _torch_pin

from ._threads import run_off_loop

__all__ = ("DeviceStage",)

_logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_THREAD_NAME_PREFIX = "aioloader-device"

# torch's helper is untyped; this alias types it. Looked up at call time, so tests can wrap it.
_pin_memory: Callable[[Any, str | None], Any] = _torch_pin.pin_memory

# Warning texts are torch 2.13's (_BaseDataLoaderIter.__init__), so filters written for torch's
# DataLoader also match aioloader's. The missing space after "device," is torch's.
_MSG_PIN_DEVICE_DEPRECATED = (
    "pin_memory_device is deprecated, the current accelerator will be used as the device,"
    "ignore pin_memory_device='{}'."
)
_MSG_NO_ACCELERATOR = (
    "'pin_memory' argument is set as true but no accelerator is found, "
    "then device pinned memory won't be used."
)
_MSG_MPS = (
    "'pin_memory' argument is set as true but not supported on MPS now, "
    "device pinned memory won't be used."
)

# Warnings point at the user's line when the loader builds this stage in its own __init__:
# user -> AsyncDataLoader.__init__ -> DeviceStage.__init__.
_WARN_STACKLEVEL = 3


class _State(enum.Enum):
    CREATED = "created"  # validated; no thread yet
    STARTED = "started"  # thread exists (when active); process() accepted
    CLOSED = "closed"  # thread shut down or shutting down; terminal


class DeviceStage:
    """Pins batches and copies them to a CUDA device on one dedicated thread.

    Guarantees: batches are processed one at a time in the order ``process()`` was called; a CUDA
    batch returned by ``process()`` is safe to use on the consumer stream without any further
    synchronisation; nothing here blocks the event loop.

    Args:
        pin_memory: pin batches in page-locked host memory (as torch's DataLoader). Ignored, with
            torch's warning, when no accelerator is available.
        device: ``None`` or ``"cpu"`` to leave batches on the host, or ``"cuda"``/``"cuda:N"`` to
            copy them there. A CUDA device implies pinning.
        pin_memory_device: deprecated in torch; accepted and ignored, with torch's warning.
        pin_threads: intra-op threads the device thread pins with. 1 (torch's pin-memory thread)
            keeps the host copy from taking cores that worker processes load on; with no worker
            processes the loader passes this process's thread count, as torch pins on its main
            thread then (one thread copies into pinned memory at a fraction of what several do:
            5.5 against 22-30 GB/s for 64 MiB batches on a 16-core H100 host, docs/benchmarks.md).

    Raises:
        TypeError: ``device`` is not a ``str``, ``torch.device`` or ``None``.
        ValueError: ``device`` is not a valid device, is a type other than cpu/cuda, or asks for
            CUDA (or a CUDA index) that this machine does not have.
    """

    def __init__(
        self,
        *,
        pin_memory: bool,
        device: str | torch.device | None,
        pin_memory_device: str = "",
        pin_threads: int = 1,
    ) -> None:
        self._device = _validate_device(device)
        self._pin_threads = max(1, pin_threads)
        copy_to_cuda = self._device is not None and self._device.type == "cuda"

        if pin_memory and pin_memory_device:
            warnings.warn(
                _MSG_PIN_DEVICE_DEPRECATED.format(pin_memory_device),
                stacklevel=_WARN_STACKLEVEL,
            )
        # The device type torch's pin helper is told; None means "do not pin".
        self._pin_device_type: str | None = None
        if copy_to_cuda:
            self._pin_device_type = "cuda"  # the pinned source is what makes non_blocking real
        elif pin_memory:
            accelerator = torch.accelerator.current_accelerator()
            if not torch.accelerator.is_available() or accelerator is None:
                warnings.warn(_MSG_NO_ACCELERATOR, stacklevel=_WARN_STACKLEVEL)
            elif accelerator.type == "mps":  # torch: pinning raises on MPS, so it skips it
                warnings.warn(_MSG_MPS, stacklevel=_WARN_STACKLEVEL)
            else:
                self._pin_device_type = accelerator.type

        self._state = _State.CREATED
        self._pool: ThreadPoolExecutor | None = None
        self._join: asyncio.Future[None] | None = None
        # Set by start() on the event-loop thread, before the device thread exists.
        self._cuda_index: int | None = None
        self._consumer_stream: torch.cuda.Stream | None = None
        # Set on the device thread by _init_thread(), read only there.
        self._side_stream: torch.cuda.Stream | None = None
        self._init_error: BaseException | None = None

    @property
    def active(self) -> bool:
        """Whether there is anything to do; if not, the loader skips the stage entirely."""
        return self._pin_device_type is not None

    def start(self) -> None:
        """Start the device thread; call on the event-loop thread that will consume batches.

        Idempotent. Does nothing when the stage is not ``active``. For a CUDA device this
        captures the consumer stream (the thread's current stream now) and initialises CUDA in
        this process, so start worker processes before calling it.

        Raises:
            RuntimeError: the stage was closed.
        """
        if self._state is _State.CLOSED:
            raise RuntimeError("this DeviceStage was closed; create a new one to start again")
        if self._state is _State.STARTED:
            return
        self._state = _State.STARTED
        if not self.active:
            return
        if self._device is not None and self._device.type == "cuda":
            index = self._device.index
            # "cuda" means the current device of the thread that starts the loader, as in torch.
            self._cuda_index = torch.cuda.current_device() if index is None else index
            self._consumer_stream = torch.cuda.current_stream(self._cuda_index)
        # Read before the device thread exists: a thread's first look at its intra-op thread
        # count takes the process's current default, which the device thread is about to change.
        threads = torch.get_num_threads()
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix=_THREAD_NAME_PREFIX, initializer=self._init_thread
        )
        # ThreadPoolExecutor creates its thread on the first submit; do that now so CUDA set-up on
        # the thread overlaps the loader's start rather than delaying the first batch.
        ready = self._pool.submit(_noop)
        ready.add_done_callback(functools.partial(_restore_default_threads, threads))
        _logger.debug(
            "device stage started (device=%s, pin=%s)", self._device, self._pin_device_type
        )

    async def process(self, batch: _T) -> _T:
        """Pin ``batch`` and move it to the device on the device thread; return the result.

        The same as ``await stage.finish(stage.submit(batch))``. A stage that is not ``active``
        returns ``batch`` itself.

        Raises:
            RuntimeError: ``start()`` was not called, or the stage was closed.
        """
        if not self.active:
            return batch
        return await self.finish(self.submit(batch))

    def submit(self, batch: _T) -> asyncio.Future[tuple[_T, torch.cuda.Event | None]]:
        """Queue ``batch`` on the device thread now and return its pending result for
        :meth:`finish`. Batches are pinned and copied in the order they were submitted.

        Submitting the next batch before the previous one is finished keeps the thread busy:
        it starts pinning batch k+1 the moment batch k is done, with no round trip through the
        event loop between them. Cancelling the returned future drops a batch still queued.

        Raises:
            RuntimeError: the stage is not active, ``start()`` was not called, or it was closed.
        """
        if not self.active:
            raise RuntimeError("DeviceStage.submit() on a stage with nothing to do")
        if self._state is not _State.STARTED or self._pool is None:
            raise RuntimeError(
                "DeviceStage.process() needs a started, open stage: call start() first"
                if self._state is _State.CREATED
                else "this DeviceStage was closed; no more batches can be processed"
            )
        return asyncio.get_running_loop().run_in_executor(self._pool, self._run, batch)

    async def finish(self, pending: asyncio.Future[tuple[_T, torch.cuda.Event | None]]) -> _T:
        """Wait for a batch given to :meth:`submit` and return it, pinned and moved.

        When this returns, the consumer stream is already ordered after the copy. If the awaiting
        task is cancelled, a batch already on the thread is finished and dropped, a batch still
        queued is never processed. Errors from a custom ``pin_memory()`` keep their type. The
        caller keeps a reference to each CUDA batch it delivers until the consumer asks for the
        next one (the guard described in the module docstring).
        """
        try:
            result, event = await pending
        except Exception as exc:
            exc.add_note("aioloader: raised in the device stage (pin_memory / copy to device)")
            raise
        if event is not None and self._consumer_stream is not None:
            # Queued here, on the loop thread when the batch is ready, not on the device thread:
            # the device thread could insert it in the middle of the consumer's previous step and
            # make the rest of that step wait for this copy. Nothing is awaited between here and
            # the return, so the wait is always queued before the consumer can see the batch.
            self._consumer_stream.wait_event(event)
        return result

    async def aclose(self) -> None:
        """Stop the device thread without blocking the event loop.

        The thread finishes the batch it is working on; batches still queued are cancelled (their
        ``process()`` raises ``CancelledError``). Idempotent: when this returns, no thread named
        ``aioloader-device*`` of this stage exists. If this await is cancelled (for example by a
        timeout) the shutdown goes on in the background and a later ``aclose()`` waits for it.
        """
        if self._state is not _State.CLOSED:
            self._state = _State.CLOSED
            pool, self._pool = self._pool, None
            if pool is not None:
                _logger.debug("device stage closing")
                # The join blocks, so it runs off the loop, on a thread that is gone afterwards.
                self._join = asyncio.ensure_future(
                    run_off_loop(
                        functools.partial(pool.shutdown, wait=True, cancel_futures=True),
                        name="stage-join",
                    )
                )
        if self._join is not None:
            await asyncio.shield(self._join)

    def close_nowait(self) -> None:
        """Stop the device thread without waiting for it (no event loop left to wait on).

        The thread finishes the batch in hand and exits; queued batches are dropped.
        """
        self._state = _State.CLOSED
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _init_thread(self) -> None:
        """Runs in: the device thread, once, before any batch."""
        try:
            # As torch's pin-memory thread (1 beside worker processes): a per-thread setting
            # under OpenMP that keeps the host-side copy into pinned memory from taking every
            # core from the workers.
            # A thread's first use of torch's thread pool sets its count from the process
            # default (which _restore_default_threads puts back); done first, it cannot undo ours.
            torch.get_num_threads()
            torch.set_num_threads(self._pin_threads)
            if self._cuda_index is not None:
                torch.cuda.set_device(self._cuda_index)  # the current device is per thread
                # torch.cuda.Stream/Event have untyped constructors, hence the ignores.
                stream = torch.cuda.Stream(device=self._cuda_index)  # type: ignore[no-untyped-call]
                self._side_stream = stream
                # The current stream is per thread and this thread does nothing else, so the
                # side stream is made current once: entering torch.cuda.stream() for every batch
                # cost about 50 us of Python, 3 % of a 64 MiB batch's time (H200).
                torch.cuda.set_stream(stream)
        except Exception as exc:
            # Raising here would break the pool and every process() would see only
            # BrokenThreadPool; keeping it lets the first batch re-raise the real error.
            self._init_error = exc

    def _run(self, batch: _T) -> tuple[_T, torch.cuda.Event | None]:
        """Runs in: the device thread. Returns the processed batch and its copy-done event."""
        if self._init_error is not None:
            raise RuntimeError("the aioloader-device thread failed to start") from self._init_error
        pinned: _T = _pin_memory(batch, self._pin_device_type)
        if self._cuda_index is None:
            return pinned, None
        side, consumer = self._side_stream, self._consumer_stream
        if side is None or consumer is None:  # _init_thread() sets both or sets _init_error
            raise RuntimeError("aioloader-device thread has no CUDA streams")
        device = torch.device("cuda", self._cuda_index)
        moved: list[torch.Tensor] = []
        # The side stream is this thread's current stream (_init_thread): the copies queue there.
        result: _T = _to_device(pinned, device, moved)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(side)
        for tensor in moved:
            tensor.record_stream(consumer)
        return result, event


def _noop() -> None:
    pass


def _restore_default_threads(threads: int, _ready: object) -> None:
    """Give threads started later the intra-op thread count they had before the device thread.

    ``torch.set_num_threads`` on the device thread also becomes the count that every thread
    started afterwards begins with (and that a thread which never used torch's thread pool yet
    picks up): a training step run through ``asyncio.to_thread`` would have run on one core. A
    call from any thread but the device thread puts the default back without touching the
    device thread's own count; this runs on a short-lived helper thread, once the device thread
    has set its own. torch's pin-memory thread leaves the default changed.
    """

    def restore() -> None:
        with contextlib.suppress(Exception):  # best effort: the loader works either way
            torch.set_num_threads(threads)

    helper = threading.Thread(target=restore, name="aioloader-device-threads")
    helper.start()
    helper.join()


def _validate_device(device: object) -> torch.device | None:
    """Return ``device`` as a ``torch.device`` (``None`` for cpu), or raise a clear error."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"device must be a str, a torch.device or None, not {type(device).__name__}"
        )
    try:
        parsed = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device={device!r} is not a valid torch device: {exc}") from None
    if parsed.type == "cpu":
        return None
    if parsed.type != "cuda":
        raise ValueError(
            f"device={device!r}: aioloader moves batches only to 'cuda' devices "
            "(or leaves them on the host with None/'cpu'); move them yourself for other types"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} but CUDA is not available (CPU-only torch build or no visible "
            "GPU); pass device=None to keep batches on the host"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"device={device!r} but this machine has {count} CUDA device(s)")
    return parsed


def _to_device(data: Any, device: torch.device, moved: list[torch.Tensor]) -> Any:
    """Copy every tensor in ``data`` to ``device``, appending each device tensor to ``moved``.

    Walks the containers torch's ``pin_memory`` walks, in its order of checks, so a type that
    pin_memory treats as a leaf is a leaf here too. Runs in: the device thread, under the side
    stream.
    """
    if isinstance(data, torch.Tensor):
        out = data.to(device, non_blocking=True)
        moved.append(out)
        return out
    if hasattr(data, "pin_memory") or isinstance(data, (str, bytes)):
        return data  # custom types stay pinned on the host: see the module docstring
    if isinstance(data, collections.abc.Mapping):
        items = {key: _to_device(value, device, moved) for key, value in data.items()}
        try:
            if isinstance(data, collections.abc.MutableMapping):
                # A copy keeps the mapping's type and extra attributes (defaultdict's factory).
                clone = copy.copy(data)
                clone.update(items)
                return clone
            return type(data)(items)  # type: ignore[call-arg]
        except TypeError:  # no copy()/update(), or no __init__(mapping)
            return items
    if isinstance(data, tuple):
        values = [_to_device(value, device, moved) for value in data]
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*values)
        return type(data)(values)
    if isinstance(data, collections.abc.Sequence):
        values = [_to_device(value, device, moved) for value in data]
        try:
            if isinstance(data, collections.abc.MutableSequence):
                clone_seq = copy.copy(data)
                for i, value in enumerate(values):
                    clone_seq[i] = value
                return clone_seq
            return type(data)(values)  # type: ignore[call-arg]
        except TypeError:  # no copy()/__setitem__, or no __init__(iterable), e.g. range
            return values
    return data
