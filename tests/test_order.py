"""Same batches in the same order as torch's DataLoader, every sample exactly once per epoch."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler

from aioloader import AsyncDataLoader
from tests import datasets
from tests.conftest import collect, torch_batches


def _norm(batches: list[Any]) -> list[Any]:
    def conv(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.tolist()
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [conv(v) for v in x]
        return x

    return [conv(b) for b in batches]


class EveryThird(Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(0, self.n, 3))

    def __len__(self) -> int:
        return len(range(0, self.n, 3))


MAP_CASES: list[Any] = [
    pytest.param({"batch_size": 4}, id="sequential"),
    pytest.param({"batch_size": 4, "drop_last": True}, id="drop_last"),
    pytest.param({"batch_size": None}, id="no-auto-collation"),
    pytest.param({"batch_size": 5, "sampler": EveryThird(40)}, id="custom-sampler"),
    pytest.param({"batch_sampler": [[3, 1], [0], [39, 38, 37]]}, id="custom-batch-sampler"),
    pytest.param(
        {"batch_sampler": BatchSampler(RandomSampler(range(40)), 6, False)}, id="batch-sampler-obj"
    ),
]


@pytest.mark.loops
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kwargs", MAP_CASES)
async def test_map_style_matches_torch(num_workers: int, kwargs: dict[str, Any]) -> None:
    ds = datasets.RangeDataset(40)
    if isinstance(kwargs.get("batch_sampler"), BatchSampler):
        torch.manual_seed(0)
        expected = _norm(torch_batches(ds, num_workers=0, **kwargs))
        torch.manual_seed(0)
    else:
        expected = _norm(torch_batches(ds, num_workers=0, **kwargs))
    async with AsyncDataLoader(ds, num_workers=num_workers, **kwargs) as loader:
        got = _norm(await collect(loader))
    assert got == expected


@pytest.mark.loops
@pytest.mark.parametrize("num_workers", [0, 2])
async def test_shuffle_with_generator_matches_torch_over_epochs(num_workers: int) -> None:
    ds = datasets.RangeDataset(50)
    ref = DataLoader(ds, batch_size=7, shuffle=True, generator=torch.Generator().manual_seed(3))
    expected = [_norm(list(ref)) for _ in range(3)]
    gen = torch.Generator().manual_seed(3)
    async with AsyncDataLoader(
        ds, batch_size=7, shuffle=True, generator=gen, num_workers=num_workers
    ) as loader:
        got = [_norm(await collect(loader)) for _ in range(3)]
    assert got == expected
    assert got[0] != got[1]  # reshuffled each epoch


@pytest.mark.loops
async def test_shuffle_persistent_workers_matches_torch() -> None:
    ds = datasets.RangeDataset(30)
    kw: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    ref = DataLoader(ds, generator=torch.Generator().manual_seed(5), persistent_workers=True, **kw)
    expected = [_norm(list(ref)) for _ in range(2)]
    del ref
    gen = torch.Generator().manual_seed(5)
    async with AsyncDataLoader(ds, generator=gen, persistent_workers=True, **kw) as loader:
        got = [_norm(await collect(loader)) for _ in range(2)]
    assert got == expected


async def test_dict_batches_match_torch() -> None:
    ds = datasets.DictDataset(10)
    expected = _norm(torch_batches(ds, batch_size=4))
    async with AsyncDataLoader(ds, batch_size=4, num_workers=2) as loader:
        assert _norm(await collect(loader)) == expected


async def test_getitems_is_used_like_torch() -> None:
    ds = datasets.GetItemsDataset(12)
    expected = _norm(torch_batches(ds, batch_size=5))
    assert expected[0] == [[0], [10], [20], [30], [40]]
    async with AsyncDataLoader(ds, batch_size=5, num_workers=2) as loader:
        assert _norm(await collect(loader)) == expected


async def test_every_start_method_delivers_in_order(start_method: str) -> None:
    ds = datasets.RangeDataset(64)
    expected = _norm(torch_batches(ds, batch_size=4))
    async with AsyncDataLoader(
        ds, batch_size=4, num_workers=2, multiprocessing_context=start_method
    ) as loader:
        assert _norm(await collect(loader)) == expected


@pytest.mark.loops
async def test_out_of_order_delivers_every_sample_once() -> None:
    ds = datasets.SlowDataset(40, 0.002)
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2, in_order=False) as loader:
        got = await collect(loader)
    counts = Counter(int(x) for b in got for x in b.flatten())
    assert counts == Counter(range(40))


@pytest.mark.loops
@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("drop_last", [False, True])
async def test_iterable_matches_torch(num_workers: int, drop_last: bool) -> None:
    ds = datasets.ShardedIterable(23)
    kw: dict[str, Any] = {"batch_size": 4, "drop_last": drop_last}
    expected = _norm(torch_batches(ds, num_workers=num_workers, **kw))
    async with AsyncDataLoader(ds, num_workers=num_workers, **kw) as loader:
        got = _norm(await collect(loader))
    assert got == expected


async def test_iterable_uneven_workers_matches_torch() -> None:
    ds = datasets.UnevenIterable([2, 9])
    for kw in ({"batch_size": 2}, {"batch_size": None}):
        expected = _norm(torch_batches(ds, num_workers=2, **kw))
        async with AsyncDataLoader(ds, num_workers=2, **kw) as loader:
            assert _norm(await collect(loader)) == expected


async def test_iterable_out_of_order_hands_batches_only_to_workers_with_room() -> None:
    """torch's rule for in_order=False: a worker gets a batch only while it holds less than its
    share of the in-flight bound, so worker 1, stuck on its slow first item, does not collect
    worker 0's turns: all of worker 0's items come first (torch's own test expects this)."""
    ds = datasets.HalvesIterable(10, slow_s=2.0)
    async with AsyncDataLoader(ds, num_workers=2, in_order=False) as loader:
        got = [(int(w), int(i)) for w, i in await collect(loader)]
    assert got == [(0, i) for i in range(5)] + [(1, i) for i in range(5, 10)]


async def test_iterable_without_sharding_duplicates_like_torch() -> None:
    ds = datasets.UnevenIterable([5, 5])  # worker k yields k*1000 + j: no sharding by index
    expected = _norm(torch_batches(ds, batch_size=2, num_workers=2))
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2) as loader:
        assert _norm(await collect(loader)) == expected


async def test_iterable_spawn_and_persistent_epochs(start_method: str) -> None:
    ds = datasets.ShardedIterable(10)
    expected = _norm(torch_batches(ds, batch_size=3, num_workers=2))
    async with AsyncDataLoader(
        ds,
        batch_size=3,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context=start_method,
    ) as loader:
        for _ in range(2):
            assert _norm(await collect(loader)) == expected


async def test_iterable_len_mismatch_warns_like_torch() -> None:
    class Liar(datasets.ShardedIterable):
        def __len__(self) -> int:
            return 3

    loader = AsyncDataLoader(Liar(6), batch_size=None)
    assert len(loader) == 3
    with pytest.warns(UserWarning, match="was reported to be 3"):
        async with loader:
            assert len(await collect(loader)) == 6
