"""User errors keep their type; dead workers and stalls become clear errors, never hangs."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader, LoaderTimeoutError, PoisonBatchError, WorkerCrashedError
from tests import datasets
from tests.conftest import collect, worker_processes


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_getitem_error_keeps_type_and_loader_recovers(num_workers: int) -> None:
    ds = datasets.RaisingDataset(12, bad=5)
    async with AsyncDataLoader(ds, batch_size=2, num_workers=num_workers) as loader:
        got: list[Any] = []
        with pytest.raises(ValueError, match="bad sample 5") as info:
            async with asyncio.timeout(30):
                async for b in loader:
                    got.append(b)
        assert [b.flatten().tolist() for b in got] == [[0, 1], [2, 3]]
        if num_workers:
            msg = str(info.value)
            assert "Caught ValueError in DataLoader worker process" in msg
            assert "send_idx=2" in msg
            assert "Traceback" in msg and "__getitem__" in msg
        # The loader is usable again: a new epoch starts from scratch.
        with pytest.raises(ValueError):
            await collect(loader)


async def test_iterating_on_after_an_error_continues_the_epoch_like_torch() -> None:
    ds = datasets.RaisingDataset(8, bad=2)
    ref = iter(torch.utils.data.DataLoader(ds, batch_size=2))
    ref_out: list[Any] = []
    for _ in range(4):
        try:
            ref_out.append(next(ref).flatten().tolist())
        except ValueError:
            ref_out.append("error")
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2) as loader:
        it = aiter(loader)
        out: list[Any] = []
        async with asyncio.timeout(30):
            for _ in range(4):
                try:
                    out.append((await anext(it)).flatten().tolist())
                except ValueError:
                    out.append("error")
    assert out == ref_out == [[0, 1], "error", [4, 5], [6, 7]]


async def test_collate_and_init_errors_keep_their_type() -> None:
    async with AsyncDataLoader(
        datasets.RangeDataset(4), batch_size=2, num_workers=1, collate_fn=datasets.failing_collate
    ) as loader:
        with pytest.raises(TypeError, match="collate rejected the batch"):
            await collect(loader)
    async with AsyncDataLoader(
        datasets.RangeDataset(4),
        batch_size=2,
        num_workers=2,
        worker_init_fn=datasets.failing_worker_init,
    ) as loader:
        with pytest.raises(OSError, match="init failed in") as info:
            await collect(loader)
        assert "in DataLoader worker process" in str(info.value)


@pytest.mark.parametrize("persistent", [False, True])
async def test_init_error_of_a_worker_that_gets_no_batch_is_raised_at_the_end(
    persistent: bool,
) -> None:
    """in_order=False shares one queue: worker 1, still starting, gets no batch. torch gives
    each worker batches in turn and so raises its worker_init_fn error; here the end does."""
    loader = AsyncDataLoader(
        datasets.RangeDataset(4),
        batch_size=2,
        num_workers=2,
        in_order=False,
        persistent_workers=persistent,
        worker_init_fn=datasets.late_failing_worker_init,
        multiprocessing_context="fork",
    )
    message = "Caught ValueError in DataLoader worker process 1"
    async with loader, asyncio.timeout(60):
        got = []
        with pytest.raises(ValueError, match=message):
            async for batch in loader:
                got.append(batch.flatten().tolist())
        assert sorted(got) == [[0, 1], [2, 3]]
        if persistent:  # every epoch, as torch (worker 1 may now take a batch, and raise there)
            with pytest.raises(ValueError, match=message):
                async for _ in loader:
                    pass


async def test_iterable_error_keeps_type() -> None:
    async with AsyncDataLoader(datasets.RaisingIterable(), num_workers=1) as loader:
        with pytest.raises(KeyError, match="stream broke"):
            await collect(loader)


async def test_exception_that_cannot_be_rebuilt_becomes_runtime_error() -> None:
    async with AsyncDataLoader(datasets.TwoArgErrorDataset(6), num_workers=2) as loader:
        with pytest.raises(RuntimeError, match="Caught TwoArgError") as info:
            await collect(loader)
        assert "Traceback" in str(info.value)
        # The pool survived: the next epoch runs up to the bad sample again.
        with pytest.raises(RuntimeError, match="Caught TwoArgError"):
            await collect(loader)


async def test_unpicklable_result_is_a_clear_error_not_a_hang() -> None:
    async with AsyncDataLoader(
        datasets.LambdaResultDataset(4), batch_size=None, num_workers=1
    ) as loader:
        with pytest.raises(Exception, match="cannot be pickled to send it back"):
            await collect(loader, limit=30)


@pytest.mark.parametrize("num_workers", [0, 1])
async def test_stop_iteration_from_getitem_is_an_error(num_workers: int) -> None:
    ds = datasets.RaisingDataset(6, bad=1, exc_type=StopIteration)
    async with AsyncDataLoader(ds, num_workers=num_workers) as loader:
        with pytest.raises(RuntimeError, match="StopIteration"):
            await collect(loader, limit=30)


async def test_index_error_from_dataset_keeps_type() -> None:
    async with AsyncDataLoader(
        datasets.RangeDataset(3), batch_sampler=[[0, 1], [7]], num_workers=1
    ) as loader:
        with pytest.raises(IndexError):
            await collect(loader)


def _torch_crash_text(ds: Any) -> str:
    """The sentence torch's DataLoader raises when a worker dies loading ``ds``, pid masked."""
    with pytest.raises(RuntimeError) as info:
        list(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=1))
    # torch's SIGCHLD handler raises this sentence; a wait it interrupts may raise "pid(s) ...
    # exited unexpectedly" from it.
    exc: BaseException | None = info.value
    while exc is not None:
        found = re.match(r"DataLoader worker \(pid \d+\) [^.]*\.", str(exc))
        if found is not None:
            return re.sub(r"pid \d+", "pid N", found.group())
        exc = exc.__cause__ or exc.__context__
    raise AssertionError(f"torch raised something else: {info.value!r}")


