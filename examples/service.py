"""A prediction service that fine-tunes its model while it serves (aiohttp + AsyncDataLoader).

Run: python examples/service.py [--port 8080] [--loader aioloader|torch|none]
                                 [--train-step thread|loop] [--workers 2]

Needs the ``service`` extra (``pip install "aioloader[service]"``). Endpoints:

* ``POST /predict`` with ``{"x": [16 floats]}`` answers ``{"y": float, "version": int}``;
* ``GET /status`` answers the training progress (steps, epochs, loss, batches per second).

Everything runs on one event loop: the HTTP server, and a background task that iterates an
``AsyncDataLoader`` whose worker processes build the batches. The pattern that keeps request
latency low (see docs/service.md for the figures):

* the **loader on the loop** (``async for``): waiting for a batch costs the loop nothing;
* the **training step on a thread** (``asyncio.to_thread``): forward, backward and the optimizer
  step release the GIL inside torch's kernels, so requests are answered meanwhile. Run on the
  loop (``--train-step loop``), every step delays every request that arrives during it;
* predictions use a **snapshot** of the model that the training thread replaces every few steps
  (an attribute swap), so a request never reads weights the optimizer is halfway through.

``--loader torch`` runs the same service with torch's DataLoader iterated through
``asyncio.to_thread`` (the usual way to use it from async code), ``--loader none`` serves without
training: both are the baselines of ``examples/service_latency.py``.

SIGTERM or Ctrl-C stop it cleanly: the server stops accepting, the training task is cancelled,
the loader is closed (its worker processes are gone) and the process exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import multiprocessing
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import torch
from aiohttp import web
from torch.utils.data import DataLoader, Dataset

from aioloader import AsyncDataLoader

FEATURES = 16


class Interactions(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Synthetic (features, target) pairs, with ``work_ms`` of CPU per sample.

    The CPU time stands for what a real pipeline spends decoding and augmenting a record; it is
    spent in the worker processes, never in the server.
    """

    def __init__(self, n: int = 100_000, work_ms: float = 0.3) -> None:
        self.n = n
        self.work_s = work_ms / 1000
        g = torch.Generator().manual_seed(0)
        self.true_w = torch.randn(FEATURES, generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(FEATURES, generator=g)
        y = (x @ self.true_w).tanh().unsqueeze(0)
        end = time.perf_counter() + self.work_s
        while time.perf_counter() < end:  # the record's decoding and augmentation
            pass
        return x, y


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    )


class Trainer:
    """The model being fine-tuned, and the snapshot that answers requests."""

    def __init__(self, snapshot_every: int = 10) -> None:
        torch.manual_seed(0)
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.snapshot_every = snapshot_every
        # Two frozen copies: requests read one while the training thread refreshes the other
        # (in-place copies, no allocation), then one assignment swaps them.
        self._copies = [self._frozen(copy.deepcopy(self.model)) for _ in range(2)]
        self.serving: tuple[torch.nn.Module, int] = (self._copies[0], 0)
        self.steps = 0
        self.epochs = 0
        self.loss = float("nan")
        self.first_batch_at: float | None = None
        self.last_step_at: float | None = None

    @staticmethod
    def _frozen(model: torch.nn.Module) -> torch.nn.Module:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    def _publish(self, version: int) -> None:
        idle = self._copies[1] if self.serving[0] is self._copies[0] else self._copies[0]
        with torch.no_grad():
            for dst, src in zip(idle.parameters(), self.model.parameters(), strict=True):
                dst.copy_(src)
        # One attribute assignment: a request sees the old snapshot or the new one.
        self.serving = (idle, version)

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """One optimizer step. Runs on the training thread (or the loop, with --train-step loop)."""
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.loss = float(loss.detach())
        self.steps += 1
        self.last_step_at = time.perf_counter()
        if self.steps % self.snapshot_every == 0:
            self._publish(self.steps)

    async def train_on(self, batch: tuple[torch.Tensor, torch.Tensor], where: str) -> None:
        """Take one batch from either loader: a step on a thread (``where="thread"``), which
        leaves the loop to the requests, or on the loop itself."""
        if self.first_batch_at is None:
            self.first_batch_at = time.perf_counter()
        if where == "thread":
            await asyncio.to_thread(self.step, batch)
        else:
            self.step(batch)

    def predict(self, x: torch.Tensor) -> tuple[float, int]:
        model, version = self.serving
        with torch.no_grad():
            return float(model(x.unsqueeze(0))), version

    def status(self) -> dict[str, Any]:
        rate = 0.0
        if self.first_batch_at is not None and self.last_step_at is not None and self.steps > 1:
            rate = (self.steps - 1) / max(1e-9, self.last_step_at - self.first_batch_at)
        return {
            "steps": self.steps,
            "epochs": self.epochs,
            "loss": self.loss,
            "batches_per_s": rate,
            "version": self.serving[1],
        }


