"""An online-learning consumer of a Redis stream, run as a process by tests/test_redis_source.py.

Logs ``D <ids>`` after training on a batch and ``A <ids>`` after acknowledging one, so the test
can check that everything produced was trained on and that nothing acknowledged went untrained.
``--hang-after N``: after N batches the training loop stops making progress (the process is
then killed from outside, mid-stream, with entries read but not acknowledged).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, TextIO

import torch

from aioloader import AsyncDataLoader
from aioloader.sources.redis import RedisStreamSource, StreamEntry


def to_sample(entry: StreamEntry) -> dict[str, Any]:
    return {
        "id": entry.id,
        "x": torch.tensor([float(entry.fields["x"])]),
        "y": torch.tensor([float(entry.fields["y"])]),
    }


class LoggedSource(RedisStreamSource):
    log: TextIO

    async def ack(self, samples: list[StreamEntry]) -> None:
        await super().ack(samples)
        self.log.write("A " + " ".join(s.id for s in samples) + "\n")
        self.log.flush()


async def main(args: argparse.Namespace, log: TextIO) -> None:
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    source = LoggedSource(
        args.url,
        args.stream,
        "trainers",
        args.consumer,
        count=32,
        block_s=0.05,
        claim_idle_s=args.claim_idle_s,
        claim_every_s=0.2,
        stop_after_idle_s=args.stop_after_idle_s,
    )
    source.log = log
    async with (
        source,
        AsyncDataLoader(
            source, batch_size=16, num_workers=1, max_batch_latency=0.05, transform=to_sample
        ) as loader,
    ):
        done = 0
        async for batch in loader:
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.write("D " + " ".join(batch["id"]) + "\n")
            log.flush()
            done += 1
            if done == args.hang_after:
                await asyncio.Event().wait()  # stuck: killed from outside


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("stream")
    parser.add_argument("consumer")
    parser.add_argument("log")
    parser.add_argument("--hang-after", type=int, default=None)
    parser.add_argument("--claim-idle-s", type=float, default=30.0)
    parser.add_argument("--stop-after-idle-s", type=float, default=None)
    arguments = parser.parse_args()
    with open(arguments.log, "a") as log_file:
        asyncio.run(main(arguments, log_file))
