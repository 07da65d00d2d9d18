"""Stream stage: an async source -> windows of samples -> workers. Runs in: the event loop.

Replaces the index scheduler (``_scheduler``) when the dataset is an *async source*:

* an **async iterable** (an ``async def`` generator, or any object with ``__aiter__``): one reader
  task drains it into a buffer of ``batch_size`` samples; a window closes when it holds
  ``batch_size`` samples or when ``max_batch_latency`` seconds have passed since its first sample
  arrived, whichever comes first;
* an **async map-style dataset** (``async def __getitem__`` or ``__getitems__``) with
  ``fetch_in="loop"``: the sampler's index batches are fetched on the loop, at most
  ``source_concurrency`` calls at a time, several batches ahead, under the loader's
  ``FetchPolicy`` (see ``_remote``). With ``fetch_in="workers"`` such a dataset takes the index
  path instead and each worker fetches (``_remote.WorkerFetcher``).

Each closed window becomes one :class:`~aioloader._worker.Samples` task with the next ``send_idx``,
so ordering, the in-flight bound, crash recovery and the consumer are the index path's own; the
workers apply ``transform`` per sample and then ``collate_fn``.

Backpressure: a window is opened only with a permit in hand (the same ``max_in_flight`` permits
the index path uses, returned when the consumer receives a batch), so when the consumer falls
behind nothing more is read. Samples read and not yet delivered never exceed
``max_in_flight * batch_size`` (windows in flight, the open one included) ``+ batch_size`` (the
reader's buffer) ``+ 1`` (the sample the reader holds while the buffer is full).

Acknowledgement: when the source has an ``ack`` method, :class:`Acks` remembers each submitted
window's samples and calls ``source.ack(samples)`` once per batch, in delivery order, when the
consumer asks for the *next* batch (its loop body finished with this one) or reaches the end of
the epoch. A batch that was never delivered (``break``, cancellation, an error at its position)
is never acknowledged; neither is the last batch of an epoch left by ``break``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from torch.utils.data import IterableDataset

from ._looplane import MIN_IDLE, LoopLane
from ._records import Failure, Flight, Host, StreamInput
from ._remote import FetchPolicy, SampleFetcher
from ._resume import batch_seed
from ._sampling import IndexStream
from ._scheduler import SubmitSide
from ._tasks import start_task
from ._worker import Samples

__all__ = ("Acks", "run_stream_scheduler", "source_kind", "user_error")

_logger = logging.getLogger(__name__)

#: A window's samples go ahead to its worker only if the source's last wait took this long.
AHEAD_MIN_WAIT_S = 0.00025

#: Loop turns a paced window from the loop lane waits at most for the consumer to take it.
HANDOVER_TURNS = 4

#: How long a source left early (break, aclose(), an error) gets to stop once cancelled,
#: cancelled again and again meanwhile, before it is given up on and left running.
SOURCE_STOP_S = 5.0


class StreamSide(SubmitSide, Protocol):
    """What the stream scheduler uses of its epoch: the scheduler's, and the acknowledgements."""

    acks: Acks | None
    window_ahead: tuple[int, Any] | None
    window_cost: tuple[float, float] | None

    @property
    def host(self) -> Host: ...

    def prefeed(self, send_idx: int, worker_id: int | None, samples: Any) -> bool: ...


def user_error(exc: BaseException, what: str) -> BaseException:
    """What to raise at a batch's position for ``exc``, raised by user code ``what`` on the loop.

    ``StopAsyncIteration``/``StopIteration`` would end the consumer's ``async for`` silently,
    and a ``CancelledError`` the loader did not ask for would read as the consumer's own
    cancellation; any other ``BaseException`` that is not an ``Exception`` would kill the task
    that reads the source without a word. Each becomes a ``RuntimeError`` that names it (as
    PEP 479 does for generators, and as the workers do for what user code raises there);
    ``KeyboardInterrupt`` and ``SystemExit`` are never passed here: they stop the event loop.
    """
    if isinstance(exc, Exception) and not isinstance(exc, (StopAsyncIteration, StopIteration)):
        return exc
    err = RuntimeError(f"{what} raised {type(exc).__name__}")
    err.__cause__ = exc
    return err


def _ours(exc: BaseException) -> bool:
    """Whether a CancelledError here is a cancellation of this task (not the source's own)."""
    task = asyncio.current_task()
    return isinstance(exc, asyncio.CancelledError) and task is not None and task.cancelling() > 0


