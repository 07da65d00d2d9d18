"""The synchronous bridge, ``for batch in loader.sync()``: torch's loop, the loader's guarantees."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from torch.utils.data import DataLoader

from aioloader import AsyncDataLoader, LoaderClosedError, SyncDataLoader
from tests import datasets
from tests.conftest import worker_processes

ROOT = Path(__file__).resolve().parent.parent

REPO = Path(__file__).resolve().parent.parent


def bridge_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aioloader-bridge")]


def flat(batches: list[Any]) -> list[list[int]]:
    return [b.flatten().tolist() for b in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epochs_yield_torchs_batches_in_order(num_workers: int) -> None:
    ds = datasets.RangeDataset(23)
    gen = torch.Generator().manual_seed(5)
    ref_gen = torch.Generator().manual_seed(5)
    ref = DataLoader(ds, batch_size=4, shuffle=True, generator=ref_gen, num_workers=num_workers)
    loader = AsyncDataLoader(
        ds, batch_size=4, shuffle=True, generator=gen, num_workers=num_workers
    ).sync()
    with loader:
        assert len(loader) == len(ref) == 6
        for _ in range(2):
            assert flat(list(loader)) == flat(list(ref))
        assert loader.stats().batches_delivered == 12
    assert bridge_threads() == []


def test_sync_returns_one_bridge_with_torchs_attributes() -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(10), batch_size=3, num_workers=1)
    bridge = loader.sync()
    assert loader.sync() is bridge and bridge.loader is loader
    assert isinstance(bridge, SyncDataLoader)
    assert (bridge.batch_size, bridge.num_workers, bridge.prefetch_factor) == (3, 1, 2)
    assert bridge.dataset is loader.dataset
    bridge.close()  # never iterated: closes the loader all the same
    with pytest.raises(LoaderClosedError):
        aiter(loader)
    assert bridge_threads() == []


def test_worker_error_keeps_type_and_traceback_and_the_epoch_goes_on() -> None:
    ds = datasets.RaisingDataset(8, bad=2)
    out: list[Any] = []
    with AsyncDataLoader(ds, batch_size=2, num_workers=2).sync() as loader:
        it = iter(loader)
        for _ in range(4):
            try:
                out.append(next(it).flatten().tolist())
            except ValueError as exc:
                msg = str(exc)
                assert "bad sample 2" in msg
                assert "Caught ValueError in DataLoader worker process" in msg
                assert "Traceback" in msg and "__getitem__" in msg
                out.append("error")
        with pytest.raises(StopIteration):
            next(it)
    assert out == [[0, 1], "error", [4, 5], [6, 7]]  # what torch's iterator yields


@pytest.mark.timeout(60)
def test_the_timeout_is_raised_to_a_synchronous_caller() -> None:
    """LoaderTimeoutError is a TimeoutError, the class concurrent.futures raises for a wait
    that ran out: the bridge must tell the loader's answer from its own polling."""
    from aioloader import LoaderTimeoutError

    ds = datasets.SlowDataset(6, delay=5.0)
    with AsyncDataLoader(ds, batch_size=2, num_workers=1, timeout=0.5).sync() as loader:
        t0 = time.monotonic()
        with pytest.raises(LoaderTimeoutError, match=r"timed out after 0\.5 seconds"):
            next(iter(loader))
        assert time.monotonic() - t0 < 4  # the deadline, not the 5 s read


@pytest.mark.timeout(60)
def test_a_datasets_own_timeout_error_reaches_a_synchronous_caller_and_the_epoch_goes_on() -> None:
    ds = datasets.RaisingDataset(6, bad=2, exc_type=TimeoutError)
    got: list[Any] = []
    with AsyncDataLoader(ds, batch_size=2, num_workers=2).sync() as loader:
        it = iter(loader)
        for _ in range(3):
            try:
                got.append(next(it).flatten().tolist())
            except TimeoutError as exc:
                assert "bad sample 2" in str(exc)
                got.append("error")
    assert got == [[0, 1], "error", [4, 5]]


def test_a_killed_worker_is_replaced_and_every_sample_arrives_once(tmp_path: Path) -> None:
    ds = datasets.ExitOnceDataset(20, bad=7, marker=str(tmp_path / "died"))
    with AsyncDataLoader(ds, batch_size=2, num_workers=2).sync() as loader:
        with pytest.warns(RuntimeWarning, match=r"SIGKILL.*send_idx=3.*\[6, 7\]"):
            got = flat(list(loader))
        assert loader.stats().worker_restarts == 1
    assert got == [[i, i + 1] for i in range(0, 20, 2)]


def test_an_error_out_of_the_for_loop_releases_the_workers_while_its_traceback_lives() -> None:
    before = worker_processes()
    ds = datasets.RaisingDataset(8, bad=2)
    with AsyncDataLoader(ds, batch_size=2, num_workers=2).sync() as loader:
        with pytest.raises(ValueError, match="bad sample 2") as info:
            for _ in loader:
                pass
        assert info.tb is not None  # kept, as a REPL keeps sys.last_traceback
        deadline = time.monotonic() + 30  # the epoch's end is handed to its loop
        while worker_processes() - before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker_processes() - before == set()


