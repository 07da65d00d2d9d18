"""Async sources: windows by size or time, async map-style datasets, backpressure, acks."""

from __future__ import annotations

import asyncio
import math
import traceback
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader
from aioloader.benchmark.stream import measure_stream
from tests import datasets
from tests import stream_sources as ss
from tests.conftest import collect, torch_batches


def values(batches: list[Any]) -> list[list[int]]:
    return [b.flatten().tolist() for b in batches]


def flat(batches: list[list[int]]) -> list[int]:
    return [x for b in batches for x in b]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("drop_last", [False, True])
async def test_windows_close_by_size_in_arrival_order(num_workers: int, drop_last: bool) -> None:
    async with AsyncDataLoader(
        ss.Counting(23), batch_size=5, num_workers=num_workers, drop_last=drop_last
    ) as loader:
        got = values(await collect(loader))
    expected = [list(range(i, min(i + 5, 23))) for i in range(0, 23, 5)]
    assert got == (expected[:-1] if drop_last else expected)


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_a_quiet_stream_yields_a_partial_batch_by_time(num_workers: int) -> None:
    # The source stops after 3 samples until the consumer has a batch: only the latency
    # window can deliver one (a size-only window would wait for ever).
    src = ss.Counting(10, gate_after=3)
    async with AsyncDataLoader(
        src, batch_size=8, num_workers=num_workers, max_batch_latency=0.05
    ) as loader:
        got = []
        async with asyncio.timeout(30):
            async for batch in loader:
                got.append(batch.flatten().tolist())
                src.gate.set()
    assert got[0] == [0, 1, 2]
    assert flat(got) == list(range(10))
    assert all(len(b) <= 8 for b in got)


