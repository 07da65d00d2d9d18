"""Results cross as bytes: small tensors inline, large ones by descriptor on each worker's
FdChannel, every other tensor kind through torch's reductions."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader, _channel, _codec
from tests import datasets

BIG = (256, 512)  # 512 KiB of float32: above INLINE_TENSOR_BYTES, so it goes through shm


@pytest.fixture
def channel() -> Iterator[_channel.FdChannel]:
    """This process plays the worker: dumps_result sends on the channel, loads_result takes."""
    with datasets.playing_worker(pool=False) as ch:
        yield ch


@pytest.fixture
def channel_takes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The tags of the results whose descriptors were taken from a channel."""
    calls: list[tuple[int, int]] = []
    orig = _channel.FdChannel.take

    def counting(self: _channel.FdChannel, tag: tuple[int, int]) -> list[int]:
        calls.append(tag)
        return orig(self, tag)

    monkeypatch.setattr(_channel.FdChannel, "take", counting)
    return calls


def test_views_of_one_storage_arrive_as_views_of_one_storage(
    channel: _channel.FdChannel, channel_takes: list[tuple[int, int]]
) -> None:
    base = torch.arange(float(BIG[0] * BIG[1])).reshape(BIG)
    batch = {"a": base, "b": base[3:], "t": base.t(), "x": [base[:, 1:], 7]}
    out = _codec.loads_result(_codec.dumps_result(batch, (0, 1)))
    assert channel_takes == [(0, 1)]  # one message for the batch
    for key in ("a", "b", "t"):
        assert torch.equal(out[key], batch[key])
        assert out[key].stride() == batch[key].stride()
        assert out[key].is_shared()
    assert torch.equal(out["x"][0], base[:, 1:]) and out["x"][1] == 7
    ptrs = {t.untyped_storage().data_ptr() for t in (out["a"], out["b"], out["t"], out["x"][0])}
    assert len(ptrs) == 1  # one storage, as in the worker, not four copies
    out["a"][3, 0] = -1.0
    assert out["b"][0, 0].item() == -1.0


def test_results_unpickled_out_of_order_each_get_their_own_descriptors(
    channel: _channel.FdChannel,
) -> None:
    sent = [
        (tag, _codec.dumps_result(torch.full(BIG, float(tag[1])), tag))
        for tag in [(0, 0), (0, 1), (1, 0), (1, 1)]
    ]
    for tag, data in reversed(sent):
        assert _codec.loads_result(data)[0, 0].item() == float(tag[1])


def test_a_result_whose_descriptors_never_came_is_an_oserror(
    channel: _channel.FdChannel,
) -> None:
    data = _codec.dumps_result(torch.zeros(BIG), (0, 5))
    taken = channel.take((0, 5))  # someone else took them
    assert len(taken) == 1
    _channel.close_all(taken)
    with pytest.raises(OSError) as info:
        _codec.loads_result(data)
    assert info.value.errno == errno.ENOENT


def _shm_fds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # listdir's own descriptor, closed by now
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/")
    return n


def test_unclaimed_descriptors_are_closed_with_the_channel() -> None:
    before = _shm_fds()
    ch = _channel.FdChannel()
    _codec.set_worker_channel(ch)
    try:
        kept = [torch.zeros(BIG) for _ in range(3)]
        for i, t in enumerate(kept):
            _codec.dumps_result(t, (0, i))
        del kept, t
        # The worker's side keeps nothing once a result is sent: its descriptors are in flight.
        assert _shm_fds() == before
        # Reads past (0, 0) and (0, 1): those are kept for their results.
        _channel.close_all(ch.take((0, 2)))
        assert ch._npending == 2
        assert _shm_fds() == before + 2
    finally:
        _codec.set_worker_channel(None)
        ch.close()
    assert _shm_fds() == before


def test_a_closed_channel_falls_back_to_torchs_descriptor_sharing(
    channel: _channel.FdChannel, channel_takes: list[tuple[int, int]]
) -> None:
    channel.main_end.close()  # the worker's send fails: nothing may be lost
    t = torch.arange(float(BIG[0] * BIG[1])).reshape(BIG)
    out = _codec.loads_result(_codec.dumps_result(t, (0, 0)))
    assert torch.equal(out, t)
    assert channel_takes == []


def test_conjugated_and_negated_large_views_arrive_with_their_values(
    channel: _channel.FdChannel,
) -> None:
    z = torch.complex(torch.ones(BIG), torch.arange(float(BIG[1])).expand(BIG).contiguous())
    batch = [z.conj(), torch._neg_view(z)]  # lazy views: raw memory holds the unflipped values
    out = _codec.loads_result(_codec.dumps_result(batch, (0, 0)))
    assert torch.equal(out[0].resolve_conj(), z.conj().resolve_conj())
    assert torch.equal(out[1].resolve_neg(), (-z))


@pytest.mark.parametrize("method", ["fork", "spawn"])
async def test_workers_send_large_batches_on_their_channel(
    method: str, channel_takes: list[tuple[int, int]]
) -> None:
    ds = datasets.BigDataset(32, (3, 128, 128))  # 192 KiB samples, 768 KiB batches
    async with asyncio.timeout(120):
        async with AsyncDataLoader(
            ds, batch_size=4, num_workers=2, multiprocessing_context=method
        ) as loader:
            got = [b async for b in loader]
    assert len(channel_takes) == 8  # every batch, none through torch's round trip
    for i, b in enumerate(got):
        assert b.is_shared()
        assert b[:, 0, 0, 0].tolist() == [float(4 * i + k) for k in range(4)]


