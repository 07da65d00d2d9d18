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

import contextlib
import ctypes
import logging
import multiprocessing
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ProcessPoolExecutor
from concurrent.futures import process as _process
from dataclasses import replace
from multiprocessing.context import BaseContext
from typing import Any

from . import _worker
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


class _ManagerThread(_process._ExecutorManagerThread):
    """The executor's manager thread with CPython gh-107219 fixed (Python < 3.12 lacks the fix).

    When a worker dies, ``terminate_broken`` fails every pending future with ``set_exception``,
    which raises ``InvalidStateError`` for one that was cancelled while it waited (the batches of
    an abandoned epoch). The thread then dies half-way: later futures are never resolved and the
    call queue's feeder thread and pipes are never closed.
    """

    def terminate_broken(self, cause: Any) -> None:
        while True:
            # Drop the futures that are already done: nobody waits for them.
            for work_id, item in list(self.pending_work_items.items()):
                if item.future.done():
                    self.pending_work_items.pop(work_id, None)
            try:
                super().terminate_broken(cause)
                return
            except InvalidStateError:  # one was cancelled just now: drop it too and go on
                continue


class _Executor(ProcessPoolExecutor):
    """``ProcessPoolExecutor`` whose manager thread is :class:`_ManagerThread` where needed."""

    def _start_executor_manager_thread(self) -> None:
        super()._start_executor_manager_thread()
        thread: Any = self._executor_manager_thread
        if sys.version_info < (3, 12) and type(thread) is _process._ExecutorManagerThread:
            # Swapped right after the thread starts, while its workers are only starting, so
            # before any of them can have died with a cancelled batch queued.
            thread.__class__ = _ManagerThread


class CrashReport:
    """Which worker died, with what exit code, holding which batch (any may be unknown)."""

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
        who = "a worker" if self.worker_id is None else f"worker {self.worker_id}"
        if self.pid is not None:
            who += f" (pid {self.pid})"
        if self.exitcode is None:
            how = "exited unexpectedly"
        elif self.exitcode < 0:
            try:
                how = f"was killed by signal {signal.Signals(-self.exitcode).name}"
            except ValueError:
                how = f"was killed by signal {-self.exitcode}"
            how += f" (exit code {self.exitcode})"
        else:
            how = f"exited unexpectedly with exit code {self.exitcode}"
        return f"{who} {how}"


