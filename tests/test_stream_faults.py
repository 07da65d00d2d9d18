"""User code on the loop that raises what an ``except Exception`` does not catch, or that will not
stop: the consumer gets an error at the batch's position, never a hang or a silent end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader, AsyncMapDataset


class Custom(BaseException):
    """Not an Exception: a plain ``except Exception`` lets it through."""


def make(kind: str) -> BaseException:
    return asyncio.CancelledError() if kind == "cancelled" else Custom("custom")


class Source:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        for i in range(6):
            yield torch.tensor([i])
        raise self.exc


class MapSource(AsyncMapDataset):
    def __init__(self, exc: BaseException, bad: int = 4) -> None:
        self.exc, self.bad = exc, bad

    def __len__(self) -> int:
        return 8

    async def __getitem__(self, i: int) -> torch.Tensor:
        await asyncio.sleep(0)
        if i == self.bad:
            raise self.exc
        return torch.tensor([i])


async def _drain(loader: AsyncDataLoader[Any]) -> tuple[list[list[int]], BaseException | None]:
    got: list[list[int]] = []
    async with loader, asyncio.timeout(60):
        try:
            async for batch in loader:
                got.append(batch.flatten().tolist())
        except RuntimeError as exc:
            return got, exc
    return got, None


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["cancelled", "custom"])
async def test_a_source_raising_a_base_exception_is_an_error_at_its_position(
    kind: str, num_workers: int
) -> None:
    loader = AsyncDataLoader(Source(make(kind)), batch_size=2, num_workers=num_workers)
    got, err = await _drain(loader)
    assert got == [[0, 1], [2, 3], [4, 5]]
    assert err is not None and "the async source raised" in str(err)
    assert isinstance(err.__cause__, type(make(kind)))


@pytest.mark.parametrize(("num_workers", "fetch_in"), [(0, "loop"), (2, "loop"), (2, "workers")])
@pytest.mark.parametrize("kind", ["cancelled", "custom", "stop"])
async def test_an_async_getitem_raising_what_except_exception_misses_is_an_error(
    kind: str, num_workers: int, fetch_in: Any
) -> None:
    exc = StopAsyncIteration() if kind == "stop" else make(kind)
    loader = AsyncDataLoader(
        MapSource(exc), batch_size=2, num_workers=num_workers, fetch_in=fetch_in
    )
    got, err = await _drain(loader)
    # The batch holding sample 4 fails; torch goes on after a failed batch, and so do we.
    assert got == [[0, 1], [2, 3]]
    assert err is not None
    if fetch_in == "loop":
        assert "MapSource's async __getitem__ raised" in str(err), err
        assert isinstance(err.__cause__, type(exc))
    else:  # raised in a worker: reported as torch reports a worker's error
        assert "in DataLoader worker process" in str(err), err
        assert type(exc).__name__ in str(err)


async def test_an_ack_raising_stop_async_iteration_does_not_end_the_epoch_silently() -> None:
    class Acking(Source):
        async def ack(self, samples: list[torch.Tensor]) -> None:
            raise StopAsyncIteration

    loader = AsyncDataLoader(Acking(ValueError("unused")), batch_size=2)
    got, err = await _drain(loader)
    assert got == [[0, 1]]  # the error comes when the consumer asks for the next batch
    assert err is not None and "ack() raised StopAsyncIteration" in str(err)


class Reconnecting:
    """Takes one cancellation for a dropped connection, reconnects, and waits again."""

    def __init__(self) -> None:
        self.cancels = 0

    async def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        for i in range(4):
            yield torch.tensor([i])
        while True:
            try:
                await asyncio.Event().wait()  # a quiet stream
            except asyncio.CancelledError:
                self.cancels += 1
                if self.cancels > 1:
                    raise


async def test_a_source_that_swallows_one_cancellation_still_lets_aclose_return() -> None:
    source = Reconnecting()
    loader = AsyncDataLoader(source, batch_size=2, max_batch_latency=0.05)
    async with asyncio.timeout(30):
        async with loader:
            async for _ in loader:
                break
    assert source.cancels == 2


async def _numbers() -> AsyncIterator[torch.Tensor]:
    for i in range(4):
        yield torch.tensor([i])


def test_an_async_generator_function_passed_uncalled_is_refused_with_advice() -> None:
    with pytest.raises(TypeError, match=r"generator function _numbers itself.*call it"):
        AsyncDataLoader(_numbers, batch_size=2)  # type: ignore[arg-type]


async def test_a_second_epoch_over_a_used_up_async_generator_warns() -> None:
    loader = AsyncDataLoader(_numbers(), batch_size=2)
    async with loader, asyncio.timeout(30):
        assert len([b async for b in loader]) == 2
        with pytest.warns(RuntimeWarning, match="async generator _numbers was used up"):
            assert [b async for b in loader] == []
