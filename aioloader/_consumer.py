"""Consumer stage: reorder buffer -> (device stage) -> the ``async for`` body. Runs in: the loop.

Upstream: ``_reorder`` (results in ``send_idx`` order). With ``pin_memory`` or ``device=`` a feeder
task passes each batch through the device thread (``_device``) and keeps up to
``device_prefetch`` batches ready; otherwise the consumer decodes results itself.

What the consumer may see, and what follows:

* a batch: a permit returns to the scheduler;
* a user error for one batch (``__getitem__`` raised): re-raised with the worker's traceback; the
  epoch goes on, as in torch, for a consumer that keeps calling ``__anext__``;
* the end: ``StopAsyncIteration``, and the epoch is FINISHED;
* a fatal error (a crash that cannot be recovered, ``timeout``, the workers failing to start):
  raised once, then ``StopAsyncIteration``;
* cancellation while waiting (a notebook interrupt, ``asyncio.timeout``): the epoch ends at once
  and releases its workers; asking again raises :class:`~aioloader.EpochEndedError`.
"""

from __future__ import annotations

import asyncio
import pickle
import time
import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch._utils import ExceptionWrapper

from . import _buffers, _worker
from ._backend import Direct
from ._device import DeviceStage
from ._errors import AioLoaderError, EpochEndedError, LoaderTimeoutError, WorkerCrashedError
from ._phase import Phase
from ._records import Counters, Failure, Plan
from ._release import Releaser
from ._tasks import start_task

if TYPE_CHECKING:
    from ._reorder import ReorderBuffer
    from ._resume import Progress
    from ._stream import Acks

__all__ = ("Consumer", "ConsumerSide", "Failure")


class ConsumerSide(Protocol):
    """What the consumer uses of its epoch."""

    plan: Plan
    counters: Counters
    epoch_no: int
    progress: Progress
    reorder: ReorderBuffer[Any]
    permits: asyncio.Semaphore
    acks: Acks | None
    phase: Phase
    started_at: float | None
    end_reason: BaseException | None
    #: The workers (None before they started); asked at the end for start-up errors.
    backend: Any

    @property
    def terminal(self) -> bool: ...

    async def ensure_started(self) -> None: ...

    def end(self, phase: Phase, reason: BaseException | None = None) -> bool: ...

    def fail(self, exc: BaseException) -> None: ...

    async def wait_cleanup(self) -> None: ...


def _user_error(exc: BaseException, what: str) -> BaseException:
    # Stop* only: any other exception of a user's ack() or pin_memory() keeps its type.
    if isinstance(exc, (StopAsyncIteration, StopIteration)):
        err = RuntimeError(f"{what} raised {type(exc).__name__}")
        err.__cause__ = exc
        return err
    return exc


_END = object()  # the device feeder's end-of-epoch marker


