"""An IterableDataset's own state in state_dict(): before the first batch, at an epoch's end,
and for a worker that has not delivered yet; seeding="batch" over workers that end apart.

The reference is the uninterrupted run, and for what a dataset sees across epochs, torch's
DataLoader: a dataset lives on between epochs with num_workers=0 and in persistent workers, and
starts afresh in new workers.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from aioloader import AsyncDataLoader
from tests import resume_data as rd


def _json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))  # type: ignore[no-any-return]


async def _take(loader: AsyncDataLoader[Any], stop: int | None = None) -> list[Any]:
    out: list[Any] = []
    async with asyncio.timeout(60):
        async for batch in loader:
            out.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)
            if stop is not None and len(out) == stop:
                break
    return out


def _plain(batches: list[Any]) -> list[Any]:
    return [[int(x) for x in b] if isinstance(b, list | tuple) else int(b) for b in batches]


async def test_a_state_taken_before_the_first_batch_holds_the_datasets_own_state() -> None:
    """The dataset keeps the global RNG in its state: the resumed epoch draws the same numbers."""
    dataset = rd.RandomPicks(20)
    async with AsyncDataLoader(dataset, batch_size=None) as loader:
        it = loader.__aiter__()
        state = copy.deepcopy(loader.state_dict())  # the epoch started; nothing delivered yet
        async with asyncio.timeout(30):
            expected = [b async for b in it]
    assert state["worker_states"], "the dataset's state at the epoch's start was not saved"
    torch.manual_seed(777)  # a new process's RNG is not the one the state was taken under
    async with AsyncDataLoader(rd.RandomPicks(20), batch_size=None) as loader:
        loader.load_state_dict(state)
        got = await _take(loader)
    assert got == expected


async def test_a_state_before_the_first_batch_holds_the_iterators_state() -> None:
    """r4_td_iter_state_epoch_start: num_workers=0 makes the dataset's iterator in iter(loader),
    as torch and torchdata do, and a state taken then holds that iterator's state (here the
    global RNG its draws come from)."""
    torch.manual_seed(0)
    async with AsyncDataLoader(rd.PicksOnIterator(8), batch_size=None) as loader:
        it = loader.__aiter__()
        state = copy.deepcopy(loader.state_dict())  # holds a tensor (the RNG): not JSON
        async with asyncio.timeout(30):
            expected = [b async for b in it]
    assert state["worker_states"], "the iterator's state at the epoch's start was not saved"
    torch.manual_seed(12345)  # a new process's RNG is not the one the state was taken under
    async with AsyncDataLoader(rd.PicksOnIterator(8), batch_size=None) as loader:
        loader.load_state_dict(state)
        assert await _take(loader) == expected


@pytest.mark.parametrize("workers", [0, 2])
async def test_plain_iteration_asks_no_state_before_iter(workers: int) -> None:
    """r4_td_state_dict_before_iter: torch never calls state_dict(); torchdata only after
    iter(dataset). A dataset whose state exists once __iter__ ran iterates as in torch."""
    kw: dict[str, Any] = {"batch_size": 4, "num_workers": workers}
    expected = [b.tolist() for b in DataLoader(rd.SetUpInIter(10), batch_size=4)]
    async with AsyncDataLoader(rd.SetUpInIter(10), **kw) as loader:
        got = await _take(loader)
    assert sorted(got) == sorted(expected * max(1, workers))  # each worker yields it all


@pytest.mark.parametrize(
    ("workers", "persistent"), [(0, False), (2, True), (2, False)], ids=["0", "2-persistent", "2"]
)
async def test_an_epoch_end_state_starts_the_next_epoch_from_where_the_dataset_lives_on(
    workers: int, persistent: bool
) -> None:
    """Epoch tags count the epochs a replica ran: 1 where it lives on, 0 in fresh workers."""
    kw: dict[str, Any] = {"batch_size": None, "num_workers": workers}
    if workers:
        kw.update(persistent_workers=persistent, multiprocessing_context="fork")
    torch_loader = DataLoader(rd.EpochTagged(6), **kw)
    list(torch_loader)
    torch_second = _plain(list(torch_loader))
    del torch_loader
    async with AsyncDataLoader(rd.EpochTagged(6), **kw) as loader:
        await _take(loader)
        state = _json(loader.state_dict())
        second = _plain(await _take(loader))
    assert second == torch_second
    async with AsyncDataLoader(rd.EpochTagged(6), **kw) as loader:
        loader.load_state_dict(state)
        resumed = _plain(await _take(loader))
        third = _plain(await _take(loader))
    assert resumed == torch_second
    assert {tag for _, tag, _ in third} == ({2} if workers == 0 or persistent else {0})


async def test_a_worker_yet_to_deliver_this_epoch_resumes_from_the_last_epochs_end() -> None:
    """Persistent workers, epoch 2, stopped after worker 0's first batch: worker 1's replica is
    where epoch 1 left it, and so it is after the resume."""
    kw: dict[str, Any] = {
        "batch_size": None, "num_workers": 2, "persistent_workers": True,
        "multiprocessing_context": "fork",
    }  # fmt: skip
    async with AsyncDataLoader(rd.EpochTagged(8), **kw) as loader:
        await _take(loader)
        expected = _plain(await _take(loader))
    async with AsyncDataLoader(rd.EpochTagged(8), **kw) as loader:
        await _take(loader)
        head = _plain(await _take(loader, 1))
        state = _json(loader.state_dict())
    assert head == expected[:1]
    async with AsyncDataLoader(rd.EpochTagged(8), **kw) as loader:
        loader.load_state_dict(state)
        rest = _plain(await _take(loader))
    assert head + rest == expected
    assert {tag for _, tag, _ in expected} == {1}


def _uneven(prefetch_factor: int) -> AsyncDataLoader[Any]:
    return AsyncDataLoader(
        rd.Uneven(40, 6),
        batch_size=None,
        num_workers=2,
        prefetch_factor=prefetch_factor,
        multiprocessing_context="fork",
        seeding="batch",
        generator=torch.Generator().manual_seed(0),
    )


async def test_batch_seeding_is_reproducible_when_iterable_workers_run_dry_apart() -> None:
    """How many turns worker 1 was handed before it was known to be dry depends on the timing
    (here made to differ by the prefetch depth); the batches, and their random draws, do not."""
    runs = []
    for prefetch in (1, 2, 8):
        async with _uneven(prefetch) as loader:
            runs.append(await _take(loader))
    assert len(runs[0]) == 46
    assert runs[1] == runs[0]
    assert runs[2] == runs[0]
    # And a resume after worker 1 ran dry goes on with the same draws.
    async with _uneven(8) as loader:
        head = await _take(loader, 20)
        state = _json(loader.state_dict())
    async with _uneven(2) as loader:
        loader.load_state_dict(state)
        rest = await _take(loader)
    assert head + rest == runs[0]


@pytest.mark.parametrize("workers", [0, 2])
async def test_a_state_after_a_short_last_batch_resumes_with_that_worker_ended(
    workers: int,
) -> None:
    """r4_03: building a short last batch ran the iterator dry, and the dataset reset its
    position (as docs/resume.md asks). The state after that batch says the worker ended (as
    torchdata's fetcher state does): the resumed epoch delivers only the rest, and the next
    epoch starts over."""
    kw: dict[str, Any] = {"batch_size": 2, "num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = "fork"
    async with AsyncDataLoader(rd.DatasetLevelState(5), **kw) as loader:
        full = await _take(loader)
        second = await _take(loader)
    # Right after a short last batch: worker 0's (worker 1's still to come), or the epoch's last.
    stop = len(full) - 1 if workers else len(full)
    async with AsyncDataLoader(rd.DatasetLevelState(5), **kw) as loader:
        head = await _take(loader, stop)
        await asyncio.sleep(0.3)  # in-flight results arrive: the state is the received one's
        state = _json(loader.state_dict())
    async with AsyncDataLoader(rd.DatasetLevelState(5), **kw) as loader:
        loader.load_state_dict(state)
        rest = await _take(loader)
        after = await _take(loader)
    assert sorted(head + rest) == sorted(full)
    assert sorted(after) == sorted(second)


def _persistent(dataset: Any) -> AsyncDataLoader[Any]:
    return AsyncDataLoader(
        dataset,
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        multiprocessing_context="fork",
        generator=torch.Generator().manual_seed(4),
    )


async def test_an_epoch_start_state_reloaded_into_the_same_persistent_loader_repeats_it() -> None:
    """r4_td_pw_reload_epoch_start: the kept workers' replicas and RNGs moved on with the epoch;
    after load_state_dict the next epoch starts new workers, as a new loader (and torchdata)."""
    async with _persistent(rd.PicksPerWorker(4)) as loader:
        it = loader.__aiter__()
        state = copy.deepcopy(loader.state_dict())  # before the first batch
        async with asyncio.timeout(60):
            expected = _plain([b async for b in it])
        loader.load_state_dict(state)
        again = _plain(await _take(loader))
    assert again == expected


async def test_an_epoch_end_state_carries_the_iterators_state_of_persistent_workers() -> None:
    """r4_td_iter_state_epoch_end_pw: in torch a persistent worker's RNG carries into the next
    epoch; here it is in the state of the iterator __iter__ returned. The end state holds it
    (torchdata's does), so a new loader resumed from it gives the uninterrupted next epoch."""
    async with _persistent(rd.PicksPerWorkerOnIterator(4)) as loader:
        first = await _take(loader)
        state = copy.deepcopy(loader.state_dict())
        second = await _take(loader)
    assert sorted(state["worker_states"]) == ["0", "1"]
    async with _persistent(rd.PicksPerWorkerOnIterator(4)) as loader:
        loader.load_state_dict(state)
        resumed = await _take(loader)
    assert resumed == second != first
