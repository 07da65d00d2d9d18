"""``ProcessPoolExecutor`` made safe to start and to stop. Runs in: helper threads.

Standard library only (no torch, no other aioloader module), so the tests can load this file by
path under every Python version we support, including ones without torch, and check the parts
that depend on CPython's private executor internals there.

What it adds to the executor:

* :meth:`Executor.start_workers`: every worker process is started up front, on the calling thread.
  Under spawn/forkserver CPython otherwise starts one process per ``submit()`` that finds no idle
  worker, on the submitting thread (the event loop), after the pool's owner took its inventory.
* :meth:`Executor.request_shutdown`: ask idle workers to exit without ever waiting behind the
  manager thread when it tears down a broken pool (Python >= 3.12 holds the executor's lock
  while it joins every worker, forever for one that ignores SIGTERM).
* :func:`kill_executors`: SIGKILL first, then shut the executors down (same reason).
* :class:`_ManagerThread`: the manager thread never holds that lock for long (a survivor that
  ignores SIGTERM is SIGKILLed), so ``submit()`` on the event loop cannot block behind it; and
  CPython gh-107219 fixed on Python < 3.12.
* :func:`quiet_fork_warning`: silence Python 3.12's multi-threaded ``fork()`` warning around our
  own process starts, without the thread-unsafe ``warnings.catch_warnings``.

Private executor attributes used (present in CPython 3.11, 3.12 and 3.13): ``_processes``,
``_max_workers``, ``_spawn_process``, ``_start_executor_manager_thread``,
``_executor_manager_thread``, ``_executor_manager_thread_wakeup``, ``_shutdown_lock``,
``_shutdown_thread``, ``_cancel_pending_futures``, ``_broken``, ``_result_queue``; and of its
manager thread: ``terminate_broken``, ``_join_executor_internals`` (>= 3.12), ``processes``,
``pending_work_items``, ``executor_reference``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import InvalidStateError, ProcessPoolExecutor
from concurrent.futures import process as _process
from multiprocessing import synchronize, util
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ("Executor", "close_pipes", "kill_executors", "quiet_fork_warning", "release_semaphores")


class _GiveUp(Exception):
    """Executor.grow: the pool broke or shut down, or the caller stopped, while it started."""


_logger = logging.getLogger(__name__)


#: Seconds the workers that survive a crash get to end after the manager thread's SIGTERM,
#: before it SIGKILLs them (Python >= 3.12, see _ManagerThread).
SIGTERM_GRACE_S = 0.5


class _ManagerThread(_process._ExecutorManagerThread):
    """The executor's manager thread, with two defects fixed.

    * CPython gh-107219 (Python < 3.12 lacks the fix): when a worker dies, ``terminate_broken``
      fails every pending future with ``set_exception``, which raises ``InvalidStateError`` for
      one that was cancelled while it waited (the batches of an abandoned epoch). The thread then
      dies half-way: later futures are never resolved and the call queue's feeder thread and
      pipes are never closed.
    * Python >= 3.12 runs all of ``terminate_broken`` under the executor's ``_shutdown_lock``:
      it SIGTERMs the surviving workers and joins them. One that ignores SIGTERM (user code may
      install a handler) is never joined, so the lock is never released, and ``submit()`` on the
      event loop (a batch queued before the loop noticed the crash) blocks it for good: nothing
      is left running to kill that worker. Survivors get :data:`SIGTERM_GRACE_S`, then SIGKILL;
      their pids go to the executor's ``killed_pids`` so a crash report does not blame them.
    """

    def _join_executor_internals(self, broken: bool = False) -> None:
        # Python >= 3.12 only (3.11 joins without holding the lock). Called by _terminate_broken
        # after the SIGTERMs, before it joins every process.
        if broken:
            self._kill_sigterm_survivors()
        super()._join_executor_internals(broken)  # type: ignore[misc]

    def _kill_sigterm_survivors(self) -> None:
        executor = self.executor_reference()
        grace = getattr(executor, "_sigterm_grace", SIGTERM_GRACE_S)
        killed: set[int] = getattr(executor, "killed_pids", set())
        del executor  # no strong reference held while waiting: it may be collected meanwhile
        if grace is None:
            return
        deadline = time.monotonic() + grace
        procs = list(self.processes.values())
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                killed.add(p.pid)
                p.kill()

    def terminate_broken(self, cause: Any) -> None:
        if sys.version_info >= (3, 12):  # gh-107219 is fixed there
            super().terminate_broken(cause)
            return
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


class Executor(ProcessPoolExecutor):
    """A ``ProcessPoolExecutor`` that starts all its processes at once and stops without hanging.

    Call :meth:`start_workers` right after construction, before the executor is shared with any
    other thread; afterwards it never starts a process again (a dead worker breaks the pool, and
    the owner replaces the whole pool).

    ``sigterm_grace``: see :class:`_ManagerThread`; None keeps CPython's wait without end.
    """

    def __init__(
        self, *args: Any, sigterm_grace: float | None = SIGTERM_GRACE_S, **kwargs: Any
    ) -> None:
        _alive.add(self)
        # The queues' semaphores start multiprocessing's resource tracker (spawn, forkserver),
        # a process of its own that a ^C must not interrupt in its start-up either.
        with _sigint_blocked():
            super().__init__(*args, **kwargs)
        self._sigterm_grace = sigterm_grace
        #: Workers the manager thread SIGKILLed because they outlived its SIGTERM.
        self.killed_pids: set[int] = set()
        # True until start_workers(): submit() queues tasks and starts nothing (see defer).
        self._deferred = True

    def start_workers(self, count: int | None = None) -> None:
        """Start ``count`` (default ``max_workers``) processes on this thread, then the manager
        thread; tasks submitted before this call are taken from then on.

        The processes are started before the manager thread, so no thread of this executor runs
        while they fork (under the fork start method, a thread holding a lock at that moment
        leaves the child with a lock nobody releases). The rest, if ``count`` is smaller, are
        started by :meth:`grow` (spawn and forkserver only: a fork then would run beside the
        manager thread).
        """
        self.start_processes(count)
        self.start_manager()

    def start_processes(self, count: int | None = None) -> None:
        """The first half of :meth:`start_workers`: only the processes. Several executors'
        processes can so all be started before any of their manager threads."""
        # CPython's own "start them all" (_launch_processes) is for fork only and asserts that no
        # manager thread exists yet; this does the same for every start method.
        target = self._max_workers if count is None else min(count, self._max_workers)  # type: ignore[attr-defined]
        with quiet_fork_warning(), _sigint_blocked(), _forking(self):
            while len(self._processes) < target:
                self._spawn_process()  # type: ignore[attr-defined]

    def start_manager(self) -> None:
        """The second half of :meth:`start_workers`: the manager thread, which takes the tasks
        queued so far."""
        with self._shutdown_lock:
            # Under the lock, as submit() starts it.
            self._deferred = False
            self._start_executor_manager_thread()

    def grow(self, stop: Callable[[], bool] = lambda: False) -> bool:
        """Start the processes :meth:`start_workers` left out, off the executor's lock; False if
        the pool broke or shut down meanwhile, or ``stop()`` turned true (those it started are
        killed then).

        ``submit()`` on the event loop takes the executor's lock, so the processes are started
        without it and added afterwards in one step, as a new dict (copy on write): the manager
        thread may be iterating the old one (Python 3.11 does so without the lock while it tears
        down a broken pool).
        """
        with self._shutdown_lock:
            if self._broken or self._shutdown_thread:
                return False
            missing = self._max_workers - len(self._processes)  # type: ignore[attr-defined]
        started: list[BaseProcess] = []
        try:
            for _ in range(missing):
                if stop():
                    break
                started.append(self._new_process())
            with self._shutdown_lock:
                if stop() or self._broken or self._shutdown_thread:
                    raise _GiveUp
                procs: Any = dict(self._processes)
                procs.update((p.pid, p) for p in started)
                self._processes = procs
                thread: Any = self._executor_manager_thread
                if thread is not None:
                    thread.processes = procs
                # It lists the processes' sentinels afresh each time it wakes.
                self._executor_manager_thread_wakeup.wakeup()
        except BaseException as exc:
            for p in started:
                with contextlib.suppress(Exception):
                    p.kill()
                    p.join()
            if isinstance(exc, _GiveUp):
                return False
            raise
        return True

    def _new_process(self) -> BaseProcess:
        """One worker process, started, not yet one of the executor's (CPython's
        ``_spawn_process`` without the registration; the same in 3.11, 3.12 and 3.13)."""
        ctx: Any = self._mp_context
        p: BaseProcess = ctx.Process(
            target=_process._process_worker,
            args=(
                self._call_queue,  # type: ignore[attr-defined]
                self._result_queue,
                self._initializer,
                self._initargs,
                self._max_tasks_per_child,  # type: ignore[attr-defined]
            ),
        )
        with _sigint_blocked(), _forking(self):
            p.start()
        return p

    def _adjust_process_count(self) -> None:
        # CPython starts a process here, on the thread calling submit() (the event loop), when no
        # worker is idle and fewer than max_workers run. Ours are started by start_workers() and
        # grow() only, off the loop.
        return

    def _start_executor_manager_thread(self) -> None:
        if self._deferred:
            return  # submit() before start_workers(): the task waits in _pending_work_items
        if self._executor_manager_thread is None:
            # CPython's own, with our thread class from the start: tasks may already be queued
            # when it starts (deferred executors), and a worker may die at once.
            if not self._safe_to_dynamically_spawn_children:
                with _sigint_blocked(), _forking(self):
                    self._launch_processes()
            thread = _ManagerThread(self)
            self._executor_manager_thread = thread
            thread.start()
            _process._threads_wakeups[thread] = self._executor_manager_thread_wakeup

    def fail_unstarted(self, cause: BaseException) -> None:
        """Workers that were to start later could not: an executor that never started fails the
        tasks queued for it with ``BrokenProcessPool`` (its owner then handles a crash), and
        takes no more."""
        with self._shutdown_lock:
            if not self._deferred:
                return
            self._broken = f"its worker process could not be started: {cause!r}"  # type: ignore[assignment]
            self._shutdown_thread = True
            items = list(self._pending_work_items.values())
        for item in items:
            with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                item.future.set_exception(_process.BrokenProcessPool(self._broken))

    def close_unstarted(self) -> None:
        """Release an executor whose workers were never started: cancel the tasks queued for it
        and close its pipes, which its manager thread would have done. It takes no more tasks."""
        with self._shutdown_lock:
            if not self._deferred:
                return
            self._shutdown_thread = True  # submit() now raises, as after shutdown()
        for item in list(self._pending_work_items.values()):
            item.future.cancel()
        self._pending_work_items.clear()
        for q in (getattr(self, "_call_queue", None), getattr(self, "_result_queue", None)):
            for end in ("_reader", "_writer"):
                with contextlib.suppress(Exception):
                    getattr(q, end).close()
        wakeup = getattr(self, "_executor_manager_thread_wakeup", None)
        if wakeup is not None:
            with contextlib.suppress(Exception):
                wakeup.close()

    def processes(self) -> list[BaseProcess]:
        """The worker processes (empty once the executor dropped them at shutdown)."""
        procs: dict[int, BaseProcess] | None = getattr(self, "_processes", None)
        return list(procs.values()) if procs else []

    def request_shutdown(self, deadline: float) -> bool:
        """``shutdown(wait=False, cancel_futures=True)`` unless the pool broke; never blocks long.

        Returns whether the workers were asked to exit. On Python >= 3.12 the manager thread
        holds ``_shutdown_lock`` while it terminates a broken pool and joins every worker, which
        never ends while a worker ignores SIGTERM; ``shutdown()`` would wait for that lock. Here
        the lock is taken with a timeout, and a broken pool (the manager thread is tearing it
        down) or the ``deadline`` (``time.monotonic()``) ends the attempt: the caller kills the
        processes instead.
        """
        lock: threading.Lock = self._shutdown_lock
        while not lock.acquire(timeout=0.01):
            if self._broken or time.monotonic() >= deadline:
                return False
        try:
            if self._broken:
                return False
            # What shutdown(wait=False, cancel_futures=True) does under the lock; calling it
            # would take the lock again. The references it drops are dropped by a later
            # shutdown() in kill_executors.
            self._cancel_pending_futures = True
            self._shutdown_thread = True
            wakeup = self._executor_manager_thread_wakeup
            if wakeup is not None:
                wakeup.wakeup()
        finally:
            lock.release()
        return True


def kill_executors(
    executors: Sequence[ProcessPoolExecutor],
    procs: Sequence[BaseProcess],
    manager_threads: Sequence[threading.Thread],
    result_queues: Sequence[Any],
    timeout: float,
) -> None:
    """SIGKILL every process, then shut the executors down and join their manager threads.

    The processes, manager threads and result queues are the executors' own, taken before any
    ``shutdown()`` (which drops the executor's references to them).

    The order matters. A manager thread that saw a worker die SIGTERMs the others and joins them,
    on Python >= 3.12 while holding the executor's ``_shutdown_lock``; ``shutdown()`` needs the
    same lock. A survivor that ignores SIGTERM (a handler installed by user code) is never
    joined, so ``shutdown()`` called first would block forever. Killed first, every process ends,
    the manager thread's joins return and the lock is free.
    """
    for p in procs:
        if p.exitcode is None:
            with contextlib.suppress(Exception):  # already reaped, or never started
                p.kill()
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(max(0.0, deadline - time.monotonic()))
        # join() returns early, exit status unknown, when the manager thread reaps the process at
        # the same moment (its waitpid() wins, ours gets ECHILD); that thread stores the status
        # right after. Waiting for it means every process is gone when this returns.
        while p.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.001)
    # A worker killed in the middle of writing a result larger than the pipe buffer leaves the
    # manager thread blocked reading the rest, forever: this process holds the queue's write end
    # too, so no EOF comes. Closing our write end once every worker is gone delivers the EOF; the
    # thread then sees a broken pool and exits.
    for q in result_queues:
        with contextlib.suppress(Exception):
            q._writer.close()
    for ex in executors:
        if isinstance(ex, Executor):
            ex.close_unstarted()  # before shutdown() drops its references to the pipes
        ex.shutdown(wait=False, cancel_futures=True)
    for t in manager_threads:
        t.join(timeout)
        if t.is_alive():
            _logger.warning("an executor manager thread did not exit: %s", t.name)
    for q in result_queues:
        with contextlib.suppress(Exception):
            q.close()


# ------------------------------------------------------------------------- the fork() warning
#
# Python >= 3.12 warns from os.fork() in the parent, on the thread that forks (here:
# multiprocessing.popen_fork.Popen._launch on our start-up thread), once the child exists, when
# the process has more than one thread: "This process (pid=N) is multi-threaded, use of fork()
# may lead to deadlocks in the child." (posixmodule.c, warn_about_fork_with_threads). An error
# raised by that warning (-W error) is cleared right there in C (PyErr_Clear), so os.fork() still
# returns the pid: the warning cannot fail a start half-way, it is only printed or recorded under
# the "default"/"always" actions.
#
# Our starts always run on a helper thread while the event loop runs, so the process is always
# multi-threaded when we fork. There is no small real fix (it would take forking every worker
# from a single-threaded process, i.e. forkserver, which users choose with
# multiprocessing_context="forkserver"); we reduce what can go wrong instead (no thread of the
# pool being started runs while it forks, see Executor.start_workers) and silence this one
# warning around our own starts, since the user cannot act on it for forks they did not make.
#
# warnings.catch_warnings() cannot be used: it swaps the process-wide filter list and restores
# it on exit, so two threads using it at once can lose each other's filters or leave one
# installed for good (the loader itself uses it on the event loop thread). Instead one filter
# entry is added while any start is under way (counted under a lock) and removed by identity
# from the list it went into, leaving every other filter as it is.

_FORK_WARNING = re.compile(
    r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to deadlocks",
    re.IGNORECASE,
)
_FORK_FILTER = ("ignore", _FORK_WARNING, DeprecationWarning, re.compile(r"multiprocessing\."), 0)
_fork_filter_lock = threading.Lock()
_fork_filter_users = 0
_fork_filter_lists: list[list[Any]] = []


def _filters_mutated() -> None:
    # Invalidates the per-module "already warned" caches; private, present in 3.11-3.13.
    mutated = getattr(warnings, "_filters_mutated", None)
    if mutated is not None:
        mutated()


@contextlib.contextmanager
def quiet_fork_warning() -> Iterator[None]:
    """Silence Python 3.12's multi-threaded ``fork()`` DeprecationWarning from multiprocessing
    while the block runs; every other warning and filter is left alone. Thread-safe."""
    global _fork_filter_users
    if sys.version_info < (3, 12):  # no such warning
        yield
        return
    with _fork_filter_lock:
        _fork_filter_users += 1
        if _fork_filter_users == 1:
            filters: list[Any] = warnings.filters
            filters.insert(0, _FORK_FILTER)
            _fork_filter_lists.append(filters)
            _filters_mutated()
    try:
        yield
    finally:
        with _fork_filter_lock:
            _fork_filter_users -= 1
            if _fork_filter_users == 0:
                # From the list it went into, and from the current one if another thread's
                # catch_warnings() copied it meanwhile: by identity, so an equal filter the
                # user installed stays.
                current: list[Any] = warnings.filters
                for lst in [*_fork_filter_lists, current]:
                    for i, entry in enumerate(lst):
                        if entry is _FORK_FILTER:
                            del lst[i]
                            break
                _fork_filter_lists.clear()
                _filters_mutated()


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Start children with SIGINT blocked (a fork, and an exec, keep the signal mask).

    A ^C meant for this process reaches its whole process group: a terminal sends it there, and
    so does a Jupyter kernel's interrupt. A worker still starting (importing torch, unpickling
    the dataset) would die of it with a KeyboardInterrupt traceback printed into the terminal or
    the notebook cell. Blocked, the signal waits until the worker's initializer ignores SIGINT
    and unblocks it, and is then discarded: the ^C is the main process's alone to handle. Here,
    on a helper thread or briefly on the caller's, a ^C for this process is only held back for
    the duration of ``start()``.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def release_semaphores(queues: Sequence[Any]) -> None:
    """Unlink the named semaphores of these multiprocessing queues now, not at a collection.

    Under spawn and forkserver every lock and semaphore of a queue is a named POSIX semaphore
    (a ``/dev/shm/sem.*`` file) that multiprocessing unlinks when the lock object is freed. The
    executors' queues live in reference cycles, so that waited for a garbage collection: a
    service running with ``gc.freeze()`` or the collector off gained five per worker per epoch,
    and an interpreter ended by a signal left them for the resource tracker to report as leaked.
    Called once every process that could open them is gone; runs the lock's own finalizer (which
    also tells the resource tracker), so nothing is unlinked twice.
    """
    locks = {
        id(lock): lock
        for q in queues
        for name in ("_rlock", "_wlock", "_sem")
        if isinstance(lock := getattr(q, name, None), synchronize.SemLock)
    }
    if not locks:
        return
    for finalizer in list(util._finalizer_registry.values()):  # type: ignore[attr-defined]
        ref = getattr(finalizer, "_weakref", None)
        if ref is not None and id(ref()) in locks and ref() is locks[id(ref())]:
            with contextlib.suppress(Exception):  # already unlinked: nothing left to do
                finalizer()


def close_pipes(queues: Sequence[Any]) -> None:
    """Close both ends of these multiprocessing queues' pipes now, not at a collection (two
    descriptors per queue; a service with the collector off gained four per epoch). Called once
    every process and thread that used them is gone."""
    for q in queues:
        for name in ("_reader", "_writer"):
            conn = getattr(q, name, None)
            if conn is not None:
                with contextlib.suppress(Exception):  # closed already
                    conn.close()


# Every executor of this process, and per thread the one whose worker it is forking (a fork
# child keeps the forking thread's value: it is that thread).
_alive: weakref.WeakSet[Executor] = weakref.WeakSet()
_forking_now = threading.local()


@contextlib.contextmanager
def _forking(executor: Executor) -> Iterator[None]:
    _forking_now.executor = executor
    try:
        yield
    finally:
        _forking_now.executor = None


def _close_foreign_result_pipes() -> None:
    """In a forked child: close the write end of every other executor's result pipe.

    A worker killed half-way through writing a large result leaves its executor's manager thread
    reading the rest; only EOF, once every holder of the write end has closed it, frees it. A
    process forked later (a worker of another pool, under the fork start method) inherited that
    write end and kept the thread waiting for ever. Runs right after a fork, in the child, with no
    other thread: no lock is taken.
    """
    mine = getattr(_forking_now, "executor", None)
    for ex in list(_alive):
        if ex is mine:
            continue  # this worker's own results go there
        queue = getattr(ex, "_result_queue", None)
        writer = getattr(queue, "_writer", None)
        if writer is not None:
            with contextlib.suppress(Exception):  # closed already
                writer.close()


os.register_at_fork(after_in_child=_close_foreign_result_pipes)
