"""Workers die at random during long epochs: every sample still arrives exactly once, in order.

The default run keeps these short; ``python -m pytest -m slow`` adds the long leak soak.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing.forkserver
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import pytest

from aioloader import AsyncDataLoader, WorkerCrashedError, _executor
from tests import datasets
from tests.conftest import START_METHODS, collect, worker_processes


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_random_sigkills_lose_and_repeat_nothing(start_method: str) -> None:
    rng = random.Random(1234)
    n = 240
    ds = datasets.PidDataset(n)
    kills = 0
    got: list[int] = []
    async with AsyncDataLoader(
        ds,
        batch_size=4,
        num_workers=2,
        multiprocessing_context=start_method,
        max_worker_restarts=10,
    ) as loader:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            async with asyncio.timeout(90):
                async for batch in loader:
                    got.extend(int(i) for i in batch[:, 0])
                    if kills < 3 and rng.random() < 0.08:
                        try:  # the worker may be gone already (replaced after an earlier kill)
                            os.kill(int(batch[rng.randrange(len(batch)), 1]), signal.SIGKILL)
                            kills += 1
                        except ProcessLookupError:
                            pass
        restarts = loader.stats().worker_restarts
    assert got == list(range(n))
    # A kill can land on a worker that is already being replaced: at most one restart per kill.
    assert 1 <= restarts <= kills
    assert sum("restarting the workers" in str(w.message) for w in caught) == restarts


async def test_deaths_inside_getitem_are_retried_once_each(tmp_path: Path) -> None:
    bad = [7, 40, 90]  # three different batches: each batch kills its worker once
    ds = datasets.ExitOnceAtDataset(120, bad, str(tmp_path))
    async with AsyncDataLoader(ds, batch_size=3, num_workers=2, max_worker_restarts=10) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = [int(i) for b in await collect(loader, limit=90) for i in b]
        assert got == list(range(120))
        assert loader.stats().worker_restarts == len({i // 3 for i in bad})


async def test_restarts_exhausted_then_a_fresh_epoch_works(tmp_path: Path) -> None:
    ds = datasets.ExitOnceAtDataset(60, [10, 30], str(tmp_path))
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2, max_worker_restarts=1) as loader:
        with (
            pytest.warns(RuntimeWarning, match="restarting"),
            pytest.raises(WorkerCrashedError, match="max_worker_restarts=1"),
        ):
            await collect(loader, limit=60)
        # Each bad index kills its worker only once: the next epoch runs clean.
        got = [int(i) for b in await collect(loader, limit=60) for i in b]
    assert got == list(range(60))


async def test_cancelled_aclose_is_finished_by_the_next() -> None:
    loader = AsyncDataLoader(datasets.SlowDataset(200, 0.01), batch_size=2, num_workers=2)
    it = aiter(loader)
    async with asyncio.timeout(30):
        await anext(it)
        closing = asyncio.create_task(loader.aclose())
        await asyncio.sleep(0)
        closing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        await loader.aclose()
    assert not worker_processes()


SIGINT_SCRIPT = textwrap.dedent(
    """
    import asyncio, faulthandler, signal, sys
    from aioloader import AsyncDataLoader
    from tests import datasets

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view into a hang

    async def main():
        async with AsyncDataLoader(datasets.SlowDataset(10_000, 0.01), batch_size=2,
                                   num_workers=2) as loader:
            async for _ in loader:
                print("ready", flush=True)
                await asyncio.sleep(0.05)

    asyncio.run(main())
    """
)


def test_keyboard_interrupt_shuts_everything_down() -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGINT_SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], 60)  # start-up on a loaded machine
        assert readable, "the script printed nothing in 60 s"
        assert proc.stdout.readline().strip() == "ready"
        descendants = psutil.Process(proc.pid).children(recursive=True)
        assert len(descendants) >= 2
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # every thread's stack, to stderr
            time.sleep(1)
            proc.kill()
            _, err = proc.communicate()
            pytest.fail(f"the script did not exit within 30 s of SIGINT; its threads:\n{err}")
        assert time.monotonic() - t0 < 15
        assert "KeyboardInterrupt" in err
        _, alive = psutil.wait_procs(descendants, timeout=10)
        assert not alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
async def test_hundreds_of_loaders_leave_nothing_behind() -> None:
    proc = psutil.Process()
    fds0, threads0 = proc.num_fds(), proc.num_threads()
    for i in range(300):
        async with AsyncDataLoader(
            datasets.BigDataset(12, (1, 256, 256)),
            batch_size=3,
            num_workers=2,
            persistent_workers=i % 4 == 0,
            in_order=i % 2 == 0,
        ) as loader:
            for _ in range(2):
                async with asyncio.timeout(30):
                    async for batch in loader:
                        assert batch.shape[1:] == (1, 256, 256)
                        if i % 3 == 0:
                            break
                del batch
    async with asyncio.timeout(10):
        # Nothing signals "the OS released it": poll the counts until they are back.
        while proc.num_fds() > fds0 or proc.num_threads() > threads0 or worker_processes():  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_worker_death_after_an_abandoned_epoch_is_recovered(tmp_path: Path) -> None:
    """Persistent workers: an epoch ended early leaves cancelled batches queued in the pool; a
    worker dying before they drain must still break the pool cleanly (CPython gh-107219)."""
    from aioloader._threads import run_off_loop

    loader = AsyncDataLoader(
        datasets.HangOnceDataset(6, stuck=1, marker=str(tmp_path / "stuck")),
        batch_size=1,
        num_workers=1,
        persistent_workers=True,
        prefetch_factor=6,
    )
    async with loader, asyncio.timeout(60):
        it = aiter(loader)
        pid = int((await anext(it))[0, 1])
        # The race behind this test's old flakiness: closing before the worker has picked up
        # index 1 cancels that batch while it is still queued, so it never hangs here and hangs
        # in the next epoch instead. Wait until the worker is inside it.
        marker = tmp_path / "stuck"
        while not marker.exists():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        await it.aclose()  # cancels the batches queued behind the worker stuck on index 1
        assert loader._pool_owner.pool is not None
        (executor,) = loader._pool_owner.pool._executors
        manager = executor._executor_manager_thread  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)  # e.g. the OOM killer
        # On CPython < 3.12 the manager thread died of InvalidStateError on the cancelled
        # futures instead of ending cleanly, leaking its queue's thread and pipes.
        await run_off_loop(lambda: manager.join(30), name="test-join")
        assert not manager.is_alive()
        with pytest.warns(RuntimeWarning, match="SIGKILL"):
            got = [int(b[0, 0]) for b in await collect(loader)]
        assert got == list(range(6))
        assert loader.stats().worker_restarts == 1


class _LaunchKiller:
    """Kills chosen forkserver workers right after the fork server forked them and before their
    parent handed them their start-up data (what a SIGKILL that lands during the start does):
    the parent's write of that data then finds no reader. Launches are counted from 1."""

    def __init__(self, doomed: set[int] | None) -> None:
        self.doomed = doomed  # None: every launch
        self.launches = 0
        self.killed: list[int] = []
        self.threads: list[str] = []  # the thread of each doomed launch
        self.original = multiprocessing.forkserver.connect_to_new_process

    def __call__(self, fds: Any) -> Any:
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        assert server is not None
        before = {p.pid for p in psutil.Process(server).children()}
        ends = self.original(fds)
        self.launches += 1
        if self.doomed is not None and self.launches not in self.doomed:
            return ends
        self.threads.append(threading.current_thread().name)
        deadline = time.monotonic() + 10
        while True:
            new = [p for p in psutil.Process(server).children() if p.pid not in before]
            if new:
                break
            assert time.monotonic() < deadline, "the fork server forked no process"
            time.sleep(0.001)
        child = new[0]
        child.kill()
        self.killed.append(child.pid)
        # Gone (reaped by the fork server), so that nothing holds the pipe's read end.
        with contextlib.suppress(psutil.NoSuchProcess):
            child.wait(timeout=10)
        time.sleep(0.05)  # the fork server closes its copy of the read end after the fork
        return ends


