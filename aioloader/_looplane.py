"""Loop lane: a paced stream's cheap windows, transformed and collated on the event loop itself.

Runs in: the event loop, called by ``_stream`` for an async iterable source.

A window sent to a worker crosses the process boundary twice: the worker wakes to transform and
collate it, the loop wakes to receive the batch. For a source that keeps the loader waiting (a
paced stream) and a ``transform`` that costs microseconds, those hops are most of a batch's
produce-to-delivery latency, while the loop sits idle between samples. The lane spends that idle
time instead: it transforms each sample soon after it arrives, in steps of at most
:data:`STEP_S`, and collates the window on the loop when it closes, with no process hop.

Where a window runs is decided by what it costs, per epoch:

* The first windows go to the workers, which time every task; a window may take the lane only
  once they measured at most :data:`MAX_COLLATE_S` plus :data:`MAX_SAMPLE_S` per sample for a
  window (transform and collate; an upper bound, since a worker that just woke runs slower than
  the loop does warm).
* While the source is paced: the loop spent at least :data:`MIN_IDLE` of the last window's
  filling waiting for samples.
* An unpaced source (the loop never waits for it) is raced between the ways of
  :data:`RACE_WAYS`: every window in the workers, one in three on the lane, or every one on the
  lane. Each way is timed over periods of :data:`RACE_PERIOD` windows (windows per second: in
  steady state what the consumer gets), and the fastest keeps them; a way that puts more on the
  lane only when it was at least :data:`RACE_MARGIN` times faster. The others are timed again
  from time to time (:class:`_Race`), and all of them as soon as the workers' priority changes.
  On a quiet machine one in three wins: the workers run beside the loop, and the loop has time
  between their hand-offs for windows of its own. While a way puts windows on the loop, the
  lane asks the priority policy for the loop's CPU (``_priority``: on a machine no other task
  wants, the workers are lowered, so a worker never shares the loop's core). Where other
  processes want the cores, the process hops cost more than they bring and the lane wins.
* The lane times itself too: once its transform takes more than :data:`MAX_SAMPLE_S` per sample,
  or its collate more than :data:`MAX_COLLATE_S` (the median of its last three windows),
  later windows of the epoch go back to the workers (the one at hand finishes on the loop: a
  transform never runs twice).
* Not with ``transform_in="workers"``: a user who keeps every window in the workers, because a
  crash in a transform run on the loop is the loader's own process's, not a replaceable
  worker's.
* Not with ``seeding="batch"`` (a window's transform runs under its batch's seed, in a worker),
  a ``worker_init_fn`` (it may prepare what the transform reads through ``get_worker_info()``)
  or an executor other than worker processes (threads and Ray actors keep every window).

What a transform sees on the lane: with worker processes, ``get_worker_info()`` is a
``WorkerInfo`` like that of the worker the window was assigned to (``id``, ``num_workers``,
``seed = base_seed + id``, the lane's stand-in dataset), and ``random``, torch's and numpy's
global generators are swapped for the lane's own for that id, for each step: the main program's
random streams are never drawn from. They are seeded from ``base_seed + num_workers + id``, not
from the worker's seed: the worker's own generators already draw that stream, and a sample
transformed on the lane must not repeat a worker's draws. With ``num_workers=0``, as in torch's
main process: ``get_worker_info()`` is None and the global generators are the program's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch.utils.data._utils import worker as torch_worker

from . import _npstate, _priority, _pyrandom, _threadworkers, _worker
from ._backend import Direct
from ._records import Host, Plan
from ._worker import Samples

__all__ = (
    "MAX_COLLATE_S",
    "MAX_SAMPLE_S",
    "MIN_IDLE",
    "STEP_S",
    "LaneSide",
    "LoopLane",
    "average",
)

#: Most time per sample's transform for a window on the loop (a few fit in one step).
MAX_SAMPLE_S = 250e-6
#: Most time for collating one window on the loop.
MAX_COLLATE_S = 0.001
#: Longest the lane transforms before it lets the loop run other callbacks.
STEP_S = 0.0005
#: Share of a window's filling the loop must have spent waiting for the source (it is paced).
MIN_IDLE = 0.25
#: Unpaced source: the ways its windows may go, as the share of them on the lane.
RACE_WAYS = (0.0, 1 / 3, 1.0)
#: ... windows per period of the race between them.
RACE_PERIOD = 32
#: ... not timed: at least this many windows after a change of way (and at least as many as
#: may be in flight: those of the other way still are).
RACE_SETTLE = 8
#: ... after this many periods, the ways not in use are timed again (the machine's load changes);
#: each time they lose again, after twice as many, up to RACE_RECHECK_MAX.
RACE_RECHECK = 8
RACE_RECHECK_MAX = 64
#: ... and a way that puts more on the lane wins only when it measured this much faster than
#: one that puts less: a tie leaves the loop free.
RACE_MARGIN = 1.1

#: Windows of the lane's own whose median cost decides whether it is dear (:class:`_Dearness`).
DEAR_WINDOWS = 3

#: The longest the race waits, without timing, for a favored lowering's verdict.
FAVOR_WAIT_S = 0.5

_NO_INFO = object()


class _Race:
    """An unpaced source's windows: the ways of :data:`RACE_WAYS`, timed in turns.

    A period is :data:`RACE_PERIOD` consecutive windows sent one way; its rate is windows per
    second from its first window's opening to the opening of the window after its last (the
    waits for a permit included, so in steady state the rate at which the consumer receives
    batches). Windows of an unpaced source are full, so windows per second are events per
    second. After a change of way, and after windows sent outside the race (a paced stretch),
    ``settle`` windows go untimed first: the batches still in flight from before (at most
    ``max_in_flight`` of them) would otherwise hold or free the permits the new way's first
    windows wait for.

    The best way is kept; after :data:`RACE_RECHECK` periods the others are timed again, one
    period each, and the best of all is kept. Each time that changes nothing, the next recheck
    comes twice as late (up to :data:`RACE_RECHECK_MAX` periods), so a settled race costs ever
    less. A way timed two periods in a row counts the better of the two: a host that stalls the
    loop for a moment slows a period down, never speeds one up, and the best way's one slow
    period before a recheck must not lose the race.
    """

    def __init__(self, settle: int = RACE_SETTLE) -> None:
        #: The way that won the last comparison (an index into RACE_WAYS).
        self.best = 0
        #: The way of the current period.
        self.way = 0
        #: The last rate measured each way.
        self.rates: dict[int, float] = {}
        self._settle = settle
        self._recheck = RACE_RECHECK
        self._since = 0  # periods since the last comparison
        self._tour: list[int] = []  # ways still to be timed before the next comparison
        self._count = 0
        self._began: float | None = None
        self._settling = 0  # windows left before the period's timing starts
        self._credit = 0.0  # spreads a way's share of lane windows evenly
        self._last: tuple[int, float] | None = None  # the last period's way and rate

    def rerace(self) -> None:
        """The machine changed under the race (the workers' priority): every way is timed
        again, and rechecks start from :data:`RACE_RECHECK` again."""
        self.rates.clear()
        self._tour = []
        self._since = 0
        self._recheck = RACE_RECHECK
        self.restart()

    def restart(self) -> None:
        """Windows went outside the race: drop the period under way, and settle again."""
        self._count = 0
        self._began = None
        self._settling = self._settle
        self._last = None

    def next(self, now: float) -> bool:
        """Whether the next window runs on the lane."""
        if self._count >= RACE_PERIOD and self._began is not None:
            way = self._ended(self._count / max(now - self._began, 1e-9))
            self._count, self._began = 0, None
            if way != self.way:
                self.way, self._settling = way, self._settle
        if self._settling:
            self._settling -= 1
        else:
            if self._began is None:
                self._began = now
            self._count += 1
        self._credit += RACE_WAYS[self.way]
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            return True
        return False

    def _ended(self, rate: float) -> int:
        """Record a period's rate; the way the next period goes."""
        compared = len(self.rates) == len(RACE_WAYS)  # before: the first tour is no recheck
        last, self._last = self._last, (self.way, rate)
        if last is not None and last[0] == self.way:
            # Two periods in a row the same way: the better one. A host that stalls the loop
            # for a moment slows one period down; it never speeds one up.
            rate = max(rate, last[1])
        self.rates[self.way] = rate
        if self.way != self.best:  # on a tour of the others
            if self._tour:
                return self._tour.pop(0)
            best = self._choose()
            if best != self.best:
                self._recheck = RACE_RECHECK
            elif compared:  # a recheck changed nothing
                self._recheck = min(2 * self._recheck, RACE_RECHECK_MAX)
            self.best, self._since = best, 0
            return best
        self._since += 1
        if len(self.rates) < len(RACE_WAYS) or self._since >= self._recheck:
            self._tour = [w for w in range(len(RACE_WAYS)) if w != self.best]
            return self._tour.pop(0)
        return self.best

    def _choose(self) -> int:
        """The fastest way; one that puts more on the lane only if :data:`RACE_MARGIN` faster."""
        best = min(self.rates)
        for way in sorted(self.rates):
            if self.rates[way] > self.rates[best] * RACE_MARGIN:
                best = way
        return best


class LaneSide(Protocol):
    """What the lane uses of its epoch."""

    plan: Plan
    epoch_no: int
    base_seed: int
    #: Worker-measured (seconds, samples) of a stream window, averaged (None until one came).
    window_cost: tuple[float, float] | None

    @property
    def host(self) -> Host: ...


def average(last: float | None, value: float) -> float:
    """A moving average of a cost: the lane's own, and the workers' (``Epoch.window_cost``)."""
    return value if last is None else 0.75 * last + 0.25 * value


class _Dearness:
    """Whether the lane's own windows cost more than a window may on the loop: the median of the
    last :data:`DEAR_WINDOWS` windows' transform per sample over :data:`MAX_SAMPLE_S`, or of
    their collation over :data:`MAX_COLLATE_S`. A transform that grew dearer makes most windows
    dear; one window stalled by the host or a full collection of the garbage collector (several
    milliseconds, in the middle of a collation) is one, and does not close the lane."""

    def __init__(self) -> None:
        self._recent: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=DEAR_WINDOWS
        )

    def add(self, sample_s: float, collate_s: float) -> bool:
        """One window's transform time per sample and collation time; whether the lane is dear."""
        self._recent.append((sample_s, collate_s))
        if len(self._recent) < DEAR_WINDOWS:
            return False
        middle = DEAR_WINDOWS // 2
        samples = sorted(s for s, _ in self._recent)
        collations = sorted(c for _, c in self._recent)
        return samples[middle] > MAX_SAMPLE_S or collations[middle] > MAX_COLLATE_S


