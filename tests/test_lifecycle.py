"""Epochs, persistent workers, break/cancel/exception cleanup, and a responsive event loop.

The autouse ``no_leaks`` fixture (conftest.py) fails any test here that leaves a process, thread,
fd or shared-memory file behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from typing import Any

import psutil
import pytest

from aioloader import AsyncDataLoader, EpochEndedError
from tests import datasets
from tests.conftest import collect, worker_processes

_worker_pids = worker_processes


@pytest.mark.loops
async def test_each_async_for_is_one_epoch_and_workers_stop_between_epochs() -> None:
    async with AsyncDataLoader(datasets.PidDataset(10), batch_size=5, num_workers=2) as loader:
        first = await collect(loader)
        assert not _worker_pids()  # non-persistent: workers end with the epoch, as in torch
        second = await collect(loader)
    assert [b[:, 0].tolist() for b in first] == [b[:, 0].tolist() for b in second]
    pids1 = {int(p) for b in first for p in b[:, 1]}
    pids2 = {int(p) for b in second for p in b[:, 1]}
    assert pids1.isdisjoint(pids2)


async def test_persistent_workers_are_reused_and_released_at_aclose(start_method: str) -> None:
    loader = AsyncDataLoader(
        datasets.PidDataset(12),
        batch_size=3,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=start_method,
    )
    async with loader:
        epochs = [await collect(loader) for _ in range(3)]
        alive = _worker_pids()
        assert len(alive) >= 2
        t0 = time.perf_counter()
        async with asyncio.timeout(30):
            async for _ in loader:
                break
        # epoch-2 start with warm workers needs no process start.
        assert time.perf_counter() - t0 < 5
    pids = [{int(p) for b in e for p in b[:, 1]} for e in epochs]
    assert pids[0] | pids[1] | pids[2] <= alive
    assert not _worker_pids()


@pytest.mark.loops
@pytest.mark.parametrize("persistent", [False, True])
async def test_break_ends_the_epoch_and_frees_workers(persistent: bool) -> None:
    async with AsyncDataLoader(
        datasets.SlowDataset(200, 0.005),
        batch_size=2,
        num_workers=2,
        persistent_workers=persistent,
    ) as loader:
        async with asyncio.timeout(30):
            async for i, _ in _aenumerate(loader):
                if i == 3:
                    break
            await asyncio.sleep(0)  # the abandoned epoch's cleanup task runs
            got = await collect(loader)  # a full new epoch, from the start
    assert [int(x) for b in got for x in b.flatten()] == list(range(200))


@pytest.mark.loops
async def test_exception_in_loop_body_cleans_up() -> None:
    loader = AsyncDataLoader(datasets.SlowDataset(100, 0.005), batch_size=2, num_workers=2)
    with pytest.raises(ZeroDivisionError):
        async with loader:
            async with asyncio.timeout(30):
                async for _ in loader:
                    1 / 0  # noqa: B018


@pytest.mark.loops
@pytest.mark.parametrize("where", ["before-first-batch", "mid-epoch", "during-start"])
async def test_cancelling_the_consumer_cleans_up(where: str) -> None:
    loader = AsyncDataLoader(
        datasets.SlowDataset(100, 0.05 if where == "before-first-batch" else 0.005),
        batch_size=2,
        num_workers=2,
        multiprocessing_context="spawn" if where == "during-start" else "fork",
    )
    seen = asyncio.Event()

    async def consume() -> None:
        async for _ in loader:
            seen.set()

    async with loader:
        task = asyncio.create_task(consume())
        async with asyncio.timeout(30):
            if where == "mid-epoch":
                await seen.wait()
            else:
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


@pytest.mark.loops
async def test_timeout_around_the_loop_cleans_up() -> None:
    async with AsyncDataLoader(datasets.SlowDataset(100, 0.01), num_workers=2) as loader:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                async for _ in loader:
                    pass


@pytest.mark.loops
async def test_aclose_during_iteration_from_another_task() -> None:
    loader = AsyncDataLoader(datasets.SlowDataset(100, 0.01), batch_size=2, num_workers=2)
    it = aiter(loader)
    async with asyncio.timeout(30):
        await anext(it)
        await loader.aclose()
        await loader.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await anext(it)


@pytest.mark.loops
async def test_a_second_epoch_runs_beside_an_unfinished_one_without_persistent_workers() -> None:
    # torch without persistent workers: two iterators are independent, each with its workers.
    async with AsyncDataLoader(datasets.RangeDataset(20), batch_size=4, num_workers=2) as loader:
        it1 = aiter(loader)
        async with asyncio.timeout(30):
            assert (await anext(it1)).flatten().tolist() == [0, 1, 2, 3]
            got = await collect(loader)
            assert [b.flatten().tolist() for b in got] == [
                list(range(i, i + 4)) for i in range(0, 20, 4)
            ]
            rest = [b.flatten().tolist() async for b in it1]
    assert rest == [list(range(i, i + 4)) for i in range(4, 20, 4)]


@pytest.mark.loops
async def test_a_new_epoch_ends_an_unfinished_one_loudly_with_persistent_workers() -> None:
    async with AsyncDataLoader(
        datasets.RangeDataset(20), batch_size=4, num_workers=2, persistent_workers=True
    ) as loader:
        it1 = aiter(loader)
        async with asyncio.timeout(30):
            assert (await anext(it1)).flatten().tolist() == [0, 1, 2, 3]
            got = await collect(loader)
            assert len(got) == 5
            with pytest.raises(EpochEndedError, match="persistent_workers=True"):
                await anext(it1)
            with pytest.raises(EpochEndedError):  # and again: never a silent end
                await anext(it1)


async def test_event_loop_stays_responsive_while_a_slow_dataset_loads() -> None:
    """A blocking __getitem__ (0.2 s) must not stall a 5 ms ticker on the same loop."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    for num_workers in (0, 2):
        gaps.clear()
        stop.clear()
        tick = asyncio.create_task(ticker())
        async with AsyncDataLoader(
            datasets.SlowDataset(6, 0.2), batch_size=2, num_workers=num_workers
        ) as loader:
            assert len(await collect(loader)) == 3
        stop.set()
        await tick
        # torch's next() would block the loop for a whole batch (0.4 s) each time.
        assert max(gaps) < 0.15, (num_workers, max(gaps))


