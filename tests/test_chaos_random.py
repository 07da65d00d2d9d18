"""Randomized chaos: workers SIGKILLed at random (also while starting and while being replaced),
consumers cancelled, ``break``, ``aclose()`` from another task; every start method, ``in_order``
both ways, persistent workers or not.

After each trial: every sample was delivered exactly once (in order when ``in_order=True``), or
the epoch ended with a documented outcome and what was delivered is a duplicate-free prefix (in
order) or subset; no hang (each trial is bounded); no process, thread or task left behind.

Each trial is drawn from its seed; a failure names it, and
``AIOLOADER_CHAOS_REPLAY=<method>,<in_order>,<persistent>,<seed> pytest tests/test_chaos_random.py
-k replay`` runs that trial again (timing differs from run to run; the plan does not). The soak
(``-m slow``) runs trials for ``AIOLOADER_SOAK_S`` seconds (default 600) and reports counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import random
import signal
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from aioloader import (
    AsyncDataLoader,
    EpochEndedError,
    LoaderClosedError,
    WorkerCrashedError,
)
from tests import datasets
from tests.conftest import START_METHODS, worker_processes

TRIAL_LIMIT_S = 30.0
SOAK_S = float(os.environ.get("AIOLOADER_SOAK_S", "600"))

#: The loader's documented ways for an epoch to end early, and when each is allowed.
ENDINGS = ("complete", "break", "cancel", "aclose")


@dataclass
class EpochPlan:
    ending: str  # one of ENDINGS
    at_batch: int  # break / cancel / aclose after this many batches (0: during start-up)
    at_delay: float  # ... or, at batch 0, after this many seconds
    kills: list[tuple[str, float]]  # ("startup", 0) | ("at", t) | ("replacement", 0)
    consumer_delay: float


@dataclass
class Plan:
    seed: int
    start_method: str
    in_order: bool
    persistent: bool
    n: int
    batch_size: int
    num_workers: int
    prefetch_factor: int
    delay: float
    epochs: list[EpochPlan]

    def replay(self) -> str:
        return (
            f"AIOLOADER_CHAOS_REPLAY={self.start_method},{int(self.in_order)},"
            f"{int(self.persistent)},{self.seed}"
        )


@dataclass
class Report:
    trials: int = 0
    epochs: int = 0
    kills: int = 0
    restarts: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)

    def add(self, other: Report) -> None:
        self.trials += other.trials
        self.epochs += other.epochs
        self.kills += other.kills
        self.restarts += other.restarts
        self.outcomes.update(other.outcomes)


def make_plan(seed: int, start_method: str, in_order: bool, persistent: bool) -> Plan:
    rng = random.Random(seed)
    n = rng.choice([24, 48, 90])
    batch_size = rng.choice([1, 2, 3])
    num_workers = rng.choice([1, 2, 2, 3])
    delay = rng.choice([0.002, 0.005, 0.01])
    batches = math.ceil(n / batch_size)
    slow_start = start_method != "fork"
    # Timed kills land while the epoch runs: from its start to about its end.
    window = n * delay / num_workers + (1.5 if start_method == "spawn" else 0.1)
    max_kills = 2 if start_method == "spawn" else 3  # spawn restarts cost seconds each
    epochs = []
    for e in range(rng.choice([2, 3]) if persistent else rng.choice([1, 2])):
        ending = rng.choices(ENDINGS, weights=[5, 2, 2, 1])[0]
        kills: list[tuple[str, float]] = []
        if rng.random() < (0.4 if e == 0 or not persistent else 0.1):
            kills.append(("startup", 0.0))  # a worker killed as soon as it exists
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            if len(kills) >= max_kills:
                break
            kills.append(("at", rng.uniform(0.0, window)))
            if rng.random() < 0.3 and len(kills) < max_kills:
                kills.append(("replacement", 0.0))  # a replacement killed while it starts
        epochs.append(
            EpochPlan(
                ending=ending,
                at_batch=rng.randrange(batches),
                at_delay=rng.uniform(0.0, 0.5 if slow_start else 0.1),
                kills=kills,
                consumer_delay=rng.choice([0.0, 0.0, 0.001, 0.01]),
            )
        )
        if ending == "aclose":
            break  # nothing can follow aclose()
    return Plan(
        seed=seed,
        start_method=start_method,
        in_order=in_order,
        persistent=persistent,
        n=n,
        batch_size=batch_size,
        num_workers=num_workers,
        prefetch_factor=rng.choice([1, 2, 3]),
        delay=delay,
        epochs=epochs,
    )


class Killer:
    """SIGKILLs this process's worker processes (children of the fork server included)."""

    def __init__(self, rng: random.Random, baseline: set[int]) -> None:
        self.rng = rng
        self.baseline = baseline
        self.seen: set[int] = set()
        self.killed: set[int] = set()
        self.kills = 0

    def workers(self) -> set[int]:
        """Live worker processes (a killed one can linger a moment as a zombie)."""
        return worker_processes() - self.baseline - self.killed

    def kill(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.killed.add(pid)
        self.kills += 1

    async def run(self, kills: list[tuple[str, float]]) -> None:
        t0 = time.monotonic()
        self.seen |= self.workers()
        for kind, at in kills:
            if kind == "at":
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                pids = sorted(self.workers())
                if pids:
                    self.kill(self.rng.choice(pids))
                self.seen |= set(pids)
                continue
            # "startup" / "replacement": the first worker that was not there before, at once.
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                new = sorted(self.workers() - self.seen)
                if new:
                    self.kill(new[0])
                    self.seen |= set(new)
                    break
                await asyncio.sleep(0.002)


def _flat(batch: Any) -> list[int]:
    return [int(x) for x in batch.flatten()]


async def run_epoch(
    loader: AsyncDataLoader[Any], plan: Plan, ep: EpochPlan, killer: Killer, crashed_before: bool
) -> tuple[str, list[int]]:
    """Run one epoch as planned; return (outcome, delivered indices) after checking them."""
    delivered: list[int] = []
    count = 0

    async def consume() -> str:
        nonlocal count
        async for b in loader:
            delivered.extend(_flat(b))
            count += 1
            if ep.ending == "break" and count >= max(1, ep.at_batch):
                break  # the documented way to leave an epoch early
            if ep.consumer_delay:
                await asyncio.sleep(ep.consumer_delay)
        else:
            return "complete"
        return "break"

    kills_before = killer.kills
    task = asyncio.create_task(consume())
    kill_task = asyncio.create_task(killer.run(ep.kills))
    we_cancelled = False
    closing: asyncio.Task[None] | None = None
    try:
        if ep.ending in ("cancel", "aclose"):
            # Wait for the planned moment (or for the consumer to finish first).
            if ep.at_batch == 0:
                await asyncio.wait([task], timeout=ep.at_delay)
            else:
                while count < ep.at_batch and not task.done():
                    await asyncio.wait([task], timeout=0.002)
            if not task.done():
                if ep.ending == "cancel":
                    task.cancel()
                    we_cancelled = True
                else:
                    closing = asyncio.create_task(loader.aclose())
        await asyncio.wait([task])
        if closing is not None:
            await closing
    finally:
        kill_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await kill_task
        if not task.done():  # a hang: the trial's bound expired
            task.cancel()
            await asyncio.wait([task], timeout=10)

    if task.cancelled():
        assert we_cancelled, "the consumer got a CancelledError nobody sent"
        outcome = "cancelled"
    elif task.exception() is not None:
        exc = task.exception()
        assert exc is not None
        outcome = type(exc).__name__
        killed = crashed_before or killer.kills > kills_before
        allowed: tuple[type[BaseException], ...] = ()
        if killed:
            allowed += (WorkerCrashedError,)  # restarts ran out / the same batch killed twice
        if ep.ending == "aclose":
            allowed += (LoaderClosedError, EpochEndedError)
        if ep.ending == "cancel":
            allowed += (EpochEndedError,)
        if not isinstance(exc, allowed):
            raise AssertionError(f"epoch ended with {exc!r}, not a documented outcome") from exc
    else:
        outcome = task.result()

    # What was delivered: exactly once; in order; everything, unless the epoch ended early.
    assert len(delivered) == len(set(delivered)), f"duplicates ({outcome}): {delivered}"
    if plan.in_order:
        assert delivered == list(range(len(delivered))), f"out of order ({outcome}): {delivered}"
    else:
        assert set(delivered) <= set(range(plan.n)), f"unknown samples: {delivered}"
    if outcome == "complete":
        assert sorted(delivered) == list(range(plan.n)), (
            f"complete but missing samples: {delivered}"
        )
    return outcome, delivered


async def run_trial(plan: Plan) -> Report:
    """One loader through its planned epochs; raises AssertionError naming the seed."""
    report = Report(trials=1)
    baseline = worker_processes()
    threads_before = {t.ident for t in threading.enumerate()}
    killer = Killer(random.Random(plan.seed ^ 0x5EED), baseline)
    loop = asyncio.get_running_loop()
    unhandled: list[str] = []
    old_handler = loop.get_exception_handler()
    loop.set_exception_handler(
        lambda _loop, ctx: unhandled.append(f"{ctx.get('message')}: {ctx.get('exception')!r}")
    )
    loader = AsyncDataLoader(
        datasets.SlowDataset(plan.n, plan.delay),
        batch_size=plan.batch_size,
        num_workers=plan.num_workers,
        prefetch_factor=plan.prefetch_factor,
        persistent_workers=plan.persistent,
        in_order=plan.in_order,
        multiprocessing_context=plan.start_method,
        max_worker_restarts=10,
    )
    where = "start"
    closed = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "restarting the workers"
            warnings.simplefilter("ignore", ResourceWarning)
            cm = asyncio.timeout(TRIAL_LIMIT_S)
            try:
                async with cm:
                    for i, ep in enumerate(plan.epochs):
                        where = f"epoch {i} ({ep.ending})"
                        outcome, _ = await run_epoch(loader, plan, ep, killer, killer.kills > 0)
                        report.epochs += 1
                        report.outcomes[outcome] += 1
                    where = "aclose()"
                    await loader.aclose()
                    closed = True
            except TimeoutError:
                if cm.expired():
                    raise AssertionError(
                        f"hang: {where} not done after {TRIAL_LIMIT_S} s"
                    ) from None
                raise
        restarts = loader.stats().worker_restarts
        report.kills, report.restarts = killer.kills, restarts
        assert restarts <= killer.kills, f"{restarts} restarts after {killer.kills} kills"
        deadline = time.monotonic() + 5
        while True:
            procs = worker_processes() - baseline
            threads = [
                t.name
                for t in threading.enumerate()
                if t.ident not in threads_before and t.name.startswith("aioloader")
            ]
            if not procs and not threads:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"left after aclose(): workers {procs}, threads {threads}")
            await asyncio.sleep(0.05)
        gc.collect()  # a task whose exception nobody retrieved is reported when it is freed
        await asyncio.sleep(0)
        assert not unhandled, f"unhandled in the loop: {unhandled}"
    except AssertionError as exc:
        raise AssertionError(
            f"chaos trial failed: {exc}\n  plan: {plan}\n  {plan.replay()}"
        ) from exc
    finally:
        loop.set_exception_handler(old_handler)
        if not closed:  # a failed trial: do not leave workers around
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(20):
                    await loader.aclose()
        for pid in worker_processes() - baseline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    return report