class WorkerPool:
    """``num_workers`` processes initialised with one :class:`~aioloader._worker.WorkerSpec`.

    Create with :meth:`start`; every worker process is started before it returns, off the loop,
    but the workers initialise concurrently and take tasks as soon as each is ready.
    """

    def __init__(self, spec: _worker.WorkerSpec, ctx: BaseContext, per_worker: bool) -> None:
        self.spec = spec
        self.num_workers = spec.num_workers
        self._ctx = ctx
        self._per_worker = per_worker
        self._executors: list[ProcessPoolExecutor] = []
        # One slot per worker id: the send_idx it is loading now, or -1. Read after a crash to
        # name the batch the dead worker was holding.
        self._slots: Any = ctx.RawArray(ctypes.c_longlong, [-1] * self.num_workers)
        # One slot per worker id: its pid, written by the worker at start-up.
        self._pid_slots: Any = ctx.RawArray(ctypes.c_longlong, [0] * self.num_workers)
        self._closed = False
        self._owns_payload = True

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
        """Kill these workers and start an identical set (after a crash); the payload moves over."""
        self.hand_over_payload()
        await self.shutdown(graceful=False)
        return await WorkerPool.start(lambda: self.spec, self._ctx, self._per_worker)

    def kill_sync(self) -> None:
        """Kill every worker and join the executors' threads; blocks. Safe to call twice."""
        self._kill_sync()

    def hand_over_payload(self) -> None:
        """A replacement pool now owns the payload file: do not close it at shutdown."""
        self._owns_payload = False

    def _remove_payload(self) -> None:
        if self._owns_payload and self.spec.payload_file is not None:
            self._owns_payload = False
            self.spec.payload_file[0].close()

    def _start_sync(self) -> None:
        if self._ctx.get_start_method() == "forkserver":
            _prepare_forkserver(self._ctx)
        t0 = time.perf_counter()
        if self._per_worker:
            for wid in range(self.num_workers):
                spec = replace(self.spec, fixed_worker_id=wid)
                self._executors.append(self._new_executor(1, spec, None))
        else:
            counter = self._ctx.Value("i", 0)
            self._executors.append(self._new_executor(self.num_workers, self.spec, counter))
        # ProcessPoolExecutor starts spawn/forkserver processes lazily, one per submit with no idle
        # worker, on the submitting thread. Submitting one ping per worker here starts them all on
        # this helper thread, so later submits from the event loop never start a process.
        for ex in self._executors:
            for _ in range(1 if self._per_worker else self.num_workers):
                ex.submit(_worker.ping)
        self._capture_internals()
        _logger.debug(
            "started %d workers (%s) in %.3fs",
            self.num_workers,
            self._ctx.get_start_method(),
            time.perf_counter() - t0,
        )

    def _new_executor(self, n: int, spec: _worker.WorkerSpec, counter: Any) -> ProcessPoolExecutor:
        return _Executor(
            max_workers=n,
            mp_context=self._ctx,
            initializer=_worker.init,
            initargs=(spec, counter, self._slots, self._pid_slots),
        )

    def submit(self, send_idx: int, indices: Any, epoch: int, worker_id: int | None) -> Future[Any]:
        """Queue one batch; ``worker_id`` picks the worker in a pinned pool, else any one does."""
        ex = self._executors[worker_id if self._per_worker and worker_id is not None else 0]
        return ex.submit(_worker.fetch, send_idx, indices, epoch)

    def _processes(self) -> list[tuple[int, multiprocessing.process.BaseProcess]]:
        """(worker_id, process) for every process; the id is -1 in a shared pool."""
        out = []
        for i, ex in enumerate(self._executors):
            procs = getattr(ex, "_processes", None) or {}
            for p in list(procs.values()):
                out.append((i if self._per_worker else -1, p))
        return out

    def crash_report(self, settle_s: float = 1.0) -> CrashReport:
        """Name the worker that died (after a ``BrokenProcessPool``); blocks up to ``settle_s``.

        The executor reports a death as soon as the worker's pipe closes, which can be a moment
        before the kernel makes its exit status available: wait for it briefly.
        """
        deadline = time.monotonic() + settle_s
        while True:
            dead = [(wid, p) for wid, p in self._workers if p.exitcode is not None]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        # The executor SIGTERMs the survivors once it sees one die: prefer any other exit code.
        dead.sort(key=lambda wp: wp[1].exitcode == -signal.SIGTERM)
        if not dead:
            return CrashReport(None, None, None, None)
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
            started=started,
        )

    def busy_send_idx(self) -> dict[int, int]:
        """worker id -> send_idx it is loading now."""
        return {wid: v for wid in range(self.num_workers) if (v := self._slots[wid]) >= 0}

    async def shutdown(self, *, graceful: bool) -> None:
        """Stop every worker and the executors' threads; safe to call twice.

        ``graceful``: idle workers are asked to exit and killed only after :data:`SHUTDOWN_GRACE_S`.
        Otherwise (an abandoned epoch) busy workers are terminated at once rather than waited for.
        """
        if self._closed:
            return
        self._closed = True
        await run_off_loop(lambda: self._shutdown_sync(graceful), name="shutdown")

    def _capture_internals(self) -> None:
        """Keep the executors' processes, manager threads and result queues for shutdown.

        ``ProcessPoolExecutor.shutdown(wait=False)`` drops its references to all three, and they
        are needed afterwards: to kill workers that do not exit, and to unblock and join a
        manager thread (see :meth:`_kill_sync`).
        """
        self._workers = self._processes()
        self._procs = [p for _, p in self._workers]
        self._manager_threads = [
            t for ex in self._executors if (t := getattr(ex, "_executor_manager_thread", None))
        ]
        self._result_queues = [
            q for ex in self._executors if (q := getattr(ex, "_result_queue", None)) is not None
        ]

    def sentinels(self) -> list[int]:
        """One fd per worker process that becomes readable when the process ends."""
        return [p.sentinel for p in self._procs]

    def _shutdown_sync(self, graceful: bool) -> None:
        if graceful:
            for ex in self._executors:
                ex.shutdown(wait=False, cancel_futures=True)
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for p in self._procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self._kill_sync()

    def _kill_sync(self) -> None:
        if not hasattr(self, "_procs"):
            self._capture_internals()
        for ex in self._executors:
            ex.shutdown(wait=False, cancel_futures=True)
        for p in self._procs:
            if p.exitcode is None:
                with contextlib.suppress(Exception):
                    p.kill()
        for p in self._procs:
            p.join(SHUTDOWN_GRACE_S)
        # A worker killed in the middle of writing a result larger than the pipe buffer leaves
        # the manager thread blocked reading the rest, forever: this process holds the queue's
        # write end too, so no EOF comes. Closing our write end once every worker is gone
        # delivers the EOF; the thread then sees a broken pool and exits.
        for q in self._result_queues:
            with contextlib.suppress(Exception):
                q._writer.close()
        for t in self._manager_threads:
            t.join(SHUTDOWN_GRACE_S)
            if t.is_alive():
                _logger.warning("an executor manager thread did not exit: %s", t.name)
        for q in self._result_queues:
            with contextlib.suppress(Exception):
                q.close()
        self._closed = True
        self._remove_payload()
