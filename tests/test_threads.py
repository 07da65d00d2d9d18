"""Thread workers: per-thread ``get_worker_info()``, seeded generators, argument checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from aioloader import AsyncDataLoader
from tests import datasets
from tests.conftest import collect


class DrawDataset(Dataset[tuple[int, str, float, float]]):
    """Sample i: (worker id, worker_method, a draw from the worker's random and torch rngs)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> tuple[int, str, float, float]:
        info = get_worker_info()
        assert info is not None
        rng: Any = info.rng
        draw = float(torch.rand((), generator=rng.torch_generator))
        return info.id, str(info.worker_method), rng.random_generator.random(), draw


async def _draws(seed: int) -> list[Any]:
    loader = AsyncDataLoader(
        DrawDataset(),
        batch_size=None,
        num_workers=2,
        executor="thread",
        generator=torch.Generator().manual_seed(seed),
    )
    async with loader:
        return [(int(w), m, float(a), float(b)) for w, m, a, b in await collect(loader)]


async def test_thread_workers_have_own_info_and_reproducible_generators() -> None:
    first = await _draws(1)
    assert [w for w, *_ in first] == [i % 2 for i in range(12)]
    assert {m for _, m, *_ in first} == {"thread"}
    assert first == await _draws(1)
    assert first != await _draws(2)
    assert get_worker_info() is None  # this thread is no worker


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"multiprocessing_context": "spawn"}, ValueError, "multiprocessing_context"),
        ({"worker_nice": 2}, ValueError, "worker_nice"),
    ],
)
def test_thread_rejects_arguments_that_mean_processes(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        AsyncDataLoader(datasets.RangeDataset(4), num_workers=2, executor="thread", **kwargs)


def test_unknown_executor_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"'process', 'thread' or aioloader\.ray\.RayWorkers"):
        AsyncDataLoader(datasets.RangeDataset(4), num_workers=2, executor="threads")
    with pytest.raises(TypeError, match="executor should be"):
        AsyncDataLoader(datasets.RangeDataset(4), num_workers=2, executor=object())  # type: ignore[arg-type]


async def test_async_source_is_collated_on_thread_workers() -> None:
    async def source() -> Any:
        for i in range(10):
            yield torch.tensor([i])

    async with AsyncDataLoader(source(), batch_size=4, num_workers=2, executor="thread") as loader:
        got = [b.flatten().tolist() for b in await collect(loader)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
