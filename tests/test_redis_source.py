"""RedisStreamSource against a real redis-server: delivery, XACK, XAUTOCLAIM, a killed consumer,
a server that goes away."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader
from tests.conftest import session_server, worker_processes
from tests.redis_server import RedisServer

redis = pytest.importorskip("redis", reason="the redis package is not installed ([redis] extra)")
from aioloader.sources.redis import (  # noqa: E402
    RedisStreamSource,
    StreamConnectionError,
    StreamEntry,
)
from tests.redis_consumer import to_sample  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _server(persist: bool = False) -> RedisServer:
    try:
        return RedisServer(persist=persist)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    server = _server()
    # It lives until the run ends: the tests after this module's must not count it as a worker
    # some loader left behind (worker_processes()).
    with session_server(server.proc.pid):
        try:
            yield server.url
        finally:
            server.stop()


def test_the_shared_server_is_no_worker(redis_url: str) -> None:
    """The session's redis-server runs on after this module, through every later test: one that
    asserts ``not worker_processes()`` (test_chaos's cancelled ``aclose()``, run after this file)
    failed on it, blaming the loader for a process the tests themselves keep."""
    assert not worker_processes()


def produce(url: str, stream: str, n: int) -> list[str]:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        pipe = client.pipeline()
        for i in range(n):
            pipe.xadd(stream, {"x": str(i), "y": str(2 * i)})
        return [str(x) for x in pipe.execute()]
    finally:
        client.close()


def pending(url: str, stream: str, group: str) -> int:
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return int(client.xpending(stream, group)["pending"])
    finally:
        client.close()


def ids_of(entry: StreamEntry) -> dict[str, Any]:
    return {"id": entry.id, "x": torch.tensor([float(entry.fields["x"])])}


async def test_entries_arrive_in_order_and_are_acknowledged(redis_url: str) -> None:
    stream = f"s-{uuid.uuid4().hex}"
    ids = produce(redis_url, stream, 100)
    async with (
        RedisStreamSource(
            redis_url, stream, "g", "c", count=32, block_s=0.05, stop_after_idle_s=0.3
        ) as src,
        AsyncDataLoader(src, batch_size=8, num_workers=1, transform=ids_of) as loader,
    ):
        first: list[list[str]] = []
        async with asyncio.timeout(60):
            async for batch in loader:  # leave after two: the second is not acknowledged
                first.append(list(batch["id"]))
                if len(first) == 2:
                    break
            # Same consumer name, next epoch: its own pending entries come first, in order.
            second = [i async for b in loader for i in b["id"]]
    assert first[0] == ids[:8]
    assert second == ids[8:]
    assert pending(redis_url, stream, "g") == 0


@pytest.mark.parametrize("restart_as", ["b", "a"], ids=["new-name", "same-name"])
async def test_a_killed_consumer_loses_nothing_and_acks_only_what_it_trained(
    redis_url: str, tmp_path: Path, restart_as: str
) -> None:
    stream = f"s-{uuid.uuid4().hex}"
    ids = produce(redis_url, stream, 300)
    # Consumer "a", a process of its own: trains on 5 batches, gets stuck in the 5th training
    # step with more entries read ahead, and is SIGKILLed there.
    log_a = tmp_path / "a.log"
    a = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "tests.redis_consumer", redis_url, stream, "a", str(log_a)),
        *("--hang-after", "5"),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        async with asyncio.timeout(90):
            while not (log_a.exists() and log_a.read_text().count("D ") >= 5):
                assert a.returncode is None, "the first consumer exited early"
                await asyncio.sleep(0.05)
    finally:
        a.send_signal(signal.SIGKILL)
        await a.wait()

    # The replacement (here). Under another name, what "a" read comes to it through XAUTOCLAIM
    # after claim_idle_s; under the same name it re-reads its own pending entries at once, and
    # never claims (claim_idle_s is far longer than the test).
    batches_b: list[list[str]] = []
    acks_b: list[list[str]] = []

    class Logged(RedisStreamSource):
        async def ack(self, samples: list[StreamEntry]) -> None:
            await super().ack(samples)
            acks_b.append([s.id for s in samples])

    src = Logged(
        redis_url,
        stream,
        "trainers",
        restart_as,
        count=32,
        block_s=0.05,
        claim_idle_s=0.3 if restart_as == "b" else 300.0,
        claim_every_s=0.2,
        stop_after_idle_s=1.0,
    )
    async with (
        src,
        AsyncDataLoader(
            src, batch_size=16, num_workers=1, max_batch_latency=0.05, transform=to_sample
        ) as loader,
    ):
        async with asyncio.timeout(60):
            async for batch in loader:
                batches_b.append(list(batch["id"]))

    batches_a: list[list[str]] = []
    acks_a: list[list[str]] = []
    for line in log_a.read_text().splitlines():
        kind, *entry_ids = line.split()
        if kind == "A":
            # Acknowledged only after it was trained on, in order.
            assert entry_ids == batches_a[len(acks_a)]
            acks_a.append(entry_ids)
        else:
            batches_a.append(entry_ids)
    # Killed mid-stream: 5 batches trained on, the 5th never finished, so never acknowledged.
    assert len(batches_a) == 5 and acks_a == batches_a[:4]
    assert acks_b == batches_b
    trained_a, acked_a = {i for b in batches_a for i in b}, {i for b in acks_a for i in b}
    trained_b, acked_b = {i for b in batches_b for i in b}, {i for b in acks_b for i in b}
    assert trained_a | trained_b == set(ids)  # everything trained on at least once
    assert acked_a | acked_b == set(ids)
    assert trained_a - acked_a <= trained_b  # what a trained but never acked: claimed by b
    assert pending(redis_url, stream, "trainers") == 0


class Unacked(RedisStreamSource):
    ack = None  # type: ignore[assignment]


@pytest.mark.parametrize("acked", [True, False], ids=["ack-fails", "read-fails"])
async def test_a_server_that_goes_away_is_an_error_not_a_hang(acked: bool) -> None:
    server = _server()
    try:
        produce(server.url, "s", 40)
        cls = RedisStreamSource if acked else Unacked
        src = cls(server.url, "s", "g", "c", count=8, block_s=0.05, reconnect_for_s=0.5)
        async with src, AsyncDataLoader(src, batch_size=4, num_workers=1, transform=ids_of) as ld:
            it = aiter(ld)
            async with asyncio.timeout(60):
                await anext(it)
                server.stop()
                with pytest.raises(StreamConnectionError) as info:
                    for _ in range(100):
                        await anext(it)
    finally:
        server.stop()
    # A built-in ConnectionError, so `except ConnectionError` catches it; the client's own error
    # is chained.
    assert isinstance(info.value, ConnectionError)
    assert isinstance(info.value.__cause__, (redis.ConnectionError, redis.TimeoutError))
    assert "Redis stream 's'" in str(info.value)
    assert "unreachable" in str(info.value)


async def _drain(loader: AsyncDataLoader[Any], on_first: Any = None) -> list[str]:
    """Every id delivered in one epoch, in delivery order; ``on_first`` runs after batch one."""
    got: list[str] = []
    async with asyncio.timeout(90):
        async for batch in loader:
            if not got and on_first is not None:
                await on_first()
            got += batch["id"]
    return got


async def test_a_restarted_server_is_reconnected_to_within_the_epoch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = _server(persist=True)
    try:
        first = produce(server.url, "s", 40)
        later: list[str] = []
        src = RedisStreamSource(
            server.url, "s", "g", "c", count=8, block_s=0.05, stop_after_idle_s=2.0
        )

        def restart() -> None:
            server.stop_only()
            time.sleep(1.0)  # the reader polls a refusing port meanwhile
            server.start()
            later.extend(produce(server.url, "s", 40))

        tasks: list[asyncio.Task[None]] = []

        async def restart_in_background() -> None:
            tasks.append(asyncio.create_task(asyncio.to_thread(restart)))

        caplog.set_level(logging.WARNING, logger="aioloader.sources.redis")
        async with src, AsyncDataLoader(src, batch_size=4, num_workers=1, transform=ids_of) as ld:
            got = await _drain(ld, restart_in_background)
            async with asyncio.timeout(30):
                await tasks[0]
        # At least once: everything produced before and after the restart, nothing else; all
        # acknowledged.
        assert set(got) == set(first) | set(later)
        assert pending(server.url, "s", "g") == 0
    finally:
        server.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("lost the server" in m for m in messages) == 1, messages
    assert sum("reconnected after" in m for m in messages) == 1, messages


async def test_a_frozen_server_is_waited_for_and_nothing_is_lost() -> None:
    server = _server()
    try:
        ids = produce(server.url, "s", 60)
        src = RedisStreamSource(
            server.url, "s", "g", "c", count=8, block_s=0.05, socket_timeout_s=0.3,
            stop_after_idle_s=1.0,
        )  # fmt: skip

        async def freeze() -> None:
            server.freeze()
            asyncio.get_running_loop().call_later(2.0, server.thaw)

        async with src, AsyncDataLoader(src, batch_size=4, num_workers=1, transform=ids_of) as ld:
            got = await _drain(ld, freeze)
        assert set(got) == set(ids)
        assert pending(server.url, "s", "g") == 0
    finally:
        server.stop()


@pytest.mark.parametrize("reconnect_for_s", [0.0, 1.0])
async def test_a_frozen_server_raises_within_the_documented_bound(reconnect_for_s: float) -> None:
    """Noticed after block_s + socket_timeout_s; raised at most reconnect_for_s later."""
    server = _server()
    block_s, socket_timeout_s = 0.05, 0.5
    bound = reconnect_for_s + block_s + socket_timeout_s
    try:
        produce(server.url, "s", 8)
        src = RedisStreamSource(
            server.url, "s", "g", "c", count=4, block_s=block_s,
            socket_timeout_s=socket_timeout_s, reconnect_for_s=reconnect_for_s,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        async with src, AsyncDataLoader(src, batch_size=4, num_workers=1, transform=ids_of) as ld:
            it = aiter(ld)
            async with asyncio.timeout(60):
                await anext(it)
                server.freeze()
                frozen_at = loop.time()
                with pytest.raises(StreamConnectionError) as info:
                    for _ in range(100):
                        await anext(it)
                took = loop.time() - frozen_at
            server.thaw()
    finally:
        server.stop()
    assert isinstance(info.value.__cause__, redis.TimeoutError)
    # The lower end is exact; the upper leaves room for a loaded machine's scheduling, but is far
    # below what the client's own retries used to cost (4 socket timeouts, 21 s by default).
    assert bound - 0.1 <= took <= bound + 2.0, (took, bound)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"count": 0},
        {"block_s": 0},
        {"claim_idle_s": -1},
        {"stop_after_idle_s": 0},
        {"reconnect_for_s": -1},
        {"reconnect_delay_s": 0},
        {"reconnect_max_delay_s": "1"},
    ],
    ids=["count", "block", "claim", "idle", "reconnect", "delay", "max-delay"],
)
def test_bad_source_arguments_say_what_is_wrong(kwargs: dict[str, Any]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        RedisStreamSource("redis://127.0.0.1:1/0", "s", "g", "c", **kwargs)


async def test_an_outage_seen_by_two_commands_at_once_is_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A read and an ack in flight together both see the server go: one "lost the server" and
    one "reconnected" per outage, not one per command (seen under load)."""
    server = _server()
    try:
        src = RedisStreamSource(server.url, "s", "g", "c", reconnect_delay_s=0.05)
        caplog.set_level(logging.WARNING, logger="aioloader.sources.redis")
        async with src, asyncio.timeout(30):
            await src.ensure_group()
            server.stop_only()
            calls = [asyncio.create_task(src.ensure_group()) for _ in range(3)]
            await asyncio.sleep(0.5)  # every call has failed at least once by now
            server.start()
            await asyncio.gather(*calls)
    finally:
        server.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("lost the server" in m for m in messages) == 1, messages
    assert sum("reconnected after" in m for m in messages) == 1, messages
