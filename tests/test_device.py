"""Tests for the device stage (aioloader/_device.py).

CPU tests always run. A CPU-only torch has no accelerator, so torch's pin helper would never be
called; the ``fake_accelerator`` fixture makes torch report one, and the batches are custom types
whose own ``pin_memory()`` records what happened (no real tensor is pinned in those tests).
CUDA tests are marked ``cuda`` and skip without a GPU.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import torch

from aioloader import _device
from aioloader._device import DeviceStage

PREFIX = "aioloader-device"

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

Pair = collections.namedtuple("Pair", ["left", "right"])


def device_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(PREFIX)]


@dataclasses.dataclass
class Item:
    """A custom batch type; ``pin_memory()`` logs (event, tag, thread name) and can block."""

    tag: int
    log: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)
    gate: threading.Event | None = None
    on_enter: Callable[[], None] | None = None
    error: Exception | None = None
    pinned: bool = False

    def pin_memory(self) -> Item:
        name = threading.current_thread().name
        self.log.append(("enter", self.tag, name))
        if self.on_enter is not None:
            self.on_enter()
        if self.gate is not None and not self.gate.wait(10):
            raise TimeoutError("test gate was never opened")
        if self.error is not None:
            raise self.error
        self.log.append(("done", self.tag, name))
        return dataclasses.replace(self, pinned=True)


@pytest.fixture
def fake_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda")
    )


@pytest.fixture
async def stages() -> AsyncIterator[Callable[..., DeviceStage]]:
    """Factory for stages that are all closed, and checked to leave no thread, at teardown."""
    made: list[DeviceStage] = []

    def make(**kwargs: Any) -> DeviceStage:
        stage = DeviceStage(**kwargs)
        made.append(stage)
        return stage

    yield make
    async with asyncio.timeout(10):
        for stage in made:
            await stage.aclose()
    assert device_threads() == []


@pytest.fixture
def gate(stages: Callable[..., DeviceStage]) -> Iterator[threading.Event]:
    """A gate that blocks ``Item.pin_memory``. It depends on ``stages`` so that it is opened
    (torn down) before the stages are closed: aclose() waits for the batch on the thread."""
    event = threading.Event()
    yield event
    event.set()


def entered_signal() -> tuple[asyncio.Event, Callable[[], None]]:
    """An asyncio.Event and a callback the device thread can call to set it."""
    loop = asyncio.get_running_loop()
    entered = asyncio.Event()
    return entered, lambda: loop.call_soon_threadsafe(entered.set)


# ---------------------------------------------------------------------------------------------
# Configuration: validation, warnings, `active`


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"pin_memory": False, "device": None}, id="nothing"),
        pytest.param({"pin_memory": False, "device": "cpu"}, id="cpu-str"),
        pytest.param({"pin_memory": False, "device": torch.device("cpu", 0)}, id="cpu-device"),
    ],
)
async def test_inactive_stage_passes_batches_through_without_a_thread(
    stages: Callable[..., DeviceStage], kwargs: dict[str, Any]
) -> None:
    stage = stages(**kwargs)
    assert not stage.active
    stage.start()
    item = Item(0)
    async with asyncio.timeout(10):
        assert await stage.process(item) is item
    assert item.log == []
    assert device_threads() == []


@pytest.mark.skipif(torch.accelerator.is_available(), reason="needs a machine with no accelerator")
async def test_pin_without_accelerator_warns_once_and_passes_through(
    stages: Callable[..., DeviceStage],
) -> None:
    with pytest.warns(UserWarning, match="but no accelerator is found") as record:
        stage = stages(pin_memory=True, device=None)
    assert [str(w.message) for w in record] == [
        "'pin_memory' argument is set as true but no accelerator is found, "
        "then device pinned memory won't be used."
    ]
    assert not stage.active
    stage.start()  # no warning again: filterwarnings=error would fail the test
    item = Item(0)
    async with asyncio.timeout(10):
        assert await stage.process(item) is item
    assert item.log == []  # as torch: custom pin_memory() is skipped too
    assert device_threads() == []


@pytest.mark.usefixtures("fake_accelerator")
def test_pin_memory_device_is_deprecated_as_in_torch() -> None:
    with pytest.warns(UserWarning) as record:
        stage = DeviceStage(pin_memory=True, device=None, pin_memory_device="cuda:0")
    assert [str(w.message) for w in record] == [
        "pin_memory_device is deprecated, the current accelerator will be used as the device,"
        "ignore pin_memory_device='cuda:0'."
    ]
    assert stage.active
    # Without pin_memory, torch says nothing about pin_memory_device; neither do we.
    assert not DeviceStage(pin_memory=False, device=None, pin_memory_device="cuda:0").active


def test_mps_accelerator_skips_pinning_as_in_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("mps")
    )
    with pytest.warns(UserWarning, match="not supported on MPS now"):
        stage = DeviceStage(pin_memory=True, device=None)
    assert not stage.active


@pytest.mark.parametrize("device", [0, 1.5, b"cuda", ["cuda"]])
def test_device_of_wrong_type_is_a_type_error(device: object) -> None:
    with pytest.raises(TypeError, match=re.escape("device must be a str, a torch.device or None")):
        DeviceStage(pin_memory=False, device=device)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("bogus", "is not a valid torch device"),
        ("cuda:x", "is not a valid torch device"),
        ("meta", "moves batches only to 'cuda' devices"),
        (torch.device("xpu"), "moves batches only to 'cuda' devices"),
    ],
)
def test_bad_device_value_is_a_value_error(device: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        DeviceStage(pin_memory=False, device=device)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_cuda_says_so(device: object) -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        DeviceStage(pin_memory=True, device=device)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# The thread: pinning, order, errors


@pytest.mark.usefixtures("fake_accelerator")
async def test_pins_on_its_own_named_thread(stages: Callable[..., DeviceStage]) -> None:
    stage = stages(pin_memory=True, device=None)
    assert stage.active
    stage.start()
    stage.start()  # idempotent: still one thread
    threads = device_threads()
    assert len(threads) == 1, "start() creates the thread, before the first batch"
    item = Item(7)
    async with asyncio.timeout(10):
        out = await stage.process(item)
    assert out.pinned and out.tag == 7 and out is not item
    assert item.log == [("enter", 7, threads[0].name), ("done", 7, threads[0].name)]
    assert threads[0].name.startswith(PREFIX)
    assert threads[0] is not threading.current_thread()


@pytest.mark.usefixtures("fake_accelerator")
async def test_pins_inside_containers_and_keeps_their_types(
    stages: Callable[..., DeviceStage],
) -> None:
    stage = stages(pin_memory=True, device=None)
    stage.start()
    batch = {"a": [Item(0), (Item(1), "text")], "b": Pair(Item(2), 3), "c": b"raw"}
    async with asyncio.timeout(10):
        out = await stage.process(batch)
    assert type(out) is dict and type(out["a"]) is list and type(out["a"][1]) is tuple
    assert type(out["b"]) is Pair
    assert [out["a"][0].pinned, out["a"][1][0].pinned, out["b"].left.pinned] == [True] * 3
    assert (out["a"][1][1], out["b"].right, out["c"]) == ("text", 3, b"raw")


@pytest.mark.usefixtures("fake_accelerator")
async def test_concurrent_calls_are_processed_and_returned_in_order(
    stages: Callable[..., DeviceStage],
) -> None:
    stage = stages(pin_memory=True, device=None)
    stage.start()
    log: list[tuple[str, int, str]] = []
    async with asyncio.timeout(10):
        outs = await asyncio.gather(*(stage.process(Item(i, log)) for i in range(200)))
    assert [o.tag for o in outs] == list(range(200))
    assert all(o.pinned for o in outs)
    assert [tag for event, tag, _ in log if event == "enter"] == list(range(200))
    assert len({name for _, _, name in log}) == 1


@pytest.mark.usefixtures("fake_accelerator")
async def test_error_in_custom_pin_memory_keeps_its_type(
    stages: Callable[..., DeviceStage],
) -> None:
    stage = stages(pin_memory=True, device=None)
    stage.start()
    async with asyncio.timeout(10):
        with pytest.raises(KeyError, match="bad sample") as info:
            await stage.process(Item(0, error=KeyError("bad sample")))
        assert any("device stage" in note for note in getattr(info.value, "__notes__", []))
        assert (await stage.process(Item(1))).pinned, "the stage survives a batch's error"


@pytest.mark.usefixtures("fake_accelerator")
async def test_thread_start_failure_surfaces_with_its_cause(
    stages: Callable[..., DeviceStage], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(n: int) -> None:
        raise OSError("no threads for you")

    monkeypatch.setattr(torch, "set_num_threads", broken)
    stage = stages(pin_memory=True, device=None)
    stage.start()
    async with asyncio.timeout(10):
        with pytest.raises(RuntimeError, match="failed to start") as info:
            await stage.process(Item(0))
    assert isinstance(info.value.__cause__, OSError)


@pytest.mark.usefixtures("fake_accelerator")
async def test_misuse_is_reported(stages: Callable[..., DeviceStage]) -> None:
    stage = stages(pin_memory=True, device=None)
    async with asyncio.timeout(10):
        with pytest.raises(RuntimeError, match="call start"):
            await stage.process(Item(0))
        stage.start()
        await stage.aclose()
        with pytest.raises(RuntimeError, match="was closed"):
            await stage.process(Item(1))
    with pytest.raises(RuntimeError, match="was closed"):
        stage.start()


# ---------------------------------------------------------------------------------------------
# Shutdown and cancellation


@pytest.mark.usefixtures("fake_accelerator")
async def test_aclose_is_idempotent_and_leaves_no_thread(
    stages: Callable[..., DeviceStage],
) -> None:
    never_started = stages(pin_memory=True, device=None)
    stage = stages(pin_memory=True, device=None)
    stage.start()
    async with asyncio.timeout(10):
        await never_started.aclose()
        assert (await stage.process(Item(0))).pinned
        assert len(device_threads()) == 1
        await stage.aclose()
        assert device_threads() == []
        await stage.aclose()
        await never_started.aclose()
    assert device_threads() == []


@pytest.mark.usefixtures("fake_accelerator")
async def test_aclose_waits_off_the_loop_and_cancels_queued_batches(
    stages: Callable[..., DeviceStage], gate: threading.Event
) -> None:
    stage = stages(pin_memory=True, device=None)
    stage.start()
    entered, signal = entered_signal()
    log: list[tuple[str, int, str]] = []
    async with asyncio.timeout(10):
        running = asyncio.create_task(stage.process(Item(0, log, gate=gate, on_enter=signal)))
        queued = asyncio.create_task(stage.process(Item(1, log)))
        await entered.wait()
        closing = asyncio.create_task(stage.aclose())
        await asyncio.wait([queued])  # cancelled by aclose() while the thread is still busy
        ticks = 0
        for _ in range(5):  # the loop keeps running while aclose() waits for the thread
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 5 and not closing.done() and len(device_threads()) == 1
        gate.set()
        await closing
        assert (await running).pinned, "the batch on the thread is finished"
        with pytest.raises(asyncio.CancelledError):
            await queued
    assert [tag for event, tag, _ in log if event == "enter"] == [0]
    assert device_threads() == []


@pytest.mark.usefixtures("fake_accelerator")
async def test_interrupted_aclose_is_finished_by_the_next(
    stages: Callable[..., DeviceStage], gate: threading.Event
) -> None:
    stage = stages(pin_memory=True, device=None)
    stage.start()
    entered, signal = entered_signal()
    async with asyncio.timeout(10):
        running = asyncio.create_task(stage.process(Item(0, gate=gate, on_enter=signal)))
        await entered.wait()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await stage.aclose()
        assert len(device_threads()) == 1
        gate.set()
        await stage.aclose()
        assert device_threads() == []
        assert (await running).pinned


@pytest.mark.usefixtures("fake_accelerator")
async def test_cancelling_a_running_batch_lets_the_thread_finish_it(
    stages: Callable[..., DeviceStage], gate: threading.Event
) -> None:
    stage = stages(pin_memory=True, device=None)
    stage.start()
    entered, signal = entered_signal()
    log: list[tuple[str, int, str]] = []
    async with asyncio.timeout(10):
        first = asyncio.create_task(stage.process(Item(0, log, gate=gate, on_enter=signal)))
        second = asyncio.create_task(stage.process(Item(1, log)))
        await entered.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first  # returns at once, while the thread is still inside pin_memory()
        assert log == [("enter", 0, log[0][2])]
        gate.set()
        assert (await second).tag == 1
    assert [(event, tag) for event, tag, _ in log] == [
        ("enter", 0),
        ("done", 0),
        ("enter", 1),
        ("done", 1),
    ]


@pytest.mark.usefixtures("fake_accelerator")
async def test_cancelling_a_queued_batch_means_it_never_runs(
    stages: Callable[..., DeviceStage], gate: threading.Event
) -> None:
    stage = stages(pin_memory=True, device=None)
    stage.start()
    entered, signal = entered_signal()
    log: list[tuple[str, int, str]] = []
    async with asyncio.timeout(10):
        first = asyncio.create_task(stage.process(Item(0, log, gate=gate, on_enter=signal)))
        second = asyncio.create_task(stage.process(Item(1, log)))
        third = asyncio.create_task(stage.process(Item(2, log)))
        await entered.wait()
        second.cancel()
        # Task.cancel() cancels the executor's future one loop iteration later; by the time the
        # task is done it has, so opening the gate only now makes the test deterministic.
        await asyncio.wait([second])
        gate.set()
        assert [(await first).tag, (await third).tag] == [0, 2]
        assert second.cancelled()
    assert [tag for event, tag, _ in log if event == "enter"] == [0, 2]


# ---------------------------------------------------------------------------------------------
# CUDA

# torch.cuda._sleep spins for this many GPU clock cycles: ~0.3-0.7 s on current GPUs, long
# enough that a 16 MB copy (about a millisecond) cannot be mistaken for overlapping it.
SLOW_KERNEL_CYCLES = 1_000_000_000


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("pin_memory", [True, False])
async def test_cuda_values_equal_the_cpu_batch_and_were_pinned_first(
    stages: Callable[..., DeviceStage], monkeypatch: pytest.MonkeyPatch, pin_memory: bool
) -> None:
    pinned_flags: list[bool] = []
    real_pin = _device._pin_memory

    def recording_pin(data: Any, device_type: str | None) -> Any:
        out = real_pin(data, device_type)
        pinned_flags.extend([out["x"].is_pinned(), out["nested"][1][0].is_pinned()])
        return out

    monkeypatch.setattr(_device, "_pin_memory", recording_pin)
    batch = {
        "x": torch.randn(64, 3, 32, 32),
        "nested": ["label", (torch.arange(64), 5)],
        "pair": Pair(torch.zeros(2), torch.full((4,), 3.0)),
    }
    stage = stages(pin_memory=pin_memory, device="cuda")  # cuda implies pinning
    assert stage.active
    stage.start()
    async with asyncio.timeout(10):
        out = await stage.process(batch)
    assert pinned_flags == [True, True]
    assert type(out) is dict and type(out["nested"][1]) is tuple and type(out["pair"]) is Pair
    assert out["nested"][0] == "label" and out["nested"][1][1] == 5
    for got, want in [
        (out["x"], batch["x"]),
        (out["nested"][1][0], batch["nested"][1][0]),
        (out["pair"].left, batch["pair"].left),
        (out["pair"].right, batch["pair"].right),
    ]:
        assert got.device.type == "cuda"
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@pytest.mark.cuda
@requires_cuda
def test_cuda_index_out_of_range_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        DeviceStage(pin_memory=True, device=f"cuda:{torch.cuda.device_count()}")


@pytest.mark.cuda
@requires_cuda
async def test_cuda_copy_overlaps_a_slow_consumer_kernel(
    stages: Callable[..., DeviceStage],
) -> None:
    stage = stages(pin_memory=True, device="cuda")
    stage.start()
    consumer = torch.cuda.current_stream()
    batch = torch.randn(4 * 1024 * 1024)
    async with asyncio.timeout(10):
        await stage.process(batch)  # warm-up: side stream, allocator, pinned pool
        await asyncio.to_thread(torch.cuda.synchronize)
        compute_done = torch.cuda.Event()
        torch.cuda._sleep(SLOW_KERNEL_CYCLES)  # the consumer's step on the previous batch
        compute_done.record(consumer)
        out = await stage.process(batch)  # the next batch's copy, on the side stream
        copy_done = torch.cuda.Event()
        copy_done.record(stage._side_stream)  # after the copy: nothing else is on that stream
        await asyncio.to_thread(copy_done.synchronize)
        assert not compute_done.query(), "the copy waited for the consumer kernel: no overlap"
        await asyncio.to_thread(compute_done.synchronize)
    torch.testing.assert_close(out.cpu(), batch, rtol=0, atol=0)


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("consumer_kind", ["default", "user-stream"])
async def test_cuda_consumer_stream_waits_for_the_copy(
    stages: Callable[..., DeviceStage], consumer_kind: str
) -> None:
    consumer = torch.cuda.current_stream() if consumer_kind == "default" else torch.cuda.Stream()
    stage = stages(pin_memory=True, device="cuda")
    before = torch.cuda.current_stream()
    with torch.cuda.stream(consumer):  # the stream current when the loader starts is the consumer
        stage.start()
    batch = torch.randn(4 * 1024 * 1024)
    async with asyncio.timeout(10):
        warm = await stage.process(batch)  # warm-up creates the side stream
        with torch.cuda.stream(consumer):
            # CUDA loads a kernel's module lazily at its first launch, and that load waits for
            # the whole device: launch the consumer's kernel once before the timed part.
            warm * 2
        await asyncio.to_thread(torch.cuda.synchronize)
        side = stage._side_stream
        assert side is not None
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLOW_KERNEL_CYCLES)  # the next copy queues behind this
        out = await stage.process(batch)
        # The device thread makes the side stream its current one; this thread's stays its own.
        assert torch.cuda.current_stream() == before
        copy_done = torch.cuda.Event()
        copy_done.record(side)
        with torch.cuda.stream(consumer):
            doubled = out * 2  # must not run before the copy
            used = torch.cuda.Event()
            used.record(consumer)
        assert not copy_done.query(), "the slow kernel should still hold the copy back"
        await asyncio.to_thread(used.synchronize)
        assert copy_done.query(), "the consumer ran before the copy had finished"
    torch.testing.assert_close(doubled.cpu(), batch * 2, rtol=0, atol=0)


@pytest.mark.cuda
@requires_cuda
async def test_cuda_no_corruption_when_the_consumer_frees_batches_at_once(
    stages: Callable[..., DeviceStage],
) -> None:
    # Each batch is freed right after a *queued* read. Without record_stream the allocator gives
    # its block to the next copy on the side stream, which overwrites it before the read runs.
    stage = stages(pin_memory=True, device="cuda")
    stage.start()
    n = 4 * 1024 * 1024
    seen = []
    async with asyncio.timeout(10):
        for i in range(20):
            out = await stage.process(torch.full((n,), float(i)))
            torch.cuda._sleep(SLOW_KERNEL_CYCLES // 20)  # keep the consumer stream behind
            seen.append(torch.stack([out.min(), out.max()]))
            del out
        got = await asyncio.to_thread(lambda: torch.stack(seen).cpu())
    want = torch.arange(20, dtype=torch.float32).repeat_interleave(2).view(20, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.usefixtures("fake_accelerator")
async def test_the_device_threads_count_does_not_become_every_later_threads(
    stages: Callable[..., DeviceStage],
) -> None:
    """torch.set_num_threads on the device thread is also the count threads started later begin
    with: a training step run through asyncio.to_thread afterwards must keep the process's."""
    before = torch.get_num_threads()
    assert before > 1, "needs a machine where torch uses more than one thread"
    seen: dict[str, int] = {}

    @dataclasses.dataclass
    class Probe(Item):
        def pin_memory(self) -> Item:
            seen["device thread"] = torch.get_num_threads()
            return super().pin_memory()

    stage = stages(pin_memory=True, device=None)  # pins with one thread, as torch's
    stage.start()
    async with asyncio.timeout(10):
        await stage.process(Probe(1))
        # A thread started after the device thread set its own count, as to_thread's may be.
        seen["later thread"] = await asyncio.to_thread(_count_on_a_new_thread)
    assert seen == {"device thread": 1, "later thread": before}
    assert torch.get_num_threads() == before


def _count_on_a_new_thread() -> int:
    out: list[int] = []
    thread = threading.Thread(target=lambda: out.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return out[0]
