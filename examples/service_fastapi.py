"""The prediction service of examples/service.py on FastAPI and uvicorn: it fine-tunes its model
while it serves, with the loader and the training task owned by the app's lifespan.

Run: python examples/service_fastapi.py [--port 8080] [--workers 2] [--start-method forkserver]

Needs the ``service`` extra (``pip install "aioloader[service]"``). Same endpoints as
examples/service.py (``POST /predict`` with ``{"x": [16 floats]}``, ``GET /status``).

The pattern, for any ASGI framework with a lifespan:

* the **lifespan** opens the loader (``async with``) and creates the training task; on shutdown
  it cancels the task, which ends the epoch, and leaving ``async with`` closes the loader: its
  worker processes are gone before uvicorn exits. A SIGTERM while the workers are still starting
  ends the same way;
* the **training step on a thread** (``asyncio.to_thread``), so the loop answers requests while
  torch computes;
* the **handlers are ``async def``**: FastAPI runs plain ``def`` handlers on its thread pool,
  which adds a thread hop per request and more GIL contention with the training thread.

uvicorn handles SIGTERM and Ctrl-C itself: it stops accepting, finishes the requests in
progress, runs the lifespan's shutdown, and then (uvicorn 0.29 and later) re-raises the signal,
so the process ends with the signal's status, as a process manager expects.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel

# The model, the synthetic dataset and the snapshot logic are the aiohttp example's.
from service import FEATURES, Interactions, Trainer

from aioloader import AsyncDataLoader


class Features(BaseModel):
    x: list[float]


async def train(loader: AsyncDataLoader[Any], trainer: Trainer) -> None:
    while True:
        async for batch in loader:
            await trainer.train_on(batch, "thread")
        trainer.epochs += 1


def make_app(args: argparse.Namespace) -> FastAPI:
    trainer = Trainer()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        dataset = Interactions(work_ms=args.work_ms)
        # forkserver: uvicorn's process has threads (the training step's, the thread pool's);
        # forking it could copy a lock another thread holds into a worker.
        async with AsyncDataLoader(
            dataset,
            batch_size=args.batch_size,
            shuffle=True,
            num_workers=args.workers,
            multiprocessing_context=args.start_method,
        ) as loader:
            training = None
            if args.training:
                training = asyncio.create_task(train(loader, trainer))
                print("training started", flush=True)  # the workers are starting from here on
            try:
                yield
            finally:
                if training is not None:
                    training.cancel()  # ends the epoch, even while the workers are starting
                    with contextlib.suppress(asyncio.CancelledError):
                        await training
        left = len(multiprocessing.active_children())
        print(
            f"stopped after {trainer.steps} training steps; worker processes left: {left}",
            flush=True,
        )

    app = FastAPI(lifespan=lifespan)

    @app.post("/predict")
    async def predict(body: Features) -> dict[str, Any]:
        if len(body.x) != FEATURES:
            raise HTTPException(400, f"x must have {FEATURES} numbers, got {len(body.x)}")
        y, version = trainer.predict(torch.tensor(body.x, dtype=torch.float32))
        return {"y": y, "version": version}

    @app.get("/status")
    async def status() -> dict[str, Any]:
        return trainer.status()

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--start-method", choices=["forkserver", "spawn", "fork"], default="forkserver")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--work-ms", type=float, default=0.3, help="CPU time per sample in a worker")
    p.add_argument(
        "--no-training", dest="training", action="store_false", help="serve only (a baseline)"
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the loop, the training thread and the workers share the CPUs
    # Bind first, so that the port is known (and printed) before uvicorn starts.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    print(f"serving on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(make_app(args), log_level="warning", lifespan="on"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
    sys.exit(0)