async def train_with_aioloader(
    trainer: Trainer, dataset: Interactions, args: argparse.Namespace
) -> None:
    async with AsyncDataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        # A server has threads (the training step's, the HTTP library's): forking it can copy a
        # lock another thread holds into a worker, which then never starts. forkserver forks
        # from a clean single-threaded server process instead (Python 3.14's default on Linux).
        multiprocessing_context=args.start_method,
    ) as loader:
        while True:
            async for batch in loader:
                await trainer.train_on(batch, args.train_step)
            trainer.epochs += 1


async def train_with_torch(
    trainer: Trainer, dataset: Interactions, args: argparse.Namespace
) -> None:
    """The baseline: torch's DataLoader, each ``next()`` on a thread so the loop stays free."""
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        multiprocessing_context=args.start_method,
    )
    while True:
        it: Iterator[Any] = iter(loader)
        try:
            while (batch := await asyncio.to_thread(next, it, None)) is not None:
                await trainer.train_on(batch, args.train_step)
        finally:
            # Shutting torch's workers down joins processes: not on the loop.
            await asyncio.to_thread(_shutdown_torch_iterator, it)
        trainer.epochs += 1


def _shutdown_torch_iterator(it: Any) -> None:
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def make_app(trainer: Trainer) -> web.Application:
    async def predict(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            x = torch.tensor(body["x"], dtype=torch.float32)
        except (KeyError, TypeError, ValueError):
            raise web.HTTPBadRequest(text=f'expected {{"x": [{FEATURES} numbers]}}') from None
        if x.shape != (FEATURES,):
            raise web.HTTPBadRequest(text=f"x must have {FEATURES} numbers, got {x.numel()}")
        y, version = trainer.predict(x)
        return web.json_response({"y": y, "version": version})

    async def status(request: web.Request) -> web.Response:
        return web.json_response(trainer.status())

    app = web.Application()
    app.router.add_post("/predict", predict)
    app.router.add_get("/status", status)
    return app


async def serve(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the loop, the training thread and the workers share the CPUs
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1000)
    trainer = Trainer()
    runner = web.AppRunner(make_app(trainer), handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    dataset = Interactions(work_ms=args.work_ms)
    training: asyncio.Task[None] | None = None
    if args.loader == "aioloader":
        training = asyncio.create_task(train_with_aioloader(trainer, dataset, args))
    elif args.loader == "torch":
        training = asyncio.create_task(train_with_torch(trainer, dataset, args))
    print(f"serving on http://{args.host}:{port} (training: {args.loader})", flush=True)

    async with _cleanup(runner, training):
        stop_wait = asyncio.create_task(stop.wait())
        waits: set[asyncio.Future[Any]] = {stop_wait}
        if training is not None:
            waits.add(training)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if training is not None and training.done():
            training.result()  # training failed: raise its error (the cleanup still runs)
    left = len(multiprocessing.active_children())
    print(
        f"stopped after {trainer.steps} training steps; worker processes left: {left}", flush=True
    )


@contextlib.asynccontextmanager
async def _cleanup(
    runner: web.AppRunner, training: asyncio.Task[None] | None
) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await runner.cleanup()  # stop accepting; finish the requests in progress
        if training is not None:
            training.cancel()  # ends the epoch; `async with` closes the loader and its workers
            with contextlib.suppress(asyncio.CancelledError):
                await training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    p.add_argument("--loader", choices=["aioloader", "torch", "none"], default="aioloader")
    p.add_argument("--train-step", choices=["thread", "loop"], default="thread")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--start-method", choices=["forkserver", "spawn", "fork"], default="forkserver")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--work-ms", type=float, default=0.3, help="CPU time per sample in a worker")
    p.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval() in ms: how long another thread may hold the GIL while the "
        "loop waits for it (Python's default: 5)",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(serve(parse_args()))
    sys.exit(0)
