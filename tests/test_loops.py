"""Event loops and frameworks (asyncio, uvloop, anyio), and the loader used from the wrong place.

Tests marked ``loops`` (here and in test_order.py / test_lifecycle.py) run once per event loop
through pytest-asyncio's loop-factory hook in conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from aioloader import AsyncDataLoader, EpochEndedError
from tests import datasets
from tests.conftest import LOOP_FACTORIES, collect, worker_processes

RANGE = datasets.RangeDataset(16)
REF = [[[4 * b + i] for i in range(4)] for b in range(4)]  # torch's batches of RANGE, size 4


def _lists(batches: list[Any]) -> list[Any]:
    return [b.tolist() for b in batches]


@pytest.mark.loops
async def test_marked_tests_run_under_each_event_loop(request: pytest.FixtureRequest) -> None:
    """The ``loops`` marker really changes the loop (a parameter that did nothing would pass)."""
    factory = request.node.callspec.params["_asyncio_loop_factory"]
    name = next(n for n, f in LOOP_FACTORIES.items() if f is factory)
    loop = asyncio.get_running_loop()
    assert ("uvloop" in type(loop).__module__) == (name == "uvloop"), (name, type(loop))
    async with AsyncDataLoader(RANGE, batch_size=4, num_workers=2) as loader:
        assert _lists(await collect(loader)) == REF


def test_uvloop_is_among_the_loops_when_installed() -> None:
    pytest.importorskip("uvloop")
    assert set(LOOP_FACTORIES) == {"asyncio", "uvloop"}


# ---------------------------------------------------------------------------------- anyio


def test_under_anyio_a_cancel_scope_ends_the_epoch_like_a_task_cancel() -> None:
    """``move_on_after`` around the loop (anyio on asyncio) ends the epoch and frees its workers
    at once; the iterator then raises EpochEndedError, as after cancelling the consumer task."""
    gate = "/nonexistent/aioloader-never"  # batches from index 8 on never come

    async def main() -> tuple[list[Any], bool, set[int], type[BaseException] | None]:
        got: list[Any] = []
        async with AsyncDataLoader(
            datasets.GatedDataset(16, open_below=8, gate=gate, limit=30),
            batch_size=4,
            num_workers=2,
        ) as loader:
            it = aiter(loader)
            with anyio.move_on_after(30) as outer:  # a hang fails below, not forever
                with anyio.move_on_after(0.5) as scope:
                    while True:
                        got.append(await anext(it))
            assert not outer.cancel_called
            left = worker_processes()  # the epoch's cleanup runs on; give it a moment
            with anyio.fail_after(30):
                while left:
                    await anyio.sleep(0.02)
                    left = worker_processes()
            again: type[BaseException] | None = None
            try:
                await anext(it)
            except BaseException as exc:
                again = type(exc)
            return got, scope.cancelled_caught, left, again

    got, caught, left, again = anyio.run(main, backend="asyncio")
    assert caught
    assert _lists(got) == REF[:2]
    assert not left
    assert again is EpochEndedError


def test_under_anyio_asyncio_backend_batches_match_torch() -> None:
    async def main() -> list[Any]:
        async with AsyncDataLoader(RANGE, batch_size=4, num_workers=2) as loader:
            with anyio.fail_after(60):
                return [b async for b in loader]

    assert _lists(anyio.run(main, backend="asyncio")) == REF


def test_under_trio_the_loader_says_it_needs_asyncio() -> None:
    pytest.importorskip("trio")
    errors: list[str] = []

    async def main() -> None:
        loader = AsyncDataLoader(RANGE, batch_size=4, num_workers=2)
        with pytest.raises(RuntimeError) as aenter:
            async with loader:
                pass
        errors.append(str(aenter.value))
        with pytest.raises(RuntimeError) as iterate:
            async for _ in loader:
                pass
        errors.append(str(iterate.value))

    anyio.run(main, backend="trio")
    for msg in errors:
        assert "trio" in msg and "needs an asyncio event loop" in msg, msg
        assert "backend='asyncio'" in msg, msg


# -------------------------------------------------------------------- one loader, many users


@pytest.mark.loops
async def test_one_iterator_awaited_by_two_tasks_at_once_raises() -> None:
    """Two tasks sharing one epoch's iterator: the second concurrent ``__anext__`` raises a clear
    RuntimeError (as an async generator does); the first task's batch and the epoch go on."""
    async with AsyncDataLoader(RANGE, batch_size=4, num_workers=2) as loader:
        it = aiter(loader)
        first = asyncio.ensure_future(anext(it))
        await asyncio.sleep(0)  # let it start waiting (a scheduling step, not a timed wait)
        with pytest.raises(RuntimeError, match="already being awaited"):
            await anext(it)
        async with asyncio.timeout(30):
            got = [await first]
            got += [b async for b in it]
    assert _lists(got) == REF