@pytest.mark.parametrize("restarts", [0, 2])
@pytest.mark.parametrize(
    "ds",
    [datasets.SignalDataset(4, bad=0, sig=signal.SIGSEGV), datasets.ExitDataset(4, bad=0, code=7)],
    ids=["segfault", "exit7"],
)
def test_a_dead_worker_is_named_in_torchs_words(ds: Any, restarts: int) -> None:
    """The final error starts with torch's sentence (torch's own test matches it); ours follows."""
    expected = _torch_crash_text(ds)
    loader = AsyncDataLoader(ds, batch_size=2, num_workers=1, max_worker_restarts=restarts)
    with (
        warnings.catch_warnings(),
        loader.sync() as it,
        pytest.raises(WorkerCrashedError) as info,
    ):
        warnings.simplefilter("ignore", RuntimeWarning)  # the restarts' warnings
        next(iter(it))
    text = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert re.sub(r"pid \d+", "pid N", text).startswith(expected + " (aioloader worker 0")
    if isinstance(ds, datasets.SignalDataset):
        assert expected == "DataLoader worker (pid N) is killed by signal: Segmentation fault."
        assert re.search(r"DataLoader worker \(pid \d+\) is killed by signal: ", text)
    else:
        assert expected == "DataLoader worker (pid N) exited unexpectedly with exit code 7."
    assert "send_idx=0 (indices [0, 1])" in text
    assert isinstance(info.value, PoisonBatchError) == (restarts > 0)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
async def test_dead_worker_is_a_clear_error_within_seconds(start_method: str) -> None:
    loader = AsyncDataLoader(
        datasets.ExitDataset(20, bad=6, code=7),
        batch_size=2,
        num_workers=2,
        max_worker_restarts=0,
        multiprocessing_context=start_method,
    )
    async with loader:
        t0 = time.monotonic()
        with pytest.raises(WorkerCrashedError) as info:
            await collect(loader, limit=60)
        assert time.monotonic() - t0 < 30
    err = info.value
    assert isinstance(err, RuntimeError)
    assert "exit code 7" in str(err) and "DataLoader worker" in str(err)
    assert err.exitcode == 7
    assert err.worker_id in (0, 1)
    assert "send_idx=3" in str(err) and "[6, 7]" in str(err)


