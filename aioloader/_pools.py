"""Worker pools: how one starts from a plan, and the one pool a loader keeps between epochs.

Runs in: the event loop (pickling the dataset for a process pool runs on a helper thread).

:func:`start_pool` starts ``plan.num_workers`` workers of the plan's executor. With
``persistent_workers=True`` a :class:`PersistentPool` owns the pool that serves epoch after epoch:
it alone decides which pool that is. It starts one when an epoch needs it, keeps it when an epoch
ends healthy (the epoch judges that), retires it otherwise, follows crash recovery's replacement,
and shuts it down with the loader. It records the plan fields the workers baked in when they
started; an epoch whose plan differs in any of them gets new workers, so a setting changed
between epochs (``collate_fn``, ``worker_init_fn``, ``multiprocessing_context``, ...) takes
effect as on workers started afresh.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os

from . import _payload, _worker
from ._backend import Backend, ThreadBackend
from ._executor import WorkerPool
from ._records import Plan
from ._remote import InWorkers
from ._threadworkers import ThreadWorkers

__all__ = ("PersistentPool", "make_spec", "start_pool", "thread_backend")

_logger = logging.getLogger(__name__)


def thread_backend(plan: Plan) -> Backend:
    """``num_workers=0``: one loading thread of this process, owned by its epoch."""
    return ThreadBackend(
        dataset=plan.worker_dataset,
        is_iterable=plan.is_iterable,
        auto_collation=plan.batch_sampler_given,
        collate_fn=plan.collate_fn,
        drop_last=plan.drop_last,
    )


def make_spec(plan: Plan, base_seed: int, *, ship: bool = True) -> _worker.WorkerSpec:
    """Runs in: a helper thread (pickling a large dataset takes a while).

    ``ship=False``: the spec carries neither the objects nor a payload file (an executor
    that moves them itself, such as Ray's object store).
    """
    objects = (plan.worker_dataset, plan.collate_fn, plan.worker_init_fn)
    payload = None
    if not ship:
        objects_or_none = None
    elif plan.mp_context.get_start_method() != "fork":
        try:
            payload = _payload.dump_payload(objects)
            objects_or_none = None
        except RuntimeError as exc:
            if "through inheritance" not in str(exc):
                raise
            # multiprocessing's Value, Lock, Queue... (a counter shared by the workers) can
            # be pickled only while a process is being started: each worker then gets them
            # in its start arguments, pickled once per worker, as torch's workers do.
            objects_or_none = objects
    else:
        objects_or_none = objects
    return _worker.WorkerSpec(
        num_workers=plan.num_workers,
        base_seed=base_seed,
        is_iterable=plan.is_iterable,
        auto_collation=plan.batch_sampler_given,
        drop_last=plan.drop_last,
        main_pid=os.getpid(),
        # Adaptive by default: workers start at 0 and the monitor renices them (_priority).
        nice=plan.worker_nice if plan.worker_nice is not None else 0,
        payload_file=payload,
        objects=objects_or_none,
        fixed_worker_id=None,
        rank=plan.rank,
        world_size=plan.world_size,
        lane_depth=plan.lane_depth,
    )


async def start_pool(plan: Plan, base_seed: int) -> Backend:
    """Start a set of ``plan.num_workers`` workers of the plan's executor."""
    executor = plan.executor
    if executor == "process":
        return await WorkerPool.start(
            functools.partial(make_spec, plan, base_seed), plan.mp_context, plan.pinned_workers
        )
    if executor == "thread":
        return ThreadWorkers(
            dataset=plan.worker_dataset,
            rank=plan.rank,
            world_size=plan.world_size,
            num_workers=plan.num_workers,
            base_seed=base_seed,
            is_iterable=plan.is_iterable,
            auto_collation=plan.batch_sampler_given,
            collate_fn=plan.collate_fn,
            drop_last=plan.drop_last,
            worker_init_fn=plan.worker_init_fn,
            pinned=plan.pinned_workers,
        )
    assert not isinstance(executor, str)
    spec = make_spec(plan, base_seed, ship=False)
    objects = (plan.worker_dataset, plan.collate_fn, plan.worker_init_fn)
    return await executor.start(spec, objects, plan.pinned_workers)


def baked_in(plan: Plan, base_seed: int) -> dict[str, object]:
    """What workers started for ``plan`` hold for their whole life, by name.

    Everything :func:`start_pool` and :func:`make_spec` read from the plan is here, and the
    plan fields whose change must reach the workers even where the pool would look the same
    (``in_order`` and ``seeding`` decide ``pinned_workers``; both are kept as set).
    """
    fields: dict[str, object] = {
        "executor": plan.executor,
        "num_workers": plan.num_workers,
        "start_method": plan.mp_context.get_start_method(),
        "pinned_workers": plan.pinned_workers,
        "in_order": plan.in_order,
        "seeding": plan.seeding,
        "is_iterable": plan.is_iterable,
        "batch_sampler_given": plan.batch_sampler_given,
        "drop_last": plan.drop_last,
        "collate_fn": plan.collate_fn,
        "worker_init_fn": plan.worker_init_fn,
        "worker_nice": plan.worker_nice,
        "rank": plan.rank,
        "world_size": plan.world_size,
        "lane_depth": plan.lane_depth,
        "base_seed": base_seed,
    }
    held = plan.worker_dataset
    # An async source's per-sample collator and fetch_in="workers"' wrapper are made anew for
    # every plan: what the workers got is their contents (the transform, the concurrency...).
    if isinstance(held, _worker.SampleCollator):
        fields["transform"] = held.transform
    elif isinstance(held, InWorkers):
        for f in dataclasses.fields(held):
            fields[f.name] = getattr(held, f.name)
    else:
        fields["dataset"] = held
    return fields


_PLAIN = (int, float, str, bool, type(None))


def _same(a: object, b: object) -> bool:
    """Plain values compare by value; objects (a dataset, a function) by identity, so a
    dataset's own ``__eq__`` is never called."""
    if isinstance(a, _PLAIN) and isinstance(b, _PLAIN):
        return type(a) is type(b) and a == b
    return a is b


def differences(built: dict[str, object], wanted: dict[str, object]) -> list[str]:
    """The names of the fields whose value differs (or is present in only one of them)."""
    names = dict.fromkeys([*built, *wanted])
    return [n for n in names if n not in built or n not in wanted or not _same(built[n], wanted[n])]


class PersistentPool:
    """The loader's persistent workers: at most one pool, and the plan it was started from.

    Guarantees: an epoch acquires a pool whose baked-in fields (:func:`baked_in`) are its plan's;
    a pool an epoch retired (or a state load made stale) never serves another epoch; at most
    one pool is started at a time per event loop.
    """

    def __init__(self) -> None:
        self._pool: Backend | None = None
        self._built: dict[str, object] = {}
        # An abandoned epoch left tasks running on the pool: close it without waiting for them.
        self._busy = False
        # load_state_dict() was called: the kept workers' replicas and RNGs are not the state's.
        self._stale = False
        # A lock belongs to one event loop: a loader used by consecutive asyncio.run() calls
        # gets a fresh one on each loop.
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None

    @property
    def pool(self) -> Backend | None:
        """The pool kept for the next epoch, if any."""
        return self._pool

    def serves(self, plan: Plan, base_seed: int | None) -> bool:
        """Whether the kept pool would serve an epoch of ``plan`` as it is (no new workers)."""
        if self._pool is None or self._stale or base_seed is None:
            return False
        return not differences(self._built, baked_in(plan, base_seed))

    async def acquire(self, plan: Plan, base_seed: int) -> Backend:
        """The pool for an epoch of ``plan``: the kept one if it serves it, else a new one
        (the kept one is shut down first)."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        async with self._lock:
            old, stale = self._pool, self._stale
            self._stale = False
            wanted = baked_in(plan, base_seed)
            changed = differences(self._built, wanted) if old is not None else []
            if old is not None and (stale or changed):
                # A setting the workers baked in was changed between epochs (torch allows it),
                # or a state was loaded: this epoch starts workers as a new loader would.
                _logger.debug("new persistent workers: %s", "state loaded" if stale else changed)
                busy = self._busy
                self._drop()
                await old.shutdown(graceful=not busy)
            if self._pool is None:
                self._pool = await start_pool(plan, base_seed)
                self._built = wanted
                self._busy = False
            return self._pool

    def keep(self, *, busy: bool) -> None:
        """An epoch ended with the pool healthy: it serves the next epoch.

        ``busy``: an abandoned epoch's batches still run on it (:meth:`close` then kills rather
        than waits for them).
        """
        self._busy = self._busy or busy

    def retire(self, pool: Backend) -> None:
        """An epoch ended with ``pool`` broken: no later epoch gets it (the epoch shuts it down)."""
        if pool is self._pool:
            self._drop()

    def detach(self) -> Backend | None:
        """Take the kept pool away, for the caller to kill (its event loop is going away)."""
        pool = self._pool
        if pool is not None:
            self._drop()
        return pool

    def replaced(self, old: Backend, new: Backend) -> None:
        """Crash recovery replaced ``old`` with ``new``, an identical pool."""
        if self._pool is old:
            self._pool = new

    def invalidate(self) -> None:
        """A state was loaded: the kept workers must not serve the next epoch."""
        self._stale = self._pool is not None

    async def close(self) -> None:
        """Shut the kept pool down (killing it if an abandoned epoch's batches still run)."""
        pool, busy = self._pool, self._busy
        self._pool = None
        if pool is not None:
            await pool.shutdown(graceful=not busy)

    def _drop(self) -> None:
        self._pool = None
        self._built = {}
        self._busy = False
