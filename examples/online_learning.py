"""Online learning from a Redis stream: a producer XADDs labelled events, a consumer trains on them.

    pip install -e ".[redis]"
    python examples/online_learning.py                   # starts a throwaway redis-server
    python examples/online_learning.py --url redis://127.0.0.1:6379/0 --rate 500 --seconds 20

The producer adds events ``x -> y = 3x + 1 + noise`` at a steady rate, each stamped with the time
it was produced. The consumer reads them as a consumer group through ``RedisStreamSource``; the
loader closes a batch at ``--batch-size`` events or ``--max-latency`` seconds after its first
event, parses and collates in a worker process, and acknowledges (XACK) each batch once the
training step on it is done. It prints the loss, the model's fit and the end-to-end latency
(event produced -> event in a delivered batch).

If the server goes away (restart it, or freeze it with ``kill -STOP``), the consumer logs one
warning, waits for it for up to ``--reconnect-for`` seconds and goes on where it stopped. Kill the
consumer and run it again with ``--url`` and the same ``--consumer`` name: what it read but never
acknowledged is delivered again at once. Under a new name, those entries are claimed only after
they have been pending for ``--claim-idle`` seconds (and a consumer that stops sooner, at
``--idle-stop``, leaves them for the next one).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import redis.asyncio as aioredis
import torch

from aioloader import AsyncDataLoader
from aioloader.sources.redis import RedisStreamSource, StreamEntry


def parse(entry: StreamEntry) -> dict[str, Any]:
    """Runs in the workers: one event's fields -> tensors."""
    return {
        "x": torch.tensor([float(entry.fields["x"])]),
        "y": torch.tensor([float(entry.fields["y"])]),
        "t": torch.tensor(float(entry.fields["t"]), dtype=torch.float64),
    }


async def produce(url: str, stream: str, rate: float, seconds: float) -> int:
    """XADD ``rate`` events per second for ``seconds``; returns how many were added."""
    client = aioredis.Redis.from_url(url)
    gen = torch.Generator().manual_seed(0)
    n = int(rate * seconds)
    t0 = time.time()
    try:
        for i in range(n):
            delay = t0 + i / rate - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            x = float(torch.rand((), generator=gen)) * 2 - 1
            y = 3 * x + 1 + 0.05 * float(torch.randn((), generator=gen))
            await client.xadd(stream, {"x": x, "y": y, "t": time.time()})
    finally:
        await client.aclose()
    return n


async def consume(args: argparse.Namespace, url: str) -> None:
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    latencies: list[float] = []
    seen = 0
    source = RedisStreamSource(
        url,
        args.stream,
        "trainers",
        args.consumer,
        stop_after_idle_s=args.idle_stop,
        claim_idle_s=args.claim_idle,
        claim_every_s=min(5.0, args.claim_idle),
        reconnect_for_s=args.reconnect_for,
    )
    async with (
        source,
        AsyncDataLoader(
            source,
            batch_size=args.batch_size,
            max_batch_latency=args.max_latency,
            num_workers=1,
            transform=parse,
        ) as loader,
    ):
        last_print = time.monotonic()
        async for batch in loader:
            now = time.time()
            latencies += (now - batch["t"]).tolist()
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen += len(batch["x"])
            if time.monotonic() - last_print >= 1.0:
                last_print = time.monotonic()
                recent = torch.tensor(latencies[-500:]) * 1e3
                print(
                    f"events {seen:6d}  batch {len(batch['x']):3d}  loss {loss.item():.4f}  "
                    f"w {model.weight.item():+.3f} b {model.bias.item():+.3f}  latency ms "
                    f"p50 {recent.quantile(0.5):.1f} p99 {recent.quantile(0.99):.1f}"
                )
    lat = torch.tensor(latencies) * 1e3
    print(
        f"trained on {seen} events; fit y = {model.weight.item():.2f} x + {model.bias.item():.2f} "
        f"(true 3x + 1); latency ms p50 {lat.quantile(0.5):.1f} p99 {lat.quantile(0.99):.1f}"
    )


@contextlib.contextmanager
def throwaway_redis() -> Iterator[str]:
    """A redis-server on a free loopback port with a temporary directory, stopped at exit."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: apt-get install redis-server, or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, "--save", ""],
            stdout=subprocess.DEVNULL,
        )
        try:
            for _ in range(500):
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                time.sleep(0.01)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait()


async def main(args: argparse.Namespace, url: str) -> None:
    producer = asyncio.create_task(produce(url, args.stream, args.rate, args.seconds))
    await consume(args, url)
    print(f"produced {await producer} events")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a Redis server (default: start a throwaway one)")
    parser.add_argument("--stream", default="events")
    parser.add_argument("--rate", type=float, default=200.0, help="events per second")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to produce")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-latency", type=float, default=0.02, help="seconds")
    parser.add_argument(
        "--idle-stop", type=float, default=2.0, help="stop after this long without events"
    )
    parser.add_argument("--consumer", default="trainer-1", help="this consumer's name in the group")
    parser.add_argument(
        "--claim-idle",
        type=float,
        default=30.0,
        help="claim other consumers' entries pending for this long (seconds)",
    )
    parser.add_argument(
        "--reconnect-for",
        type=float,
        default=60.0,
        help="how long to wait for a lost server before giving up (seconds)",
    )
    arguments = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if arguments.url:
        asyncio.run(main(arguments, arguments.url))
    else:
        with throwaway_redis() as server_url:
            asyncio.run(main(arguments, server_url))
