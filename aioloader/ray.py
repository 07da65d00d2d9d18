"""Workers as Ray actors: ``AsyncDataLoader(..., num_workers=N, executor=RayWorkers(...))``.

Needs ``pip install 'aioloader[ray]'`` and a connected Ray (``ray.init()`` for a local cluster,
``ray.init(address=...)`` for an existing one, called by the program before the first epoch). The
loader never starts or shuts down Ray; it starts ``num_workers`` actors per worker set and kills
them when the set is released (epoch end, or ``aclose()`` with persistent workers).

What crosses the cluster, and how:

* the dataset, ``collate_fn`` and ``worker_init_fn`` are put into Ray's object store once
  (``ray.put``) per worker set; every actor receives the same reference and builds its worker
  state from it (``get_worker_info()`` works inside the actor: its id, ``base_seed + id``);
* a task is one actor method call carrying ``(send_idx, indices, epoch)``; its result is an
  ``ObjectRef`` whose completion resolves the epoch's future on a Ray thread, so the event loop
  never blocks in ``ray.get``;
* a batch is pickled in the actor as a process worker pickles it (so tuple and list subclasses,
  named tuples and dict subclasses keep their type), except that its tensors cross as numpy
  views (pickle protocol 5 out-of-band buffers): the actor
  writes each once into the object store, and this process copies it once out of the store (Ray
  hands out read-only views, and torch has no read-only tensors): two copies, against three when
  torch's own pickling of a tensor goes through Ray. The copy out runs on Ray's thread, not the
  loop, and the batch neither pins object-store memory nor differs from a process worker's.

Crashes take the path of a dead worker process. An actor that dies (``ray.kill``, its node lost,
an out-of-memory kill) fails its calls with ``RayActorError``; the backend turns that into the
protocol's ``BrokenProcessPool``, makes its sentinel readable and names the actor, its pid and
the batch it held in ``crash_report``; the recovery replaces the whole set of actors and
resubmits the batches in flight, exactly once and in order, as for processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import copyreg
import io
import os
import pickle
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

try:
    import ray
    import ray.exceptions
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "aioloader.ray needs Ray: pip install 'aioloader[ray]' (or pip install ray)"
    ) from exc

import torch

from . import _worker
from ._backend import Backend, Direct
from ._executor import CrashReport
from ._threads import run_off_loop

__all__ = ("RayWorkers",)

#: How long ``shutdown`` waits for Ray to report killed actors dead.
KILL_WAIT_S = 30.0


@dataclass(frozen=True)
class RayWorkers:
    """Run the loader's ``num_workers`` workers as Ray actors, one actor per worker.

    Args:
        num_cpus: CPUs Ray reserves per actor (fractions allowed; torch's intra-op threads in
            the actor are set to ``max(1, int(num_cpus))``).
        num_gpus: GPUs per actor (loading rarely needs one).
        memory: Bytes of memory Ray reserves per actor, or None.
        resources: Custom resources per actor, e.g. ``{"preprocess": 1}`` to place the actors on
            nodes that advertise that resource.
        runtime_env: Ray runtime environment of the actors (packages, env vars).
        tasks_per_actor: With ``in_order=False`` the batches wait in one queue in this process
            and each actor is given at most this many at a time (2 hides the round trip).
        start_timeout_s: Seconds to wait for all actors to be placed and ready (a cluster
            without the requested resources would otherwise wait forever).
        options: Further ``ActorClass.options(...)`` keywords (``scheduling_strategy``, ...).
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int | None = None
    resources: dict[str, float] | None = None
    runtime_env: dict[str, Any] | None = None
    tasks_per_actor: int = 2
    start_timeout_s: float = 300.0
    options: dict[str, Any] = field(default_factory=dict)

    #: How the loader names this executor in errors.
    name = "ray"

    def __post_init__(self) -> None:
        for name in ("num_cpus", "num_gpus"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"RayWorkers({name}=...) must be a number >= 0, got {value!r}")
        tpa = self.tasks_per_actor
        if not isinstance(tpa, int) or isinstance(tpa, bool) or tpa < 1:
            raise ValueError(f"RayWorkers(tasks_per_actor=...) must be an int >= 1, got {tpa!r}")
        if not self.start_timeout_s > 0:
            raise ValueError(
                f"RayWorkers(start_timeout_s=...) must be > 0, got {self.start_timeout_s!r}"
            )

    def actor_options(self) -> dict[str, Any]:
        """The keywords passed to Ray's ``.options()`` for every actor."""
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory is not None:
            opts["memory"] = self.memory
        if self.resources:
            opts["resources"] = dict(self.resources)
        if self.runtime_env is not None:
            opts["runtime_env"] = self.runtime_env
        opts.update(self.options)
        # Ray restarting an actor by itself would hide the death from the recovery, which must
        # resubmit the batches the actor held.
        opts["max_restarts"] = 0
        opts["max_task_retries"] = 0
        return opts

    def validate(self, *, num_workers: int, multiprocessing_context: Any) -> None:
        """Reject loader arguments that make no sense with Ray actors."""
        if num_workers < 1:
            raise ValueError(
                "executor=RayWorkers(...) needs num_workers >= 1 (one Ray actor per worker); "
                "num_workers=0 loads in this process"
            )
        if multiprocessing_context is not None:
            raise ValueError(
                "multiprocessing_context applies to worker processes started by this process; "
                "with executor=RayWorkers(...) Ray starts the actors: drop multiprocessing_context"
            )

    async def start(
        self, spec: _worker.WorkerSpec, objects: tuple[Any, Any, Any], pinned: bool
    ) -> Backend:
        """Put ``objects`` into the object store and start one actor per worker."""
        if not ray.is_initialized():
            raise RuntimeError(
                "executor=RayWorkers(...) needs a connected Ray: call ray.init() (a local "
                "cluster) or ray.init(address=...) before iterating the loader; the loader never "
                "starts or shuts down Ray itself"
            )
        # Pickling a large dataset takes a while: not on the loop.
        ref = await run_off_loop(lambda: ray.put(objects), name="ray-put")
        return await RayPool.start(self, spec, ref, pinned)


