"""Shared fixtures: every test must leave no child process, thread, fd or shm file behind."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest
import torch

# Datasets used across test modules live in tests/datasets.py so spawn/forkserver workers can
# import them by reference.
from tests import datasets

START_METHODS = ["fork", "spawn", "forkserver"]

#: Event loops the tests marked ``loops`` run under (pytest-asyncio's loop-factory hook: no
#: event-loop policy, which Python 3.14 deprecates). uvloop is an optional extra.
LOOP_FACTORIES: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop
}
try:
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - the dev extra installs it
    pass
else:
    LOOP_FACTORIES["uvloop"] = _uvloop.new_event_loop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Main behaviour tests (marked ``loops``) run once per event loop; the rest on asyncio's."""
    if item.get_closest_marker("loops") is not None:
        return LOOP_FACTORIES
    return {"asyncio": asyncio.new_event_loop}


def worker_processes() -> set[int]:
    """Our descendant processes, less the stdlib's process-wide helpers (kept by design).

    The fork server and the resource tracker are started once and live as long as this process;
    forkserver *workers* are children of the fork server and are counted.
    """
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            parent = p.ppid()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        if "resource_tracker" in cmd:
            continue
        if "multiprocessing.forkserver" in cmd and parent == os.getpid():
            continue
        out.add(p.pid)
    return out


def _threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.ident is not None}


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _fd_targets(fds: set[str]) -> list[str]:
    out = []
    for fd in sorted(fds, key=int):
        try:
            out.append(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            continue
    return out


def _shm() -> set[str]:
    try:
        return {f for f in os.listdir("/dev/shm") if f.startswith(f"aioloader-{os.getpid()}-")}
    except FileNotFoundError:
        return set()


def _snapshot() -> tuple[set[int], set[int], int, set[str]]:
    return worker_processes(), _threads(), len(_fds()), _shm()


@pytest.fixture(scope="session", autouse=True)
def _start_global_helpers() -> None:
    """Start the stdlib's forkserver and resource tracker once, before any baseline is taken."""
    ctx = multiprocessing.get_context("forkserver")
    from aioloader._executor import _prepare_forkserver

    _prepare_forkserver(ctx)
    p = ctx.Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    # multiprocessing's fd-sharing listener (a thread and a socket) starts the first time this
    # process sends a shared-memory tensor to a worker (an index batch that is a tensor) and
    # lives as long as the process, as with torch's DataLoader.
    from multiprocessing import resource_sharer

    sharer: Any = resource_sharer._resource_sharer  # type: ignore[attr-defined]
    with sharer._lock:
        if sharer._address is None:
            sharer._start()
    if torch.cuda.is_available():
        # The CUDA driver opens its device files and a context once per process and keeps them;
        # open them before any test takes its fd baseline.
        pinned = torch.ones(1).pin_memory()
        pinned.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
    # multiprocessing's shared heap keeps its first small arena (and its fd) for the process's
    # life; the loader's shared counters come from it.
    _arena_keeper.append(multiprocessing.RawArray("q", 8))
    # uvloop opens a process-wide pipe the first time a loop is made.
    try:
        import uvloop
    except ImportError:
        return

    async def nothing() -> None:
        return None

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(nothing())


_arena_keeper: list[object] = []


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves a child process, thread, fd or shared-memory file behind."""
    before_children, before_threads, before_fds, before_shm = _snapshot()
    fds_before = _fds()
    yield
    if request.node.get_closest_marker("allow_leaks"):
        return
    deadline = time.monotonic() + 10
    while True:
        gc.collect()  # objects the test made (a tensor moved to shared memory) hold fds too
        children, threads, nfds, shm = _snapshot()
        new_children = children - before_children
        new_threads = threads - before_threads
        new_shm = shm - before_shm
        if not new_children and not new_threads and nfds <= before_fds and not new_shm:
            return
        if time.monotonic() > deadline:
            names = [t.name for t in threading.enumerate() if t.ident in new_threads]
            pytest.fail(
                f"leaked: children={sorted(new_children)} threads={names} "
                f"fds {before_fds}->{nfds} {_fd_targets(_fds() - fds_before)} "
                f"shm={sorted(new_shm)}"
            )
        time.sleep(0.05)


@pytest.fixture(params=START_METHODS)
def start_method(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def small_ds() -> datasets.RangeDataset:
    return datasets.RangeDataset(40)


def torch_batches(*args: object, **kwargs: object) -> list[object]:
    """What torch's DataLoader yields for the same arguments (the reference behaviour)."""
    return list(torch.utils.data.DataLoader(*args, **kwargs))  # type: ignore[arg-type]


async def collect(loader: object, limit: float = 60) -> list[object]:
    """Drain one epoch of ``loader`` within ``limit`` seconds."""
    async with asyncio.timeout(limit):
        return [b async for b in loader]  # type: ignore[attr-defined]
