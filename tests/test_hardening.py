"""Regression tests for the hardening review: one test per defect, named after the behaviour.

Each docstring names the finding it guards (``rNN`` are the review's reproduction scripts). Every
wait is bounded: a hang fails within seconds with a message saying what never happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import gc
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import warnings
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch.utils.data import DataLoader

from aioloader import (
    AsyncDataLoader,
    EpochEndedError,
    LoaderClosedError,
    LoaderTimeoutError,
    WorkerCrashedError,
)
from aioloader._executor import WorkerPool
from tests import datasets
from tests.conftest import collect, torch_batches, worker_processes

_T = TypeVar("_T")

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------- helpers


async def bounded(aw: Awaitable[_T], limit: float, what: str) -> _T:
    """Await ``aw`` for at most ``limit`` seconds; a hang fails the test and says what hung."""
    cm = asyncio.timeout(limit)
    try:
        async with cm:
            return await aw
    except TimeoutError:
        if cm.expired():
            pytest.fail(f"{what}: nothing happened within {limit} s (hang)")
        raise  # a TimeoutError of the loader's own (LoaderTimeoutError)


async def close(loader: AsyncDataLoader[Any], limit: float = 20) -> None:
    await bounded(loader.aclose(), limit, "aclose()")


async def wait_until(pred: Callable[[], bool], limit: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + limit
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(step)
    return True


def loader_threads(before: set[int]) -> list[str]:
    """``aioloader-*`` threads that were not there ``before`` (a set of thread idents)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith("aioloader") and t.ident not in before
    )


def thread_idents() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def new_threads(before: set[int]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.ident not in before)


def indices(batches: list[Any]) -> list[int]:
    return [int(x) for b in batches for x in b.flatten()]


def flat(batches: list[list[int]]) -> list[int]:
    return [x for b in batches for x in b]


def pid_indices(batches: list[Any]) -> list[int]:
    """Indices of PidDataset batches (rows are ``(index, pid)``)."""
    return [int(x) for b in batches for x in b[:, 0]]


@pytest.fixture
def fake_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes torch report a CUDA accelerator so the device stage runs on a CPU machine; batches
    made by ``datasets.pinned_batch_collate`` pin themselves (their own ``pin_memory()``)."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda")
    )


# ------------------------------------------------------------------ 1. nested crash recovery


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _touch(path: str) -> None:
    Path(path).touch()


async def _resubmit_crash_trials(tmp_path: Path, max_restarts: int, trials: int) -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[str] = []
    old_handler = loop.get_exception_handler()
    loop.set_exception_handler(
        lambda _loop, ctx: unhandled.append(f"{ctx.get('message')}: {ctx.get('exception')!r}")
    )
    try:
        for trial in range(trials):
            armed = str(tmp_path / f"armed-{trial}")
            loader = AsyncDataLoader(
                datasets.SlowPidDataset(80, 0.01),
                batch_size=2,
                num_workers=6,
                worker_init_fn=functools.partial(datasets.die_in_init_once, armed),
                max_worker_restarts=max_restarts,
                multiprocessing_context="fork",
                worker_nice=0,
            )
            got: list[int] = []

            async def consume(
                loader: AsyncDataLoader[Any] = loader, armed: str = armed, got: list[int] = got
            ) -> None:
                pids: set[int] = set()
                async for b in loader:
                    got.extend(int(x) for x in b[:, 0])
                    pids.add(int(b[0, 1]))
                    if len(pids) == 6 and not _exists(armed):
                        # Every original worker is past its init: the next worker to start is
                        # a replacement, and it dies in its init.
                        _touch(armed)
                        os.kill(int(b[0, 1]), signal.SIGKILL)

            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # "restarting the workers"
                    if max_restarts > 1:
                        await bounded(consume(), 15, f"trial {trial}: epoch")
                        assert got == list(range(80)), f"trial {trial}"
                    else:
                        with pytest.raises(WorkerCrashedError):
                            await bounded(consume(), 15, f"trial {trial}: epoch")
                        assert got == list(range(len(got))), f"trial {trial}: {got}"
                assert _exists(armed + ".claimed"), "no replacement worker died in init"
            finally:
                await close(loader)
            gc.collect()  # a task whose exception nobody retrieved is reported when it is freed
            await asyncio.sleep(0)
            assert not unhandled, f"trial {trial}: {unhandled}"
    finally:
        loop.set_exception_handler(old_handler)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("max_restarts", [5, 1])
async def test_replacement_worker_dying_while_recovery_resubmits_never_hangs(
    tmp_path: Path, max_restarts: int
) -> None:
    """r15: a worker is killed; in the replacement pool one worker dies in its init (a native
    crash or OOM kill during start-up) while the recovery is still resubmitting. Never a hang:
    every sample arrives once and in order while restarts are left, else WorkerCrashedError after
    a duplicate-free in-order prefix; no task of the loader dies unseen ("Task exception was
    never retrieved").

    The race (the first replacement dies while the last ones are still being forked) is won
    about 5 times in 6 with 6 workers at full priority: several trials."""
    await _resubmit_crash_trials(tmp_path, max_restarts, trials=4 if max_restarts > 1 else 3)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