@pytest.mark.parametrize("launch", [1, 2], ids=["first-wave", "second-wave"])
async def test_a_worker_killed_while_it_is_being_started_is_started_again(
    launch: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    killer = _LaunchKiller({launch})
    monkeypatch.setattr(multiprocessing.forkserver, "connect_to_new_process", killer)
    # One worker in the first wave, on the start-up thread; the other in the second, started by
    # the pool's own thread once the first is up.
    monkeypatch.setattr(_executor, "first_wave_size", lambda: 1)
    caplog.set_level(logging.WARNING, logger="aioloader._procpool")
    ds = datasets.PidDataset(40)
    async with AsyncDataLoader(
        ds, batch_size=4, num_workers=2, multiprocessing_context="forkserver"
    ) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no crash, so no restart warning
            batches = await collect(loader, limit=60)
        assert [int(i) for b in batches for i in b[:, 0]] == list(range(40))
        assert loader.stats().worker_restarts == 0  # nothing was lost: not a restart
    assert len(killer.killed) == 1 and killer.launches == 3
    assert (killer.threads[0] == "aioloader-start-rest") == (launch == 2), killer.threads
    assert any("died while it was being started" in r.getMessage() for r in caplog.records)


async def test_workers_that_always_die_while_starting_fail_the_epoch_with_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aioloader._procpool import LAUNCH_ATTEMPTS

    killer = _LaunchKiller(None)
    monkeypatch.setattr(multiprocessing.forkserver, "connect_to_new_process", killer)
    loader = AsyncDataLoader(
        datasets.PidDataset(8), batch_size=4, num_workers=2, multiprocessing_context="forkserver"
    )
    try:
        with pytest.raises(WorkerCrashedError, match="being started, 3 times in a row"):
            await collect(loader, limit=60)
        assert killer.launches == LAUNCH_ATTEMPTS == len(killer.killed)
        # Once processes can start again, so can the loader.
        monkeypatch.setattr(multiprocessing.forkserver, "connect_to_new_process", killer.original)
        batches = await collect(loader, limit=60)
        assert [int(i) for b in batches for i in b[:, 0]] == list(range(8))
    finally:
        async with asyncio.timeout(30):
            await loader.aclose()


async def test_replacement_workers_that_always_die_while_starting_fail_the_epoch_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A crash's recovery starts new workers; when every one of their launches dies, the epoch
    fails with WorkerCrashedError, as a first start does, not with the pool's own error."""
    killer = _LaunchKiller(None)
    loader = AsyncDataLoader(
        datasets.PidDataset(40), batch_size=2, num_workers=1, multiprocessing_context="forkserver"
    )
    try:
        it = aiter(loader)
        async with asyncio.timeout(60):
            first = await anext(it)
            monkeypatch.setattr(multiprocessing.forkserver, "connect_to_new_process", killer)
            os.kill(int(first[0, 1]), signal.SIGKILL)
            with (
                pytest.warns(RuntimeWarning, match="restarting the workers"),
                pytest.raises(WorkerCrashedError, match="being started, 3 times in a row"),
            ):
                async for _ in it:
                    pass
        assert killer.launches == len(killer.killed) == 3
    finally:
        async with asyncio.timeout(30):
            await loader.aclose()


@pytest.mark.parametrize(
    "failure",
    [ConnectionRefusedError(111, "Connection refused"), OSError(9, "Bad file descriptor")],
    ids=["refused", "ebadf"],
)
async def test_a_launch_the_fork_server_itself_fails_is_tried_again(
    failure: OSError, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fork server that is exiting refuses the connection (and a start on another thread that
    replaces it meanwhile can leave this one sending a closed descriptor): the launch is tried
    again after a pause, and the epoch is whole."""
    original = multiprocessing.forkserver.connect_to_new_process
    calls = 0

    def failing_once(fds: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise failure
        return original(fds)

    monkeypatch.setattr(multiprocessing.forkserver, "connect_to_new_process", failing_once)
    caplog.set_level(logging.WARNING, logger="aioloader._procpool")
    async with AsyncDataLoader(
        datasets.PidDataset(12), batch_size=4, num_workers=1, multiprocessing_context="forkserver"
    ) as loader:
        batches = await collect(loader, limit=60)
    assert [int(i) for b in batches for i in b[:, 0]] == list(range(12))
    assert calls == 2
    assert any(type(failure).__name__ in r.getMessage() for r in caplog.records)


async def test_any_other_launch_error_is_not_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = 0

    def failing(fds: Any) -> Any:
        nonlocal calls
        calls += 1
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(multiprocessing.forkserver, "connect_to_new_process", failing)
    loader = AsyncDataLoader(
        datasets.PidDataset(4), batch_size=4, num_workers=1, multiprocessing_context="forkserver"
    )
    try:
        with pytest.raises(PermissionError):
            await collect(loader, limit=60)
        assert calls == 1
    finally:
        async with asyncio.timeout(30):
            await loader.aclose()
