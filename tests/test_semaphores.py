"""The named semaphores of the workers' queues (spawn, forkserver: /dev/shm/sem.* files) go when
the workers go, not at a garbage collection (a service may run with the collector off)."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator
from multiprocessing import synchronize
from typing import Any

import pytest

from aioloader import AsyncDataLoader
from tests import datasets


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _semaphore_files(pool: Any) -> list[str]:
    """The /dev/shm files of the named semaphores of ``pool``'s executors' queues."""
    names = []
    for ex in pool._executors:
        for q in (ex._call_queue, ex._result_queue):
            for attr in ("_rlock", "_wlock", "_sem"):
                lock = getattr(q, attr, None)
                if isinstance(lock, synchronize.SemLock) and lock._semlock.name:
                    names.append(f"/dev/shm/sem.{lock._semlock.name.lstrip('/')}")
    return names


def _existing(files: list[str]) -> list[str]:
    return [f for f in files if os.path.exists(f)]


@pytest.mark.usefixtures("collector_off")
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("end", ["finished", "break", "aclose"])
async def test_an_epochs_semaphores_go_with_its_workers(method: str, end: str) -> None:
    loader = AsyncDataLoader(
        datasets.RangeDataset(40), batch_size=4, num_workers=2, multiprocessing_context=method
    )
    files: list[str] = []
    async with asyncio.timeout(120):
        async with loader:
            async for _ in loader:
                if not files:
                    (epoch,) = list(loader._epochs)
                    files = _semaphore_files(epoch.backend)
                    assert files and _existing(files) == files
                if end == "break":
                    break
                if end == "aclose":
                    await loader.aclose()
                    break
            if end != "aclose":
                await asyncio.sleep(0)  # the ended epoch's cleanup runs on the loop
                for _ in range(200):
                    if not _existing(files):
                        break
                    await asyncio.sleep(0.05)
    assert _existing(files) == []


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.usefixtures("collector_off")
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
async def test_epochs_leave_no_descriptor_behind_with_the_collector_off(method: str) -> None:
    """Queue pipes, wakeup pipes and process sentinels are closed when the workers go."""
    loader = AsyncDataLoader(
        datasets.RangeDataset(16), batch_size=4, num_workers=2, multiprocessing_context=method
    )
    async with loader, asyncio.timeout(120):
        async for _ in loader:
            pass
        after_one = _fds()
        for _ in range(3):
            async for _ in loader:
                pass
        assert _fds() == after_one
