"""The core behaviour on every executor: processes, threads and Ray actors (``executor`` fixture).

Order and exactly-once across epochs, ``in_order=False``, iterables, errors with the worker's
traceback, the timeout, ``break`` cleanup and per-worker ``get_worker_info()``. Each test is run
once per backend by the parametrised ``executor`` fixture of conftest.py, which also checks,
for Ray, that no actor of the loader is left alive. Ray cases are ``slow`` (each actor start is a
fresh interpreter importing torch) except those marked ``ray_default``.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader, LoaderTimeoutError
from tests import datasets
from tests.conftest import collect, torch_batches


def _ints(batches: list[Any]) -> list[list[int]]:
    return [b.flatten().tolist() for b in batches]


@pytest.mark.ray_default
async def test_same_batches_as_torch_every_epoch(executor: Any) -> None:
    """Shuffled, seeded: each epoch equals torch's epoch, every sample once; workers persist."""
    ds = datasets.RangeDataset(40)
    torch_gen = torch.Generator().manual_seed(7)
    ref = torch.utils.data.DataLoader(
        ds, batch_size=4, shuffle=True, generator=torch_gen, num_workers=2, persistent_workers=True
    )
    expected = [_ints(list(ref)) for _ in range(2)]
    gen = torch.Generator().manual_seed(7)
    async with AsyncDataLoader(
        ds,
        batch_size=4,
        shuffle=True,
        generator=gen,
        num_workers=2,
        persistent_workers=True,
        executor=executor,
    ) as loader:
        for epoch in range(2):
            got = _ints(await collect(loader))
            assert got == expected[epoch]
            assert sorted(i for b in got for i in b) == list(range(40))


async def test_in_order_false_delivers_every_batch_once(executor: Any) -> None:
    ds = datasets.RangeDataset(30)
    async with AsyncDataLoader(
        ds, batch_size=3, num_workers=2, in_order=False, executor=executor
    ) as loader:
        got = _ints(await collect(loader))
    assert Counter(tuple(b) for b in got) == Counter(
        tuple(b) for b in _ints(torch_batches(ds, batch_size=3))
    )


async def test_iterable_is_sharded_per_worker_as_in_torch(executor: Any) -> None:
    ds = datasets.ShardedIterable(20)
    expected = _ints(torch_batches(ds, batch_size=3, num_workers=2))
    async with AsyncDataLoader(ds, batch_size=3, num_workers=2, executor=executor) as loader:
        assert _ints(await collect(loader)) == expected


@pytest.mark.ray_default
async def test_error_carries_worker_traceback_and_epoch_goes_on(executor: Any) -> None:
    ds = datasets.RaisingDataset(12, bad=5)
    got: list[list[int]] = []
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2, executor=executor) as loader:
        it = aiter(loader)
        async with asyncio.timeout(60):
            for _ in range(2):
                got.append(_ints([await anext(it)])[0])
            with pytest.raises(ValueError, match="bad sample 5") as info:
                await anext(it)
            got += _ints([b async for b in it])
    text = str(info.value)
    assert "in DataLoader worker" in text and "Traceback" in text and "__getitem__" in text
    assert got == [[0, 1], [2, 3], [6, 7], [8, 9], [10, 11]]


def _shape_of(batch: Any) -> Any:
    """Every container's type (and a TaggedList's tag) and every tensor's dtype and values."""
    if isinstance(batch, torch.Tensor):
        return (type(batch), batch.dtype, batch.tolist())
    if isinstance(batch, dict):
        return (type(batch), {k: _shape_of(v) for k, v in batch.items()})
    if isinstance(batch, list | tuple):
        return (type(batch), getattr(batch, "tag", None), [_shape_of(b) for b in batch])
    return batch


@pytest.mark.ray_default
async def test_batch_container_types_arrive_as_torch_delivers_them(executor: Any) -> None:
    """Tuple and list subclasses, named tuples and dict subclasses keep their type."""
    ds = datasets.RangeDataset(8)
    expected = [
        _shape_of(b)
        for b in torch_batches(
            ds, batch_size=4, num_workers=2, collate_fn=datasets.container_collate
        )
    ]
    assert expected[0][0] is datasets.Pair
    async with AsyncDataLoader(
        ds, batch_size=4, num_workers=2, collate_fn=datasets.container_collate, executor=executor
    ) as loader:
        got = [_shape_of(b) for b in await collect(loader)]
    assert got == expected


async def test_timeout_raises_and_releases_the_workers(executor: Any, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    ds = datasets.GatedDataset(4, open_below=0, gate=str(gate), limit=60)
    async with AsyncDataLoader(
        ds, batch_size=1, num_workers=2, timeout=0.5, executor=executor
    ) as loader:
        with pytest.raises(LoaderTimeoutError):
            await collect(loader)
        gate.touch()  # a thread worker finishes the sample it is in; it cannot be killed


async def test_break_ends_the_epoch_and_aclose_frees_everything(executor: Any) -> None:
    ds = datasets.RangeDataset(64)
    async with AsyncDataLoader(ds, batch_size=2, num_workers=2, executor=executor) as loader:
        async with asyncio.timeout(60):
            async for batch in loader:
                assert batch.tolist() == [[0], [1]]
                break
            # A new epoch after the break starts from the beginning with fresh workers.
            assert _ints(await collect(loader))[:2] == [[0, 1], [2, 3]]
    # conftest's checks: no process, thread, fd (processes, threads) or actor (Ray) left.


async def test_each_worker_sees_its_own_worker_info(executor: Any) -> None:
    ds = datasets.WorkerInfoDataset()
    async with AsyncDataLoader(
        ds, batch_size=None, num_workers=2, executor=executor, in_order=True
    ) as loader:
        rows = await collect(loader)
    ids = {int(r[1]) for r in rows}
    assert ids == {0, 1}
    assert all(int(r[2]) == 2 for r in rows)
    # Round-robin, as torch: sample i is loaded by worker i % 2, whose seed is base + id.
    assert all(int(r[1]) == int(r[0]) % 2 for r in rows)
    assert len({int(r[3]) - int(r[1]) for r in rows}) == 1
