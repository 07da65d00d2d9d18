"""Load batches on Ray actors: one actor per worker, anywhere in a Ray cluster.

Run: python examples/ray_workers.py [--address ADDRESS] [--workers 2]

Without --address it starts a local Ray cluster (and stops it at the end); with one it connects
to an existing cluster, which it leaves running. Needs ``pip install 'aioloader[ray]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import ray
import torch
from torch.utils.data import Dataset, get_worker_info

from aioloader import AsyncDataLoader
from aioloader.ray import RayWorkers


class NoisyImages(Dataset[tuple[torch.Tensor, int]]):
    """Synthetic 3x64x64 images with a per-sample augmentation drawn from the worker's seed."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        info = get_worker_info()  # set inside each actor: its id, seed, num_workers
        assert info is not None
        image = torch.full((3, 64, 64), float(i)) + torch.randn(3, 64, 64) * 0.1
        return image, info.id


async def main(workers: int) -> None:
    loader = AsyncDataLoader(
        NoisyImages(512),
        batch_size=32,
        shuffle=True,
        num_workers=workers,
        persistent_workers=True,  # the actors live across epochs: each start imports torch
        executor=RayWorkers(num_cpus=1),
    )
    async with loader:
        for epoch in range(2):
            t0 = time.perf_counter()
            seen = 0
            by_worker: dict[int, int] = {}
            async for images, worker_ids in loader:
                seen += images.shape[0]
                for w in worker_ids.tolist():
                    by_worker[w] = by_worker.get(w, 0) + 1
            took = time.perf_counter() - t0
            print(f"epoch {epoch}: {seen} samples in {took:.2f}s, samples per actor {by_worker}")
        print(loader.stats())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", help="an existing cluster's address (default: a local one)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if args.address:
        ray.init(address=args.address)
        asyncio.run(main(args.workers))  # the cluster is not ours to stop
    else:
        ray.init(num_cpus=max(2, args.workers), include_dashboard=False)
        try:
            asyncio.run(main(args.workers))
        finally:
            ray.shutdown()
