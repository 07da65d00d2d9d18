"""Attributes changed between epochs, as torch's DataLoader allows: checked when set, and the
next epoch runs with the new value."""

from __future__ import annotations

import asyncio

import pytest

from aioloader import AsyncDataLoader
from tests import datasets


@pytest.mark.parametrize("value", [0, -1, 2.5, "2", True, None])
def test_a_bad_prefetch_factor_is_refused_when_set(value: object) -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(8), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="prefetch_factor must be at least 1 and an int"):
        loader.prefetch_factor = value  # type: ignore[assignment]
    assert loader.prefetch_factor == 2  # unchanged


def test_prefetch_factor_without_workers_is_refused_as_torch_does() -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(8), batch_size=2)
    with pytest.raises(ValueError, match="only be specified in multiprocessing"):
        loader.prefetch_factor = 2


async def test_a_changed_prefetch_factor_bounds_the_next_epoch() -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(64), batch_size=1, num_workers=2)
    loader.prefetch_factor = 1
    async with loader:
        it = aiter(loader)
        async with asyncio.timeout(60):
            first = await anext(it)
            await asyncio.sleep(0.3)  # time for the workers to load ahead, up to the bound
            assert loader.stats().batches_in_flight <= 2 * 1
            rest = [b async for b in it]
    assert [int(x) for x in [first, *rest]] == list(range(64))


@pytest.mark.parametrize("value", [-1, 1.5, "2"])
def test_a_bad_num_workers_is_refused_when_set(value: object) -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(8), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="num_workers option should be non-negative"):
        loader.num_workers = value  # type: ignore[assignment]


@pytest.mark.parametrize("new", [4, 1])
async def test_num_workers_changed_on_a_persistent_loader_takes_effect_next_epoch(new: int) -> None:
    loader = AsyncDataLoader(
        datasets.RangeDataset(20), batch_size=2, num_workers=2, persistent_workers=True
    )
    async with loader, asyncio.timeout(120):
        first = [b.flatten().tolist() async for b in loader]
        loader.num_workers = new
        second = [b.flatten().tolist() async for b in loader]
        third = [b.flatten().tolist() async for b in loader]  # the new workers persist
    expected = [[i, i + 1] for i in range(0, 20, 2)]
    assert first == second == third == expected


async def test_workers_set_on_a_loader_made_without_get_torchs_default_prefetch() -> None:
    loader = AsyncDataLoader(datasets.RangeDataset(8), batch_size=2)
    loader.num_workers = 2
    assert loader.prefetch_factor == 2
    async with loader, asyncio.timeout(60):
        assert [b.flatten().tolist() async for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]


async def test_a_bad_timeout_set_later_fails_the_next_epoch_with_torchs_error() -> None:
    """torch checks timeout only in its constructor; here the next epoch's plan checks it."""
    async with AsyncDataLoader(datasets.RangeDataset(4), batch_size=2) as loader:
        loader.timeout = -1
        with pytest.raises(ValueError, match="timeout option should be non-negative"):
            aiter(loader)
        loader.timeout = 0
        async with asyncio.timeout(30):
            assert len([b async for b in loader]) == 2


async def test_settings_changed_during_an_epoch_reach_the_next_one_not_the_running_one() -> None:
    """A running epoch runs from the plan made when it began: a timeout and a prefetch depth
    set half-way through apply from the next epoch on."""
    loader = AsyncDataLoader(
        datasets.SlowDataset(6, delay=0.2), batch_size=1, num_workers=1, prefetch_factor=1
    )
    async with loader, asyncio.timeout(60):
        got = []
        async for batch in loader:
            got.append(int(batch))
            if len(got) == 1:
                loader.timeout = 0.05  # far shorter than a batch takes
                loader.prefetch_factor = 4
                await asyncio.sleep(0.5)
                assert loader.stats().batches_in_flight <= 1  # still this epoch's bound
        assert got == list(range(6))
        with pytest.raises(TimeoutError):
            async for _ in loader:
                pass
