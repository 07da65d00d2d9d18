"""Exact mid-epoch resume: state_dict()/load_state_dict(), seeding="batch", set_epoch.

The round trip: run two epochs uninterrupted; run again, stop after batch k (or at the epoch's
end), save the state through JSON, build a fresh loader (other num_workers where it says so),
load, finish the epoch and run the next; the batches must equal the uninterrupted run's.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from aioloader import AsyncDataLoader
from tests import datasets
from tests import resume_data as rd

N = 22  # samples: with batch_size 4, five full batches and a partial one

Make = Callable[[], AsyncDataLoader[Any]]


def _plain(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, list | tuple):
        return [_plain(b) for b in batch]
    return batch


async def _epoch(loader: AsyncDataLoader[Any], stop: int | None = None) -> list[Any]:
    out: list[Any] = []
    if stop == 0:  # the epoch starts (its seed is drawn) and ends before any batch
        await loader.__aiter__().aclose()
        return out
    async with asyncio.timeout(60):
        async for batch in loader:
            out.append(_plain(batch))
            if stop is not None and len(out) == stop:
                break
    return out


def _json(state: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(state))  # type: ignore[no-any-return]


async def round_trip(
    make: Make,
    k: int | None,
    *,
    resume_make: Make | None = None,
    next_exact: bool = True,
    sort: bool = False,
) -> None:
    """Stop after batch ``k`` (None: after the whole epoch), resume, compare with no stop."""
    torch.manual_seed(1234)
    async with make() as loader:
        full = [await _epoch(loader), await _epoch(loader)]
    torch.manual_seed(1234)
    async with make() as loader:
        head = await _epoch(loader, k)
        state = _json(loader.state_dict())
    torch.manual_seed(98765)  # a fresh process's global RNG is not the interrupted one's
    async with (resume_make or make)() as loader:
        loader.load_state_dict(state)
        assert _json(loader.state_dict()) == state  # a state right after a restore is the same
        rest = await _epoch(loader)
        after = await _epoch(loader)
    if k is None:
        assert head == full[0]
        if next_exact:
            assert rest == full[1]
        return
    assert len(head) == min(k, len(full[0]))
    if sort:  # in_order=False: the same batches, each exactly once, in completion order
        assert sorted(map(repr, head + rest)) == sorted(map(repr, full[0]))
    else:
        assert head + rest == full[0]
    if next_exact:
        assert after == full[1]


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(7)


# Sampler configurations, single process (num_workers=0): cheap, so every stop position is run.
CONFIGS: dict[str, tuple[Make, bool]] = {
    "shuffle+generator": (
        lambda: AsyncDataLoader(rd.Indexed(N), 4, shuffle=True, generator=_g()),
        True,
    ),
    "shuffle, global RNG": (lambda: AsyncDataLoader(rd.Indexed(N), 4, shuffle=True), False),
    "sequential": (lambda: AsyncDataLoader(rd.Indexed(N), 4), True),
    "drop_last": (
        lambda: AsyncDataLoader(rd.Indexed(N), 4, shuffle=True, drop_last=True, generator=_g()),
        True,
    ),
    "batch_size=None": (
        lambda: AsyncDataLoader(rd.Indexed(7), None, shuffle=True, generator=_g()),
        True,
    ),
    "RandomSampler replacement": (
        lambda: AsyncDataLoader(
            rd.Indexed(N),
            4,
            sampler=RandomSampler(rd.Indexed(N), replacement=True, num_samples=21, generator=_g()),
        ),
        True,
    ),
    "RandomSampler own generator": (
        lambda: AsyncDataLoader(
            rd.Indexed(N), 4, sampler=RandomSampler(rd.Indexed(N), generator=_g())
        ),
        True,
    ),
    "BatchSampler": (
        lambda: AsyncDataLoader(
            rd.Indexed(N), batch_sampler=BatchSampler(SequentialSampler(range(N)), 5, False)
        ),
        True,
    ),
    "WeightedRandomSampler": (
        lambda: AsyncDataLoader(rd.Indexed(N), 4, sampler=WeightedRandomSampler([1.0] * N, N)),
        False,
    ),
    "SubsetRandomSampler+generator": (
        lambda: AsyncDataLoader(
            rd.Indexed(N), 4, sampler=SubsetRandomSampler(list(range(0, N, 2)), generator=_g())
        ),
        True,
    ),
    "DistributedSampler": (
        lambda: AsyncDataLoader(
            rd.Indexed(N),
            4,
            sampler=DistributedSampler(rd.Indexed(N), num_replicas=2, rank=1, seed=3),
        ),
        True,
    ),
    "custom, global RNG": (
        lambda: AsyncDataLoader(rd.Indexed(N), 4, sampler=rd.GlobalRngSampler(N)),
        False,
    ),
    "custom with state_dict": (
        lambda: AsyncDataLoader(rd.Indexed(N), 4, sampler=rd.StatefulSampler(N)),
        True,
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
async def test_round_trip_every_position(name: str) -> None:
    make, next_exact = CONFIGS[name]
    torch.manual_seed(0)
    async with make() as probe:
        batches = len(await _epoch(probe))
    for k in [*range(batches + 1), None]:
        await round_trip(make, k, next_exact=next_exact)


def _workers(n: int, **kw: Any) -> Make:
    def make() -> AsyncDataLoader[Any]:
        return AsyncDataLoader(
            rd.Indexed(N),
            4,
            shuffle=True,
            generator=_g(),
            num_workers=n,
            multiprocessing_context="fork" if n else None,
            **kw,
        )

    return make


@pytest.mark.parametrize("k", [0, 2, 5])
@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 0), (0, 2), (2, 1)])
async def test_resume_with_other_num_workers(k: int, before: int, after: int) -> None:
    """bionemo-recipes#1212: resume required the same num_workers. Map-style needs not."""
    await round_trip(_workers(before), k, resume_make=_workers(after))


