"""Worker priority that follows the loop's lateness (the default ``worker_nice=None``). Runs in:
the loop.

A fixed niceness trades one figure for another: workers at torch's priority (nice 0) keep their
share of a machine shared with other processes, but on a quiet machine they delay the loop's
wake-ups (when every core runs a worker, a woken loop waits for one); workers at nice 5 keep the
loop prompt and lose a third of their throughput beside a busy process. So the loader measures,
and decides:

* **What it measures.** Every :data:`PERIOD_S` a timer on the loop notes how late it fired,
  capped by how long the loop's thread waited for a CPU meanwhile (its run-queue wait, from
  ``/proc/thread-self/schedstat``): lateness of the loop's own making (a long callback) is not
  counted, since lowering the workers would not cure it. Beside it, how many *other* tasks were
  runnable (``/proc/loadavg``'s running count, less this process's threads and the workers
  running then).
* **What it decides** (:class:`NicePolicy`, window by window of :data:`WINDOW` samples): workers
  start at nice 0. A window whose lateness exceeds :data:`BOUND_S` in more than 2% of its
  samples, while no other task competes, lowers them: the contention is the loader's own, and
  lowering its workers cures it (as soon as that many samples are late, where it can be undone).
  Lowered means ``SCHED_IDLE`` where the policy may raise them again (Linux): a worker then runs
  only on a core nothing else wants, so it never delays the loop's thread by a scheduler tick,
  which a niceness only makes less likely; elsewhere nice :data:`LOW_NICE`. A window in which
  other tasks compete (a mean of :data:`SHARED_RUNNABLE` or more) raises them back to nice 0:
  the machine is shared, the workers need their share, and lowering them would not bring the
  lateness within its bound.
* **The guard on idle workers.** ``SCHED_IDLE`` workers give way to every task, this process's
  own threads included (a training step on threads counts as "ours", not as competition, above).
  A window in which the consumer waited for data more than :data:`STARVED` of the time while
  the idle workers waited for a CPU more than :data:`QUEUED` of it (their run-queue wait, from
  ``/proc/<pid>/schedstat``) moves them to nice :data:`LOW_NICE` for the rest of the policy's
  life. A consumer that waits on a slow dataset alone does not: its workers get the cores.
* **The loop lane's request** (:meth:`NicePolicy.favor`). While an unpaced stream's windows are
  partly transformed on the loop itself (``_looplane``), the loop's CPU time is what the consumer
  waits on, and a worker that shares the loop's core slows the whole pipeline. While the lane
  asks, on a machine known not to be shared (the last window, or the current one's first
  samples; never with the machine's load unknown), the workers run lowered, where the policy
  may raise them again; beside other tasks they keep their level. The lateness policy's own
  level (what later pools start at) is not changed by it. Every change the policy makes is
  counted in :data:`changes`, for the lane's race.
* **What it may do.** Lowering a priority is always allowed; raising it back needs
  ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` of 20 or more. Without either, workers go down only
  (after two such windows in a row, not one) and stay there until they are replaced; new workers
  start at nice 0 again.

Not on Linux (no ``/proc``): the timer's lateness alone decides, and the machine never counts as
shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import resource
import threading
import weakref
from collections.abc import Callable

__all__ = (
    "BOUND_S",
    "IDLE",
    "LOW_NICE",
    "PERIOD_S",
    "QUEUED",
    "STARVED",
    "WINDOW",
    "NicePolicy",
    "PriorityMonitor",
)

#: How often the loop's lateness is sampled.
PERIOD_S = 0.01

#: Samples per decision (half a second).
WINDOW = 50

#: The loop's lateness bound: a window with more than 2% of its samples above it is over.
BOUND_S = 0.0015

#: More than this many samples above the bound (of a full window) make a window over.
_OVER_SAMPLES = WINDOW // 50

#: Samples of the machine's other load needed before a window may end early (see observe).
_EARLY_SAMPLES = 10

#: The niceness of lowered workers (the fixed default before this policy).
LOW_NICE = 5

#: Other runnable tasks, on average over a window, from which the machine counts as shared.
SHARED_RUNNABLE = 0.5

#: The level that stands for ``SCHED_IDLE`` (above every niceness: the lowest priority).
IDLE = 20

#: Share of a window the consumer may wait for data while the workers are idle...
STARVED = 0.2

#: ...if the idle workers also waited this share of it for a CPU, they are starved.
QUEUED = 0.5


class NicePolicy:
    """The decision, from samples alone (no clock, no system calls): feed it with
    :meth:`observe`; it answers the workers' new niceness when it changes."""

    def __init__(
        self,
        *,
        can_raise: bool,
        level: int = 0,
        window: int = WINDOW,
        bound_s: float = BOUND_S,
        over_samples: int = _OVER_SAMPLES,
        low: int = LOW_NICE,
        shared: float = SHARED_RUNNABLE,
    ) -> None:
        #: The workers' niceness now.
        self.level = level
        #: Whether a lowered worker may be raised again (see the module docstring).
        self.can_raise = can_raise
        self.window = window
        self.bound_s = bound_s
        self.over_samples = over_samples
        self.low = low
        self.shared = shared
        self._n = 0
        self._late = 0
        self._others = 0.0
        self._others_n = 0
        self._stalled = 0.0
        self._queued = 0.0
        self._strikes = 0  # over windows in a row at level 0 with the machine not shared
        #: The loop lane asks for the loop's CPU (see :meth:`favor`).
        self.favored = False
        self._shared_last: bool | None = None  # the last full window's verdict (None: none yet)
        self._load_unknown = False  # the last sample could not read the machine's load
        self._early_quiet: bool | None = None  # this window's first samples' verdict

    @property
    def effective(self) -> int:
        """The workers' niceness to apply: :attr:`level`, or lowered while :attr:`favored` and
        the machine is known not to be shared (where the lowering can be undone)."""
        if self.favored and self.can_raise and self.level < self.low and self._quiet():
            return self.low
        return self.level

    def _quiet(self) -> bool:
        """No other task competes: the last window said so, or this one's first samples do."""
        if self._shared_last is not None:
            return not self._shared_last
        return self._quiet_so_far()

    def _quiet_so_far(self) -> bool:
        """This window's first :data:`_EARLY_SAMPLES` samples found no other task competing. (The
        verdict of those samples holds until the window's end: a running mean that hovers near
        :data:`SHARED_RUNNABLE` would turn a favored lowering on and off sample by sample.)"""
        return self._early_quiet is True

    @property
    def favor_pending(self) -> bool:
        """A favored lowering waits for the machine's verdict: asked for and allowed, the load
        readable, and no window (nor enough of this one) has said yet whether other tasks
        compete. Until it comes the workers run at :attr:`level`, which the loop lane's race
        must not time as the favored way's rate."""
        return (
            self.favored
            and self.can_raise
            and self.level < self.low
            and not self._load_unknown
            and self._shared_last is None
            and self._early_quiet is None
        )

    def favor(self, on: bool) -> int | None:
        """The loop lane runs an unpaced stream's windows beside the workers (on), or no longer
        (off). While it does, the loop's CPU time is what the consumer waits on, and a worker
        that shares the loop's core slows the whole pipeline: on a machine no other task wants,
        the workers are lowered; beside other tasks they keep their share. Returns the new
        effective level when it changes."""
        before = self.effective
        self.favored = on
        after = self.effective
        return after if after != before else None

    def observe(
        self,
        lateness_s: float,
        others: float | None = None,
        stalled: float = 0.0,
        queued: float = 0.0,
    ) -> int | None:
        """One sample: the loop's lateness, how many other tasks were runnable (None: unknown),
        and the shares of the sample's time the consumer waited for data and the workers waited
        for a CPU. Returns the new :attr:`effective` level when this sample changes it: a window
        ends after ``window`` samples, or earlier to lower the workers (see :meth:`_observe`);
        a favored lowering waits for the machine to be known quiet."""
        before = self.effective
        self._observe(lateness_s, others, stalled, queued)
        after = self.effective
        # (A favored lowering may take effect here too: once the machine is known quiet.)
        return after if after != before else None

    def _observe(
        self, lateness_s: float, others: float | None, stalled: float, queued: float
    ) -> None:
        """:meth:`observe` for :attr:`level`."""
        self._n += 1
        if lateness_s > self.bound_s:
            self._late += 1
        self._load_unknown = others is None
        if others is not None:
            self._others += others
            self._others_n += 1
            if self._others_n == _EARLY_SAMPLES:
                self._early_quiet = self._others / self._others_n < self.shared
        self._stalled += stalled
        self._queued += queued
        if self._n < self.window:
            # A window is over as soon as enough of its samples are late: where the lowering can
            # be undone, it need not wait for the window's end (a short-lived loader's first
            # half second would run at the contended priority). The machine must have looked
            # quiet for a few samples first. The window still runs to its end.
            if (
                self.can_raise
                and self.level < self.low
                and self._late > self.over_samples
                and self._quiet_so_far()
            ):
                self._strikes = 0
                self.level = self.low
            return
        over = self._late > self.over_samples
        shared = self._others_n > 0 and self._others / self._others_n >= self.shared
        # Unknown competition never counts as a quiet machine for a favored lowering.
        self._shared_last = shared if self._others_n > 0 else None
        starved = self._stalled / self._n > STARVED and self._queued / self._n > QUEUED
        self._n = self._late = self._others_n = 0
        self._others = self._stalled = self._queued = 0.0
        self._early_quiet = None
        if self.effective == IDLE and starved:
            # Something of this process keeps the cores busy and the idle workers get none of
            # them: they go back to a niceness, and idle is not tried again (favored or not).
            self.low = min(self.low, LOW_NICE)
            if self.level == IDLE:
                self.level = LOW_NICE
                return
        self._decide(over, shared)

    def _decide(self, over: bool, shared: bool) -> None:
        if self.level < self.low:
            if not over or shared:
                self._strikes = 0
                return
            self._strikes += 1
            # A lowering that cannot be undone waits for a second window to confirm it.
            if self._strikes < (1 if self.can_raise else 2):
                return
            self._strikes = 0
            self.level = self.low
        elif shared and self.can_raise:
            self.level = 0


