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
* with ``fetch_in="workers"`` ``__getitem__`` runs in the worker processes, so it decodes there:
  the JPEG's bytes never cross to the main process, only the batch does;
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
    """``GET {base}/objects/{key}`` for each index, on one aiohttp session per event loop.

    ``decode=True``: ``__getitem__`` returns ``(image tensor, label)``, decoded where it runs (a
    worker with ``fetch_in="workers"``). ``decode=False``: ``(jpeg bytes, label)``, for a
    ``transform`` to decode (the loader runs that in its workers).
    """

    def __init__(self, base: str, n: int, *, decode: bool = True, in_flight: int = 16) -> None:
        self.base = base
        self.n = n
        self.decode = decode
        self.in_flight = in_flight
        self.session: Any = None  # made in __aenter__, in the loop that fetches
        self.users = 0  # entered this many times in this process (see train())

    def __getstate__(self) -> dict[str, Any]:
        # The dataset travels to the workers before any session exists; never pickle one.
        return {**self.__dict__, "session": None, "users": 0}

    def __len__(self) -> int:
        return self.n

    async def __aenter__(self) -> RemoteImages:
        import aiohttp

        self.users += 1
        if self.session is None:
            connector = aiohttp.TCPConnector(limit=self.in_flight)
            timeout = aiohttp.ClientTimeout(total=30)  # a request never hangs the epoch
            self.session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.users -= 1
        if self.users == 0 and self.session is not None:
            session, self.session = self.session, None
            await session.close()

    async def __getitem__(self, i: int) -> tuple[Any, int]:
        async with self.session.get(f"{self.base}/objects/{object_key(i)}") as resp:
            resp.raise_for_status()  # a 404 or a 5xx is an error at this batch's position
            data = await resp.read()
        label = jpeg_label(i)  # in a real dataset: from an index file or the object's metadata
        return (decode(data), label) if self.decode else (data, label)


def make_loader(base: str, n: int, workers: int) -> tuple[AsyncDataLoader[Any], RemoteImages]:
    """The loader, and the dataset it reads: fetched and decoded in the workers; before the
    loader had ``fetch_in``, fetched on the loop and decoded by ``transform`` in the workers."""
    common: dict[str, Any] = {
        "batch_size": 32,
        "shuffle": True,
        "num_workers": workers,
        "persistent_workers": workers > 0,
        "generator": torch.Generator().manual_seed(0),
    }
    if workers > 0:  # with no workers, fetching is on the loop: the fallback below
        ds = RemoteImages(base, n, decode=True)
        try:
            return AsyncDataLoader(ds, fetch_in="workers", source_concurrency=16, **common), ds
        except TypeError:  # an aioloader without fetch_in=
            pass
    ds = RemoteImages(base, n, decode=False, in_flight=64)
    loader = AsyncDataLoader(ds, source_concurrency=64, transform=decode_sample, **common)
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
    loader, ds = make_loader(base, n, workers)
    in_workers = ds.decode
    accuracy = 0.0
    # On the loop (the fallback) the session lives in this loop: enter the dataset here too, for
    # an aioloader that does not enter it itself (the count in __aenter__ makes either work).
    async with loader:
        if not in_workers:
            await ds.__aenter__()
        try:
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
        finally:
            if not in_workers:
                await ds.__aexit__(None, None, None)
    where = "fetched and decoded in the workers" if in_workers else "fetched on the loop"
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