#: The default run: a handful of trials over the interesting corners (well under a minute).
SHORT_TRIALS = [
    ("fork", True, False, 113),  # kills at start-up, mid-epoch and of a replacement; break
    ("fork", True, False, 108),  # consumer cancelled, workers killed at start-up
    ("fork", False, True, 104),  # persistent; aclose() from another task in the last epoch
    ("fork", True, True, 110),  # persistent: cancel, complete, break
    ("forkserver", False, False, 116),  # cancelled around kills of a worker and its replacement
    ("forkserver", True, True, 102),  # persistent: three kills, then a start-up kill
    ("spawn", True, False, 127),  # a start-up kill and a mid-epoch kill
]


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize(
    ("start_method", "in_order", "persistent", "seed"),
    SHORT_TRIALS,
    ids=[
        f"{m}-{'ordered' if o else 'unordered'}-{'persistent' if p else 'fresh'}-{s}"
        for m, o, p, s in SHORT_TRIALS
    ],
)
async def test_chaos_trial(start_method: str, in_order: bool, persistent: bool, seed: int) -> None:
    await run_trial(make_plan(seed, start_method, in_order, persistent))


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.skipif("AIOLOADER_CHAOS_REPLAY" not in os.environ, reason="replays a failed trial")
async def test_chaos_replay() -> None:
    method, in_order, persistent, seed = os.environ["AIOLOADER_CHAOS_REPLAY"].split(",")
    await run_trial(make_plan(int(seed), method, in_order == "1", persistent == "1"))