def test_break_releases_the_workers_before_the_loop_goes_on() -> None:
    before = worker_processes()
    with AsyncDataLoader(datasets.SlowDataset(40, 0.01), batch_size=2, num_workers=2).sync() as ld:
        for batch in ld:
            assert worker_processes() - before, "no worker running during the epoch"
            assert batch.flatten().tolist() == [0, 1]
            break
        assert worker_processes() - before == set()
        assert flat(list(ld))[:2] == [[0, 1], [2, 3]]  # the next epoch starts afresh


def test_garbage_collection_ends_epoch_and_thread() -> None:
    before = worker_processes()
    loader = AsyncDataLoader(datasets.SlowDataset(40, 0.01), batch_size=2, num_workers=2)
    it = iter(loader.sync())
    assert next(it).flatten().tolist() == [0, 1]
    assert bridge_threads() == ["aioloader-bridge"]
    del it  # the dropped iterator ends its epoch
    assert worker_processes() - before == set()
    ref = weakref.ref(loader)
    del loader
    deadline = time.monotonic() + 10  # a callback still queued on the loop may hold the epoch
    while ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert ref() is None, "the bridge keeps its loader alive"
    assert bridge_threads() == []  # its finalizer joined the thread


def test_persistent_workers_serve_every_epoch_until_close() -> None:
    before = worker_processes()
    ds = datasets.PidDataset(8)
    with AsyncDataLoader(ds, batch_size=2, num_workers=2, persistent_workers=True).sync() as ld:
        first = list(ld)
        workers = worker_processes() - before
        assert len(workers) == 2
        second = list(ld)
        assert worker_processes() - before == workers
    assert [b[:, 0].tolist() for b in first] == [b[:, 0].tolist() for b in second]
    assert worker_processes() - before == set()


def test_keyboard_interrupt_ends_the_epoch_and_the_loader_goes_on(tmp_path: Path) -> None:
    """Ctrl-C while the script waits for a batch: the epoch ends (workers released), the
    interrupt reaches the script, and the next epoch works."""
    gate = tmp_path / "gate"
    before = worker_processes()
    ds = datasets.GatedDataset(12, open_below=2, gate=str(gate))
    main = threading.get_ident()
    go, abort = threading.Event(), threading.Event()

    def interrupt() -> None:
        if go.wait(60) and not abort.is_set():
            signal.pthread_kill(main, signal.SIGINT)

    sender = threading.Thread(target=interrupt)
    sender.start()
    with AsyncDataLoader(ds, batch_size=2, num_workers=2).sync() as loader:
        try:
            with pytest.raises(KeyboardInterrupt):  # wherever it lands, the gate holds the loop
                it = iter(loader)
                assert next(it).flatten().tolist() == [0, 1]
                go.set()
                for _ in it:
                    pass
        finally:
            if not go.is_set():  # failed before the interrupt: send none
                abort.set()
                go.set()
            sender.join()
        del it
        # The interrupt returns at once; the loop releases the workers right after.
        deadline = time.monotonic() + 30
        while worker_processes() - before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker_processes() - before == set()
        gate.touch()
        assert len(list(loader)) == 6


def test_state_dict_resumes_a_synchronous_epoch() -> None:
    ds = datasets.RangeDataset(20)

    def make() -> SyncDataLoader[Any]:
        gen = torch.Generator().manual_seed(3)
        return AsyncDataLoader(ds, batch_size=3, shuffle=True, generator=gen, num_workers=2).sync()

    with make() as reference:
        full = flat(list(reference))
    with make() as loader:
        it = iter(loader)
        head = [next(it).flatten().tolist() for _ in range(3)]
        state = loader.state_dict()
        del it
    with make() as resumed:
        resumed.load_state_dict(state)
        assert head + flat(list(resumed)) == full


def test_closed_loader_refuses_without_starting_a_thread() -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(4), batch_size=2)
    asyncio.run(loader.aclose())
    with pytest.raises(LoaderClosedError, match="create a new AsyncDataLoader"):
        iter(loader.sync())
    with pytest.raises(LoaderClosedError), loader.sync():
        pass
    loader.sync().close()  # idempotent
    assert bridge_threads() == []


def test_an_epoch_open_when_the_bridge_closes_says_so() -> None:
    before = worker_processes()
    with AsyncDataLoader(datasets.RangeDataset(8), batch_size=2, num_workers=2).sync() as loader:
        it = iter(loader)
        assert next(it).flatten().tolist() == [0, 1]
    assert worker_processes() - before == set() and bridge_threads() == []
    with pytest.raises(LoaderClosedError, match=r"closed .* while this epoch was running"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_plain_for_names_async_for_and_the_bridge() -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(4))
    with pytest.raises(TypeError, match=r"async for batch in loader.*loader\.sync\(\)"):
        for _ in loader:  # type: ignore[attr-defined]
            pass


