"""Async datasets reading a real store: the HTTP object store (aioloader.benchmark._store, its
own process) through aiohttp, and moto's S3 server through obstore. The client opens in the
dataset's ``__aenter__`` in each worker (or on the loop) and closes in ``__aexit__``."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import psutil
import pytest
import torch

from aioloader import AsyncDataLoader, FetchPolicy, _remote
from tests.conftest import collect

aiohttp = pytest.importorskip("aiohttp")


class HttpObjects:
    """Object ``i`` of an HTTP store, as a uint8 tensor; one aiohttp session per event loop."""

    def __init__(self, base: str, n: int, size: int, *, offset: int = 0) -> None:
        self.base, self.n, self.size, self.offset = base, n, size, offset
        self.session: Any = None
        self.calls: dict[int, int] = {}  # calls per index, in this process

    def __len__(self) -> int:
        return self.n

    async def __aenter__(self) -> HttpObjects:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.session.close()
        self.session = None

    def url(self, i: int) -> str:
        return f"{self.base}/objects/{i + self.offset:08d}"

    async def __getitem__(self, i: int) -> torch.Tensor:
        self.calls[i] = self.calls.get(i, 0) + 1
        async with self.session.get(self.url(i)) as response:
            response.raise_for_status()
            data = await response.read()
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _first_index(sample: torch.Tensor) -> int:
    return int.from_bytes(bytes(sample[:8].tolist()), "big")


def _connections_to(port: int) -> int:
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    count = 0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            count += sum(1 for c in proc.net_connections("tcp") if c.raddr and c.raddr.port == port)
    return count


@pytest.mark.parametrize(("num_workers", "fetch_in"), [(2, "workers"), (0, "loop")])
async def test_objects_arrive_whole_and_in_order_and_no_client_is_left_open(
    http_store: Any, capfd: pytest.CaptureFixture[str], num_workers: int, fetch_in: Any
) -> None:
    ds = HttpObjects(http_store.url, 96, http_store.config.size)
    async with AsyncDataLoader(
        ds,
        batch_size=8,
        num_workers=num_workers,
        fetch_in=fetch_in,
        persistent_workers=num_workers > 0,
    ) as loader:
        for _ in range(2):
            batches = await collect(loader, 60)
            samples = [s for b in batches for s in b]
            assert [_first_index(s) for s in samples] == list(range(96))
            assert all(bytes(s.tolist()) == http_store.expected(i) for i, s in enumerate(samples))
    # The workers are gone and this process holds no connection to the store.
    assert _connections_to(http_store.port) == 0
    err = capfd.readouterr().err
    assert "Unclosed" not in err, err


async def test_a_missing_key_is_an_error_at_its_batch_naming_the_url(http_store: Any) -> None:
    ds = HttpObjects(http_store.url, 16, 10_000, offset=250)  # 256..265 do not exist
    async with AsyncDataLoader(
        ds, batch_size=4, num_workers=2, fetch_policy=FetchPolicy(backoff=0.001)
    ) as loader:
        it = aiter(loader)
        async with asyncio.timeout(60):
            first = await anext(it)
            assert [_first_index(s) for s in first] == [250, 251, 252, 253]
            with pytest.raises(RuntimeError, match="ClientResponseError") as caught:
                await anext(it)
    text = str(caught.value)
    assert "404" in text and "/objects/00000256" in text
    assert "fetching index 6 failed (not transient: not retried)" in text


async def test_a_throttling_store_is_retried_and_every_object_arrives_once(
    make_http_store: Any,
) -> None:
    store = make_http_store(size=2_000, count=64, fail_first=2, errors=(503,))
    ds = HttpObjects(store.url, 64, 2_000)
    async with AsyncDataLoader(
        ds, batch_size=8, num_workers=2, fetch_policy=FetchPolicy(retries=3, backoff=0.001)
    ) as loader:
        samples = [s for b in await collect(loader, 60) for s in b]
    assert [_first_index(s) for s in samples] == list(range(64))
    stats = store.stats()
    assert stats["by_status"]["503"] == 2 * 64
    assert stats["by_status"]["200"] == 64


async def test_a_store_that_goes_away_ends_the_batch_with_an_error_and_the_loader_cleanly(
    make_http_store: Any,
) -> None:
    store = make_http_store(size=2_000, count=64)
    ds = HttpObjects(store.url, 64, 2_000)
    policy = FetchPolicy(retries=2, backoff=0.01)
    async with AsyncDataLoader(ds, batch_size=8, num_workers=2, fetch_policy=policy) as loader:
        it = aiter(loader)
        async with asyncio.timeout(60):
            assert len(await anext(it)) == 8
            store.kill()
            with pytest.raises((RuntimeError, OSError)) as caught:
                while True:
                    await anext(it)
    text = str(caught.value)
    assert "failed after 3 attempts" in text
    assert str(store.port) in text  # the URL it could not reach


async def test_hedging_sends_a_second_request_for_the_slow_tail(make_http_store: Any) -> None:
    store = make_http_store(size=2_000, count=600, latency_ms=5, slow_fraction=0.02, slow_factor=40)
    ds = HttpObjects(store.url, 600, 2_000)
    policy = FetchPolicy(hedge=0.95, hedge_min_calls=30)
    async with AsyncDataLoader(
        ds, batch_size=20, num_workers=0, fetch_policy=policy, source_concurrency=20
    ) as loader:
        samples = [s for b in await collect(loader, 120) for s in b]
    assert [_first_index(s) for s in samples] == list(range(600))
    # Some samples were asked for again (the store never counts the loser it was cancelled
    # for): twice, or three times when the hedge met the tail too; each was delivered once.
    assert 2 <= max(ds.calls.values()) <= 1 + _remote._HEDGES
    assert sum(ds.calls.values()) > 600


class S3Objects:
    """Object ``i`` of an S3 bucket through obstore (its own retry and timeout settings)."""

    def __init__(self, endpoint: str, bucket: str, n: int) -> None:
        self.endpoint, self.bucket, self.n = endpoint, bucket, n
        self.store: Any = None

    def __len__(self) -> int:
        return self.n

    async def __aenter__(self) -> S3Objects:
        from obstore.store import S3Store

        self.store = S3Store(
            self.bucket,
            endpoint=self.endpoint,
            region="us-east-1",
            access_key_id="testing",
            secret_access_key="testing",
            client_options={"allow_http": True},
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.store = None

    async def __getitem__(self, i: int) -> torch.Tensor:
        import obstore

        result = await obstore.get_async(self.store, f"{i:08d}")
        data = await result.bytes_async()
        return torch.frombuffer(bytearray(bytes(data)), dtype=torch.uint8)


async def test_s3_objects_through_obstore_in_the_workers(s3_store: Any) -> None:
    pytest.importorskip("obstore")
    ds = S3Objects(s3_store.endpoint, s3_store.bucket, s3_store.count)
    # obstore's Rust runtime is already running in this process (the fixture started it), and
    # its threads do not survive a fork: workers are spawned.
    async with AsyncDataLoader(
        ds, batch_size=8, num_workers=2, multiprocessing_context="spawn"
    ) as loader:
        samples = [s for b in await collect(loader, 90) for s in b]
    assert [bytes(s.tolist()) for s in samples] == [s3_store.expected(i) for i in range(64)]
