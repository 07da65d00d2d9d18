"""Worker processes behind ``ProcessPoolExecutor``. Runs in: the event loop, with blocking steps
(process start, pickling the payload, joins) on short-lived helper threads.

Two shapes, chosen by the loader:

* **Pinned** (iterable-style datasets, and map-style with ``in_order=True``): one single-process
  executor per worker id; the scheduler assigns batches round-robin as torch does. Iterables need
  it (each worker iterates its own replica); in-order map-style loading uses it so each worker's
  RNG stream sees the same batches as under torch, which makes seeded runs reproduce torch's.
* **Shared** (map-style with ``in_order=False``): one executor of ``num_workers`` processes fed
  from one queue, so an idle worker always takes the next batch and a slow batch does not hold up
  the ones queued behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing.connection

# Imported by the first pool's start otherwise, on the path to its first batch (3-4 ms, measured
# in a fresh process): the shared arrays every pool makes, and fork's process launcher.
import multiprocessing.heap
import multiprocessing.sharedctypes
import multiprocessing.util
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

with contextlib.suppress(ImportError):  # POSIX only
    import multiprocessing.popen_fork

from . import _buffers, _channel, _worker
from ._procpool import Executor, close_pipes, kill_executors, release_semaphores
from ._threads import run_off_loop

__all__ = ("CrashReport", "WorkerPool")

_logger = logging.getLogger(__name__)

#: How long idle workers get to exit after being asked to, before they are killed.
SHUTDOWN_GRACE_S = 5.0

_forkserver_lock = threading.Lock()


def _prepare_forkserver(ctx: BaseContext) -> None:
    """Preload torch in the fork server, so each worker forks with torch already imported.

    Only possible before the fork server first starts (a process-wide server shared by every user
    of the forkserver context); afterwards this is a no-op.
    """
    from multiprocessing import forkserver

    with _forkserver_lock:
        server = forkserver._forkserver
        if getattr(server, "_forkserver_pid", None) is None:
            preload = list(getattr(server, "_preload_modules", ["__main__"]))
            for mod in ("torch", "aioloader._worker"):
                if mod not in preload:
                    preload.append(mod)
            ctx.set_forkserver_preload(preload)


# Every pool not shut down yet, for _kill_live_pools.
_live_pools: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _kill_live_pools() -> None:
    """At the exit of this process, kill the workers of every pool it made and did not close.

    Our workers are not daemon processes (a ``ProcessPoolExecutor``'s never are), so
    multiprocessing's exit joins them, and a pool nobody closed never tells them to stop. In the
    main process concurrent.futures' own exit hook does that first; in a multiprocessing child
    (a training function under ``torch.multiprocessing.spawn``) nothing does, and the child
    never exited. torch's workers are daemons, terminated there; ours are killed. Registered as
    a multiprocessing finalizer, which runs before those joins; a forked child inherits the
    registry and the set, so each pool is killed only by the process that made it.
    """
    for pool in list(_live_pools):
        if pool._pid == os.getpid():
            pool.kill_at_exit()


multiprocessing.util.Finalize(None, _kill_live_pools, exitpriority=10)


def _kill_unfinished_pools() -> None:
    """At interpreter exit, kill the workers of every open pool that would hold the exit up.

    concurrent.futures' exit hook (it runs before the atexit hooks, among them the bridge's that
    closes loaders) asks each executor's workers to stop and joins them: a worker still starting
    (a slow ``worker_init_fn``) or loading a batch that nobody will take (an epoch interrupted
    with ^C, its persistent pool left open) would keep the interpreter alive until it is done,
    or for ever. Those are killed first, as a loader left open at exit promises; idle workers
    are left to that hook's orderly stop. Registered after concurrent.futures' hook, so it runs
    before it (threading runs them in reverse).
    """
    for pool in list(_live_pools):
        if pool._pid == os.getpid() and not pool._idle():
            pool.kill_at_exit()


threading._register_atexit(_kill_unfinished_pools)  # type: ignore[attr-defined]


def first_wave_size() -> int:
    """Workers started at once under spawn/forkserver: the CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class CrashReport:
    """Which worker died, with what exit code, holding which batch of which epoch.

    Any of them may be unknown (None). ``epoch`` and ``send_idx`` name the task the worker was
    running when it died, which can belong to an earlier, abandoned epoch on a persistent pool.
    """

    def __init__(
        self,
        worker_id: int | None,
        pid: int | None,
        exitcode: int | None,
        send_idx: int | None,
        epoch: int | None = None,
        started: bool = True,
    ):
        self.worker_id = worker_id
        self.pid = pid
        self.exitcode = exitcode
        self.send_idx = send_idx
        self.epoch = epoch
        #: False when the worker died before its initializer ran (a set-up error).
        self.started = started

    def describe(self) -> str:
        """What happened, in torch's words first ("worker (pid N) is killed by signal: ...",
        "... exited unexpectedly with exit code N"), so that code matching torch's message
        finds it; then the worker id and the signal's name."""
        who = "worker" if self.pid is None else f"worker (pid {self.pid})"
        ours = [] if self.worker_id is None else [f"aioloader worker {self.worker_id}"]
        if self.exitcode is None:
            how = "exited unexpectedly"
        elif self.exitcode < 0:
            sig = -self.exitcode
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            text = signal.strsignal(sig) or name
            how = f"is killed by signal: {text}."
            ours += [name, f"exit code {self.exitcode}"]
        else:
            how = f"exited unexpectedly with exit code {self.exitcode}."
        return f"{who} {how}" + (f" ({', '.join(ours)})" if ours else "")