def _same(value: Callable[[], list[int]]) -> Callable[[], list[int]]:
    return value


def _runnable(fd: int) -> int:
    """1 if the task whose ``/proc/.../stat`` file ``fd`` is is runnable now, else 0."""
    try:
        stat = os.pread(fd, 512, 0)
    except OSError:
        return 0
    state = stat.rfind(b")") + 2
    return 1 if stat[state : state + 1] == b"R" else 0


def _run_queue_ns(fd: int) -> int:
    """Nanoseconds the task whose ``schedstat`` file ``fd`` is has waited for a CPU so far."""
    return int(os.pread(fd, 128, 0).split()[1])


def may_raise_priority() -> bool:
    """Whether this process may lower a niceness it raised (``CAP_SYS_NICE``, or an
    ``RLIMIT_NICE`` soft limit of 20 or more, which allows nice 0)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
        if soft == resource.RLIM_INFINITY or soft >= 20:
            return True
    except (AttributeError, OSError, ValueError):
        pass
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 23 & 1)  # CAP_SYS_NICE
    except (OSError, ValueError, IndexError):
        pass
    return False


#: The niceness decided last in this process, where it can be undone: a new pool starts there
#: (a loader per round of a benchmark, a loader per request) instead of learning it again.
_last_level = 0

#: How many times a monitor of this process changed its workers' level: what was timed before a
#: change (the loop lane's race between ways) no longer holds after it.
changes = 0


def start_level() -> int:
    """The niceness new workers start at under the adaptive policy."""
    return _last_level if may_raise_priority() else 0


class PriorityMonitor:
    """Samples the loop's lateness while an epoch runs and renices the workers as
    :class:`NicePolicy` decides. Runs in: the loop (``watch``/``pause`` too)."""

    def __init__(
        self, active: Callable[[], bool], waited: Callable[[], float] | None = None
    ) -> None:
        """``active()``: whether an epoch runs (sampling stops by itself when none does);
        ``waited()``: seconds the consumer has waited for data so far (the idle guard)."""
        can_raise = may_raise_priority()
        # SCHED_IDLE only where the guard can take it back (see the module docstring).
        low = IDLE if can_raise and hasattr(os, "SCHED_IDLE") else LOW_NICE
        self.policy = NicePolicy(can_raise=can_raise, level=min(start_level(), low), low=low)
        self._active = active
        self._waited = waited
        self._waited_s = 0.0
        # Each pool's pids() (weakly: a pool shut down and dropped leaves by itself); overlapping
        # epochs with pools of their own all get the decided niceness.
        self._pools: list[Callable[[], Callable[[], list[int]] | None]] = []
        self._applied: dict[int, int] = {}  # pid -> niceness set
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._sched_fd = -1
        self._load_fd = -1
        self._stat_fds: dict[int, int] = {}  # worker pid -> its /proc stat file
        self._queue_fds: dict[int, int] = {}  # idle worker pid -> its /proc schedstat file
        self._queued_ns: dict[int, int] = {}  # ... and its run-queue wait at the last sample
        self._last_tick = 0.0
        self._thread_fds: dict[int, int] = {}  # this process's other threads, likewise
        self._loop_tid = 0
        self._wait_ns = 0
        self._favors = 0  # lanes that asked for the loop's CPU (overlapping epochs: several)

    @property
    def running(self) -> bool:
        return self._handle is not None

    def watch(self, pids: Callable[[], list[int]]) -> None:
        """Start sampling (again) on the running loop, for the workers ``pids()`` lists too
        (a bound method of their pool). Raises ``RuntimeError`` with no running loop."""
        loop = asyncio.get_running_loop()
        self._pools = [ref for ref in self._pools if ref() not in (None, pids)]
        ref: Callable[[], Callable[[], list[int]] | None]
        try:
            ref = weakref.WeakMethod(pids)
        except TypeError:  # not a bound method: held as it is
            ref = functools.partial(_same, pids)
        self._pools.append(ref)
        self._apply()
        if self._handle is not None and self._loop is loop:
            return
        self.pause()
        self._loop = loop
        with contextlib.suppress(OSError):
            # Opened here: thread-self is the thread that opens it, the loop's.
            self._sched_fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            self._wait_ns = self._read_wait()
        with contextlib.suppress(OSError):
            self._load_fd = os.open("/proc/loadavg", os.O_RDONLY)
        self._loop_tid = threading.get_native_id()
        self._find_threads()
        self._last_tick = loop.time()
        self._due = self._last_tick + PERIOD_S
        self._waited_s = self._waited() if self._waited is not None else 0.0
        self._handle = loop.call_at(self._due, self._tick)

    def pause(self) -> None:
        """Stop sampling (no epoch runs); the workers keep their niceness. Runs in: the loop, or
        any thread while it does not run."""
        loop = self._loop
        if loop is not None and loop.is_running() and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                with contextlib.suppress(RuntimeError):  # closed meanwhile
                    loop.call_soon_threadsafe(self.pause)
                    return
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        for fd in (
            self._sched_fd,
            self._load_fd,
            *self._stat_fds.values(),
            *self._queue_fds.values(),
            *self._thread_fds.values(),
        ):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._sched_fd = self._load_fd = -1
        self._stat_fds.clear()
        self._queue_fds.clear()
        self._queued_ns.clear()
        self._thread_fds.clear()

    def _tick(self) -> None:
        loop = self._loop
        assert loop is not None
        if not self._active():
            self.pause()
            return
        now = loop.time()
        lateness = max(0.0, now - self._due)
        if self._sched_fd >= 0:
            wait_ns = self._read_wait()
            lateness = min(lateness, (wait_ns - self._wait_ns) / 1e9)
            self._wait_ns = wait_ns
        stalled = queued = 0.0
        elapsed = now - self._last_tick
        self._last_tick = now
        if self._waited is not None:
            waited = self._waited()
            stalled = min(1.0, max(0.0, (waited - self._waited_s) / max(elapsed, PERIOD_S)))
            self._waited_s = waited
        if self.policy.effective == IDLE:
            queued = self._queued(max(elapsed, PERIOD_S))
        else:
            self._queued_ns.clear()  # from the first idle sample again, if they go idle later
        level = self.policy.level
        self._decided(level, self.policy.observe(lateness, self._others(), stalled, queued))
        if self.policy._n == 0:
            self._find_threads()
        self._due = now + PERIOD_S
        self._handle = loop.call_at(self._due, self._tick)

    def _decided(self, level: int, changed: int | None) -> None:
        """After a sample: ``level`` was the policy's level before it, ``changed`` what
        :meth:`NicePolicy.observe` answered. Counts and applies the change."""
        global _last_level, changes
        if self.policy.level != level or changed is not None:
            # A change the policy made (a favored lowering that waited for the machine to be
            # known quiet included; not one favor() made at once): what the lane's race timed
            # before it is stale.
            changes += 1
            if self.policy.level != level and self.policy.can_raise:
                _last_level = self.policy.level
        if changed is not None or self.policy._n == 0:
            # (At a window's end, workers started since get the level too.)
            self._apply()

    def favor_pending(self) -> bool:
        """:attr:`NicePolicy.favor_pending`."""
        return self.policy.favor_pending

    def favor_loop(self, on: bool) -> None:
        """The loop lane runs an unpaced stream's windows beside the workers, or no longer:
        :meth:`NicePolicy.favor`, applied at once."""
        # (At 0 at least: a lane that asked before this monitor existed asked nobody.)
        self._favors = max(0, self._favors + (1 if on else -1))
        if self.policy.favor(self._favors > 0) is not None:
            self._apply()

    def _queued(self, elapsed: float) -> float:
        """The idle workers' mean share of the last ``elapsed`` seconds spent waiting for a CPU
        (0 for a worker seen for the first time)."""
        shares = []
        for pid in self._applied:
            try:
                fd = self._queue_fds.get(pid)
                if fd is None:
                    fd = self._queue_fds[pid] = os.open(f"/proc/{pid}/schedstat", os.O_RDONLY)
                wait_ns = _run_queue_ns(fd)
            except (OSError, ValueError, IndexError):
                continue
            last = self._queued_ns.get(pid)
            self._queued_ns[pid] = wait_ns
            if last is not None:
                shares.append(min(1.0, (wait_ns - last) / 1e9 / elapsed))
        return sum(shares) / len(shares) if shares else 0.0

    def _read_wait(self) -> int:
        try:
            return _run_queue_ns(self._sched_fd)
        except (OSError, ValueError, IndexError):
            return self._wait_ns

    def _others(self) -> float | None:
        """Runnable tasks other than this thread and the workers, now; None if unknown."""
        if self._load_fd < 0:
            return None
        try:
            running = int(os.pread(self._load_fd, 128, 0).split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            return None
        return float(max(0, running - self._ours()))

    def _ours(self) -> int:
        """This process's runnable threads (this one, reading, included) and the workers'."""
        ours = 1  # this thread, reading
        for pid in self._applied:
            fd = self._stat_fds.get(pid)
            try:
                if fd is None:
                    fd = self._stat_fds[pid] = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
            except OSError:
                continue
            ours += _runnable(fd)
        # This process's other threads (a training step on a thread) are not competition either:
        # lowering the workers gives them the cores too.
        for fd in self._thread_fds.values():
            ours += _runnable(fd)
        return ours

    def _find_threads(self) -> None:
        """Open the stat files of this process's threads other than the loop's (again once
        per window: threads come and go)."""
        try:
            tids = {int(t) for t in os.listdir("/proc/self/task")} - {self._loop_tid}
        except (OSError, ValueError):
            return
        for gone in set(self._thread_fds) - tids:
            with contextlib.suppress(OSError):
                os.close(self._thread_fds.pop(gone))
        for tid in tids - set(self._thread_fds):
            with contextlib.suppress(OSError):
                self._thread_fds[tid] = os.open(f"/proc/self/task/{tid}/stat", os.O_RDONLY)

    def _apply(self) -> None:
        """Give every current worker the policy's niceness."""
        global changes
        pids: list[int] = []
        for ref in list(self._pools):
            source = ref()
            if source is None:
                self._pools.remove(ref)
                continue
            with contextlib.suppress(Exception):  # a pool shutting down: nothing to renice
                pids += source()
        # Relative to this process's own niceness, as worker_nice=N is.
        base = os.getpriority(os.PRIO_PROCESS, 0)
        level = self.policy.effective
        for gone in set(self._applied) - set(pids):
            del self._applied[gone]
            self._queued_ns.pop(gone, None)
            for fds in (self._stat_fds, self._queue_fds):
                fd = fds.pop(gone, None)
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        for pid in pids:
            was = self._applied.get(pid)
            if was == level:
                continue
            try:
                if level == IDLE:
                    os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
                else:
                    if was == IDLE:
                        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
                    os.setpriority(os.PRIO_PROCESS, pid, min(19, base + level))
            except PermissionError:
                # Raising it back is not allowed after all: stay lowered from now on.
                self.policy.can_raise = False
                self.policy.level = max(self.policy.level, self._applied.get(pid, 0))
                changes += 1  # the workers stay where they are: not where the race thinks
                continue
            except OSError:  # exited meanwhile
                continue
            self._applied[pid] = level
