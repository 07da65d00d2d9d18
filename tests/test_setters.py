"""Attributes changed between epochs, as torch's DataLoader allows: checked when set, and the
next epoch runs with the new value."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader
from aioloader._records import Plan
from tests import datasets, stream_sources


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


def _collate(batch: list[Any]) -> Any:
    return batch


def _init(worker_id: int) -> None:
    pass


def _transform(sample: Any) -> Any:
    return sample


_MAP: dict[str, Any] = {"batch_size": 2, "num_workers": 2}
_STREAM: dict[str, Any] = {"batch_size": 2, "num_workers": 2, "max_batch_latency": 1.0}
#: An async map-style dataset, fetched in the workers.
_REMOTE: dict[str, Any] = {"batch_size": 2, "num_workers": 2}

# (attribute, constructor kwargs, value set between epochs, what the next plan shows: a check of
# it, or the error (type, message) the next epoch raises). Every settable attribute has a row
# with a good value; test_the_table_covers_every_settable_attribute keeps it so.
_SETTERS: list[tuple[str, dict[str, Any], Any, Callable[[Plan], bool] | tuple[type, str]]] = [
    ("num_workers", _MAP, 3, lambda p: p.num_workers == 3 and p.max_in_flight == 6),
    ("num_workers", _MAP, -1, (ValueError, "num_workers option should be non-negative")),
    ("prefetch_factor", _MAP, 3, lambda p: p.max_in_flight == 6),
    ("collate_fn", _MAP, _collate, lambda p: p.collate_fn is _collate),
    ("pin_memory", _MAP, True, lambda p: p.pin_memory),
    ("timeout", _MAP, 5, lambda p: p.timeout == 5),
    ("timeout", _MAP, -1, (ValueError, "timeout option should be non-negative")),
    ("worker_init_fn", _MAP, _init, lambda p: p.worker_init_fn is _init),
    (
        "multiprocessing_context",
        _MAP,
        "spawn",
        lambda p: p.mp_context.get_start_method() == "spawn",
    ),
    ("generator", _MAP, torch.Generator(), lambda p: p.generator is not None),
    ("pin_memory_device", _MAP, "cuda", lambda p: p.pin_memory_device == "cuda"),
    # r4_01: the round-robin assignment (torch's) follows in_order and seeding set later.
    ("in_order", {**_MAP, "in_order": False}, True, lambda p: p.in_order and p.pinned_workers),
    ("in_order", _MAP, False, lambda p: not p.in_order and not p.pinned_workers),
    ("seeding", {**_MAP, "seeding": "batch"}, "worker", lambda p: p.pinned_workers),
    ("seeding", _MAP, "batch", lambda p: p.seeding == "batch" and not p.pinned_workers),
    ("seeding", _MAP, "epoch", (ValueError, "seeding should be")),
    ("executor", _MAP, "thread", lambda p: p.executor == "thread"),
    ("executor", _MAP, "threads", (ValueError, "executor should be")),
    ("worker_nice", _MAP, 7, lambda p: p.worker_nice == 7),
    ("worker_nice", _MAP, 20, (ValueError, "worker_nice should be")),
    ("device", _MAP, "cpu", lambda p: p.device == "cpu"),
    ("device", _MAP, "nowhere", (ValueError, "not a valid torch device")),
    ("device_prefetch", _MAP, 3, lambda p: p.device_prefetch == 3),
    ("device_prefetch", _MAP, 0, (ValueError, "device_prefetch should be")),
    ("max_worker_restarts", _MAP, 0, lambda p: p.max_worker_restarts == 0),
    ("max_worker_restarts", _MAP, -1, (ValueError, "max_worker_restarts should be")),
    ("transform", _STREAM, _transform, lambda p: p.stream is not None and p.stream.transformed),
    ("transform", _MAP, _transform, (ValueError, "applies to async sources only")),
    (
        "max_batch_latency",
        _STREAM,
        0.5,
        lambda p: p.stream is not None and p.stream.max_batch_latency == 0.5,
    ),
    ("max_batch_latency", _STREAM, -1, (ValueError, "max_batch_latency")),
    (
        "source_concurrency",
        _STREAM,
        4,
        lambda p: p.stream is not None and p.stream.source_concurrency == 4,
    ),
    ("source_concurrency", _STREAM, 0, (ValueError, "source_concurrency should be")),
    (
        "transform_in",
        _STREAM,
        "workers",
        lambda p: p.stream is not None and p.stream.transform_in == "workers",
    ),
    ("transform_in", _STREAM, "loop", (ValueError, "transform_in should be")),
    ("transform_in", _MAP, "auto", (ValueError, "applies to async iterable sources")),
    ("transform_in", _REMOTE, "loop", (ValueError, "transform_in should be")),
    ("transform_in", _REMOTE, "auto", (ValueError, "fetches in the workers")),
]


def _id(value: object) -> str:
    if isinstance(value, (int, float, str)):
        return repr(value)
    return str(getattr(value, "__name__", type(value).__name__))


def _made(kwargs: dict[str, Any]) -> AsyncDataLoader[Any]:
    if kwargs is _STREAM:
        return AsyncDataLoader(stream_sources.Counting(8), **kwargs)
    if kwargs is _REMOTE:
        return AsyncDataLoader(stream_sources.AsyncMap(8), **kwargs)
    return AsyncDataLoader(datasets.RangeDataset(8), **kwargs)


@pytest.mark.parametrize(
    ("name", "kwargs", "value", "expect"),
    _SETTERS,
    ids=[f"{row[0]}={_id(row[2])}" for row in _SETTERS],
)
def test_every_setter_reaches_the_next_epochs_plan(
    name: str,
    kwargs: dict[str, Any],
    value: Any,
    expect: Callable[[Plan], bool] | tuple[type, str],
) -> None:
    """Every derived field is built with the plan, from the attributes as they are now."""
    loader = _made(kwargs)
    before = loader._plan()
    if isinstance(expect, tuple):  # refused when set, or by the next epoch
        with pytest.raises(expect[0], match=expect[1]):
            setattr(loader, name, value)
            loader._plan()
        return
    setattr(loader, name, value)
    assert not expect(before)
    assert expect(loader._plan())


def test_the_table_covers_every_settable_attribute() -> None:
    loader = _made(_MAP)
    settable = {k for k in vars(loader) if not k.startswith("_")}
    for cls in type(loader).__mro__:
        for k, v in vars(cls).items():
            if isinstance(v, property) and v.fset is not None and not k.startswith("_"):
                try:
                    setattr(_made(_MAP), k, getattr(loader, k))
                except ValueError as exc:
                    assert "should not be set after" in str(exc)
                else:
                    settable.add(k)
    assert settable == {row[0] for row in _SETTERS}


async def test_in_order_set_later_loads_batch_k_on_worker_k_mod_n() -> None:
    """r4_01: torch's round-robin (which decides worker-seeded augmentations) after in_order=True
    on a loader made with in_order=False."""
    loader = AsyncDataLoader(
        datasets.WorkerInfoDataset(), batch_size=None, num_workers=2, in_order=False
    )
    loader.in_order = True
    async with loader, asyncio.timeout(60):
        workers = [int(row[1]) async for row in loader]
    assert workers == [k % 2 for k in range(len(workers))]