def source_kind(dataset: object) -> str | None:
    """``"iterable"`` for an async iterable, ``"map"`` for an async map-style dataset, or None."""
    cls = type(dataset)
    if hasattr(cls, "__aiter__"):
        return "iterable"
    for name in ("__getitems__", "__getitem__"):
        if inspect.iscoroutinefunction(getattr(cls, name, None)):
            return "map"
    return None


def check_latency(value: object) -> float | None:
    if value is None:
        return None
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            "max_batch_latency should be a positive number of seconds (a batch closes that long "
            f"after its first sample arrived, or when it is full), or None, got {value!r}"
        )
    return float(value)


class Acks:
    """Acknowledges delivered batches to the source, in delivery order. See the module docstring."""

    def __init__(self, ack: Callable[[list[Any]], Any]) -> None:
        self._ack = ack
        self._submitted: dict[int, Samples] = {}
        self._received: list[Samples] = []

    def submitted(self, send_idx: int, samples: Samples) -> None:
        self._submitted[send_idx] = samples

    def received(self, send_idx: int | None, ok: bool) -> None:
        """The consumer got batch ``send_idx`` (``ok``) or its error (never acknowledged)."""
        if send_idx is None:
            return
        samples = self._submitted.pop(send_idx, None)
        if ok and samples is not None:
            self._received.append(samples)

    async def flush(self) -> None:
        """Acknowledge every batch received so far, oldest first."""
        while self._received:
            samples = self._received.pop(0)
            try:
                result = self._ack(list(samples))
                if inspect.isawaitable(result):
                    await result
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                err = user_error(exc, "the source's ack()")
                if _ours(exc) or err is exc:
                    raise
                raise err from exc


async def run_stream_scheduler(epoch: StreamSide) -> None:
    """Submit the epoch's windows of samples, then close the reorder buffer at the end."""
    stream = epoch.plan.stream
    assert stream is not None
    try:
        if stream.kind == "iterable":
            await _run_iterable(epoch, stream)
        else:
            await _run_map(epoch, stream)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # a bug of ours: surface it rather than hang the consumer
        epoch.fail(exc)


def _submit(epoch: StreamSide, send_idx: int, samples: Samples, wid: int | None) -> None:
    if epoch.acks is not None:
        epoch.acks.submitted(send_idx, samples)
    seed = None
    if epoch.plan.seeding == "batch":
        seed = batch_seed(epoch.base_seed, epoch.progress.epoch, send_idx)
    epoch.in_flight[send_idx] = Flight(samples, wid, None, seed)
    epoch.submit(send_idx)


def _deliver_local(
    epoch: StreamSide, send_idx: int, samples: Samples, wid: int | None, result: Any
) -> None:
    """Hand over a window the loop lane loaded, as its worker's result would be."""
    if epoch.acks is not None:
        epoch.acks.submitted(send_idx, samples)
    if wid is not None:
        epoch.outstanding[wid] -= 1
        epoch.arrived.set()
    epoch.reorder.put(send_idx, result)


async def _permit(epoch: StreamSide) -> tuple[bool, int | None]:
    """Wait for a permit and a running epoch; (False, None) if the epoch ended meanwhile."""
    await epoch.permits.acquire()
    await epoch.resumed.wait()
    if epoch.terminal:
        return False, None
    wid = epoch.consumer.pick_worker() if epoch.plan.pinned_workers else None
    if wid is not None:
        epoch.outstanding[wid] += 1
    return True, wid


class _End(NamedTuple):
    """The reader's last item: the source ran dry (``error`` None) or raised ``error``."""

    error: BaseException | None