def _to_views(batch: Any) -> Any:
    """Runs in: an actor. The batch pickled as a process worker pickles it, except that plain
    tensors become numpy arrays beside the bytes, which Ray serialises out of band (no copy).

    Pickling the whole batch here (not rebuilding containers item by item) keeps every type a
    process worker keeps: tuple and list subclasses, named tuples, dict subclasses, objects
    holding tensors. A batch plain pickle cannot carry (a lambda inside, say) is handed to Ray
    as it is: Ray's cloudpickle carries it, its tensors by torch's own pickling.
    """
    arrays: list[Any] = []

    def reduce(t: torch.Tensor) -> tuple[Any, ...]:
        if (
            t.device.type == "cpu"
            and t.layout is torch.strided
            and not t.is_nested
            and not t.requires_grad
            and t.dtype in _NUMPY_DTYPES
            and t.is_contiguous()
            and not t.is_conj()
            and not t.is_neg()
        ):
            arrays.append(t.numpy())
            return _tensor_from_array, (len(arrays) - 1,)
        reduced: tuple[Any, ...] = t.__reduce_ex__(_PICKLE_PROTOCOL)  # type: ignore[no-untyped-call]
        return reduced

    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=_PICKLE_PROTOCOL)
    table = copyreg.dispatch_table.copy()
    table[torch.Tensor] = reduce  # exact type: subclasses keep their own reduction, as in torch
    pickler.dispatch_table = table
    try:
        pickler.dump(batch)
    except (pickle.PicklingError, TypeError, AttributeError):
        return batch
    return _Encoded(buf.getvalue(), arrays)


_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL

_NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)


class _Encoded:
    """A batch from an actor: its pickle, and its tensors as numpy arrays (Ray stores their
    buffers out of band)."""

    __slots__ = ("arrays", "data")

    def __init__(self, data: bytes, arrays: list[Any]) -> None:
        self.data = data
        self.arrays = arrays


class _Decoding(threading.local):
    arrays: list[Any] | None = None


_decoding = _Decoding()