async def test_many_loaders_and_epochs_do_not_accumulate_resources() -> None:
    proc = psutil.Process()
    fds0 = proc.num_fds()
    threads0 = proc.num_threads()
    for i in range(30):
        async with AsyncDataLoader(
            datasets.BigDataset(8, (1, 256, 256)), batch_size=4, num_workers=2
        ) as loader:
            for _ in range(2):
                async for batch in loader:
                    assert batch.shape == (4, 1, 256, 256)
                    if i % 3 == 0:
                        break  # abandoned epochs too
                del batch  # a batch in shared memory holds an fd while it lives
    # Dropped batches release their shared memory when collected; give that a moment.
    async with asyncio.timeout(10):
        while proc.num_fds() > fds0 or proc.num_threads() > threads0 or _worker_pids():
            gc.collect()
            await asyncio.sleep(0.05)


PARENT = textwrap.dedent(
    """
    import asyncio, os, sys
    from aioloader import AsyncDataLoader
    from tests import datasets

    async def main():
        async with AsyncDataLoader(datasets.SlowDataset(10_000, 0.01), num_workers=2,
                                   multiprocessing_context=sys.argv[1]) as loader:
            async for _ in loader:
                print("ready", flush=True)
                await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_workers_exit_when_the_main_process_is_killed(method: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, method], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "ready"
        # Every descendant: the workers (and, for forkserver, the fork server they hang off).
        workers = psutil.Process(parent.pid).children(recursive=True)
        assert len(workers) >= 2
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers outlived their parent: {alive}"
        # The dataset payload travelled in an unnamed file: no name was left in /dev/shm.
        if os.path.isdir("/dev/shm"):
            assert not [f for f in os.listdir("/dev/shm") if f"aioloader-{parent.pid}-" in f]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()


async def _aenumerate(it: Any) -> Any:
    i = 0
    async for x in it:
        yield i, x
        i += 1


async def test_aclose_does_not_wait_for_an_abandoned_epochs_slow_batches() -> None:
    loader = AsyncDataLoader(
        datasets.SlowDataset(40, 2.0), num_workers=2, persistent_workers=True, timeout=30
    )
    async with loader:
        async with asyncio.timeout(30):
            async for _ in loader:
                t0 = time.perf_counter()
                break  # the workers are still loading 2 s batches
    # Closing killed the busy workers instead of waiting for their batches.
    assert time.perf_counter() - t0 < 1.5
    assert not _worker_pids()


async def test_an_interrupt_shows_the_callers_frames_not_the_loaders() -> None:
    """A notebook interrupt (a cancellation) raised out of `async for`: its traceback is the
    caller's, not where the loader was waiting inside (the loader's own frames)."""
    caught: list[list[str]] = []

    async def consume(loader: AsyncDataLoader[Any]) -> None:
        try:
            async for _ in loader:
                pass
        except asyncio.CancelledError as exc:
            caught.append([f.filename for f in traceback.extract_tb(exc.__traceback__)])
            raise

    async with (
        AsyncDataLoader(datasets.SlowDataset(4, delay=5), batch_size=1, num_workers=1) as loader,
        asyncio.timeout(60),
    ):
        task = asyncio.ensure_future(consume(loader))
        await asyncio.sleep(0.5)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert caught == [[__file__]]


@pytest.mark.parametrize("started", [False, True])
async def test_asking_a_failed_epoch_again_raises_its_failure_not_a_restart(
    started: bool,
) -> None:
    """An epoch that failed (before its start, or after its cleanup dropped its tasks) is never
    started again by the next ``__anext__``: the consumer reads the failure."""
    async with AsyncDataLoader(datasets.RangeDataset(8), batch_size=2, num_workers=1) as loader:
        it = aiter(loader)
        epoch = it._epoch  # type: ignore[attr-defined]
        if started:
            assert int((await asyncio.wait_for(anext(it), 60))[0]) == 0
        epoch.fail(ValueError("the epoch's own failure"))
        await asyncio.wait_for(epoch.wait_cleanup(), 60)
        with pytest.raises(ValueError, match="the epoch's own failure"):
            await asyncio.wait_for(anext(it), 60)
        with pytest.raises(StopAsyncIteration):  # as after any fatal error: the epoch is over
            await asyncio.wait_for(anext(it), 60)
