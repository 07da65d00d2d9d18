"""The servers the remote-data tests and the ``remote`` benchmark read from: the HTTP object
store (aioloader.benchmark._store) and moto's S3 server, read by the clients users will use."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest

from aioloader.benchmark._store import JPEG_CLASSES, expected_bytes, jpeg_label, object_key
from tests.remote_servers import assert_gone

aiohttp = pytest.importorskip("aiohttp")

#: Every await of these tests is bounded by this many seconds.
LIMIT = 30


async def fetch(url: str, *, session: Any = None) -> tuple[int, bytes]:
    async with asyncio.timeout(LIMIT):
        if session is None:
            async with aiohttp.ClientSession() as own:
                return await fetch(url, session=own)
        async with session.get(url) as resp:
            return resp.status, await resp.read()


async def test_store_serves_each_keys_bytes_and_404_for_others(http_store: Any) -> None:
    async with aiohttp.ClientSession() as session:
        for i in (0, 7, 255):
            status, body = await fetch(http_store.object_url(i), session=session)
            assert status == 200
            assert body == expected_bytes(i, 10_000) == http_store.expected(i)
        for key in ("nope", object_key(256), "0000000x"):
            status, body = await fetch(http_store.object_url(key), session=session)
            assert status == 404
            assert b"<Code>NoSuchKey</Code>" in body
    assert http_store.info()["count"] == 256
    from aioloader.benchmark.remote import object_url

    assert object_url(http_store.url, 256 + 7, 256) == http_store.object_url(7)


async def test_first_byte_latency_and_a_slow_tail(make_http_store: Callable[..., Any]) -> None:
    store = make_http_store(latency_ms=100, size=1000, count=4)
    async with aiohttp.ClientSession() as session:
        await fetch(store.object_url(0), session=session)  # connection up
        t0 = time.perf_counter()
        await fetch(store.object_url(1), session=session)
        took = time.perf_counter() - t0
        assert 0.1 <= took < 5
        store.configure(latency_ms=20, slow_fraction=1.0, slow_factor=10)
        t0 = time.perf_counter()
        await fetch(store.object_url(2), session=session)
        assert time.perf_counter() - t0 >= 0.2


async def test_many_requests_at_once_are_served_concurrently(
    make_http_store: Callable[..., Any],
) -> None:
    store = make_http_store(latency_ms=200, size=100_000, count=64)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(fetch(store.object_url(i), session=session)
                                     for i in range(64)))  # fmt: skip
        took = time.perf_counter() - t0
    assert [s for s, _ in got] == [200] * 64
    assert took < 3, f"64 requests of 200 ms took {took:.2f} s: served one by one?"
    assert store.stats()["max_in_flight"] >= 32


async def test_errors_at_the_set_rate_as_s3_answers_them(
    make_http_store: Callable[..., Any],
) -> None:
    store = make_http_store(size=100, count=400, error_rate=0.5)
    async with aiohttp.ClientSession() as session:
        got = await asyncio.gather(*(fetch(store.object_url(i), session=session)
                                     for i in range(400)))  # fmt: skip
    statuses = [s for s, _ in got]
    assert 100 <= sum(s != 200 for s in statuses) <= 300
    assert {503, 429, 500} <= set(statuses)
    slow = next(body for s, body in got if s == 503)
    assert b"<Code>SlowDown</Code>" in slow
    counts = store.stats()["by_status"]
    assert sum(counts.values()) == 400


async def test_fail_first_fails_each_key_once_then_serves_it(
    make_http_store: Callable[..., Any],
) -> None:
    store = make_http_store(size=100, count=4, fail_first=1, errors=(503,))
    async with aiohttp.ClientSession() as session:
        assert (await fetch(store.object_url(1), session=session))[0] == 503
        status, body = await fetch(store.object_url(1), session=session)
        assert (status, body) == (200, expected_bytes(1, 100))
        assert (await fetch(store.object_url(2), session=session))[0] == 503


async def test_per_connection_bandwidth(make_http_store: Callable[..., Any]) -> None:
    store = make_http_store(size=100_000, count=2, bandwidth=250_000)
    t0 = time.perf_counter()
    status, body = await fetch(store.object_url(0))
    took = time.perf_counter() - t0
    assert status == 200 and body == expected_bytes(0, 100_000)
    assert 0.35 <= took < 5


async def test_jpeg_objects_decode_to_images_of_their_class(
    make_http_store: Callable[..., Any],
) -> None:
    from PIL import Image, ImageStat

    store = make_http_store(size=20_000, count=8, jpeg=True, jpeg_pool=4)
    assert abs(store.info()["mean_object_bytes"] - 20_000) < 2_000
    async with aiohttp.ClientSession() as session:
        for i in range(8):
            status, body = await fetch(store.object_url(i), session=session)
            assert status == 200
            with Image.open(io.BytesIO(body)) as im:
                assert im.format == "JPEG"
                rgb = im.convert("RGB")
                means = ImageStat.Stat(rgb).mean
            # the class's colour: the brightest channel(s) of its palette entry
            dominant = max(range(3), key=lambda c: means[c])
            assert dominant == [0, 1, 2, 0][jpeg_label(i)], (i, means)
    assert JPEG_CLASSES == 4


async def test_a_store_that_goes_away_and_comes_back(make_http_store: Callable[..., Any]) -> None:
    store = make_http_store(size=100, count=2)
    port = store.port
    assert (await fetch(store.object_url(0)))[0] == 200
    store.kill()
    with pytest.raises(aiohttp.ClientConnectionError):
        await fetch(store.object_url(0))
    store.restart()
    assert store.port == port
    assert (await fetch(store.object_url(0)))[0] == 200


async def test_reset_connections(make_http_store: Callable[..., Any]) -> None:
    store = make_http_store(size=100, count=2, reset_rate=1.0)
    with pytest.raises(aiohttp.ClientConnectionError):
        await fetch(store.object_url(0))
    store.configure(reset_rate=0.0)
    assert (await fetch(store.object_url(0)))[0] == 200


def test_command_line_prints_its_port_and_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "aioloader.benchmark._store", "--port", "0", "--size", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/objects/00000003", timeout=10) as r:
            assert r.read() == expected_bytes(3, 10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert proc.stderr is not None
        assert proc.stderr.read() == b""  # no warning, no traceback
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(20)
        for pipe in (proc.stdout, proc.stderr):
            assert pipe is not None
            pipe.close()
    assert_gone(proc.pid, port)


# --------------------------------------------------------------------------------------------
# The S3 server, read by the async clients the docs recommend
# --------------------------------------------------------------------------------------------


async def test_obstore_reads_the_bucket(s3_store: Any) -> None:
    obstore = pytest.importorskip("obstore")
    store = s3_store.obstore()
    async with asyncio.timeout(LIMIT):
        got = await asyncio.gather(*(obstore.get_async(store, object_key(i)) for i in range(8)))
        bodies = [bytes(await r.bytes_async()) for r in got]
        assert bodies == [s3_store.expected(i) for i in range(8)]
        with pytest.raises(FileNotFoundError):
            await obstore.get_async(store, "missing")


async def test_aiobotocore_reads_the_bucket(s3_store: Any) -> None:
    pytest.importorskip("aiobotocore")
    from aiobotocore.session import get_session

    from tests.remote_servers import S3_CREDENTIALS

    async with asyncio.timeout(LIMIT):
        async with get_session().create_client(
            "s3", endpoint_url=s3_store.endpoint, **S3_CREDENTIALS
        ) as client:
            for i in (0, 63):
                resp = await client.get_object(Bucket=s3_store.bucket, Key=object_key(i))
                async with resp["Body"] as body:
                    assert await body.read() == s3_store.expected(i)
            with pytest.raises(client.exceptions.NoSuchKey):
                await client.get_object(Bucket=s3_store.bucket, Key="missing")