async def test_poison_batch_is_named_after_two_deaths() -> None:
    async with AsyncDataLoader(
        datasets.ExitDataset(20, bad=9), batch_size=4, num_workers=2
    ) as loader:
        with (
            pytest.warns(RuntimeWarning, match="restarting the workers"),
            pytest.raises(PoisonBatchError) as info,
        ):
            await collect(loader, limit=60)
    assert info.value.indices == [8, 9, 10, 11]
    assert "killed its worker twice" in str(info.value)


@pytest.mark.parametrize("in_order", [True, False])
async def test_worker_killed_once_is_replaced_and_nothing_is_lost(
    tmp_path: Path, in_order: bool
) -> None:
    ds = datasets.ExitOnceDataset(40, bad=13, marker=str(tmp_path / "died"))
    expected = [[i, i + 1] for i in range(0, 40, 2)]
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2, in_order=in_order) as loader:
        with pytest.warns(RuntimeWarning, match=r"SIGKILL.*send_idx=6.*\[12, 13\]"):
            got = [b.flatten().tolist() for b in await collect(loader, limit=60)]
        assert loader.stats().worker_restarts == 1
    assert (got if in_order else sorted(got)) == expected


def test_a_killed_workers_left_shared_memory_files_are_unlinked(tmp_path: Path) -> None:
    shm_dir = "/dev/shm"
    if not os.path.isdir(shm_dir):
        pytest.skip("needs /dev/shm")
    marker = tmp_path / "died"
    ds = datasets.ExitOnceLeavingSegmentDataset(20, bad=7, marker=str(marker), shm_dir=shm_dir)

    async def load() -> list[Any]:
        async with AsyncDataLoader(ds, batch_size=2, num_workers=2) as loader:
            return await collect(loader, limit=30)

    try:
        with pytest.warns(RuntimeWarning, match="SIGKILL"):
            got = asyncio.run(load())
        assert [b.flatten().tolist() for b in got] == [[i, i + 1] for i in range(0, 20, 2)]
        left = marker.read_text()
        assert left.startswith(shm_dir + "/torch_")
        # Unlinked once the killed worker's pool was shut down (replaced mid-epoch).
        assert not os.path.exists(left)
    finally:
        if marker.exists() and marker.read_text():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker.read_text())


def test_only_a_dead_processs_segments_are_unlinked(tmp_path: Path) -> None:
    from aioloader._buffers import unlink_left_segments

    for name in ("torch_111_5_0", "torch_111_6_1", "torch_1111_5_0", "torch_22_5_0", "other"):
        (tmp_path / name).write_bytes(b"")
    assert unlink_left_segments(111, str(tmp_path)) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "torch_1111_5_0", "torch_22_5_0"]
    assert unlink_left_segments(111, str(tmp_path / "missing")) == 0


async def test_worker_killed_from_outside_is_replaced() -> None:
    ds = datasets.PidDataset(60)
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2, prefetch_factor=1) as loader:
        it = aiter(loader)
        got = []
        async with asyncio.timeout(60):
            first = await anext(it)
            got.append(first)
            os.kill(int(first[0, 1]), signal.SIGKILL)
            with pytest.warns(RuntimeWarning, match="restarting"):
                got.extend([b async for b in it])
    indices = [int(i) for b in got for i in b[:, 0]]
    assert Counter(indices) == Counter(range(60))
    assert indices == sorted(indices)


async def test_iterable_worker_death_is_not_retried() -> None:
    class DyingStream(datasets.ShardedIterable):
        def __iter__(self) -> Any:
            yield 1
            os._exit(3)

    async with AsyncDataLoader(DyingStream(4), num_workers=1) as loader:
        with pytest.raises(WorkerCrashedError, match="IterableDataset worker"):
            await collect(loader, limit=30)


async def test_timeout_raises_instead_of_waiting_forever() -> None:
    async with AsyncDataLoader(
        datasets.SlowDataset(4, delay=3.0), num_workers=1, timeout=0.3
    ) as loader:
        t0 = time.monotonic()
        with pytest.raises(LoaderTimeoutError, match=r"timed out after 0\.3 seconds"):
            await collect(loader)
        assert time.monotonic() - t0 < 3.0


