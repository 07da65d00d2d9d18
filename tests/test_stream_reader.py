"""The async source's reader: samples in a bounded buffer, taken by the window in bulk."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from aioloader import AsyncDataLoader, _stream


async def _count(n: int, gate: asyncio.Event | None = None) -> AsyncIterator[int]:
    for i in range(n):
        if gate is not None and i == n // 2:
            await gate.wait()
        yield i


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_the_reader_fills_its_buffer_and_holds_one_more_while_it_is_full() -> None:
    reading = _stream._Reader(_count(100), 8)
    task = asyncio.create_task(reading.run())
    await _settle()
    assert list(reading.samples) == list(range(8))  # full: the 9th is held, not read further
    assert len(reading.arrived) == 8
    window: list[int] = []
    first = reading.take(window, 100)
    assert window == list(range(8))  # everything waiting, in one call
    assert first > 0  # the first sample's arrival (loop time): a window's deadline starts there
    assert not reading.samples and not reading.arrived
    await _settle()
    assert list(reading.samples) == list(range(8, 16))  # refilled once there was room
    reading.take(window, 3)  # a window with room for 3 takes 3
    assert window == list(range(11)) and list(reading.samples)[:1] == [11]
    await reading.stop(task)
    assert task.done()


async def test_the_end_comes_after_the_last_sample_and_wait_is_cancel_safe() -> None:
    gate = asyncio.Event()
    reading = _stream._Reader(_count(6, gate), 64)
    task = asyncio.create_task(reading.run())
    await _settle()
    window: list[int] = []
    reading.take(window, 64)
    assert window == [0, 1, 2] and not reading.ready()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await reading.wait()  # nothing there: cancelled, nothing lost
    gate.set()
    await reading.wait()
    await _settle()
    assert reading.end is not None and reading.end.error is None
    assert reading.samples  # the end waits behind the last samples
    reading.take(window, 64)
    assert window == list(range(6)) and reading.ready() and not reading.samples
    await task


async def test_a_source_failing_ends_the_reader_with_its_error() -> None:
    async def failing() -> AsyncIterator[int]:
        yield 1
        raise ValueError("boom")

    reading = _stream._Reader(failing(), 4)
    await reading.run()
    assert list(reading.samples) == [1]
    assert reading.end is not None and isinstance(reading.end.error, ValueError)


class _Unpaced:
    def __init__(self, n: int) -> None:
        self.n = n

    async def __aiter__(self) -> AsyncIterator[int]:
        for i in range(self.n):
            yield i


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_an_unpaced_stream_arrives_whole_and_in_order(num_workers: int) -> None:
    async with AsyncDataLoader(
        _Unpaced(10_000), batch_size=64, num_workers=num_workers, collate_fn=list
    ) as loader:
        got = [x async for batch in loader for x in batch]
    assert got == list(range(10_000))