def _tensor_from_array(i: int) -> torch.Tensor:
    arrays = _decoding.arrays
    if arrays is None:
        raise RuntimeError("aioloader bug: a Ray batch's tensor unpickled outside _from_views")
    # One copy out of the object store: Ray's view is read-only and would pin the store.
    return torch.from_numpy(arrays[i].copy())


def _from_views(batch: Any) -> Any:
    """Runs in: a Ray thread of the loader's process. Rebuilds the batch ``_to_views`` sent."""
    if not isinstance(batch, _Encoded):
        return batch
    _decoding.arrays = batch.arrays
    try:
        return pickle.loads(batch.data)
    finally:
        _decoding.arrays = None


class _Actor:
    """One worker. Runs in: a Ray actor process (anywhere in the cluster)."""

    def __init__(
        self, spec: _worker.WorkerSpec, objects: tuple[Any, Any, Any], worker_id: int, threads: int
    ) -> None:
        torch.set_num_threads(threads)
        _worker.setup(spec, worker_id, lambda: objects, shm_collate=False)

    def ready(self) -> tuple[int, str, str | None]:
        return os.getpid(), socket.gethostname(), _start_time(os.getpid())

    def fetch(self, send_idx: int, indices: Any, epoch: int) -> _worker.Result:
        return _worker.load(send_idx, indices, epoch, _to_views)


_actor_cls: Any = None
_actor_lock = threading.Lock()


def _actor_class() -> Any:
    global _actor_cls
    with _actor_lock:
        if _actor_cls is None:
            _actor_cls = ray.remote(_Actor)
        return _actor_cls


class _Task:
    __slots__ = ("epoch", "future", "indices", "resolved", "send_idx")

    def __init__(self, send_idx: int, indices: Any, epoch: int, future: Future[Any]) -> None:
        self.send_idx = send_idx
        self.indices = indices
        self.epoch = epoch
        self.future = future
        #: Ray has told its outcome (set under the pool's lock).
        self.resolved = False