async def test_persistent_workers_full_epochs_after_resume() -> None:
    """huggingface/datasets#7447: persistent_workers=True shortened epochs after a resume."""
    make = _workers(2, persistent_workers=True)
    for k in (1, 4, None):
        await round_trip(make, k)


@pytest.mark.parametrize("k", [1, 3])
async def test_in_order_false_delivers_exactly_the_rest(k: int) -> None:
    slow = frozenset(range(0, N, 3))

    def make() -> AsyncDataLoader[Any]:
        return AsyncDataLoader(
            rd.Indexed(N, slow),
            2,
            generator=_g(),
            shuffle=True,
            num_workers=2,
            in_order=False,
            multiprocessing_context="fork",
        )

    await round_trip(make, k, sort=True, next_exact=False)
    # Out of order the state names exactly which batches arrived, past the oldest missing one.
    async with make() as loader:
        await _epoch(loader, 4)
        state = loader.state_dict()
    assert state["batches_delivered"] == 4
    assert state["delivered_below"] + len(state["delivered_also"]) == 4


async def test_state_at_epoch_end_resumes_the_whole_next_epoch() -> None:
    """meta-pytorch/data#1437: a state saved at an epoch's end dropped the next epoch."""
    make = CONFIGS["shuffle+generator"][0]
    async with make() as loader:
        first = await _epoch(loader)
        state = _json(loader.state_dict())
        second = await _epoch(loader)
    assert state["epoch"] == 1 and state["batches_delivered"] == 0
    async with make() as loader:
        loader.load_state_dict(state)
        assert await _epoch(loader) == second
    assert len(second) == len(first)


async def test_state_dict_is_small_and_costs_nothing_per_batch() -> None:
    """data#1317: per-step snapshots cost seconds. The state is O(1) to keep and to take."""
    sampler = rd.StatefulSampler(400)
    async with AsyncDataLoader(rd.Indexed(400), 1, sampler=sampler) as loader:
        sizes = []
        async with asyncio.timeout(60):
            async for _ in loader:
                sizes.append(len(json.dumps(loader.state_dict())))
    # The sampler's own state is taken once per epoch, never per batch or per state_dict().
    assert sampler.state_dict_calls == 1
    assert max(sizes) - min(sizes) <= 4  # only the counters' digits grow


async def test_prefetched_batches_are_loaded_again() -> None:
    """data#1520: batches in flight at save time were dropped on resume."""
    make = _workers(2, prefetch_factor=4)
    await round_trip(make, 1)