async def test_batch_size_none_yields_samples_one_by_one() -> None:
    async with AsyncDataLoader(ss.Counting(4), batch_size=None, num_workers=1) as loader:
        got = await collect(loader)
    assert [int(x) for x in got] == [0, 1, 2, 3]  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("num_workers", "ctx"),
    [(0, None), (2, "fork"), (2, "forkserver")],
    ids=["thread", "fork", "forkserver"],
)
async def test_transform_runs_in_the_workers(num_workers: int, ctx: str | None) -> None:
    async with AsyncDataLoader(
        ss.Counting(12),
        batch_size=4,
        num_workers=num_workers,
        multiprocessing_context=ctx,
        transform=ss.with_worker,
    ) as loader:
        got = await collect(loader)
    assert [b["x"].flatten().tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    workers = {int(w) for b in got for w in b["worker"]}
    assert workers == ({-1} if num_workers == 0 else {0, 1})
    if num_workers == 0:  # collated on the fetch thread, never on the loop's
        assert not any(bool(m) for b in got for m in b["main_thread"])


@pytest.mark.parametrize(("num_workers", "fetch_in"), [(0, "loop"), (2, "loop"), (2, "workers")])
async def test_async_map_dataset_matches_torch_on_the_sync_twin(
    num_workers: int, fetch_in: str
) -> None:
    ds = ss.AsyncMap(50)
    kwargs: dict[str, Any] = {"batch_size": 7, "shuffle": True, "num_workers": num_workers}
    async with AsyncDataLoader(
        ds,
        generator=torch.Generator().manual_seed(3),
        source_concurrency=3,
        fetch_in=fetch_in,  # type: ignore[arg-type]
        **kwargs,
    ) as loader:
        assert loader.fetch_in == fetch_in
        got = values(await collect(loader))
    want = torch_batches(ss.SyncRange(50), generator=torch.Generator().manual_seed(3), **kwargs)
    assert got == values(want)
    if fetch_in == "loop":
        assert 1 < ds.max_running <= 3
    else:  # fetched by the workers' copies: this process's dataset is never called
        assert ds.max_running == 0


async def test_async_getitems_is_preferred() -> None:
    ds = ss.AsyncMapBatched(20)
    async with AsyncDataLoader(ds, batch_size=6, num_workers=1, fetch_in="loop") as loader:
        got = values(await collect(loader))
    assert flat(got) == list(range(20))
    assert ds.batched_calls == 4
    assert ds.max_running == 0  # __getitem__ never called


async def test_async_map_getitem_error_is_raised_at_its_batch() -> None:
    class Broken(ss.AsyncMap):
        async def __getitem__(self, i: int) -> torch.Tensor:
            if i == 9:
                raise KeyError("sample 9 is missing")
            return await super().__getitem__(i)

    async with AsyncDataLoader(Broken(16), batch_size=4, num_workers=0) as loader:
        it = aiter(loader)
        async with asyncio.timeout(30):
            assert (await anext(it)).flatten().tolist() == [0, 1, 2, 3]
            assert (await anext(it)).flatten().tolist() == [4, 5, 6, 7]
            with pytest.raises(KeyError, match="sample 9"):
                await anext(it)
            # As torch: the epoch goes on after one batch's error.
            assert (await anext(it)).flatten().tolist() == [12, 13, 14, 15]
            with pytest.raises(StopAsyncIteration):
                await anext(it)


BAD: list[Any] = [
    pytest.param({"shuffle": True}, ValueError, "stream", id="shuffle"),
    pytest.param({"sampler": [0, 1]}, ValueError, "no indices", id="sampler"),
    pytest.param({"batch_sampler": [[0, 1]]}, ValueError, "no indices", id="batch_sampler"),
    pytest.param({"max_batch_latency": 0}, ValueError, "positive number", id="latency-0"),
    pytest.param({"max_batch_latency": -1.0}, ValueError, "positive number", id="latency-neg"),
    pytest.param({"max_batch_latency": math.nan}, ValueError, "positive number", id="latency-nan"),
    pytest.param({"max_batch_latency": "1"}, ValueError, "positive number", id="latency-str"),
    pytest.param({"source_concurrency": 0}, ValueError, "source_concurrency", id="concurrency"),
    pytest.param({"transform": 3}, TypeError, "callable", id="transform"),
]


@pytest.mark.parametrize(("kwargs", "exc", "match"), BAD)
def test_bad_stream_arguments_say_what_is_wrong(
    kwargs: dict[str, Any], exc: type[Exception], match: str
) -> None:
    with pytest.raises(exc, match=match):
        AsyncDataLoader(ss.Counting(3), batch_size=2, **kwargs)


def test_stream_only_arguments_are_refused_elsewhere() -> None:
    with pytest.raises(ValueError, match="async sources only"):
        AsyncDataLoader(ss.SyncRange(3), transform=ss.with_worker)
    with pytest.raises(ValueError, match="async sources only"):
        AsyncDataLoader(ss.SyncRange(3), max_batch_latency=0.1)
    with pytest.raises(ValueError, match="async iterable"):
        AsyncDataLoader(ss.AsyncMap(3), max_batch_latency=0.1)
    with pytest.raises(TypeError, match="no len"):
        len(AsyncDataLoader(ss.Counting(3)))


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_a_source_error_reaches_the_consumer_at_its_position(num_workers: int) -> None:
    async with AsyncDataLoader(
        ss.Counting(20, fail_at=7), batch_size=5, num_workers=num_workers
    ) as loader:
        it = aiter(loader)
        async with asyncio.timeout(30):
            assert (await anext(it)).flatten().tolist() == [0, 1, 2, 3, 4]
            assert (await anext(it)).flatten().tolist() == [5, 6]
            with pytest.raises(ValueError, match="source broke at sample 7") as info:
                await anext(it)
            with pytest.raises(StopAsyncIteration):
                await anext(it)
    frames = "".join(traceback.format_tb(info.value.__traceback__))
    assert "__aiter__" in frames  # the source's own frame


@pytest.mark.parametrize("num_workers", [0, 1])
async def test_non_samples_get_a_clear_collate_error(num_workers: int) -> None:
    async def junk() -> Any:
        for _ in range(3):
            yield object()

    async with AsyncDataLoader(junk(), batch_size=3, num_workers=num_workers) as loader:
        with pytest.raises(TypeError, match="default_collate") as info:
            await collect(loader)
    assert "transform=" in str(info.value) + "".join(getattr(info.value, "__notes__", []))


async def test_backpressure_bounds_what_is_pulled_but_not_delivered() -> None:
    src = ss.Counting(None)  # endless and as fast as the loop lets it be
    batch_size, workers, prefetch = 8, 2, 2
    bound = (prefetch * workers + 1) * batch_size + 1
    delivered = 0
    worst = 0
    async with AsyncDataLoader(
        src, batch_size=batch_size, num_workers=workers, prefetch_factor=prefetch
    ) as loader:
        async with asyncio.timeout(60):
            async for batch in loader:
                delivered += len(batch)
                for _ in range(200):  # a slow consumer: the producer gets every chance to run
                    await asyncio.sleep(0)
                worst = max(worst, src.yielded - delivered)
                if delivered >= 40 * batch_size:
                    break
    assert worst <= bound, (worst, bound)
    assert src.closed  # break closed the source


async def test_acks_follow_delivery_in_order_and_cover_all_at_the_end() -> None:
    src = ss.Counting(30)
    async with AsyncDataLoader(src, batch_size=4, num_workers=2) as loader:
        got = values(await collect(loader))
    assert src.acked == got


async def test_break_acknowledges_only_what_the_body_finished() -> None:
    src = ss.Counting(None)
    got = []
    async with AsyncDataLoader(src, batch_size=4, num_workers=2) as loader:
        async with asyncio.timeout(30):
            async for batch in loader:
                got.append(batch.flatten().tolist())
                # Everything before the batch in hand, never it nor anything after it.
                assert src.acked == got[:-1]
                if len(got) == 3:
                    break
    assert src.acked == got[:2]


async def test_cancelled_consumer_acknowledges_nothing_undelivered() -> None:
    src = ss.Counting(100, gate_after=10)  # stalls after 10 samples: the consumer waits
    got: list[list[int]] = []
    two = asyncio.Event()

    async def consume(loader: AsyncDataLoader[Any]) -> None:
        async for batch in loader:
            got.append(batch.flatten().tolist())
            if len(got) == 2:
                two.set()

    async with AsyncDataLoader(src, batch_size=4, num_workers=1) as loader:
        task = asyncio.create_task(consume(loader))
        async with asyncio.timeout(30):
            await two.wait()
            for _ in range(50):
                await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert src.acked == [[0, 1, 2, 3], [4, 5, 6, 7]]  # asked for a third: both bodies finished
    assert src.closed


async def test_a_failing_ack_ends_the_epoch_with_its_error() -> None:
    src = ss.Counting(20, ack_error=ConnectionError("ack store is down"))
    async with AsyncDataLoader(src, batch_size=4, num_workers=1) as loader:
        it = aiter(loader)
        async with asyncio.timeout(30):
            await anext(it)
            with pytest.raises(ConnectionError, match="ack store is down") as info:
                await anext(it)
            with pytest.raises(StopAsyncIteration):
                await anext(it)
    assert any("acknowledging" in n for n in info.value.__notes__)


async def test_a_worker_killed_by_a_sample_is_replaced_and_nothing_is_lost(tmp_path: Any) -> None:
    src = ss.Counting(40)
    async with AsyncDataLoader(
        src,
        batch_size=4,
        num_workers=2,
        transform=ss.KillOnce(13, str(tmp_path / "killed")),
    ) as loader:
        with pytest.warns(RuntimeWarning, match="restarting"):
            got = values(await collect(loader))
        assert loader.stats().worker_restarts == 1
    assert flat(got) == list(range(40))
    assert src.acked == got  # each sample acknowledged exactly once


def test_stream_benchmark_measures_both_loaders() -> None:
    got = measure_stream(
        rates=[500.0],
        seconds=0.2,
        max_events=400,
        batch_size=16,
        latency_s=0.01,
        workers=1,
        rounds=1,
        progress=lambda _: None,
    )
    assert set(got) == {
        "p50 latency ms @500/s",
        "p99 latency ms @500/s",
        "events/s, unpaced source, aioloader num_workers=1",
        "events/s, unpaced source, aioloader num_workers=0",
    }
    for metric, per_loader in got.items():
        # The unpaced row with workers also has the machine's limit (the bare round trip); the
        # paced rows also time transform_in="workers" (with workers: without, it is the same).
        limit = {"limit"} if metric.endswith("num_workers=1") else set()
        auto = {"aio-workers"} if metric.startswith("p") else set()
        assert set(per_loader) == {"torch", "aioloader"} | limit | auto
        assert all(len(v) == 1 and v[0] > 0 for v in per_loader.values())


async def test_acks_count_receipt_not_device_preparation(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake accelerator turns the device stage on: it prepares batches ahead of the consumer,
    # and those must not be acknowledged before the consumer has them.
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda")
    )
    src = ss.Counting(None)
    got = []
    async with AsyncDataLoader(
        src,
        batch_size=4,
        num_workers=1,
        pin_memory=True,
        collate_fn=datasets.pinned_batch_collate,
        device_prefetch=3,
    ) as loader:
        async with asyncio.timeout(30):
            async for batch in loader:
                assert batch.pinned_by == "aioloader-device_0"
                got.append(batch.values)
                for _ in range(100):  # let the device stage run ahead
                    await asyncio.sleep(0)
                assert src.acked == got[:-1]
                if len(got) == 4:
                    break
    assert src.acked == got[:3]


async def test_each_epoch_reads_a_fresh_stream_on_persistent_workers() -> None:
    src = ss.Counting(10)
    async with AsyncDataLoader(
        src, batch_size=4, num_workers=2, persistent_workers=True, transform=ss.with_worker
    ) as loader:
        first = [b["x"].flatten().tolist() for b in await collect(loader)]
        second = [b["x"].flatten().tolist() for b in await collect(loader)]
    assert first == second == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert src.acked == first + second


async def test_batch_seeding_gives_the_same_batches_for_any_num_workers() -> None:
    runs = []
    for workers in (0, 2):
        async with AsyncDataLoader(
            ss.Counting(12),
            batch_size=4,
            num_workers=workers,
            transform=ss.noisy,
            seeding="batch",
            generator=torch.Generator().manual_seed(5),
        ) as loader:
            runs.append(torch.cat(await collect(loader)))  # type: ignore[arg-type]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0].floor(), runs[0])  # the transform did add noise


def test_resume_state_is_refused_for_async_sources() -> None:
    loader = AsyncDataLoader(ss.Counting(3))
    with pytest.raises(ValueError, match="async source"):
        loader.state_dict()
    with pytest.raises(ValueError, match="async source"):
        loader.load_state_dict({})


async def test_a_source_that_swallows_cancellation_still_ends_with_the_epoch() -> None:
    src = ss.SwallowsCancel()
    async with asyncio.timeout(30):
        async with AsyncDataLoader(src, batch_size=4, num_workers=0) as loader:
            async for batch in loader:
                assert batch.flatten().tolist() == [0, 1, 2, 3]
                break
    assert src.closed


def test_the_sync_bridge_reads_an_async_source() -> None:
    src = ss.Counting(10)
    loader = AsyncDataLoader(src, batch_size=4, num_workers=1, max_batch_latency=0.05)
    with loader.sync() as batches:
        got = values(list(batches))
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert src.acked == got
