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
* :class:`Lane` (``Executor(lane=True)``, one process): tasks submitted on an event loop and
  their results travel over two pipes that loop writes and reads itself, not through the
  executor's manager and feeder threads (see the section comment above :class:`Lane`); the
  worker serves them from its call queue's ``get()`` (:class:`_LaneCallQueue`).

Private executor attributes used (present in CPython 3.11, 3.12 and 3.13): ``_processes``,
``_max_workers``, ``_spawn_process``, ``_start_executor_manager_thread``,
``_executor_manager_thread``, ``_executor_manager_thread_wakeup``, ``_shutdown_lock``,
``_shutdown_thread``, ``_cancel_pending_futures``, ``_broken``, ``_result_queue``,
``_call_queue``, ``_max_tasks_per_child``, ``_mp_context``; of
its manager thread: ``terminate_broken``, ``_join_executor_internals`` (>= 3.12), ``processes``,
``pending_work_items``, ``executor_reference``; of the module: ``_process_worker``,
``_ExceptionWithTraceback``, ``_SafeQueue`` (whose ``get()`` the worker loop calls).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import io
import itertools
import logging
import os
import pickle
import re
import select
import signal
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, InvalidStateError, ProcessPoolExecutor
from concurrent.futures import process as _process
from multiprocessing import synchronize, util
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as ready_of
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import _ahead

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = ("Executor", "close_pipes", "kill_executors", "quiet_fork_warning", "release_semaphores")


class _GiveUp(Exception):
    """Executor.grow: the pool broke or shut down, or the caller stopped, while it started."""


class LaunchError(RuntimeError):
    """Worker processes kept dying while they were being started (see :data:`LAUNCH_ATTEMPTS`)."""


#: Times in a row a worker process is started again when it dies before its parent has handed
#: it its start-up data. Such a process ran none of the user's code and held no batch (nothing
#: is lost or repeated), so this is not a worker restart; something outside kills processes.
LAUNCH_ATTEMPTS = 3

#: What ``Process.start()`` raises when the new process died during the hand-over: the write of
#: its start-up data into its pipe finds no reader (forkserver), or the fork server that forks it
#: went away (a refused or dropped connection; EBADF, see :func:`_died_in_hand_over`).
_LAUNCH_DEATHS = (BrokenPipeError, ConnectionResetError, ConnectionRefusedError, EOFError)

#: Seconds to wait before the next launch after the fork server itself failed it, times the
#: attempt: a fork server that is exiting still counts as alive to
#: ``multiprocessing.forkserver.ensure_running`` until it has exited, which restarts it then.
_SERVER_BACKOFF_S = 0.1


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

    def join_executor_internals(self) -> None:
        # Called on a normal shutdown (also by concurrent.futures' hook at interpreter exit).
        lane = self.lane
        if lane is not None and lane.unread():
            # Results nobody will read (their event loop is closed or stopped): a worker blocked
            # writing one into a full pipe never reads its exit request, and the join below,
            # at interpreter exit too, would wait for ever. Its futures fail; it is killed.
            lane.fail(_process.BrokenProcessPool("the worker pool was shut down"))
            self._kill_alive(list(self.processes.values()))
        super().join_executor_internals()

    def _join_executor_internals(self, broken: bool = False) -> None:
        # Python >= 3.12 only (3.11 joins without holding the lock). Called by _terminate_broken
        # after the SIGTERMs, before it joins every process.
        if broken:
            self._kill_sigterm_survivors()
        super()._join_executor_internals(broken)  # type: ignore[misc]

    def _kill_sigterm_survivors(self) -> None:
        executor = self.executor_reference()
        grace = getattr(executor, "_sigterm_grace", SIGTERM_GRACE_S)
        del executor  # no strong reference held while waiting: it may be collected meanwhile
        if grace is None:
            return
        deadline = time.monotonic() + grace
        procs = list(self.processes.values())
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill_alive(procs)

    def _kill_alive(self, procs: list[Any]) -> None:
        """SIGKILL those of ``procs`` still running; their pids go to the executor's
        ``killed_pids``, so a crash report does not blame them."""
        executor = self.executor_reference()
        killed: set[int] = getattr(executor, "killed_pids", set())
        del executor
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                killed.add(p.pid)
                p.kill()

    def _note_first_deaths(self) -> None:
        """Put the pids of the workers dead now, before this thread stops the others, into the
        executor's ``first_dead_pids``: the crash report blames those. Exit codes cannot tell
        them apart afterwards: a forkserver worker's exit code read by two threads at once comes
        out as 255 for one of them (its ``poll`` is not thread-safe), like a real exit(255)."""
        executor = self.executor_reference()
        first: set[int] | None = getattr(executor, "first_dead_pids", None)
        del executor
        if first is None:
            return
        procs = list(self.processes.values())
        ready = set(ready_of([p.sentinel for p in procs], 0))
        first.update(p.pid for p in procs if p.sentinel in ready and p.pid is not None)

    #: The executor's :class:`Lane`, if it has one (set before the thread starts).
    lane: Lane | None = None

    def terminate_broken(self, cause: Any) -> None:
        self._note_first_deaths()
        lane = self.lane
        if lane is not None:
            # First: CPython joins the workers before it returns (forever for one that ignores
            # SIGTERM on Python 3.11), and the lane's futures must not wait for that.
            lane.fail(
                _process.BrokenProcessPool(
                    "A process in the process pool was terminated abruptly while the future "
                    "was running or pending."
                )
            )
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


