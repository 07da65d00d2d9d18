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
