"""Batches of Python objects travel in pieces, rebuilt on the loop a bounded step at a time."""

from __future__ import annotations

import asyncio
import io
import itertools
import pickle
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from torch.utils.data import Dataset

from aioloader import AsyncDataLoader, _channel, _codec
from tests import datasets
from tests.conftest import collect, torch_batches


class TextDataset(Dataset[list[str]]):
    """Sample ``i``: 2 000 short strings (a tokenised document)."""

    def __init__(self, n: int, strings: int = 2000) -> None:
        self.n = n
        self.strings = strings

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[str]:
        return [f"w{i}-{j}" for j in range(self.strings)]


class TextAndTensorDataset(TextDataset):
    """A dict per sample: strings, a label and a tensor large enough for shared memory."""

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        return {
            "text": super().__getitem__(i),
            "label": i,
            "emb": torch.full((300, 300), float(i)),  # 360 KiB: through shared memory
        }


def keep_list(batch: list[Any]) -> list[Any]:
    return batch


class Pairs(NamedTuple):
    left: list[str]
    right: list[str]


def _count(obj: Any) -> int:
    """The objects a piece holds (containers looked into)."""
    if type(obj) in (list, tuple):
        return 1 + sum(_count(x) for x in obj)
    if type(obj) is dict:
        return 1 + sum(1 + _count(v) for v in obj.values())
    return 1


def _pieces(data: bytes) -> list[Any]:
    """The pieces of a result in pieces, as one unpickler loads them (the skeleton last)."""
    assert _codec.in_pieces(data)
    header = _codec._PIECES_HEADER
    _, loads = header.unpack_from(data)
    unpickler = pickle.Unpickler(io.BytesIO(data[header.size :]))
    return [unpickler.load() for _ in range(loads)]


def _text_batch(n: int = 32, strings: int = 2000) -> list[list[str]]:
    ds = TextDataset(n, strings)
    return [ds[i] for i in range(n)]


@pytest.fixture
def channel() -> Iterator[_channel.FdChannel]:
    with datasets.playing_worker(pool=False) as ch:
        yield ch


def test_an_object_batch_travels_in_pieces_of_bounded_size() -> None:
    batch = _text_batch()
    data = _codec.dumps_result(batch)
    pieces = _pieces(data)
    assert len(pieces) > 16  # 64 000 strings: far more than one piece
    bound = 2 * _codec.PIECE_OBJECTS
    for piece in pieces[:-1]:
        assert _count(piece) <= bound
    assert pieces[-1] == batch  # the skeleton rebuilds the batch from the pieces


@pytest.mark.parametrize(
    "batch",
    [
        torch.zeros(32, 3, 8, 8),
        {"x": torch.zeros(32, 16), "y": torch.arange(32)},
        [torch.zeros(32, 16), torch.arange(32)],
        (torch.zeros(32, 16), [f"label{i}" for i in range(32)]),
        [f"short text {i}" for i in range(32)],
    ],
    ids=["tensor", "dict", "list", "tensor-and-labels", "32-strings"],
)
def test_tensor_and_small_batches_stay_one_pickle(batch: Any) -> None:
    data = _codec.dumps_result(batch)
    assert not _codec.in_pieces(data)
    assert data[:1] == pickle.PROTO
    decoder = _codec.PieceDecoder(data)
    assert decoder.step(0.0)  # complete in one step
    assert decoder.loads == 1


def test_a_step_with_no_time_left_loads_one_piece() -> None:
    data = _codec.dumps_result(_text_batch())
    decoder = _codec.PieceDecoder(data)
    steps = 0
    while not decoder.step(0.0):
        steps += 1
        assert decoder.loads == steps
    assert decoder.loads == len(_pieces(data))
    assert decoder.value == _text_batch()


def test_pieces_rebuild_types_order_and_shared_objects() -> None:
    shared = [f"s{i}" for i in range(5000)]
    sample = {"text": [f"t{i}" for i in range(3000)], "ids": tuple(range(3000)), "n": 1}
    batch = {
        "rows": [dict(sample, k=i) for i in range(8)],
        "twice": [shared, shared],
        "tuple": tuple(f"x{i}" for i in range(9000)),
        "pairs": Pairs(shared, shared),
        "tagged": datasets.TaggedList(shared),
        "nested": [[[f"{i}-{j}" for j in range(3000)] for i in range(3)]],
    }
    out = _codec.loads_result(_codec.dumps_result(batch))
    assert out == batch
    assert list(out) == list(batch)
    assert type(out["tuple"]) is tuple and type(out["rows"][0]["ids"]) is tuple
    assert type(out["pairs"]) is Pairs and type(out["tagged"]) is datasets.TaggedList
    assert out["twice"][0] is out["twice"][1]  # one object sent twice is one object again
    assert out["pairs"].left is out["pairs"].right


