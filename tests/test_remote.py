"""Async map-style datasets fetched in the workers (``fetch_in="workers"``) or on the loop:
order, concurrency across batches, errors naming the index, retries, timeouts, hedging, the
dataset's client lifetime, crash recovery and resume."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate

from aioloader import AsyncDataLoader, FetchPolicy, _remote, is_transient
from tests import remote_data as rd
from tests.conftest import collect, torch_batches
from tests.stream_sources import SyncRange


def _fast(**kw: Any) -> FetchPolicy:
    return FetchPolicy(backoff=0.001, max_backoff=0.005, **kw)


async def test_workers_deliver_torch_order_and_overlap_requests_across_batches() -> None:
    ds = rd.Latent(96, delay=0.02)
    kwargs: dict[str, Any] = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    async with AsyncDataLoader(
        ds, generator=torch.Generator().manual_seed(5), source_concurrency=6, **kwargs
    ) as loader:
        assert loader.fetch_in == "workers"
        got = await collect(loader)
    want = torch_batches(SyncRange(96), generator=torch.Generator().manual_seed(5), **kwargs)
    assert rd.values(got) == [int(v) for b in want for v in b.flatten()]
    in_flight = [int(v) for b in got for v in b["in_flight"]]
    # More than one batch of 4 in flight in one worker: its next batches started while it
    # waited for one; never more than source_concurrency.
    assert max(in_flight) > 4
    assert max(in_flight) <= 6
    assert {int(w) for b in got for w in b["worker"]} == {0, 1}
    # Batch k is loaded by worker k % 2, as torch assigns it.
    assert [int(b["worker"][0]) for b in got] == [k % 2 for k in range(len(got))]
    assert all(name == "aioloader-io" for b in got for name in b["io_thread"])
    assert ds.calls == {}  # this process's copy was never called


@pytest.mark.parametrize("collate", ["_collate_tensors", "_stack_unshared"])
def test_collating_a_small_batch_leaves_get_worker_info_to_the_other_threads(
    collate: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker collates a small batch without shared memory, and its io thread may be asking
    get_worker_info() at that moment (to shard): the answer must stay this worker's."""
    from torch.utils.data._utils import worker as torch_worker

    from aioloader import _worker

    info = object()
    seen: list[object] = []
    stack = torch.stack

    def watching_stack(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(torch_worker._worker_info)  # what another thread would read now
        return stack(*args, **kwargs)

    monkeypatch.setattr(torch_worker, "_worker_info", info)
    monkeypatch.setattr(torch, "stack", watching_stack)
    out = getattr(_worker, collate)([torch.tensor([1]), torch.tensor([2])])
    assert out.tolist() == [[1], [2]]
    assert seen == [info]
    with pytest.raises(RuntimeError, match="nested tensors"):  # torch's own error, as before
        nested = torch.nested.nested_tensor([torch.zeros(2)], layout=torch.jagged)
        getattr(_worker, collate)([nested])


async def test_thread_executor_fetches_on_one_io_loop() -> None:
    ds = rd.Latent(40, delay=0.005)
    async with AsyncDataLoader(
        ds, batch_size=8, num_workers=2, executor="thread", fetch_in="workers"
    ) as loader:
        got = await collect(loader)
    assert rd.values(got) == list(range(40))
    assert {name for b in got for name in b["io_thread"]} == {"aioloader-io"}


async def test_an_error_is_raised_at_its_batch_naming_the_index_and_the_epoch_goes_on() -> None:
    ds = rd.Flaky(16, bad={9}, failures=99, error=KeyError("objects/9.jpg"))
    async with AsyncDataLoader(ds, batch_size=4, num_workers=2) as loader:
        it = aiter(loader)
        async with asyncio.timeout(60):
            assert rd.values([await anext(it), await anext(it)]) == list(range(8))
            with pytest.raises(KeyError, match=r"objects/9\.jpg") as caught:
                await anext(it)
            assert rd.values([await anext(it)]) == [12, 13, 14, 15]
            with pytest.raises(StopAsyncIteration):
                await anext(it)
    text = str(caught.value) + "".join(getattr(caught.value, "__notes__", []))
    assert "fetching index 9 failed" in text
    assert "worker process" in text  # the worker's traceback came along


@pytest.mark.parametrize("fetch_in", ["workers", "loop"])
@pytest.mark.parametrize(
    "error",
    [
        ConnectionResetError(errno.ECONNRESET, "reset by peer"),
        rd.Status(503, "http://store/objects/3"),
        rd.Status(429, "http://store/objects/3"),
        TimeoutError("read timed out"),
    ],
    ids=["reset", "503", "429", "timeout"],
)
async def test_transient_failures_are_retried_and_each_sample_arrives_once(
    fetch_in: str, error: BaseException
) -> None:
    ds = rd.Flaky(24, bad={3, 10, 17}, failures=2, error=error)
    async with AsyncDataLoader(
        ds,
        batch_size=4,
        num_workers=2 if fetch_in == "workers" else 0,
        fetch_in=fetch_in,  # type: ignore[arg-type]
        fetch_policy=_fast(retries=2),
    ) as loader:
        got = await collect(loader)
    assert rd.values(got) == list(range(24))
    attempts = {int(x): int(a) for b in got for x, a in zip(b["x"], b["attempt"], strict=True)}
    assert {i for i, a in attempts.items() if a > 1} == {3, 10, 17}
    assert all(attempts[i] == 3 for i in (3, 10, 17))


@pytest.mark.parametrize(
    "error",
    [
        rd.Status(404, "http://store/objects/5"),
        rd.Status(403, "http://store/objects/5"),
        FileNotFoundError(errno.ENOENT, "objects/5"),
        ValueError("corrupt JPEG"),
    ],
    ids=["404", "403", "missing-file", "user-error"],
)
async def test_errors_that_are_not_transient_are_not_retried(error: BaseException) -> None:
    ds = rd.Flaky(8, bad={5}, failures=99, error=error)
    async with AsyncDataLoader(
        ds, batch_size=4, num_workers=0, fetch_policy=_fast(retries=3)
    ) as loader:
        it = aiter(loader)
        async with asyncio.timeout(30):
            assert rd.values([await anext(it)]) == [0, 1, 2, 3]
            with pytest.raises(type(error)) as caught:
                await anext(it)
    assert ds.calls[5] == 1
    notes = "".join(getattr(caught.value, "__notes__", []))
    assert "fetching index 5 failed" in notes and "not retried" in notes


async def test_retries_run_out_with_an_error_naming_the_attempts() -> None:
    ds = rd.Flaky(8, bad={6}, failures=99, error=rd.Status(503, "http://store/objects/6"))
    async with AsyncDataLoader(
        ds, batch_size=4, num_workers=2, fetch_policy=_fast(retries=2)
    ) as loader:
        it = aiter(loader)
        async with asyncio.timeout(60):
            assert rd.values([await anext(it)]) == [0, 1, 2, 3]
            # Status takes two arguments: rebuilt from its message it cannot be, so torch's
            # rule gives a RuntimeError carrying the worker's whole report (aiohttp's
            # ClientResponseError is such an exception too).
            with pytest.raises(RuntimeError, match="Caught Status in DataLoader worker") as caught:
                await anext(it)
    text = str(caught.value)
    assert "503 for http://store/objects/6" in text
    assert "fetching index 6 failed after 3 attempts" in text


async def test_a_call_over_the_timeout_is_cancelled_and_reported() -> None:
    ds = rd.Hangs(8, at=2)
    async with AsyncDataLoader(
        ds, batch_size=4, num_workers=2, fetch_policy=_fast(timeout=0.2, retries=1)
    ) as loader:
        it = aiter(loader)
        async with asyncio.timeout(60):
            with pytest.raises(TimeoutError) as caught:
                await anext(it)
            assert rd.values([await anext(it)]) == [4, 5, 6, 7]
    text = str(caught.value)  # the worker's report: its traceback and the notes
    assert "FetchPolicy.timeout=0.2" in text and "index 2 failed after 2 attempts" in text


async def test_the_loaders_timeout_still_ends_a_worker_stuck_in_a_request() -> None:
    from aioloader import LoaderTimeoutError

    async with AsyncDataLoader(rd.Hangs(8, at=1), batch_size=4, num_workers=1, timeout=1) as ld:
        with pytest.raises(LoaderTimeoutError):
            await collect(ld, 60)


async def test_hedging_answers_a_straggler_with_a_second_call_and_cancels_the_first() -> None:
    slow = {60, 61, 70, 75}
    ds = rd.SlowFirstCall(80, slow=slow, slow_s=30.0)
    policy = FetchPolicy(hedge=0.9, hedge_min_calls=20)
    async with AsyncDataLoader(
        ds, batch_size=10, num_workers=0, fetch_policy=policy, source_concurrency=10
    ) as loader:
        got = await collect(loader, 25)  # without hedging one batch alone takes 30 s
        await asyncio.sleep(0.05)  # the losers' cancellations settle
    assert rd.values(got) == list(range(80))
    attempts = {int(x): int(a) for b in got for x, a in zip(b["x"], b["attempt"], strict=True)}
    # Every slow sample was answered by a later call (on a busy machine a fast sample may be
    # hedged too: its first call can outlast the quantile).
    assert all(attempts[i] >= 2 for i in slow)
    assert sorted(ds.cancelled) == sorted(slow)


async def test_a_hedge_that_is_slow_too_gets_one_more_and_no_further() -> None:
    # Two slow calls in a row (a 1 % tail meets its hedge 1 % of the time): a third call answers.
    # (source_concurrency=20: 4 slots for hedged calls, two for each slow sample.)
    slow = {60, 75}
    ds = rd.SlowFirstCall(80, slow=slow, slow_s=30.0, slow_calls=2)
    policy = FetchPolicy(hedge=0.9, hedge_min_calls=20)
    async with AsyncDataLoader(
        ds, batch_size=10, num_workers=0, fetch_policy=policy, source_concurrency=20
    ) as loader:
        got = await collect(loader, 25)  # with one hedge only, a batch takes 30 s
        await asyncio.sleep(0.05)  # the losers' cancellations settle
    assert rd.values(got) == list(range(80))
    attempts = {int(x): int(a) for b in got for x, a in zip(b["x"], b["attempt"], strict=True)}
    assert all(attempts[i] == 3 for i in slow)
    assert sorted(ds.cancelled) == sorted(2 * list(slow))
    # Three slow calls: the sample waits for the first of them; no fourth call is made.
    ds = rd.SlowFirstCall(80, slow={70}, slow_s=0.5, slow_calls=3)
    async with AsyncDataLoader(
        ds, batch_size=10, num_workers=0, fetch_policy=policy, source_concurrency=20
    ) as loader:
        got = await collect(loader, 25)
    assert rd.values(got) == list(range(80))
    assert ds.calls[70] == 3


async def test_hedging_is_off_by_default() -> None:
    ds = rd.SlowFirstCall(30, slow={25}, slow_s=0.3)
    async with AsyncDataLoader(ds, batch_size=10, num_workers=0) as loader:
        got = await collect(loader)
    assert all(int(a) == 1 for b in got for a in b["attempt"])


@pytest.mark.parametrize("persistent", [False, True])
async def test_the_client_opens_once_per_worker_and_closes_when_the_worker_ends(
    tmp_path: Path, persistent: bool
) -> None:
    log = str(tmp_path / "client.log")
    ds = rd.WithClient(24, log)
    async with AsyncDataLoader(
        ds, batch_size=4, num_workers=2, persistent_workers=persistent
    ) as loader:
        for _ in range(2):
            assert rd.values(await collect(loader)) == list(range(24))
    lines = rd.log_lines(log)
    opens = [line for line in lines if line[0] == "open"]
    closes = [line for line in lines if line[0] == "close"]
    # Each worker process: one client, opened and closed on its own event loop thread.
    assert len(opens) == (2 if persistent else 4)
    assert sorted(o[1] for o in opens) == sorted(c[1] for c in closes)
    assert all(line[3] == "aioloader-io" for line in lines)
    assert {o[2] for o in opens} == {"0", "1"}
    assert ds.client is None  # this process's copy was never entered


async def test_on_the_loop_the_client_lives_for_the_epoch(tmp_path: Path) -> None:
    log = str(tmp_path / "client.log")
    ds = rd.WithClient(12, log)
    async with AsyncDataLoader(ds, batch_size=4, num_workers=0) as loader:
        assert rd.values(await collect(loader)) == list(range(12))
        assert [line[0] for line in rd.log_lines(log)] == ["open", "close"]
        async for _ in loader:  # break: the client closes all the same
            break
        await asyncio.sleep(0)
    assert [line[0] for line in rd.log_lines(log)] == ["open", "close", "open", "close"]
    assert ds.client is None


class _HoldsASession(rd.Latent):
    def __init__(self) -> None:
        super().__init__(4)
        self.session = asyncio.Event()  # stands for a client made in __init__ (asyncio's)


def test_a_client_made_in_init_is_refused_at_construction_saying_what_to_do() -> None:
    with pytest.raises(TypeError, match=r"_HoldsASession\.session is a asyncio") as caught:
        AsyncDataLoader(_HoldsASession(), batch_size=2, num_workers=2)
    assert "async def __aenter__" in str(caught.value)
    AsyncDataLoader(_HoldsASession(), batch_size=2, num_workers=2, fetch_in="loop")  # stays here


async def test_an_aiohttp_session_made_in_init_is_refused_naming_it() -> None:
    aiohttp = pytest.importorskip("aiohttp")

    class Eager(rd.Latent):
        def __init__(self) -> None:
            super().__init__(4)
            self.http = aiohttp.ClientSession()

    ds = Eager()
    try:
        with pytest.raises(TypeError, match=r"Eager\.http is a aiohttp\.client\.ClientSession"):
            AsyncDataLoader(ds, batch_size=2, num_workers=2)
    finally:
        await ds.http.close()


@pytest.mark.parametrize(
    ("dataset", "kwargs", "match"),
    [
        (rd.Latent(4), {"num_workers": 0, "fetch_in": "workers"}, "needs num_workers > 0"),
        (rd.Latent(4), {"num_workers": 2, "fetch_in": "process"}, "fetch_in should be"),
        (SyncRange(4), {"num_workers": 2, "fetch_in": "workers"}, "async map-style"),
        (SyncRange(4), {"fetch_policy": FetchPolicy()}, "async map-style"),
        (rd.Latent(4), {"fetch_policy": FetchPolicy(retries=-1)}, "retries"),
        (rd.Latent(4), {"fetch_policy": FetchPolicy(timeout=0)}, "timeout"),
        (rd.Latent(4), {"fetch_policy": FetchPolicy(hedge=1.0)}, "quantile"),
    ],
)
def test_bad_arguments_are_refused_naming_what_to_change(
    dataset: Any, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        AsyncDataLoader(dataset, **kwargs)


async def test_setting_num_workers_to_zero_later_is_refused_at_the_next_epoch() -> None:
    loader = AsyncDataLoader(rd.Latent(4), batch_size=2, num_workers=2)
    loader.num_workers = 0
    loader.prefetch_factor = None  # else torch's own check of prefetch_factor comes first
    with pytest.raises(ValueError, match="num_workers is now 0"):
        await collect(loader)
    await loader.aclose()


async def test_a_worker_killed_mid_request_is_replaced_and_nothing_is_lost(tmp_path: Path) -> None:
    ds = rd.KillsOnce(64, at=37, marker=str(tmp_path / "killed"))
    async with AsyncDataLoader(ds, batch_size=4, num_workers=2, source_concurrency=8) as loader:
        with pytest.warns(RuntimeWarning, match="killed by signal"):
            got = await collect(loader, 90)
        assert loader.stats().worker_restarts == 1
    assert rd.values(got) == list(range(64))


async def test_resume_mid_epoch_delivers_exactly_the_rest() -> None:
    def make() -> AsyncDataLoader[Any]:
        return AsyncDataLoader(
            rd.Latent(40),
            batch_size=4,
            shuffle=True,
            num_workers=2,
            generator=torch.Generator().manual_seed(11),
        )

    async with make() as loader:
        full = rd.values(await collect(loader))
    async with make() as loader:
        it = aiter(loader)
        async with asyncio.timeout(60):
            head = rd.values([await anext(it) for _ in range(3)])
        state = loader.state_dict()
        await it.aclose()  # type: ignore[attr-defined]
    async with make() as loader:
        loader.load_state_dict(state)
        rest = rd.values(await collect(loader))
    assert head + rest == full


def test_is_transient_reads_statuses_codes_and_connection_errors() -> None:
    class ClientError(Exception):  # botocore's shape
        def __init__(self, code: str, status: int) -> None:
            self.response = {
                "Error": {"Code": code},
                "ResponseMetadata": {"HTTPStatusCode": status},
            }

    class ServerDisconnectedError(ConnectionError):
        pass

    assert is_transient(ClientError("SlowDown", 503))
    assert is_transient(ClientError("InternalError", 500))
    assert not is_transient(ClientError("NoSuchKey", 404))
    assert not is_transient(ClientError("AccessDenied", 403))
    assert is_transient(ServerDisconnectedError())
    assert is_transient(OSError(errno.ECONNREFUSED, "refused"))
    assert not is_transient(OSError(errno.ENOENT, "missing"))
    assert not is_transient(KeyError("x"))
    assert not is_transient(SystemExit(1))


async def test_an_async_iterable_dataset_is_iterated_in_each_worker_as_torch_shards_it() -> None:
    ds = rd.Shards(shards=6, per_shard=5)
    async with AsyncDataLoader(ds, batch_size=4, num_workers=2) as loader:
        assert loader.fetch_in == "workers"
        got = await collect(loader)
    # As torch round-robins an IterableDataset's workers: worker 0's batch, then worker 1's.
    w0 = [i for s in (0, 2, 4) for i in range(s * 5, s * 5 + 5)]
    w1 = [i for s in (1, 3, 5) for i in range(s * 5, s * 5 + 5)]
    want = []
    for k in range(4):
        want += w0[4 * k : 4 * k + 4] + w1[4 * k : 4 * k + 4]
    assert rd.values(got) == want
    assert {int(w) for b in got for w in b["worker"]} == {0, 1}
    assert all(name == "aioloader-io" for b in got for name in b["io"])


def test_an_async_iterable_dataset_read_as_a_stream_when_asked_or_timed() -> None:
    assert AsyncDataLoader(rd.Shards(2, 2), num_workers=2, fetch_in="loop").fetch_in == "loop"
    timed = AsyncDataLoader(rd.Shards(2, 2), num_workers=2, max_batch_latency=0.1)
    assert timed.fetch_in == "loop"
    with pytest.raises(ValueError, match="max_batch_latency"):
        AsyncDataLoader(rd.Shards(2, 2), num_workers=2, max_batch_latency=0.1, fetch_in="workers")
    with pytest.raises(ValueError, match="executor='thread'"):
        AsyncDataLoader(rd.Shards(2, 2), num_workers=2, executor="thread")


async def test_the_thread_executor_ends_at_once_with_a_request_that_never_answers() -> None:
    loader = AsyncDataLoader(
        rd.Hangs(64, at=9), batch_size=4, num_workers=2, executor="thread", fetch_in="workers"
    )
    async with asyncio.timeout(30):
        async for _ in loader:
            break  # index 9's batch is in flight and never answers
        await loader.aclose()


class _HangsWithClient(rd.WithClient):
    """Index 1 never answers; every call needs the open client."""

    async def answer(self, i: int) -> dict[str, Any]:
        await super().answer(i)
        if i == 1:
            await asyncio.Event().wait()
        return {}


@pytest.mark.parametrize("timeout", [0.0, 5.0])
def test_a_closed_fetcher_leaves_no_request_pending_and_closes_the_client(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    timeout: float,
) -> None:
    # close(timeout=0) is the thread executor's kill: it waits for nothing, yet the fetcher's
    # own thread must still cancel the request that never answers and close the client; a
    # task left pending in a closed loop is destroyed later, outside any loop.
    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    log = str(tmp_path / "client.log")
    ds = _HangsWithClient(4, log)
    spec = _remote.InWorkers(ds, FetchPolicy(), 4, None)
    fetcher = _remote.WorkerFetcher(spec, True, default_collate)
    fetcher.start(0, [0, 1])
    deadline = time.monotonic() + 10
    while ds.running == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ds.running == 1  # index 1 waits; index 0 answered
    fetcher.close(timeout)
    fetcher._thread.join(10)
    assert not fetcher._thread.is_alive()
    gc.collect()
    assert unraisable == []
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]
    assert [line[0] for line in rd.log_lines(log)] == ["open", "close"]
    assert ds.running == 0


@pytest.mark.parametrize("timeout", [0.0, 5.0])
def test_a_request_settled_by_close_before_it_started_is_not_an_error(
    caplog: pytest.LogCaptureFixture, timeout: float
) -> None:
    ds = rd.Latent(8)
    fetcher = _remote.WorkerFetcher(
        _remote.InWorkers(ds, FetchPolicy(), 4, None), True, default_collate
    )
    fetcher._loop.call_soon_threadsafe(time.sleep, 0.2)  # the io loop is busy for a moment
    fetcher.start(0, [0, 1])  # its request is queued behind that
    fetcher.close(timeout)  # and settled before it starts
    fetcher._thread.join(10)
    assert not fetcher._thread.is_alive()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert ds.calls == {}


@pytest.mark.parametrize("executor", ["process", "thread"])
async def test_sys_exit_in_an_async_getitem_is_an_error_at_its_batch(executor: str) -> None:
    async with AsyncDataLoader(
        rd.Exits(16, at=5), batch_size=4, num_workers=1, executor=executor, fetch_in="workers"
    ) as loader:
        it = aiter(loader)
        async with asyncio.timeout(60):
            assert rd.values([await anext(it)]) == [0, 1, 2, 3]
            with pytest.raises(BaseException, match=r"SystemExit|3") as caught:
                await anext(it)
            assert rd.values([await anext(it)]) == [8, 9, 10, 11]
    assert not isinstance(caught.value, (asyncio.CancelledError, TimeoutError))


async def test_a_worker_keeps_requests_of_all_its_prefetched_batches_in_flight() -> None:
    ds = rd.Latent(64, delay=0.05)
    async with AsyncDataLoader(
        ds, batch_size=2, num_workers=1, prefetch_factor=8, source_concurrency=16
    ) as loader:
        got = await collect(loader)
    assert max(int(v) for b in got for v in b["in_flight"]) > 4  # more than 2 batches of 2


@pytest.mark.parametrize("num_workers", [0, 1])
async def test_on_the_loop_source_concurrency_requests_are_in_flight(num_workers: int) -> None:
    ds = rd.Latent(64, delay=0.05)
    async with AsyncDataLoader(
        ds, batch_size=4, num_workers=num_workers, fetch_in="loop", source_concurrency=16
    ) as loader:
        got = await collect(loader)
    assert max(int(v) for b in got for v in b["in_flight"]) > 8


async def test_a_batch_sampler_of_unknown_size_keeps_the_look_ahead_bounded() -> None:
    ds = rd.Latent(200, delay=0.0)
    batches = [list(range(k, k + 8)) for k in range(0, 200, 8)]
    async with AsyncDataLoader(ds, batch_sampler=batches, num_workers=0) as loader:
        it = aiter(loader)
        async with asyncio.timeout(30):
            await anext(it)
            await asyncio.sleep(0.2)
            # source_concurrency=16 needs 3 batches of 8 in flight: not the whole epoch.
            assert len(loader.dataset.calls) <= 5 * 8  # type: ignore[attr-defined]
            await it.aclose()  # type: ignore[attr-defined]


@pytest.mark.parametrize("fetch_in", ["workers", "loop"])
async def test_a_retry_does_not_shift_the_workers_random_draws(fetch_in: str) -> None:
    async def draws(failures: int) -> list[float]:
        ds = rd.Flaky(12, bad={1}, failures=failures, error=ConnectionResetError())
        async with AsyncDataLoader(
            ds,
            batch_size=4,
            num_workers=1,
            fetch_in=fetch_in,  # type: ignore[arg-type]
            transform=rd.draw,
            fetch_policy=_fast(retries=2),
            generator=torch.Generator().manual_seed(0),
        ) as loader:
            return [float(v) for b in await collect(loader) for v in b["draw"]]

    assert await draws(0) == await draws(1)


@pytest.mark.parametrize("fetch_in", ["workers", "loop"])
async def test_hedged_calls_stay_within_their_bound(fetch_in: str) -> None:
    ds = rd.SlowFirstCall(120, slow=set(range(40, 120, 3)), slow_s=0.3, delay=0.01)
    async with AsyncDataLoader(
        ds,
        batch_size=8,
        num_workers=1 if fetch_in == "workers" else 0,
        fetch_in=fetch_in,  # type: ignore[arg-type]
        source_concurrency=4,
        fetch_policy=FetchPolicy(hedge=0.5, hedge_min_calls=10),
    ) as loader:
        got = await collect(loader)
    assert rd.values(got) == list(range(120))
    # source_concurrency=4, and at most 2 * (1 - 0.5) * 4 = 4 hedged calls beside them.
    assert max(int(v) for b in got for v in b["in_flight"]) <= 8


async def test_an_async_iterable_read_on_the_loop_opens_its_client() -> None:
    ds = rd.Shards(shards=3, per_shard=4)
    async with AsyncDataLoader(ds, batch_size=4, num_workers=0) as loader:
        assert loader.fetch_in == "loop"
        got = await collect(loader)
    assert sorted(rd.values(got)) == list(range(12))
    assert ds.client is None  # entered for the epoch and closed after


async def test_an_abandoned_async_generator_is_closed_in_its_worker(tmp_path: Path) -> None:
    log = tmp_path / "log"
    ds = rd.Generations(100, str(log))
    async with AsyncDataLoader(ds, batch_size=4, num_workers=1, persistent_workers=True) as ld:
        async for _ in ld:
            break
        assert len(rd.values(await collect(ld))) == 100
    # The first epoch's iterator, left after one batch, and the second's, run to its end.
    assert log.read_text().splitlines() == ["closed", "closed"]


async def test_overlapping_epochs_on_the_loop_share_one_client(tmp_path: Path) -> None:
    log = str(tmp_path / "client.log")
    ds = rd.WithClient(400, log)
    ds.delay = 0.002
    outer = AsyncDataLoader(ds, batch_size=4)
    inner = AsyncDataLoader(ds, batch_size=4)
    seen: list[int] = []
    async with outer, inner, asyncio.timeout(60):
        async for batch in outer:
            seen += rd.values([batch])
            if len(seen) == 8:  # a validation pass while the outer epoch still reads
                assert rd.values(await collect(inner)) == list(range(400))
    assert seen == list(range(400))
    # Each epoch's reads used an open client; it was never closed under the other's feet
    # (every call checks), and it was opened and closed alternately, never twice at once.
    events = [line[0] for line in rd.log_lines(log)]
    assert events[: events.index("close")] == ["open"]
    assert events == ["open", "close"] * (len(events) // 2)


def test_is_transient_reads_errno_before_the_class() -> None:
    assert is_transient(asyncio.IncompleteReadError(b"", 10))
    assert not is_transient(ConnectionError(errno.EPERM, "not permitted"))

    class AppError(ValueError):
        code = 500  # an application's own number, not an HTTP status

    assert not is_transient(AppError())
