"""Which async S3 client reads small objects fastest: obstore, aiobotocore or s3fs.

    PYTHONPATH=. python -m tests.s3_clients [--size 100000] [--concurrency 32] [--requests 600]

Starts moto's S3 server (tests/remote_servers.py) with one bucket, then reads the same objects
with each client in turn, round by round (A B C A B C ...), ``concurrency`` requests in flight on
one event loop. Reported per client: requests/s (median of rounds) and this process's CPU time
per request (all its threads: obstore runs its own Rust runtime). moto itself is a Python server
and may be what bounds requests/s; the CPU per request is what the client costs a data loader's
process whatever the server.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psutil

from aioloader.benchmark._store import object_key
from tests.remote_servers import S3_CREDENTIALS, MotoS3, moto_s3

Get = Callable[[str], Awaitable[bytes]]


async def _timed(get: Get, keys: list[str], concurrency: int) -> tuple[float, float]:
    sem = asyncio.Semaphore(concurrency)

    async def one(key: str) -> int:
        async with sem:
            return len(await get(key))

    await asyncio.gather(*(one(k) for k in keys[:concurrency]))  # connections up, untimed
    c0, t0 = time.process_time(), time.perf_counter()
    sizes = await asyncio.gather(*(one(k) for k in keys))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert all(sizes)
    return len(keys) / wall, cpu / len(keys)


async def run_obstore(m: MotoS3, keys: list[str], concurrency: int) -> tuple[float, float]:
    import obstore

    store = m.obstore()

    async def get(key: str) -> bytes:
        r = await obstore.get_async(store, key)
        return bytes(await r.bytes_async())

    return await _timed(get, keys, concurrency)


async def run_aiobotocore(m: MotoS3, keys: list[str], concurrency: int) -> tuple[float, float]:
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    config = AioConfig(max_pool_connections=concurrency)
    async with get_session().create_client(
        "s3", endpoint_url=m.endpoint, config=config, **S3_CREDENTIALS
    ) as client:

        async def get(key: str) -> bytes:
            r = await client.get_object(Bucket=m.bucket, Key=key)
            async with r["Body"] as body:
                data: bytes = await body.read()
            return data

        return await _timed(get, keys, concurrency)


async def run_s3fs(m: MotoS3, keys: list[str], concurrency: int) -> tuple[float, float]:
    import s3fs

    fs = s3fs.S3FileSystem(
        asynchronous=True,
        key=S3_CREDENTIALS["aws_access_key_id"],
        secret=S3_CREDENTIALS["aws_secret_access_key"],
        endpoint_url=m.endpoint,
        config_kwargs={"max_pool_connections": concurrency},
        skip_instance_cache=True,
    )
    session = await fs.set_session()
    try:

        async def get(key: str) -> bytes:
            data: bytes = await fs._cat_file(f"{m.bucket}/{key}")
            return data

        return await _timed(get, keys, concurrency)
    finally:
        await session.close()


CLIENTS: dict[str, Callable[[MotoS3, list[str], int], Awaitable[tuple[float, float]]]] = {
    "obstore": run_obstore,
    "aiobotocore": run_aiobotocore,
    "s3fs": run_s3fs,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--objects", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    keys = [object_key(i % a.objects) for i in range(a.requests)]
    rates: dict[str, list[float]] = {n: [] for n in CLIENTS}
    cpus: dict[str, list[float]] = {n: [] for n in CLIENTS}
    with moto_s3(count=a.objects, size=a.size) as m:
        server = psutil.Process(m.pid)
        for r in range(a.rounds):
            for name, fn in CLIENTS.items():
                s0 = sum(server.cpu_times()[:2])
                rate, cpu = asyncio.run(fn(m, keys, a.concurrency))
                srv = (sum(server.cpu_times()[:2]) - s0) / (a.requests + a.concurrency)
                rates[name].append(rate)
                cpus[name].append(cpu)
                print(f"round {r + 1} {name:12s} {rate:7.0f} req/s  client {cpu * 1e3:.3f} "
                      f"ms CPU/req  moto {srv * 1e3:.2f} ms CPU/req", flush=True)  # fmt: skip
    print(f"\n{a.size} B objects, {a.concurrency} in flight, median of {a.rounds} rounds:")
    for name in CLIENTS:
        med: Any = statistics.median(rates[name])
        print(f"  {name:12s} {med:7.0f} req/s  {statistics.median(cpus[name]) * 1e3:.3f} "
              "ms client CPU per request")  # fmt: skip


if __name__ == "__main__":
    main()
