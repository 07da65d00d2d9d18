"""RedisStreamSource against a real redis-server: delivery, XACK, XAUTOCLAIM, a killed consumer,
a server that goes away."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader
from tests.redis_server import RedisServer

redis = pytest.importorskip("redis", reason="the redis package is not installed ([redis] extra)")
from aioloader.sources.redis import RedisStreamSource, StreamEntry  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _server() -> RedisServer:
    try:
        return RedisServer()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    server = _server()
    try:
        yield server.url
    finally:
        server.stop()


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


def test_a_killed_consumer_loses_nothing_and_acks_only_what_it_trained(
    redis_url: str, tmp_path: Path
) -> None:
    stream = f"s-{uuid.uuid4().hex}"
    ids = produce(redis_url, stream, 300)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tests.redis_consumer", redis_url, stream]
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = subprocess.Popen([*cmd, "a", str(log_a), "--hang-after", "5"], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 90
        while not (log_a.exists() and log_a.read_text().count("D ") >= 5):
            assert a.poll() is None, "the first consumer exited early"
            assert time.monotonic() < deadline, "the first consumer made no progress"
            time.sleep(0.05)
    finally:
        a.send_signal(signal.SIGKILL)
        a.wait()
    b = subprocess.Popen(
        [*cmd, "b", str(log_b), "--claim-idle-s", "0.3", "--stop-after-idle-s", "2"],
        cwd=ROOT,
        env=env,
    )
    try:
        assert b.wait(120) == 0
    finally:
        if b.poll() is None:
            b.kill()
            b.wait()

    def read(log: Path) -> tuple[list[list[str]], list[list[str]]]:
        trained: list[list[str]] = []
        acked: list[list[str]] = []
        for line in log.read_text().splitlines():
            kind, *entry_ids = line.split()
            if kind == "A":
                # Acknowledged only after it was trained on, by this very process, in order.
                assert entry_ids == trained[len(acked)]
                acked.append(entry_ids)
            else:
                trained.append(entry_ids)
        return trained, acked

    batches_a, acks_a = read(log_a)
    batches_b, acks_b = read(log_b)
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
        src = cls(server.url, "s", "g", "c", count=8, block_s=0.05)
        async with src, AsyncDataLoader(src, batch_size=4, num_workers=1, transform=ids_of) as ld:
            it = aiter(ld)
            async with asyncio.timeout(60):
                await anext(it)
                server.stop()
                with pytest.raises(redis.RedisError) as info:
                    for _ in range(100):
                        await anext(it)
    finally:
        server.stop()
    assert any("Redis stream 's'" in note for note in info.value.__notes__)