def _tensor_facts(t: torch.Tensor) -> Any:
    """What a consumer sees of a tensor: type, dtype, layout, shape, grad, pinning, values."""

    def values(t: torch.Tensor) -> Any:
        if t.is_nested:
            return [values(x) for x in t.unbind()]
        if t.is_quantized:
            return (str(t.qscheme()), t.int_repr().tolist(), t.dequantize().tolist())
        if t.layout is not torch.strided:
            return values(t.to_dense())
        t = t.detach().resolve_conj().resolve_neg()
        if t.dtype.is_floating_point:
            t = t.to(torch.float64)  # bfloat16, float8: tolist() wants a common dtype
        elif t.dtype == torch.complex32:
            t = t.to(torch.complex64)
        elif t.dtype in (torch.uint16, torch.uint32, torch.uint64):
            t = t.to(torch.int64)
        return t.tolist()

    try:
        seen = values(t)
    except RuntimeError as exc:  # torch's loader delivers quantized tensors without quantizer
        seen = f"broken: {str(exc)[:40]}"
    try:
        pinned = t.is_pinned()
    except (RuntimeError, NotImplementedError):
        pinned = None
    return {
        "type": type(t),
        "dtype": t.dtype,
        "layout": t.layout,
        "shape": None if t.is_nested else tuple(t.shape),
        "requires_grad": t.requires_grad,
        "pinned": pinned,
        "values": seen,
    }


#: torch's loader drops a lazy conjugate/negative flag with the memory unflipped (its consumer
#: sees wrong values), and rebuilds a quantized tensor without its quantizer (reading it fails).
#: We deliver the dataset's values.
_TORCH_LOSES_VALUES = {"conj", "conj_big", "neg", "neg_big", "quantized", "quantized_per_channel"}


@pytest.mark.parametrize("pin_memory", [False, True])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_every_tensor_kind_arrives_as_torchs_loader_delivers_it(
    method: str, pin_memory: bool
) -> None:
    """Nested, sparse, quantized, subclasses, views, every dtype: compared with torch's loader."""
    ds = datasets.TensorKindsDataset()
    kwargs: dict[str, Any] = {
        "batch_size": None,
        "num_workers": 2,
        "multiprocessing_context": method,
        "pin_memory": pin_memory,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator; torch's betas
        expected = [_tensor_facts(t) for t in torch.utils.data.DataLoader(ds, **kwargs)]
        with AsyncDataLoader(ds, **kwargs).sync() as loader:
            got = [_tensor_facts(t) for t in loader]
        truth = [_tensor_facts(ds[i]) for i in range(len(ds))]
    assert len(got) == len(expected) == len(datasets.TENSOR_KINDS)
    kinds = datasets.TENSOR_KINDS
    for name, ours, torchs, dataset in zip(kinds, got, expected, truth, strict=True):
        if name in _TORCH_LOSES_VALUES:
            assert ours["values"] == dataset["values"], name
            assert torchs["values"] != dataset["values"], name  # still so in this torch?
            ours = {**ours, "values": None}
            torchs = {**torchs, "values": None}
        assert ours == torchs, name


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_batches_of_nested_tensors_as_in_torchs_own_test(method: str) -> None:
    """torch's test_nested_tensor_multiprocessing: a collate_fn keeping the nested tensors
    delivers them; default_collate's refusal to stack them is its RuntimeError."""
    ds = [torch.nested.nested_tensor([torch.randn(5), torch.randn(i + 1)]) for i in range(6)]
    kwargs: dict[str, Any] = {"batch_size": 1, "num_workers": 2, "multiprocessing_context": method}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's nested tensors are a prototype
        with AsyncDataLoader(ds, collate_fn=datasets.clone_collate, **kwargs).sync() as loader:
            got = list(loader)
        with (
            AsyncDataLoader(ds, **kwargs).sync() as loader,
            pytest.raises(RuntimeError, match="not currently supported by the default collate_fn"),
        ):
            next(iter(loader))
    assert len(got) == len(ds)
    for (batch,), sample in zip(got, ds, strict=True):
        assert batch.is_nested
        assert [x.tolist() for x in batch.unbind()] == [x.tolist() for x in sample.unbind()]


def _same(a: torch.Tensor, b: torch.Tensor) -> str:
    """'' when ``b`` is ``a`` moved across processes: type, layout, dtype, grad, values."""
    if type(a) is not type(b):
        return f"type {type(a).__name__} != {type(b).__name__}"
    for attr in ("layout", "dtype", "requires_grad", "is_nested", "is_quantized"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{attr} {getattr(a, attr)} != {getattr(b, attr)}"
    if a.is_nested:
        ok = all(torch.equal(x, y) for x, y in zip(a.unbind(), b.unbind(), strict=True))
    elif a.is_quantized:
        ok = torch.equal(a.int_repr(), b.int_repr()) and a.q_scale() == b.q_scale()
    else:
        if a.layout is not torch.strided:
            a, b = a.to_dense(), b.to_dense()
        # Lazy conjugate/negative views: the values they stand for.
        ok = torch.equal(
            a.detach().resolve_conj().resolve_neg(), b.detach().resolve_conj().resolve_neg()
        )
    return "" if ok else "values"


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
async def test_every_tensor_kind_torchs_loader_moves_arrives_intact(ctx: str) -> None:
    """Nested, sparse, quantized, lazily conjugated or negated, subclasses, parameters...: the
    inline and channel transports take plain dense tensors, torch's reductions the rest."""
    loader = AsyncDataLoader(
        datasets.TensorKinds(), batch_size=None, num_workers=1, multiprocessing_context=ctx
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: nested tensors are a prototype
        expected = datasets.tensor_kinds()
        async with loader, asyncio.timeout(120):
            got = [b async for b in loader]
    assert len(got) == 2
    diffs = {k: d for k, v in expected.items() if (d := _same(v, got[0][k]))}
    assert diffs == {}