# ----------------------------------------------------------------------------- the direct lane
#
# A one-process executor's tasks and results normally cross three threads of this process each
# way: submit() wakes the manager thread, which puts the task on the call queue, whose feeder
# thread pickles and writes it; the manager thread reads the result, completes the future, and
# the owner's callback hands it to the event loop with call_soon_threadsafe. For small batches
# those hops, not the worker, bound the rate (on a 2-core machine the threads also compete with
# the workers for the cores and with the loop for the GIL).
#
# A lane is a second pair of pipes between the event loop and the worker, used instead: the loop
# writes the pickled task into the call pipe itself (non-blocking; what does not fit waits for
# the pipe to drain, through loop.add_writer) and reads the worker's results with
# loop.add_reader, completing each future on the loop. The executor's own queues and manager
# thread stay: the manager thread still watches the process (a death fails every future, the
# lane's too, see _ManagerThread.terminate_broken) and still asks the worker to exit at shutdown.
# Its frames are multiprocessing.Connection's own (a 4-byte big-endian length, -1 then 8 bytes
# for 2 GiB and more), so the worker reads and writes them with Connection.recv_bytes/send_bytes.

_FRAME = struct.Struct("!i")
_FRAME_LONG = struct.Struct("!Q")
_WORK_ID = struct.Struct("!q")
#: The work id of a post: a task the worker runs without sending anything back.
_POST_ID = -1

# concurrent.futures.process's private helpers, the same in CPython 3.11-3.13 (untyped here).
_private: Any = _process

#: Tasks a lane keeps written ahead into its worker's pipe, as many as a one-process executor's
#: call queue holds (max_workers + EXTRA_QUEUED_CALLS): the worker never waits for the next
#: task, and a task further back can still be cancelled without ever reaching the worker.
LANE_DEPTH = 2

#: A lane's result buffer grows by at least this much at a time (a default pipe holds 64 KiB).
_READ_SIZE = 1 << 16

#: Bytes a lane reads from its result pipe per callback, at most: other callbacks get their
#: turn (about 0.1 ms of copying on the 2-core VM). A frame may take several callbacks.
_READ_BUDGET = 1 << 17

#: A lane's result buffer, once empty, shrinks back to this size.
_KEEP_SIZE = 1 << 20

_LONG_HEAD = 4 + 8  # _FRAME.size + _FRAME_LONG.size


class _Dumper:
    """``ForkingPickler.dumps`` with one pickler kept for every call, for one thread's use.

    ``ForkingPickler.dumps`` builds a pickler per call, and each copies the reduction tables:
    3.7 of its 5.4 us for a batch's task (measured warm; a lane pickles one task and one result
    per batch). The kept pickler reads both tables live, in ForkingPickler's order (its own
    reductions first), so a reduction registered or replaced later is used as by a new pickler;
    after each call it gets a new, empty memo, so one large pickle leaves no large table behind
    (clearing the old one keeps its size: later calls would wipe all of it).
    """

    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._pickler = ForkingPickler(self._buf, pickle.HIGHEST_PROTOCOL)
        # Any mapping does (the pickler looks types up with __getitem__); typeshed says dict.
        self._pickler.dispatch_table = collections.ChainMap(  # type: ignore[assignment]
            ForkingPickler._extra_reducers,  # type: ignore[attr-defined]
            ForkingPickler._copyreg_dispatch_table,  # type: ignore[attr-defined]
        )

    def dumps(self, obj: object) -> bytes:
        pickler = self._pickler
        try:
            pickler.dump(obj)
            return self._buf.getvalue()
        finally:
            # Forget the objects (the memo holds them) and the bytes, also after an error.
            pickler.memo = {}
            self._buf.seek(0)
            self._buf.truncate()


#: The worker's: its lane tasks run on its main thread, one at a time.
_result_dumper = _Dumper()


def _frame(payload: bytes) -> bytes:
    n = len(payload)
    if n > 0x7FFFFFFF:
        return _FRAME.pack(-1) + _FRAME_LONG.pack(n) + payload
    return _FRAME.pack(n) + payload