class RayCrashReport(CrashReport):
    """A dead actor, named with Ray's reason for its death."""

    def __init__(self, *args: Any, cause: str = "", host: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cause = cause
        self.host = host

    def describe(self) -> str:
        who = (
            "a Ray actor worker" if self.worker_id is None else f"Ray actor worker {self.worker_id}"
        )
        if self.pid is not None:
            who += f" (pid {self.pid}" + (f" on {self.host})" if self.host else ")")
        first = self.cause.strip().splitlines()[0] if self.cause.strip() else ""
        return f"{who} died" + (f": {first}" if first else "")


class RayPool:
    """``num_workers`` Ray actors; implements :class:`~aioloader._backend.Backend`."""

    def __init__(
        self, config: RayWorkers, spec: _worker.WorkerSpec, objects_ref: Any, pinned: bool
    ) -> None:
        self.config = config
        self.spec = spec
        self.num_workers = spec.num_workers
        self._objects_ref = objects_ref
        self._pinned = pinned
        self._actors: list[Any] = []
        self._pids: list[int | None] = [None] * self.num_workers
        self._hosts: list[str] = [""] * self.num_workers
        # Each actor process's start time (Linux): tells it from a later process given its pid.
        self._started: list[str | None] = [None] * self.num_workers
        # Reentrant: a call's completion callback can run at once, inside _call, on this thread.
        self._lock = threading.RLock()
        # Per actor, the tasks given to it and not finished, in submission order: a Ray actor
        # runs its calls in that order, so the first one is the batch it is loading.
        self._running: list[deque[_Task]] = [deque() for _ in range(self.num_workers)]
        self._queue: deque[_Task] = deque()  # in_order=False: not yet given to an actor
        self._dead: list[tuple[int, int | None, int | None, str]] = []
        self._closing = False
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)

    @classmethod
    async def start(
        cls, config: RayWorkers, spec: _worker.WorkerSpec, objects_ref: Any, pinned: bool
    ) -> RayPool:
        """Start every actor and wait until each has built its worker state."""
        pool = cls(config, spec, objects_ref, pinned)
        try:
            await pool._start()
        except BaseException:
            pool.kill_sync()
            raise
        return pool

    async def _start(self) -> None:
        actor_cls = _actor_class().options(**self.config.actor_options())
        threads = max(1, int(self.config.num_cpus))
        self._actors = [
            actor_cls.remote(self.spec, self._objects_ref, wid, threads)
            for wid in range(self.num_workers)
        ]
        readies = [asyncio.wrap_future(a.ready.remote().future()) for a in self._actors]
        try:
            async with asyncio.timeout(self.config.start_timeout_s):
                got = await asyncio.gather(*readies)
        except TimeoutError:
            raise RuntimeError(
                f"{self.num_workers} Ray actor(s) with {self.config.actor_options()} were not all "
                f"ready after {self.config.start_timeout_s:g}s: the cluster may lack the "
                "requested resources (see ray.cluster_resources())"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(f"a Ray actor of the loader could not start: {exc}") from exc
        for wid, (pid, host, started) in enumerate(got):
            self._pids[wid] = pid
            self._hosts[wid] = host
            self._started[wid] = started

    # ------------------------------------------------------------------------------ tasks

    def submit(self, send_idx: int, indices: Any, epoch: int, worker_id: int | None) -> Future[Any]:
        """Queue one batch: on actor ``worker_id`` (pinned), else on the next actor free."""
        with self._lock:
            if self._dead:
                raise BrokenProcessPool("a Ray actor of this worker set died")
            if self._closing:
                raise RuntimeError("the Ray worker set is shut down")
            task = _Task(send_idx, indices, epoch, Future())
            if self._pinned and worker_id is not None:
                self._call(worker_id, task)
            else:
                self._queue.append(task)
                self._dispatch()
        return task.future

    def _dispatch(self) -> None:
        """Give queued tasks to the actors with room (holding ``_lock``)."""
        limit = self.config.tasks_per_actor
        while self._queue:
            wid = min(range(self.num_workers), key=lambda w: len(self._running[w]))
            if len(self._running[wid]) >= limit:
                return
            task = self._queue.popleft()
            if task.future.cancelled():
                continue
            self._call(wid, task)

    def _call(self, wid: int, task: _Task) -> None:
        self._running[wid].append(task)
        ref = self._actors[wid].fetch.remote(task.send_idx, task.indices, task.epoch)
        ref.future().add_done_callback(lambda f: self._finished(wid, task, f))

    def _finished(self, wid: int, task: _Task, inner: Future[Any]) -> None:
        """Runs in: a Ray thread. Moves the outcome to the epoch's future."""
        exc = inner.exception()
        outcome: Any = None
        with self._lock:
            task.resolved = True
            if isinstance(exc, ray.exceptions.RayActorError):
                self._actor_died(wid, exc)
                outcome = BrokenProcessPool(f"Ray actor worker {wid} died")
            else:
                with contextlib.suppress(ValueError):
                    self._running[wid].remove(task)
                if not self._closing:
                    self._dispatch()
        if outcome is None and exc is None:
            try:
                res: _worker.Result = inner.result()
                if not isinstance(res.data, _worker.RemoteError | _worker.Exhausted):
                    res = res._replace(data=Direct(_from_views(res.data)))
                outcome = res
            except BaseException as err:  # a batch that cannot be rebuilt is that batch's error
                outcome = err
        elif outcome is None:
            outcome = exc
        with contextlib.suppress(InvalidStateError):  # cancelled: the epoch moved on
            if isinstance(outcome, BaseException):
                task.future.set_exception(outcome)
            else:
                task.future.set_result(outcome)

    def _actor_died(self, wid: int, exc: BaseException) -> None:
        """Record the first death of actor ``wid`` (holding ``_lock``) and wake the sentinel."""
        if self._closing or any(d[0] == wid for d in self._dead):
            return
        head = self._running[wid][0] if self._running[wid] else None
        self._dead.append(
            (wid, head.epoch if head else None, head.send_idx if head else None, str(exc))
        )
        with contextlib.suppress(OSError):
            os.write(self._w, b"x")

    # ------------------------------------------------------------------------------ crashes

    def sentinels(self) -> list[int]:
        """One fd, readable once an actor of this set has died."""
        return [] if self._r < 0 else [self._r]

    def crash_report(self, settle_s: float = 1.0) -> CrashReport:
        deadline = time.monotonic() + settle_s
        while True:
            with self._lock:
                dead = list(self._dead)
                # Ray reports the outcomes of one actor's calls on its own threads, in no fixed
                # order: the call that failed may be told before an earlier one that succeeded.
                # Once every call of the dead actor is told, the first one still listed (the
                # successes are removed) is the one it was running.
                running = self._running[dead[0][0]] if dead else deque()
                settled = all(t.resolved for t in running)
                head = running[0] if running else None
            if (dead and settled) or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        if not dead:
            return CrashReport(None, None, None, None, None)
        wid, epoch, send_idx, cause = dead[0]
        if settled:
            epoch, send_idx = (head.epoch, head.send_idx) if head else (None, None)
        return RayCrashReport(
            wid, self._pids[wid], None, send_idx, epoch, cause=cause, host=self._hosts[wid]
        )

    async def replace(self) -> Backend:
        """Kill these actors and start a new set from the same object-store reference."""
        await self.shutdown(graceful=False)
        return await RayPool.start(self.config, self.spec, self._objects_ref, self._pinned)

    # ------------------------------------------------------------------------------ shutdown

    def _kill_all(self) -> list[Any]:
        with self._lock:
            self._closing = True
            tasks = list(self._queue)
            self._queue.clear()
            actors, self._actors = self._actors, []
        for task in tasks:
            task.future.cancel()
        for actor in actors:
            with contextlib.suppress(Exception):  # already dead, or Ray shut down
                ray.kill(actor, no_restart=True)
        return actors

    def _close_pipe(self) -> None:
        with self._lock:
            fds, self._r, self._w = (self._r, self._w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    async def shutdown(self, *, graceful: bool) -> None:
        """Kill every actor and return once Ray reports each dead. Safe to call twice.

        ``graceful`` changes nothing: an actor holds no state worth an orderly exit.
        """
        actors = self._kill_all()
        try:
            deadline = time.monotonic() + KILL_WAIT_S
            for actor in actors:
                await _wait_dead(actor, deadline)
            # Ray reports an actor dead before its process has exited (up to ~2 s later here):
            # on this node, wait for the processes themselves.
            here = socket.gethostname()
            for pid, host, started in zip(self._pids, self._hosts, self._started, strict=True):
                if pid is not None and started is not None and host == here:
                    await _wait_exited(pid, started, deadline)
        finally:
            self._close_pipe()

    def kill_at_exit(self) -> None:
        # Ray calls at finalization are not safe; the actors share the fate of this driver (Ray
        # kills a non-detached actor when its owner exits).
        return

    def kill_sync(self) -> None:
        """Kill every actor now (does not wait for Ray to confirm); safe from any thread."""
        self._kill_all()
        self._close_pipe()


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``), or None: gone, a
    zombie, or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the fields after it follow
    # the last ")". Field 3 is the state, field 22 the start time.
    rest = stat[stat.rfind(")") + 2 :].split()
    if len(rest) < 20 or rest[0] in ("Z", "X"):
        return None
    return rest[19]


async def _wait_exited(pid: int, started: str, deadline: float) -> None:
    """Return once process ``pid`` (started at ``started``) has exited, or the deadline passed.

    Waits on a pidfd (Linux 5.3+), which turns readable when the process ends; elsewhere it
    returns at once.
    """
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # gone already, or no pidfd here
        return
    loop = asyncio.get_running_loop()
    try:
        # Checked after opening: the pidfd holds this very process, not a later one with its pid.
        if _start_time(pid) != started:
            return
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(fd, readable)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                await exited
        except TimeoutError:
            pass
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)


async def _wait_dead(actor: Any, deadline: float) -> None:
    """Return once a call to ``actor`` fails because it is dead (or the deadline passed)."""
    while time.monotonic() < deadline:
        try:
            await asyncio.wrap_future(actor.ready.remote().future())
        except ray.exceptions.RayActorError:
            return
        except Exception:  # Ray itself is shut down or unreachable: nothing left to wait for
            return
        await asyncio.sleep(0.01)  # the kill is still on its way: ask again