class _Reader:
    """Runs in: one task per epoch. Source -> a bounded buffer of samples, each with its arrival.

    Reading in one task and draining the buffer without suspending keeps the cost per sample
    low; waiting for the source sample by sample cost ~100 us each. The buffer is two deques
    (samples, arrival times), not a queue of pairs: the reader appends with no coroutine, pair or
    queue operation per sample, and the window builder takes everything there with one
    ``extend`` (see :meth:`take`). At most ``size`` samples wait in it, and the reader holds
    one more while it is full.
    """

    def __init__(self, source: Any, size: int) -> None:
        self.source = source
        self.size = size
        self.samples: collections.deque[Any] = collections.deque()
        self.arrived: collections.deque[float] = collections.deque()
        #: Set after the last sample: the source ran dry or failed.
        self.end: _End | None = None
        self.stopping = False
        #: The reader awaits the source's next sample (not room in the buffer, not its turn).
        self.in_source = False
        # An AsyncIterableDataset's client (__aenter__/__aexit__) lives as long as the read, as
        # in a worker. Any other async iterable (a stream such as RedisStreamSource) is the
        # caller's to enter and close: it outlives epochs, and its acks come after the read.
        self.client = (
            SampleFetcher(source, FetchPolicy(), 1) if isinstance(source, IterableDataset) else None
        )
        self._data: asyncio.Future[None] | None = None  # the builder, waiting for a sample
        self._room: asyncio.Future[None] | None = None  # the reader, waiting for room

    def ready(self) -> bool:
        """Whether a sample (or the end) waits."""
        return bool(self.samples) or self.end is not None

    async def wait(self) -> None:
        """Until :meth:`ready`. Cancel-safe: nothing is taken."""
        while not self.ready():
            self._data = asyncio.get_running_loop().create_future()
            try:
                await self._data
            finally:
                self._data = None

    def take(self, window: list[Any], n: int) -> float:
        """Move up to ``n`` waiting samples (at least one must wait) to ``window``; the arrival
        time of the first one moved."""
        samples, arrived = self.samples, self.arrived
        first = arrived[0]
        if n >= len(samples):
            window.extend(samples)
            samples.clear()
            arrived.clear()
        else:
            pop, pop_time = samples.popleft, arrived.popleft
            for _ in range(n):
                window.append(pop())
                pop_time()
        self._wake(self._room)
        return first

    @staticmethod
    def _wake(fut: asyncio.Future[None] | None) -> None:
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _finish(self, end: _End) -> None:
        self.end = end
        self._wake(self._data)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        samples, arrived, size, now = self.samples, self.arrived, self.size, loop.time
        it: Any = None
        try:
            if self.client is not None:
                await self.client.open()
            it = aiter(self.source)
            self.in_source = True
            async for sample in it:
                self.in_source = False
                if self.stopping:
                    return
                t = now()
                # Full: hold this sample until there is room (then read the next), as a queue's
                # put() would.
                while len(samples) >= size and not self.stopping:
                    self._room = loop.create_future()
                    try:
                        await self._room
                    finally:
                        self._room = None
                samples.append(sample)
                arrived.append(t)
                if self._data is not None:
                    self._wake(self._data)
                self.in_source = True
            self.in_source = False
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # the source failed: raised at its position in the stream
            if _ours(exc) or self.stopping:
                raise
            # Anything, a CancelledError it raised itself included, must reach the consumer:
            # a reader that just died would leave it waiting for ever.
            self._finish(_End(user_error(exc, "the async source")))
        else:
            if not self.stopping:
                self._finish(_End(None))
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                # A source left early (break, cancellation, a crash) releases what it holds now.
                with contextlib.suppress(Exception):
                    await aclose()
            if self.client is not None:
                await _close_source(self.client)

    async def stop(self, task: asyncio.Task[None]) -> None:
        """End the reader (and so the source) and wait for it.

        Cancelling alone is not enough: a source may swallow the cancellation (a client library
        that turns it into a reconnect) and hand over one more sample, which would then wait
        for room in a full buffer for ever. So the reader is also told to stop, and the buffer
        is emptied until it has.
        """
        self.stopping = True
        loop = asyncio.get_running_loop()
        give_up = loop.time() + SOURCE_STOP_S
        while not task.done():
            # Again each round: a source that swallowed one cancellation (taking it for a
            # dropped connection) and awaits again gets the next one.
            task.cancel()
            self.samples.clear()
            self.arrived.clear()
            self._wake(self._room)  # wakes a reader waiting for room
            if loop.time() >= give_up:
                warnings.warn(
                    f"aioloader: the async source {self.source!r} did not stop within "
                    f"{SOURCE_STOP_S:g} s of being cancelled (it swallows cancellations); it is "
                    "left running on the event loop, and the epoch ends without it",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return
            with contextlib.suppress(BaseException):
                await asyncio.wait([task], timeout=0.05)


async def _run_iterable(epoch: StreamSide, stream: StreamInput) -> None:
    loop = asyncio.get_running_loop()
    size = stream.batch_size if stream.batch_size is not None else 1
    latency = stream.max_batch_latency
    drop_last = bool(epoch.plan.drop_last)
    source = stream.source
    if inspect.isasyncgen(source) and source.ag_frame is None:
        warnings.warn(
            f"aioloader: the async generator {source.__qualname__} was used up (or closed) by an "
            "earlier epoch, so this epoch yields no batches. An async generator streams once: "
            "pass an object whose `async def __aiter__` starts a new stream each time, or a "
            "new loader over a new generator for each epoch",
            RuntimeWarning,
            stacklevel=2,
        )
    # At most one window's worth read ahead of the open window: the backpressure bound.
    reading = _Reader(stream.source, size)
    reader = start_task(loop, reading.run(), name="aioloader-source-reader")
    # Samples of a window still filling go ahead to its worker whenever the source makes the
    # window wait, so their transform runs meanwhile and only the last few are left for when
    # the window closes (produce-to-delivery latency of a fast paced stream). Not with
    # seeding="batch": the transform must run under the batch's seed.
    ahead = stream.transformed and size > 1 and epoch.plan.seeding != "batch"
    # A paced source's cheap windows are transformed and collated here, with no process hop.
    lane = LoopLane(epoch)
    lane_step = max(1, size // 8)
    waited = 0.0  # how long the last wait for the source took
    idle = 0.0  # the share of the last window's filling spent waiting for the source
    send_idx = 0
    try:
        while True:
            local = lane.usable(idle)
            opened, idle_s = loop.time(), 0.0
            ok, wid = await _permit(epoch)
            if not ok:
                return
            window = Samples()
            sent = 0  # samples of the window sent ahead (or, on the lane, transformed)
            deadline: float | None = None
            end: _End | None = None
            while len(window) < size:
                if not reading.ready():
                    # Only when the source kept us waiting last time too: a paced source. One
                    # that hands over control at every sample but has the next one ready at
                    # once would cost a post per sample; an unpaced one never empties the buffer.
                    if local:
                        # The loop is idle until the next sample anyway. A few samples a step:
                        # each step swaps the generators in and out (see _looplane).
                        if len(window) - sent >= lane_step:
                            began = loop.time()
                            sent = await lane.transform(send_idx, window, sent, wid)
                            idle_s += loop.time() - began  # idle time the lane put to use
                    elif (
                        ahead
                        and waited >= AHEAD_MIN_WAIT_S
                        and len(window) > sent
                        and epoch.prefeed(send_idx, wid, Samples(window[sent:]))
                    ):
                        sent = len(window)
                        window.ahead = ((epoch.epoch_no, send_idx), sent)
                        epoch.window_ahead = (send_idx, window)
                    began = loop.time()
                    # Waiting while the reader is inside the source: the source keeps us waiting.
                    # (An unpaced source never suspends, so the reader is never seen there; the
                    # buffer is then only empty until the reader runs again.)
                    in_source = reading.in_source
                    closed = False
                    if deadline is None:
                        await reading.wait()
                    else:
                        remaining = deadline - began
                        if remaining <= 0:
                            break  # closed by time
                        try:
                            async with asyncio.timeout(remaining):
                                await reading.wait()  # cancel-safe: nothing is taken
                        except TimeoutError:
                            closed = True
                    waited = loop.time() - began
                    if in_source:
                        idle_s += waited
                    if closed:
                        break  # closed by time
                if not reading.samples:
                    end = reading.end
                    break
                # Every sample waiting (up to the window's room) in one go.
                arrived = reading.take(window, size - len(window))
                if deadline is None and latency is not None:
                    deadline = arrived + latency
            idle = idle_s / max(loop.time() - opened, 1e-9)
            error = end.error if end is not None else None
            dropped = not window or (drop_last and len(window) < size)
            if end is not None and error is None and dropped:
                epoch.window_ahead = None
                epoch.permits.release()  # nothing (left) to deliver: drop_last as in torch
                break
            result = await lane.finish(send_idx, window, sent, wid) if local and window else None
            await epoch.resumed.wait()  # a crash while reading pauses submission here
            if epoch.terminal:
                return
            if window:
                if result is not None:
                    _deliver_local(epoch, send_idx, window, wid, result)
                    if idle >= MIN_IDLE:
                        # A paced source: let the consumer take the batch before this task
                        # reads on (the next window's first samples may be waiting already,
                        # and their transform would come first). A few turns at most: the
                        # consumer may be busy elsewhere, or wait for an earlier batch.
                        for _ in range(HANDOVER_TURNS):
                            if not epoch.reorder.holds(send_idx):
                                break
                            await asyncio.sleep(0)
                else:
                    _submit(epoch, send_idx, window, wid)
                    epoch.window_ahead = None  # in flight now: a crash is blamed on it there
                send_idx += 1
                if error is not None:
                    ok, _ = await _permit(epoch)
                    if not ok:
                        return
            if error is not None:
                epoch.reorder.put(send_idx, Failure(error))
                send_idx += 1
            if end is not None:
                break
        epoch.reorder.close(send_idx)
    finally:
        epoch.window_ahead = None
        try:
            await reading.stop(reader)
        finally:
            lane.close()


async def _run_map(epoch: StreamSide, stream: StreamInput) -> None:
    indices_stream = IndexStream(
        epoch.plan.index_sampler, batch_sampler=epoch.plan.batch_sampler_given
    )
    # One per epoch: the dataset's client (``__aenter__``) lives as long as the epoch's reads.
    fetcher = SampleFetcher(stream.source, stream.policy, stream.source_concurrency)
    turns = _Turns()
    loop = asyncio.get_running_loop()
    fetches: set[asyncio.Task[None]] = set()
    send_idx = 0
    try:
        while True:
            ok, wid = await _permit(epoch)
            if not ok:
                return
            try:
                indices = await indices_stream.next()
            except StopAsyncIteration:
                epoch.permits.release()
                break
            except Exception as exc:  # the user's sampler failed: raise it at this position
                epoch.reorder.put(send_idx, Failure(exc))
                send_idx += 1
                break
            task = start_task(
                loop,
                _fetch_and_submit(epoch, stream, send_idx, indices, wid, fetcher, turns),
                name=f"aioloader-source-fetch:{send_idx}",
            )
            fetches.add(task)
            task.add_done_callback(fetches.discard)
            send_idx += 1
        epoch.reorder.close(send_idx)
        while fetches:
            await asyncio.wait(list(fetches))
    finally:
        for task in list(fetches):
            task.cancel()
        if fetches:
            with contextlib.suppress(BaseException):
                await asyncio.wait(list(fetches))
        await _close_source(fetcher)


async def _close_source(fetcher: SampleFetcher) -> None:
    """Leave the dataset's async context (its client closes), even in a cancelled task."""
    closing = asyncio.ensure_future(fetcher.close())
    try:
        await asyncio.wait({closing}, timeout=SOURCE_STOP_S)
    except asyncio.CancelledError:  # asyncio.run() ending: give it the same bound, then go
        await asyncio.wait({closing}, timeout=SOURCE_STOP_S)
        raise
    finally:
        if not closing.done():
            closing.cancel()
            _logger.warning(
                "aioloader: the dataset's __aexit__ did not return in %ss", SOURCE_STOP_S
            )
        elif not closing.cancelled() and closing.exception() is not None:
            warnings.warn(
                f"aioloader: the dataset's __aexit__ raised {closing.exception()!r}",
                RuntimeWarning,
                stacklevel=1,
            )


async def _fetch_and_submit(
    epoch: StreamSide,
    stream: StreamInput,
    send_idx: int,
    indices: Any,
    wid: int | None,
    fetcher: SampleFetcher,
    turns: _Turns,
) -> None:
    try:
        try:
            samples = Samples(await fetcher.samples(indices, stream.batch_size is not None))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # __getitem__ raised: at this batch's position, as torch
            if _ours(exc):
                raise
            if not epoch.terminal:
                what = f"{type(stream.source).__name__}'s async __getitem__"
                epoch.reorder.put(send_idx, Failure(user_error(exc, what)))
            return
        # Batches reach the workers in send_idx order whatever order their fetches finish in:
        # a worker's transforms draw from its seeded RNG in the order torch's would.
        await turns.wait(send_idx)
        await epoch.resumed.wait()
        if epoch.terminal:
            return
        _submit(epoch, send_idx, samples, wid)
    finally:
        turns.done(send_idx)


class _Turns:
    """Lets ``send_idx`` go once every smaller one went (was submitted, failed or gave up)."""

    def __init__(self) -> None:
        self._next = 0
        self._finished: set[int] = set()
        self._waiters: dict[int, asyncio.Future[None]] = {}

    async def wait(self, send_idx: int) -> None:
        if send_idx > self._next:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[send_idx] = waiter
            try:
                await waiter
            finally:
                self._waiters.pop(send_idx, None)

    def done(self, send_idx: int) -> None:
        self._finished.add(send_idx)
        while self._next in self._finished:
            self._finished.discard(self._next)
            self._next += 1
        waiter = self._waiters.get(self._next)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
