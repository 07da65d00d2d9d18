"""worker_nice=None: the workers' niceness follows the loop's lateness (aioloader._priority)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from aioloader import AsyncDataLoader, _priority
from aioloader._priority import NicePolicy
from tests import datasets
from tests.conftest import collect

LATE = 0.005  # a sample well over the bound
PROMPT = 0.0002  # one well within it


def feed(policy: NicePolicy, samples: list[float], others: float | None = 0.0) -> list[int]:
    """The levels the policy moved to over ``samples`` (all with ``others`` runnable)."""
    return [lvl for s in samples if (lvl := policy.observe(s, others)) is not None]


def window(over: int, policy: NicePolicy) -> list[float]:
    """One window with ``over`` samples above the bound, the rest prompt."""
    return [LATE] * over + [PROMPT] * (policy.window - over)


def test_workers_are_lowered_when_the_loop_is_late_and_nothing_else_competes() -> None:
    policy = NicePolicy(can_raise=True)
    assert policy.level == 0
    assert feed(policy, window(policy.over_samples, policy)) == []  # 2% over: within
    assert feed(policy, window(policy.over_samples + 1, policy)) == [_priority.LOW_NICE]
    assert policy.level == _priority.LOW_NICE
    # Lowered and prompt: they stay lowered (a quiet machine).
    assert feed(policy, window(0, policy) * 5) == []
    assert policy.level == _priority.LOW_NICE


def test_a_decision_waits_for_a_full_window_unless_it_can_lower_early() -> None:
    # Unknown competition, or a lowering that cannot be undone: the whole window.
    policy = NicePolicy(can_raise=True)
    assert feed(policy, [LATE] * (policy.window - 1), others=None) == []
    assert policy.observe(LATE, None) == _priority.LOW_NICE
    policy = NicePolicy(can_raise=False)
    assert feed(policy, [LATE] * (2 * policy.window - 1)) == []
    assert policy.observe(LATE, 0.0) == _priority.LOW_NICE
    # Reversible, and the machine looked quiet for a few samples: as soon as enough are late.
    policy = NicePolicy(can_raise=True)
    early = _priority._EARLY_SAMPLES
    levels = [policy.observe(LATE if i >= early - 3 else PROMPT, 0.0) for i in range(early)]
    assert levels[-1] == _priority.LOW_NICE and levels[:-1] == [None] * (early - 1)
    assert feed(policy, [PROMPT] * (policy.window - early)) == []  # the window runs on
    # A shared machine never ends a window early (nor lowers at its end).
    policy = NicePolicy(can_raise=True)
    assert feed(policy, [LATE] * (policy.window - 1), others=2.0) == []


def test_workers_keep_torchs_priority_on_a_shared_machine() -> None:
    policy = NicePolicy(can_raise=True)
    # Late, but another process competes for the cores: lowering the workers would only cost
    # their share of them.
    assert feed(policy, window(policy.window, policy) * 4, others=1.0) == []
    assert policy.level == 0


def test_lowered_workers_get_their_priority_back_when_the_machine_becomes_shared() -> None:
    policy = NicePolicy(can_raise=True)
    assert feed(policy, window(policy.window, policy)) == [_priority.LOW_NICE]
    assert feed(policy, window(0, policy), others=0.2) == []  # an occasional other task
    assert feed(policy, window(0, policy), others=1.5) == [0]
    # Quiet again, and late: lowered again.
    assert feed(policy, window(policy.window, policy)) == [_priority.LOW_NICE]


def test_without_permission_to_raise_a_lowering_needs_two_windows_and_stays() -> None:
    policy = NicePolicy(can_raise=False)
    assert feed(policy, window(policy.window, policy)) == []
    assert feed(policy, window(0, policy)) == []  # a prompt window in between starts over
    assert feed(policy, window(policy.window, policy)) == []
    assert feed(policy, window(policy.window, policy)) == [_priority.LOW_NICE]
    assert feed(policy, window(0, policy) * 3, others=2.0) == []  # cannot be undone
    assert policy.level == _priority.LOW_NICE


def test_unknown_competition_leaves_lateness_to_decide() -> None:
    policy = NicePolicy(can_raise=True)
    assert feed(policy, window(policy.window, policy), others=None) == [_priority.LOW_NICE]
    assert feed(policy, window(0, policy) * 3, others=None) == []


def test_where_it_can_be_undone_lowered_means_idle() -> None:
    policy = NicePolicy(can_raise=True, low=_priority.IDLE)
    assert feed(policy, window(policy.window, policy)) == [_priority.IDLE]
    # Shared: back to torch's priority; quiet and late again: idle again.
    assert feed(policy, window(0, policy), others=1.5) == [0]
    assert feed(policy, window(policy.window, policy)) == [_priority.IDLE]


def idle_window(policy: NicePolicy, stalled: float, queued: float) -> list[int]:
    """The levels over one prompt window, quiet, with these stall and run-queue shares."""
    return [
        lvl
        for _ in range(policy.window)
        if (lvl := policy.observe(PROMPT, 0.0, stalled, queued)) is not None
    ]


def test_idle_workers_starved_by_this_process_go_back_to_a_niceness_for_good() -> None:
    policy = NicePolicy(can_raise=True, low=_priority.IDLE)
    assert feed(policy, window(policy.window, policy)) == [_priority.IDLE]
    # The consumer waits on a slow dataset, the workers get the cores: nothing changes.
    assert idle_window(policy, stalled=1.0, queued=0.1) == []
    # Workers waiting for a CPU while nothing waits for them: nothing changes either.
    assert idle_window(policy, stalled=0.0, queued=1.0) == []
    # Both: the cores go to something of this process (a training step on threads) and the
    # consumer starves. A niceness, and idle is not tried again.
    assert idle_window(policy, stalled=0.5, queued=0.9) == [_priority.LOW_NICE]
    assert feed(policy, window(policy.window, policy) * 3) == []
    assert policy.level == _priority.LOW_NICE
    assert feed(policy, window(0, policy), others=1.5) == [0]
    assert feed(policy, window(policy.window, policy)) == [_priority.LOW_NICE]


@pytest.fixture
def child() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_favored_loop_lowers_the_workers_on_a_quiet_machine_only() -> None:
    """The loop lane asks for the loop's CPU: the workers go idle once the machine is known
    quiet, come back when it is shared or the lane is done; the lateness policy's own level
    (what later loaders start at) is not touched."""
    policy = NicePolicy(can_raise=True, low=_priority.IDLE)
    # Nothing is known of the machine yet: no lowering until its first samples say quiet, and
    # until then the lowering is pending (the lane's race waits for it).
    assert not policy.favor_pending
    assert policy.favor(True) is None
    assert policy.effective == 0 and policy.favor_pending
    early = _priority._EARLY_SAMPLES
    assert feed(policy, [PROMPT] * (early - 1)) == []
    assert policy.favor_pending
    assert policy.observe(PROMPT, 0.0) == _priority.IDLE
    assert (policy.level, policy.effective) == (0, _priority.IDLE)
    assert not policy.favor_pending
    # The rest of a quiet window: they stay lowered, the window's end changes nothing.
    assert feed(policy, [PROMPT] * (policy.window - early)) == []
    # The lane is done: back to the lateness policy's level at once.
    assert policy.favor(False) == 0
    assert policy.favor(True) == _priority.IDLE  # the last window was quiet: at once
    # Another process competes for a whole window: the workers keep their share (an answer:
    # nothing pending).
    assert feed(policy, [PROMPT] * policy.window, others=1.0) == [0]
    assert policy.effective == 0 and not policy.favor_pending
    assert feed(policy, [PROMPT] * policy.window) == [_priority.IDLE]  # quiet again
    assert policy.favor(False) == 0
    assert policy.level == 0


def test_a_favored_loop_changes_nothing_where_the_workers_could_not_be_raised_again() -> None:
    policy = NicePolicy(can_raise=False, low=_priority.LOW_NICE)
    assert feed(policy, [PROMPT] * policy.window) == []
    assert policy.favor(True) is None
    assert not policy.favor_pending
    assert feed(policy, [PROMPT] * policy.window * 2) == []
    assert policy.effective == 0


def test_a_favored_loop_changes_nothing_where_competition_is_unknown() -> None:
    """Without the machine's load (no /proc/loadavg) it is never known quiet."""
    policy = NicePolicy(can_raise=True, low=_priority.IDLE)
    assert policy.favor(True) is None
    assert feed(policy, [PROMPT] * policy.window * 3, others=None) == []
    assert policy.effective == 0
    assert not policy.favor_pending  # no answer will come: nothing to wait for


