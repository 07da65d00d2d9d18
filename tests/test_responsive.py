"""The sampler stage: torch's exact index batches, without holding the event loop.

torch's RandomSampler builds ``randperm(n).tolist()`` in its first ``next()`` (seconds for tens of
millions of samples); IndexStream must give the same batches, drawing the same random numbers,
while a ticker task on the same loop keeps ticking.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    Dataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from aioloader import AsyncDataLoader, _payload
from aioloader._sampling import IndexStream, is_empty_batch
from aioloader._threads import run_off_loop
from tests import datasets
from tests.conftest import collect, torch_batches

# Large enough that the off-loop path draws permutations on a thread (see _OFF_LOOP_DRAW).
_BIG = 1 << 15

_END = "end"


# ------------------------------------------------------------------------------------ helpers


def _state(g: torch.Generator | None) -> tuple[bytes, bytes | None]:
    """The global RNG's state and ``g``'s: which random numbers were drawn so far."""
    own = None if g is None else g.get_state().numpy().tobytes()
    return torch.get_rng_state().numpy().tobytes(), own


def _norm(item: Any) -> Any:
    return item.tolist() if isinstance(item, (np.ndarray, torch.Tensor)) else item


def _torch_trace(
    make: Callable[[], tuple[Any, torch.Generator | None]], rng_seed: int = 1234
) -> list[Any]:
    """Every item of torch's own iteration, each with the RNG states right after it was drawn."""
    torch.manual_seed(rng_seed)
    sampler, g = make()
    out = [(_norm(item), _state(g)) for item in sampler]
    out.append((_END, _state(g)))
    return out


async def _stream_trace(
    make: Callable[[], tuple[Any, torch.Generator | None]], rng_seed: int = 1234
) -> list[Any]:
    torch.manual_seed(rng_seed)
    sampler, g = make()
    stream = IndexStream(sampler, batch_sampler=False)
    out = []
    async with asyncio.timeout(30):
        async for item in stream:
            out.append((_norm(item), _state(g)))
    out.append((_END, _state(g)))
    return out


def _random(
    n: int, seed: int | None, batch_size: int | None, drop_last: bool, **kwargs: Any
) -> Callable[[], tuple[Any, torch.Generator | None]]:
    def make() -> tuple[Any, torch.Generator | None]:
        g = None
        if seed is not None:
            g = torch.Generator()
            g.manual_seed(seed)
        sampler: Any = RandomSampler(range(n), generator=g, **kwargs)
        if batch_size is not None:
            sampler = BatchSampler(sampler, batch_size, drop_last)
        return sampler, g

    return make


@contextlib.asynccontextmanager
async def _worst_gap(period: float = 0.002) -> AsyncIterator[list[float]]:
    """Yields a list that holds, on exit, the longest time the loop let a ticker wait."""
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(period)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(period * 5)  # ticking before the operation starts
    result: list[float] = []
    try:
        yield result
    finally:
        await asyncio.sleep(period * 5)
        stop.set()
        async with asyncio.timeout(5):
            await task
        result.append(max(gaps))


# ------------------------------------------------------------- same batches as torch's samplers

BATCHING = [
    pytest.param(None, False, id="no-batching"),
    pytest.param(1, False, id="bs1"),
    pytest.param(7, False, id="bs7"),
    pytest.param(7, True, id="bs7-drop_last"),
    pytest.param(32, True, id="bs32-drop_last"),
]

RANDOM_KWARGS: list[dict[str, Any]] = [
    {},  # one permutation
    {"num_samples": 3},  # a part of one
    {"num_samples": 200},  # several, then a part
    {"replacement": True},
    {"replacement": True, "num_samples": 64},  # whole chunks of 32 draws (and an empty one)
    {"replacement": True, "num_samples": 77},  # and a shorter last chunk
]


@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "generator"])
@pytest.mark.parametrize(("batch_size", "drop_last"), BATCHING)
async def test_random_sampler_replayed_exactly(
    batch_size: int | None, drop_last: bool, seeded: bool
) -> None:
    """Same items in the same order, and the same random numbers drawn by each item."""
    for kwargs in RANDOM_KWARGS:
        for n in (1, 5, 32, 33, 100):
            for seed in range(3):
                make = _random(n, seed if seeded else None, batch_size, drop_last, **kwargs)
                # Unseeded, a fresh generator is seeded from the global RNG: vary that too.
                expected = _torch_trace(make, rng_seed=seed)
                assert await _stream_trace(make, rng_seed=seed) == expected, (kwargs, n, seed)