async def test_stateless_iterable_says_what_to_implement() -> None:
    """data#1520: non-stateful iterables were silently replayed from the start."""
    async with AsyncDataLoader(rd.Stateless(10), 2) as loader:
        assert loader.state_dict()["batches_delivered"] == 0  # nothing delivered: fine
        await _epoch(loader, 2)
        with pytest.raises(ValueError, match="implement state_dict"):
            loader.state_dict()


async def test_set_epoch_is_restored() -> None:
    """data#1513: set_epoch was not restored (and an exhausted sampler not reset)."""

    def make() -> AsyncDataLoader[Any]:
        sampler = DistributedSampler(rd.Indexed(N), num_replicas=2, rank=0, seed=5)
        return AsyncDataLoader(rd.Indexed(N), 3, sampler=sampler)

    async with make() as loader:
        loader.set_epoch(4)
        assert loader.sampler.epoch == 4  # type: ignore[attr-defined]
        whole = await _epoch(loader)
    async with make() as loader:
        loader.set_epoch(4)
        head = await _epoch(loader, 2)
        state = _json(loader.state_dict())
    async with make() as loader:
        loader.load_state_dict(state)
        assert loader.sampler.epoch == 0  # type: ignore[attr-defined]  # until the epoch starts
        rest = await _epoch(loader)
        assert loader.sampler.epoch == 4  # type: ignore[attr-defined]
        # The sampler was used up by the interrupted epoch; the next epoch is whole again.
        again = await _epoch(loader)
    assert head + rest == whole
    assert again == whole  # same set_epoch value: the same order


async def test_load_after_aiter_raises() -> None:
    """prime-rl#3332: iter() before load_state_dict silently restarted from sample 0."""
    make = CONFIGS["shuffle+generator"][0]
    async with make() as loader:
        await _epoch(loader, 2)
        state = loader.state_dict()
    async with make() as loader:
        it = aiter(loader)
        with pytest.raises(RuntimeError, match="before the next `async for`"):
            loader.load_state_dict(state)
        await it.aclose()  # type: ignore[attr-defined]
        loader.load_state_dict(state)  # the epoch ended: now it is fine
        assert loader.state_dict() == state  # and state_dict() reports what was loaded


async def test_second_resume_in_the_same_epoch() -> None:
    """KempnerForge#57: a second resume within one epoch was misaligned."""
    make = CONFIGS["shuffle+generator"][0]
    async with make() as loader:
        whole = await _epoch(loader)
    async with make() as loader:
        a = await _epoch(loader, 1)
        state = _json(loader.state_dict())
    async with make() as loader:
        loader.load_state_dict(state)
        b = await _epoch(loader, 2)
        state = _json(loader.state_dict())
    async with make() as loader:
        loader.load_state_dict(state)
        c = await _epoch(loader)
    assert a + b + c == whole


async def test_distributed_sampler_no_duplicates_after_resume() -> None:
    """huggingface/accelerate#3938: DDP wrappers duplicated indices after a resume."""
    seen: list[int] = []
    for rank in (0, 1):

        def make(rank: int = rank) -> AsyncDataLoader[Any]:
            s = DistributedSampler(rd.Indexed(N), num_replicas=2, rank=rank, seed=1)
            return AsyncDataLoader(
                rd.Indexed(N), 2, sampler=s, num_workers=2, multiprocessing_context="fork"
            )

        async with make() as loader:
            head = await _epoch(loader, 2)
            state = _json(loader.state_dict())
        async with make() as loader:
            loader.load_state_dict(state)
            rest = await _epoch(loader)
        seen += [i for b in head + rest for i in b]
    assert sorted(seen) == list(range(N))  # N is even: no padding


def _aug(n_workers: int, **kw: Any) -> Make:
    return lambda: AsyncDataLoader(
        rd.Augmented(12),
        3,
        shuffle=True,
        generator=_g(),
        num_workers=n_workers,
        seeding="batch",
        multiprocessing_context="fork" if n_workers else None,
        **kw,
    )


async def test_batch_seeding_is_bit_identical_for_any_num_workers() -> None:
    results = []
    for n in (0, 1, 2):
        async with _aug(n)() as loader:
            results.append([await _epoch(loader), await _epoch(loader)])
    assert results[0] == results[1] == results[2]
    assert results[0][0] != results[0][1]  # a new epoch, new augmentations


