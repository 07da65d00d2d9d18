"""Train on JPEG images read from an object store over HTTP, decoded in the worker processes.

Run: python examples/remote_dataset.py [--workers 2] [--epochs 2] [--latency-ms 20]

The script starts its own store (aioloader.benchmark._store: a real HTTP server in a process of
its own, 10-20 ms before each object's first byte, as a cloud store in the same region) holding
512 JPEG images of 4 classes, reads them with an async dataset, trains a small CNN for a couple
of epochs and stops the store. Needs aiohttp and Pillow (``pip install 'aioloader[remote]'
pillow``).

What to copy:

* the dataset opens its HTTP client in ``async def __aenter__`` and closes it in
  ``async def __aexit__``: the loader enters the dataset once in every event loop that fetches
  (each worker's with ``fetch_in="workers"``) and exits it when that worker ends, so the session
  is made once per worker and closed; no "Unclosed client session" warning at the end;
* with workers, ``__getitem__`` runs in the worker processes (``fetch_in="workers"``, the
  default) and ``transform`` decodes there: the JPEG's bytes never cross to the main process,
  only the batch does;
* ``source_concurrency`` requests in flight per worker: with 20 ms per request, 16 in flight
  give a worker up to 800 images/s from the store, far more than torch's one request at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import time
from typing import Any

import torch

from aioloader import AsyncDataLoader
from aioloader.benchmark._store import jpeg_label, object_key, start_store

SIDE = 32  # the model's input: images are resized to 32x32


def decode(data: bytes) -> torch.Tensor:
    """JPEG bytes -> a 3x32x32 float tensor in [0, 1]."""
    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        small = im.convert("RGB").resize((SIDE, SIDE), Image.Resampling.BILINEAR)
    return torch.from_numpy(np.array(small)).permute(2, 0, 1).float().div_(255)


def decode_sample(sample: tuple[bytes, int]) -> tuple[torch.Tensor, int]:
    data, label = sample
    return decode(data), label


class RemoteImages:
    """``GET {base}/objects/{key}`` for each index, on one aiohttp session per event loop that
    fetches: ``(jpeg bytes, label)``. Decoding is CPU work: it is the ``transform``'s, which the
    loader runs in the worker, in batch order, while the worker's next requests are in flight.
    """

    def __init__(self, base: str, n: int, *, in_flight: int = 16) -> None:
        self.base = base
        self.n = n
        self.in_flight = in_flight
        self.session: Any = None  # made in __aenter__, on the event loop that fetches

    def __len__(self) -> int:
        return self.n

    async def __aenter__(self) -> RemoteImages:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.in_flight)
        timeout = aiohttp.ClientTimeout(total=30)  # a request never hangs the epoch
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        session, self.session = self.session, None
        await session.close()

    async def __getitem__(self, i: int) -> tuple[bytes, int]:
        async with self.session.get(f"{self.base}/objects/{object_key(i)}") as resp:
            resp.raise_for_status()  # a 404 or a 5xx is an error at this batch's position
            data = await resp.read()
        label = jpeg_label(i)  # in a real dataset: from an index file or the object's metadata
        return data, label


def make_loader(base: str, n: int, workers: int) -> tuple[AsyncDataLoader[Any], RemoteImages]:
    """The loader and the dataset it reads. With workers, each fetches (``fetch_in="workers"``,
    the default) and decodes; with none, this loop fetches and the fetch thread decodes."""
    ds = RemoteImages(base, n, in_flight=16 if workers else 64)
    loader = AsyncDataLoader(
        ds,
        batch_size=32,
        shuffle=True,
        num_workers=workers,
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(0),
        transform=decode_sample,  # in the worker that fetched the sample
        source_concurrency=ds.in_flight,  # requests in flight per worker
    )
    return loader, ds


async def train(base: str, n: int, workers: int, epochs: int) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 16, 4),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader, _ = make_loader(base, n, workers)
    accuracy = 0.0
    async with loader:  # closes the workers, and with them every session
        for epoch in range(epochs):
            t0 = time.perf_counter()
            right = seen = 0
            async for images, labels in loader:
                loss = torch.nn.functional.cross_entropy(model(images), labels)
                opt.zero_grad()
                loss.backward()
                opt.step()
                right += int((model(images).argmax(1) == labels).sum())
                seen += len(labels)
            took = time.perf_counter() - t0
            accuracy = right / seen
            print(
                f"epoch {epoch}: {seen} images in {took:.2f} s ({seen / took:.0f}/s), "
                f"loss {loss.item():.3f}, accuracy {accuracy:.2f}",
                flush=True,
            )
        where = f"fetched in the workers ({loader.fetch_in})" if workers else "fetched on the loop"
    print(f"done: {where}; the loader and every session closed")
    return accuracy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--latency-ms", type=float, default=20.0)
    a = p.parse_args()
    with start_store(latency_ms=a.latency_ms, size=20_000, count=a.images, jpeg=True) as store:
        print(f"store at {store.url}: {a.images} JPEGs of about 20 KB, {a.latency_ms:g} ms each")
        asyncio.run(train(store.url, a.images, a.workers, a.epochs))


if __name__ == "__main__":
    main()
