"""Loaders left open until the interpreter (or a multiprocessing child) exits, or dropped without
closing: the process exits promptly and no worker outlives it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent

UNCLOSED = textwrap.dedent(
    """
    import asyncio, multiprocessing, sys
    import torch
    from aioloader import AsyncDataLoader

    KEEP = []

    async def main(method, where, executor):
        kw = (
            dict(multiprocessing_context=method) if executor == "process"
            else dict(executor="thread")
        )
        loader = AsyncDataLoader(
            [torch.tensor([i]) for i in range(8)], batch_size=2, num_workers=2,
            persistent_workers=True, **kw,
        )
        n = 0
        async for _ in loader:
            n += 1
        print("pids", *[p.pid for p in multiprocessing.active_children()], flush=True)
        if where == "global":
            KEEP.append(loader)  # alive at interpreter finalization
        else:
            loader.cycle = loader  # garbage that no collection frees before exit

    if __name__ == "__main__":
        import gc
        gc.disable()
        asyncio.run(main(*sys.argv[1:]))
        print("exiting", flush=True)
    """
)


def _run(script: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone(pids: list[int], within: float = 10.0) -> list[int]:
    """The processes of ``pids`` still running after ``within`` seconds."""
    deadline = time.monotonic() + within
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.05)
    return alive


@pytest.mark.parametrize(
    "method,where,executor",
    [
        ("fork", "global", "process"),
        ("spawn", "local", "process"),
        ("forkserver", "global", "process"),
        ("fork", "global", "thread"),
    ],
)
def test_an_unclosed_persistent_loader_alive_at_exit_lets_the_interpreter_exit(
    method: str, where: str, executor: str
) -> None:
    """Its __del__ runs during finalization, where no thread can start (3.11 waited for ever)."""
    proc = _run(UNCLOSED, method, where, executor)
    assert proc.returncode == 0, proc.stderr
    assert "exiting" in proc.stdout, proc.stdout
    pids = [int(p) for p in proc.stdout.split("pids", 1)[1].split("\n", 1)[0].split()]
    if executor == "process":
        assert len(pids) >= 2, proc.stdout
    assert _gone(pids) == []


DROPPED_BRIDGES = textwrap.dedent(
    """
    import gc
    from aioloader import AsyncDataLoader

    class Collecting:
        # A collection in the worker, as any allocation-heavy __getitem__ sets off sooner or
        # later: it frees the worker's copy of the previous, dropped loader.
        def __len__(self):
            return 100

        def __getitem__(self, i):
            if i % 50 == 0:
                gc.collect()
            return i

    gc.disable()  # the parent leaves the garbage for the workers to inherit
    for rep in range(3):
        # The previous bridged loader is dropped unclosed: cyclic garbage when this one forks.
        dl = AsyncDataLoader(Collecting(), num_workers=2, multiprocessing_context="fork").sync()
        print(rep, sum(1 for _ in dl), flush=True)
    print("done", flush=True)
    """
)


def test_a_dropped_bridged_loader_does_not_hang_the_next_loaders_forked_workers() -> None:
    """Freeing the inherited copy in a worker must not call into the parent's loop thread."""
    proc = _run(DROPPED_BRIDGES, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "100", "1", "100", "2", "100", "done"], proc.stdout


MP_CHILD = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time

    def train(raise_error, persistent):
        from aioloader import AsyncDataLoader
        loader = AsyncDataLoader(
            list(range(100)), batch_size=2, num_workers=1, persistent_workers=persistent
        ).sync()
        print("worker pids", *[p.pid for p in mp.active_children()], flush=True)
        it = iter(loader)  # a local: the traceback keeps it (and its epoch) while the child exits
        for _ in it:
            print("worker pids", *[p.pid for p in mp.active_children()], flush=True)
            if raise_error:
                raise RuntimeError("a bug in the training step")
        # the persistent case ends its epoch and leaves the loader open, as torch allows

    if __name__ == "__main__":
        raise_error, persistent = sys.argv[1] == "1", sys.argv[2] == "1"
        child = mp.get_context("spawn").Process(target=train, args=(raise_error, persistent))
        t0 = time.monotonic()
        child.start()
        child.join(60)
        print("alive", child.is_alive(), "exitcode", child.exitcode,
              "after", round(time.monotonic() - t0), flush=True)
        if child.is_alive():
            child.kill()
    """
)


@pytest.mark.parametrize(
    "raise_error,persistent", [("1", "0"), ("0", "1")], ids=["raises-mid-epoch", "persistent"]
)
def test_a_multiprocessing_child_with_an_open_loader_exits(
    raise_error: str, persistent: str, tmp_path: Path
) -> None:
    """Python's multiprocessing joins a child's non-daemon children at its exit: the loader's
    workers must be told to go (torch's are daemons; its child exits in seconds)."""
    script = tmp_path / "mp_child.py"  # a file: spawn re-imports the main module
    script.write_text(MP_CHILD)
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(script), raise_error, persistent],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert f"alive False exitcode {raise_error}" in proc.stdout, proc.stdout + proc.stderr
    pids = {int(p) for line in proc.stdout.splitlines() if line.startswith("worker pids")
            for p in line.split()[2:]}  # fmt: skip
    assert pids, proc.stdout
    assert _gone(sorted(pids)) == []