async def test_random_sampler_replayed_exactly_fuzzed() -> None:
    """Sizes, batch sizes and sample counts off the round numbers above."""
    rnd = random.Random(0)
    for case in range(60):
        n = rnd.randint(1, 300)
        batch_size = rnd.choice([None, rnd.randint(1, 70)])
        drop_last = batch_size is not None and rnd.random() < 0.5
        kwargs = {
            "replacement": rnd.random() < 0.4,
            "num_samples": rnd.choice([None, rnd.randint(1, 700)]),
        }
        seed = rnd.choice([None, rnd.randint(0, 2**31)])
        make = _random(n, seed, batch_size, drop_last, **kwargs)
        expected = _torch_trace(make, rng_seed=case)
        got = await _stream_trace(make, rng_seed=case)
        assert got == expected, (n, batch_size, drop_last, kwargs, seed)


@pytest.mark.parametrize("seeded", [False, True], ids=["global-rng", "generator"])
@pytest.mark.parametrize(
    ("batch_size", "drop_last", "num_samples"),
    [
        (4096, False, None),
        (4096, True, 2 * _BIG + 5),
        (5000, False, 2 * _BIG),
        (20_000, False, 3 * _BIG),  # batches larger than one conversion step
        (None, False, 3),
    ],
)
async def test_large_permutations_drawn_off_the_loop_replayed_exactly(
    batch_size: int | None, drop_last: bool, num_samples: int | None, seeded: bool
) -> None:
    """Permutations drawn on a thread (n >= 2**15) give the same batches and RNG draws."""
    make = _random(_BIG, 7 if seeded else None, batch_size, drop_last, num_samples=num_samples)
    assert await _stream_trace(make) == _torch_trace(make)


@pytest.mark.parametrize(("batch_size", "drop_last"), BATCHING)
async def test_sequential_sampler_replayed_exactly(batch_size: int | None, drop_last: bool) -> None:
    for n in (0, 1, 5, 7, 64, 100):

        def make(n: int = n) -> tuple[Any, None]:
            sampler: Any = SequentialSampler(range(n))
            if batch_size is not None:
                sampler = BatchSampler(sampler, batch_size, drop_last)
            return sampler, None

        assert await _stream_trace(make) == _torch_trace(make), n


class _RandomSubclass(RandomSampler):
    """Not the exact stock type: takes the generic path."""


def _other_samplers() -> list[Any]:
    g = torch.Generator()
    g.manual_seed(3)
    return [
        pytest.param(lambda: (_RandomSubclass(range(50)), None), id="RandomSampler-subclass"),
        pytest.param(
            lambda: (BatchSampler(_RandomSubclass(range(50)), 8, False), None), id="batch-subclass"
        ),
        pytest.param(lambda: (SubsetRandomSampler([3, 1, 4, 1, 5, 9]), None), id="subset"),
        pytest.param(
            lambda: (WeightedRandomSampler([0.1, 0.9, 0.4, 3.0], 20), None), id="weighted"
        ),
        pytest.param(lambda: ([[3, 1], [0], [2, 2, 2]], None), id="list-of-batches"),
        pytest.param(lambda: (iter([[0], [1]]), None), id="one-shot-iterator"),
        pytest.param(lambda: (BatchSampler(range(10), 3, False), None), id="batch-over-range"),
    ]


@pytest.mark.parametrize("make", _other_samplers())
async def test_other_samplers_pulled_as_torch_pulls_them(
    make: Callable[[], tuple[Any, torch.Generator | None]],
) -> None:
    assert await _stream_trace(make) == _torch_trace(make)


async def test_stream_ends_for_good() -> None:
    for sampler in (BatchSampler(RandomSampler(range(4)), 2, False), [[1], [2]]):
        stream = IndexStream(sampler, batch_sampler=False)
        async with asyncio.timeout(10):
            assert len([b async for b in stream]) == 2
            for _ in range(2):
                with pytest.raises(StopAsyncIteration):
                    await stream.next()


# ----------------------------------------------------------------------------------- errors


class _Failing(Sampler[list[int]]):
    """Yields ``good`` batches, then raises ``exc``; records the threads it ran on."""

    def __init__(self, good: int, exc: BaseException) -> None:
        self.good = good
        self.exc = exc
        self.iters = 0

    def __iter__(self) -> Iterator[list[int]]:
        self.iters += 1
        for i in range(self.good):
            yield [i]
        raise self.exc


@pytest.mark.parametrize("good", [0, 2], ids=["first-pull", "later-pull"])
async def test_sampler_exception_propagates_unchanged(good: int) -> None:
    exc = ValueError("sampler broke")
    stream = IndexStream(_Failing(good, exc), batch_sampler=True)
    async with asyncio.timeout(10):
        assert [await stream.next() for _ in range(good)] == [[i] for i in range(good)]
        with pytest.raises(ValueError) as info:
            await stream.next()
    assert info.value is exc