@pytest.mark.loops
async def test_two_tasks_each_iterating_the_loader_get_every_batch() -> None:
    """Without persistent workers, two tasks each running ``async for`` are two epochs."""
    async with AsyncDataLoader(RANGE, batch_size=4, num_workers=2) as loader:
        a, b = await asyncio.gather(collect(loader), collect(loader))
    assert _lists(a) == REF and _lists(b) == REF


@pytest.mark.parametrize("persistent", [False, True])
def test_one_loader_across_consecutive_asyncio_runs(persistent: bool) -> None:
    """Two ``asyncio.run`` calls one after the other may share a loader: each epoch belongs to
    the loop that runs it (persistent workers outlive the first loop and serve the second)."""
    loader = AsyncDataLoader(
        datasets.PidDataset(8), batch_size=4, num_workers=2, persistent_workers=persistent
    )

    async def epoch() -> list[Any]:
        return await collect(loader)

    async def last_epoch_and_close() -> list[Any]:
        async with loader:
            return await collect(loader)

    first = asyncio.run(epoch())
    second = asyncio.run(last_epoch_and_close())
    assert [b[:, 0].tolist() for b in first] == [b[:, 0].tolist() for b in second]
    pids = [{int(p) for b in e for p in b[:, 1]} for e in (first, second)]
    assert (pids[0] == pids[1]) if persistent else pids[0].isdisjoint(pids[1])
    assert not worker_processes()


def test_one_loader_on_two_running_loops_at_once_raises(tmp_path: Path) -> None:
    """A loader iterated on a second event loop (another thread's ``asyncio.run``) while an epoch
    runs on the first: a clear RuntimeError, and the first loop's epoch is not disturbed."""
    loader = AsyncDataLoader(
        datasets.GatedDataset(16, open_below=4, gate=str(tmp_path / "gate"), limit=30),
        batch_size=4,
        num_workers=2,
    )
    first_batch = threading.Event()
    go_on = threading.Event()
    result: dict[str, Any] = {}

    async def on_first_loop() -> None:
        async with asyncio.timeout(60):
            it = aiter(loader)
            got = [await anext(it)]
            first_batch.set()
            await asyncio.to_thread(go_on.wait, 30)
            got += [b async for b in it]
            result["first"] = got
            await loader.aclose()

    def thread_main() -> None:
        try:
            asyncio.run(on_first_loop())
        except BaseException as exc:
            result["thread_error"] = exc

    thread = threading.Thread(target=thread_main)
    thread.start()
    try:
        assert first_batch.wait(30), result

        async def on_second_loop() -> tuple[str, str]:
            with pytest.raises(RuntimeError, match="another event loop") as iterate:
                async with asyncio.timeout(30):
                    async for _ in loader:
                        pass
            with pytest.raises(RuntimeError, match="another event loop") as close:
                await loader.aclose()
            return str(iterate.value), str(close.value)

        msgs = asyncio.run(on_second_loop())
    finally:
        (tmp_path / "gate").touch()
        go_on.set()
        thread.join(60)
    assert not thread.is_alive()
    assert "thread_error" not in result, result
    assert _lists(result["first"]) == REF
    for msg in msgs:
        assert "one loader per event loop" in msg, msg
    assert not worker_processes()


def test_ref_is_torchs() -> None:
    got = list(torch.utils.data.DataLoader(RANGE, batch_size=4))
    assert _lists(got) == REF


# ------------------------------------------------------------------- the loop gets its turns


@pytest.mark.loops
async def test_buffered_batches_are_handed_over_with_a_loop_turn_between_them() -> None:
    """A consumer working through a full buffer yields to the loop between batches, so other
    tasks (a service's requests) are not held up for the whole buffer."""
    async with AsyncDataLoader(
        datasets.RangeDataset(64), batch_size=4, num_workers=2, prefetch_factor=2
    ) as loader:
        it = aiter(loader)
        await anext(it)
        reorder = it._epoch.reorder  # type: ignore[attr-defined]
        async with asyncio.timeout(30):
            # Poll the buffer (it offers no event): wait until every batch in flight arrived.
            while len(reorder) < 4:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        turns = 0

        async def other_task() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(other_task())
        await asyncio.sleep(0)
        seen = []
        for _ in range(4):
            await anext(it)  # already buffered
            seen.append(turns)
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
    assert len(set(seen)) == 4, f"the other task ran only at turns {seen}"