async def test_the_timeout_message_reads_as_torchs() -> None:
    """torch formats the number as given: ``timeout=1`` says "after 1 seconds" (its own test
    matches ``after \\d+ seconds``)."""
    async with AsyncDataLoader(
        datasets.SlowDataset(4, delay=3.0), num_workers=1, timeout=1
    ) as loader:
        with pytest.raises(LoaderTimeoutError, match=r"^DataLoader timed out after 1 seconds"):
            await collect(loader)


async def test_timeout_is_honoured_without_workers() -> None:
    # torch accepts timeout with num_workers=0 and then fails with an AssertionError.
    async with AsyncDataLoader(datasets.SlowDataset(2, delay=1.0), timeout=0.2) as loader:
        with pytest.raises(TimeoutError):
            await collect(loader)


class _Stuck(torch.utils.data.Dataset[int]):
    """Every read blocks until the test lets it go (a hung network read)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        self.release.wait(60)
        return i


@pytest.mark.parametrize("executor", ["none", "thread"])
async def test_leaving_after_a_timeout_waits_only_a_moment_for_a_stuck_thread(
    executor: str,
) -> None:
    """torch's single-process loader would wait for the read; here `timeout` raises at the
    deadline and leaving the loader waits at most a second more, then says what was left."""
    dataset = _Stuck()
    kw: dict[str, Any] = {"timeout": 0.5}
    if executor == "thread":
        kw.update(num_workers=1, executor="thread")
    try:
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match="still inside the dataset"):
            async with AsyncDataLoader(dataset, **kw) as loader:
                with pytest.raises(LoaderTimeoutError):
                    await collect(loader)
        assert time.monotonic() - t0 < 20  # not the 60 s the read would take
    finally:
        dataset.release.set()
    async with asyncio.timeout(30):  # the abandoned read returns, and its thread ends
        while any(t.name.startswith("aioloader-") for t in threading.enumerate()):  # noqa: ASYNC110
            await asyncio.sleep(0.05)


async def test_sampler_error_surfaces_at_its_position() -> None:
    def sampler() -> Any:
        yield 0
        yield 1
        raise LookupError("sampler broke")

    async with AsyncDataLoader(
        datasets.RangeDataset(5), sampler=sampler(), num_workers=1
    ) as loader:
        got: list[Any] = []
        with pytest.raises(LookupError, match="sampler broke"):
            async with asyncio.timeout(30):
                async for b in loader:
                    got.append(int(b))
    assert got == [0, 1]


async def test_empty_batch_from_batch_sampler_is_a_clear_error() -> None:
    async with AsyncDataLoader(
        datasets.RangeDataset(4), batch_sampler=[[0, 1], []], num_workers=1
    ) as loader:
        with pytest.raises(IndexError, match="empty batch"):
            await collect(loader)


async def test_empty_dataset_gives_an_empty_epoch_like_torch() -> None:
    async with AsyncDataLoader(datasets.RangeDataset(0), batch_size=2, num_workers=2) as loader:
        assert await collect(loader) == []
    with pytest.raises(ValueError, match="num_samples should be a positive integer"):
        AsyncDataLoader(datasets.RangeDataset(0), shuffle=True)


async def test_one_shot_sampler_used_up_is_a_clear_error() -> None:
    async with AsyncDataLoader(
        datasets.RangeDataset(6), sampler=iter(range(6)), batch_size=3
    ) as loader:
        assert len(await collect(loader)) == 2
        with pytest.raises(ValueError, match="one-shot iterator"):
            await collect(loader)


EMFILE_SCRIPT = """
import asyncio, resource
from aioloader import AsyncDataLoader
from tests import datasets

async def main():
    kept = []
    async with asyncio.timeout(60):
        async with AsyncDataLoader(datasets.BigDataset(400, (512, 256)), batch_size=1,
                                   num_workers=2) as loader:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
            try:
                async for b in loader:
                    kept.append(b)  # each shared-memory batch holds a descriptor
            except RuntimeError as exc:
                print("ERROR:", exc)
            finally:
                kept.clear()
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

