"""A paced stream's cheap windows are transformed and collated on the loop (``_looplane``):
with ``transform_in="auto"`` (the default), or without worker processes.

The lane's thresholds are measured costs; tests that need the lane to engage whatever the
machine's load raise them, and tests that need it to stay out use a transform that is dear by
any measure or a source that never keeps the loader waiting.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import get_worker_info

from aioloader import AsyncDataLoader, _looplane, _priority
from tests import stream_sources as ss
from tests.conftest import collect

N, BATCH, GAP = 48, 4, 0.002


@pytest.fixture
def lane_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any measured cost qualifies: the lane engages on a paced source even on a busy machine."""
    monkeypatch.setattr(_looplane, "MAX_SAMPLE_S", 10.0)
    monkeypatch.setattr(_looplane, "MAX_COLLATE_S", 10.0)


class Paced:
    """``tensor([i])`` for i < n, ``gap`` seconds apart; records each ``ack``."""

    def __init__(self, n: int, gap: float) -> None:
        self.n = n
        self.gap = gap
        self.acked: list[list[int]] = []

    async def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        for i in range(self.n):
            await asyncio.sleep(self.gap)
            yield torch.tensor([i])

    def ack(self, samples: list[torch.Tensor]) -> None:
        self.acked.append([int(s) for s in samples])


def where(sample: torch.Tensor) -> dict[str, Any]:
    """The process (and whether its main thread), and the worker id and count get_worker_info()
    gives there (-1: None)."""
    info = get_worker_info()
    return {
        "x": sample,
        "pid": os.getpid(),
        "main": threading.current_thread() is threading.main_thread(),
        "id": -1 if info is None else info.id,
        "n": -1 if info is None else info.num_workers,
    }


def draws(sample: torch.Tensor) -> dict[str, Any]:
    """A random augmentation drawing from all three global generators."""
    return {
        "x": sample,
        "pid": os.getpid(),
        "r": random.random(),
        "rgauss": random.gauss(0.0, 1.0),  # random keeps every second one too
        "t": torch.rand(()),
        "np": float(np.random.random()),
        "gauss": float(np.random.standard_normal()),  # numpy keeps every second one
    }


def dear(sample: torch.Tensor) -> dict[str, Any]:
    """2 ms a sample: far above what the lane takes on the loop."""
    time.sleep(0.002)
    return {"x": sample, "pid": os.getpid()}


def _pids(batches: list[Any]) -> list[int]:
    pids = []
    for b in batches:
        assert len({int(p) for p in b["pid"]}) == 1, "a window is loaded in one place"
        pids.append(int(b["pid"][0]))
    return pids


def _in_order(batches: list[Any]) -> None:
    got = [int(v) for b in batches for v in b["x"].flatten()]
    assert got == list(range(N))


@pytest.mark.usefixtures("lane_open")
async def test_a_paced_stream_with_a_cheap_transform_is_loaded_on_the_loop() -> None:
    src = Paced(N, GAP)
    async with AsyncDataLoader(src, batch_size=BATCH, num_workers=2, transform=where) as loader:
        got: list[Any] = await collect(loader)
    _in_order(got)
    pids = _pids(got)
    here = [k for k, pid in enumerate(pids) if pid == os.getpid()]
    assert pids[0] != os.getpid(), "the workers measure the first window"
    assert len(here) >= len(got) // 2, pids
    for k in here:
        # The transform sees the worker the window was assigned to, as it would there.
        assert {int(i) for i in got[k]["id"]} <= {0, 1}
        assert {int(n) for n in got[k]["n"]} == {2}
    # Every batch acknowledged once, in order, wherever it was loaded.
    assert src.acked == [list(range(i, i + BATCH)) for i in range(0, N, BATCH)]
    # Nothing of the stand-in worker info is left on the loop's thread.
    assert get_worker_info() is None