def test_shared_memory_tensors_arrive_across_steps(channel: _channel.FdChannel) -> None:
    ds = TextAndTensorDataset(8)
    batch = [ds[i] for i in range(8)]
    decoder = _codec.PieceDecoder(_codec.dumps_result(batch, (0, 3)))
    # Another result rebuilt between two steps of this one (as the loop may).
    assert _codec.loads_result(_codec.dumps_result([torch.ones(300, 300)], (0, 4)))
    while not decoder.step(0.0):
        pass
    out = decoder.value
    assert decoder.loads > 2
    for got, want in zip(out, batch, strict=True):
        assert got["text"] == want["text"] and got["label"] == want["label"]
        assert torch.equal(got["emb"], want["emb"]) and got["emb"].is_shared()


def test_an_unfinished_rebuild_gives_back_its_descriptors(channel: _channel.FdChannel) -> None:
    ds = TextAndTensorDataset(8)
    decoder = _codec.PieceDecoder(_codec.dumps_result([ds[i] for i in range(8)], (0, 5)))
    while decoder.loads < 2:
        decoder.step(0.0)
    decoder.close()  # the no_leaks fixture checks that no descriptor is left open


@pytest.fixture
def one_piece_per_step(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every step on the loop loads one piece; records each step as ("step", decoder id)."""
    monkeypatch.setattr(_codec, "DECODE_STEP_S", 0.0)
    events: list[tuple[str, int]] = []
    orig = _codec.PieceDecoder.step
    serials: dict[_codec.PieceDecoder, int] = {}  # not id(): a freed decoder's is reused

    def step(self: _codec.PieceDecoder, budget: float = float("inf")) -> bool:
        events.append(("step", serials.setdefault(self, len(serials))))
        return orig(self, budget)

    monkeypatch.setattr(_codec.PieceDecoder, "step", step)
    return events


@pytest.mark.parametrize("in_order", [True, False])
async def test_text_batches_match_torch_and_let_the_loop_run_between_pieces(
    one_piece_per_step: list[tuple[str, int]], in_order: bool
) -> None:
    events = one_piece_per_step
    ds = TextDataset(6 * 32)
    kwargs: dict[str, Any] = {"batch_size": 32, "num_workers": 2, "collate_fn": keep_list}
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            events.append(("tick", 0))
            await asyncio.sleep(0)

    tick = asyncio.create_task(ticker())
    try:
        got = await collect(AsyncDataLoader(ds, in_order=in_order, **kwargs))
    finally:
        stop.set()
        await tick
    want = torch_batches(ds, **kwargs)
    if in_order:
        assert got == want
    else:
        assert sorted(map(str, got)) == sorted(map(str, want))
    steps: dict[int, list[int]] = {}
    for pos, (kind, who) in enumerate(events):
        if kind == "step":
            steps.setdefault(who, []).append(pos)
    assert len(steps) == 6
    for positions in steps.values():
        assert len(positions) > 16  # one piece per step
        for a, b in itertools.pairwise(positions):
            # The loop ran another callback (the ticker) between two steps of a batch.
            assert any(kind == "tick" for kind, _ in events[a + 1 : b])
    # Nor do batches that arrived together each take a step in the same loop turn: one step's
    # budget per turn, whichever batches are waiting.
    kinds = [kind for kind, _ in events]
    assert all(a != "step" or b != "step" for a, b in itertools.pairwise(kinds))


async def test_mixed_batches_match_torch_through_shared_memory(
    one_piece_per_step: list[tuple[str, int]],
) -> None:
    ds = TextAndTensorDataset(4 * 8)
    kwargs: dict[str, Any] = {"batch_size": 8, "num_workers": 2, "collate_fn": keep_list}
    got = await collect(AsyncDataLoader(ds, **kwargs))
    want = torch_batches(ds, **kwargs)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want, strict=True):
        assert isinstance(g, list)
        for a, b in zip(g, w, strict=True):
            assert a["text"] == b["text"] and a["label"] == b["label"]
            assert torch.equal(a["emb"], b["emb"])


async def test_an_epoch_ended_mid_rebuild_drops_it(
    one_piece_per_step: list[tuple[str, int]],
) -> None:
    ds = TextAndTensorDataset(8 * 8)
    kwargs: dict[str, Any] = {"batch_size": 8, "num_workers": 2, "collate_fn": keep_list}
    async with AsyncDataLoader(ds, **kwargs) as loader:
        async for _ in loader:
            break  # the next batches are being rebuilt or on their way: dropped, fds closed
        assert len(await collect(loader)) == 8  # a new epoch still gets every batch


def test_result_pipes_hold_a_large_result_whole() -> None:
    """A text batch (hundreds of KiB) fits the result pipe: the worker writes it in one go."""
    import fcntl
    import multiprocessing

    from aioloader import _procpool

    get_size = getattr(fcntl, "F_GETPIPE_SZ", None)
    if get_size is None:
        pytest.skip("no F_GETPIPE_SZ here")
    lane = _procpool.Lane(multiprocessing.get_context("fork"))
    try:
        size = fcntl.fcntl(lane.result_w.fileno(), get_size)
        with open("/proc/sys/fs/pipe-max-size") as fh:
            limit = int(fh.read())
        assert size == min(_procpool.RESULT_PIPE_BYTES, limit) or size >= 64 * 1024
        if limit >= _procpool.RESULT_PIPE_BYTES:
            assert size == _procpool.RESULT_PIPE_BYTES
    finally:
        lane.close()
