"""Progress bars: tqdm gets the epoch's length, and the data-stall fraction fits its postfix."""

from __future__ import annotations

import asyncio
import io

import pytest
import tqdm
import tqdm.asyncio

from aioloader import AsyncDataLoader
from tests import datasets


@pytest.fixture(autouse=True)
def _no_tqdm_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """tqdm's monitor thread lives on after the bar; the leak check would count it."""
    monkeypatch.setattr(tqdm.std.tqdm, "monitor_interval", 0)


async def test_tqdm_asyncio_shows_the_epoch_with_the_right_total() -> None:
    out = io.StringIO()
    async with AsyncDataLoader(datasets.RangeDataset(10), batch_size=3, num_workers=2) as loader:
        async with asyncio.timeout(60):
            # The one-liner of docs/index.md: the data-stall fraction in the bar's postfix.
            async for _ in (bar := tqdm.asyncio.tqdm(loader, file=out, mininterval=0)):
                bar.set_postfix(stall=f"{loader.stats().data_stall_fraction:.0%}")
    assert bar.total == len(loader) == 4
    assert bar.n == 4
    text = out.getvalue()
    assert "4/4" in text
    assert "stall=" in text and "%" in bar.postfix  # type: ignore[operator]


async def test_tqdm_asyncio_break_ends_the_epoch() -> None:
    out = io.StringIO()
    async with AsyncDataLoader(datasets.RangeDataset(10), batch_size=2, num_workers=1) as loader:
        async with asyncio.timeout(60):
            async for batch in tqdm.asyncio.tqdm(loader, file=out):
                assert batch.flatten().tolist() == [0, 1]
                break
            got = [b.flatten().tolist() async for b in loader]  # a fresh epoch
    assert got[0] == [0, 1] and len(got) == 5


def test_tqdm_over_the_sync_bridge_has_the_right_total() -> None:
    out = io.StringIO()
    with AsyncDataLoader(datasets.RangeDataset(7), batch_size=2, drop_last=True).sync() as loader:
        bar = tqdm.tqdm(loader, file=out, mininterval=0)
        assert bar.total == 3
        assert sum(len(b) for b in bar) == 6
    assert "3/3" in out.getvalue()