class Consumer:
    """The consuming side of one epoch: ``next()`` is what ``__anext__`` awaits."""

    def __init__(self, epoch: ConsumerSide) -> None:
        self._epoch = epoch
        workers = max(1, epoch.plan.num_workers)
        # Iterable datasets: torch's round-robin over workers that are not exhausted.
        self._active = [True] * workers
        self._next_worker = 0
        progress = epoch.progress
        if progress.resume_from is not None and progress.last_worker is not None:
            # Resuming: the turn passes on from the worker whose batch was delivered last.
            self._next_worker = (progress.last_worker + 1) % workers
        self._yielded = 0
        # num_workers=0 loads on demand, as torch's single-process loader does (only inside
        # next()): the permit of a delivered batch returns when the consumer asks for the next
        # one, not when it receives this one, so nothing is loaded while the loop body uses the
        # batch. A dataset or collate_fn that refills one output buffer is safe there in torch,
        # and so it is here. Async sources keep reading ahead (their reads are I/O).
        self._on_demand = epoch.plan.num_workers == 0 and epoch.plan.stream is None
        self._owed_permit = False
        # The end or a fatal error was raised once: later calls see StopAsyncIteration.
        self._done = False
        # Device stage (pin_memory / device=): a feeder task hands batches from the reorder
        # buffer to the device thread as soon as each arrives (_submitted holds them, pending,
        # in order) and a finisher task moves each finished one into _ready; together they keep
        # up to device_prefetch batches ahead of the consumer.
        self._stage: DeviceStage | None = None
        self._feed_task: asyncio.Task[None] | None = None
        self._finish_task: asyncio.Task[None] | None = None
        self._submitted: asyncio.Queue[Any] = asyncio.Queue()
        self._slots: asyncio.Semaphore | None = None
        self._ready: asyncio.Queue[Any] = asyncio.Queue()
        # The reference-holding guard: the batch delivered last stays referenced until the
        # consumer asks for the next one, so its device memory is freed only after the consumer
        # has queued all its work on it (see _device.py).
        self._last_delivered: Any = None
        # send_idx of the batch the last _next_value() returned (acknowledgements need it).
        self._received: int | None = None
        # Workers' errors raised this epoch (a start-up error is raised at the end otherwise).
        self._raised: set[_worker.RemoteError] = set()
        # Batches of many Python objects are freed a step at a time once the loop body lets
        # go of them (_release); _pieces: the batch _decode returned last is one.
        self._releaser = Releaser()
        self._pieces = False

    # --------------------------------------------------------------------- worker choice

    def pick_worker(self, outstanding: list[int] | None = None, bound: int = 0) -> int | None:
        """The next worker in turn that is not exhausted; None: none is left.

        With ``outstanding`` (batches each worker holds), as torch does for ``in_order=False``:
        only a worker holding fewer than its share of ``bound`` (the in-flight bound split
        between the workers still active); None: none has room now.
        """
        n = len(self._active)
        share = bound // max(1, sum(self._active))
        for _ in range(n):
            wid = self._next_worker
            self._next_worker = (self._next_worker + 1) % n
            if self._active[wid] and (outstanding is None or outstanding[wid] < share):
                return wid
        return None

    def all_exhausted(self) -> bool:
        return not any(self._active)

    def worker_exhausted(self, wid: int) -> None:
        self._active[wid] = False

    # --------------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the device stage, if any. Called once the workers exist."""
        plan = self._epoch.plan
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # given once per epoch by __aiter__, as torch does
            stage = DeviceStage(
                pin_memory=plan.pin_memory,
                device=plan.device,
                pin_memory_device=plan.pin_memory_device,
                # No worker processes to leave cores to: pin with all of this process's threads,
                # as torch pins on its main thread with num_workers=0.
                pin_threads=torch.get_num_threads() if plan.num_workers == 0 else 1,
            )
        if not stage.active:
            return
        # After the workers exist: starting CUDA and a thread must not precede a fork.
        stage.start()
        self._stage = stage
        self._slots = asyncio.Semaphore(plan.device_prefetch)
        loop = asyncio.get_running_loop()
        self._feed_task = start_task(
            loop, self._feed(stage), name=f"aioloader-device-feed:{self._epoch.epoch_no}"
        )
        self._finish_task = start_task(
            loop, self._finish(stage), name=f"aioloader-device-finish:{self._epoch.epoch_no}"
        )

    def on_end(self, reason: BaseException | None) -> None:
        """The epoch ended: wake a consumer waiting on the device stage with ``reason``."""
        self._last_delivered = None
        self._releaser.end()
        for task in (self._feed_task, self._finish_task):
            if task is not None and not task.done():
                task.cancel()
        if self._stage is not None:
            self._ready.put_nowait(Failure(reason) if reason is not None else _END)

    def close_nowait(self) -> None:
        """Stop the device thread without waiting (no running loop to wait on)."""
        if self._stage is not None:
            self._stage.close_nowait()

    async def aclose(self) -> None:
        """Stop the device stage and drop the batches it prepared. Called by the cleanup."""
        try:
            tasks = [t for t in (self._feed_task, self._finish_task) if t is not None]
            if tasks:
                await asyncio.wait(tasks)
        finally:  # also when cancelled (asyncio.run exiting): the thread must not outlive us
            self._drop_submitted()
            if self._stage is not None:
                await self._stage.aclose()
            while not self._ready.empty():
                self._ready.get_nowait()

    # --------------------------------------------------------------------- consuming

    def _after_end(self) -> BaseException:
        reason = self._epoch.end_reason
        if reason is None:
            return StopAsyncIteration()
        return type(reason)(*reason.args)  # a fresh one: re-raising adds to its traceback

    async def next(self) -> Any:
        ep = self._epoch
        counters = ep.counters
        if self._done or ep.phase is Phase.ENDED:
            raise self._after_end()
        t0 = time.perf_counter()
        # The clock of stats()'s fractions starts with the first wait it counts, not when the
        # epoch stamps its own start a moment later: a consumer that only ever waited read a
        # data-stall fraction above 1.
        counters.note_request(t0)
        counters.waiting_since = t0
        try:
            try:
                await ep.ensure_started()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # the workers could not start: the epoch is over
                self._done = True
                ep.fail(exc)
                raise
            self._last_delivered = None
            if self._owed_permit:
                self._owed_permit = False
                ep.permits.release()  # the loop body is done with the last batch: load the next
            if ep.acks is not None:
                # The loop body is done with the batch delivered last: acknowledge it now.
                await self._flush_acks()
            self._received = None
            if self._buffered():
                # Taking a buffered batch does not yield to the event loop: give its other
                # callbacks (a service's requests) a turn first, or a consumer working through a
                # full buffer would hold them up for as many batches. Before the batch is taken,
                # so a cancellation here is one while waiting: nothing is lost.
                await asyncio.sleep(0)
            value = await self._next_with_timeout()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling() == 0 and ep.terminal:
                # Not our cancellation: the epoch was ended under us (aclose() elsewhere).
                self._done = True
                raise self._after_end() from None
            ep.end(
                Phase.ENDED,
                EpochEndedError(
                    f"epoch {ep.epoch_no} ended because its consumer was cancelled while "
                    "waiting for a batch (an interrupt or a timeout); its workers were released. "
                    "Start a new epoch with `async for` to go on."
                ),
            )
            raise
        except StopAsyncIteration:
            self._done = True
            self._releaser.end()
            if ep.acks is not None and not ep.terminal:
                await self._flush_acks()
            try:
                start_error = None if ep.terminal else await self._unreported_start_error()
            except asyncio.CancelledError:
                if ep.end(Phase.FINISHED):  # every batch was delivered: only the check is lost
                    ep.progress.finished = True
                raise
            ended = ep.end(Phase.FINISHED)
            if ep.phase is Phase.FINISHED:
                ep.progress.finished = True  # state_dict() now points at the next epoch
            if ended:
                await ep.wait_cleanup()  # as torch: the workers are gone when the loop ends
            if start_error is not None:
                raise_remote(start_error)
            raise
        except AioLoaderError as exc:
            # The loader's own errors are fatal (a crash, the timeout, closed, superseded).
            self._done = True
            ep.fail(exc)
            if isinstance(exc, WorkerCrashedError):
                # Dead workers are gone in moments: as torch, raise once they are. After a
                # timeout, or when another task closed the loader, a thread may be stuck in
                # user code: do not wait for it here (aclose() does).
                await ep.wait_cleanup()
            raise
        except Exception:
            if ep.terminal:
                # The epoch failed (workers that could not be replaced): this was its fatal
                # error, raised once; what is left of the epoch is its end.
                self._done = True
                await ep.wait_cleanup()
            raise  # otherwise one batch's error: the epoch goes on, as in torch
        finally:
            counters.wait_s += time.perf_counter() - t0
            counters.waiting_since = None
        if self._yielded == 0 and ep.started_at is not None:
            counters.ttfb = time.perf_counter() - ep.started_at
        if ep.acks is not None:
            ep.acks.received(self._received, ok=True)
        self._yielded += 1
        counters.batches += 1
        self._check_iterable_len()
        if self._stage is not None:
            self._last_delivered = value
        else:
            self._releaser.delivered(value, self._pieces)
        return value

    def _buffered(self) -> bool:
        """Whether the next batch (or error) may be ready without waiting."""
        if self._stage is None:
            reorder = self._epoch.reorder
            return len(reorder) > 0 or reorder.failure is not None
        return not self._ready.empty()

    async def _flush_acks(self) -> None:
        """Acknowledge the batches received so far; a failure to is fatal for the epoch."""
        ep = self._epoch
        assert ep.acks is not None
        try:
            await ep.acks.flush()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            exc.add_note(
                "aioloader: acknowledging delivered batches to the source failed; the epoch "
                "ends here. Batches not acknowledged are delivered again by an at-least-once "
                "source when it restarts."
            )
            self._done = True
            ep.fail(exc)
            raise

    async def _next_with_timeout(self) -> Any:
        timeout = self._epoch.plan.timeout
        if timeout <= 0:
            return await self._next_value()
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                return await self._next_value()
        except TimeoutError:
            if not deadline.expired():
                raise  # the batch's own error (a dataset that raised TimeoutError)
            raise LoaderTimeoutError(
                f"DataLoader timed out after {timeout} seconds (no batch arrived in time)"
            ) from None

    async def _next_value(self) -> Any:
        """The next batch, decoded (and pinned/moved when the device stage is on)."""
        ep = self._epoch
        if self._stage is None:
            item = await ep.reorder.get()
            if self._on_demand:
                self._owed_permit = True
            else:
                ep.permits.release()
            idx = ep.reorder.last_idx
            wid, state = _origin(item)
            ep.progress.delivered(idx, wid, state)
            value = self._decode_acked(item, idx)
            self._received = idx
            return value
        ready = await self._ready.get()
        assert self._slots is not None
        self._slots.release()
        if isinstance(ready, Failure):
            raise ready.exc
        if ready is _END:
            raise StopAsyncIteration
        idx, wid, state, value = ready
        ep.progress.delivered(idx, wid, state)
        if isinstance(value, Failure):
            raise value.exc
        self._received = idx
        return value

    async def _feed(self, stage: DeviceStage) -> None:
        """Runs in: a task. reorder buffer -> decode -> device thread (submitted, in order)."""
        slots = self._slots
        assert slots is not None
        ep = self._epoch
        while True:
            await slots.acquire()
            try:
                item = await ep.reorder.get()
            except StopAsyncIteration:
                self._submitted.put_nowait(_END)
                return
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # fatal (worker crash): the consumer raises it
                self._submitted.put_nowait(Failure(exc))
                return
            ep.permits.release()
            idx = ep.reorder.last_idx
            wid, state = _origin(item)
            pending: Any
            try:
                pending = stage.submit(self._decode_acked(item, idx))
            except Exception as exc:  # this batch's error; the epoch goes on, as in torch
                pending = self._batch_failure(idx, exc)
            self._submitted.put_nowait((idx, wid, state, pending))

    async def _finish(self, stage: DeviceStage) -> None:
        """Runs in: a task. Each submitted batch, once pinned and moved -> _ready, in order."""
        try:
            while True:
                entry = await self._submitted.get()
                if entry is _END or isinstance(entry, Failure):
                    self._ready.put_nowait(entry)
                    return
                idx, wid, state, pending = entry
                value: Any = pending
                if not isinstance(pending, Failure):
                    try:
                        value = await stage.finish(pending)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # this batch's error; the epoch goes on
                        value = self._batch_failure(idx, exc)
                self._ready.put_nowait((idx, wid, state, value))
        finally:
            # Ended or cancelled: batches still queued for the thread are never processed.
            self._drop_submitted()

    def _batch_failure(self, idx: int, exc: Exception) -> Failure:
        """Batch ``idx`` failed on its way to the device: delivered as its error, never acked."""
        if self._epoch.acks is not None:
            self._epoch.acks.received(idx, ok=False)
        # A StopAsyncIteration from a custom pin_memory() must not end the epoch.
        return Failure(_user_error(exc, "the batch's pin_memory()"))

    def _drop_submitted(self) -> None:
        while not self._submitted.empty():
            entry = self._submitted.get_nowait()
            if isinstance(entry, tuple) and isinstance(entry[3], asyncio.Future):
                pending = entry[3]
                if pending.done() and not pending.cancelled():
                    pending.exception()  # retrieved: nobody will raise it, nor log it unread
                pending.cancel()

    def _decode_acked(self, item: Any, idx: int) -> Any:
        """:meth:`_decode` of batch ``idx``; a batch that raises instead is never acknowledged."""
        try:
            return self._decode(item)
        except BaseException:
            acks = self._epoch.acks
            if acks is not None:
                acks.received(idx, ok=False)
            raise

    def _decode(self, item: Any) -> Any:
        if isinstance(item, Failure):
            raise item.exc
        res: _worker.Result = item
        data = res.data
        value: Any
        self._pieces = False
        if isinstance(data, Direct):
            value = data.value
            # Not with pool buffers: the pool reads how long the consumer keeps them.
            self._pieces = data.pieces and not data.buffers
            if data.buffers:
                # The pool tells a consumer that keeps batches from waits it would not cure.
                _buffers.delivered(data.buffers)
        elif isinstance(data, _worker.RemoteError):
            self._raised.add(data)
            raise_remote(data)
        elif isinstance(data, Failure):
            raise data.exc
        else:
            raise RuntimeError(f"aioloader bug: unexpected result {type(data).__name__}")
        self._epoch.counters.samples += _batch_len(value, self._epoch.plan.batch_size)
        return value

    async def _unreported_start_error(self) -> _worker.RemoteError | None:
        """A worker's start-up error not raised this epoch, from workers sharing one queue.

        torch hands batches to its workers in turn, so each worker's ``worker_init_fn`` error
        comes with a batch. From a shared queue a worker that started late may get none: its
        error is raised at the end instead. With a ``worker_init_fn`` the end first waits, as
        torch's epoch does, until every worker has started (bounded by ``timeout``).
        """
        plan = self._epoch.plan
        failures = getattr(self._epoch.backend, "start_failures", None)
        if plan.pinned_workers or failures is None:
            return None
        wait = plan.worker_init_fn is not None
        try:
            async with asyncio.timeout(plan.timeout if plan.timeout > 0 else None):
                errors: list[_worker.RemoteError] = await failures(wait=wait)
        except TimeoutError:
            return None
        return next((e for e in errors if e not in self._raised), None)

    def _check_iterable_len(self) -> None:
        plan = self._epoch.plan
        promised = plan.len_promised
        if plan.is_iterable and promised is not None and self._yielded > promised:
            msg = (
                f"Length of IterableDataset {plan.dataset_repr} was reported to be {promised}"
                f"(when accessing len(dataloader)), but {self._yielded} samples have been "
                "fetched. "
            )
            if plan.num_workers > 0:
                msg += (
                    "For multiprocessing data-loading, this could be caused by not properly "
                    "configuring the IterableDataset replica at each worker. Please see "
                    "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                    "for examples."
                )
            warnings.warn(msg, UserWarning, stacklevel=4)