@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 300)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
async def test_chaos_soak(capsys: pytest.CaptureFixture[str]) -> None:
    """Trials for ``AIOLOADER_SOAK_S`` seconds over every start method, order and persistence;
    ``AIOLOADER_SOAK_SEED`` picks the first seed (default: drawn, and printed)."""
    base = int(os.environ.get("AIOLOADER_SOAK_SEED", random.randrange(1 << 30)))
    combos = [(m, o, p) for m in START_METHODS for o in (True, False) for p in (False, True)]
    per_combo: dict[tuple[str, bool, bool], Report] = {c: Report() for c in combos}
    deadline = time.monotonic() + SOAK_S
    failures: list[str] = []
    i = 0
    try:
        while time.monotonic() < deadline and len(failures) < 5:
            combo = combos[i % len(combos)]
            try:
                per_combo[combo].add(await run_trial(make_plan(base + i, *combo)))
            except AssertionError as exc:
                failures.append(str(exc))
            i += 1
    finally:
        total = Report()
        for r in per_combo.values():
            total.add(r)
        with capsys.disabled():
            print(f"\nchaos soak: seeds {base}..{base + i - 1}, {SOAK_S:.0f} s")
            for (m, o, p), r in per_combo.items():
                print(
                    f"  {m:10s} in_order={o!s:5s} persistent={p!s:5s}: {r.trials:4d} trials "
                    f"{r.epochs:4d} epochs {r.kills:4d} kills {r.restarts:4d} restarts "
                    f"{dict(r.outcomes)}"
                )
            print(
                f"  total: {total.trials} trials passed, {len(failures)} failed; {total.epochs} "
                f"epochs, {total.kills} kills, {total.restarts} restarts, {dict(total.outcomes)}"
            )
    assert not failures, "\n\n".join(failures)
    assert total.trials > 0
