"""WorkerPool and the worker side: start-up, stopping in any order, crash reports, and
``BaseException`` from user code. The parts that need no torch also run under every Python found
(tests/procpool_check.py)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import process as _cf_process
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, TensorDataset
from torch.utils.data._utils.collate import default_collate

from aioloader import AsyncDataLoader, _codec, _executor, _payload, _worker
from aioloader._executor import CrashReport, WorkerPool
from aioloader._procpool import Executor
from aioloader._threads import run_off_loop
from tests.conftest import interpreters, worker_processes

CHECK_SCRIPT = Path(__file__).with_name("procpool_check.py")

# ---------------------------------------------------------------------------------- datasets
# At module level: spawn/forkserver workers import them from here.


class PidDataset(Dataset[torch.Tensor]):
    """Sample i is ``tensor([i, pid])``; index ``slow`` takes ``delay`` seconds."""

    def __init__(self, n: int, slow: int = -1, delay: float = 0.0) -> None:
        self.n, self.slow, self.delay = n, slow, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.slow or self.slow == -2:  # -2: every index
            time.sleep(self.delay)
        return torch.tensor([i, os.getpid()])


class RaisesBuiltinAt(PidDataset):
    """``__getitem__(at)`` raises ``exc`` (SystemExit, KeyboardInterrupt, ...)."""

    def __init__(self, n: int, at: int, exc: type[BaseException]) -> None:
        super().__init__(n)
        self.at, self.exc = at, exc

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.at:
            if self.exc is SystemExit:
                sys.exit(2)  # what a dataset calling argparse or sys.exit() does
            raise self.exc(f"from sample {i}")
        return super().__getitem__(i)


class ExitingStream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        sys.exit(5)


def quick_dataset() -> TensorDataset[torch.Tensor]:
    """A dataset whose class the fork server has imported already: its workers are ready (and
    idle) within milliseconds, which is when CPython's lazy process starts go wrong."""
    return TensorDataset(torch.arange(64))


def sleep_in_worker_init(worker_id: int) -> None:
    time.sleep(60)


def exit_in_worker_init(worker_id: int) -> None:
    sys.exit(3)


def exit_in_collate(batch: list[Any]) -> Any:
    raise SystemExit(4)


def ignore_sigterm(worker_id: int) -> None:
    signal.signal(signal.SIGTERM, lambda *_: None)


# ----------------------------------------------------------------------------------- helpers


def make_spec(
    dataset: Any,
    num_workers: int,
    ctx: Any,
    worker_init_fn: Callable[[int], None] | None = None,
) -> _worker.WorkerSpec:
    """A WorkerSpec as the loader builds one (see _pools.make_spec)."""
    objects = (dataset, default_collate, worker_init_fn)
    fork = ctx.get_start_method() == "fork"
    return _worker.WorkerSpec(
        num_workers=num_workers,
        base_seed=0,
        is_iterable=False,
        auto_collation=True,
        drop_last=False,
        main_pid=os.getpid(),
        nice=0,
        payload_file=None if fork else _payload.dump_payload(objects),
        objects=objects if fork else None,
        fixed_worker_id=None,
    )


async def start_pool(
    dataset: Any,
    num_workers: int,
    method: str,
    *,
    per_worker: bool,
    worker_init_fn: Callable[[int], None] | None = None,
) -> WorkerPool:
    ctx = multiprocessing.get_context(method)
    async with asyncio.timeout(60):
        return await WorkerPool.start(
            lambda: make_spec(dataset, num_workers, ctx, worker_init_fn), ctx, per_worker
        )


async def result(fut: Future[Any], limit: float = 30) -> _worker.Result:
    async with asyncio.timeout(limit):
        res: _worker.Result = await asyncio.wrap_future(fut)
    return res


def batch_of(res: _worker.Result) -> Any:
    assert isinstance(res.data, bytes), res.data
    return _codec.loads_result(res.data)


async def wait_until(cond: Callable[[], bool], limit: float = 30) -> None:
    async with asyncio.timeout(limit):
        while not cond():  # noqa: ASYNC110 (shared memory written by another process)
            await asyncio.sleep(0.01)


def pids_of(pool: WorkerPool) -> set[int]:
    return {p.pid for p in pool._procs if p.pid is not None}


def executor_pids(pool: WorkerPool) -> set[int]:
    return {pid for ex in pool._executors for pid in (ex._processes or {})}  # type: ignore[attr-defined]


# ---------------------------------------------------------- torch-free checks, every Python


