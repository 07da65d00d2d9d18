"""The device stage wired into the loader (CPU: a fake accelerator makes pinning observable)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader
from tests import datasets
from tests.conftest import collect


@pytest.fixture
def fake_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda")
    )


def _stage_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("aioloader-device")]


@pytest.mark.usefixtures("fake_accelerator")
@pytest.mark.parametrize("num_workers", [0, 2])
async def test_batches_are_pinned_on_the_device_thread_in_order(num_workers: int) -> None:
    async with AsyncDataLoader(
        datasets.RangeDataset(30),
        batch_size=4,
        num_workers=num_workers,
        pin_memory=True,
        collate_fn=datasets.pinned_batch_collate,
    ) as loader:
        got = await collect(loader)
        assert not _stage_threads()  # the stage ends with its epoch
    assert [b.values for b in got] == [list(range(i, min(i + 4, 30))) for i in range(0, 30, 4)]
    assert {b.pinned_by for b in got} == {"aioloader-device_0"}


@pytest.mark.usefixtures("fake_accelerator")
async def test_pin_error_keeps_its_type_and_the_epoch_goes_on() -> None:
    class WithBad(datasets.RangeDataset):
        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.tensor(-1 if i == 5 else i)

    async with AsyncDataLoader(
        WithBad(12), batch_size=4, pin_memory=True, collate_fn=datasets.pinned_batch_collate
    ) as loader:
        it = aiter(loader)
        out: list[Any] = []
        async with asyncio.timeout(30):
            for _ in range(3):
                try:
                    out.append((await anext(it)).values)
                except ArithmeticError as exc:
                    assert "device stage" in "".join(exc.__notes__)
                    out.append("error")
    assert out == [[0, 1, 2, 3], "error", [8, 9, 10, 11]]


@pytest.mark.usefixtures("fake_accelerator")
@pytest.mark.parametrize("how", ["break", "cancel"])
async def test_break_and_cancel_stop_the_device_thread(how: str) -> None:
    loader = AsyncDataLoader(
        datasets.SlowDataset(100, 0.002),
        batch_size=2,
        num_workers=2,
        pin_memory=True,
        collate_fn=datasets.pinned_batch_collate,
        device_prefetch=3,
    )
    async with loader:
        if how == "break":
            async with asyncio.timeout(30):
                async for _ in loader:
                    assert _stage_threads()
                    break
        else:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in loader:
                    started.set()

            task = asyncio.create_task(consume())
            async with asyncio.timeout(30):
                await started.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
    assert not _stage_threads()


@pytest.mark.usefixtures("fake_accelerator")
@pytest.mark.parametrize("num_workers", [0, 2])
async def test_the_next_batch_is_queued_on_the_device_thread_before_this_one_is_done(
    num_workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch k+1 reaches the device thread while batch k is pinned there, so the thread goes
    from one to the next with no round trip through the event loop in between."""
    from aioloader import _device

    total = 8
    submitted = 0
    cond = threading.Condition()
    ahead: list[bool] = []  # per batch pinned: was the next one submitted meanwhile?
    submit = _device.DeviceStage.submit

    def counting_submit(self: _device.DeviceStage, batch: Any) -> Any:
        nonlocal submitted
        pending = submit(self, batch)
        with cond:
            submitted += 1
            cond.notify_all()
        return pending

    def waiting_pin(batch: Any, device_type: str | None) -> Any:
        k = len(ahead)
        with cond:  # bounded: without the look-ahead this waits out its timeout
            ahead.append(cond.wait_for(lambda: submitted >= min(k + 2, total), timeout=3))
        return batch

    monkeypatch.setattr(_device.DeviceStage, "submit", counting_submit)
    monkeypatch.setattr(_device, "_pin_memory", waiting_pin)
    async with AsyncDataLoader(
        datasets.RangeDataset(total * 2), batch_size=2, num_workers=num_workers, pin_memory=True
    ) as loader:
        got = await collect(loader)
    assert [b.flatten().tolist() for b in got] == [[2 * k, 2 * k + 1] for k in range(total)]
    assert ahead == [True] * total


def test_device_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match="device_prefetch"):
        AsyncDataLoader(datasets.RangeDataset(2), device_prefetch=0)
    with pytest.raises(TypeError, match="device must be"):
        AsyncDataLoader(datasets.RangeDataset(2), device=3)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            AsyncDataLoader(datasets.RangeDataset(2), device="cuda")


async def test_cpu_device_is_a_pass_through() -> None:
    async with AsyncDataLoader(datasets.RangeDataset(8), batch_size=4, device="cpu") as loader:
        got = await collect(loader)
        assert not _stage_threads()
    assert [b.flatten().tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_batches_arrive_on_the_device_with_the_right_values() -> None:
    ds = datasets.BigDataset(16, (3, 32, 32))
    async with AsyncDataLoader(ds, batch_size=4, num_workers=2, device="cuda") as loader:
        got = await collect(loader)
    assert all(b.is_cuda for b in got)
    expected = list(torch.utils.data.DataLoader(ds, batch_size=4))
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g.cpu(), e)