def test_the_first_samples_verdict_holds_for_the_rest_of_the_window() -> None:
    """A mean of other runnable tasks near the threshold must not turn a favored lowering on
    and off sample by sample: the first samples decide until the window's end, where the whole
    window's mean does."""
    early = _priority._EARLY_SAMPLES
    policy = NicePolicy(can_raise=True, low=_priority.IDLE)
    policy.favor(True)
    assert feed(policy, [PROMPT] * early, others=0.3) == [_priority.IDLE]
    # The mean climbs past the threshold and falls back below it: nothing moves meanwhile.
    rest = policy.window - early
    levels = [policy.observe(PROMPT, 1.0 if k % 2 else 0.6) for k in range(rest - 1)]
    assert [lvl for lvl in levels if lvl is not None] == []
    assert policy.observe(PROMPT, 1.0) == 0  # the window's mean says shared: back
    # Shared by the first samples of the next: no lowering before its end, however quiet the
    # rest; quiet by the whole window's mean, lowered then.
    policy = NicePolicy(can_raise=True, low=_priority.IDLE)
    policy.favor(True)
    assert feed(policy, [PROMPT] * early, others=0.6) == []
    assert feed(policy, [PROMPT] * (policy.window - early - 1), others=0.0) == []
    assert policy.observe(PROMPT, 0.0) == _priority.IDLE