async def test_batch_seeding_resume_is_exact_including_augmentations() -> None:
    for k in (1, 3):
        await round_trip(_aug(2), k, resume_make=_aug(1))
    await round_trip(_aug(2, in_order=False), 2, sort=True, next_exact=False)


async def test_batch_seeding_leaves_the_main_process_rng_alone() -> None:
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    async with _aug(0)() as loader:
        await _epoch(loader)
    # Only the loader's own draws from the global RNG (none: it has a generator) happened.
    assert torch.equal(torch.rand(4), expected)


async def test_worker_seeding_stays_torchs() -> None:
    async with AsyncDataLoader(
        rd.Augmented(4), 2, num_workers=2, generator=_g(), multiprocessing_context="fork"
    ) as loader:
        ours = await _epoch(loader)
    torch_loader = torch.utils.data.DataLoader(
        rd.Augmented(4), 2, num_workers=2, generator=_g(), multiprocessing_context="fork"
    )
    assert ours == [_plain(b) for b in torch_loader]


@pytest.mark.parametrize("dataset", [rd.Counting, rd.DatasetLevelState])
@pytest.mark.parametrize("workers", [0, 2])
async def test_iterable_resumes_per_worker(dataset: Any, workers: int) -> None:
    if dataset is rd.DatasetLevelState and workers:
        pytest.skip("this dataset does not shard by worker: every worker would yield it all")

    def make() -> AsyncDataLoader[Any]:
        return AsyncDataLoader(
            dataset(23), 3, num_workers=workers, multiprocessing_context="fork" if workers else None
        )

    for k in (0, 1, 4, None):
        await round_trip(make, k)


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # 3 > 2 cores
async def test_iterable_resume_after_a_worker_ran_dry() -> None:
    """Shards of 4, 3 and 3 samples in batches of 3: workers 1 and 2 run dry first."""

    def make() -> AsyncDataLoader[Any]:
        return AsyncDataLoader(rd.Counting(10), 3, num_workers=3, multiprocessing_context="fork")

    for k in (2, 3, 4, None):
        await round_trip(make, k)
    async with make() as loader:
        await _epoch(loader, 4)  # all four batches, the dry workers' indices skipped between
        state = loader.state_dict()
    assert (state["delivered_below"], state["delivered_also"]) == (4, [])


async def test_iterable_resume_needs_the_same_num_workers() -> None:
    async with AsyncDataLoader(
        rd.Counting(20), 2, num_workers=2, multiprocessing_context="fork"
    ) as loader:
        await _epoch(loader, 3)
        state = loader.state_dict()
    loader = AsyncDataLoader(rd.Counting(20), 2, num_workers=1)
    with pytest.raises(ValueError, match="same num_workers"):
        loader.load_state_dict(state)


async def test_iterable_resume_under_spawn() -> None:
    """The dataset states travel to spawned workers (saved under fork, resumed under spawn)."""

    def make(method: str) -> Make:
        return lambda: AsyncDataLoader(
            rd.Counting(15),
            2,
            num_workers=2,
            multiprocessing_context=method,
            persistent_workers=True,
        )

    await round_trip(make("fork"), 3, resume_make=make("spawn"))


async def test_bad_states_are_refused_clearly() -> None:
    loader = AsyncDataLoader(rd.Indexed(4), 2)
    with pytest.raises(ValueError, match="pass a dict returned by"):
        loader.load_state_dict({"epoch": 1})
    good = loader.state_dict()
    with pytest.raises(ValueError, match="upgrade aioloader"):
        loader.load_state_dict({**good, "version": 99})
    with pytest.raises(ValueError, match="map-style"):
        AsyncDataLoader(rd.Counting(4), 2).load_state_dict(good)
    with pytest.raises(ValueError, match="seeding should be"):
        AsyncDataLoader(rd.Indexed(4), 2, seeding="sample")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both rank and world_size"):
        AsyncDataLoader(rd.Indexed(4), 2, rank=1)
    await loader.aclose()
    with pytest.raises(Exception, match="closed"):
        loader.load_state_dict(good)


async def test_state_is_safe_for_torch_save(tmp_path: Path) -> None:
    make = CONFIGS["custom with state_dict"][0]
    async with make() as loader:
        await _epoch(loader, 2)
        state = loader.state_dict()
    torch.save(state, tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True) == state