async def _draw_after_an_epoch(
    lane: bool, bit_generator: str, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, ...]:
    """Seed every generator, run an epoch whose transform draws, return the program's next
    draws and the batches."""
    if not lane:
        monkeypatch.setattr(_looplane.LoopLane, "usable", lambda self, idle: False)
    random.seed(7)
    random.gauss(0.0, 1.0)  # the program's random keeps a normal for its next draw
    if bit_generator == "PCG64":  # numpy's documented way to change the global generator
        np.random.set_bit_generator(np.random.PCG64(7))
    else:
        np.random.seed(7)
    np.random.standard_normal()  # the program's numpy keeps a normal for its next draw
    torch.manual_seed(7)
    loader = AsyncDataLoader(Paced(N, GAP), batch_size=BATCH, num_workers=2, transform=draws)
    async with loader:
        got: list[Any] = await collect(loader)
    assert type(np.random.get_bit_generator()).__name__ == bit_generator
    program = (
        random.gauss(0.0, 1.0),
        random.random(),
        float(np.random.standard_normal()),
        float(np.random.random()),
    )
    return *program, float(torch.rand(())), got


@pytest.mark.usefixtures("lane_open")
@pytest.mark.parametrize("bit_generator", ["MT19937", "PCG64"])
async def test_the_lane_leaves_the_programs_random_streams_alone(
    bit_generator: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = np.random.get_bit_generator()
    try:
        *after_lane, got = await _draw_after_an_epoch(True, bit_generator, monkeypatch)
        _in_order(got)
        assert os.getpid() in _pids(got)
        # The same draws as when every window is loaded in a worker process.
        *after_workers, got_workers = await _draw_after_an_epoch(False, bit_generator, monkeypatch)
    finally:
        np.random.set_bit_generator(original)
    assert os.getpid() not in _pids(got_workers)
    assert after_lane == after_workers
    # Windows loaded as the same worker never repeat values: each id's generators go on from
    # where its last window left them. (Only the lane's: with PCG64, numpy's seed() in each
    # worker keeps the normal the program kept before the fork, in both workers alike.)
    for key in ("r", "rgauss", "np", "gauss"):
        pairs = [(v, p) for b in got for v, p in zip(b[key], b["pid"], strict=True)]
        values = [float(v) for v, p in pairs if p == os.getpid()]
        assert len(set(values)) == len(values), key


def _program_draws() -> tuple[float, ...]:
    return (
        random.gauss(0.0, 1.0),
        random.random(),
        float(np.random.standard_normal()),
        float(torch.rand(())),
    )


def _program_states() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _put_program_states(states: tuple[Any, ...]) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


def test_the_stand_in_generators_go_on_across_blocks_and_leave_the_programs() -> None:
    # The swap refills the buffers of the block before: blocks one after another, with the
    # program drawing in between (each block must give back the program's state of its own
    # start, not the last block's), and a block inside a block, each give the program back
    # exactly its own streams; the stand-in's draws go on from where its last block left them.
    saved = _program_states()
    try:
        random.seed(5)
        random.gauss(0.0, 1.0)  # a kept normal each
        np.random.seed(5)
        np.random.standard_normal()
        torch.manual_seed(5)
        gens = _looplane._Generators(100, 3)
        lane: list[tuple[float, ...]] = []
        for nested in (False, False, True, False):
            _program_draws()  # the program moves on between blocks
            before = _program_states()
            expected = _program_draws()
            _put_program_states(before)
            with gens.current():
                lane.append(_program_draws())
                if nested:
                    with gens.current():
                        lane.append(_program_draws())
            assert _program_draws() == expected
        assert len(set(lane)) == len(lane), "the stand-in's streams never repeat"
        # The stand-in's first draws are those of its own seed, in every generator.
        random.seed(103)
        np.random.set_state(np.random.RandomState(gens._np_seed).get_state())
        torch.manual_seed(103)
        assert lane[0] == _program_draws()
    finally:
        _put_program_states(saved)


def test_a_generator_that_fails_to_come_back_leaves_the_others_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(state: Any) -> None:
        raise RuntimeError("random's state cannot be put back")

    saved = _program_states()
    try:
        random.seed(8)
        np.random.seed(8)
        torch.manual_seed(8)
        before = _program_states()
        expected = _program_draws()
        _put_program_states(before)
        gens = _looplane._Generators(100, 3)
        with pytest.raises(RuntimeError, match="cannot be put back"), gens.current():
            _program_draws()
            monkeypatch.setattr(_looplane._pyrandom, "put", broken)
        monkeypatch.undo()
        # torch's and numpy's came back although random's, put back first, failed.
        assert _program_draws()[2:] == expected[2:]
        assert not gens._open  # the next block swaps again
    finally:
        _put_program_states(saved)


def test_a_program_that_replaced_getstate_still_gets_its_streams_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A shim of the program's own in place of random.getstate / np.random.get_state (no bound
    # generator behind it): the public calls carry the states.
    real_random, real_np = random.getstate, np.random.get_state
    monkeypatch.setattr(random, "getstate", lambda: real_random())
    monkeypatch.setattr(np.random, "get_state", lambda legacy=True: real_np(legacy=legacy))
    monkeypatch.setattr(_looplane._pyrandom, "_seen", None)
    monkeypatch.setattr(_looplane._npstate, "_seen", None)
    saved = _program_states()
    try:
        random.seed(2)
        np.random.seed(2)
        before = _program_states()
        expected = _program_draws()
        _put_program_states(before)
        gens = _looplane._Generators(100, 1)
        for _ in range(2):
            with gens.current():
                drawn = _program_draws()
            assert drawn != expected
            assert _program_draws() == expected
            _put_program_states(before)
    finally:
        _put_program_states(saved)


@pytest.mark.usefixtures("lane_open")
async def test_an_error_on_the_lane_is_raised_at_its_batch() -> None:
    async with AsyncDataLoader(
        Paced(N, GAP),
        batch_size=BATCH,
        num_workers=2,
        transform=ss.FailAt(30, ValueError("bad 30")),
        transform_in="auto",
    ) as loader:
        it = aiter(loader)
        got: list[Any] = []
        async with asyncio.timeout(30):
            for _ in range(30 // BATCH):
                got.append(await anext(it))
            with pytest.raises(ValueError, match="bad 30"):
                await anext(it)
            rest = [b async for b in it]
    assert [int(v) for b in got for v in b.flatten()] == list(range(28))
    assert [int(v) for b in rest for v in b.flatten()] == list(range(32, N))


async def test_a_dear_transform_stays_in_the_workers() -> None:
    async with AsyncDataLoader(
        Paced(24, GAP), batch_size=BATCH, num_workers=2, transform=dear, transform_in="auto"
    ) as loader:
        got: list[Any] = await collect(loader)
    assert os.getpid() not in _pids(got)


class Bursts:
    """``tensor([i])`` for i < n, in bursts of ``burst`` back to back, ``gap`` seconds apart."""

    def __init__(self, n: int, burst: int, gap: float) -> None:
        self.n, self.burst, self.gap = n, burst, gap

    async def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        for i in range(self.n):
            if i % self.burst == 0:
                await asyncio.sleep(self.gap)
            yield torch.tensor([i])


@pytest.mark.usefixtures("lane_open")
async def test_a_paced_window_from_the_loop_reaches_the_consumer_before_the_next_one_starts() -> (
    None
):
    """A burst longer than a window leaves samples waiting when a window on the loop closes: the
    consumer gets the batch first, and only then does the loop transform those for the next
    window (they would otherwise add a transform step to the batch's latency)."""
    events: list[tuple[str, int]] = []

    def transform(sample: torch.Tensor) -> torch.Tensor:
        if threading.current_thread() is threading.main_thread():  # on the loop
            events.append(("transform", int(sample)))
        return sample

    n, size = 120, 8
    async with AsyncDataLoader(
        Bursts(n, size + size // 2, 0.004),
        batch_size=size,
        num_workers=2,
        transform=transform,
        in_order=False,  # a batch from the loop is the consumer's at once, whatever the workers do
    ) as loader:
        async with asyncio.timeout(30):
            async for batch in loader:
                events.append(("batch", int(batch[-1])))

    on_loop = [i for kind, i in events if kind == "transform"]
    delivered = [(k, i) for k, (kind, i) in enumerate(events) if kind == "batch"]
    checked = 0
    for k, last in delivered:
        if last not in on_loop:
            continue  # a worker's batch: it arrives whenever the worker's result does
        # Every sample after the batch's last was transformed after the consumer had the batch.
        before = {i for kind, i in events[:k] if kind == "transform"}
        assert not {i for i in before if i > last}, (last, sorted(before)[-3:])
        checked += 1
    assert checked >= 2, "too few windows were loaded on the loop to tell"


@pytest.mark.usefixtures("lane_open")
async def test_an_unpaced_sources_first_windows_go_to_the_workers() -> None:
    """Until a race period (RACE_PERIOD windows) has been timed, nothing runs on the loop."""
    assert N // BATCH < _looplane.RACE_PERIOD
    async with AsyncDataLoader(
        ss.Counting(N), batch_size=BATCH, num_workers=2, transform=where, transform_in="auto"
    ) as loader:
        got: list[Any] = await collect(loader)
    _in_order(got)
    assert os.getpid() not in _pids(got)


async def _unpaced_once_in_order(n: int) -> list[Any]:
    """The batches of an unpaced source of ``n`` events, 2 workers; checks every event came once,
    in order."""
    async with AsyncDataLoader(
        ss.Counting(n), batch_size=BATCH, num_workers=2, transform=where, transform_in="auto"
    ) as loader:
        got: list[Any] = await collect(loader)
    assert [int(v) for b in got for v in b["x"].flatten()] == list(range(n))
    return got


@pytest.mark.usefixtures("lane_open")
async def test_an_unpaced_source_moving_between_lane_and_workers_keeps_every_event_once_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows change ways every period (as a race that keeps changing its mind would): the
    batches still arrive in order, each event once, some from the loop and some from workers."""
    monkeypatch.setattr(_looplane, "RACE_PERIOD", 3)
    monkeypatch.setattr(_looplane._Race, "_ended", lambda race, rate: 2 - race.way)
    # (No wait for a favored lowering's verdict: every period is timed at once.)
    monkeypatch.setattr(_priority.PriorityMonitor, "favor_pending", lambda monitor: False)
    pids = _pids(await _unpaced_once_in_order(240))
    assert os.getpid() in pids and len(set(pids)) >= 2
    # Several switches each way, not one move half-way.
    switches = sum(
        1 for a, b in itertools.pairwise(pids) if (a == os.getpid()) != (b == os.getpid())
    )
    assert switches >= 4


@pytest.mark.usefixtures("lane_open")
async def test_the_lane_asks_for_the_loops_cpu_while_a_way_puts_windows_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loader's priority monitor hears favor_loop(True) when the race moves to a way that
    puts windows on the loop and favor_loop(False) when it moves back, in pairs, the last one
    at the epoch's end; a change of the workers' priority meanwhile has every way timed
    again."""
    monkeypatch.setattr(_priority, "changes", _priority.changes)
    calls: list[bool] = []
    # The loader's own monitor gets them (through the epoch's host).
    monkeypatch.setattr(_priority.PriorityMonitor, "favor_loop", lambda m, on: calls.append(on))
    reraces: list[int] = []
    monkeypatch.setattr(_looplane._Race, "rerace", lambda race: reraces.append(race.way))
    monkeypatch.setattr(_looplane, "RACE_PERIOD", 3)

    def ended(race: Any, rate: float) -> int:
        _priority.changes += 1  # the policy renices the workers once a period
        return (race.way + 1) % 3

    monkeypatch.setattr(_looplane._Race, "_ended", ended)
    await _unpaced_once_in_order(600)
    assert calls[0] is True and calls[-1] is False and len(calls) >= 4
    assert all(a != b for a, b in itertools.pairwise(calls))  # on, off, on, off...
    assert len(reraces) >= 3


@pytest.mark.usefixtures("lane_open")
@pytest.mark.parametrize("verdict", ["comes", "never comes"])
async def test_a_way_that_asked_for_the_loops_cpu_is_not_timed_before_the_answer(
    verdict: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the priority policy has not yet said whether the machine is shared, the workers
    keep their level: a period of a way that asked for the lowering is not timed (its rate
    would be the unlowered one's). Once the verdict is in, or after FAVOR_WAIT_S without one,
    it is."""
    monkeypatch.setattr(_looplane, "RACE_PERIOD", 3)
    monkeypatch.setattr(_looplane, "FAVOR_WAIT_S", 0.03)
    asked = 0
    first_asked: float | None = None

    def pending(monitor: Any) -> bool:
        nonlocal asked, first_asked
        asked += 1
        if first_asked is None:
            first_asked = time.perf_counter()
        return verdict == "never comes" or asked <= 60

    monkeypatch.setattr(_priority.PriorityMonitor, "favor_pending", pending)
    timed: list[tuple[int, bool, float]] = []

    def ended(race: Any, rate: float) -> int:
        still = verdict == "never comes" or asked <= 60
        timed.append((race.way, still, time.perf_counter()))
        return LANE  # every period after the first on the loop

    monkeypatch.setattr(_looplane._Race, "_ended", ended)
    await _unpaced_once_in_order(9000)
    lane_periods = [(still, at) for way, still, at in timed if way == LANE]
    assert lane_periods and first_asked is not None, timed
    if verdict == "comes":
        assert not any(still for still, _ in lane_periods), timed
    else:  # timed anyway once the wait is over
        assert all(at >= first_asked + 0.03 for _, at in lane_periods), timed


WORKERS, MIXED, LANE = range(3)


class _Clock:
    """Drives a race: each window takes the time its period's way takes (``costs``, by way).
    ``in_flight``: after a change of way, that many windows still take the old way's time, as
    windows do that wait for the permits the old way's batches in flight hold, or find them
    free."""

    def __init__(self, settle: int = _looplane.RACE_SETTLE, in_flight: int = 0) -> None:
        self.now = 0.0
        self.race = _looplane._Race(settle)
        self.in_flight = in_flight

    def windows(self, periods: int, costs: tuple[float, float, float]) -> list[int]:
        """The way of each of ``periods * RACE_PERIOD`` windows."""
        ways: list[int] = []
        behind, old = 0, WORKERS
        for _ in range(periods * _looplane.RACE_PERIOD):
            self.race.next(self.now)
            way = self.race.way
            if ways and way != ways[-1]:
                behind, old = self.in_flight, ways[-1]
            self.now += costs[old if behind else way]
            behind = max(0, behind - 1)
            ways.append(way)
        return ways


def _runs(ways: list[int]) -> list[tuple[int, int]]:
    """(way, consecutive windows) in order."""
    return [(way, len(list(group))) for way, group in itertools.groupby(ways)]


def _share(ways: list[int], way: int) -> float:
    """The share of the last half of ``ways`` that went ``way``."""
    half = ways[len(ways) // 2 :]
    return half.count(way) / len(half)


def test_each_way_sends_its_share_of_windows_to_the_lane() -> None:
    assert _looplane.RACE_WAYS == (0.0, 1 / 3, 1.0)
    race = _looplane._Race(settle=0)
    race.way = MIXED
    race.rates = {WORKERS: 1.0, MIXED: 2.0, LANE: 1.0}
    race.best = MIXED  # no tour for a while
    lane = [race.next(i * 0.001) for i in range(6 * _looplane.RACE_PERIOD)]
    assert sum(lane) == 2 * _looplane.RACE_PERIOD
    assert all(lane[i] == (i % 3 == 2) for i in range(len(lane)))


def test_the_race_keeps_the_workers_when_they_are_faster_and_times_the_others_ever_less_often() -> (
    None
):
    ways = _Clock().windows(600, costs=(0.001, 0.0015, 0.002))
    runs = _runs(ways)
    period, settle = _looplane.RACE_PERIOD, _looplane.RACE_SETTLE
    # The workers first, then the others, one period each after their settling windows.
    assert runs[:3] == [(WORKERS, period), (MIXED, settle + period), (LANE, settle + period)]
    tours = [n for way, n in runs[:-1] if way != WORKERS]  # the last may be cut short
    assert set(tours) == {settle + period}
    stays = [n for way, n in runs if way == WORKERS][1:-1]  # between two tours
    # Timed again after 8 periods, then 16, 32 and 64 at most.
    checks = [_looplane.RACE_RECHECK * 2**k for k in range(4)]
    assert checks[-1] == _looplane.RACE_RECHECK_MAX
    assert stays[:5] == [settle + n * period for n in [*checks, checks[-1]]]
    assert _share(ways, WORKERS) > 0.9


def test_the_race_puts_more_on_the_lane_only_when_that_is_clearly_faster() -> None:
    tie = _Clock().windows(100, costs=(0.001, 0.00095, 0.00092))
    assert _share(tie, WORKERS) > 0.9  # a tie leaves the loop free
    mixed = _Clock().windows(100, costs=(0.001, 0.0006, 0.0008))
    assert _share(mixed, MIXED) > 0.9
    lane = _Clock().windows(100, costs=(0.001, 0.0008, 0.0005))
    assert _share(lane, LANE) > 0.9


def test_the_race_does_not_time_the_windows_behind_those_still_in_flight() -> None:
    """With many batches in flight (many workers, a deep prefetch), the first windows after a
    change go at the old way's pace; settling for as many keeps them out of the timing."""
    in_flight, costs = 24, (0.001, 0.0012, 0.0007)
    settled = _Clock(settle=in_flight, in_flight=in_flight).windows(200, costs)
    assert _share(settled, LANE) > 0.85
    # Timed from the first window on, the lane's period is mostly another way's pace: it loses.
    unsettled = _Clock(settle=0, in_flight=in_flight).windows(200, costs)
    assert _share(unsettled, LANE) < 0.2


def test_the_race_follows_the_machines_load() -> None:
    clock = _Clock()
    clock.windows(20, costs=(0.001, 0.0007, 0.002))  # quiet: one in three on the lane wins
    assert clock.race.best == MIXED
    # Loaded: the workers slow down, and the lane wins once it is timed again.
    periods = 2 * _looplane.RACE_RECHECK_MAX + 10
    loaded = clock.windows(periods, costs=(0.004, 0.003, 0.002))
    assert clock.race.best == LANE
    assert _share(loaded, LANE) > 0.9
    # Quiet again: the others are timed again (after RACE_RECHECK_MAX periods at the latest)
    # and one in three wins back.
    quiet = clock.windows(periods, costs=(0.001, 0.0007, 0.002))
    assert clock.race.best == MIXED
    assert _share(quiet, MIXED) > 0.9


def test_one_slow_period_of_the_best_way_before_a_recheck_does_not_lose_the_race() -> None:
    """The host stalls the loop for a moment: the best way's last period before a recheck is
    slow. Its rate is the better of its last two periods, so a slower way does not win."""
    clock = _Clock(settle=0)
    race = clock.race
    race.rates = {WORKERS: 1000.0, MIXED: 1500.0, LANE: 500.0}
    race.best = race.way = MIXED
    race._since = race._recheck - 2  # two more periods of MIXED, then the others are timed
    normal, stalled = (0.001, 1 / 1500, 0.002), (0.001, 0.001, 0.002)
    clock.windows(1, normal)
    clock.windows(1, stalled)  # the period before the tour: as slow as the workers
    ways = clock.windows(3, normal)
    assert [way for way, _ in _runs(ways)][:3] == [WORKERS, LANE, MIXED]
    assert race.best == MIXED


def test_a_change_of_the_workers_priority_times_every_way_again() -> None:
    """Rates timed under another priority of the workers are stale: after ``rerace`` the
    others are timed at once (not after the settled race's long recheck interval), and the
    rechecks start again from RACE_RECHECK."""
    clock = _Clock()
    clock.windows(300, costs=(0.001, 0.0015, 0.002))
    assert clock.race.best == WORKERS and clock.race._recheck == _looplane.RACE_RECHECK_MAX
    clock.race.rerace()
    # Now one in three on the lane is the fastest (the workers were lowered meanwhile).
    ways = clock.windows(4, costs=(0.001, 0.0007, 0.002))
    assert [way for way, _ in _runs(ways)][:3] == [WORKERS, MIXED, LANE]
    assert clock.race.best == MIXED and clock.race._recheck == _looplane.RACE_RECHECK
    # Without it, the lowering would be found only at the next recheck, 64 periods on.
    clock = _Clock()
    clock.windows(300, costs=(0.001, 0.0015, 0.002))
    assert set(clock.windows(4, costs=(0.001, 0.0007, 0.002))) == {WORKERS}


def test_windows_sent_outside_the_race_drop_its_period_and_settle_it_again() -> None:
    """A paced stretch in the middle of a period (the source kept the loader waiting) drops the
    period, whose rate would be the source's; the windows after it settle first."""
    settle = 3
    race = _looplane._Race(settle)
    for i in range(_looplane.RACE_PERIOD - 1):  # a new race starts timing at once
        race.next(i * 0.001)
    race.restart()
    for i in range(settle):  # untimed: a pause of 10 s among them changes nothing
        race.next(1.0 + i * 10.0)
    for i in range(_looplane.RACE_PERIOD + 1):
        race.next(100.0 + i * 0.001)
    assert race.rates == {WORKERS: pytest.approx(1000.0)}


@pytest.mark.usefixtures("lane_open")
@pytest.mark.parametrize(
    "setting",
    [
        {"transform_in": "workers"},  # a crash in the transform stays a worker's
        {"seeding": "batch"},
        {"worker_init_fn": abs},
    ],
)
async def test_settings_that_need_the_worker_keep_every_window_there(
    setting: dict[str, Any],
) -> None:
    async with AsyncDataLoader(
        Paced(N, GAP), batch_size=BATCH, num_workers=2, transform=where, **setting
    ) as loader:
        got: list[Any] = await collect(loader)
    _in_order(got)
    assert os.getpid() not in _pids(got)


@pytest.mark.usefixtures("lane_open")
async def test_thread_workers_keep_every_window() -> None:
    async with AsyncDataLoader(
        Paced(N, GAP),
        batch_size=BATCH,
        num_workers=2,
        transform=where,
        transform_in="auto",
        executor="thread",
    ) as loader:
        got: list[Any] = await collect(loader)
    _in_order(got)
    assert not any(bool(m) for b in got for m in b["main"])


@pytest.mark.usefixtures("lane_open")
async def test_without_workers_the_lane_is_the_main_process() -> None:
    random.seed(3)
    async with AsyncDataLoader(
        Paced(N, GAP), batch_size=BATCH, num_workers=0, transform=where
    ) as loader:
        got: list[Any] = await collect(loader)
    _in_order(got)
    # As torch's main process: no worker info, wherever the window was loaded.
    assert {int(i) for b in got for i in b["id"]} == {-1}
    # Loaded on the loop's thread (not the loading thread) once the first windows were timed.
    assert any(bool(m) for b in got for m in b["main"])


@pytest.mark.parametrize(
    ("dataset", "value", "message"),
    [
        (Paced(4, 0.0), "loop", "transform_in should be 'workers'"),
        (ss.AsyncMap(4), "auto", "applies to async iterable sources"),
        (ss.SyncRange(4), "auto", "applies to async iterable sources"),
    ],
)
def test_transform_in_names_what_it_takes(dataset: Any, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AsyncDataLoader(dataset, batch_size=2, num_workers=2, transform_in=value)  # type: ignore[arg-type]


class PacedFailing(Paced):
    """As :class:`Paced`, but the source itself raises instead of yielding sample ``at``."""

    def __init__(self, n: int, gap: float, at: int) -> None:
        super().__init__(n, gap)
        self.at = at

    async def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        async for sample in super().__aiter__():
            if int(sample) == self.at:
                raise ValueError(f"source broke at {self.at}")
            yield sample


@pytest.mark.usefixtures("lane_open")
async def test_a_source_error_after_a_lane_window_is_raised_in_its_place() -> None:
    async with AsyncDataLoader(
        PacedFailing(N, GAP, 30),
        batch_size=BATCH,
        num_workers=2,
        transform=where,
        transform_in="auto",
    ) as loader:
        it = aiter(loader)
        got: list[Any] = []
        async with asyncio.timeout(30):
            for _ in range(8):
                got.append(await anext(it))
            with pytest.raises(ValueError, match="source broke at 30"):
                await anext(it)
            with pytest.raises(StopAsyncIteration):
                await anext(it)
    assert [int(v) for b in got for v in b["x"].flatten()] == list(range(30))
    assert os.getpid() in _pids(got)


@pytest.mark.usefixtures("lane_open")
async def test_a_swap_that_fails_leaves_the_programs_generators_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_put = _looplane._npstate.put
    calls = 0

    def put(npr: Any, state: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:  # the first swap in: random's and torch's are in already
            raise RuntimeError("swap failed")
        real_put(npr, state)

    monkeypatch.setattr(_looplane._npstate, "put", put)
    # (torch's generator is drawn by the loader itself, for the epoch's base seed, as torch's
    # DataLoader does: only random's and numpy's are the program's alone here.)
    random.seed(3)
    np.random.seed(3)
    expected = random.Random(3).random(), float(np.random.RandomState(3).random())
    loader = AsyncDataLoader(Paced(N, GAP), batch_size=BATCH, num_workers=2, transform=draws)
    with pytest.raises(RuntimeError, match="swap failed"):
        async with loader:
            await asyncio.wait_for(collect(loader), 60)
    assert calls >= 1
    assert (random.random(), float(np.random.random())) == expected


def test_the_lane_is_dear_by_the_median_of_its_last_windows() -> None:
    cheap, dear_sample = (5e-6, 50e-6), (2 * _looplane.MAX_SAMPLE_S, 50e-6)
    stalled = (5e-6, 5 * _looplane.MAX_COLLATE_S)  # a full collection in the middle of one
    dearness = _looplane._Dearness()
    # One stalled window among cheap ones, again and again: never dear.
    assert not any(dearness.add(*w) for w in [cheap, cheap, stalled, cheap, cheap, stalled] * 5)
    # A transform that grew dearer: dear by the second such window of three.
    assert [dearness.add(*dear_sample) for _ in range(2)] == [False, True]
    # Not before three windows were timed, whatever the first cost.
    assert [_looplane._Dearness().add(*stalled) for _ in range(1)] == [False]
    fresh = _looplane._Dearness()
    assert [fresh.add(*stalled) for _ in range(3)] == [False, False, True]


class _StallsOnce:
    """Cheap, but one sample (on the loop) takes 20 ms: a host stall, a full collection."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, sample: torch.Tensor) -> dict[str, Any]:
        if int(sample) == self.at and threading.current_thread() is threading.main_thread():
            time.sleep(0.02)
        return where(sample)


class _GrowsDear:
    """Cheap, then 2 ms a sample on the loop from sample ``at`` on."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, sample: torch.Tensor) -> dict[str, Any]:
        if int(sample) >= self.at and threading.current_thread() is threading.main_thread():
            time.sleep(0.002)
        return where(sample)


async def test_one_stalled_window_keeps_the_lane_and_a_dearer_transform_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Bounds far above what the cheap transform and collation cost even on a busy machine, far
    # below the dear transform's 2 ms a sample.
    monkeypatch.setattr(_looplane, "MAX_SAMPLE_S", 0.001)
    monkeypatch.setattr(_looplane, "MAX_COLLATE_S", 0.01)
    n = 160
    for transform, stays in ((_StallsOnce(60), True), (_GrowsDear(60), False)):
        async with AsyncDataLoader(
            Paced(n, GAP), batch_size=BATCH, num_workers=2, transform=transform
        ) as loader:
            got: list[Any] = await collect(loader)
        assert [int(v) for b in got for v in b["x"].flatten()] == list(range(n))
        pids = _pids(got)
        late = pids[-(n - 100) // BATCH :]  # windows well after sample 60
        on_loop = [pid == os.getpid() for pid in late]
        if stays:
            assert sum(on_loop) >= len(late) // 2, pids
        else:
            assert not any(on_loop), pids
