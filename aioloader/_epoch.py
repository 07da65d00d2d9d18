"""One epoch: its state machine and the table of batches in flight. Runs in: the event loop.

An epoch is one pass over the sampler. Its life is one explicit :class:`Phase`, changed only by
:meth:`Epoch._to` (transitions between running phases) and :meth:`Epoch.end` (the single way into
a terminal phase), so the stages it drives cannot race on flags::

    CREATED -> STARTING -> RUNNING <-> RECOVERING
                  |           |            |
                  +-----------+------------+--> FINISHED | FAILED | ENDED   (terminal)

* the scheduler (``_scheduler``) submits index batches while the phase is RUNNING;
* the recovery (``_recovery``) owns RECOVERING (entered and left through
  :meth:`Epoch.enter_recovery` and :meth:`Epoch.leave_recovery`): one task replaces crashed
  workers and absorbs any further crash while it runs;
* the consumer (``_consumer``) turns the reorder buffer's items into batches (through the device
  stage when there is one) and moves the epoch to FINISHED when it received the end.

:meth:`Epoch.end` wakes every waiter with the epoch's reason, cancels what is queued, and decides
once what happens to the workers: an epoch's own workers are shut down; a persistent pool (held by
the loader's ``_pools.PersistentPool``) is kept only if the epoch ended while it was healthy, and
retired otherwise so no later epoch inherits a crash.

Invariant: ``submitted - delivered - skipped == permits held <= max_in_flight``. A permit returns
when the *consumer receives* a batch (or an exhausted iterable worker's index is skipped), so a
straggler can never make the reorder buffer grow past ``max_in_flight`` batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import heapq
import logging
import math
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import connection as mp_connection
from typing import Any

from . import _buffers, _codec, _worker
from ._backend import Backend, Direct
from ._consumer import Consumer
from ._errors import EpochEndedError, LoaderTimeoutError, emfile_error
from ._looplane import average
from ._phase import TERMINAL, Phase
from ._records import Counters, Failure, Flight, Host, Plan
from ._recovery import Recovery, start_error, start_failure
from ._reorder import ReorderBuffer
from ._resume import Progress
from ._scheduler import run_scheduler
from ._stream import Acks, run_stream_scheduler
from ._tasks import start_task

__all__ = ("Epoch", "Phase")

_logger = logging.getLogger(__name__)


_ALLOWED = {
    Phase.CREATED: {Phase.STARTING},
    Phase.STARTING: {Phase.RUNNING},
    Phase.RUNNING: {Phase.RECOVERING},
    Phase.RECOVERING: {Phase.RUNNING},
}


class Epoch:
    """One pass over the sampler; see the module docstring for the phases."""

    @property
    def host(self) -> Host:
        host = self._host_ref()
        if host is None:
            raise RuntimeError("aioloader bug: an epoch outlived its loader and its iterator")
        return host

    def __init__(
        self,
        plan: Plan,
        host: Host,
        counters: Counters,
        epoch_no: int,
        base_seed: int,
        progress: Progress,
        *,
        replay: bool = False,
        shared_seed: int | None = None,
    ) -> None:
        #: The settings this epoch runs from, fixed when its ``async for`` began.
        self.plan = plan
        self.counters = counters
        # Weak: the epoch and its stages form reference cycles (each stage holds the epoch), and
        # a cycle that held the loader would keep a dropped loader, and its persistent workers,
        # alive until a garbage collection. The epoch's iterator holds the loader instead.
        self._host_ref = weakref.ref(host)
        self.epoch_no = epoch_no
        self.base_seed = base_seed
        #: An ``IterDataPipe``'s seed for its random DataPipes this epoch (torch's shared seed).
        self.shared_seed = shared_seed
        self.phase = Phase.CREATED
        # What the consumer received, for state_dict(); a resumed epoch starts past it.
        self.progress = progress
        self.replay = replay
        # Iterable datasets resuming: worker id -> dataset state to load before its first batch.
        self.resume_states: dict[int, Any] = {}
        start = progress.resume_from
        self.reorder: ReorderBuffer[Any] = ReorderBuffer(
            plan.in_order,
            start=start.low if start is not None else 0,
            done=start.above if start is not None else None,
        )
        self.max_in_flight = plan.max_in_flight
        self.permits = asyncio.Semaphore(self.max_in_flight)
        # Set while submissions may go on (RUNNING); cleared during recovery.
        self.resumed = asyncio.Event()
        self.in_flight: dict[int, Flight] = {}
        # Pinned workers: batches submitted to each and not yet back, and an event set when one
        # comes back (in_order=False hands a batch only to a worker below its share).
        self.outstanding = [0] * max(1, plan.num_workers)
        self.arrived = asyncio.Event()
        self.backend: Backend | None = None
        self.owns_backend = False
        # Bumped when a crash is accepted: every future of the dead workers is stale from then.
        self.generation = 0
        # Set by the stream scheduler while an open window's samples are with a worker.
        self.window_ahead: tuple[int, Any] | None = None
        #: An async source's windows as the workers timed them: moving averages of a window's
        #: seconds (transform and collate) and samples; None until one came back. Read by the
        #: loop lane (``_looplane``).
        self.window_cost: tuple[float, float] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None
        self.started_at: float | None = None
        self.recovery = Recovery(self)
        # An async source with an ``ack`` method: delivered batches are acknowledged to it.
        stream = plan.stream
        self.acks = Acks(stream.ack) if stream is not None and stream.ack is not None else None
        self.consumer = Consumer(self)
        self._watched: list[int] = []
        self._start_task: asyncio.Task[None] | None = None
        self._sched_task: asyncio.Task[None] | None = None
        self._ended_from: Phase | None = None
        # Why the epoch ended early, raised again to a consumer that keeps asking (None: the
        # consumer ended it itself, and then gets StopAsyncIteration).
        self.end_reason: BaseException | None = None
        #: The fatal error of a FAILED epoch.
        self.failure: BaseException | None = None
        self._cleanup_task: asyncio.Task[None] | None = None
        self._guard_task: asyncio.Task[None] | None = None
        self._ended = asyncio.Event()
        # Batches of Python objects waiting to be rebuilt on the loop, lowest send_idx first,
        # by one callback per loop turn (_rebuild_turn): however many arrive together, the
        # loop spends one step's budget on them per turn, not one step per batch.
        self._rebuilds: list[tuple[int, int, int, Future[Any], Rebuild]] = []
        self._rebuild_seq = 0
        self._rebuild_queued = False

    def __repr__(self) -> str:
        return f"<Epoch {self.epoch_no} {self.phase.value}>"

    def in_flight_count(self) -> int:
        return len(self.in_flight) + len(self.reorder)

    # ------------------------------------------------------------------------------ phases

    def _to(self, phase: Phase) -> None:
        """Move between non-terminal phases; a terminal phase is entered only through end()."""
        if phase not in _ALLOWED.get(self.phase, set()):
            raise RuntimeError(f"aioloader bug: epoch phase {self.phase.value} -> {phase.value}")
        _logger.debug("epoch %d: %s -> %s", self.epoch_no, self.phase.value, phase.value)
        self.phase = phase
        if phase is Phase.RUNNING:
            self.resumed.set()
        else:
            self.resumed.clear()

    def enter_recovery(self) -> None:
        """RUNNING -> RECOVERING: submissions pause until :meth:`leave_recovery`."""
        self._to(Phase.RECOVERING)

    def leave_recovery(self) -> None:
        """RECOVERING -> RUNNING: the replacement workers hold every batch in flight."""
        self._to(Phase.RUNNING)

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL

    def end(self, phase: Phase, reason: BaseException | None = None) -> bool:
        """Enter terminal ``phase`` (the only way to): wake waiters, cancel work, release workers.

        ``reason`` is raised to a consumer waiting now or asking later (for FAILED: the fatal
        error). Returns False if the epoch had already ended. Safe from any thread: called off
        the loop's thread (garbage collection), it hands itself over to the loop.
        """
        if phase not in TERMINAL:
            raise RuntimeError(f"aioloader bug: end() with non-terminal {phase.value}")
        if self.terminal:
            return False
        loop = self.loop
        if loop is not None and threading.get_ident() != self.loop_thread:
            # Another thread (the garbage collector running there): the loop owns this epoch.
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(self.end, phase, reason)
                return True
        if loop is not None and not loop.is_running():
            self._end_without_loop(phase)  # e.g. collected after asyncio.run() returned
            return True
        _logger.debug("epoch %d: %s -> %s (%r)", self.epoch_no, self.phase.value, phase, reason)
        self._ended_from = self.phase
        self.phase = phase
        self.end_reason = reason if phase is Phase.ENDED else None
        self.failure = reason if phase is Phase.FAILED else None
        self.resumed.set()  # a scheduler waiting for a recovery wakes and sees the end
        self.arrived.set()  # ... or for a worker with room
        self._ended.set()
        self.unwatch()
        # Wake a consumer waiting in the reorder buffer: with the reason, or with the end when
        # the consumer's own side ended the epoch (the iterator's aclose() from another task).
        self.reorder.fail(reason if reason is not None else StopAsyncIteration())
        self.consumer.on_end(reason)
        current = asyncio.current_task() if loop is not None else None
        for task in (self._start_task, self._sched_task, self.recovery.task):
            if task is not None and task is not current and not task.done():
                task.cancel()
        for flight in self.in_flight.values():
            if flight.future is not None:
                flight.future.cancel()
        self._decide_backend_fate()
        host = self._host_ref()  # None: the loader went first (its iterator freed by the GC)
        if host is not None:
            host.epoch_ended(self)
        if loop is None:
            return True  # never started: nothing to release
        self._cleanup_task = start_task(
            loop, self._cleanup(), name=f"aioloader-cleanup:{self.epoch_no}"
        )
        if host is not None:
            host.track_cleanup(self._cleanup_task)
        return True

    async def _guard(self) -> None:
        """Ends the epoch if the event loop shuts down under it, and finishes the cleanup.

        ``asyncio.run`` cancels every task when its main coroutine returns, an unclosed loader's
        epochs included, and then closes the loop: without this the workers and the device
        thread would outlive it. This task is among those it waits for.
        """
        try:
            await self._ended.wait()
            return
        except asyncio.CancelledError:
            self.end(
                Phase.ENDED,
                EpochEndedError(f"epoch {self.epoch_no} ended because its event loop shut down"),
            )
            waits = [t for t in [self._cleanup_task] if t is not None]
            # The loop is going away: persistent workers cannot serve another epoch on it. A
            # loader already gone (collected together with its iterator) stopped its own pool.
            host = self._host_ref()
            pool = host.pool_keeper().detach() if host is not None else None
            if pool is not None:
                waits.append(asyncio.ensure_future(pool.shutdown(graceful=False)))
            for task in waits:
                while not task.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([task])
            raise

    def fail(self, exc: BaseException) -> None:
        """A fatal error: the consumer raises ``exc`` next; the workers go at once."""
        self.end(Phase.FAILED, exc)

    def _decide_backend_fate(self) -> None:
        """Decide, once and at once, whether a persistent pool outlives this epoch.

        It is kept only if the epoch finished, or was abandoned while RUNNING; after a failure
        or an end during recovery it is retired from the loader's keeper now (so a new epoch
        cannot pick it up while it is being torn down) and the cleanup shuts it down like the
        epoch's own. The keeper holds the pool; this method only judges its health.
        """
        if self.backend is None or self.owns_backend:
            return
        host = self._host_ref()
        if host is None:  # the loader is gone (its __del__ stops the pool): no next epoch
            self.owns_backend = True
            return
        healthy = self.phase is Phase.FINISHED or (
            self.phase is Phase.ENDED and self._ended_from is Phase.RUNNING
        )
        if healthy and (self._worker_died() or start_error(self.backend) is not None):
            # A death not handled yet, or workers that could not start: the next epoch must
            # not inherit it. (A start failing later is reported to the next epoch by watch().)
            healthy = False
        if healthy:
            host.pool_keeper().keep(busy=bool(self.in_flight))
            self.backend = None  # the keeper holds it
        else:
            host.pool_keeper().retire(self.backend)
            self.owns_backend = True

    def _worker_died(self) -> bool:
        """Whether a worker of the current backend has exited (its sentinel is readable)."""
        if self.backend is None:
            return False
        sentinels = self.backend.sentinels()
        return bool(sentinels) and bool(mp_connection.wait(sentinels, timeout=0))

    def _end_without_loop(self, phase: Phase) -> None:
        """The loop is not running (closed, or gone): release what can be released now."""
        self._ended_from = self.phase
        self.phase = phase
        self._decide_backend_fate()
        self.consumer.close_nowait()
        self._drop_rebuilds()
        backend, self.backend = self.backend, None
        if backend is not None and self.owns_backend:
            backend.kill_sync()
        self.host.epoch_ended(self)

    async def _cleanup(self) -> None:
        """Release the epoch's resources. Finishes even if cancelled (``asyncio.run`` exit)."""
        cancelled: asyncio.CancelledError | None = None
        for task in (self._start_task, self._sched_task, self.recovery.task):
            if task is None:
                continue
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError as exc:  # go on: the workers must still be released
                cancelled = exc
        try:
            await self.consumer.aclose()
        except asyncio.CancelledError as exc:
            cancelled = exc
        except Exception:  # releasing the workers below matters more
            _logger.exception("aioloader: stopping the device stage failed")
        self.reorder.drain()  # decoded batches: dropping them frees their shared memory
        self._drop_rebuilds()
        try:
            await self._release_backend()
        except asyncio.CancelledError as exc:
            cancelled = exc
        # The finished tasks' cancellation tracebacks hold their frames, and so the loader: a
        # reference from this epoch's cycle would keep a dropped loader alive until a collection.
        self._start_task = self._sched_task = None
        self.recovery.task = None
        if cancelled is not None:
            raise cancelled

    async def _release_backend(self) -> None:
        """Shut down the workers this epoch owns (its own, or a retired persistent pool)."""
        backend, owned = self.backend, self.owns_backend
        self.backend, self.owns_backend = None, False
        if backend is not None and owned:
            graceful = self.phase is Phase.FINISHED and not self.in_flight
            abandon = getattr(backend, "abandon_stuck_calls", None)
            if isinstance(self.failure, LoaderTimeoutError) and abandon is not None:
                abandon()  # a thread stuck in the dataset is not waited for (docs/errors.md)
            await backend.shutdown(graceful=graceful)

    async def wait_cleanup(self) -> None:
        if self._cleanup_task is not None:
            await asyncio.wait([self._cleanup_task])

    # ------------------------------------------------------------------------------ start-up

    async def ensure_started(self) -> None:
        """Start the workers on the first request; later calls return at once.

        Cancelling the caller does not wait for workers that are still starting: the epoch
        ends and its cleanup (awaited by ``aclose()``) releases them once they are up.
        """
        if self._start_task is None:
            if self.terminal:
                # Ended before its start, or long enough ago that its cleanup dropped the start
                # task: nothing to start; the consumer reads the end (or the failure) from the
                # reorder buffer, as it would from a running epoch.
                return
            loop = asyncio.get_running_loop()
            self.host.check_loop(loop, "start an epoch")
            self.loop = loop
            self.loop_thread = threading.get_ident()
            self.started_at = time.perf_counter()
            self._to(Phase.STARTING)
            self._guard_task = start_task(
                loop, self._guard(), name=f"aioloader-guard:{self.epoch_no}"
            )
            self._start_task = start_task(
                loop, self._start(), name=f"aioloader-start:{self.epoch_no}"
            )
        if not self._start_task.done():
            await asyncio.shield(self._start_task)
        if not self._start_task.cancelled():
            self._start_task.result()

    async def _start(self) -> None:
        try:
            backend, owned = await self.host.acquire_backend(self.plan, self.base_seed)
        except Exception as exc:
            failure = start_failure(exc)
            if failure is not exc:
                raise failure from exc
            raise
        if self.terminal:  # ended while the workers started
            if owned:
                await backend.shutdown(graceful=False)
            return
        self.install(backend, owned)
        loop = asyncio.get_running_loop()
        self._to(Phase.RUNNING)
        schedule = run_scheduler if self.plan.stream is None else run_stream_scheduler
        self._sched_task = start_task(
            loop, schedule(self), name=f"aioloader-scheduler:{self.epoch_no}"
        )
        self.consumer.start()

    def adopt(self, old: Backend, new: Backend) -> None:
        """Crash recovery replaced ``old`` with ``new``: they are the epoch's workers now."""
        self.host.backend_replaced(old, new)
        self.install(new)

    def install(self, backend: Backend, owned: bool | None = None) -> None:
        """Make ``backend`` the epoch's workers (at start, or a replacement after a crash)."""
        self.backend = backend
        if owned is not None:
            self.owns_backend = owned
        self._watch()

    # ------------------------------------------------------------------------------ submission

    def prefeed(self, send_idx: int, worker_id: int | None, samples: Any) -> bool:
        """Send samples of the open window ``send_idx`` ahead to its worker, if the backend can
        (see ``_stream``); whether they were sent."""
        backend = self.backend
        post = getattr(backend, "prefeed", None)
        if post is None or self.phase is not Phase.RUNNING:
            return False
        try:
            return bool(post(worker_id, (self.epoch_no, send_idx), samples))
        except Exception:  # an optimisation only: the window's task carries every sample
            _logger.debug("prefeed of send_idx=%d failed", send_idx, exc_info=True)
            return False

    def submit(self, send_idx: int) -> None:
        """Send the in-flight entry ``send_idx`` to the workers (again, after a recovery)."""
        flight = self.in_flight[send_idx]
        backend = self.backend
        if backend is None or (self.phase is not Phase.RUNNING and not self.recovery.resubmitting):
            return  # the recovery resubmits every entry once new workers are up
        gen = self.generation
        try:
            fut = backend.submit(send_idx, flight.task(), self.epoch_no, flight.worker_id)
        except BrokenProcessPool:
            self.recovery.on_crash(gen)
            return
        except RuntimeError:
            if self.terminal:  # a persistent pool shut down under us (aclose() racing)
                return
            raise
        self.in_flight[send_idx] = flight._replace(future=fut)
        loop = self.loop
        assert loop is not None
        loop_thread = self.loop_thread

        def done(f: Future[Any]) -> None:
            # Runs in: the loop (a pinned worker's lane, see _procpool.Lane), or the thread that
            # completed the future (an executor's manager thread, a crash, Ray or thread workers).
            # Unpickled where it arrives: a batch's descriptors are waiting on its worker's
            # channel already (see _channel.FdChannel), so this does not wait for the worker.
            # A batch of many Python objects comes in pieces, rebuilt on the loop a bounded
            # step at a time (a thread would hold the GIL, and so the loop, throughout).
            received = receive(f, stepwise=True)
            if type(received) is Rebuild:
                if threading.get_ident() == loop_thread:
                    self._queue_rebuild(send_idx, gen, f, received)
                    return
                with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
                    loop.call_soon_threadsafe(self._queue_rebuild, send_idx, gen, f, received)
                return
            with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
                if threading.get_ident() == loop_thread:
                    # A stale lane result can arrive on a later loop of this thread (persistent
                    # workers over two asyncio.run calls): this epoch's loop is closed then.
                    loop.call_soon(self._on_done, send_idx, gen, f, received)
                    return
                loop.call_soon_threadsafe(self._on_done, send_idx, gen, f, received)

        fut.add_done_callback(done)

    def _queue_rebuild(self, send_idx: int, gen: int, fut: Future[Any], rebuild: Rebuild) -> None:
        """A batch in pieces arrived: rebuild it in the loop's coming turns. Runs on the loop."""
        if self.terminal or gen != self.generation:
            rebuild.close()  # ended, or resubmitted to replacement workers
            return
        self._rebuild_seq += 1
        heapq.heappush(self._rebuilds, (send_idx, gen, self._rebuild_seq, fut, rebuild))
        self._queue_rebuild_turn()

    def _queue_rebuild_turn(self) -> None:
        if self._rebuild_queued:
            return
        loop = self.loop
        if loop is None:
            return
        self._rebuild_queued = True
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
            # Behind every callback ready now: a service's requests run between the steps.
            # On the epoch's own loop: a stale result can reach a later loop of this thread.
            loop.call_soon(self._rebuild_turn)

    def _rebuild_turn(self) -> None:
        """Rebuild queued batches for one step's budget, the one the consumer needs first
        first, handing each on once complete; again next turn while any is left. One batch at
        a time also keeps few half-built ones alive: the garbage collector's young generation,
        which it walks every few hundred new containers, holds less."""
        self._rebuild_queued = False
        rebuilds = self._rebuilds
        if self.terminal or any(entry[1] != self.generation for entry in rebuilds):
            # Ended, or resubmitted to replacement workers: every stale one gives back its
            # descriptors now, not when it reaches the top.
            self._rebuilds = rebuilds = [e for e in rebuilds if not self._stale(e)]
            heapq.heapify(rebuilds)
        deadline = time.perf_counter() + _codec.DECODE_STEP_S
        while rebuilds:
            if self._stale(rebuilds[0]):  # _on_done below may end the epoch, or bump gen
                heapq.heappop(rebuilds)
                continue
            send_idx, gen, _, fut, rebuild = rebuilds[0]
            received = rebuild.step(max(0.0, deadline - time.perf_counter()))
            if received is None:
                break  # the budget is spent
            heapq.heappop(rebuilds)
            self._on_done(send_idx, gen, fut, received)
            if time.perf_counter() >= deadline:
                break
        if rebuilds:
            self._queue_rebuild_turn()

    def _stale(self, entry: tuple[int, int, int, Future[Any], Rebuild]) -> bool:
        if self.terminal or entry[1] != self.generation:
            entry[4].close()
            return True
        return False

    def _drop_rebuilds(self) -> None:
        """Give back what unfinished rebuilds hold (the epoch is over)."""
        rebuilds, self._rebuilds = self._rebuilds, []
        for *_, rebuild in rebuilds:
            rebuild.close()

    def _on_done(self, send_idx: int, gen: int, fut: Future[Any], received: Any) -> None:
        if self.terminal or gen != self.generation or fut.cancelled():
            return  # ended, or resubmitted to replacement workers
        exc = fut.exception()
        if isinstance(exc, BrokenProcessPool):
            self.recovery.on_crash(gen)
            return
        flight = self.in_flight.pop(send_idx, None)
        if flight is None:
            return
        if exc is not None:
            self.reorder.put(send_idx, Failure(exc))
            return
        res: _worker.Result = received
        if isinstance(res.data, Lost) and self._worker_died():
            # The batch's shared memory went with a worker that died just after sending it:
            # that is a crash (its sentinel callback may simply not have run yet), and the
            # batch is loaded again like every other one in flight.
            self.in_flight[send_idx] = flight
            self.recovery.on_crash(gen)
            return
        self.counters.busy_s += res.busy_s
        if type(flight.indices) is _worker.Samples:
            last = self.window_cost
            size = len(flight.indices)
            self.window_cost = (
                average(None if last is None else last[0], res.busy_s),
                average(None if last is None else last[1], size),
            )
        if flight.worker_id is not None:
            self.outstanding[flight.worker_id] -= 1
            self.arrived.set()
        if isinstance(res.data, _worker.Exhausted):
            self.consumer.worker_exhausted(res.data.worker_id)
            self.progress.exhausted(res.data.worker_id, res.state)
            self.reorder.skip(send_idx)
            self.permits.release()
            return
        self.reorder.put(send_idx, res)

    # ------------------------------------------------------------------------------ crashes

    def _watch(self) -> None:
        """Watch the worker processes' sentinels on the loop: a death is noticed at once.

        The executor reports a dead worker too, but not always: a worker killed while writing a
        result larger than the pipe buffer leaves the executor's thread waiting for the rest of
        it, forever. Watching the processes directly does not depend on that thread.
        """
        self.unwatch()
        if self.backend is None or self.loop is None:
            return
        gen = self.generation
        loop = self.loop
        # A pool that starts its workers in waves (WorkerPool) says when the rest are up.
        watch = getattr(self.backend, "watch", None)
        if watch is not None:

            def grown(error: BaseException | None) -> None:  # runs in: the pool's start thread
                with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
                    loop.call_soon_threadsafe(self._on_grown, gen, error)

            sentinels = watch(grown)
        else:
            sentinels = self.backend.sentinels()
        for fd in sentinels:
            loop.add_reader(fd, self._on_sentinel, gen)
            self._watched.append(fd)

    def _on_grown(self, gen: int, error: BaseException | None) -> None:
        if self.terminal or gen != self.generation:
            return
        if error is not None:
            self.fail(start_failure(error))
            return
        self._watch()  # the new workers' sentinels too

    def unwatch(self) -> None:
        loop = self.loop
        for fd in self._watched:
            if loop is not None and not loop.is_closed():
                loop.remove_reader(fd)
        self._watched.clear()

    def _on_sentinel(self, gen: int) -> None:
        self.unwatch()  # a finished process's sentinel stays readable
        self.recovery.on_crash(gen)


