"""Ray actors as workers: a killed actor is replaced and its batches loaded again; bad arguments.

The cluster is conftest's session-wide ``ray_cluster`` (skipped only when ray is missing).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import psutil
import pytest

from aioloader import AsyncDataLoader
from tests import datasets
from tests.conftest import live_loader_actors, loader_actor_pids, ray_actor_ids

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'aioloader[ray]'")
from aioloader.ray import RayWorkers  # noqa: E402  (needs ray)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.allow_leaks  # Ray's own threads and sockets; the actors are checked below
async def test_killed_actor_is_replaced_and_batches_arrive_once_in_order(
    ray_cluster: None, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    # Indices from 4 on wait for the gate: actor 1 is inside batch 3 (indices 6, 7) when killed.
    ds = datasets.GatedDataset(24, open_below=4, gate=str(gate), limit=60)
    loader = AsyncDataLoader(ds, batch_size=2, num_workers=2, executor=RayWorkers(num_cpus=0))
    got: list[Any] = []
    earlier_actors = ray_actor_ids()
    with pytest.warns(RuntimeWarning, match=r"Ray actor worker 1 .*died.*send_idx=3"):
        async with loader:
            it = aiter(loader)
            async with asyncio.timeout(180):
                # Batches 0 and 1 (open): once both are received, actor 1's oldest call is
                # batch 3. (After batch 0 alone, batch 1's result may still be on its way.)
                got += [await anext(it), await anext(it)]
                (epoch,) = list(loader._epochs)
                victim = epoch.backend._actors[1]  # type: ignore[union-attr]
                ray.kill(victim)
                with pytest.raises(ray.exceptions.RayActorError):
                    await asyncio.wrap_future(victim.ready.remote().future())  # it is dead now
                gate.touch()
                got += [b async for b in it]
                stats = loader.stats()
        pids = loader_actor_pids(since=earlier_actors)
    # aclose() returned: every actor process, the killed one and the replacement's included, has
    # exited (Ray reports an actor dead before its process is gone).
    assert len(pids) == 4, pids
    assert [p for p in pids if _running(p)] == []
    assert [b.flatten().tolist() for b in got] == [[i, i + 1] for i in range(0, 24, 2)]
    assert stats.worker_restarts == 1
    assert live_loader_actors() == []


def test_ray_rejects_arguments_that_mean_processes() -> None:
    ds = datasets.RangeDataset(4)
    with pytest.raises(ValueError, match="multiprocessing_context"):
        AsyncDataLoader(ds, num_workers=2, multiprocessing_context="spawn", executor=RayWorkers())
    with pytest.raises(ValueError, match="worker_nice"):
        AsyncDataLoader(ds, num_workers=2, worker_nice=3, executor=RayWorkers())
    with pytest.raises(ValueError, match="num_workers >= 1"):
        AsyncDataLoader(ds, num_workers=0, executor=RayWorkers())
    with pytest.raises(ValueError, match="num_cpus"):
        RayWorkers(num_cpus=-1)
    with pytest.raises(ValueError, match="tasks_per_actor"):
        RayWorkers(tasks_per_actor=0)