def test_a_favored_lowering_is_pending_only_until_the_first_samples_say_shared() -> None:
    policy = NicePolicy(can_raise=True, low=_priority.IDLE)
    policy.favor(True)
    assert policy.favor_pending
    assert feed(policy, [PROMPT] * _priority._EARLY_SAMPLES, others=1.0) == []
    assert policy.effective == 0 and not policy.favor_pending


def test_workers_idle_for_a_favored_loop_and_starved_go_to_a_niceness() -> None:
    """The idle guard holds for a favored lowering too: starved idle workers get a niceness,
    for good, and the lateness policy's level stays what it was."""
    policy = NicePolicy(can_raise=True, low=_priority.IDLE)
    feed(policy, [PROMPT] * policy.window)
    assert policy.favor(True) == _priority.IDLE
    levels = [
        lvl
        for _ in range(policy.window)
        if (lvl := policy.observe(PROMPT, 0.0, stalled=0.5, queued=0.9)) is not None
    ]
    assert levels == [_priority.LOW_NICE]
    assert (policy.level, policy.effective, policy.low) == (
        0,
        _priority.LOW_NICE,
        _priority.LOW_NICE,
    )
    assert policy.favor(False) == 0
    # The window's lateness still counts: a late, starved window lowers the policy's level too.
    policy = NicePolicy(can_raise=True, low=_priority.IDLE)
    feed(policy, [PROMPT] * policy.window)
    policy.favor(True)
    for s in window(policy.window, policy):
        policy.observe(s, 0.0, stalled=0.5, queued=0.9)
    assert (policy.level, policy.low) == (_priority.LOW_NICE, _priority.LOW_NICE)