asyncio.run(main())
"""


def test_running_out_of_file_descriptors_says_how_to_fix_it() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", EMFILE_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert "ERROR: Too many open files" in out.stdout, out.stdout + out.stderr
    assert "ulimit -n" in out.stdout


MID_WRITE_SCRIPT = """
import asyncio, os, random, signal, warnings
import psutil
from aioloader import AsyncDataLoader
from tests import datasets

async def main():
    warnings.simplefilter("ignore", RuntimeWarning)
    rng = random.Random(0)
    # 192 KiB batches travel inline: longer than a pipe buffer, so kills land mid-write.
    ds = datasets.BigDataset(600, (3, 128, 128))
    seen = []
    async with asyncio.timeout(100):
        async with AsyncDataLoader(ds, batch_size=1, num_workers=2,
                                   max_worker_restarts=100) as loader:
            async for b in loader:
                seen.append(int(b[0, 0, 0, 0]))
                if rng.random() < 0.02:
                    kids = psutil.Process().children()
                    if kids:
                        os.kill(rng.choice(kids).pid, signal.SIGKILL)
    assert seen == list(range(600)), seen[:20]
    print("restarts", loader.stats().worker_restarts)

asyncio.run(main())
"""


def test_workers_killed_while_writing_results_never_hang_the_loader() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", MID_WRITE_SCRIPT], capture_output=True, text=True, timeout=150
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) >= 3


async def test_crash_is_an_error_when_warnings_are_errors(tmp_path: Path) -> None:
    ds = datasets.ExitOnceDataset(20, bad=5, marker=str(tmp_path / "died"))
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(WorkerCrashedError, match="not restarted") as info:
                await collect(loader, limit=60)
    assert isinstance(info.value.__cause__, RuntimeWarning)


@pytest.mark.parametrize("restarts", [0, 1])
async def test_a_segfaulting_worker_is_reported_in_torchs_words(restarts: int) -> None:
    """torch's test_segfault matches r"DataLoader worker \\(pid \\d+\\) is killed by signal: "."""
    loader = AsyncDataLoader(
        datasets.SegfaultDataset(8, at=2),
        batch_size=2,
        num_workers=1,
        max_worker_restarts=restarts,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the restart's warning, restarts=1
        async with loader, asyncio.timeout(60):
            with pytest.raises(WorkerCrashedError) as info:
                async for _ in loader:
                    pass
    assert isinstance(info.value, RuntimeError)
    assert re.search(
        r"DataLoader worker \(pid \d+\) is killed by signal: Segmentation fault", str(info.value)
    ), str(info.value)
    assert info.value.exitcode == -signal.SIGSEGV


TORCH_SEGFAULT = r"DataLoader worker \(pid \d+\) is killed by signal: Segmentation fault"


def _segfault_loader(start_method: str) -> AsyncDataLoader[Any]:
    # torch's test_segfault (every sample faults, 2 workers) with persistent workers.
    return AsyncDataLoader(
        datasets.SegfaultEveryDataset(10),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=start_method,
    )


async def test_a_segfault_that_repeats_after_a_restart_fails_without_more_restarts() -> None:
    # Spawned workers, as torch's test gets them: every restart is a worker start-up that
    # imports torch, seconds on a busy machine, so the number of restarts is what bounds the wait.
    loader = _segfault_loader("spawn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the one restart's warning
        # torch's test gives its process 60 s (JOIN_TIMEOUT); two quiet start-ups take ~3 s.
        async with loader, asyncio.timeout(60):
            with pytest.raises(WorkerCrashedError, match=TORCH_SEGFAULT):
                async for _ in loader:
                    pass
            # At most one restart after the first crash (was up to one per batch in flight).
            assert loader.stats().worker_restarts <= 1
            deadline = time.monotonic() + 20
            while worker_processes():
                assert time.monotonic() < deadline, f"workers left: {worker_processes()}"
                await asyncio.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_repeated_segfault_reaches_a_synchronous_caller_and_leaves_no_worker() -> None:
    loader = _segfault_loader("fork")
    started = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with loader.sync() as bridge, pytest.raises(WorkerCrashedError, match=TORCH_SEGFAULT):
            next(iter(bridge))
    assert loader.stats().worker_restarts <= 1
    # Forked workers start in milliseconds: the error and the workers' end take well under 1 s.
    while worker_processes():
        assert time.monotonic() - started < 20, f"workers left: {worker_processes()}"
        time.sleep(0.05)
    assert time.monotonic() - started < 20


async def test_a_fault_on_another_batch_before_any_completes_is_not_restarted_again(
    tmp_path: Path,
) -> None:
    # The first crash blames batch 1, the restarted workers' crash batch 0: no batch was
    # killed twice, yet the replacement completed nothing, so the epoch ends there.
    ds = datasets.SegfaultInTurnDataset(8, str(tmp_path / "faulted"))
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2, prefetch_factor=1) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(WorkerCrashedError, match="before completing any") as info:
                await collect(loader, limit=60)
    assert not isinstance(info.value, PoisonBatchError)
    assert info.value.indices == [0, 1]
    assert loader.stats().worker_restarts == 1


async def test_segfaults_on_different_batches_with_progress_between_are_each_restarted(
    tmp_path: Path,
) -> None:
    # Each bad sample faults once; every replacement completes batches before the next fault,
    # so each fault is a restart and every sample arrives.
    ds = datasets.ExitOnceAtDataset(40, [1, 13, 29], str(tmp_path), segfault=True)
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2, max_worker_restarts=5) as loader:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = [int(i) for b in await collect(loader, limit=60) for i in b]
        assert got == list(range(40))
        assert loader.stats().worker_restarts == 3