class Lane:
    """The event loop's direct pipes to one worker process (see the section comment above).

    Owned by an :class:`Executor` made with ``lane=True``. :meth:`submit` runs on the event loop
    only; :meth:`fail` on any thread. Every future it returns is completed exactly once: with the
    worker's result, with the task's exception, with ``BrokenProcessPool`` when the pool breaks
    or is killed, or cancelled while it still waits in this process.
    """

    def __init__(self, ctx: Any, depth: int = LANE_DEPTH) -> None:
        #: Tasks written ahead into the worker's pipe (more for a worker that fetches
        #: asynchronously: it starts the requests of every task it holds, see ``_ahead``).
        self.depth = max(1, depth)
        self.call_r, self.call_w = ctx.Pipe(duplex=False)
        self.result_r, self.result_w = ctx.Pipe(duplex=False)
        _remember(self.call_r, self.call_w, self.result_r, self.result_w)
        _grow_pipe(self.result_w.fileno())
        # Guards the futures' hand-over between the loop and a thread that fails them all:
        # whoever pops a future from _pending/_queued completes it.
        self._lock = threading.Lock()
        self._ids = itertools.count()
        # Written to the worker, result not read yet: work id -> future (set running).
        self._pending: dict[int, Future[Any]] = {}
        # Not written yet (more than LANE_DEPTH outstanding, or the worker not started yet); a
        # post has no future.
        self._queued: collections.deque[tuple[int, Future[Any] | None, bytes]] = collections.deque()
        self._out = bytearray()  # framed bytes not yet written to the call pipe
        # Bytes read from the result pipe, not yet a whole frame: the first _filled of _in.
        self._in = bytearray()
        self._filled = 0
        self._dumper = _Dumper()  # the loop's: tasks are pickled on it only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writing = False
        self._open = False  # the worker process exists: tasks may be written
        self._broken: BaseException | None = None
        self._closed = False

    # -------------------------------------------------------------------- worker start-up

    def worker_args(self) -> tuple[Connection, Connection]:
        return self.call_r, self.result_w

    def started(self) -> None:
        """The worker process exists and holds its own copies of its ends: close ours, and
        write what was queued for it (from the loop). Runs in: the thread that started it."""
        for conn in (self.call_r, self.result_w):
            with contextlib.suppress(OSError):
                conn.close()
        with self._lock:
            self._open = True
            loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to serve
                loop.call_soon_threadsafe(self._pump)

    # -------------------------------------------------------------------- the event loop side

    def submit(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Future[Any]:
        """Queue ``fn(*args)`` for the worker. Runs in: the event loop (the one it serves).

        Raises ``BrokenProcessPool`` once the pool broke and ``RuntimeError`` once closed, as
        ``ProcessPoolExecutor.submit`` does; a task that cannot be pickled fails its future.
        """
        fut: Future[Any] = Future()
        try:
            data = self._encode(fn, args)
        except Exception as exc:  # as the executor's feeder thread reports it: on the future
            fut.set_exception(exc)
            return fut
        with self._lock:
            if self._broken is not None:
                raise _process.BrokenProcessPool(str(self._broken))
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._queued.append((next(self._ids), fut, data))
        self._pump()
        return fut

    def post(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> bool:
        """Queue ``fn(*args)`` for the worker with no reply and no future, in order with the
        tasks. Runs in: the event loop it serves. False (nothing sent) if it cannot be pickled or
        the lane is broken or closed: a post is only ever an optimisation."""
        try:
            data = self._encode(fn, args)
        except Exception:
            return False
        with self._lock:
            if self._broken is not None or self._closed:
                return False
            self._queued.append((_POST_ID, None, data))
        self._pump()
        return True

    def _encode(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
        """Attach to the running loop if it is a new one, and pickle ``(fn, args)``."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._attach(loop)
        # multiprocessing's pickler, as the executor's own queue uses: its reductions
        # (connections, sockets, shared tensors) must hold on this path too.
        return self._dumper.dumps((fn, args))

    def serves(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether :meth:`submit` may run on ``loop``: not while another loop that watches the
        lane runs (on another thread), whose callbacks would then share the lane's buffers."""
        old = self._loop
        return old is None or old is loop or old.is_closed() or not old.is_running()

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        # A persistent pool kept from an earlier event loop (consecutive asyncio.run() calls, or
        # a loop that is open but stopped): move over, unregistering from it while it is idle.
        self.detach()
        # Non-blocking: the loop must never wait for the worker. Our ends only; the worker's
        # ends are other open files (a pipe's two ends are).
        os.set_blocking(self.call_w.fileno(), False)
        os.set_blocking(self.result_r.fileno(), False)
        self._writing = False
        loop.add_reader(self.result_r.fileno(), self._on_readable)
        with self._lock:  # started() reads it from the start thread
            self._loop = loop
        if self._out:
            self._flush()

    def _pump(self) -> None:
        """Write queued tasks while fewer than ``depth`` are with the worker. Runs in: loop."""
        if self._loop is None or self._closed:
            return
        out = self._out
        while True:
            with self._lock:
                if not self._open or not self._queued or self._broken is not None:
                    break
                # A post waits for nothing but the tasks ahead of it (it adds no result).
                if self._queued[0][1] is not None and len(self._pending) >= self.depth:
                    break
                work_id, fut, data = self._queued.popleft()
                if fut is not None:
                    if not fut.set_running_or_notify_cancel():
                        continue  # cancelled while it waited here: the worker never sees it
                    self._pending[work_id] = fut
            out += _frame(_WORK_ID.pack(work_id) + data)
        self._flush()

    def _flush(self) -> None:
        if not self._out or self._writing or self._loop is None:
            return
        try:
            n = os.write(self.call_w.fileno(), self._out)
        except BlockingIOError:
            n = 0
        except OSError:  # the worker is gone (EPIPE): its death is handled elsewhere
            self._out.clear()
            return
        del self._out[:n]
        if self._out:
            # The rest once the worker has read some: frames stay whole and in order because
            # only the loop ever writes to this pipe.
            self._loop.add_writer(self.call_w.fileno(), self._on_writable)
            self._writing = True

    def _on_writable(self) -> None:
        loop = self._loop
        assert loop is not None
        loop.remove_writer(self.call_w.fileno())
        self._writing = False
        self._flush()

    def _on_readable(self) -> None:
        # Read straight into one kept buffer and load each whole frame from a view of it: a
        # batch of Python objects is a frame of hundreds of KiB, and every copy of it (a read
        # into a new bytes object, a slice) costs the loop fresh pages as well as the copying.
        fd = self.result_r.fileno()
        buf = self._in
        filled = self._filled
        budget = _READ_BUDGET
        while budget > 0:
            if filled == len(buf):
                need = self._frame_bounds(buf, filled)[1]
                # Grow to the frame under way (its length is known once its header is in),
                # or by a read's worth.
                buf = self._resized(buf, filled + max(need - filled, _READ_SIZE))
            with memoryview(buf) as view, view[filled:] as free:
                try:
                    n = os.readv(fd, [free])
                except BlockingIOError:
                    break
                except OSError:
                    n = 0
            if n == 0:
                # Every write end is closed: the worker is gone (its death is handled by the
                # manager thread and the owner's sentinel watch, not here).
                self.detach()
                break
            filled += n
            budget -= n
            if filled < len(buf):
                break  # the pipe is empty for now
        pos = 0
        interrupt: BaseException | None = None
        completed = False
        with memoryview(buf) as view:
            while True:
                start, end = self._frame_bounds(view, filled, pos)
                if end > filled:
                    break
                with view[start:end] as frame:
                    try:
                        self._complete(frame)
                    except BaseException as exc:  # a ^C on the loop thread: raised at the end
                        interrupt = interrupt or exc
                completed = True
                pos = end
        if pos:
            # The rest (a frame under way) moves to the front; a buffer grown for one large
            # frame goes back to the usual size once empty.
            rest = filled - pos
            with memoryview(buf) as view:
                view[:rest] = view[pos:filled]  # a memmove: no copy of the rest on the side
            filled = rest
            if not filled and len(buf) > _KEEP_SIZE:
                self._resized(buf, _KEEP_SIZE)
        self._filled = filled
        if completed:
            self._pump()
        if interrupt is not None:
            raise interrupt

    def _resized(self, buf: bytearray, size: int) -> bytearray:
        """``buf`` (``self._in``) grown or cut to ``size`` bytes."""
        try:
            if size > len(buf):
                buf.extend(bytes(size - len(buf)))
            else:
                del buf[size:]
        except BufferError:  # a view of it outlived its frame (an error's traceback): copy
            buf = bytearray(buf[:size]) + bytes(max(0, size - len(buf)))
            self._in = buf
        return buf

    @staticmethod
    def _frame_bounds(buf: bytearray | memoryview, filled: int, pos: int = 0) -> tuple[int, int]:
        """Where the payload of the frame starting at ``pos`` starts and where the frame ends;
        the end is past ``filled`` while the frame, or its header, is incomplete."""
        if filled - pos < _FRAME.size:
            return pos, filled + 1
        n = int(_FRAME.unpack_from(buf, pos)[0])
        if n != -1:
            return pos + _FRAME.size, pos + _FRAME.size + n
        if filled - pos < _LONG_HEAD:
            return pos, filled + 1
        return pos + _LONG_HEAD, pos + _LONG_HEAD + int(
            _FRAME_LONG.unpack_from(buf, pos + _FRAME.size)[0]
        )

    def _complete(self, frame: memoryview) -> None:
        (work_id,) = _WORK_ID.unpack_from(frame)
        with self._lock:
            fut = self._pending.pop(work_id, None)
        if fut is None:
            return  # failed meanwhile (the pool broke or was killed)
        try:
            exc, value = pickle.loads(frame[_WORK_ID.size :])
        except BaseException as err:
            # A result that cannot be rebuilt here fails its task alone; popped above, the
            # future is completed here or never. A ^C or SystemExit still reaches the loop.
            fut.set_exception(err)
            if not isinstance(err, Exception):
                raise
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)

    def detach(self) -> None:
        """Stop watching the pipes. Runs in: the event loop, or any thread while it is not
        running."""
        loop, self._loop = self._loop, None
        writing, self._writing = self._writing, False
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(Exception):  # closed meanwhile
            loop.remove_reader(self.result_r.fileno())
        if writing:
            with contextlib.suppress(Exception):
                loop.remove_writer(self.call_w.fileno())

    # -------------------------------------------------------------------- any thread

    def unread(self) -> bool:
        """Whether tasks are with the worker (or waiting) while no running loop reads the
        lane: their results would stay in the pipe. Runs in: any thread."""
        with self._lock:
            # A frame half-written (a large post, say) leaves the worker blocked reading the rest.
            outstanding = (
                bool(self._pending)
                or bool(self._out)
                or any(f is not None for _, f, _ in self._queued)
            )
            loop = self._loop
        return outstanding and (loop is None or loop.is_closed() or not loop.is_running())

    def fail(self, exc: BaseException) -> None:
        """Fail every future not completed yet with ``exc``; later submits raise
        ``BrokenProcessPool``. Runs in: any thread."""
        with self._lock:
            if self._broken is None:
                self._broken = exc
            futures = [f for f in self._pending.values()]
            futures += [f for _, f, _ in self._queued if f is not None]
            self._pending.clear()
            self._queued.clear()
        for f in futures:
            with contextlib.suppress(InvalidStateError):  # cancelled while it waited here
                f.set_exception(exc)

    def cancel_queued(self) -> None:
        """Cancel the tasks not written to the worker yet, and take no more (shutdown with
        ``cancel_futures=True``). Runs in: any thread."""
        with self._lock:
            self._closed = True
            queued = [f for _, f, _ in self._queued if f is not None]
            self._queued.clear()
        for f in queued:
            f.cancel()

    def close(self) -> None:
        """After the worker is gone: cancel what waited here, fail what it had, stop watching
        the pipes and close them. Runs in: any thread; safe to call twice."""
        self.cancel_queued()
        self.fail(_process.BrokenProcessPool("the worker pool was shut down"))
        loop = self._loop
        if loop is not None and not loop.is_closed() and loop.is_running():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                # The loop's selector may be in use right now: unregister there, then close
                # (a descriptor closed while registered could be reused and misrouted).
                with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing to undo
                    loop.call_soon_threadsafe(self._close_now)
                    return
        self._close_now()

    def _close_now(self) -> None:
        self.detach()
        for conn in (self.call_r, self.call_w, self.result_r, self.result_w):
            with contextlib.suppress(OSError):
                conn.close()
        self._out.clear()
        self._in = bytearray()  # not clear(): that would fail while a view of it is alive
        self._filled = 0


#: A result pipe holds this much (Linux; the default 64 KiB elsewhere or where refused). A batch
#: of Python objects pickles to hundreds of KiB: through 64 KiB the worker wrote it in pieces,
#: sleeping between them, and every read by the loop woke it again, so the loop's callback that
#: read the result was preempted by the worker it had just woken (a 730 KB `text` batch: callbacks
#: of 2+ ms wall-clock for 1 ms of CPU).
RESULT_PIPE_BYTES = 1 << 20


def _grow_pipe(fd: int) -> None:
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if set_size is None:
        return
    with contextlib.suppress(OSError):  # above /proc/sys/fs/pipe-max-size, or another limit
        fcntl.fcntl(fd, set_size, RESULT_PIPE_BYTES)


class _LockedWakeup(_private._ThreadWakeup):  # type: ignore[misc]
    """The executor's manager-thread wakeup pipe, with ``wakeup()`` and ``close()`` serialised.

    CPython (3.11-3.13.0 at least) calls ``wakeup()`` from its interpreter-exit hook
    (``concurrent.futures.process._python_exit``) without any lock, while the manager thread may
    be closing the same pipe (``join_executor_internals``, under the executor's lock only):
    ``wakeup()`` sees the pipe open, the manager thread closes it, and the write then fails with
    ``OSError`` ("handle is closed", or ``EBADF`` when the descriptor is closed but its number
    not yet cleared), or writes into whatever reused that number. A multiprocessing child with
    a loader left open hits this at its exit: our finalizer SIGKILLs the workers just before,
    so the manager thread is tearing the pool down exactly then, and the child exited with
    status 1. A per-pipe lock closes that window (what later CPython versions do). The executor's
    own pipe object gets this class (``__class__`` set once, before its manager thread starts),
    so the call queue and the exit hook keep referring to it.
    """

    _wakeup_lock: threading.Lock

    def close(self) -> None:
        with self._wakeup_lock:
            super().close()

    def wakeup(self) -> None:
        with self._wakeup_lock:
            super().wakeup()


def _lock_wakeup(wakeup: Any) -> None:
    if wakeup is not None and type(wakeup) is _private._ThreadWakeup:
        wakeup._wakeup_lock = threading.Lock()
        wakeup.__class__ = _LockedWakeup


class _LaneCallQueue(_private._SafeQueue):  # type: ignore[misc]
    """The call queue of an executor with a :class:`Lane`: in the worker, ``get()`` serves the
    lane's tasks while it waits for the queue's next item.

    CPython's worker loop (``_process_worker``) is kept as it is: it runs the initializer, then
    calls ``get()`` for each item of the call queue, which carries only the shutdown request
    (``None``) and tasks submitted with no running event loop. Lane tasks are taken first and
    in order. The executor's own call queue object gets this class (``__class__`` is set once,
    before any process starts), so its pipes, locks and feeder thread are the executor's own.
    """

    lane_in: Connection | None = None
    lane_out: Connection | None = None

    def __getstate__(self) -> Any:
        return (super().__getstate__(), self.lane_in, self.lane_out)

    def __setstate__(self, state: Any) -> None:
        base, self.lane_in, self.lane_out = state
        super().__setstate__(base)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Runs in: a worker process."""
        lane_in, lane_out = self.lane_in, self.lane_out
        if lane_in is None or lane_out is None or not block or timeout is not None:
            return super().get(block, timeout)
        if _ahead.start is not None:
            return self._get_ahead(lane_out)
        poller = select.poll()
        lane_fd = lane_in.fileno()
        poller.register(self._reader.fileno(), select.POLLIN)
        poller.register(lane_fd, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if lane_fd not in ready:
                return super().get(True)
            try:
                data = lane_in.recv_bytes()
            except EOFError:  # every copy of the loop's end is closed: the queue is left
                self.lane_in = None
                return super().get(True)
            _run_lane_task(data, lane_out)
            del data

    def _get_ahead(self, lane_out: Connection) -> Any:
        """``get()`` for a worker whose dataset fetches asynchronously: every lane task is read
        as soon as it arrives and shown to ``_ahead.start`` (its requests begin), then run in
        order; while one waits for its requests, ``_ahead.wait`` reads on (see ``_ahead``)."""
        pending: collections.deque[tuple[bytes, Any]] = collections.deque()

        def read() -> int:
            lane_in = self.lane_in
            while lane_in is not None and lane_in.poll(0):
                try:
                    data = lane_in.recv_bytes()
                except EOFError:  # every copy of the loop's end is closed
                    self.lane_in = lane_in = None
                    break
                try:
                    task = pickle.loads(memoryview(data)[_WORK_ID.size :])
                except BaseException:
                    task = None  # _run_lane_task reports the error
                else:
                    start = _ahead.start
                    if start is not None:
                        with contextlib.suppress(Exception):  # the task itself reports errors
                            start(*task)
                pending.append((data, task))
            return -1 if lane_in is None else lane_in.fileno()

        _ahead.reader = read
        try:
            poller = select.poll()
            poller.register(self._reader.fileno(), select.POLLIN)
            while True:
                if pending:
                    data, task = pending.popleft()
                    _run_lane_task(data, lane_out, task)
                    del data, task
                    continue
                lane_fd = read()
                if pending:
                    continue
                if lane_fd < 0:
                    return super().get(True)
                poller.register(lane_fd, select.POLLIN)
                ready = {fd for fd, _ in poller.poll()}
                poller.unregister(lane_fd)
                if lane_fd not in ready:
                    return super().get(True)
        finally:
            _ahead.reader = None


def _run_lane_task(data: bytes, lane_out: Connection, task: Any = None) -> None:
    """Run one lane task and send its result back, or the exception it raised (an exception
    that cannot be pickled is replaced by the pickling error, as the executor does).
    ``task``: its ``(fn, args)`` where the frame was already unpickled."""
    work_id = data[: _WORK_ID.size]
    if _WORK_ID.unpack(work_id)[0] == _POST_ID:
        with contextlib.suppress(Exception):  # a post reports nothing (see Lane.post)
            fn, args = task or pickle.loads(memoryview(data)[_WORK_ID.size :])
            fn(*args)
        return
    result: Any = None
    exc: Any = None
    try:
        fn, args = task or pickle.loads(memoryview(data)[_WORK_ID.size :])
        result = fn(*args)
    except BaseException as e:
        exc = _private._ExceptionWithTraceback(e, e.__traceback__)
    try:
        payload = _result_dumper.dumps((exc, result))
    except BaseException as e:
        exc = _private._ExceptionWithTraceback(e, e.__traceback__)
        payload = _result_dumper.dumps((exc, None))
    del result
    lane_out.send_bytes(work_id + payload)


class Executor(ProcessPoolExecutor):
    """A ``ProcessPoolExecutor`` that starts all its processes at once and stops without hanging.

    Call :meth:`start_workers` right after construction, before the executor is shared with any
    other thread; afterwards it never starts a process again (a dead worker breaks the pool, and
    the owner replaces the whole pool).

    ``sigterm_grace``: see :class:`_ManagerThread`; None keeps CPython's wait without end.

    ``lane=True`` (one process only): tasks submitted from a running event loop travel over a
    :class:`Lane`, written and read by that loop, and never through the executor's threads; the
    worker takes them in submission order. Submitted anywhere else they take the executor's own
    path. The manager thread still watches the process and stops it.
    """

    def __init__(
        self,
        *args: Any,
        sigterm_grace: float | None = SIGTERM_GRACE_S,
        lane: bool = False,
        lane_depth: int = LANE_DEPTH,
        **kwargs: Any,
    ) -> None:
        _alive.add(self)
        self._lane: Lane | None = None
        # The queues' semaphores start multiprocessing's resource tracker (spawn, forkserver),
        # a process of its own that a ^C must not interrupt in its start-up either.
        with _sigint_blocked():
            super().__init__(*args, **kwargs)
        _remember(self._result_queue._writer)  # type: ignore[attr-defined]
        _lock_wakeup(getattr(self, "_executor_manager_thread_wakeup", None))
        if lane:
            if self._max_workers != 1 or self._max_tasks_per_child is not None:  # type: ignore[attr-defined]
                raise ValueError("a lane serves an executor of one process, never replaced")
            self._lane = Lane(self._mp_context, lane_depth)
            queue: Any = self._call_queue  # type: ignore[attr-defined]
            queue.__class__ = _LaneCallQueue
            queue.lane_in, queue.lane_out = self._lane.worker_args()
        self._sigterm_grace = sigterm_grace
        #: Workers the manager thread SIGKILLed because they outlived its SIGTERM.
        self.killed_pids: set[int] = set()
        #: Workers found dead when the manager thread saw the pool break, before it stopped the
        #: others (see _ManagerThread._note_first_deaths).
        self.first_dead_pids: set[int] = set()
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
        while len(self._processes) < target:
            self._spawn_process()
        if self._lane is not None and self._processes:
            self._lane.started()

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

    def _spawn_process(self) -> None:
        # CPython's, with the launch retried (:meth:`_new_process`); every start goes through
        # here or :meth:`grow`.
        p = self._new_process()
        procs: Any = self._processes
        procs[p.pid] = p

    def _new_process(self) -> BaseProcess:
        """One worker process, started, not yet one of the executor's (CPython's
        ``_spawn_process`` without the registration; the same in 3.11, 3.12 and 3.13). Started
        again if it dies while being started, :data:`LAUNCH_ATTEMPTS` times in all, then
        :class:`LaunchError`."""
        ctx: Any = self._mp_context
        args = (
            self._call_queue,  # type: ignore[attr-defined]
            self._result_queue,
            self._initializer,
            self._initargs,
            self._max_tasks_per_child,  # type: ignore[attr-defined]
        )
        for attempt in itertools.count(1):
            p: BaseProcess = ctx.Process(target=_process._process_worker, args=args)
            try:
                with quiet_fork_warning(), _sigint_blocked(), _forking(self):
                    p.start()
            except (OSError, EOFError) as exc:
                if not _died_in_hand_over(exc):
                    raise
                code = _release_launch(exc)
                if code is not None and code >= 0:
                    # It exited by itself while reading its start-up data: that would fail the
                    # same way again.
                    raise LaunchError(
                        f"DataLoader worker process exited with code {code} while it was being "
                        "started, before any of your code ran in it (its own error, if it "
                        "printed one, is above); it is not started again"
                    ) from exc
                if attempt >= LAUNCH_ATTEMPTS:
                    raise LaunchError(
                        f"DataLoader worker process died while it was being started, "
                        f"{attempt} times in a row ({exc!r}): something kills new processes "
                        "(an out-of-memory killer, a process limit, a supervisor)"
                    ) from exc
                if not isinstance(exc, BrokenPipeError):  # the fork server's own failure
                    time.sleep(_SERVER_BACKOFF_S * attempt)
                # Logged, not warned: under -W error a warning here would fail the start.
                _logger.warning(
                    "a DataLoader worker process died while it was being started (%r); "
                    "starting another (attempt %d of %d)",
                    exc,
                    attempt + 1,
                    LAUNCH_ATTEMPTS,
                )
                continue
            return p
        raise AssertionError("unreachable")

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        lane = self._lane
        if lane is not None and not kwargs:
            if self._broken:
                raise _process.BrokenProcessPool(self._broken)
            if self._shutdown_thread:
                raise RuntimeError("cannot schedule new futures after shutdown")
            loop = _running_loop()
            # Another thread's loop serving the lane right now: the executor's own path (the
            # worker serves both; only tasks of the two paths are not ordered among themselves).
            if loop is not None and lane.serves(loop):
                return lane.submit(fn, args)
        return super().submit(fn, *args, **kwargs)

    def post(self, fn: Callable[..., Any], /, *args: Any) -> bool:
        """Run ``fn(*args)`` in the worker with no reply, in order with the tasks submitted
        through the lane (see :meth:`Lane.post`); False if it was not sent: no lane, or the lane
        is not this event loop's."""
        lane = self._lane
        if lane is None or self._broken or self._shutdown_thread:
            return False
        loop = _running_loop()
        if loop is None or not lane.serves(loop):
            return False
        return lane.post(fn, args)

    def detach_lane(self) -> None:
        """Stop the event loop watching the lane's pipes. Runs in: that loop."""
        if self._lane is not None:
            self._lane.detach()

    def close_lane(self) -> None:
        """Once the worker is gone: fail what the lane still had, close its pipes."""
        if self._lane is not None:
            self._lane.close()

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
            thread.lane = self._lane
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
        if self._lane is not None:
            self._lane.fail(_process.BrokenProcessPool(self._broken))

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
        if self._lane is not None:
            self._lane.close()
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

        Returns whether the workers were asked to exit (or there are none). On Python >= 3.12
        the manager thread holds ``_shutdown_lock`` while it terminates a broken pool and joins
        every worker, which never ends while a worker ignores SIGTERM; ``shutdown()`` would wait
        for that lock. Here the lock is taken with a timeout, and a broken pool (the manager
        thread is tearing it down) or the ``deadline`` (``time.monotonic()``) ends the attempt:
        the caller kills the processes instead.
        """
        lock: threading.Lock = self._shutdown_lock
        while not lock.acquire(timeout=0.01):
            if self._broken or time.monotonic() >= deadline:
                return False
        try:
            if self._broken:
                return False
            if self._deferred:
                # No manager thread yet (stopped while the pool was starting): none can ask its
                # workers to exit. An executor with no worker has nobody to ask.
                return not self._processes
            # What shutdown(wait=False, cancel_futures=True) does under the lock; calling it
            # would take the lock again. The references it drops are dropped by a later
            # shutdown() in kill_executors.
            self._cancel_pending_futures = True
            self._shutdown_thread = True
            if self._lane is not None:
                self._lane.cancel_queued()
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
            ex.close_lane()  # every worker is gone: what it still had fails now
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


def _died_in_hand_over(exc: BaseException) -> bool:
    """Whether a failed ``Process.start()`` failed in the hand-over (:data:`_LAUNCH_DEATHS`).

    EBADF too: the fork server died and another thread's start replaced it while this one was
    sending it the old one's "alive" descriptor (CPython reads that descriptor outside the lock
    its replacement takes). Any other OSError is the start's own.
    """
    return isinstance(exc, _LAUNCH_DEATHS) or (
        isinstance(exc, OSError) and exc.errno == errno.EBADF
    )


def _release_launch(exc: BaseException) -> int | None:
    """Close the pipes a ``Process.start()`` that failed half-way holds, now; the dead process's
    exit code (negative: the signal that killed it), or None if it cannot be told.

    The failed start leaves its ``Popen`` object only in the traceback's frames (the process
    never gets it), and with it its pipes to the dead process, until the garbage collector
    breaks the frame cycle; its finalizer closes them. Before that, the fork server's status
    pipe gives the process's pid and, once the fork server reaped it, its exit status. (Spawn
    keeps its own copy of the child's read end during the hand-over, so the write does not fail
    there: the death shows as an ordinary crash once the worker is up.)
    """
    tb = exc.__traceback__
    while tb is not None:
        popen = tb.tb_frame.f_locals.get("self")
        finalizer = getattr(popen, "finalizer", None)
        if isinstance(finalizer, util.Finalize):
            code = _launch_status(getattr(popen, "sentinel", None))
            finalizer()
            return code
        tb = tb.tb_next
    return None


def _launch_status(sentinel: object, timeout: float = 2.0) -> int | None:
    """The exit code a fork server's status pipe ``sentinel`` reports after the pid, waiting up
    to ``timeout`` (``forkserver.read_signed`` would wait for ever); None if it does not come."""
    if not isinstance(sentinel, int):
        return None
    # Here, not at import: only a forkserver launch gets here (the module is POSIX-only).
    from multiprocessing.forkserver import SIGNED_STRUCT as signed

    data = b""
    deadline = time.monotonic() + timeout
    while len(data) < 2 * signed.size:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not ready_of([sentinel], remaining):
            return None
        try:
            chunk = os.read(sentinel, 2 * signed.size - len(data))
        except OSError:
            return None
        if not chunk:  # the fork server went away
            return None
        data += chunk
    code: int = signed.unpack_from(data, signed.size)[0]
    return code


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
        if isinstance(q, _private._ThreadWakeup):
            # Its own close(): it marks the pipe closed, so a later wakeup() (concurrent.futures'
            # exit hook) skips it instead of failing on a closed connection.
            with contextlib.suppress(Exception):
                q.close()
            continue
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
    before = getattr(_forking_now, "executor", None)
    _forking_now.executor = executor
    try:
        yield
    finally:
        _forking_now.executor = before


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


#: What each pipe end :func:`_close_foreign_result_pipes` may close was when it was made (the
#: device and inode its number then referred to): see :func:`_close_in_child`.
_identities: weakref.WeakKeyDictionary[Connection, tuple[int, int]] = weakref.WeakKeyDictionary()


def _remember(*conns: Connection) -> None:
    """Record what these freshly made pipe ends refer to. Runs in: the thread that made them."""
    for conn in conns:
        with contextlib.suppress(OSError):
            st = os.fstat(conn.fileno())
            _identities[conn] = (st.st_dev, st.st_ino)


def _close_in_child(conn: Connection | None) -> None:
    """In a forked child: close ``conn``'s descriptor if it is still the pipe end it was made as.

    Another thread of the parent may have been inside ``conn.close()`` at the fork: past its
    ``os.close()``, not yet clearing the number (the number is cleared only once the thread gets
    the GIL back, which on a loaded machine can take several switch intervals). That number may
    already be reused by the thread that forked, e.g. for the pipes multiprocessing opens for the
    new process itself: closing it here made the new worker exit with status 1, silently, before
    its initializer ran (multiprocessing's own close of that pipe failed with EBADF). A number that
    no longer refers to the same pipe is only forgotten, never closed, here or by a later close.
    """
    if conn is None:
        return
    fd = getattr(conn, "_handle", None)
    if fd is None:  # closed already
        return
    ident = _identities.get(conn)
    try:
        st = os.fstat(fd)
        same = ident is None or (st.st_dev, st.st_ino) == ident
    except OSError:
        same = False
    if same:
        with contextlib.suppress(OSError):
            conn.close()
    else:
        conn._handle = None  # type: ignore[attr-defined]


def _close_foreign_result_pipes() -> None:
    """In a forked child: close the write end of every other executor's result pipe.

    A worker killed half-way through writing a large result leaves its executor's manager thread
    reading the rest; only EOF, once every holder of the write end has closed it, frees it. A
    process forked later (a worker of another pool, under the fork start method) inherited that
    write end and kept the thread waiting for ever. Runs right after a fork, in the child, with no
    other thread: no lock is taken. Each end is checked first (see :func:`_close_in_child`).
    """
    mine = getattr(_forking_now, "executor", None)
    for ex in list(_alive):
        lane = getattr(ex, "_lane", None)
        if lane is not None:
            # The main process's ends of every lane, and another worker's ends too: a lane's
            # pipes are the loop's and its own worker's alone.
            ends = [lane.call_w, lane.result_r]
            if ex is not mine:
                ends += [lane.call_r, lane.result_w]
            for conn in ends:
                _close_in_child(conn)
        if ex is mine:
            continue  # this worker's own results go there
        queue = getattr(ex, "_result_queue", None)
        _close_in_child(getattr(queue, "_writer", None))


os.register_at_fork(after_in_child=_close_foreign_result_pipes)
