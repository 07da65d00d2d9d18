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

from aioloader import AsyncDataLoader, PoisonBatchError, _looplane
from aioloader._epoch import Epoch
from tests import stream_sources as ss
from tests.conftest import collect

N, BATCH, GAP = 12, 4, 0.03


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_a_filling_window_is_transformed_before_it_closes(
    num_workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What goes ahead to the worker; a cheap transform of a paced source may instead take the
    # loop lane (tests/test_loop_lane.py).
    monkeypatch.setattr(_looplane.LoopLane, "usable", lambda self, idle: False)
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


@pytest.mark.parametrize("restarts", [1, 3])
async def test_a_sample_that_kills_its_worker_ahead_and_again_is_a_poison_batch(
    restarts: int,
) -> None:
    # The first death happens while sample 5 is transformed ahead, before its window is a task:
    # it still counts against that window, so the window's own task killing the replacement
    # makes it a poison batch, as when no sample goes ahead (not a second restart).
    # Samples 0.15 s apart: the death must be seen before the window closes, two gaps after
    # sample 5 (with GAP, a loop stalled by a loaded machine saw it after the window had gone
    # out as a task, and blamed the task).
    async with AsyncDataLoader(
        ss.Slow(N, 0.15),
        batch_size=BATCH,
        num_workers=2,
        transform=ss.KillAlways(5),
        max_worker_restarts=restarts,
    ) as loader:
        it = aiter(loader)
        async with asyncio.timeout(60):
            assert (await anext(it)).flatten().tolist() == [0, 1, 2, 3]
            with (
                pytest.warns(RuntimeWarning, match="transforming ahead batch send_idx=1") as warned,
                pytest.raises(PoisonBatchError, match="send_idx=1") as info,
            ):
                await anext(it)
        assert loader.stats().worker_restarts == 1
    assert len(warned) == 1
    assert len(info.value.indices) == BATCH  # type: ignore[arg-type]


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_a_fast_source_that_yields_control_per_sample_sends_little_ahead(
    num_workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its buffer runs dry at every sample, but the next one is there at once: a post per sample
    # would halve the rate. Only a source that kept the window waiting gets samples sent ahead.
    sent: list[int] = []
    prefeed = Epoch.prefeed

    def counting(self: Epoch, send_idx: int, worker_id: int | None, samples: Any) -> bool:
        ok = prefeed(self, send_idx, worker_id, samples)
        if ok:
            sent.append(len(samples))
        return ok

    monkeypatch.setattr(Epoch, "prefeed", counting)
    n = 2000
    async with AsyncDataLoader(
        ss.Yielding(n), batch_size=64, num_workers=num_workers, transform=ss.stamped
    ) as loader:
        got: list[Any] = await collect(loader)
    assert torch.cat([b["x"] for b in got]).flatten().tolist() == list(range(n))
    # A stall of the loop (a loaded machine) may make one wait look long; a post per sample
    # would be n of them.
    assert len(sent) < n // 10, len(sent)