DROPPED_PERSISTENT = textwrap.dedent(
    """
    import asyncio, gc, multiprocessing, sys, time
    import torch
    from aioloader import AsyncDataLoader

    gc.disable()  # reference counting alone must release the workers, as with torch
    data = [torch.tensor([i]) for i in range(100)]
    if sys.argv[1] == "sync":
        loader = AsyncDataLoader(data, batch_size=2, num_workers=2, persistent_workers=True)
        it = iter(loader.sync())
        del loader  # the bridge's iterator holds it
        for i, _ in enumerate(it):
            if i == 10:
                break
        pids = [p.pid for p in multiprocessing.active_children()]
        del it, _
    else:
        async def main():
            loader = AsyncDataLoader(data, batch_size=2, num_workers=2, persistent_workers=True)
            async for _ in loader:
                break
            return [p.pid for p in multiprocessing.active_children()]
        pids = asyncio.run(main())
    print("pids", *pids, flush=True)
    time.sleep(30)  # the test watches the workers meanwhile
    """
)


@pytest.mark.parametrize("bridge", ["sync", "async"])
def test_the_workers_of_a_dropped_persistent_loader_go_without_a_collection(bridge: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", DROPPED_PERSISTENT, bridge],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) >= 2, line
        assert _gone(pids, within=10) == []
    finally:
        proc.kill()
        proc.communicate()


LOADER_AND_ITERATOR_IN_A_CYCLE = textwrap.dedent(
    """
    import gc, sys, time
    import psutil, torch
    from aioloader import AsyncDataLoader

    num_workers, persistent = int(sys.argv[1]), sys.argv[2] == "1"
    kw = {"persistent_workers": True} if persistent else {}
    ds = torch.utils.data.TensorDataset(torch.arange(100.0))
    loader = AsyncDataLoader(ds, batch_size=2, num_workers=num_workers, **kw).sync()
    it = iter(loader)
    next(it)
    # Garbage together, in one cycle (a failed test's traceback, `except ... as e`).
    box = {"loader": loader, "it": it}
    box["self"] = box
    del loader, it, box
    gc.collect()
    deadline = time.monotonic() + 10
    while psutil.Process().children() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("children", len(psutil.Process().children()), flush=True)
    """
)


@pytest.mark.parametrize("num_workers,persistent", [(0, "0"), (2, "0"), (2, "1")])
def test_a_loader_collected_together_with_its_open_iterator_ends_quietly(
    num_workers: int, persistent: str
) -> None:
    """The collector freed a bridged loader before its half-consumed iterator: the loop's
    shutdown cancelled the epoch's guard, which asked the loader (gone) for its pool and raised
    'aioloader bug: an epoch outlived its loader' (found by torch's test_dataloader.py)."""
    done = subprocess.run(
        [sys.executable, "-c", LOADER_AND_ITERATOR_IN_A_CYCLE, str(num_workers), persistent],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr
    assert "children 0" in done.stdout, done.stdout + done.stderr
    for noise in ("aioloader bug", "Task was destroyed", "Traceback"):
        assert noise not in done.stderr, done.stderr


UNREAD_LANE_RESULT_AT_EXIT = textwrap.dedent(
    """
    import asyncio, multiprocessing as mp
    from aioloader._procpool import Executor

    def big(n):
        return b"x" * n

    ex = Executor(max_workers=1, mp_context=mp.get_context("fork"), lane=True)
    ex.start_workers()

    async def main():
        ex.submit(big, 1 << 20)  # a result larger than the pipe, never read

    asyncio.run(main())
    print("exiting", flush=True)
    """
)


def test_an_unread_lane_result_larger_than_the_pipe_does_not_hang_the_exit() -> None:
    """The loop that would read a pinned worker's result closed first: the worker blocks writing
    it into the full pipe, and concurrent.futures' exit hook joined the manager thread, which
    joined the worker, for ever. Unread lanes are failed and their workers killed instead."""
    done = _run(UNREAD_LANE_RESULT_AT_EXIT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "exiting" in done.stdout


HALF_WRITTEN_POST_AT_EXIT = textwrap.dedent(
    """
    import asyncio, time, torch
    from aioloader import AsyncDataLoader

    class Src:
        async def __aiter__(self):
            for i in range(100):
                yield torch.full((1 << 16,), float(i))  # 256 KiB: a post larger than the pipe
                await asyncio.sleep(0.05)

    def slow(x):
        time.sleep(0.5)
        return x

    loader = None

    async def main():
        global loader  # kept open past the loop: its pool is left to the exit hook
        loader = AsyncDataLoader(
            Src(), batch_size=8, num_workers=1, transform=slow, persistent_workers=True
        )
        try:
            async with asyncio.timeout(0.3):
                await anext(aiter(loader))
        except TimeoutError:
            pass

    asyncio.run(main())
    print("exiting", flush=True)
    """
)


def test_a_post_half_written_when_its_loop_closes_does_not_hang_the_exit() -> None:
    """A window's samples sent ahead (a lane post) larger than the pipe, the worker busy: the
    loop closes with part of the frame unwritten, and the worker waits for the rest instead of
    its exit request. Such a lane counts as unread: its worker is killed at exit."""
    done = _run(HALF_WRITTEN_POST_AT_EXIT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "exiting" in done.stdout


STALE_LANE_RESULTS_ON_A_LATER_LOOP = textwrap.dedent(
    """
    import asyncio, io, logging
    from aioloader import AsyncDataLoader
    from tests.datasets import SlowDataset

    log = io.StringIO()
    logging.getLogger("concurrent.futures").addHandler(logging.StreamHandler(log))
    loader = AsyncDataLoader(
        SlowDataset(40, 0.05), batch_size=2, num_workers=2, persistent_workers=True
    )

    async def first():
        async for _ in loader:
            break  # batches still loading on the lanes; this loop closes next

    async def second():
        out = [int(x) async for b in loader for x in b]
        await loader.aclose()
        return out

    asyncio.run(first())
    print("second epoch whole:", asyncio.run(second()) == list(range(40)))
    print("callback errors:", log.getvalue().count("exception calling callback"))
    """
)


def test_stale_lane_results_read_on_a_later_loop_are_dropped_quietly() -> None:
    """Persistent workers over two asyncio.run calls: the first epoch's results arrive on the
    second loop, and their callback asked the first (closed) loop to run them: an error logged
    for each."""
    done = _run(STALE_LANE_RESULTS_ON_A_LATER_LOOP, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "second epoch whole: True" in done.stdout, done.stdout + done.stderr
    assert "callback errors: 0" in done.stdout, done.stdout + done.stderr


STARTING_AT_EXIT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import torch
    from torch.utils.data import Dataset
    from aioloader import AsyncDataLoader

    class Idx(Dataset):
        def __len__(self):
            return 100
        def __getitem__(self, i):
            return torch.tensor([i])

    def slow_init(worker_id):
        time.sleep(60)

    if __name__ == "__main__":
        loader = AsyncDataLoader(Idx(), batch_size=4, num_workers=2, persistent_workers=True,
                                 worker_init_fn=slow_init, multiprocessing_context="fork").sync()
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # the user's ^C
        try:
            for batch in loader:
                pass
        except KeyboardInterrupt:
            pass
        print(time.time(), flush=True)  # left open: the interpreter exits now
    """
)


def test_workers_still_starting_at_exit_do_not_hold_the_interpreter() -> None:
    """r4_bridge_exit_waits_startup: concurrent.futures' exit hook joins the workers, which were
    still in a 60 s worker_init_fn: they are killed first, as for a loader left open."""
    out = _run(STARTING_AT_EXIT, timeout=45)
    exited = time.time()
    assert out.returncode == 0, out.stderr
    assert exited - float(out.stdout.split()[-1]) < 10