class _Generators:
    """A stand-in worker's own ``random``, torch and numpy generator states."""

    def __init__(self, base_seed: int, worker_id: int) -> None:
        seed = base_seed + worker_id  # the caller passes an id past the workers' (see above)
        self.py = _pyrandom.seeded(seed)
        self.torch = torch.Generator().manual_seed(seed).get_state()
        # As a worker seeds numpy's global generator; made on first use, of the kind the
        # program's global generator is then.
        self._np_seed = torch_worker._generate_state(base_seed, worker_id)  # type: ignore[no-untyped-call]
        self.np: Any = None
        # The program's states of the last block, whose buffers the next one fills.
        self._kept: tuple[Any, Any] = (None, None)
        self._open = False

    def _numpy(self, npr: Any) -> Any:
        """The stand-in's numpy state, of the kind the global generator is now; None where
        none can be made (a bit generator of the program's own that takes no seed)."""
        if self.np is None or not _npstate.fits(npr, self.np):
            try:
                self.np = _npstate.seeded(npr, self._np_seed)
            except Exception:
                return None
        return self.np

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Make these the global generators for the block; the program's come back after,
        whatever happens in it (or in the swap itself). ``random``'s and numpy's through
        :mod:`._pyrandom` and :mod:`._npstate`, into buffers kept from the last block: their
        own calls, and fresh buffers, cost most of a cheap step."""
        if self._open:  # a block inside a block: these are the global generators already
            yield
            return
        npr = sys.modules.get("numpy.random")  # aioloader._worker imports it
        # The program's states go into the buffers of the last block.
        py, program_np = self._kept
        program = _pyrandom.get(py), torch.get_rng_state()
        program_np = _npstate.get(npr, program_np) if npr is not None else None
        lane_np = self._numpy(npr) if npr is not None else None
        entered = False
        self._open = True
        try:
            _pyrandom.put(self.py)
            torch.set_rng_state(self.torch)
            if lane_np is not None:
                _npstate.put(npr, lane_np)
            entered = True
            yield
        finally:
            try:
                if entered:
                    self.py, self.torch = _pyrandom.get(self.py), torch.get_rng_state()
                    if lane_np is not None:
                        self.np = _npstate.get(npr, self.np)
            finally:
                try:
                    _give_back(npr, program[0], program[1], program_np)
                finally:
                    self._kept = program[0], program_np
                    self._open = False


def _give_back(npr: Any, py: Any, pt: torch.Tensor, np_state: Any) -> None:
    """Put the program's generator states back, each on its own: one that fails (its error is
    raised after) leaves the others restored."""
    error: BaseException | None = None
    try:
        _pyrandom.put(py)
    except BaseException as exc:
        error = exc
    try:
        torch.set_rng_state(pt)
    except BaseException as exc:
        error = error or exc
    try:
        # (Where it no longer fits, the block replaced the program's bit generator itself: that
        # one stays.)
        if np_state is not None and _npstate.fits(npr, np_state):
            _npstate.put(npr, np_state)
    except BaseException as exc:
        error = error or exc
    if error is not None:
        raise error


class LoopLane:
    """Transforms and collates windows on the loop; see the module docstring for when."""

    def __init__(self, epoch: LaneSide) -> None:
        plan = epoch.plan
        stream = plan.stream
        assert stream is not None
        self._epoch = epoch
        # A stand-in of the workers' own (it keeps samples transformed ahead, per window).
        self._collator = _worker.SampleCollator(plan.worker_dataset.transform)
        self._collate_fn = plan.collate_fn
        self._auto_collation = stream.batch_size is not None
        self._num_workers = plan.num_workers
        self._generators: dict[int, _Generators] = {}
        self._infos: dict[int, Any] = {}
        # With workers, only when asked for: a crash in the transform then takes the loader's
        # own process, not a worker. Without, everything runs in this process anyway.
        workers_allow = (
            stream.transform_in == "auto"
            and plan.worker_init_fn is None
            and plan.executor == "process"
        )
        self._closed = not ((plan.num_workers == 0 or workers_allow) and plan.seeding == "worker")
        if plan.num_workers > 0 and not self._closed:
            # Only where a window may run here: it changes torch's get_worker_info for the
            # whole process (see _threadworkers.install_thread_info).
            _threadworkers.install_thread_info()
        # This window's transform time so far; a moving average of the lane's own measure.
        self._spent = 0.0
        self._sample_s: float | None = None
        self._dear = _Dearness()
        #: Windows delivered from the lane (stats, tests).
        self.windows = 0
        self._race = _Race(max(RACE_SETTLE, plan.max_in_flight))
        self._priority_changes = _priority.changes
        self._favoring = False
        self._pending_since: float | None = None  # since when a favored lowering is pending

    def usable(self, idle: float) -> bool:
        """Whether the next window runs here: cheap as the workers measured it, and the source
        paced (``idle``: the share of the last window's filling spent waiting for it), or not
        paced and the lane the faster way (:class:`_Race`). Called once per window."""
        cost = self._epoch.window_cost
        if self._closed or cost is None or cost[0] > MAX_COLLATE_S + MAX_SAMPLE_S * cost[1]:
            self._outside_race()
            return False
        if idle >= MIN_IDLE:
            self._outside_race()  # the source's pace, not the pipeline's, sets the rate now
            return True
        if self._priority_changes != _priority.changes:
            # The workers' priority changed (not by this lane): the rates timed before are stale.
            self._priority_changes = _priority.changes
            self._race.rerace()
        here = self._race.next(time.perf_counter())
        # A way that puts windows on the loop makes the loop's CPU the pipeline's bottleneck.
        self._favor(RACE_WAYS[self._race.way] > 0)
        if self._favoring and self._epoch.host.favor_pending():
            # The workers keep their level until the policy knows whether the machine is shared
            # (a tenth of a second at the start): not this way's rate. Timed once it knows, or
            # after FAVOR_WAIT_S whatever it knows (a monitor that stopped sampling).
            now = time.perf_counter()
            if self._pending_since is None:
                self._pending_since = now
            if now - self._pending_since < FAVOR_WAIT_S:
                self._race.restart()
        else:
            self._pending_since = None
        return here

    def _outside_race(self) -> None:
        """The next window is not the race's: its period is dropped, and the loop's CPU is no
        longer asked for on its behalf."""
        self._race.restart()
        self._favor(False)

    def _favor(self, on: bool) -> None:
        if on != self._favoring:
            self._favoring = on
            self._epoch.host.favor_loop(on)

    def close(self) -> None:
        """The epoch's windows are done: the loop's CPU is no longer asked for."""
        with contextlib.suppress(RuntimeError):  # the loader is gone: so is its monitor
            self._favor(False)

    def _per_step(self) -> int:
        """Samples per step, from the lane's own measure, else the most a sample may take."""
        return max(1, int(STEP_S / max(self._sample_s or MAX_SAMPLE_S, 1e-7)))

    def _step(self, key: tuple[int, int], samples: list[Any]) -> None:
        """Transform ``samples`` ahead for window ``key``; the caller stands in for its worker."""
        began = time.perf_counter()
        self._collator.prefeed(key, samples)
        self._spent += time.perf_counter() - began

    async def transform(
        self, send_idx: int, window: Samples, done: int, worker_id: int | None, end: int = -1
    ) -> int:
        """Transform ``window[done:end]`` (window ``send_idx``; all of it by default) ahead of
        its close, in steps of at most about :data:`STEP_S`; returns how many of its samples are
        transformed now. An error is kept, and raised in the window's place by :meth:`finish`."""
        key = (self._epoch.epoch_no, send_idx)
        per_step = self._per_step()
        end = len(window) if end < 0 else end
        while done < end:
            chunk = window[done : min(end, done + per_step)]
            with self._as_worker(worker_id):
                self._step(key, chunk)
            done += len(chunk)
            if done < end:
                await asyncio.sleep(0)  # let the loop run other callbacks between steps
        return done

    async def finish(self, send_idx: int, window: Samples, done: int, worker_id: int | None) -> Any:
        """Transform the rest of ``window`` and collate it: the batch (or its error) as a worker's
        result for ``send_idx``."""
        key = (self._epoch.epoch_no, send_idx)
        per_step = self._per_step()
        if len(window) - done > per_step:  # all but the last step's worth, in steps
            done = await self.transform(send_idx, window, done, worker_id, len(window) - per_step)
        wid = -1 if worker_id is None else worker_id
        data: object
        began = time.perf_counter()
        try:
            # The last step and the collation share one swap of the generators: at the close,
            # every microsecond is the batch's latency.
            with self._as_worker(worker_id):
                if done < len(window):
                    self._step(key, window[done:])
                window.ahead = (key, len(window))
                began = time.perf_counter()
                # The samples transformed ahead are taken from the stand-in (or their error
                # raised).
                with self._collating():
                    batch = self._collator.collate(window, self._collate_fn, self._auto_collation)
            data = Direct(batch)
        except BaseException:  # SystemExit from user code too: it belongs to the batch
            where = (
                f"in the loader's event loop, standing in for DataLoader worker {wid}, while "
                f"loading batch send_idx={send_idx}"
            )
            data = _worker.RemoteError.capture(where)
        collate_s = time.perf_counter() - began
        busy = self._spent + collate_s
        sample_s = self._spent / max(1, len(window))
        self._sample_s = average(self._sample_s, sample_s)  # the step size's measure
        if self._dear.add(sample_s, collate_s):
            self._closed = True  # dearer than the workers measured: later windows go to them
        self._spent = 0.0
        self.windows += 1
        return _worker.Result(send_idx, self._epoch.epoch_no, wid, os.getpid(), data, busy)

    @contextlib.contextmanager
    def _as_worker(self, worker_id: int | None) -> Iterator[None]:
        """Run user code as worker ``worker_id`` would see itself (see the module docstring)."""
        if self._num_workers == 0:
            yield
            return
        wid = 0 if worker_id is None else worker_id
        gens = self._generators.get(wid)
        if gens is None:
            gens = self._generators[wid] = _Generators(
                self._epoch.base_seed, self._num_workers + wid
            )
        local = _threadworkers.thread_local()
        saved = getattr(local, "info", _NO_INFO)
        local.info = self._info(wid)
        try:
            with gens.current():
                yield
        finally:
            if saved is _NO_INFO:
                del local.info
            else:
                local.info = saved

    @contextlib.contextmanager
    def _collating(self) -> Iterator[None]:
        """Inside :meth:`_as_worker`: no worker info for ``collate_fn``. torch's
        ``default_collate`` builds in shared memory whenever it sees worker info, not for a
        batch that never leaves this process."""
        local = _threadworkers.thread_local()
        info = getattr(local, "info", _NO_INFO)
        if info is _NO_INFO:  # num_workers=0: there is none
            yield
            return
        local.info = None
        try:
            yield
        finally:
            local.info = info

    def _info(self, wid: int) -> Any:
        """Worker ``wid``'s ``WorkerInfo``: one per id for the epoch, as a worker keeps one."""
        info = self._infos.get(wid)
        if info is None:
            plan = self._epoch.plan
            info = self._infos[wid] = _worker.make_worker_info(
                id=wid,
                num_workers=self._num_workers,
                seed=self._epoch.base_seed + wid,
                dataset=self._collator,
                rank=plan.rank,
                world_size=plan.world_size,
            )
        return info
