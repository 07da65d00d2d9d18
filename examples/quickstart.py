"""Quickstart: train a tiny model on synthetic data with AsyncDataLoader.

Run: python examples/quickstart.py [--workers 2] [--epochs 2] [--start-method spawn]

The event loop stays free while batches load: a heartbeat task prints between batches to show it.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
from torch.utils.data import Dataset

from aioloader import AsyncDataLoader


class Spirals(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Two interleaved spirals: a small, deterministic classification problem."""

    def __init__(self, n: int = 4096) -> None:
        g = torch.Generator().manual_seed(0)
        t = torch.rand(n, generator=g) * 2 * torch.pi + 0.5
        self.labels = (torch.arange(n) % 2).long()
        sign = self.labels.float() * 2 - 1
        self.points = torch.stack([t.cos() * t * sign, t.sin() * t * sign], dim=1)
        self.points += 0.1 * torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[i], self.labels[i]


async def heartbeat(stop: asyncio.Event) -> int:
    beats = 0
    while not stop.is_set():
        await asyncio.sleep(0.05)
        beats += 1
    return beats


async def main(workers: int, epochs: int, start_method: str | None) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    stop = asyncio.Event()
    beat_task = asyncio.create_task(heartbeat(stop))
    t0 = time.perf_counter()
    async with AsyncDataLoader(
        Spirals(),
        batch_size=64,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        multiprocessing_context=start_method if workers > 0 else None,
        generator=torch.Generator().manual_seed(1),
    ) as loader:
        for epoch in range(epochs):
            total, correct, loss_sum = 0, 0, 0.0
            async for x, y in loader:
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                loss_sum += loss.item() * len(y)
                correct += int((logits.argmax(1) == y).sum())
                total += len(y)
            print(f"epoch {epoch}: loss {loss_sum / total:.3f}  accuracy {correct / total:.1%}")
        stats = loader.stats()
    stop.set()
    beats = await beat_task
    print(
        f"{stats.batches_delivered} batches in {time.perf_counter() - t0:.2f}s, "
        f"data stall {stats.data_stall_fraction:.1%}, heartbeat ticked {beats} times"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--start-method", choices=["fork", "spawn", "forkserver"], default=None)
    args = parser.parse_args()
    asyncio.run(main(args.workers, args.epochs, args.start_method))