class WorkerPool:
    """``num_workers`` processes initialised with one :class:`~aioloader._worker.WorkerSpec`.

    Create with :meth:`start`; every worker process is started before it returns, off the loop
    (a replacement pool after a crash too), but the workers initialise concurrently and take
    tasks as soon as each is ready. No process is started later: a dead worker breaks its
    executor, and the owner replaces the whole pool.

    Under the ``fork`` start method every start forks a multi-threaded process (the event loop's
    thread at least, plus the manager threads of other pools and the device thread). A thread
    that holds a lock at the instant of the fork (a ``print`` blocked on a full stdout pipe, an
    allocator lock in a native library) leaves the child holding it, and the child deadlocks when
    it needs it; Python >= 3.12 warns about exactly this. The residual risk is accepted for
    ``fork`` (it is what makes ``fork`` cheap: the dataset is inherited, not pickled); it is
    reduced, not removed, by starting a pool's processes before any of its threads. The warning
    itself is silenced around our own starts (see :func:`~aioloader._procpool.quiet_fork_warning`;
    it can never fail a start: CPython clears it even under ``-W error``). ``forkserver`` and
    ``spawn`` do not have the problem.
    """

    def __init__(self, spec: _worker.WorkerSpec, ctx: BaseContext, per_worker: bool) -> None:
        self.spec = spec
        self.num_workers = spec.num_workers
        self._ctx = ctx
        self._per_worker = per_worker
        self._executors: list[Executor] = []
        # One pair of slots per worker id: the (epoch, send_idx) it is loading now, send_idx -1
        # when idle. Read after a crash to name the task the dead worker was holding; the epoch
        # tells a task of an abandoned epoch (persistent workers) from the current one.
        self._slots: Any = ctx.RawArray(ctypes.c_longlong, [-1] * self.num_workers)
        self._epoch_slots: Any = ctx.RawArray(ctypes.c_longlong, [-1] * self.num_workers)
        # One slot per worker id: its pid, written by the worker at start-up.
        self._pid_slots: Any = ctx.RawArray(ctypes.c_longlong, [0] * self.num_workers)
        # One per worker id: 1 once its initializer is done (dataset loaded, worker_init_fn run).
        self._ready_slots: Any = ctx.RawArray(ctypes.c_ubyte, [0] * self.num_workers)
        # Each worker's start-up failure, if it had one (its ready slot is 2 then).
        self._start_errors: Any = ctx.RawArray(
            ctypes.c_char, self.num_workers * _worker.START_ERROR_BYTES
        )
        # One per worker id: large tensors' descriptors travel with the results, not through a
        # connection from the main process to each worker per batch (see _channel).
        # Batch buffers any worker can reuse once the consumer drops a batch (see _buffers).
        self._buffers = _buffers.BufferPool(self.num_workers, ctx.RawArray)
        self._channels: list[_channel.FdChannel] = []
        try:
            for wid in range(self.num_workers):
                self._channels.append(_channel.FdChannel(wid))
                self._buffers.attach(self._channels[-1])
        except BaseException:  # out of descriptors, say: close what was made
            # The pool first: once closed, no finaliser announces a buffer on a channel.
            self._buffers.close()
            for ch in self._channels:
                ch.close()
            raise
        self._closed = False
        self._owns_payload = True
        self._payload_lock = threading.Lock()
        self._pid = os.getpid()
        _live_pools.add(self)
        # Serialises _shutdown_sync/_kill_sync: a second caller (another thread) waits until the
        # first is done and then finds nothing left to do.
        self._stop_lock = threading.Lock()
        self._stopped = False
        # Set by _kill_sync before it waits for that lock: a graceful shutdown under way stops
        # waiting for idle workers and lets it kill them now.
        self._kill_requested = threading.Event()
        self._workers: list[tuple[int, BaseProcess]] = []
        self._procs: list[BaseProcess] = []
        self._manager_threads: list[threading.Thread] = []
        self._result_queues: list[Any] = []
        self._call_queues: list[Any] = []
        self._wakeups: list[Any] = []  # each executor's manager-thread wakeup pipe
        self._captured = False
        # Staggered start (see _start_sync): the thread that starts the second wave, what to call
        # once it did, and whether it is done. _grow_lock orders the second wave's start against
        # watch() and the shutdown.
        self._grow_lock = threading.Lock()
        self._grower: threading.Thread | None = None
        self._growing = False
        self._on_grown: Callable[[BaseException | None], None] | None = None
        self._grow_error: BaseException | None = None
        self._stop_growing = threading.Event()

    @classmethod
    async def start(
        cls,
        make_spec: Callable[[], _worker.WorkerSpec],
        ctx: BaseContext,
        per_worker: bool,
    ) -> WorkerPool:
        """Build the spec (this may pickle the dataset) and start every worker, off the loop.

        The pool owns the spec's payload file and closes it at shutdown unless
        :meth:`hand_over_payload` moved it to a replacement pool.
        """

        def start_sync() -> WorkerPool:
            pool = cls(make_spec(), ctx, per_worker)
            try:
                pool._start_sync()
            except BaseException:
                pool._kill_sync()
                raise
            return pool

        return await run_off_loop(start_sync, name="start", on_abandon=lambda p: p._kill_sync())

    async def replace(self) -> WorkerPool:
        """Kill these workers and start an identical set (after a crash); the payload moves over.

        Cancelled (the epoch ended meanwhile) before the new pool exists, the payload is closed
        here; once :meth:`start` runs, the new pool owns it, and closes it if it never serves.
        """
        self.hand_over_payload()  # this shutdown must not close what the next pool needs
        try:
            await self.shutdown(graceful=False)
        except BaseException:
            self._owns_payload = True
            self._remove_payload()
            raise
        return await WorkerPool.start(lambda: self.spec, self._ctx, self._per_worker)

    def kill_sync(self) -> None:
        """Kill every worker and join the executors' threads; blocks. Safe to call twice."""
        self._kill_sync()

    def kill_at_exit(self) -> None:
        """SIGKILL every worker process and return: no join, no lock, no thread.

        For interpreter finalization, where a thread can no longer start and the executors'
        manager threads may be gone or frozen; the processes are reaped by whoever outlives us.
        """
        self._kill_requested.set()
        self._stop_growing.set()  # a second wave still to come never starts
        procs = list(self._procs)
        for ex in self._executors:
            procs += [p for p in ex.processes() if all(p is not q for q in procs)]
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(Exception):  # already gone
                    os.kill(p.pid, signal.SIGKILL)

    def hand_over_payload(self) -> None:
        """A replacement pool now owns the payload file: do not close it at shutdown."""
        self._owns_payload = False

    def _remove_payload(self) -> None:
        # Under a lock: a cancelled replace() and its shutdown's thread may both get here, and a
        # second os.close() of the number could close a descriptor opened meanwhile elsewhere.
        with self._payload_lock:
            if self._owns_payload and self.spec.payload_file is not None:
                self._owns_payload = False
                self.spec.payload_file[0].close()

    def _first_wave(self) -> int:
        """How many workers start before start() returns; the rest start on the grower thread
        (see _start_sync and _grow)."""
        if self._ctx.get_start_method() == "fork":
            # All at once: forking is cheap, and every fork must end before start() returns, so
            # that no code of the user's (a sampler on the sampler thread, the consumer's step)
            # runs on another thread while a worker forks. A native lock held there at that
            # instant (torch's default generator during randperm, numpy's RandomState) would
            # stay locked in the child, which then hangs in its initializer's seeding.
            return self.num_workers
        return max(1, min(self.num_workers, first_wave_size()))

    def _start_sync(self) -> None:
        if self._ctx.get_start_method() == "forkserver":
            _prepare_forkserver(self._ctx)
        t0 = time.perf_counter()
        wave = self._first_wave()
        if self._per_worker:
            for wid in range(self.num_workers):
                spec = replace(self.spec, fixed_worker_id=wid)
                self._executors.append(self._new_executor(1, spec, None))
        else:
            counter = self._ctx.Value("i", 0)
            self._executors.append(self._new_executor(self.num_workers, self.spec, counter))
        # Processes start on this thread (and the grower's), never on submit(): under
        # spawn/forkserver CPython would otherwise start them one per submit() that finds no idle
        # worker, on the event loop, unwatched.
        #
        # Staggered: under spawn and forkserver a worker's start is CPU work (importing torch,
        # unpickling the dataset), so N workers starting on fewer cores all finish late. As many
        # as there are cores start now; the others once those are up, and batch 0 goes out as
        # soon as its worker is ready. Tasks for a worker not started yet wait in its executor.
        if self._per_worker:
            # Every process before any manager thread: under fork, no thread of this pool runs
            # while a worker forks (see the class docstring). The manager threads start on the
            # grower thread: a pinned worker's tasks and results travel over its lane, so the
            # loop sends the first batches meanwhile (each thread's start waits for the thread
            # to run, 1-3 ms while new workers take the cores).
            for ex in self._executors[:wave]:
                ex.start_processes()
        else:
            self._executors[0].start_workers(wave)
        self._capture_internals()
        self._growing = self._per_worker or wave < self.num_workers
        if self._growing:
            self._grower = threading.Thread(
                target=self._grow, args=(wave,), name="aioloader-start-rest", daemon=True
            )
            self._grower.start()
        else:
            for ch in self._channels:
                ch.close_worker_end()  # each worker holds its own copy now
        _logger.debug(
            "started %d of %d workers (%s) in %.3fs",
            wave,
            self.num_workers,
            self._ctx.get_start_method(),
            time.perf_counter() - t0,
        )

    def _grow(self, wave: int) -> None:
        """Runs in: the grower thread. Start what :meth:`_start_sync` left to start.

        A pinned pool's manager threads of the first wave; under spawn and forkserver, the
        second wave once the first one is up. Never a fork: under fork, every worker exists
        before :meth:`start` returns (see :meth:`_first_wave`).

        Starts no process while holding a lock the event loop takes (``watch``, the executors'
        own): the loop never waits for a process start.
        """
        error: BaseException | None = None
        stopping = self._stop_growing.is_set
        try:
            if self._per_worker:
                for ex in self._executors[:wave]:
                    if stopping():
                        return
                    ex.start_manager()
            if wave < self.num_workers:
                first = [p.sentinel for _, p in self._workers]
                # Up: its initializer is done (imports, dataset, worker_init_fn), so the next
                # workers' start-up no longer competes with it for a core.
                while sum(1 for r in self._ready_slots if r) < wave:
                    if stopping():
                        return
                    if multiprocessing.connection.wait(first, 0.01):
                        return  # one died: crash handling replaces the whole pool
                if self._per_worker:
                    for ex in self._executors[wave:]:
                        if stopping():
                            return
                        ex.start_workers()
                elif not self._executors[0].grow(stopping):
                    return  # broken or stopping: crash handling or the shutdown does the rest
            for ch in self._channels:
                ch.close_worker_end()
        except BaseException as exc:  # a process or thread that could not start (EMFILE, say)
            error = exc
            with self._grow_lock:
                # Before the tasks fail: the crash handling they set off reads it.
                self._grow_error = exc
            # Tasks already queued for workers that will never start fail now (the epoch then
            # handles a crash and reports this error), so nothing waits for them forever.
            for ex in self._executors:
                ex.fail_unstarted(exc)
        finally:
            with self._grow_lock:
                self._capture_internals()  # whatever did start, for the shutdown to stop it
                self._growing = False
                self._grow_error = error
                callback, self._on_grown = self._on_grown, None
        if callback is not None and (error is not None or not stopping()):
            callback(error)

    @property
    def start_error(self) -> BaseException | None:
        """Why workers of the second wave could not start, if they could not: the pool is
        unusable (its owner fails the epoch with this error and does not reuse the pool)."""
        return self._grow_error

    def _idle(self) -> bool:
        """Every worker started (well or not) and none is loading a batch."""
        return all(self._ready_slots) and all(s == -1 for s in self._slots)

    async def start_failures(self, *, wait: bool) -> list[_worker.RemoteError]:
        """The start-up errors (``worker_init_fn`` raised) of workers that had one.

        A worker whose start failed reports it with every batch it is given; from a shared
        queue it may get none (started late, when the others had taken every batch), so the
        epoch asks here before it ends. ``wait``: first wait until every worker has finished
        starting (as torch's epoch does), unless the pool stops, cannot grow, or loses a worker.
        """
        while wait and not all(self._ready_slots):
            if self._stopped or self._stop_growing.is_set() or self._grow_error is not None:
                break
            if multiprocessing.connection.wait(self.sentinels(), 0):
                break  # a worker died: crash handling's, not ours
            await asyncio.sleep(0.01)
        return [
            err
            for wid, ready in enumerate(self._ready_slots)
            if ready == 2 and (err := _worker.read_start_error(self._start_errors, wid)) is not None
        ]

    def watch(self, on_grown: Callable[[BaseException | None], None]) -> list[int]:
        """The workers' sentinels now (as :meth:`sentinels`). If more workers are still to
        start, ``on_grown`` is called once from another thread when they have (None) or could
        not (the error); if they already could not, it is called at once with the error. A
        later call replaces an earlier ``on_grown``."""
        with self._grow_lock:
            if self._growing:
                self._on_grown = on_grown
            error = self._grow_error
            sentinels = self.sentinels()
        if error is not None:
            on_grown(error)
        return sentinels

    def _new_executor(self, n: int, spec: _worker.WorkerSpec, counter: Any) -> Executor:
        return Executor(
            max_workers=n,
            mp_context=self._ctx,
            # A pinned worker's batches and results travel over its lane (see _procpool.Lane),
            # written and read by the event loop, never through the executor's threads.
            lane=self._per_worker,
            lane_depth=spec.lane_depth,
            initializer=_worker.init,
            initargs=(
                spec,
                counter,
                self._slots,
                self._epoch_slots,
                self._pid_slots,
                self._channels,
                self._ready_slots,
                self._start_errors,
            ),
        )

    def submit(self, send_idx: int, indices: Any, epoch: int, worker_id: int | None) -> Future[Any]:
        """Queue one batch; ``worker_id`` picks the worker in a pinned pool, else any one does."""
        ex = self._executors[worker_id if self._per_worker and worker_id is not None else 0]
        return ex.submit(_worker.fetch, send_idx, indices, epoch)

    def prefeed(self, worker_id: int | None, key: tuple[int, int], samples: Any) -> bool:
        """Send samples of an open window ahead to the worker it is pinned to (see
        ``_stream``); False if they were not sent (no pinned worker, or no lane to post on)."""
        if not self._per_worker or worker_id is None:
            return False
        return self._executors[worker_id].post(_worker.prefeed, key, samples)

    def crash_report(self, settle_s: float = 1.0) -> CrashReport:
        """Name the worker that died (after a ``BrokenProcessPool``); blocks up to ``settle_s``.

        The executor reports a death as soon as the worker's pipe closes, which can be a moment
        before the kernel makes its exit status available: wait for it briefly. A process counts
        as ended when its sentinel is readable, not when ``exitcode`` is set: the executor's
        manager thread reaps workers too, and while it does ``exitcode`` reads None for a moment
        (the loser of two concurrent ``waitpid`` calls gets ECHILD), which would leave the
        first death out and blame a later one.
        """
        deadline = time.monotonic() + settle_s
        # A broken executor's manager thread stops the other workers and reaps them all: let it
        # finish first. Reading a forkserver worker's exit code while it does can give 255
        # (two threads reading one status pipe) instead of the real code.
        for ex in self._executors:
            thread = getattr(ex, "_executor_manager_thread", None)
            if thread is not None and getattr(ex, "_broken", False):
                thread.join(max(0.0, deadline - time.monotonic()))
        while True:
            ended = set(multiprocessing.connection.wait(self.sentinels(), 0))
            dead = [(wid, p) for wid, p in self._workers if p.sentinel in ended]
            settled = all(p.exitcode is not None for _, p in dead)
            if (dead and settled) or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        # The executor SIGTERMs the survivors once it sees one die, SIGKILLs those that outlive
        # it (see _procpool._ManagerThread), and (Python 3.11) asks them to exit, which one that
        # ignores SIGTERM does with status 0: blame the deaths it found first, then any other.
        first = {pid for ex in self._executors for pid in ex.first_dead_pids}
        killed = {pid for ex in self._executors for pid in ex.killed_pids}
        dead.sort(
            key=lambda wp: (
                wp[1].pid not in first,
                wp[1].pid in killed,
                wp[1].exitcode in (0, -signal.SIGTERM),
                wp[1].exitcode == 0,
            )
        )
        if not dead:
            return CrashReport(None, None, None, None, None)
        wid, proc = dead[0]
        if wid < 0 and proc.pid is not None:
            wid = next((w for w in range(self.num_workers) if self._pid_slots[w] == proc.pid), -1)
        send_idx = self._slots[wid] if wid >= 0 else -1
        started = wid >= 0 and self._pid_slots[wid] == proc.pid
        return CrashReport(
            wid if wid >= 0 else None,
            proc.pid,
            proc.exitcode,
            send_idx if send_idx >= 0 else None,
            self._epoch_slots[wid] if send_idx >= 0 else None,
            started=started,
        )

    def busy_send_idx(self) -> dict[int, tuple[int, int]]:
        """worker id -> (epoch, send_idx) of the task it is loading now."""
        out = {}
        for wid in range(self.num_workers):
            send_idx = self._slots[wid]
            if send_idx >= 0:
                out[wid] = (self._epoch_slots[wid], send_idx)
        return out

    async def shutdown(self, *, graceful: bool) -> None:
        """Stop every worker and the executors' threads; safe to call twice.

        ``graceful``: idle workers are asked to exit and killed only after :data:`SHUTDOWN_GRACE_S`.
        Otherwise (an abandoned epoch) busy workers are terminated at once rather than waited for.
        """
        if self._closed:
            return
        self._closed = True
        # Here, on the loop that watches the lanes: the thread below then closes their pipes
        # at once (see _procpool.Lane.close).
        for ex in self._executors:
            ex.detach_lane()
        await run_off_loop(lambda: self._shutdown_sync(graceful), name="shutdown")

    def _capture_internals(self) -> None:
        """Keep the executors' processes, manager threads and result queues for shutdown.

        ``ProcessPoolExecutor.shutdown(wait=False)`` drops its references to all three, and they
        are needed afterwards: to kill workers that do not exit, and to unblock and join a
        manager thread (see :func:`~aioloader._procpool.kill_executors`).
        """
        # Added to what an earlier call kept (a second wave, a start that failed half-way),
        # never replacing it: an executor forgets its processes once shut down.
        self._captured = True
        workers = list(self._workers)
        workers += [
            (i if self._per_worker else -1, p)
            for i, ex in enumerate(self._executors)
            for p in ex.processes()
            if all(p is not q for _, q in workers)
        ]
        self._workers = workers
        self._procs = [p for _, p in workers]
        self._manager_threads += [
            t
            for ex in self._executors
            if (t := getattr(ex, "_executor_manager_thread", None))
            and t not in self._manager_threads
        ]
        self._result_queues += [
            q
            for ex in self._executors
            if (q := getattr(ex, "_result_queue", None)) is not None
            and all(q is not r for r in self._result_queues)
        ]
        self._call_queues += [
            q
            for ex in self._executors
            if (q := getattr(ex, "_call_queue", None)) is not None
            and all(q is not r for r in self._call_queues)
        ]
        self._wakeups += [
            w
            for ex in self._executors
            if (w := getattr(ex, "_executor_manager_thread_wakeup", None)) is not None
            and all(w is not r for r in self._wakeups)
        ]

    def pids(self) -> list[int]:
        """The worker processes' ids (those started so far; none once the pool is stopped)."""
        if self._stopped:
            return []
        return [p.pid for p in self._procs if p.pid is not None]

    def sentinels(self) -> list[int]:
        """One fd per worker process that becomes readable when the process ends (none once
        the pool is stopped: the descriptors are closed then)."""
        if self._stopped:
            return []
        return [p.sentinel for p in self._procs]

    def _stop_grower(self) -> None:
        """No second wave starts from now on; one under way finishes first (it is short)."""
        self._stop_growing.set()
        grower = self._grower
        # Not started (its start failed, or is still to come): it will see the stop at once.
        if (
            grower is not None
            and grower.ident is not None
            and grower is not threading.current_thread()
        ):
            grower.join()

    def _shutdown_sync(self, graceful: bool) -> None:
        self._stop_grower()
        with self._stop_lock:
            if self._stopped:
                return
            if graceful and self._captured:
                deadline = time.monotonic() + SHUTDOWN_GRACE_S
                # Ask; never wait behind a manager thread that is tearing down a broken pool
                # (see Executor.request_shutdown): its workers are killed below anyway.
                asked = [ex.request_shutdown(deadline) for ex in self._executors]
                if all(asked):
                    self._wait_for_exit(deadline)
            self._kill_locked()

    def _wait_for_exit(self, deadline: float) -> None:
        """Wait until every worker exited, the deadline passed or a kill was requested."""
        while not self._kill_requested.is_set():
            alive = [p.sentinel for p in self._procs if p.exitcode is None]
            left = deadline - time.monotonic()
            if not alive or left <= 0:
                return
            # In short slices, to notice a kill request.
            multiprocessing.connection.wait(alive, min(left, 0.05))

    def _kill_sync(self) -> None:
        """Kill every worker and release the executors at once; idempotent and thread-safe.

        A graceful shutdown under way on another thread stops waiting; this returns once
        everything is gone, whichever call did the work.
        """
        self._kill_requested.set()
        self._stop_grower()
        with self._stop_lock:
            if not self._stopped:
                self._kill_locked()

    def _kill_locked(self) -> None:
        # Also after the start failed or was abandoned half-way, and whatever a second wave
        # started (the grower was joined before): every process, thread and queue there is.
        self._capture_internals()
        try:
            kill_executors(
                self._executors,
                self._procs,
                self._manager_threads,
                self._result_queues,
                SHUTDOWN_GRACE_S,
            )
        finally:
            self._stopped = True
            self._closed = True
            _live_pools.discard(self)
            self._remove_payload()
            # The pool first: once closed, no finaliser announces a buffer on a channel.
            self._buffers.close()
            for ch in self._channels:
                ch.close()
            # Every worker and the manager threads are gone: their queues' named semaphores and
            # pipes can go now (see there).
            release_semaphores(self._call_queues + self._result_queues)
            if not any(t.is_alive() for t in self._manager_threads):
                close_pipes(self._call_queues + self._result_queues + self._wakeups)
            for p in self._procs:
                popen = getattr(p, "_popen", None)
                if p.exitcode is not None and popen is not None:
                    # Its sentinel pipe, otherwise closed when the collector frees the object.
                    # Not p.close(): the exit code stays readable (it is known by now).
                    with contextlib.suppress(Exception):
                        popen.finalizer()
                if p.exitcode is not None and p.exitcode < 0 and p.pid is not None:
                    # Killed by a signal (a crash, or our own SIGKILL): maybe between torch's
                    # creating a shared-memory file and unlinking its name.
                    _buffers.unlink_left_segments(p.pid)