async def test_replacement_worker_dying_while_recovery_resubmits_soak(tmp_path: Path) -> None:
    """r15, many trials."""
    await _resubmit_crash_trials(tmp_path, 5, trials=30)


# ---------------------------------------------- 2. aclose() / a new epoch wake a waiting consumer


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_aclose_from_another_task_wakes_a_waiting_consumer(
    tmp_path: Path, num_workers: int
) -> None:
    """r19: a consumer waits in ``__anext__``; a shutdown handler calls ``aclose()``. The consumer
    raises LoaderClosedError at once instead of waiting forever."""
    gate = tmp_path / "gate"
    loader = AsyncDataLoader(
        datasets.GatedDataset(40, open_below=2, gate=str(gate)),
        batch_size=2,
        num_workers=num_workers,
    )
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in loader:
            first.set()

    task = asyncio.create_task(consume())
    closing: asyncio.Task[None] | None = None
    try:
        await bounded(first.wait(), 30, "first batch")
        await asyncio.sleep(0.2)  # the consumer now waits for batch 1, which never comes
        assert not task.done()
        t0 = time.monotonic()
        closing = asyncio.create_task(loader.aclose())
        done, _ = await asyncio.wait([task], timeout=3)
        waited = time.monotonic() - t0
        assert task in done, "consumer still waiting in __anext__ 3 s after aclose() began"
        assert not task.cancelled(), "the consumer got a CancelledError nobody sent"
        assert isinstance(task.exception(), LoaderClosedError), repr(task.exception())
        assert waited < 2, waited
    finally:
        gate.touch()  # releases a thread stuck in __getitem__ (num_workers=0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        if closing is not None:
            await bounded(closing, 20, "aclose()")
        await close(loader)


async def test_new_epoch_on_persistent_workers_ends_a_waiting_consumer_with_epoch_ended_error(
    tmp_path: Path,
) -> None:
    """r19b: a consumer waits in ``__anext__`` of a persistent-workers loader; another task
    starts a new ``async for``. The workers are shared, so the first epoch ends, loudly:
    EpochEndedError at once. The second epoch then delivers every sample."""
    gate = tmp_path / "gate"
    loader = AsyncDataLoader(
        datasets.GatedDataset(20, open_below=2, gate=str(gate)),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
    )
    first = asyncio.Event()

    async def consume(tag: str) -> list[int]:
        out: list[int] = []
        async for b in loader:
            out.extend(indices([b]))
            if tag == "first":
                first.set()
        return out

    t1 = asyncio.create_task(consume("first"))
    t2: asyncio.Task[list[int]] | None = None
    try:
        await bounded(first.wait(), 30, "first batch")
        await asyncio.sleep(0.2)  # t1 waits for batch 1, which never comes
        assert not t1.done()
        t2 = asyncio.create_task(consume("second"))
        done, _ = await asyncio.wait([t1], timeout=3)
        assert t1 in done, "first consumer still waiting 3 s after a second epoch started"
        assert not t1.cancelled(), "the first consumer got a CancelledError nobody sent"
        assert isinstance(t1.exception(), EpochEndedError), repr(t1.exception())
        gate.touch()
        assert await bounded(t2, 30, "second epoch") == list(range(20))
    finally:
        gate.touch()
        for t in (t1, t2):
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in (t1, t2) if t is not None), return_exceptions=True)
        await close(loader)


# ------------------------------------------------------------- 3. SystemExit in __getitem__

SYSEXIT_SCRIPT = textwrap.dedent(
    """
    import asyncio
    from aioloader import AsyncDataLoader
    from tests import datasets

    async def main():
        ds = datasets.RaisingDataset(8, bad=3, exc_type=SystemExit)
        async with AsyncDataLoader(ds, batch_size=1, num_workers=2) as loader:
            got = []
            try:
                async with asyncio.timeout(30):
                    async for b in loader:
                        got.append(int(b))
            except RuntimeError as exc:
                print("RuntimeError:", " | ".join(str(exc).splitlines()))
            print("got", got)
        await asyncio.sleep(0)
        print("loop alive")

    asyncio.run(main())
    print("process alive")
    """
)