# ------------------------------------------------------------------ real processes: DDP, SIGKILL

_REPO = Path(__file__).resolve().parent.parent


def _run(
    code: str, where: Path, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` as a script file (spawned processes re-import it by path)."""
    script = where / "script.py"
    script.write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": str(_REPO)}
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=_REPO,
        check=False,
    )


_DDP = """
import asyncio, json, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.utils.data import DistributedSampler
from aioloader import AsyncDataLoader
from tests import datasets
from tests import resume_data as rd

N = 30

async def epochs(rank, world):
    out = {}
    def make():
        s = DistributedSampler(rd.Indexed(N), num_replicas=world, rank=rank, seed=2)
        return AsyncDataLoader(rd.Indexed(N), 2, sampler=s, num_workers=2,
                               multiprocessing_context="fork")
    async with make() as loader:
        for e in (0, 1):
            loader.set_epoch(e)
            out[e] = [i for b in [x async for x in loader] for i in b.tolist()]
    # resume mid-epoch 1 on this rank
    async with make() as loader:
        loader.set_epoch(1)
        head = []
        async for b in loader:
            head += b.tolist()
            if len(head) >= 4:
                break
        state = json.loads(json.dumps(loader.state_dict()))
    async with make() as loader:
        loader.load_state_dict(state)
        rest = [i for b in [x async for x in loader] for i in b.tolist()]
    out["resumed"] = head + rest
    # rank and world size reach the workers, for sharding an IterableDataset
    async with AsyncDataLoader(rd.Sharded(N), 3, num_workers=2,
                               multiprocessing_context="fork") as loader:
        out["sharded"] = [i for b in [x async for x in loader] for i in b.tolist()]
    return out

def main(rank, world, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        out = asyncio.run(epochs(rank, world))
        gathered = [None] * world
        dist.all_gather_object(gathered, out)
        if rank == 0:
            with open(path, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(main, args=(2, port, sys.argv[1]), nprocs=2, start_method="spawn")
"""


@pytest.mark.timeout(240)
def test_two_ranks_with_torch_distributed(tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    proc = _run(_DDP, tmp_path, str(out), timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    for e in ("0", "1"):
        both = ranks[0][e] + ranks[1][e]
        assert sorted(both) == list(range(30)), e  # the ranks partition the dataset
        assert not set(ranks[0][e]) & set(ranks[1][e])
    assert ranks[0]["0"] != ranks[0]["1"]  # set_epoch reshuffles
    for r in ranks:
        assert r["resumed"] == r["1"]  # a per-rank resume gives exactly the rest
    sharded = ranks[0]["sharded"] + ranks[1]["sharded"]
    assert sorted(sharded) == list(range(30))


_TRAIN = """
import asyncio, json, os, sys, torch
from aioloader import AsyncDataLoader
from tests import datasets
from tests import resume_data as rd

path = sys.argv[1]

async def main():
    # No generator: the order comes from this process's global RNG, which a restart changes.
    torch.manual_seed(os.getpid())
    loader = AsyncDataLoader(rd.Indexed(60, frozenset(range(60))), 3, shuffle=True, num_workers=2,
                             multiprocessing_context="fork")
    seen = []
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        loader.load_state_dict(saved["loader"])
        seen = saved["seen"]
    async with loader:
        async for batch in loader:
            seen += batch.tolist()
            tmp = path + ".tmp"
            with open(tmp, "w") as f:  # the samples trained on and the state, atomically
                json.dump({"seen": seen, "loader": loader.state_dict()}, f)
            os.replace(tmp, path)
    print("DONE", len(seen), flush=True)

asyncio.run(main())
"""


@pytest.mark.timeout(240)
def test_resume_after_sigkill_is_exactly_once(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.json"
    env = {**os.environ, "PYTHONPATH": str(_REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_TRAIN), str(path)],
        env=env,
        cwd=_REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            if path.exists() and len(json.loads(path.read_text())["seen"]) >= 15:
                break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        else:
            pytest.fail("the training process made no progress")
        os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its workers, mid-epoch
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    before = len(json.loads(path.read_text())["seen"])
    assert 15 <= before < 60
    done = _run(_TRAIN, tmp_path, str(path), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(path.read_text())["seen"]
    assert sorted(seen) == list(range(60))  # every sample once over the two runs


@pytest.mark.parametrize(
    "changed",
    [{"batch_size": 8}, {"drop_last": True}, {"n": 60}, {"seeding": "batch"}],
    ids=["batch_size", "drop_last", "sampler_len", "seeding"],
)
async def test_a_mid_epoch_state_is_refused_by_a_loader_that_batches_differently(
    changed: dict[str, object],
) -> None:
    """Received batches are skipped by count: another batching would skip undelivered samples."""
    base: dict[str, Any] = {"n": 62, "batch_size": 4, "drop_last": False, "seeding": "worker"}

    def make(**kw: Any) -> AsyncDataLoader[Any]:
        n = kw.pop("n")
        return AsyncDataLoader(datasets.RangeDataset(n), **kw)

    first = make(**base)
    async with asyncio.timeout(60):
        got = 0
        async for _ in first:
            got += 1
            if got == 5:
                break
    state = first.state_dict()
    field = "sampler_len" if "n" in changed else next(iter(changed))
    with pytest.raises(ValueError, match=f"saved mid-epoch by a loader with {field}="):
        make(**{**base, **changed}).load_state_dict(state)
    # The same loader resumes; a state saved at an epoch's end loads into any batching.
    make(**base).load_state_dict(state)
    async with asyncio.timeout(60):
        async for _ in first:
            pass
    make(**{**base, **changed}).load_state_dict(first.state_dict())


def test_an_epoch_end_resume_leaves_the_global_rng_where_the_uninterrupted_run_does() -> None:
    """shuffle=True without a generator: RandomSampler's seed comes from the global RNG, and a
    resumed run must draw it from there too (it drew from a copy: later epochs differed)."""

    def make() -> Any:
        return AsyncDataLoader(datasets.RangeDataset(10), batch_size=None, shuffle=True).sync()

    def flat(dl: Any) -> list[int]:
        return [int(x) for x in dl]

    torch.manual_seed(0)
    with make() as dl:
        uninterrupted = [flat(dl) for _ in range(4)]
    torch.manual_seed(0)
    with make() as dl:
        flat(dl), flat(dl)
        state = dl.state_dict()  # the end of epoch 1: the start of epoch 2
    with make() as dl:
        dl.load_state_dict(state)
        resumed = [flat(dl), flat(dl)]
    assert resumed == uninterrupted[2:]


class _Augmented(torch.utils.data.Dataset[torch.Tensor]):
    """Sample i with a random augmentation drawn in the worker."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


async def test_the_ddp_recipe_resumes_augmentations_of_later_epochs_exactly() -> None:
    """docs/resume.md's recipe: a DistributedSampler, seeding="batch" and a generator per rank.
    After a mid-epoch resume in a process whose global RNG differs, the rest of that epoch and
    every later one are bit-identical, augmentations included."""
    from torch.utils.data import DistributedSampler

    def make(rank: int) -> AsyncDataLoader[Any]:
        sampler = DistributedSampler(_Augmented(), num_replicas=2, rank=rank, seed=0)
        return AsyncDataLoader(
            _Augmented(), batch_size=4, sampler=sampler, num_workers=2, seeding="batch",
            generator=torch.Generator().manual_seed(1000 + rank),
        )  # fmt: skip

    async def epochs(loader: AsyncDataLoader[Any], start: int, stop: int) -> list[list[float]]:
        out = []
        for epoch in range(start, stop):
            loader.set_epoch(epoch)
            out += [b.flatten().tolist() async for b in loader]
        return out

    async with asyncio.timeout(120):
        for rank in (0, 1):
            torch.manual_seed(0)
            async with make(rank) as whole:
                uninterrupted = await epochs(whole, 0, 3)
            torch.manual_seed(0)
            async with make(rank) as first:
                first.set_epoch(0)
                head = []
                async for b in first:
                    head.append(b.flatten().tolist())
                    if len(head) == 3:
                        break
                state = first.state_dict()
            torch.manual_seed(12345)  # another process: another global RNG
            async with make(rank) as resumed:
                resumed.load_state_dict(state)
                assert resumed.state_dict()["epoch"] == 0
                rest = [b.flatten().tolist() async for b in resumed]  # set_epoch restored
                rest += await epochs(resumed, 1, 3)
            assert head + rest == uninterrupted
