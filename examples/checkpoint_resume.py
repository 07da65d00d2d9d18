"""Checkpoint a training run mid-epoch and resume it: kill it at any moment (SIGKILL, preemption),
run the same command again, and it goes on with exactly the batches, augmentations included, that
the uninterrupted run would have trained on.

Run: python examples/checkpoint_resume.py --ckpt /tmp/run.pt [--epochs 3] [--save-every 8]

One checkpoint file holds the model, the optimizer and the loader's position, written with
``torch.save`` (atomically: a temporary file, then ``os.replace``) every ``--save-every`` steps
and at the end of each epoch. On start, if the file exists, everything is loaded back and
``loader.state_dict()["epoch"]`` says which epoch to go on with. Steps trained after the last
checkpoint are trained again after a resume, from the same batches, so the final model is the
uninterrupted run's, bit for bit (``tests/test_examples.py`` kills it and checks).

Reproducible to the bit needs: a ``generator`` for the shuffle, ``seeding="batch"`` for the
random augmentations (each batch's seed comes from its position, not from a worker's history),
and deterministic training code (here: one CPU thread).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any, TextIO

import torch
from torch.utils.data import Dataset

from aioloader import AsyncDataLoader


class Noisy(Dataset[dict[str, torch.Tensor]]):
    """``y = 2x - 1`` with a random augmentation of ``x`` drawn in the worker."""

    def __init__(self, n: int = 1024) -> None:
        self.x = torch.linspace(-1, 1, n).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.x[i] + 0.01 * torch.randn(1)  # the augmentation: seeded per batch
        return {"index": torch.tensor(i), "x": x, "y": 2 * self.x[i] - 1}


def save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, loader: Any) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": loader.state_dict()},
        tmp,
    )
    os.replace(tmp, path)  # a kill mid-write leaves the previous checkpoint whole


def restore(
    args: argparse.Namespace,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, AsyncDataLoader[Any]]:
    """The model, the optimizer and the loader, from the checkpoint if there is one."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = AsyncDataLoader(
        Noisy(),
        batch_size=32,
        shuffle=True,
        num_workers=2,
        generator=torch.Generator().manual_seed(0),
        seeding="batch",
    )
    if Path(args.ckpt).exists():
        ckpt = torch.load(args.ckpt, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])  # before the next `async for`
    return model, opt, loader


async def train(
    args: argparse.Namespace,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    loader: AsyncDataLoader[Any],
    log: TextIO | None,
) -> None:
    # Where to go on: the epoch the saved position is in (0 for a fresh start; the next epoch
    # for a state saved at an epoch's end), and how many of its batches were trained on.
    state = loader.state_dict()
    start_epoch, step = state["epoch"], state["batches_delivered"]
    print(f"starting at epoch {start_epoch}, batch {step}", flush=True)
    ckpt_path = Path(args.ckpt)
    async with loader:
        for epoch in range(start_epoch, args.epochs):
            async for batch in loader:
                loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
                if log is not None:  # what was trained, for tests/test_checkpoint_example.py
                    log.write(f"{epoch} {step} {batch['index'].tolist()}\n")
                    log.flush()
                if step % args.save_every == 0:
                    # On the loop, on purpose: the checkpoint must be of this very step, so
                    # training waits for it (nothing else runs on this script's loop).
                    save(ckpt_path, model, opt, loader)
            save(ckpt_path, model, opt, loader)  # the state now points at the next epoch
            print(f"epoch {epoch}: loss {loss.item():.5f}", flush=True)
            step = 0
    w, b = model.weight.item(), model.bias.item()
    print(f"done: y = {w:.4f} x + {b:.4f} (true 2x - 1); weights {w!r} {b!r}", flush=True)


def main(args: argparse.Namespace) -> None:
    model, opt, loader = restore(args)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(args.log, "a")) if args.log else None
        asyncio.run(train(args, model, opt, loader, log))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="the checkpoint file (resumed if it exists)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=8, help="steps between checkpoints")
    parser.add_argument("--log", help="append each trained batch's indices to this file")
    main(parser.parse_args())