def _version(exe: str) -> tuple[int, int]:
    out = subprocess.run(
        [exe, "-c", "import sys; print(*sys.version_info[:2])"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.split()
    return int(out[0]), int(out[1])


def _run_check(exe: str, *args: str) -> subprocess.CompletedProcess[str]:
    # -I: no site-packages, no PYTHONPATH: only the standard library is importable (no torch).
    return subprocess.run(
        [exe, "-I", str(CHECK_SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("exe", list(interpreters().values()), ids=list(interpreters()))
def test_executor_internals_hold_under_every_python(exe: str) -> None:
    """All workers start up front on the starting thread, or in two waves; stopping never hangs
    behind a manager thread that tears down a broken pool; the fork warning is silenced without
    leaking a filter; a worker killed while it is being started is started again."""
    proc = _run_check(exe)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 11, proc.stdout


def test_the_old_kill_order_hangs_on_python_3_12() -> None:
    """The check above is meaningful: with shutdown() before SIGKILL it hangs on >= 3.12."""
    newer = [exe for exe in interpreters().values() if _version(exe) >= (3, 12)]
    if not newer:
        pytest.skip("no Python >= 3.12 installed")
    proc = _run_check(newer[0], "kill_after_crash", "--old-order")
    assert proc.returncode == 1
    assert "kill_after_crash: HANG" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------- start-up


@pytest.fixture
def one_wave(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every worker starts at once, as on a machine with a core for each (see staggering)."""
    monkeypatch.setattr(_executor, "first_wave_size", lambda: 64)


@pytest.fixture
def process_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the threads that start worker processes, in order. Each start is followed by a
    pause, as on a busy machine: the workers started first are idle before the next start."""
    starts: list[str] = []
    new_process = Executor._new_process  # every process start, in either wave

    def slow_new_process(self: Executor) -> Any:
        p = new_process(self)
        starts.append(threading.current_thread().name)
        time.sleep(0.5)
        return p

    monkeypatch.setattr(Executor, "_new_process", slow_new_process)
    return starts


async def test_shared_pool_has_every_process_right_after_start(
    process_starts: list[str], one_wave: None
) -> None:
    """in_order=False map-style: one executor of num_workers processes, all started (and
    watched) by start(), none later by a submit from the event loop. (CPython starts spawn and
    forkserver processes alike, lazily; forkserver is the faster to test.)"""
    pool = await start_pool(quick_dataset(), 3, "forkserver", per_worker=False)
    try:
        assert len(pool._procs) == 3
        assert len(pool.sentinels()) == 3
        assert executor_pids(pool) == pids_of(pool)
        futs = [pool.submit(i, [2 * i, 2 * i + 1], 0, None) for i in range(12)]
        used = {(await result(f)).pid for f in futs}
        assert used <= pids_of(pool)
        assert executor_pids(pool) == pids_of(pool)
        assert process_starts == ["aioloader-start"] * 3  # none on the event loop's thread
    finally:
        await pool.shutdown(graceful=True)


async def test_shared_pool_loader_starts_every_worker_off_the_loop(
    process_starts: list[str],
) -> None:
    """Through the loader, under spawn: every worker is started by the start-up thread."""
    async with AsyncDataLoader(
        PidDataset(48),
        batch_size=2,
        num_workers=2,
        in_order=False,
        multiprocessing_context="spawn",
        worker_nice=0,
    ) as loader:
        async with asyncio.timeout(60):
            it = aiter(loader)
            await anext(it)
            assert len(worker_processes()) == 2
            async for _ in it:
                pass
    assert process_starts == ["aioloader-start"] * 2


async def test_replacement_after_a_crash_starts_every_process(
    process_starts: list[str], one_wave: None
) -> None:
    pool = await start_pool(quick_dataset(), 3, "forkserver", per_worker=False)
    new: WorkerPool | None = None
    try:
        victim = pool._procs[1]
        os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
        report = await run_off_loop(pool.crash_report, name="test-diagnose")
        assert report.pid == victim.pid
        new = await pool.replace()  # what crash recovery does
        assert len(new._procs) == 3
        assert executor_pids(new) == pids_of(new)
        res = await result(new.submit(0, [0, 1], 0, None))
        assert batch_of(res)[0].tolist() == [0, 1]
        assert process_starts == ["aioloader-start"] * 6
    finally:
        await pool.shutdown(graceful=False)
        if new is not None:
            await new.shutdown(graceful=True)


async def test_a_replacement_cancelled_while_the_dead_pool_shuts_down_closes_the_payload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The epoch ends (cancelling its recovery) while the dead pool is being killed: no pool
    will ever own the payload file, so replace() closes it rather than leak the dataset."""
    pool = await start_pool(quick_dataset(), 2, "spawn", per_worker=False)
    payload = pool.spec.payload_file
    assert payload is not None and payload[0].fd >= 0
    kill = WorkerPool._kill_locked
    killing = threading.Event()

    def slow_kill(self: WorkerPool) -> None:
        killing.set()
        time.sleep(0.5)  # the window in which the epoch ends
        kill(self)

    monkeypatch.setattr(WorkerPool, "_kill_locked", slow_kill)
    os.kill(pool._procs[0].pid, signal.SIGKILL)  # type: ignore[arg-type]
    task = asyncio.ensure_future(pool.replace())
    await wait_until(killing.is_set)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(30):
            await task
    await wait_until(lambda: pool._stopped)
    assert payload[0].fd == -1


async def test_start_failing_half_way_leaves_no_process(
    monkeypatch: pytest.MonkeyPatch, one_wave: None
) -> None:
    """A start that fails after some processes exist kills them and closes the payload."""
    calls = 0
    spawn = Executor._spawn_process

    def flaky(self: Executor) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # e.g. fork() failing with EAGAIN at the process limit
            raise OSError(11, "Resource temporarily unavailable")
        spawn(self)

    monkeypatch.setattr(Executor, "_spawn_process", flaky)
    specs: list[_worker.WorkerSpec] = []
    ctx = multiprocessing.get_context("forkserver")

    def make() -> _worker.WorkerSpec:
        specs.append(make_spec(PidDataset(8), 3, ctx))
        return specs[-1]

    with pytest.raises(OSError, match="temporarily unavailable"):
        async with asyncio.timeout(60):
            await WorkerPool.start(make, ctx, False)
    assert calls == 3
    (spec,) = specs
    assert spec.payload_file is not None and spec.payload_file[0].fd == -1
    # no_leaks: neither the two processes started nor any thread or fd survives


async def test_pinned_fork_pool_forks_every_worker_before_any_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under fork a thread running at the instant of a fork can leave the child a lock nobody
    releases: a pinned pool forks all its workers before it starts any manager thread."""
    spawn = Executor._spawn_process
    managers_at_fork: list[int] = []

    def counting_spawn(self: Executor) -> None:
        managers_at_fork.append(
            sum(isinstance(t, _cf_process._ExecutorManagerThread) for t in threading.enumerate())
        )
        spawn(self)

    monkeypatch.setattr(Executor, "_spawn_process", counting_spawn)
    pool = await start_pool(PidDataset(8), 3, "fork", per_worker=True)
    try:
        # Every fork ended before start() returned: no code of the user's runs on another
        # thread while a worker forks (see test_every_fork_ends_before_the_sampler_runs).
        assert len(executor_pids(pool)) == 3
        res = await result(pool.submit(0, [1], 0, 2))
        assert res.worker_id == 2
        await wait_grown(pool)  # the manager threads start after start() returned
        assert managers_at_fork == [0, 0, 0]
        assert len(pool._manager_threads) == 3
    finally:
        await pool.shutdown(graceful=True)


class _ChildrenAtFirstPull(Sampler[int]):
    """Records the pids of this process's multiprocessing children when first iterated."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen: list[set[int]] = []

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        self.seen.append({p.pid for p in multiprocessing.active_children() if p.pid})
        return iter(range(self.n))


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("in_order", [True, False])
async def test_every_fork_ends_before_the_sampler_runs(in_order: bool) -> None:
    """Under fork, a worker forked while another thread holds a native lock inherits it held:
    a sampler's torch.randperm holds the default generator's mutex with the interpreter lock
    released, and a worker forked then hung for ever in its initializer's torch.manual_seed (a
    review found this in a version that forked the later workers after start() returned). The
    sampler runs on its own thread, so every worker must exist before it is first pulled."""
    sampler = _ChildrenAtFirstPull(24)
    pids: set[int] = set()
    async with AsyncDataLoader(
        PidDataset(24),
        batch_size=2,
        sampler=sampler,
        num_workers=3,
        in_order=in_order,
        multiprocessing_context="fork",
        persistent_workers=True,
    ) as loader:
        async with asyncio.timeout(60):
            async for batch in loader:
                pids |= set(batch[:, 1].tolist())
        pool = loader._pool_owner.pool
        assert isinstance(pool, WorkerPool)
        workers = pids_of(pool)
    assert len(workers) == 3
    assert pids <= workers
    assert len(sampler.seen) == 1
    assert workers <= sampler.seen[0]


# --------------------------------------------------------------------- staggered start-up
#
# Under spawn/forkserver only as many workers as there are cores start at once; the rest start
# on the pool's own thread once those are up. Here the first wave is one worker of three.


@pytest.fixture
def wave_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_executor, "first_wave_size", lambda: 1)


async def wait_grown(pool: WorkerPool) -> None:
    assert pool._grower is not None
    await wait_until(lambda: not pool._grower.is_alive())  # type: ignore[union-attr]


@pytest.mark.parametrize("per_worker", [True, False], ids=["pinned", "shared"])
async def test_staggered_start_takes_tasks_for_workers_not_started_yet(
    process_starts: list[str], wave_of_one: None, per_worker: bool
) -> None:
    pool = await start_pool(quick_dataset(), 3, "forkserver", per_worker=per_worker)
    try:
        assert process_starts[:1] == ["aioloader-start"]
        # Tasks for every worker, submitted before workers 1 and 2 exist: none is lost, none
        # starts a process on the event loop's thread.
        futs = [pool.submit(i, [i], 0, i % 3) for i in range(9)]
        results = [await result(f) for f in futs]
        assert [batch_of(r)[0].tolist() for r in results] == [[i] for i in range(9)]
        await wait_grown(pool)
        assert process_starts == ["aioloader-start"] + ["aioloader-start-rest"] * 2
        assert len(pool.sentinels()) == 3
        assert executor_pids(pool) == pids_of(pool)
        if per_worker:  # pinned: each task ran on the worker it names
            assert [r.worker_id for r in results] == [i % 3 for i in range(9)]
    finally:
        await pool.shutdown(graceful=True)
    assert _all_gone(pool)


async def test_watch_reports_the_second_wave(wave_of_one: None) -> None:
    pool = await start_pool(quick_dataset(), 3, "forkserver", per_worker=True)
    grown: list[BaseException | None] = []
    try:
        assert len(pool.watch(grown.append)) in (1, 3)  # 3: the rest were up already
        await wait_grown(pool)
        assert grown in ([None], [])
        assert len(pool.watch(grown.append)) == 3  # once grown, no further call
        assert len(grown) <= 1
    finally:
        await pool.shutdown(graceful=False)


@pytest.mark.parametrize("graceful", [True, False])
async def test_shutdown_before_the_second_wave_starts_none_of_it(
    monkeypatch: pytest.MonkeyPatch, process_starts: list[str], wave_of_one: None, graceful: bool
) -> None:
    # The first worker never comes up: its initializer blocks, so the second wave waits.
    pool = await start_pool(
        quick_dataset(), 3, "forkserver", per_worker=True, worker_init_fn=sleep_in_worker_init
    )
    fut = pool.submit(0, [0], 0, 2)  # queued on a worker that never starts
    await pool.shutdown(graceful=graceful)
    assert process_starts == ["aioloader-start"]
    assert fut.cancelled()
    assert _all_gone(pool)
    # no_leaks: the unstarted executors' pipes are closed, the pool's thread is gone


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
async def test_second_wave_start_failure_fails_the_epoch(
    monkeypatch: pytest.MonkeyPatch, wave_of_one: None
) -> None:
    spawn = Executor._spawn_process

    def no_second(self: Executor) -> None:
        if threading.current_thread().name == "aioloader-start-rest":
            raise OSError(11, "Resource temporarily unavailable")
        spawn(self)

    monkeypatch.setattr(Executor, "_spawn_process", no_second)
    loader = AsyncDataLoader(
        PidDataset(12), batch_size=2, num_workers=3, multiprocessing_context="forkserver"
    )
    async with loader:
        with pytest.raises(OSError, match="temporarily unavailable"):
            async with asyncio.timeout(60):
                async for _ in loader:
                    pass


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
async def test_second_wave_failing_after_its_epoch_ended_fails_the_next_one(
    monkeypatch: pytest.MonkeyPatch, wave_of_one: None
) -> None:
    """A persistent pool kept by an abandoned epoch whose second wave then fails: the next
    epoch fails with that error instead of waiting for workers that never start, and the one
    after it gets a fresh pool."""
    gate = threading.Event()
    spawn = Executor._spawn_process

    def gated(self: Executor) -> None:
        if threading.current_thread().name == "aioloader-start-rest":
            gate.wait(60)
            raise OSError(11, "Resource temporarily unavailable")
        spawn(self)

    monkeypatch.setattr(Executor, "_spawn_process", gated)
    loader = AsyncDataLoader(
        PidDataset(12),
        batch_size=2,
        num_workers=3,
        multiprocessing_context="forkserver",
        persistent_workers=True,
    )
    async with loader:
        async with asyncio.timeout(90):
            async for _ in loader:
                break  # abandoned while running: the pool is kept, its second wave pending
            first_pool = loader._pool_owner.pool
            gate.set()
            with pytest.raises(OSError, match="temporarily unavailable"):
                async for _ in loader:
                    pass
            monkeypatch.setattr(Executor, "_spawn_process", spawn)
            seen = [i for b in [b async for b in loader] for i in b[:, 0].tolist()]
            assert seen == list(range(12))
            assert loader._pool_owner.pool is not first_pool


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
async def test_loader_watches_the_second_wave(wave_of_one: None) -> None:
    """A worker of the second wave killed mid-batch is noticed and its batch loaded again."""
    loader = AsyncDataLoader(
        PidDataset(12, slow=5, delay=3),
        batch_size=1,
        num_workers=3,
        multiprocessing_context="forkserver",
        worker_nice=0,
    )
    seen: list[int] = []
    async with loader:
        async with asyncio.timeout(90):
            it = aiter(loader)
            for _ in range(5):
                seen += (await anext(it))[:, 0].tolist()
            epoch = it._epoch  # type: ignore[attr-defined]
            assert epoch.backend is not None
            pool = epoch.backend
            assert isinstance(pool, WorkerPool)
            await wait_until(lambda: pool.busy_send_idx().get(2) == (0, 5))  # index 5: worker 2
            assert len(epoch._watched) == 3
            with pytest.warns(RuntimeWarning, match="worker 2"):
                os.kill(pool._pid_slots[2], signal.SIGKILL)
                async for b in it:
                    seen += b[:, 0].tolist()
    assert seen == list(range(12))


# ----------------------------------------------------------------------------- crash reports


async def test_result_carries_epoch_worker_and_pid() -> None:
    assert _worker.Result._fields[:6] == ("send_idx", "epoch", "worker_id", "pid", "data", "busy_s")
    assert _worker.Result._fields[6:] == ("state",)
    pool = await start_pool(PidDataset(8), 2, "fork", per_worker=True)
    try:
        res = await result(pool.submit(5, [2, 3], 7, 1))
        assert (res.send_idx, res.epoch, res.worker_id) == (5, 7, 1)
        assert res.pid == pool._workers[1][1].pid
        assert batch_of(res)[:, 0].tolist() == [2, 3]
        assert pool.busy_send_idx() == {}
    finally:
        await pool.shutdown(graceful=True)


async def test_crash_report_names_the_worker_its_batch_and_epoch() -> None:
    """A persistent pool's worker can die on a task of an earlier, abandoned epoch: the report
    says which epoch the batch it held belonged to."""
    pool = await start_pool(PidDataset(8, slow=3, delay=60), 2, "fork", per_worker=True)
    try:
        fut = pool.submit(4, [3], 2, 1)  # epoch 2, send_idx 4, on worker 1
        await wait_until(lambda: pool.busy_send_idx() == {1: (2, 4)})
        os.kill(pool._workers[1][1].pid, signal.SIGKILL)  # type: ignore[arg-type]
        with pytest.raises(BrokenProcessPool):
            await result(fut)
        report: CrashReport = await run_off_loop(pool.crash_report, name="test-diagnose")
        assert (report.worker_id, report.epoch, report.send_idx) == (1, 2, 4)
        assert report.exitcode == -signal.SIGKILL
        assert "worker 1" in report.describe() and "SIGKILL" in report.describe()
    finally:
        await pool.shutdown(graceful=False)


async def test_shared_pool_crash_is_blamed_on_the_worker_that_died(one_wave: None) -> None:
    pool = await start_pool(PidDataset(8, slow=-2, delay=60), 3, "forkserver", per_worker=False)
    try:
        futs = [pool.submit(10 + i, [i], 1, None) for i in range(3)]
        await wait_until(lambda: len(pool.busy_send_idx()) == 3)
        busy = pool.busy_send_idx()
        pid = pool._pid_slots[2]
        os.kill(pid, signal.SIGKILL)
        for f in futs:
            with pytest.raises(BrokenProcessPool):
                await result(f)
        report = await run_off_loop(pool.crash_report, name="test-diagnose")
        # The manager thread noted the death it saw before it stopped the other two, so an
        # exit code read as 255 (forkserver's status pipe read by two threads) cannot mislead.
        assert pool._executors[0].first_dead_pids == {pid}
        assert (report.worker_id, report.pid) == (2, pid)
        assert report.exitcode == -signal.SIGKILL
        assert (report.epoch, report.send_idx) == busy[2]
    finally:
        await pool.shutdown(graceful=False)


# --------------------------------------------------------------------------------- stopping


async def _busy_pool() -> WorkerPool:
    """Two pinned fork workers, worker 0 busy for a minute, worker 1 idle."""
    pool = await start_pool(PidDataset(8, slow=3, delay=60), 2, "fork", per_worker=True)
    pool.submit(0, [3], 0, 0)
    await wait_until(lambda: 0 in pool.busy_send_idx())
    return pool


def _all_gone(pool: WorkerPool) -> bool:
    return all(p.exitcode is not None for p in pool._procs) and not any(
        t.is_alive() for t in pool._manager_threads
    )


@pytest.mark.parametrize(
    "first, second",
    [("kill", "kill"), ("kill", "graceful"), ("graceful", "kill"), ("graceful", "graceful")],
)
async def test_stopping_twice_in_any_order_leaves_nothing(first: str, second: str) -> None:
    pool = await start_pool(PidDataset(8), 2, "fork", per_worker=True)
    steps = {"kill": pool._kill_sync, "graceful": lambda: pool._shutdown_sync(True)}
    t0 = time.monotonic()
    await run_off_loop(steps[first], name="test-stop-1")
    assert _all_gone(pool)
    await run_off_loop(steps[second], name="test-stop-2")
    await pool.shutdown(graceful=True)  # a no-op now
    assert _all_gone(pool)
    assert time.monotonic() - t0 < _executor.SHUTDOWN_GRACE_S  # idle workers exit when asked


@pytest.mark.parametrize("graceful", [False, True])
async def test_two_threads_stopping_at_once_both_return_when_all_is_gone(graceful: bool) -> None:
    """Two threads stop the same pool at once (aclose() racing a cleanup, or a garbage-collected
    iterator): neither returns while a worker still runs, both return, and a kill does not wait
    for the grace period a graceful shutdown gives a busy worker."""
    pool = await _busy_pool()
    t0 = time.monotonic()
    seen: list[bool] = []
    go = threading.Barrier(2)

    def stop(kill: bool) -> None:
        go.wait()
        if kill:
            pool._kill_sync()
        else:
            pool._shutdown_sync(graceful)
        seen.append(_all_gone(pool))

    threads = [threading.Thread(target=stop, args=(k,)) for k in (True, False)]
    for t in threads:
        t.start()
    await run_off_loop(lambda: [t.join(30) for t in threads], name="test-join")
    assert seen == [True, True]
    assert time.monotonic() - t0 < _executor.SHUTDOWN_GRACE_S


async def test_graceful_shutdown_of_a_broken_pool_does_not_wait_for_sigterm_survivors() -> None:
    """A worker died and the survivor ignores SIGTERM (a handler installed by user code): the
    pool is killed at once, not after the grace period (and on Python >= 3.12 the request to
    shut down never blocks behind the manager thread, see procpool_check.py)."""
    pool = await start_pool(
        PidDataset(8, slow=-2, delay=60), 2, "fork", per_worker=False, worker_init_fn=ignore_sigterm
    )
    (ex,) = pool._executors
    pool.submit(0, [0], 0, None)
    pool.submit(1, [1], 0, None)
    await wait_until(lambda: len(pool.busy_send_idx()) == 2)
    os.kill(pool._pid_slots[0], signal.SIGKILL)
    await wait_until(lambda: bool(ex._broken))  # type: ignore[attr-defined]
    t0 = time.monotonic()
    async with asyncio.timeout(30):
        await pool.shutdown(graceful=True)
    assert time.monotonic() - t0 < 2.0
    assert _all_gone(pool)


# ----------------------------------------------------------------- BaseException from user code


def test_remote_error_records_system_exit_as_runtime_error() -> None:
    from aioloader._consumer import raise_remote

    try:
        sys.exit(2)
    except BaseException:
        err = _worker.RemoteError.capture("in DataLoader worker process 1 while loading batch")
    assert err.exc_type is not None and pickle.loads(err.exc_type) is RuntimeError
    assert err.type_name == "SystemExit"
    assert err.exc_msg.startswith("Caught SystemExit in DataLoader worker process 1 ")
    assert "sys.exit(2)" in err.exc_msg  # the worker's traceback
    assert "must not raise SystemExit" in err.exc_msg
    with pytest.raises(RuntimeError, match="SystemExit") as info:
        raise_remote(err)
    assert type(info.value) is RuntimeError


@pytest.mark.parametrize("exc", [SystemExit, KeyboardInterrupt, GeneratorExit])
async def test_base_exception_in_getitem_is_a_runtime_error_and_the_epoch_goes_on(
    exc: type[BaseException],
) -> None:
    loader = AsyncDataLoader(RaisesBuiltinAt(8, 3, exc), batch_size=1, num_workers=2)
    async with loader, asyncio.timeout(60):
        it = aiter(loader)
        got = [int((await anext(it))[0, 0]) for _ in range(3)]
        with pytest.raises(RuntimeError, match=f"Caught {exc.__name__} in DataLoader worker"):
            await anext(it)
        got += [int(b[0, 0]) async for b in it]
        assert got == [0, 1, 2, 4, 5, 6, 7]
        assert loader.stats().worker_restarts == 0  # the workers lived on


@pytest.mark.parametrize("where", ["worker_init_fn", "collate_fn", "__iter__"])
async def test_system_exit_in_init_collate_or_iter_is_a_runtime_error(where: str) -> None:
    kwargs: dict[str, Any] = {}
    dataset: Any = PidDataset(4)
    if where == "worker_init_fn":
        kwargs["worker_init_fn"] = exit_in_worker_init
    elif where == "collate_fn":
        kwargs["collate_fn"] = exit_in_collate
    else:
        dataset = ExitingStream()
    loader = AsyncDataLoader(dataset, batch_size=2, num_workers=2, **kwargs)
    async with loader, asyncio.timeout(60):
        with pytest.raises(RuntimeError, match="Caught SystemExit in DataLoader worker process"):
            async for _ in loader:
                pass
    await asyncio.sleep(0)  # the event loop is alive


async def test_crash_report_does_not_blame_workers_the_manager_thread_killed() -> None:
    """A worker dies while another ignores SIGTERM. On Python >= 3.12 the executor's manager
    thread SIGKILLs that one after a moment (see _procpool._ManagerThread): the report still
    names the first death, not the other SIGKILL. (On 3.11 the survivor lives until shutdown.)"""
    pool = await start_pool(
        PidDataset(8), 2, "fork", per_worker=False, worker_init_fn=ignore_sigterm
    )
    try:
        (ex,) = pool._executors
        await result(pool.submit(0, [0], 0, None))  # the SIGTERM handlers are in place
        await result(pool.submit(1, [1], 0, None))
        survivor, crashed = pool._procs  # the survivor comes first: a plain sort would pick it
        os.kill(crashed.pid, signal.SIGKILL)  # type: ignore[arg-type]
        if sys.version_info >= (3, 12):
            await wait_until(lambda: survivor.pid in ex.killed_pids)
            await wait_until(lambda: survivor.exitcode is not None)
        report = await run_off_loop(pool.crash_report, name="test-diagnose")
        assert (report.pid, report.exitcode) == (crashed.pid, -signal.SIGKILL)
    finally:
        await pool.shutdown(graceful=False)


def test_a_pinned_pool_serves_one_event_loop_after_another() -> None:
    """A pinned worker's batches travel over a lane that the submitting event loop watches
    (_procpool.Lane): persistent workers kept from a loop that is still open but stopped serve
    the next loop, and the first one again, every batch in order."""
    from tests.datasets import RangeDataset

    loader = AsyncDataLoader(RangeDataset(12), batch_size=2, num_workers=2, persistent_workers=True)

    async def epoch() -> list[int]:
        return [int(x) async for b in loader for x in b]

    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        for loop in (first, second, first):
            assert loop.run_until_complete(asyncio.wait_for(epoch(), 60)) == list(range(12))
        first.run_until_complete(loader.aclose())
    finally:
        first.close()
        second.close()


_NOTES: list[Any] = []


def _note(x: Any) -> None:
    if x == "raise":
        raise ValueError("a post that fails")
    _NOTES.append(x)


def _notes(delay: float = 0.0) -> list[Any]:
    time.sleep(delay)
    return list(_NOTES)


async def test_lane_posts_run_in_order_with_tasks_and_send_nothing_back() -> None:
    """A post (Lane.post, used to send a filling window's samples ahead) runs in the worker in
    submission order with the tasks, even behind tasks the lane still holds back, and a failing
    or unpicklable post neither breaks the lane nor produces a result."""
    ex = Executor(max_workers=1, mp_context=multiprocessing.get_context("fork"), lane=True)
    ex.start_workers()
    try:
        async with asyncio.timeout(30):
            assert ex.post(_note, 1) and ex.post(_note, "raise") and ex.post(_note, 2)
            assert await asyncio.wrap_future(ex.submit(_notes)) == [1, 2]
            # More tasks than the lane writes ahead: the post waits behind them, in order.
            slow = [ex.submit(_notes, 0.05) for _ in range(3)]
            assert ex.post(_note, 3)
            last = ex.submit(_notes)
            results = [await asyncio.wrap_future(f) for f in slow]
            assert results == [[1, 2]] * 3
            assert await asyncio.wrap_future(last) == [1, 2, 3]
            assert not ex.post(lambda: None)  # cannot be pickled: not sent, and says so
            assert await asyncio.wrap_future(ex.submit(_notes)) == [1, 2, 3]
            lane = ex._lane
            assert lane is not None and not lane.unread()
    finally:
        await asyncio.to_thread(ex.shutdown, True)
    assert not ex.post(_note, 4)  # shut down: nothing is sent


def _payload_of(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + bytes(size % 256)


class _FailsToLoad:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse, ())


def _refuse() -> None:
    raise ValueError("this result cannot be rebuilt")


def _failing_result() -> _FailsToLoad:
    return _FailsToLoad()


async def test_lane_results_of_every_size_arrive_whole_and_in_order() -> None:
    """Results read from one kept buffer, a bounded stretch per callback: frames smaller and
    larger than a read, several in the pipe at once, one that spans callbacks, and one that
    fails to load between them all arrive as sent; the buffer shrinks back afterwards."""
    from aioloader import _procpool

    sizes = [0, 1, (1 << 16) - 7, 1 << 16, (1 << 18) + 3, 3 << 20, 5, (1 << 20) + 1, 17]
    ex = Executor(max_workers=1, mp_context=multiprocessing.get_context("fork"), lane=True)
    ex.start_workers()
    try:
        async with asyncio.timeout(60):
            futs = [ex.submit(_payload_of, n) for n in sizes[:5]]
            futs.append(ex.submit(_failing_result))
            futs += [ex.submit(_payload_of, n) for n in sizes[5:]]
            got = [await asyncio.wrap_future(f) for f in futs[:5]]
            with pytest.raises(ValueError, match="cannot be rebuilt"):
                await asyncio.wrap_future(futs[5])
            got += [await asyncio.wrap_future(f) for f in futs[6:]]
            assert [len(g) for g in got] == sizes
            assert got == [_payload_of(n) for n in sizes]
            lane = ex._lane
            assert lane is not None
            assert lane._filled == 0 and len(lane._in) <= _procpool._KEEP_SIZE
    finally:
        await asyncio.to_thread(ex.shutdown, True)


def test_a_fork_during_another_threads_pipe_close_leaves_the_new_worker_alone() -> None:
    """A worker forked while another thread is inside ``Connection.close()`` of another
    executor's pipe end (Lane.started closing its worker's ends, as two epochs' pools start at
    once): that thread has closed the descriptor but not yet cleared the connection's number,
    and the fork reused the number for the new process's own pipe. The child's at-fork handler
    closed that stale number, i.e. the new worker's own pipe, and the worker exited with status
    1 before its initializer ran, printing nothing (multiprocessing's fork start failed on its
    own close of that pipe)."""
    ctx = multiprocessing.get_context("fork")
    other = Executor(max_workers=1, mp_context=ctx, lane=True)
    ex = Executor(max_workers=1, mp_context=ctx, lane=True)
    assert other._lane is not None
    conn = other._lane.call_r
    fd = conn.fileno()
    closed, resume = threading.Event(), threading.Event()
    parent = os.getpid()

    def close_slowly() -> None:  # Connection.close() clears its number once this returns
        os.close(fd)
        if os.getpid() == parent:  # not in the child's at-fork handler
            closed.set()
            resume.wait(30)

    conn._close = close_slowly  # type: ignore[attr-defined]
    closer = threading.Thread(target=conn.close, name="test-closer")
    closer.start()
    holes: list[int] = []
    try:
        assert closed.wait(30)
        # Every lower number taken: the next pipe (the new worker's first one) gets ``fd``.
        while (h := os.open(os.devnull, os.O_RDONLY)) < fd:
            holes.append(h)
        os.close(h)
        assert h == fd
        ex.start_workers()
        for h in holes:
            os.close(h)
        holes.clear()
        (proc,) = ex.processes()
        assert ex.submit(os.getpid).result(30) == proc.pid
    finally:
        for h in holes:
            os.close(h)
        resume.set()
        closer.join(30)
        ex.shutdown(wait=True)
        other.close_unstarted()


def test_the_exit_hooks_wakeup_never_writes_into_a_pipe_the_manager_thread_closes() -> None:
    """concurrent.futures' interpreter-exit hook (``_python_exit``) calls ``wakeup()`` on every
    manager thread's wakeup pipe with no lock, while that thread may be closing the pipe (a
    multiprocessing child with a persistent loader left open: our exit finalizer SIGKILLs the
    workers just before, so the manager thread tears the pool down right then). ``wakeup()``
    saw the pipe open, the thread closed the descriptor, and the write failed with EBADF: the
    child exited with status 1. Here the waker is held between its check and its write."""
    ctx = multiprocessing.get_context("fork")
    ex = Executor(max_workers=1, mp_context=ctx)
    ex.start_workers()
    assert ex.submit(os.getpid).result(30) != os.getpid()
    wakeup: Any = ex._executor_manager_thread_wakeup  # type: ignore[attr-defined]
    writer = wakeup._writer
    thread: Any = ex._executor_manager_thread  # type: ignore[attr-defined]
    fd = writer.fileno()
    waker_in, fd_closed, waker_done = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []
    real_send = writer._send_bytes

    def send_late(buf: Any) -> None:  # past wakeup()'s "not closed" check
        if threading.current_thread().name == "test-waker":
            waker_in.set()
            fd_closed.wait(1.0)  # with the fix the close waits for us: this times out
        real_send(buf)

    def close_slowly() -> None:  # the number is cleared only once this returns
        os.close(fd)
        fd_closed.set()
        waker_done.wait(30)

    def wake() -> None:
        try:
            wakeup.wakeup()  # as _python_exit does
        except BaseException as exc:
            errors.append(exc)
        finally:
            waker_done.set()

    writer._send_bytes = send_late
    writer._close = close_slowly
    waker = threading.Thread(target=wake, name="test-waker")
    waker.start()
    try:
        assert waker_in.wait(30)
        ex.shutdown(wait=False)  # the manager thread closes the pipe on its way out
        waker.join(30)
        thread.join(30)
        assert not thread.is_alive()
        assert errors == []
        assert wakeup._closed and writer.closed
    finally:
        waker_done.set()
        waker.join(30)
        ex.shutdown(wait=True)


class _Registered:
    """Pickled through a reduction registered while a test runs."""


def test_the_lanes_kept_pickler_pickles_as_a_new_one_would() -> None:
    import copyreg
    import tracemalloc
    import weakref
    from multiprocessing.reduction import ForkingPickler

    from aioloader._procpool import _Dumper

    dumper = _Dumper()
    first = dumper.dumps(("task", [1, 2]))
    assert pickle.loads(first) == ("task", [1, 2])
    # An error leaves nothing behind for the next call.
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        dumper.dumps(lambda: None)
    assert pickle.loads(dumper.dumps(7)) == 7
    # A reduction registered after the pickler was made is used, as by a new ForkingPickler,
    # and so is one that replaces it.
    copyreg.pickle(_Registered, lambda _: (tuple, ((1, 2),)))
    try:
        assert pickle.loads(dumper.dumps(_Registered())) == (1, 2)
        copyreg.pickle(_Registered, lambda _: (tuple, ((3, 4),)))
        assert pickle.loads(dumper.dumps(_Registered())) == (3, 4)
    finally:
        del copyreg.dispatch_table[_Registered]
    # ForkingPickler's own reductions come first, as in a new one.
    ForkingPickler.register(_Registered, lambda _: (tuple, ((5, 6),)))
    copyreg.pickle(_Registered, lambda _: (tuple, ((7, 8),)))
    try:
        assert pickle.loads(dumper.dumps(_Registered())) == (5, 6)
    finally:
        del copyreg.dispatch_table[_Registered]
        del ForkingPickler._extra_reducers[_Registered]  # type: ignore[attr-defined]
    # One large pickle leaves no large memo table behind.
    tracemalloc.start()
    try:
        big = [(i,) for i in range(200_000)]
        dumper.dumps(big)
        del big
        dumper.dumps(("task", [1, 2]))
        left, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert left < 1 << 20
    # The pickler's memo does not keep what it pickled alive.
    obj = _Registered()
    ref = weakref.ref(obj)
    dumper.dumps([obj, obj])
    del obj
    assert ref() is None
