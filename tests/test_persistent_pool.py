"""The persistent pool's owner (``_pools.PersistentPool``): one pool kept between epochs, new
workers whenever a setting the workers baked in at start differs in the next epoch's plan.

The autouse ``no_leaks`` fixture (conftest.py) fails any test here that leaves a process, thread,
fd or shared-memory file behind.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader, FetchPolicy, _pools
from aioloader._pools import PersistentPool, baked_in
from aioloader._records import Plan
from aioloader._resume import batch_seed
from tests import datasets, pool_probes, resume_data, stream_sources
from tests import remote_data as rd
from tests.conftest import collect

# ------------------------------------------------------------------ the owner, without workers


class _FakePool:
    """Stands in for a started pool: records how it was shut down."""

    num_workers = 2

    def __init__(self) -> None:
        self.shutdowns: list[bool] = []

    async def shutdown(self, *, graceful: bool) -> None:
        self.shutdowns.append(graceful)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Plan, int, _FakePool]]:
    """Every pool the owner starts, with the plan and base seed it was started for."""
    log: list[tuple[Plan, int, _FakePool]] = []

    async def start(plan: Plan, base_seed: int) -> Any:
        pool = _FakePool()
        log.append((plan, base_seed, pool))
        return pool

    monkeypatch.setattr(_pools, "start_pool", start)
    return log


def _other(value: object) -> Callable[[Any], None]:
    def fn(_: Any) -> None:
        return None

    fn.__name__ = f"other_{value}"
    return fn


def _map_plan() -> Plan:
    return AsyncDataLoader(
        datasets.RangeDataset(8), batch_size=2, num_workers=2, persistent_workers=True
    )._plan()


def _stream_plan() -> Plan:
    return AsyncDataLoader(
        stream_sources.Counting(8),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        transform=pool_probes.with_pid,
    )._plan()


def _remote_plan() -> Plan:
    return AsyncDataLoader(
        rd.Latent(8), batch_size=2, num_workers=2, persistent_workers=True, fetch_in="workers"
    )._plan()


def _other_context(plan: Plan) -> Any:
    method = "spawn" if plan.mp_context.get_start_method() != "spawn" else "fork"
    return multiprocessing.get_context(method)


# (baked-in field, the plan it is read from, the same plan with that field changed)
_CHANGES: list[tuple[str, Callable[[], Plan], Callable[[Plan], Plan]]] = [
    ("executor", _map_plan, lambda p: dataclasses.replace(p, executor="thread")),
    ("num_workers", _map_plan, lambda p: dataclasses.replace(p, num_workers=3)),
    ("start_method", _map_plan, lambda p: dataclasses.replace(p, mp_context=_other_context(p))),
    (
        "pinned_workers",
        _map_plan,
        lambda p: dataclasses.replace(p, pinned_workers=not p.pinned_workers),
    ),
    ("in_order", _map_plan, lambda p: dataclasses.replace(p, in_order=not p.in_order)),
    ("seeding", _map_plan, lambda p: dataclasses.replace(p, seeding="batch")),
    ("is_iterable", _map_plan, lambda p: dataclasses.replace(p, is_iterable=True)),
    (
        "batch_sampler_given",
        _map_plan,
        lambda p: dataclasses.replace(p, batch_sampler_given=not p.batch_sampler_given),
    ),
    ("drop_last", _map_plan, lambda p: dataclasses.replace(p, drop_last=not p.drop_last)),
    ("collate_fn", _map_plan, lambda p: dataclasses.replace(p, collate_fn=_other("c"))),
    ("worker_init_fn", _map_plan, lambda p: dataclasses.replace(p, worker_init_fn=_other("i"))),
    ("worker_nice", _map_plan, lambda p: dataclasses.replace(p, worker_nice=7)),
    ("rank", _map_plan, lambda p: dataclasses.replace(p, rank=1, world_size=2)),
    ("world_size", _map_plan, lambda p: dataclasses.replace(p, world_size=3)),
    ("lane_depth", _map_plan, lambda p: dataclasses.replace(p, lane_depth=5)),
    (
        "dataset",
        _map_plan,
        lambda p: dataclasses.replace(p, worker_dataset=datasets.RangeDataset(8)),
    ),
    (
        "transform",
        _stream_plan,
        lambda p: dataclasses.replace(
            p,
            worker_dataset=type(p.worker_dataset)(pool_probes.negated_with_pid),
        ),
    ),
    *[
        (
            f"fetch_in='workers' {name}",
            _remote_plan,
            lambda p, name=name, value=value: dataclasses.replace(  # type: ignore[misc]
                p, worker_dataset=dataclasses.replace(p.worker_dataset, **{name: value()})
            ),
        )
        for name, value in [
            ("dataset", lambda: rd.Latent(8)),
            ("policy", lambda: FetchPolicy(timeout=3.0)),
            ("concurrency", lambda: 3),
            ("transform", lambda: pool_probes.with_pid),
        ]
    ],
]


def test_the_table_changes_every_baked_in_field() -> None:
    """Each field baked_in() records has a row above that changes it, and only it."""
    seen: set[str] = set()
    for name, make, change in _CHANGES:
        plan = make()
        built, wanted = baked_in(plan, 1), baked_in(change(plan), 1)
        diff = {k for k in built if built[k] is not wanted[k] and built[k] != wanted[k]}
        key = name.split()[-1]
        # rank is set with a world size it fits in; in_order decides pinned_workers.
        assert key in diff and diff <= {key, "world_size", "pinned_workers"}, (name, diff)
        seen |= diff
    every = {k for make in (_map_plan, _stream_plan, _remote_plan) for k in baked_in(make(), 1)}
    assert seen | {"base_seed"} == every


@pytest.mark.parametrize(("name", "make", "change"), _CHANGES, ids=[r[0] for r in _CHANGES])
async def test_a_changed_baked_in_field_gets_new_workers(
    started: list[tuple[Plan, int, _FakePool]],
    name: str,
    make: Callable[[], Plan],
    change: Callable[[Plan], Plan],
) -> None:
    owner = PersistentPool()
    plan = make()
    new_plan = change(plan)
    async with asyncio.timeout(10):
        first = await owner.acquire(plan, 7)
        owner.keep(busy=False)
        assert await owner.acquire(plan, 7) is first  # the same plan: the kept pool
        assert owner.serves(plan, 7) and not owner.serves(new_plan, 7)
        second = await owner.acquire(new_plan, 7)
    assert second is not first and owner.pool is second
    assert [p for _, _, p in started] == [first, second]
    assert started[1][0] is new_plan
    assert first.shutdowns == [True]  # type: ignore[attr-defined]
    assert owner.serves(new_plan, 7)


async def test_a_new_base_seed_gets_new_workers(started: list[Any]) -> None:
    owner = PersistentPool()
    plan = _map_plan()
    async with asyncio.timeout(10):
        first = await owner.acquire(plan, 7)
        second = await owner.acquire(plan, 8)
    assert second is not first and [seed for _, seed, _ in started] == [7, 8]


async def test_retired_stale_and_detached_pools_serve_no_later_epoch(started: list[Any]) -> None:
    owner = PersistentPool()
    plan = _map_plan()
    async with asyncio.timeout(10):
        first = await owner.acquire(plan, 1)
        owner.retire(first)  # an epoch ended with it broken: its cleanup shuts it down
        assert owner.pool is None and not owner.serves(plan, 1)
        second = await owner.acquire(plan, 1)
        owner.invalidate()  # a state was loaded
        assert not owner.serves(plan, 1)
        third = await owner.acquire(plan, 1)
        assert owner.detach() is third and owner.pool is None
    assert len({id(first), id(second), id(third)}) == 3
    assert first.shutdowns == [] and second.shutdowns == [True]
    assert third.shutdowns == []  # detached: the caller kills it


async def test_a_busy_pool_is_killed_and_a_replacement_is_kept(started: list[Any]) -> None:
    owner = PersistentPool()
    plan = _map_plan()
    async with asyncio.timeout(10):
        first = await owner.acquire(plan, 1)
        owner.keep(busy=True)  # an abandoned epoch's batches still run on it
        replacement = _FakePool()
        owner.replaced(first, replacement)  # crash recovery
        assert owner.pool is replacement and owner.serves(plan, 1)
        owner.replaced(first, _FakePool())  # a stale report changes nothing
        assert owner.pool is replacement
        await owner.close()
    assert owner.pool is None
    assert replacement.shutdowns == [False] and first.shutdowns == []


# ------------------------------------------------------------------ real workers, via setters


def _pids(batches: list[Any]) -> set[int]:
    return {int(p) for b in batches for p in b["pid"]}


def _order(batches: list[Any]) -> list[int]:
    return [int(i) for b in batches for i in b["i"]]


def _parents(batches: list[Any]) -> set[int]:
    return {int(p) for b in batches for p in b["ppid"]}


def _base_seed(first: list[Any]) -> int:
    return min(int(s) for b in first for s in b["seed"])  # worker 0's seed is base_seed + 0


# (attribute, value set between epochs, a check of (first epoch, second epoch) batches)
_SETTINGS: list[tuple[str, Any, Callable[[list[Any], list[Any]], bool]]] = [
    ("num_workers", 3, lambda a, b: len(_pids(b)) == 3),
    ("collate_fn", pool_probes.tag_collate, lambda a, b: all(x["tag"] == "tagged" for x in b)),
    (
        "worker_init_fn",
        pool_probes.mark_worker_init,
        lambda a, b: (
            {m for x in a for m in x["mark"]} == {""}
            and {m for x in b for m in x["mark"]} == {"marked-0", "marked-1"}
        ),
    ),
    # Forked by this process, then by the fork server.
    (
        "multiprocessing_context",
        "forkserver",
        lambda a, b: _parents(a) == {os.getpid()} and os.getpid() not in _parents(b),
    ),
    # in_order=False: the slow first batch no longer holds up the rest.
    ("in_order", False, lambda a, b: _order(a)[0] == 0 and _order(b)[0] != 0),
    (
        "seeding",
        "batch",
        lambda a, b: (
            sorted(int(s) for x in b for s in x["seed"][:1])
            == sorted(batch_seed(_base_seed(a), 1, k) for k in range(4))
        ),
    ),
    ("executor", "thread", lambda a, b: _pids(b) == {os.getpid()}),
    (
        "worker_nice",
        7,
        lambda a, b: {int(n) for x in b for n in x["nice"]} == {min(19, os.nice(0) + 7)},
    ),
]


@pytest.mark.parametrize(("name", "value", "check"), _SETTINGS, ids=[r[0] for r in _SETTINGS])
async def test_a_setting_changed_between_epochs_gets_fresh_persistent_workers(
    name: str, value: Any, check: Callable[[list[Any], list[Any]], bool]
) -> None:
    loader = AsyncDataLoader(
        pool_probes.Probe(8, slow_first=0.5),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(0),
    )
    async with loader:
        first = await collect(loader)
        setattr(loader, name, value)
        second = await collect(loader)
        third = await collect(loader)  # the new workers persist in turn
    assert _pids(first).isdisjoint(_pids(second))
    assert _pids(second) == _pids(third)
    assert sorted(_order(second)) == list(range(8))
    assert check(first, second)


async def test_a_stream_transform_changed_between_epochs_gets_fresh_workers() -> None:
    loader = AsyncDataLoader(
        stream_sources.Counting(8),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        transform=pool_probes.with_pid,
    )
    async with loader:
        first = await collect(loader)
        loader.transform = pool_probes.negated_with_pid
        second = await collect(loader)
    pids = [{int(p) for b in e for p in b[:, 1]} for e in (first, second)]
    assert pids[0].isdisjoint(pids[1])
    assert sorted(int(v) for b in first for v in b[:, 0]) == list(range(8))
    assert sorted(int(v) for b in second for v in b[:, 0]) == [-i for i in range(7, -1, -1)]


async def test_source_concurrency_changed_between_epochs_reaches_fresh_workers() -> None:
    loader = AsyncDataLoader(
        rd.Latent(16, delay=0.05),
        batch_size=8,
        num_workers=1,
        persistent_workers=True,
        fetch_in="workers",
        source_concurrency=8,
    )
    async with loader:
        first = await collect(loader)
        loader.source_concurrency = 2
        second = await collect(loader)
    assert max(int(n) for b in first for n in b["in_flight"]) > 2
    assert max(int(n) for b in second for n in b["in_flight"]) <= 2
    assert {int(p) for b in first for p in b["pid"]}.isdisjoint(
        {int(p) for b in second for p in b["pid"]}
    )


async def test_unchanged_plan_keeps_the_same_workers_across_epochs() -> None:
    """Settings the workers do not hold (the bound on batches in flight, the timeout, the
    restart budget, the device queue) reach the next epoch without new workers."""
    loader = AsyncDataLoader(
        pool_probes.Probe(8), batch_size=2, num_workers=2, persistent_workers=True
    )
    async with loader:
        epochs = [await collect(loader)]
        epochs.append(await collect(loader))
        loader.prefetch_factor = 3
        loader.timeout = 30
        loader.max_worker_restarts = 1
        loader.device_prefetch = 4
        loader.collate_fn = loader.collate_fn  # the same function again
        epochs.append(await collect(loader))
    pids = [_pids(e) for e in epochs]
    assert len(pids[0]) == 2 and pids[0] == pids[1] == pids[2]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("batch_size", 4),
        ("drop_last", True),
        ("dataset", pool_probes.Probe(4)),
        ("sampler", None),
        ("batch_sampler", None),
        ("persistent_workers", False),
    ],
)
async def test_attributes_torch_fixes_are_refused_after_an_epoch_and_the_workers_stay(
    name: str, value: Any
) -> None:
    loader = AsyncDataLoader(
        pool_probes.Probe(8), batch_size=2, num_workers=2, persistent_workers=True
    )
    async with loader:
        first = await collect(loader)
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after"):
            setattr(loader, name, value)
        second = await collect(loader)
    assert _pids(first) == _pids(second)


def _picks(dataset: Any, **kwargs: Any) -> AsyncDataLoader[Any]:
    return AsyncDataLoader(
        dataset,
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(4),
        **kwargs,
    )


async def test_an_epoch_end_state_carries_worker_states_only_while_the_workers_are_kept() -> None:
    """An IterableDataset's replicas carry into the next epoch only on the kept workers: once a
    setting they hold changed, the next epoch's new workers start from the dataset as pickled
    (drawing what the first epoch drew), and the state taken then says so."""
    loader = _picks(resume_data.PicksPerWorker(4))
    async with loader:
        first = sorted(await collect(loader))
        assert sorted(loader.state_dict()["worker_states"]) == ["0", "1"]
        loader.worker_init_fn = pool_probes.mark_worker_init
        state = copy.deepcopy(loader.state_dict())
        second = sorted(await collect(loader))
    assert state["worker_states"] == {}
    assert second == first
    resumed_loader = _picks(
        resume_data.PicksPerWorker(4), worker_init_fn=pool_probes.mark_worker_init
    )
    async with resumed_loader:
        resumed_loader.load_state_dict(state)
        assert sorted(await collect(resumed_loader)) == second