def test_system_exit_in_getitem_is_a_runtime_error_naming_it() -> None:
    """r08: ``sys.exit()`` inside ``__getitem__`` (an argparse error in a dataset) reaches the
    consumer as a RuntimeError that names SystemExit, as torch's does; it never exits the
    consumer's process or stops its event loop."""
    proc = subprocess.run(
        [sys.executable, "-c", SYSEXIT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    out = proc.stdout
    detail = f"rc={proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, detail
    assert "loop alive" in out and "process alive" in out, detail
    error = [line for line in out.splitlines() if line.startswith("RuntimeError:")]
    assert error and "SystemExit" in error[0], detail
    assert "got [0, 1, 2]" in out, detail


# ------------------------------------------------ 5/6. persistent pools after a failed recovery


@pytest.mark.parametrize(
    ("settle", "pause"),
    [(0.0, 1.5), (0.02, 1.5), (0.1, 1.5), (0.02, 0.0)],
    ids=["left-at-once", "left-mid-recovery", "left-later", "next-epoch-at-once"],
)
async def test_persistent_pool_abandoned_during_recovery_serves_the_next_epochs(
    settle: float, pause: float
) -> None:
    """r01, r10: a persistent worker dies and the epoch is left (``break``) while the loader is
    recovering. Later epochs deliver every sample, and the one kill causes at most one restart
    (later epochs must not "recover" from the pool the abandoned recovery shut down itself)."""
    loader = AsyncDataLoader(
        datasets.SlowPidDataset(40, 0.01),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    killed: list[int] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)

            async def leave_mid_recovery() -> None:
                async for b in loader:
                    killed.append(int(b[0, 1]))
                    os.kill(killed[0], signal.SIGKILL)
                    await asyncio.sleep(settle)  # the loop notices the death: recovery starts
                    break

            await bounded(leave_mid_recovery(), 30, "first batch")
            await asyncio.sleep(pause)  # 0: the next epoch races the abandoned recovery
            for epoch in range(3):
                got = pid_indices(await collect(loader, 30))
                assert got == list(range(40)), f"epoch {epoch} after the abandoned recovery"
    finally:
        await close(loader)
    # One kill is one crash: at most one restart, whichever epoch noticed it. A second one is
    # a later epoch "recovering" from the pool the abandoned recovery shut down itself.
    restarts = [str(w.message) for w in caught if "restarting the workers" in str(w.message)]
    assert len(restarts) <= 1, f"{len(restarts)} restarts after one kill: {restarts}"
    assert loader.stats().worker_restarts <= 1


@pytest.mark.parametrize("how", ["restart-warning-is-an-error", "restarts-used-up"])
async def test_persistent_pool_whose_recovery_failed_serves_the_next_epochs(how: str) -> None:
    """r02: a persistent worker dies and the recovery fails (the restart RuntimeWarning is an
    error here, or no restart is left): that epoch raises WorkerCrashedError, and every later
    epoch delivers every sample instead of re-raising the stale crash."""
    loader = AsyncDataLoader(
        datasets.SlowPidDataset(40, 0.01),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
        max_worker_restarts=0 if how == "restarts-used-up" else 3,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)

            async def kill_once() -> None:
                killed = False
                async for b in loader:
                    if not killed:
                        os.kill(int(b[0, 1]), signal.SIGKILL)
                        killed = True

            with pytest.raises(WorkerCrashedError):
                await bounded(kill_once(), 30, "the epoch with the crash")
            for epoch in range(2):
                got = pid_indices(await collect(loader, 30))
                assert got == list(range(40)), f"epoch {epoch} after the failed recovery"
    finally:
        await close(loader)


# -------------------------------------------------------------- 7. timeout with num_workers=0


async def test_timeout_without_workers_fires_while_getitem_is_stuck(tmp_path: Path) -> None:
    """r06: ``timeout=1``, ``num_workers=0`` and a ``__getitem__`` stuck for a long time:
    LoaderTimeoutError comes after about 1 s, not when the stuck call returns."""
    gate = tmp_path / "gate"
    loader = AsyncDataLoader(
        datasets.GatedDataset(10, open_below=3, gate=str(gate), limit=8),
        batch_size=1,
        num_workers=0,
        timeout=1,
    )
    got: list[int] = []
    error: BaseException | None = None
    took = float("inf")
    t0 = time.monotonic()
    try:

        async def consume() -> None:
            async for b in loader:
                got.append(int(b))

        try:
            await bounded(consume(), 6, "LoaderTimeoutError with timeout=1")
        except LoaderTimeoutError as exc:
            error, took = exc, time.monotonic() - t0
    finally:
        gate.touch()  # the stuck call returns, so its thread can be joined
        await close(loader)
    assert got == [0, 1, 2]
    assert error is not None
    assert 0.9 < took < 5, took


# ---------------------------------------------------------------- 8. reorder bookkeeping memory


@pytest.mark.parametrize(
    ("in_order", "arrival"),
    [(True, "sequential"), (True, "shuffled-window"), (False, "shuffled-window")],
)
async def test_reorder_buffer_state_stays_constant_on_long_epochs(
    in_order: bool, arrival: str
) -> None:
    """r28: an endless stream (pre-training) must not grow the loader's memory per batch. After
    200 k put+get cycles (indices out of order within a window of 8, a few skipped) the reorder
    buffer holds no more than after 20 k."""
    from aioloader._reorder import ReorderBuffer

    rng = random.Random(0)
    window = 8
    buf: ReorderBuffer[int] = ReorderBuffer(in_order)

    async def cycles(start: int, stop: int) -> None:
        for base in range(start, stop, window):
            idxs = list(range(base, base + window))
            if arrival == "shuffled-window":
                rng.shuffle(idxs)
            expect = []
            for i in idxs:
                if i % 1000 == 999:  # an exhausted iterable worker's index
                    buf.skip(i)
                else:
                    buf.put(i, i)
                    expect.append(i)
            out = [await buf.get() for _ in expect]
            assert out == sorted(expect) if in_order else sorted(out) == sorted(expect)

    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        async with asyncio.timeout(120):
            await cycles(0, 20_000)
            gc.collect()
            at_20k = tracemalloc.get_traced_memory()[0]
            await cycles(20_000, 200_000)
            gc.collect()
            at_200k = tracemalloc.get_traced_memory()[0]
    finally:
        if not was_tracing:
            tracemalloc.stop()
    grew = at_200k - at_20k
    assert grew < 64 * 1024, f"reorder state grew by {grew / 1024:.0f} KiB over 180 k batches"


# ------------------------------------------------------------------------- 9. prefetch bound


def test_prefetch_factor_must_be_an_int() -> None:
    """r09: torch accepts ``prefetch_factor=2.5`` until it is iterated; a float made the in-flight
    bound vanish (the whole epoch submitted at once). It is a ValueError naming the argument."""
    for bad in (2.5, 2.0):
        with pytest.raises(ValueError, match="prefetch_factor"):
            AsyncDataLoader(datasets.RangeDataset(8), num_workers=2, prefetch_factor=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("prefetch_factor", [1, 3])
async def test_batches_in_flight_never_exceed_prefetch_factor_times_workers(
    prefetch_factor: int,
) -> None:
    """r09: with a slow consumer the workers run ahead by at most ``prefetch_factor *
    num_workers`` batches (``stats().batches_in_flight``)."""
    bound = prefetch_factor * 2
    most = 0
    async with AsyncDataLoader(
        datasets.RangeDataset(400), batch_size=2, num_workers=2, prefetch_factor=prefetch_factor
    ) as loader:

        async def slow_consumer() -> None:
            nonlocal most
            n = 0
            async for _ in loader:
                n += 1
                for _ in range(4):  # the workers run ahead as far as they may
                    most = max(most, loader.stats().batches_in_flight)
                    await asyncio.sleep(0.01)
                if n == 25:
                    break

        await bounded(slow_consumer(), 60, "slow consumer")
    assert 0 < most <= bound, f"{most} batches in flight, bound {bound}"


# ------------------------------------------------------- 13/14. device stage after fatal errors


async def _outcomes_after_a_fatal_error(pin: bool, how: str, limit: float = 8) -> list[str]:
    """What the consumer sees, call by call, after a worker is killed: "batch" or the type of
    what ``__anext__`` raised, up to the second raise (or "HANG" when nothing comes)."""
    loader = AsyncDataLoader(
        datasets.SlowDataset(60, 0.01),
        batch_size=2,
        num_workers=2,
        pin_memory=pin,
        collate_fn=datasets.pinned_batch_collate,
        multiprocessing_context="fork",
        max_worker_restarts=0 if how == "worker-crash" else 3,
    )
    before = worker_processes()
    out: list[str] = []
    try:
        it = aiter(loader)
        await bounded(anext(it), 30, "first batch")
        os.kill(min(worker_processes() - before), signal.SIGKILL)
        for _ in range(40):
            cm = asyncio.timeout(limit)
            try:
                async with cm:
                    await anext(it)
                out.append("batch")
            except TimeoutError:
                if not cm.expired():
                    raise
                out.append("HANG")
                break
            except (Exception, StopAsyncIteration) as exc:
                out.append(type(exc).__name__)
                if sum(o != "batch" for o in out) == 2:
                    break
    finally:
        await close(loader)
    return out


@pytest.mark.usefixtures("fake_accelerator")
@pytest.mark.parametrize("how", ["worker-crash", "restart-fails"])
async def test_device_stage_raises_after_a_fatal_error_like_the_plain_path(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r11: after a fatal error (a crash with no restart left, or a replacement pool that cannot
    be started: fork fails with ENOMEM), the next ``__anext__`` raises at once with
    ``pin_memory=True`` exactly as without it, instead of waiting forever."""
    from aioloader._executor import WorkerPool

    starts = {"n": 0}
    if how == "restart-fails":
        real_start = WorkerPool.start

        async def failing_start(*args: Any, **kwargs: Any) -> Any:
            starts["n"] += 1
            if starts["n"] > 1:  # every pool after the first: the fork fails
                raise OSError(errno.ENOMEM, "Cannot allocate memory (injected fork failure)")
            return await real_start(*args, **kwargs)

        monkeypatch.setattr(WorkerPool, "start", failing_start)
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "restarting the workers"
        for pin in (False, True):
            starts["n"] = 0
            results[pin] = await _outcomes_after_a_fatal_error(pin, how)
            if how == "restart-fails":
                assert starts["n"] >= 2, "fault injection not reached: update this test"
    plain, staged = results[False], results[True]
    assert "HANG" not in staged, f"pin_memory=True: {staged} (pin_memory=False: {plain})"
    assert [o for o in staged if o != "batch"] == [o for o in plain if o != "batch"], (
        f"pin_memory=True: {staged}; pin_memory=False: {plain}"
    )


def _device_threads(before: set[int]) -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("aioloader-device") and t.ident not in before
    ]


@pytest.mark.usefixtures("fake_accelerator")
@pytest.mark.parametrize("pin", [False, True], ids=["no-stage", "device-stage"])
def test_unclosed_loader_leaves_nothing_once_asyncio_run_returns(pin: bool) -> None:
    """r27: a loader left un-closed when ``asyncio.run`` ends (its cleanup task cancelled at loop
    shutdown) leaves no worker process and, with the device stage on, no device thread."""
    before, threads_before = worker_processes(), thread_idents()

    async def leave_an_epoch() -> None:
        loader = AsyncDataLoader(
            datasets.SlowDataset(200, 0.01),
            batch_size=2,
            num_workers=2,
            pin_memory=pin,
            collate_fn=datasets.pinned_batch_collate,
        )
        async with asyncio.timeout(30):
            async for _ in loader:
                break  # the epoch's cleanup is left to a background task
        # ... and the main coroutine returns without `await loader.aclose()`

    asyncio.run(leave_an_epoch())
    deadline = time.monotonic() + 2
    while (
        worker_processes() - before or _device_threads(threads_before)
    ) and time.monotonic() < deadline:
        time.sleep(0.02)
    left, threads = worker_processes() - before, _device_threads(threads_before)
    for pid in left:  # do not leave them to the rest of the session
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left and not threads, f"after asyncio.run(): workers {left}, threads {threads}"


# --------------------------------------------------------------------- 17. concurrent aclose()


async def test_concurrent_aclose_calls_both_wait_for_every_worker_to_exit() -> None:
    """r24: ``async with`` exit and a signal handler both call ``aclose()``: neither returns
    while a worker process (or a loader thread) is still alive."""
    threads_before = thread_idents()
    before = worker_processes()
    loader = AsyncDataLoader(
        datasets.RangeDataset(20), batch_size=2, num_workers=2, persistent_workers=True
    )
    try:
        assert len(await collect(loader, 30)) == 10
        assert len(worker_processes() - before) >= 2
        first = asyncio.create_task(loader.aclose())
        await asyncio.sleep(0)
        await bounded(loader.aclose(), 20, "second aclose()")
        after_second = (worker_processes() - before, new_threads(threads_before))
        await bounded(first, 20, "first aclose()")
        after_first = (worker_processes() - before, new_threads(threads_before))
    finally:
        await close(loader)
    assert after_second == (set(), []), f"alive when the second aclose() returned: {after_second}"
    assert after_first == (set(), []), f"alive when the first aclose() returned: {after_first}"


# ------------------------------------------------------------------- 18. GC off the event loop


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
async def test_garbage_collecting_unclosed_persistent_loaders_does_not_block_the_loop() -> None:
    """r13: un-closed persistent-workers loaders dropped inside a running loop must not kill and
    join their workers on the loop thread (214 ms stall for one loader with 4 workers); the
    workers still exit soon. Checked by where each pool is killed, not by timing the loop."""
    before = worker_processes()
    loaders = [
        AsyncDataLoader(
            datasets.RangeDataset(40), batch_size=2, num_workers=4, persistent_workers=True
        )
        for _ in range(3)
    ]
    for i in range(3):
        assert len(await collect(loaders[i], 30)) == 20
    assert len(worker_processes() - before) >= 12
    refs = [weakref.ref(x) for x in loaders]
    # Where each pool is killed and joined: never on the loop's thread (a join waits for 4
    # processes to exit). Recorded, not timed: timings on a shared 2-core machine are noise.
    killed_on: list[str] = []
    real_kill = WorkerPool.kill_sync

    def recording_kill(self: WorkerPool) -> None:
        killed_on.append(threading.current_thread().name)
        real_kill(self)

    loop_thread = threading.current_thread().name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # "was not closed"
        try:
            WorkerPool.kill_sync = recording_kill  # type: ignore[method-assign]
            del loaders
            if any(r() is not None for r in refs):  # in a cycle: only the cyclic GC frees it
                gc.collect()
            assert all(r() is None for r in refs), "a loader was not freed: the test holds it"
            gone = await wait_until(lambda: not worker_processes() - before, 10)
        finally:
            WorkerPool.kill_sync = real_kill  # type: ignore[method-assign]
    assert len(killed_on) == 3, killed_on
    assert loop_thread not in killed_on, killed_on
    assert gone, "workers of the collected loaders still alive 5 s later"


# ------------------------------------------------------ 19. cancellation during start-up


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
@pytest.mark.parametrize("slow", ["pickle", "unpickle"])
async def test_cancelling_the_consumer_during_start_up_takes_effect_at_once(
    start_method: str, slow: str
) -> None:
    """r23: cancelling a consumer whose first ``__anext__`` is still starting the workers ends it
    within 0.3 s, not when the pool is up. Start-up is made long by a dataset that takes a second
    to pickle (in this process, before any worker starts: a big dataset) or to unpickle (in each
    worker). After ``aclose()`` nothing is left (``no_leaks``)."""
    slow_ds = datasets.SlowPickleDataset if slow == "pickle" else datasets.SlowUnpickleDataset
    ds = slow_ds(100, 1.0)
    loader = AsyncDataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context=start_method)

    async def consume() -> None:
        async for _ in loader:
            break

    task = asyncio.create_task(consume())
    try:
        await asyncio.sleep(0.05)  # start-up is under way
        assert not task.done()
        t0 = time.monotonic()
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=10)
        took = time.monotonic() - t0
        assert task in done, "consumer still running 10 s after it was cancelled"
        assert task.cancelled(), repr(task.exception())
        assert took < 0.3, f"cancellation took effect after {took:.2f} s"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await close(loader, 30)


# -------------------------------------------------- 20. multiprocessing_context set after init


def test_setting_multiprocessing_context_after_construction_behaves_like_torch() -> None:
    """r22: ``loader.multiprocessing_context = "spawn"`` is converted to a context object as on
    torch's DataLoader (it was stored as a string and failed at the first epoch), and invalid
    values raise what torch raises."""

    def outcome(dl: Any, value: object) -> object:
        try:
            dl.multiprocessing_context = value
        except Exception as exc:
            return type(exc)
        return type(dl.multiprocessing_context)

    for num_workers in (0, 1):
        for value in ("spawn", "fork", "forkserver", "bogus", 5, None):
            ref = DataLoader(datasets.RangeDataset(4), batch_size=2, num_workers=num_workers)
            ours = AsyncDataLoader(datasets.RangeDataset(4), batch_size=2, num_workers=num_workers)
            assert outcome(ours, value) == outcome(ref, value), (num_workers, value)


async def test_multiprocessing_context_set_after_construction_is_used() -> None:
    """r22: the context set after construction starts the workers."""
    loader = AsyncDataLoader(datasets.PidDataset(8), batch_size=2, num_workers=2)
    loader.multiprocessing_context = "fork"
    async with loader:
        got = await collect(loader, 30)
    assert pid_indices(got) == list(range(8))


# --------------------------------------------------- 21. iterator collected on another thread


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_iterator_garbage_collected_on_another_thread_still_releases_everything(
    num_workers: int,
) -> None:
    """r21: an epoch iterator held by a reference cycle is freed by the cyclic GC on whatever
    thread allocates (the executor's thread unpickles every batch). After ``aclose()`` no
    ``aioloader-*`` thread and no worker process is left, and no task of the epoch was destroyed
    while pending: the loop holds tasks weakly, so a collection that found the whole epoch
    unreachable closed its coroutines on that thread (its cleanup never ran; aclose() returned
    with the loading thread still alive, seen under load)."""
    destroyed: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: destroyed.append(str(ctx.get("message"))))
    before, threads_before = worker_processes(), thread_idents()
    loader = AsyncDataLoader(datasets.SlowDataset(100, 0.01), batch_size=2, num_workers=num_workers)
    refs: list[weakref.ref[Any]] = []

    async def step() -> None:
        it = aiter(loader)
        refs.append(weakref.ref(it))
        await anext(it)
        try:
            raise ValueError("boom")
        except ValueError as exc:
            err = exc  # frame -> err -> traceback -> frame: a cycle that holds `it`
        assert err

    gc.disable()
    try:
        await bounded(step(), 30, "first batch")
        assert refs[0]() is not None, "the cycle did not hold the iterator"
        other = threading.Thread(target=gc.collect, name="not-the-loop-thread")
        other.start()
        other.join()
        assert refs[0]() is None, "the GC on the other thread did not free the iterator"
    finally:
        gc.enable()
    await close(loader)
    left = (loader_threads(threads_before), worker_processes() - before)
    assert left == ([], set()), f"left after aclose(): {left}"
    assert destroyed == []


# --------------------------------------------------- 22. interrupted epochs without async with


async def test_cancelled_consumer_of_an_unmanaged_loader_releases_its_workers_at_once() -> None:
    """A notebook interrupt: the consumer task of a loader made without ``async with`` is
    cancelled mid-epoch while the loader and its iterator are still referenced. The workers
    exit within ~2 s, and the interrupted iterator raises EpochEndedError if iterated again."""
    before = worker_processes()
    loader = AsyncDataLoader(datasets.SlowDataset(400, 0.01), batch_size=2, num_workers=2)
    it = aiter(loader)
    seen = asyncio.Event()

    async def consume() -> None:
        async for _ in it:
            seen.set()

    task = asyncio.create_task(consume())
    try:
        await bounded(seen.wait(), 30, "first batch")
        assert worker_processes() - before
        task.cancel()
        await bounded(asyncio.gather(task, return_exceptions=True), 10, "cancelled consumer")
        assert await wait_until(lambda: not worker_processes() - before, 2), (
            "workers still alive 2 s after the consumer was cancelled"
        )
        with pytest.raises(EpochEndedError):
            await bounded(anext(it), 5, "__anext__ of the interrupted epoch")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await close(loader)


async def test_dataset_error_out_of_async_for_with_its_traceback_kept_leaves_no_worker() -> None:
    """A dataset error raised out of ``async for`` while the exception and its traceback stay
    alive (IPython keeps ``sys.last_traceback``): no worker is left behind within ~2 s.
    (A manually held iterator still goes on after an error, like torch:
    test_errors.py::test_iterating_on_after_an_error_continues_the_epoch_like_torch.)"""
    before = worker_processes()
    loader = AsyncDataLoader(datasets.RaisingDataset(400, bad=10), batch_size=2, num_workers=2)

    async def train() -> None:
        async for _ in loader:
            pass

    kept: list[BaseException] = []
    try:
        try:
            await bounded(train(), 30, "epoch up to the bad sample")
        except ValueError as exc:
            kept.append(exc)  # with exc.__traceback__, as sys.last_traceback would
        assert kept, "the dataset error was not raised"
        assert kept[0].__traceback__ is not None
        assert await wait_until(lambda: not worker_processes() - before, 2), (
            "workers still alive 2 s after the error left `async for`"
        )
    finally:
        await close(loader)


# -------------------------------------------------------- 23. two epochs of one loader at once


@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
async def test_nested_epochs_of_a_non_persistent_loader_both_complete(shuffle: bool) -> None:
    """A validation loop inside a training loop over the same (non-persistent) loader: both run
    to completion, each as torch's would; nothing is truncated."""
    n = 24
    ds = datasets.RangeDataset(n)
    gen = torch.Generator().manual_seed(0) if shuffle else None
    outer: list[list[int]] = []
    inner: list[list[int]] = []
    async with AsyncDataLoader(
        ds, batch_size=4, shuffle=shuffle, generator=gen, num_workers=2
    ) as loader:

        async def train() -> None:
            async for b in loader:
                outer.append(b.flatten().tolist())
                if len(outer) == 2:
                    async for v in loader:
                        inner.append(v.flatten().tolist())

        await bounded(train(), 60, "nested epochs")
    _assert_whole_epochs(ds, shuffle, outer, inner)


def _assert_whole_epochs(ds: Any, shuffle: bool, *epochs: list[list[int]]) -> None:
    """Each epoch holds every sample once: torch's batches in order, or (shuffled) as a set."""
    ref = [b.flatten().tolist() for b in torch_batches(ds, batch_size=4)]
    for got in epochs:
        if shuffle:
            assert sorted(flat(got)) == list(range(len(ds))), got
        else:
            assert got == ref, got


@pytest.mark.parametrize("shuffle", [False, True], ids=["sequential", "shuffled"])
async def test_two_tasks_iterating_one_non_persistent_loader_both_complete(shuffle: bool) -> None:
    """Two tasks each run an ``async for`` over the same non-persistent loader at the same time:
    both complete with torch's batches; neither gets a CancelledError nobody sent."""
    n = 24
    ds = datasets.SlowDataset(n, 0.005)
    gen = torch.Generator().manual_seed(0) if shuffle else None

    async def epoch() -> list[list[int]]:
        return [b.flatten().tolist() async for b in loader]

    async with AsyncDataLoader(
        ds, batch_size=4, shuffle=shuffle, generator=gen, num_workers=2
    ) as loader:
        a, b = await bounded(asyncio.gather(epoch(), epoch()), 60, "two concurrent epochs")
    _assert_whole_epochs(ds, shuffle, a, b)


async def test_nested_epoch_on_persistent_workers_ends_the_outer_loop_loudly() -> None:
    """On a persistent-workers loader the workers are shared: an inner ``async for`` ends the
    outer epoch, and the outer loop's next ``__anext__`` raises EpochEndedError (never a silent
    early end). The inner epoch is complete."""
    ds = datasets.RangeDataset(24)
    ref = [b.flatten().tolist() for b in torch_batches(ds, batch_size=4)]
    outer: list[list[int]] = []
    inner: list[list[int]] = []
    async with AsyncDataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True) as loader:

        async def train() -> None:
            async for b in loader:
                outer.append(b.flatten().tolist())
                if len(outer) == 2:
                    inner.extend([v.flatten().tolist() async for v in loader])

        with pytest.raises(EpochEndedError):
            await bounded(train(), 60, "nested epochs")
    assert inner == ref
    assert outer == ref[:2]


# ------------------------------------------------- 24. dataset in an unguarded __main__, spawn

MAIN_SCRIPT = textwrap.dedent(
    """
    import asyncio
    import torch
    from torch.utils.data import Dataset
    from aioloader import AsyncDataLoader

    class Squares(Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.tensor([i * i])

    async def main():
        try:
            async with AsyncDataLoader(Squares(), batch_size=2, num_workers=2,
                                       multiprocessing_context="spawn") as loader:
                async for b in loader:
                    print("batch", b.tolist(), flush=True)
        except Exception as exc:
            if __name__ == "__main__":  # not in a spawned worker re-running this file
                # One flushed write: workers write their own errors to the same pipe meanwhile.
                print("TOP-LEVEL ERROR:", type(exc).__name__, " | ".join(str(exc).splitlines()),
                      flush=True)
            raise

    asyncio.run(main())  # no `if __name__ == "__main__":` guard
    """
)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_dataset_in_an_unguarded_main_module_under_spawn_fails_at_once_with_its_cause(
    tmp_path: Path, method: str
) -> None:
    """New-user finding: a script without ``if __name__ == "__main__":`` under spawn. Each worker
    re-runs the script and fails while starting; that start-up error surfaces at once, with its
    cause, and no worker restart is attempted (no pile of restart warnings)."""
    script = tmp_path / "train.py"
    script.write_text(MAIN_SCRIPT.replace('"spawn"', repr(method)))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        start_new_session=True,  # so a hang's workers can be killed with it
    )
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"still running after 60 s; output:\n{out[-3000:]}")
    took = time.monotonic() - t0
    lines = out.splitlines()
    detail = f"rc={proc.returncode} after {took:.1f} s, {len(lines)} lines:\n{out[-4000:]}"
    assert proc.returncode != 0, detail
    assert "restarting the workers" not in out, detail
    assert len(lines) < 100, detail
    # A worker's unfinished line may precede ours on the shared pipe: search, not startswith.
    top = [line[line.index("TOP-LEVEL ERROR:") :] for line in lines if "TOP-LEVEL ERROR:" in line]
    assert top, detail
    # The cause: the worker's own start-up error (multiprocessing's "bootstrapping phase" advice
    # about the `if __name__ == '__main__':` idiom).
    assert "bootstrapping" in top[0] or "__main__" in top[0], detail
    # ... and what to add, in the error the script's own code catches.
    assert "only under `if __name__ == '__main__':`" in top[0], detail
    assert took < 30, detail


# ------------------------------------------------------------------- 25. plain `for` over it


def test_plain_for_loop_raises_type_error_pointing_to_async_for() -> None:
    """``for batch in loader:`` (torch habit) raises TypeError saying to use ``async for``."""
    loader = AsyncDataLoader(datasets.RangeDataset(4))
    with pytest.raises(TypeError, match="async for"):
        for _ in loader:  # type: ignore[attr-defined]
            pass
    with pytest.raises(TypeError, match="async for"):
        iter(loader)  # type: ignore[call-overload]


# ------------------------------------------------- other: BaseException while rebuilding results


async def test_base_exception_while_rebuilding_a_result_does_not_lose_the_batch() -> None:
    """A BaseException (not an Exception) raised while a result is unpickled in the main process
    escaped the executor's callback: that batch never arrived and the epoch hung. The consumer
    gets the batches before it, then an error at its position that names it."""
    loader = AsyncDataLoader(
        datasets.AbortOnReceiveDataset(8, bad=3), batch_size=None, num_workers=2
    )
    out: list[Any] = []
    try:
        it = aiter(loader)
        for _ in range(4):
            try:
                out.append(int(await bounded(anext(it), 10, f"batch {len(out)}")))
            except (asyncio.CancelledError, pytest.fail.Exception):
                raise
            except BaseException as exc:
                out.append(f"{type(exc).__name__}: {exc}")
                break
    finally:
        await close(loader)
    assert out[:3] == [0, 1, 2], out
    assert len(out) == 4 and "UnpickleAbort" in str(out[3]), out


# ------------------------------------------------------- found by review of the redesign itself


class _StopAsyncInGetitem(datasets.RangeDataset):
    def __getitem__(self, i: int) -> Any:
        if i == 3:
            raise StopAsyncIteration("from the dataset")
        return super().__getitem__(i)


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_anext_of_a_fresh_iterator_returns_the_first_batch_like_next_iter(
    num_workers: int,
) -> None:
    """torch's `next(iter(loader))`: the iterator is a temporary that nothing else holds."""
    ds = datasets.RangeDataset(10)
    want = next(iter(DataLoader(ds, batch_size=2)))
    async with AsyncDataLoader(ds, batch_size=2, num_workers=num_workers) as loader:
        got = await bounded(anext(aiter(loader)), 30, "first batch")
        assert torch.equal(got, want)
        task = asyncio.create_task(anext(aiter(loader)))  # the same, scheduled as a task
        assert torch.equal(await bounded(task, 30, "first batch, as a task"), want)


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_iterator_aclose_from_another_task_wakes_its_waiting_consumer(
    tmp_path: Path, num_workers: int
) -> None:
    gate = tmp_path / "gate"
    loader = AsyncDataLoader(
        datasets.GatedDataset(40, open_below=2, gate=str(gate)),
        batch_size=2,
        num_workers=num_workers,
    )
    closing: asyncio.Task[None] | None = None
    try:
        it = aiter(loader)
        await bounded(anext(it), 30, "first batch")
        waiter = asyncio.create_task(anext(it))  # batch 1 never comes
        await asyncio.sleep(0.2)
        assert not waiter.done()
        closing = asyncio.create_task(it.aclose())  # with num_workers=0 it waits for the thread
        done, _ = await asyncio.wait([waiter], timeout=3)
        assert waiter in done, "the waiting consumer was never woken"
        assert isinstance(waiter.exception(), StopAsyncIteration), repr(waiter.exception())
    finally:
        gate.touch()  # releases a thread stuck in __getitem__ (num_workers=0)
        if closing is not None:
            await bounded(closing, 20, "iterator aclose()")
        await close(loader)


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_stop_async_iteration_from_getitem_is_an_error_not_the_end(
    num_workers: int,
) -> None:
    async with AsyncDataLoader(
        _StopAsyncInGetitem(8), batch_size=2, num_workers=num_workers
    ) as loader:
        with pytest.raises(RuntimeError, match="StopAsyncIteration"):
            await collect(loader, 30)