MID_WRITE_TWO_POOLS_SCRIPT = """
import asyncio, os, signal, sys, tempfile, threading, warnings
import multiprocessing.connection as mpc
import torch
from torch.utils.data import Dataset
from aioloader import AsyncDataLoader
from tests import datasets

FLAG = os.path.join(tempfile.mkdtemp(), "died")

class HalfWritten(Dataset):
    # Sample 2 kills its worker half-way through writing its 8 MB result, once (as an OOM kill).
    def __len__(self):
        return 5

    def __getitem__(self, i):
        if i == 2 and not os.path.exists(FLAG):
            open(FLAG, "w").close()
            send = mpc.Connection._send

            def half_then_die(conn, buf, write=os.write):
                if len(buf) > (1 << 20):
                    write(conn._handle, bytes(buf[: 1 << 16]))
                    os.kill(os.getpid(), signal.SIGKILL)
                return send(conn, buf)

            mpc.Connection._send = half_then_die
        return {"x": torch.tensor([i]), "blob": "x" * (8 << 20)}

def manager_threads():
    return [t for t in threading.enumerate() if "ManagerThread" in type(t).__name__]

async def main():
    warnings.simplefilter("ignore")
    train = AsyncDataLoader(HalfWritten(), batch_size=1, num_workers=1,
                            multiprocessing_context="fork")
    val = AsyncDataLoader(datasets.RangeDataset(4), batch_size=2, num_workers=1,
                          persistent_workers=True, multiprocessing_context="fork")
    async with asyncio.timeout(100):
        it = aiter(train)
        got = [int((await anext(it))["x"])]
        [b async for b in val]  # val's worker is forked now: it inherits train's pipes
        got += [int(b["x"]) async for b in it]
        del it
        await train.aclose()
        left = len(manager_threads())  # val's pool's own thread, and no other
        await val.aclose()
    print("got", *got, "restarts", train.stats().worker_restarts, "threads", left)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_worker_killed_mid_write_with_another_forked_pool_alive_is_recovered_cleanly(
    tmp_path: Path,
) -> None:
    """A later fork (another pool's worker) must not hold this pool's result pipe open: the
    manager thread reading the dead worker's half-written result never saw EOF, recovery waited
    its 5 s join, and the thread was left behind."""
    import os
    import subprocess
    import sys

    script = tmp_path / "two_pools.py"
    script.write_text(MID_WRITE_TWO_POOLS_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=150,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [
        "got",
        "0",
        "1",
        "2",
        "3",
        "4",
        "restarts",
        "1",
        "threads",
        "1",
    ], out.stdout