@pytest.mark.parametrize("replacement", [False, True])
async def test_stock_sampler_errors_match_torch(replacement: bool) -> None:
    """A dataset that shrank to nothing after the sampler was made: torch's own error."""
    ds = datasets.RangeDataset(4)
    sampler = BatchSampler(RandomSampler(ds, replacement=replacement, num_samples=4), 2, False)
    ds.n = 0
    with pytest.raises(Exception) as expected:
        list(sampler)
    stream = IndexStream(sampler, batch_sampler=False)
    async with asyncio.timeout(10):
        with pytest.raises(type(expected.value), match=re.escape(str(expected.value))):
            await stream.next()
        with pytest.raises(StopAsyncIteration):  # as torch's generator, finished by the error
            await stream.next()


async def test_empty_batch_named_by_position() -> None:
    stream = IndexStream([[0], [1, 2], []], batch_sampler=True)
    async with asyncio.timeout(10):
        assert await stream.next() == [0]
        assert await stream.next() == [1, 2]
        with pytest.raises(IndexError, match=r"send_idx=2.*at least one index"):
            await stream.next()


async def test_empty_item_passes_without_batch_sampler() -> None:
    """Without a batch_sampler, items are whatever the sampler yields; [] is not judged."""
    stream = IndexStream([[], [1]], batch_sampler=False)
    async with asyncio.timeout(10):
        assert [b async for b in stream] == [[], [1]]


@pytest.mark.parametrize(
    ("indices", "empty"),
    [
        ([], True),
        ([0], False),
        ((), True),
        (np.array([0]), False),
        (np.array([0, 1]), False),
        (np.array([], dtype=np.int64), True),
        (torch.tensor([0]), False),
        (torch.tensor([3, 4]), False),
        (torch.empty(0, dtype=torch.int64), True),
        (torch.tensor(0), False),  # 0-d: no length
        (iter([]), False),  # no length: passed on, as torch passes it
    ],
)
def test_is_empty_batch(indices: Any, empty: bool) -> None:
    assert is_empty_batch(indices) is empty


# Factories: a tensor of indices sent to a worker process moves to shared memory (as with
# torch's DataLoader), so each test makes its own, freed (with its fd) when the test ends.
BATCH_SAMPLERS = [
    pytest.param(lambda: [np.array([0, 1]), np.array([2, 3])], id="np-arrays"),
    pytest.param(lambda: [np.array([0]), np.array([1])], id="np-single-zero"),
    pytest.param(lambda: [torch.tensor([0, 1]), torch.tensor([2, 3])], id="tensors"),
    pytest.param(lambda: [torch.tensor([0]), torch.tensor([5])], id="tensor-single-zero"),
    pytest.param(lambda: [[0], [1, 2]], id="lists-single-zero"),
]


@pytest.mark.parametrize("make", BATCH_SAMPLERS)
async def test_array_batches_pass_through_the_stream(make: Callable[[], list[Any]]) -> None:
    batch_sampler = make()
    stream = IndexStream(batch_sampler, batch_sampler=True)
    async with asyncio.timeout(10):
        got = [b async for b in stream]
    assert [_norm(b) for b in got] == [_norm(b) for b in batch_sampler]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("make", BATCH_SAMPLERS)
async def test_loader_accepts_array_batches_as_torch_does(
    make: Callable[[], list[Any]], num_workers: int
) -> None:
    ds = datasets.RangeDataset(8)
    batch_sampler = make()
    expected = torch_batches(ds, batch_sampler=batch_sampler)
    async with AsyncDataLoader(ds, batch_sampler=batch_sampler, num_workers=num_workers) as loader:
        got = await collect(loader)
    assert [b.tolist() for b in got] == [b.tolist() for b in expected]  # type: ignore[attr-defined]


# ------------------------------------------------------------------------------ cancellation


async def test_cancelled_draw_loses_nothing() -> None:
    """A next() cancelled while a permutation is drawn on a thread: the next call gets it."""
    make = _random(2 * _BIG, 11, 4096, False)
    expected = [item for item, _ in _torch_trace(make)][:-1]
    sampler, _ = make()
    stream = IndexStream(sampler, batch_sampler=False)
    first = asyncio.create_task(stream.next())
    await asyncio.sleep(0)  # the task is now waiting for the draw
    first.cancel()
    async with asyncio.timeout(30):
        with pytest.raises(asyncio.CancelledError):
            await first
        assert [b async for b in stream] == expected