async def test_async_for_over_the_bridge_names_the_loader_itself() -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(4))
    with pytest.raises(TypeError, match=r"synchronous code.*`async for batch in loader:`"):
        async for _ in loader.sync():
            pass
    assert bridge_threads() == []


@pytest.mark.skipif(torch.accelerator.is_available(), reason="needs a machine with no accelerator")
def test_the_pin_memory_warning_comes_once_per_loader_at_the_callers_line() -> None:
    """torch's persistent iterator warns once; through the bridge the warning names the caller's
    `for` line, not the bridge's thread."""
    bridge = AsyncDataLoader(
        datasets.RangeDataset(4), batch_size=2, num_workers=1, persistent_workers=True,
        pin_memory=True,
    ).sync()  # fmt: skip
    with bridge, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for _ in bridge:
                pass
    pins = [w for w in caught if "no accelerator is found" in str(w.message)]
    assert [(w.filename, w.lineno) for w in pins] == [(__file__, pins[0].lineno)]


async def test_bridge_refuses_inside_a_running_loop() -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(4), batch_size=2)
    with pytest.raises(RuntimeError, match=r"event loop is running in this thread.*async for"):
        iter(loader.sync())
    assert bridge_threads() == []
    async with loader:  # the loader itself is untouched
        assert len([b async for b in loader]) == 2


async def test_bridge_from_a_thread_of_a_running_loop() -> None:
    """Synchronous training code run with asyncio.to_thread may use the bridge."""
    bridge = AsyncDataLoader(datasets.RangeDataset(6), batch_size=2, num_workers=1).sync()

    def train() -> list[list[int]]:
        with bridge:
            return flat(list(bridge))

    async with asyncio.timeout(60):
        assert await asyncio.to_thread(train) == [[0, 1], [2, 3], [4, 5]]


def test_trio_is_refused_with_a_clear_error() -> None:
    anyio = pytest.importorskip("anyio")
    pytest.importorskip("trio")
    loader = AsyncDataLoader(datasets.RangeDataset(4))

    async def use() -> None:
        async with loader:
            pass

    with pytest.raises(RuntimeError, match=r"needs an asyncio event loop.*running here: trio"):
        anyio.run(use, backend="trio")
    with pytest.raises(RuntimeError, match=r"needs an asyncio event loop.*running here: none"):
        aiter(loader)


def test_unclosed_bridge_in_a_script_exits_cleanly(tmp_path: Path) -> None:
    """A torch-style script that never closes its loader (persistent workers, mid-epoch) exits
    at once, its workers stopped."""
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            from aioloader import AsyncDataLoader
            from tests.datasets import PidDataset

            if __name__ == "__main__":
                loader = AsyncDataLoader(
                    PidDataset(40), batch_size=2, num_workers=2, persistent_workers=True
                ).sync()
                for epoch in range(2):
                    for i, batch in enumerate(loader):
                        pids = {int(p) for p in batch[:, 1]}
                        if epoch == 1 and i == 3:
                            break
                it = iter(loader)
                next(it)
                print(" ".join(str(p) for p in pids), flush=True)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ResourceWarning" not in proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert pids
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, f"worker {pid} lives"


CTRL_C_DURING_STARTUP = textwrap.dedent(
    """
    import signal, threading, time
    import torch
    from aioloader import AsyncDataLoader

    class SlowPickle(torch.utils.data.Dataset):
        # spawn pickles the dataset before any worker starts: a big dataset takes this long
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return torch.tensor([i])

        def __getstate__(self):
            time.sleep(8.0)
            return self.__dict__

    if __name__ == "__main__":
        bridge = AsyncDataLoader(
            SlowPickle(), batch_size=2, num_workers=2, multiprocessing_context="spawn"
        ).sync()
        sent = []
        # A ^C that the kernel hands to another thread of the process (as a terminal's may be):
        threading.Timer(
            0.5, lambda: (sent.append(time.monotonic()), signal.raise_signal(signal.SIGINT))
        ).start()
        try:
            for _ in bridge:
                pass
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - sent[0]:.2f}", flush=True)
        bridge.close()
        print("closed", flush=True)
    """
)


def test_a_ctrl_c_while_the_workers_start_reaches_the_caller_at_once(tmp_path: Path) -> None:
    script = tmp_path / "ctrl_c.py"  # a file: spawn re-imports the main module
    script.write_text(CTRL_C_DURING_STARTUP)
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert "closed" in proc.stdout, proc.stdout + proc.stderr
    took = float(proc.stdout.split("interrupted after ")[1].split()[0])
    assert took < 4.0, took  # not the 8 s the start-up takes
