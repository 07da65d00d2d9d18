"""Samples of a window still filling go ahead to its worker, so its transform runs meanwhile.

A paced source keeps a window waiting; whatever it holds by then is sent to the worker the window
is pinned to (or the loading thread with ``num_workers=0``) and transformed there while the rest
arrives. The window's task still carries every sample, so a worker that lost those results (a
replacement after a crash) transforms them all again.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader
from tests import stream_sources as ss
from tests.conftest import collect

N, BATCH, GAP = 12, 4, 0.03


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_a_filling_window_is_transformed_before_it_closes(num_workers: int) -> None:
    src = ss.Slow(N, GAP)
    async with AsyncDataLoader(
        src, batch_size=BATCH, num_workers=num_workers, transform=ss.stamped
    ) as loader:
        got: list[Any] = await collect(loader)
    assert [b["x"].flatten().tolist() for b in got] == [
        list(range(i, i + BATCH)) for i in range(0, N, BATCH)
    ]
    for k, batch in enumerate(got):
        last_produced = src.produced[k * BATCH + BATCH - 1]
        # The window's first sample was transformed while its last one was not produced yet.
        assert float(batch["at"][0]) < last_produced, (k, batch["at"].tolist(), last_produced)
        if num_workers:
            assert len({int(p) for p in batch["pid"]}) == 1  # one worker did the whole window
            assert int(batch["pid"][0]) != os.getpid()


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_an_error_of_a_sample_sent_ahead_is_raised_at_its_batch(num_workers: int) -> None:
    async with AsyncDataLoader(
        ss.Slow(N, GAP),
        batch_size=BATCH,
        num_workers=num_workers,
        transform=ss.FailAt(5, ValueError("bad sample 5")),
    ) as loader:
        it = aiter(loader)
        async with asyncio.timeout(30):
            first = await anext(it)
            with pytest.raises(ValueError, match="bad sample 5"):
                await anext(it)
            rest = [b async for b in it]
    assert first.flatten().tolist() == [0, 1, 2, 3]
    assert [b.flatten().tolist() for b in rest] == [[8, 9, 10, 11]]


async def test_a_base_exception_of_a_sample_sent_ahead_is_an_error_at_its_batch() -> None:
    # SystemExit from a transform run ahead must not end the worker or the consumer's loop.
    async with AsyncDataLoader(
        ss.Slow(N, GAP), batch_size=BATCH, num_workers=2, transform=ss.FailAt(6, SystemExit(3))
    ) as loader:
        it = aiter(loader)
        async with asyncio.timeout(30):
            await anext(it)
            with pytest.raises(Exception, match="SystemExit"):
                await anext(it)
            rest = [b.flatten().tolist() async for b in it]
        assert loader.stats().worker_restarts == 0
    assert rest == [[8, 9, 10, 11]]


async def test_a_worker_killed_by_a_sample_sent_ahead_is_replaced_and_nothing_is_lost(
    tmp_path: Any,
) -> None:
    # Sample 5 is transformed ahead, before its window is submitted: the worker dies holding no
    # task. Its replacement gets the whole window and transforms every sample again.
    src = ss.Slow(N, GAP)
    async with AsyncDataLoader(
        src,
        batch_size=BATCH,
        num_workers=2,
        transform=ss.KillOnce(5, str(tmp_path / "killed")),
    ) as loader:
        with pytest.warns(RuntimeWarning, match="restarting"):
            got = [b.flatten().tolist() for b in await collect(loader)]
        assert loader.stats().worker_restarts == 1
    assert got == [list(range(i, i + BATCH)) for i in range(0, N, BATCH)]
    assert (tmp_path / "killed").exists()


async def test_batch_seeding_transforms_each_window_under_its_seed() -> None:
    # seeding="batch": nothing runs ahead, so a random transform gives the same batches for any
    # pacing and any number of workers.
    runs = []
    for num_workers in (0, 2):
        async with AsyncDataLoader(
            ss.Slow(8, 0.01),
            batch_size=BATCH,
            num_workers=num_workers,
            transform=ss.noisy,
            seeding="batch",
            generator=torch.Generator().manual_seed(7),
        ) as loader:
            runs.append(torch.cat(await collect(loader)))  # type: ignore[arg-type]
    assert torch.equal(runs[0], runs[1])