async def test_the_monitor_renices_workers_as_the_policy_decides(
    child: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _priority.may_raise_priority():
        pytest.skip("this process may not raise a priority it lowered")
    monkeypatch.setattr(_priority, "_last_level", 0)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    monitor = _priority.PriorityMonitor(lambda: True)
    try:
        monitor.watch(lambda: [child])
        assert os.getpriority(os.PRIO_PROCESS, child) == base
        assert monitor.running
        monitor.policy.level = _priority.LOW_NICE
        monitor._apply()
        assert os.getpriority(os.PRIO_PROCESS, child) == min(19, base + _priority.LOW_NICE)
        monitor.policy.level = 0
        monitor._apply()
        assert os.getpriority(os.PRIO_PROCESS, child) == base
        if hasattr(os, "SCHED_IDLE"):
            monitor.policy.level = _priority.IDLE
            monitor._apply()
            assert os.sched_getscheduler(child) == os.SCHED_IDLE
            assert monitor._queued(0.01) == 0.0  # its first run-queue reading
            monitor.policy.level = _priority.LOW_NICE
            monitor._apply()
            assert os.sched_getscheduler(child) == os.SCHED_OTHER
            assert os.getpriority(os.PRIO_PROCESS, child) == min(19, base + _priority.LOW_NICE)
    finally:
        monitor.pause()
    assert not monitor.running


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
async def test_the_monitor_applies_a_favored_loop_at_once_and_counts_no_change(
    child: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """favor_loop renices at once; overlapping lanes count (the last one out raises them); a
    favor() that takes effect at once is the lane's own doing, not a change for its race."""
    if not _priority.may_raise_priority():
        pytest.skip("this process may not raise a priority it lowered")
    monkeypatch.setattr(_priority, "_last_level", 0)
    monitor = _priority.PriorityMonitor(lambda: True)
    try:
        monitor.watch(lambda: [child])
        feed(monitor.policy, [PROMPT] * monitor.policy.window)  # a quiet machine
        changes = _priority.changes
        monitor.favor_loop(True)
        assert os.sched_getscheduler(child) == os.SCHED_IDLE
        monitor.favor_loop(True)  # a second epoch's lane
        monitor.favor_loop(False)
        assert os.sched_getscheduler(child) == os.SCHED_IDLE
        monitor.favor_loop(False)
        assert os.sched_getscheduler(child) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, child) == os.getpriority(os.PRIO_PROCESS, 0)
        assert _priority.changes == changes and _priority._last_level == 0
    finally:
        monitor.pause()


def test_the_monitor_counts_every_change_the_policy_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    """``changes`` (which makes the lane's race time every way again) moves when the policy's
    level moves, even while a favored lowering hides it, and when a favored lowering waited
    for the machine to be known quiet; only the lateness policy's level is remembered for
    later pools."""
    monkeypatch.setattr(_priority, "changes", 0)
    monkeypatch.setattr(_priority, "_last_level", 0)
    monitor = _priority.PriorityMonitor(lambda: True)
    monitor.policy = policy = NicePolicy(can_raise=True, low=_priority.IDLE)

    def sample(lateness: float) -> None:
        level = policy.level
        monitor._decided(level, policy.observe(lateness, 0.0))

    monitor.favor_loop(True)  # nothing known of the machine yet: no change
    assert (_priority.changes, policy.effective) == (0, 0)
    for _ in range(_priority._EARLY_SAMPLES):
        sample(PROMPT)
    assert (_priority.changes, policy.effective) == (1, _priority.IDLE)  # known quiet now
    assert _priority._last_level == 0
    for s in window(policy.window, policy)[_priority._EARLY_SAMPLES :]:
        sample(s)  # late: the policy lowers its own level, under the favored one
    assert policy.level == _priority.IDLE and policy.effective == _priority.IDLE
    assert _priority.changes == 2 and _priority._last_level == _priority.IDLE
    monitor.favor_loop(False)  # its own level: still idle, no change of the workers
    assert _priority.changes == 2


async def test_a_refused_raise_leaves_the_workers_lowered(
    child: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_priority, "_last_level", 0)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    monitor = _priority.PriorityMonitor(lambda: True)
    monitor.policy.can_raise = True
    try:
        monitor.watch(lambda: [child])
        monitor.policy.level = _priority.LOW_NICE
        monitor._apply()
        real = os.setpriority

        def refuse(which: int, who: int, prio: int) -> None:
            if prio < os.getpriority(which, who):
                raise PermissionError(1, "Operation not permitted")
            real(which, who, prio)

        monkeypatch.setattr(os, "setpriority", refuse)
        monitor.policy.level = 0
        monitor._apply()
        assert not monitor.policy.can_raise
        assert monitor.policy.level == _priority.LOW_NICE
        assert os.getpriority(os.PRIO_PROCESS, child) == min(19, base + _priority.LOW_NICE)
    finally:
        monitor.pause()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
async def test_injected_lateness_lowers_a_loaders_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path: samples the monitor takes (injected here) reach the workers' niceness."""

    class Nice(datasets.RangeDataset):
        def __getitem__(self, i: int) -> Any:
            import os
            import time

            time.sleep(0.02)
            return os.sched_getscheduler(0), os.nice(0)

    monkeypatch.setattr(_priority, "_last_level", 0)
    monkeypatch.setattr(_priority, "may_raise_priority", lambda: True)
    monkeypatch.setattr(_priority.PriorityMonitor, "_others", lambda self: 0.0)
    real_tick = _priority.PriorityMonitor._tick

    def late_tick(self: _priority.PriorityMonitor) -> None:
        assert self._loop is not None
        self._due = self._loop.time() - 0.01  # every sample 10 ms late
        if self._sched_fd >= 0:  # and no run-queue figure to cap it
            os.close(self._sched_fd)
            self._sched_fd = -1
        real_tick(self)

    monkeypatch.setattr(_priority.PriorityMonitor, "_tick", late_tick)
    monkeypatch.setattr(_priority, "PERIOD_S", 0.001)
    monkeypatch.setattr(_priority, "_EARLY_SAMPLES", 10**9)  # whole windows: 50 ms here
    base = os.nice(0)
    async with AsyncDataLoader(Nice(120), batch_size=None, num_workers=2) as loader:
        got = await collect(loader)
        monitor = loader._priority
        assert monitor is not None and not monitor.running  # stopped with the epoch
    assert list(got[0]) == [os.SCHED_OTHER, base]  # started at torch's priority
    # Lowered while the loop was late: to SCHED_IDLE where it can be undone. The consumer waits
    # on the dataset's sleeps all along, but the workers never wait for a CPU: not starved.
    assert list(got[-1]) == [os.SCHED_IDLE, base]
    assert monitor.policy.level == _priority.IDLE
    assert _priority._last_level == _priority.IDLE  # where the next pool starts


async def test_a_fixed_worker_nice_has_no_monitor() -> None:
    async with AsyncDataLoader(datasets.RangeDataset(4), num_workers=1, worker_nice=3) as loader:
        await collect(loader)
        assert loader._priority is None


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
async def test_idle_workers_run_under_sched_idle_with_no_monitor() -> None:
    async with AsyncDataLoader(
        datasets.SchedDataset(4), batch_size=2, num_workers=2, worker_nice="idle"
    ) as loader:
        got = await collect(loader)
        assert loader._priority is None  # fixed: nothing adapts it
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert [row.tolist() for b in got for row in b] == [[os.SCHED_IDLE, base]] * 4
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # the loop's own process is untouched


@pytest.mark.parametrize("bad", ["low", True, 20, -1])
def test_worker_nice_names_what_it_takes(bad: object) -> None:
    with pytest.raises(ValueError, match=r"worker_nice should be an int from 0 .* 'idle'"):
        AsyncDataLoader(datasets.RangeDataset(4), num_workers=1, worker_nice=bad)  # type: ignore[arg-type]


async def test_the_monitor_stops_when_the_epoch_is_abandoned() -> None:
    async with AsyncDataLoader(
        datasets.RangeDataset(400), num_workers=1, persistent_workers=True
    ) as loader:
        async for _ in loader:
            break
        await asyncio.sleep(0.05)
        assert loader._priority is not None and not loader._priority.running
        assert len(await collect(loader)) == 400
        assert not loader._priority.running


async def test_threads_of_this_process_are_not_competition() -> None:
    """A training step on a thread of the loop's process competes with the workers, not with
    the loader: it must not make the machine count as shared."""
    import hashlib
    import threading

    stop = threading.Event()
    data = bytes(8 << 20)

    def step() -> None:  # runnable throughout: hashing a large buffer releases the GIL
        while not stop.is_set():
            hashlib.sha256(data).digest()

    thread = threading.Thread(target=step)
    thread.start()
    monitor = _priority.PriorityMonitor(lambda: True)
    try:
        monitor.watch(lambda: [])
        assert threading.get_native_id() not in monitor._thread_fds  # the loop's own
        assert thread.native_id in monitor._thread_fds
        ours = [monitor._ours() for _ in range(20)]
        assert sum(ours) / len(ours) > 1.5  # the reading thread and the step, runnable
        assert monitor._others() is not None
        stop.set()
        thread.join()
        for _ in range(100):  # the OS thread ends a moment after join() returns
            monitor._find_threads()
            if thread.native_id not in monitor._thread_fds:
                break
            await asyncio.sleep(0.01)
        assert thread.native_id not in monitor._thread_fds  # its stat file closed
    finally:
        stop.set()
        thread.join()
        monitor.pause()


@pytest.fixture
def two_children() -> Iterator[list[int]]:
    procs = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


async def test_overlapping_epochs_pools_all_get_the_decided_niceness(
    monkeypatch: pytest.MonkeyPatch, two_children: list[int]
) -> None:
    if not _priority.may_raise_priority():
        pytest.skip("this process may not raise a priority it lowered")
    monkeypatch.setattr(_priority, "_last_level", 0)
    base = os.getpriority(os.PRIO_PROCESS, 0)

    class Pool:  # what the monitor needs of a pool: a bound pids()
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def pids(self) -> list[int]:
            return [self.pid]

    pools = [Pool(pid) for pid in two_children]
    monitor = _priority.PriorityMonitor(lambda: True)
    try:
        monitor.watch(pools[0].pids)
        monitor.watch(pools[1].pids)  # a second epoch's pool beside the first
        monitor.policy.level = _priority.LOW_NICE
        monitor._apply()
        for pid in two_children:
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, base + _priority.LOW_NICE)
        del pools[0]  # a dropped pool leaves the monitor by itself
        monitor.policy.level = 0
        monitor._apply()
        assert os.getpriority(os.PRIO_PROCESS, two_children[1]) == base
        assert len(monitor._pools) == 1
    finally:
        monitor.pause()
