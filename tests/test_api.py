"""Constructor arguments, validation errors, len() and attributes match torch's DataLoader."""

from __future__ import annotations

import asyncio
import re
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

import aioloader
from aioloader import AsyncDataLoader, LoaderClosedError
from aioloader._epoch import Epoch
from tests import datasets
from tests.conftest import collect

RANGE = datasets.RangeDataset(10)
ITER = datasets.ShardedIterable(10)

BAD_ARGS: list[Any] = [
    pytest.param((RANGE,), {"num_workers": -1}, id="negative-workers"),
    pytest.param((RANGE,), {"timeout": -1}, id="negative-timeout"),
    pytest.param((RANGE,), {"prefetch_factor": 2}, id="prefetch-without-workers"),
    pytest.param((RANGE,), {"num_workers": 1, "prefetch_factor": -1}, id="negative-prefetch"),
    pytest.param((RANGE,), {"persistent_workers": True}, id="persistent-without-workers"),
    pytest.param(
        (RANGE,), {"shuffle": True, "sampler": SequentialSampler(RANGE)}, id="sampler+shuffle"
    ),
    pytest.param(
        (RANGE,), {"batch_sampler": [[0, 1]], "batch_size": 2}, id="batch_sampler+batch_size"
    ),
    pytest.param(
        (RANGE,), {"batch_sampler": [[0, 1]], "shuffle": True}, id="batch_sampler+shuffle"
    ),
    pytest.param(
        (RANGE,), {"batch_sampler": [[0, 1]], "sampler": [0, 1]}, id="batch_sampler+sampler"
    ),
    pytest.param(
        (RANGE,), {"batch_sampler": [[0, 1]], "drop_last": True}, id="batch_sampler+drop_last"
    ),
    pytest.param((RANGE,), {"batch_size": None, "drop_last": True}, id="no-batch+drop_last"),
    pytest.param((ITER,), {"shuffle": True}, id="iterable+shuffle"),
    pytest.param((ITER,), {"sampler": [0, 1]}, id="iterable+sampler"),
    pytest.param((ITER,), {"batch_sampler": [[0, 1]]}, id="iterable+batch_sampler"),
    pytest.param((RANGE,), {"multiprocessing_context": "fork"}, id="context-without-workers"),
    pytest.param((RANGE,), {"num_workers": 1, "multiprocessing_context": "nope"}, id="bad-context"),
    pytest.param((RANGE,), {"num_workers": 1, "multiprocessing_context": 3}, id="context-type"),
]


@pytest.mark.parametrize(("args", "kwargs"), BAD_ARGS)
def test_validation_errors_match_torch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    with pytest.raises(Exception) as torch_err:
        DataLoader(*args, **kwargs)
    with pytest.raises(type(torch_err.value), match=re.escape(str(torch_err.value))):
        AsyncDataLoader(*args, **kwargs)


def test_prefetch_factor_zero_is_rejected_up_front() -> None:
    # torch accepts it, then fails with a bare AssertionError when iterated.
    with pytest.raises(ValueError, match="prefetch_factor must be at least 1"):
        AsyncDataLoader(RANGE, num_workers=1, prefetch_factor=0)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_max_worker_restarts_validated(bad: object) -> None:
    with pytest.raises(ValueError, match="max_worker_restarts"):
        AsyncDataLoader(RANGE, max_worker_restarts=bad)  # type: ignore[arg-type]


def test_defaults_and_attributes_match_torch() -> None:
    kwargs: dict[str, Any] = {"batch_size": 3, "shuffle": True, "num_workers": 2}
    ref = DataLoader(RANGE, **kwargs)
    ours = AsyncDataLoader(RANGE, **kwargs)
    for name in (
        "dataset",
        "batch_size",
        "num_workers",
        "pin_memory",
        "drop_last",
        "timeout",
        "prefetch_factor",
        "persistent_workers",
        "pin_memory_device",
        "in_order",
        "collate_fn",
        "worker_init_fn",
        "generator",
    ):
        assert getattr(ours, name) == getattr(ref, name), name
    assert type(ours.sampler) is RandomSampler
    assert ours.batch_sampler.batch_size == 3
    assert AsyncDataLoader(RANGE).prefetch_factor is None
    assert AsyncDataLoader(RANGE, num_workers=1).prefetch_factor == 2
    assert AsyncDataLoader(RANGE, batch_size=None).collate_fn is torch.utils.data.default_convert
    assert AsyncDataLoader(RANGE).collate_fn is torch.utils.data.default_collate