def _origin(item: Any) -> tuple[int | None, Any]:
    """The worker that loaded a reorder-buffer item and its dataset state after it, if known."""
    if isinstance(item, _worker.Result):
        return item.worker_id, item.state
    return None, None


def raise_remote(err: _worker.RemoteError) -> None:
    """Re-raise a worker's exception in this process, as torch does (type kept when possible)."""
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
    if not (isinstance(exc_type, type) and issubclass(exc_type, Exception)):
        exc_type = RuntimeError  # SystemExit & co. in the consumer would end the event loop
    if err.type_name != "RuntimeError" and err.exc_msg.startswith(f"Caught {err.type_name} "):
        # A SystemExit & co. the worker already described in full (RemoteError.capture).
        raise RuntimeError(err.exc_msg)
    wrapper = ExceptionWrapper.__new__(ExceptionWrapper)
    wrapper.exc_type = exc_type
    wrapper.exc_msg = err.exc_msg
    wrapper.where = err.where
    if exc_type is RuntimeError and err.type_name != "RuntimeError":
        wrapper.where = f"{err.where} (original type {err.type_name} cannot be rebuilt here)"
    wrapper.reraise()  # type: ignore[no-untyped-call]


def _batch_len(value: Any, batch_size: int | None) -> int:
    if batch_size is None:
        return 1
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return int(value.size(0))  # not shape[0]: a nested tensor has no shape
    if isinstance(value, (list, tuple)) and value:
        return _batch_len(value[0], batch_size)
    if isinstance(value, dict) and value:
        return _batch_len(next(iter(value.values())), batch_size)
    return int(batch_size)