class Lost(Failure):
    """A batch whose shared memory could not be received: a crash if its worker is dead."""


def receive(fut: Future[Any], stepwise: bool = False) -> Any:
    """Rebuild a finished task's batch. Runs in: the loop (a lane), or the thread that completed
    the task (an executor's manager thread, a fetch thread).

    Returns the :class:`~aioloader._worker.Result` with its ``data`` decoded into ``Direct`` (or a
    ``Failure`` to raise at the batch's position), or None if the task did not complete; with
    ``stepwise``, a batch that came in pieces is not rebuilt: a :class:`Rebuild` to step through
    is returned instead. Never raises: an exception escaping here would lose the batch.
    """
    if fut.cancelled() or fut.exception() is not None:
        return None
    res: _worker.Result = fut.result()
    if not isinstance(res.data, bytes):
        return res
    rebuild = Rebuild(res)
    if stepwise and _codec.in_pieces(res.data):
        return rebuild
    return rebuild.step()


class Rebuild:
    """A finished task's batch being rebuilt, a step at a time (see
    :class:`~aioloader._codec.PieceDecoder`). Runs in: one thread at a time."""

    def __init__(self, res: _worker.Result) -> None:
        self.res = res
        self.buffers: list[tuple[_buffers.BufferPool, int]] = []
        self.decoder: _codec.PieceDecoder | None = None

    def close(self) -> None:
        """Give back what an unfinished rebuild holds."""
        if self.decoder is not None:
            self.decoder.close()

    def step(self, budget: float = math.inf) -> Any:
        """Rebuild for about ``budget`` seconds: the result as :func:`receive` returns it once
        complete, None before. Never raises."""
        res = self.res
        assert isinstance(res.data, bytes)
        try:
            if self.decoder is None:
                if not _codec.in_pieces(res.data):  # one pickle: loaded at once
                    value = _codec.loads_result(res.data, self.buffers)
                    return res._replace(data=Direct(value, tuple(self.buffers)))
                self.decoder = _codec.PieceDecoder(res.data, self.buffers)
            if not self.decoder.step(budget):
                return None
            value, self.decoder.value = self.decoder.value, None  # the batch's one reference
            return res._replace(data=Direct(value, tuple(self.buffers), pieces=True))
        except (OSError, RuntimeError, EOFError) as exc:
            # At the descriptor limit, receiving a batch's fd fails with EMFILE, or with
            # multiprocessing's "received 0 items of ancdata" when the fd was dropped.
            if getattr(exc, "errno", None) == errno.EMFILE or "ancdata" in str(exc):
                return res._replace(data=Failure(emfile_error(exc)))
            # Otherwise the worker that holds the batch's memory may have died after sending it.
            return res._replace(data=Lost(exc))
        except Exception as exc:
            return res._replace(data=Failure(exc))
        except BaseException as exc:  # e.g. SystemExit from a custom type's unpickling
            err = RuntimeError(
                f"Caught {type(exc).__name__} while unpickling batch send_idx={res.send_idx} "
                "in the main process"
            )
            err.__cause__ = exc
            return res._replace(data=Failure(err))