class _SlowStart(Sampler[list[int]]):
    """A sampler whose set-up blocks (reading an index file, say) before the first batch."""

    def __init__(self, delay: float, batches: list[list[int]]) -> None:
        self.delay = delay
        self.batches = batches
        self.iters = 0

    def __iter__(self) -> Iterator[list[int]]:
        self.iters += 1
        time.sleep(self.delay)
        return iter(self.batches)


async def test_cancelled_first_pull_loses_nothing() -> None:
    sampler = _SlowStart(0.05, [[0], [1], [2]])
    stream = IndexStream(sampler, batch_sampler=True)
    first = asyncio.create_task(stream.next())
    await asyncio.sleep(0)
    first.cancel()
    async with asyncio.timeout(10):
        with pytest.raises(asyncio.CancelledError):
            await first
        assert [b async for b in stream] == [[0], [1], [2]]
    assert sampler.iters == 1


# ---------------------------------------------------------------------- loop responsiveness

# randperm(4 M).tolist() in one call holds the loop ~0.5 s on 2 busy cores.
_HUGE = 4_000_000


@pytest.mark.parametrize("batch_size", [64, None])
async def test_first_shuffled_batch_keeps_loop_responsive(batch_size: int | None) -> None:
    sampler: Any = RandomSampler(range(_HUGE))
    if batch_size is not None:
        sampler = BatchSampler(sampler, batch_size, False)
    stream = IndexStream(sampler, batch_sampler=False)
    async with _worst_gap() as worst, asyncio.timeout(30):
        first = [await stream.next() for _ in range(100)]
    assert len(set(np.ravel(first))) == 100 * (batch_size or 1)
    assert worst[0] < 0.1, f"the loop stalled {worst[0] * 1e3:.0f} ms"


async def test_slow_sampler_setup_runs_off_the_loop() -> None:
    stream = IndexStream(_SlowStart(0.4, [[0], [1]]), batch_sampler=True)
    async with _worst_gap() as worst, asyncio.timeout(30):
        assert [b async for b in stream] == [[0], [1]]
    assert worst[0] < 0.1, f"the loop stalled {worst[0] * 1e3:.0f} ms"


async def test_loader_first_shuffled_batch_keeps_loop_responsive() -> None:
    ds = datasets.RangeDataset(_HUGE)
    loader = AsyncDataLoader(ds, batch_size=64, shuffle=True, num_workers=0)
    async with _worst_gap() as worst, asyncio.timeout(60), loader:
        it = aiter(loader)
        batch = await anext(it)
        await it.aclose()
    assert batch.shape == (64, 1)
    assert worst[0] < 0.1, f"the loop stalled {worst[0] * 1e3:.0f} ms"


# ------------------------------------------------------------------------ worker payload


class _ListDataset(Dataset[int]):
    """Many small Python objects: what makes pickling for spawn/forkserver slow."""

    def __init__(self, n: int) -> None:
        self.items = [(i, f"s{i}") for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> int:
        return self.items[i][0]


def _first(batch: list[int]) -> int:
    return batch[0]


@pytest.mark.parametrize(
    "collate", [_first, lambda batch: batch[0]], ids=["plain-pickle", "cloudpickle"]
)
def test_payload_round_trips(collate: Callable[[list[int]], int]) -> None:
    """A module-level function travels by plain pickle; a lambda needs the cloudpickle retry."""
    ds = _ListDataset(1000)
    payload, tensors = _payload.dump_payload((ds, collate, None))
    # Plain pickle unless something must go by value (its C pickler is faster; cloudpickle's
    # extra reducers would also accept what torch refuses, such as an open file).
    written = os.pread(payload.fd, os.fstat(payload.fd).st_size, 0)
    assert (b"cloudpickle" in written) == (collate is not _first)
    ds2, collate2, init = _payload.load_payload(payload, tensors)
    assert ds2.items == ds.items
    assert collate2([7, 8]) == 7
    assert init is None


async def test_payload_pickling_lets_the_loop_run() -> None:
    """The payload is written frame by frame, letting the loop run between frames."""
    ds = _ListDataset(300_000)
    async with _worst_gap() as worst, asyncio.timeout(60):
        start = time.perf_counter()
        payload, _ = await run_off_loop(
            lambda: _payload.dump_payload((ds, None, None)), name="payload"
        )
        took = time.perf_counter() - start
    payload.close()
    # One dumps() into bytes holds the loop for all of `took`. The pickler's memo table still
    # holds it while it grows (at 2**19 entries here) and when it is freed: tens of ms.
    assert worst[0] < 0.5 * took, f"the loop stalled {worst[0] * 1e3:.0f} ms of {took:.2f} s"