def test_context_string_becomes_context_object() -> None:
    loader = AsyncDataLoader(RANGE, num_workers=1, multiprocessing_context="spawn")
    assert loader.multiprocessing_context.get_start_method() == "spawn"


@pytest.mark.parametrize("name", ["batch_size", "sampler", "dataset", "drop_last", "batch_sampler"])
def test_frozen_attributes_like_torch(name: str) -> None:
    loader = AsyncDataLoader(RANGE)
    with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
        setattr(loader, name, None)


def test_unknown_attribute_is_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = AsyncDataLoader(RANGE).nope


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 3},
        {"batch_size": 3, "drop_last": True},
        {"batch_size": None},
        {"batch_sampler": [[0, 1], [2], [3, 4, 5]]},
    ],
)
def test_len_matches_torch(kwargs: dict[str, Any]) -> None:
    assert len(AsyncDataLoader(RANGE, **kwargs)) == len(DataLoader(RANGE, **kwargs))


def test_len_of_iterable_matches_torch() -> None:
    assert len(AsyncDataLoader(ITER, batch_size=3)) == len(DataLoader(ITER, batch_size=3)) == 4


def test_too_many_workers_warns_like_torch() -> None:
    with pytest.warns(UserWarning, match="This DataLoader will create 999 worker processes"):
        AsyncDataLoader(RANGE, num_workers=999)


def test_public_api() -> None:
    assert aioloader.__all__ == sorted(aioloader.__all__)
    for name in aioloader.__all__:
        assert hasattr(aioloader, name), name
    assert issubclass(aioloader.LoaderClosedError, RuntimeError)
    assert issubclass(aioloader.WorkerCrashedError, RuntimeError)
    assert issubclass(aioloader.PoisonBatchError, aioloader.WorkerCrashedError)
    assert issubclass(aioloader.LoaderTimeoutError, TimeoutError)
    assert issubclass(aioloader.LoaderTimeoutError, RuntimeError)


async def test_closed_loader_refuses_to_iterate() -> None:
    loader = AsyncDataLoader(RANGE, batch_size=5)
    async with loader:
        assert len(await collect(loader)) == 2
    await loader.aclose()  # idempotent
    with pytest.raises(LoaderClosedError, match="create a new AsyncDataLoader"):
        aiter(loader)
    with pytest.raises(LoaderClosedError):
        async with loader:
            pass


async def test_stats_counts_what_was_delivered() -> None:
    async with AsyncDataLoader(RANGE, batch_size=4, num_workers=2) as loader:
        assert loader.stats().batches_delivered == 0
        batches = await collect(loader)
        s = loader.stats()
    assert s.batches_delivered == len(batches) == 3
    assert s.samples_delivered == 10
    assert 0.0 <= s.data_stall_fraction <= 1.0
    assert s.time_to_first_batch_s is not None and s.time_to_first_batch_s > 0
    assert s.worker_restarts == 0
    assert s.batches_in_flight == 0


async def test_the_data_stall_fraction_counts_from_the_first_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fractions' clock starts with the first wait stats() counts. It started when the
    epoch stamped its own start, a moment after the consumer's first wait began, so a consumer
    that only ever waited could read more than 1 (1.0006 in a loaded test run); a start that
    is slow to stamp shows it every time."""
    stamp = Epoch.ensure_started

    async def late_stamp(self: Epoch) -> None:
        if self._start_task is None:
            await asyncio.sleep(0.2)
        await stamp(self)

    monkeypatch.setattr(Epoch, "ensure_started", late_stamp)
    async with AsyncDataLoader(RANGE, batch_size=4, num_workers=0) as loader:
        async with asyncio.timeout(30):
            await collect(loader)
        s = loader.stats()
    assert s.wait_s >= 0.2
    assert 0.0 < s.data_stall_fraction <= 1.0


def test_works_under_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def run() -> list[Any]:
        async with AsyncDataLoader(RANGE, batch_size=4, num_workers=2) as loader:
            return await collect(loader)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        got = runner.run(run())
    assert [b.tolist() for b in got] == [b.tolist() for b in DataLoader(RANGE, batch_size=4)]


def test_pin_memory_without_accelerator_warns_like_torch() -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")

    async def run() -> list[Any]:
        async with AsyncDataLoader(RANGE, batch_size=5, pin_memory=True) as loader:
            return await collect(loader)

    with pytest.warns(UserWarning, match="no accelerator is found"):
        got = asyncio.run(run())
    assert len(got) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not got[0].is_pinned()
