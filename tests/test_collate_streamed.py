"""Large tensor batches are built sample by sample in a worker (``_worker.fetch_streamed``).

The batch must be bit-identical to ``default_collate``'s, the dataset must see the same calls,
and any sample that does not fit must give default_collate's own result or exception.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils import worker as torch_worker

from aioloader import AsyncDataLoader, _buffers, _channel, _codec, _worker
from tests import datasets


class Recorded:
    """A map-style dataset over ``make(i)`` that records its calls and its live tensors."""

    def __init__(self, make: Callable[[int], Any]) -> None:
        self.make = make
        self.calls: list[int] = []
        self.live = 0
        self.max_live = 0

    def _dropped(self) -> None:
        self.live -= 1

    def __getitem__(self, i: int) -> Any:
        self.calls.append(i)
        sample = self.make(i)
        for t in sample if isinstance(sample, tuple) else (sample,):
            if isinstance(t, torch.Tensor):
                self.live += 1
                self.max_live = max(self.max_live, self.live)
                weakref.finalize(t, self._dropped)
        return sample


@pytest.fixture(params=["fresh segment", "pool buffer"])
def worker_side(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[_channel.FdChannel | None]:
    """This process plays a worker; batches of any size are streamed (no inline threshold).

    Inside a worker torch's ``default_collate`` stacks into a contiguous shared-memory tensor
    (outside one it may keep the samples' memory format): the reference is the worker's.
    """
    monkeypatch.setattr(_codec, "INLINE_TENSOR_BYTES", 0)
    monkeypatch.setattr(
        torch_worker,
        "_worker_info",
        _worker.make_worker_info(id=0, num_workers=1, seed=0, dataset=None),
    )
    if request.param != "pool buffer":
        yield None
        return
    with datasets.playing_worker(pool=True) as ch:
        yield ch


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _assert_identical(got: Any, want: torch.Tensor) -> None:
    assert type(got) is torch.Tensor
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    assert _bits(got) == _bits(want)


def _sample(shape: tuple[int, ...], dtype: torch.dtype, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
        if t.numel():  # NaN payloads, infinities and negative zero travel bit for bit
            t.view(-1)[0] = float("nan")
            t.view(-1)[-1] = -0.0
        return t
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex64,
    ],
)
@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 4)])
def test_a_streamed_batch_is_bit_identical_to_default_collate(
    worker_side: _channel.FdChannel | None, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    ds = Recorded(lambda i: _sample(shape, dtype, i))
    indices = [5, 2, 9, 2, 0]
    expected = default_collate([_sample(shape, dtype, i) for i in indices])
    got = _worker.fetch_streamed(ds, indices)
    _assert_identical(got, expected)
    assert ds.calls == indices
    assert got.is_shared()
    if worker_side is None:
        return
    end = _codec._worker_channel
    assert end is not None
    # The pool starts empty: a fresh buffer, which the pool keeps once its batch is dropped...
    assert got.untyped_storage().data_ptr() in end.fresh
    _codec.loads_result(_codec.dumps_result(got, (0, 0)))
    _codec.release_unsent()
    del got
    # ...and the next batch is built in it, over the old values.
    got = _worker.fetch_streamed(ds, indices)
    assert got.untyped_storage().data_ptr() in end.slot_of
    _assert_identical(got, expected)
    _codec.release_unsent()


VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "transposed": lambda t: t.t(),
    "strided": lambda t: t[:, ::2],
    "channels_last": lambda t: t.reshape(2, 3, 2, 4).contiguous(memory_format=torch.channels_last),
    # Lazy conjugate and negative views are not streamed: default_collate decides (torch's in a
    # worker cannot stack them into shared memory; the worker's pool path can).
    "conjugate": lambda t: torch.complex(t, -t).conj(),
    "negative": lambda t: torch._neg_view(torch.complex(t, t)),
}


@pytest.mark.parametrize("view", list(VIEWS))
def test_views_and_lazy_flags_get_default_collates_outcome(
    worker_side: _channel.FdChannel | None, view: str
) -> None:
    def make(i: int) -> torch.Tensor:
        return VIEWS[view](torch.arange(48.0).reshape(6, 8) + i)

    got = _outcome(lambda: _worker.fetch_streamed(Recorded(make), [0, 1, 2, 3]))
    want = _outcome(lambda: _worker._default_collate_small_inline([make(i) for i in range(4)]))
    assert got[0] == want[0], (got, want)
    if got[0] != "ok":
        assert got[1] == want[1]
        return
    _assert_identical(got[1], want[1])
    if view not in ("conjugate", "negative"):
        _assert_identical(got[1], default_collate([make(i) for i in range(4)]))


def test_the_worker_holds_at_most_two_samples_at_once(
    worker_side: _channel.FdChannel | None,
) -> None:
    ds = Recorded(lambda i: torch.full((64, 64), float(i)))
    got = _worker.fetch_streamed(ds, list(range(32)))
    assert got[:, 0, 0].tolist() == [float(i) for i in range(32)]
    assert ds.max_live <= 2  # default_collate's fetch holds all 32 before stacking


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and ((a.dtype, a.shape) == (b.dtype, b.shape) and _bits(a) == _bits(b))
        )
    return bool(a == b)


MISFITS: dict[str, Callable[[int], Any]] = {
    "another shape": lambda i: torch.zeros(2, 4) if i == 3 else torch.full((2, 3), float(i)),
    "another dtype": lambda i: (
        torch.zeros(2, 3, dtype=torch.float64 if i == 3 else torch.float32) + i
    ),
    "an int": lambda i: 7 if i == 3 else torch.full((2, 3), float(i)),
    "a subclass": lambda i: (
        torch.nn.Parameter(torch.ones(2, 3)) if i == 3 else torch.full((2, 3), float(i))
    ),
    "needs grad": lambda i: torch.ones(2, 3, requires_grad=i == 3),
    "a 0-dim tensor": lambda i: torch.tensor(1.0) if i == 3 else torch.full((2, 3), float(i)),
    "a dict first": lambda i: {"x": torch.full((2, 3), float(i))},
    "an int first": lambda i: i,
}


@pytest.mark.parametrize("misfit", list(MISFITS))
def test_a_sample_that_does_not_fit_gets_default_collates_outcome(
    worker_side: _channel.FdChannel | None, misfit: str
) -> None:
    make = MISFITS[misfit]
    indices = [0, 1, 2, 3, 4]
    ds = Recorded(make)
    got = _outcome(lambda: _worker.fetch_streamed(ds, indices))
    assert ds.calls == indices  # every sample read once, in order, as torch's fetcher does
    # What torch's default_collate gives the same samples in a worker, and the worker's own.
    for want in (
        _outcome(lambda: default_collate([make(i) for i in indices])),
        _outcome(lambda: _worker._default_collate_small_inline([make(i) for i in indices])),
    ):
        assert got[0] == want[0], (got, want)
        if got[0] != "ok":
            assert got[1] == want[1]
        elif isinstance(want[1], dict):
            assert want[1].keys() == got[1].keys()
            assert all(_same(got[1][k], want[1][k]) for k in want[1])
        else:
            assert _same(got[1], want[1])


def _img(i: int, shape: tuple[int, ...] = (2, 3)) -> torch.Tensor:
    return torch.full(shape, float(i))


TUPLES: dict[str, Callable[[int], Any]] = {
    "image and label": lambda i: (_img(i), i),
    "label first, two tensors, a string": lambda i: (i % 3, _img(i), f"s{i}", _img(-i, (4,))),
    "a small member kept": lambda i: (_img(i), torch.tensor([i, i])),
    "another length": lambda i: (_img(i), i, 0) if i == 3 else (_img(i), i),
    "a list": lambda i: [_img(i), i] if i == 3 else (_img(i), i),
    "a namedtuple later": lambda i: (
        torch.return_types.max((_img(i), _img(i))) if i == 3 else (_img(i), _img(i))
    ),
    "another member shape": lambda i: (_img(i, (2, 4)) if i == 3 else _img(i), i),
    "labels of mixed types": lambda i: (_img(i), 2.5 if i == 3 else i),
    "labels that cannot collate": lambda i: (_img(i), object() if i == 3 else i),
    "a tensor member later": lambda i: (_img(i), _img(i) if i == 3 else i),
}


@pytest.mark.parametrize("case", list(TUPLES))
def test_tuples_stream_their_tensors_and_get_default_collates_outcome(
    worker_side: _channel.FdChannel | None, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 2x3 float32 members stream, as would an image; 2-element ones stay below the threshold.
    monkeypatch.setattr(_codec, "INLINE_TENSOR_BYTES", 5 * 6 * 4)
    make = TUPLES[case]
    indices = [0, 1, 2, 3, 4]
    ds = Recorded(make)
    got = _outcome(lambda: _worker.fetch_streamed(ds, indices))
    assert ds.calls == indices
    want = _outcome(lambda: default_collate([make(i) for i in indices]))
    assert got[0] == want[0], (got, want)
    if got[0] != "ok":
        assert got[1] == want[1] or "object" in got[1]  # object() reprs differ by address
        return
    assert type(got[1]) is type(want[1]) and len(got[1]) == len(want[1])
    for g, w in zip(got[1], want[1], strict=True):
        if isinstance(w, torch.Tensor):
            _assert_identical(g, w)
        else:
            assert type(g) is type(w) and g == w


def test_tuple_members_are_dropped_as_they_are_copied(
    worker_side: _channel.FdChannel | None,
) -> None:
    ds = Recorded(lambda i: (torch.full((64, 64), float(i)), i))
    images, labels = _worker.fetch_streamed(ds, list(range(32)))
    assert images.is_shared() and images[:, 0, 0].tolist() == [float(i) for i in range(32)]
    assert labels.tolist() == list(range(32))
    assert ds.max_live <= 2


def test_an_abandoned_pool_buffer_is_freed_at_the_tasks_end(
    worker_side: _channel.FdChannel | None,
) -> None:
    if worker_side is None:
        pytest.skip("pool buffers only")
    pool = _buffers.pool_of(worker_side)
    assert pool is not None
    ds = Recorded(MISFITS["another dtype"])
    # The pool's first buffer: a batch of the same size, received and dropped.
    warm = _worker.fetch_streamed(ds, [0, 1, 2, 4, 5])
    received = _codec.loads_result(_codec.dumps_result(warm, (0, 0)))
    _codec.release_unsent()
    del warm, received
    (slot,) = [s for s in range(pool.capacity) if pool.state[s] == _buffers._SPARE]
    batch = _worker.fetch_streamed(ds, [0, 1, 2, 3, 4])  # streamed 3 samples, then gave up
    # In a worker default_collate stacks into a tensor of the first sample's dtype.
    assert batch.dtype == torch.float32 and batch[:, 0, 0].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert pool.state[slot] == _buffers._BUSY
    data = _codec.dumps_result(batch, (0, 1))  # sent on the channel, from a fresh segment
    _codec.release_unsent()  # what load() does after each task
    assert pool.state[slot] == _buffers._SPARE
    assert torch.equal(_codec.loads_result(data), batch)
    assert _codec.pool_buffer((5, 2, 3), torch.float32) is not None  # its token is back
    _codec.release_unsent()


def test_a_dataset_with_getitems_is_not_streamed() -> None:
    _worker._state.dataset = datasets.GetItemsDataset(8)
    _worker._state.streamed = True
    try:
        assert not _worker._streams([0, 1])
        _worker._state.dataset = datasets.BigDataset(8)
        assert _worker._streams([0, 1]) and _worker._streams((0, 1))
        assert not _worker._streams(torch.tensor([0, 1]))
    finally:
        _worker._state.dataset = None
        _worker._state.streamed = False


@pytest.mark.parametrize("method", ["fork", "spawn"])
async def test_a_loader_streams_big_batches_and_reports_a_misfit_like_torch(method: str) -> None:
    ds = datasets.MisfitAt(40, (3, 64, 64), misfit=21)  # 48 KiB samples, 384 KiB batches
    expected: list[Any] = []
    for b in range(5):
        expected.append(
            _outcome(lambda b=b: default_collate([ds[i] for i in range(8 * b, 8 * b + 8)]))
        )
    got: list[Any] = []
    async with asyncio.timeout(120):
        async with AsyncDataLoader(
            ds, batch_size=8, num_workers=2, multiprocessing_context=method
        ) as loader:
            it = aiter(loader)
            for _ in range(5):
                got.append(await _aoutcome(anext(it)))
    assert (
        [g[0] for g in got] == [e[0] for e in expected] == ["ok", "ok", "RuntimeError"] + ["ok"] * 2
    )
    for g, e in zip(got, expected, strict=True):
        if g[0] == "ok":
            assert _same(g[1], e[1])
        else:  # the worker's error names where it happened, then default_collate's message
            assert e[1] in g[1]


async def _aoutcome(aw: Any) -> tuple[str, Any]:
    try:
        return "ok", await aw
    except Exception as exc:
        return type(exc).__name__, str(exc)


def test_the_pool_budget_keeps_one_buffer_per_worker_and_one_more_for_big_batches() -> None:
    big = 64 * 3 * 224 * 224 * 4  # the benchmark's 38.5 MB batch
    with datasets.pools_on_a_memfd(big) as (fd, pools, channels):
        # As receiving a batch does: the pools learn the size of the batches now.
        pools[0].offered(big)
        pools[1].offered(1 << 20)
        # num_workers + 1 permits, each made into a buffer; one made without is not kept.
        assert pools[0]._permits == 3
        kept = [pools[0].adopt(channels[0], fd, big, permitted=True) for _ in range(3)]
        assert kept == [0, 1, 2] and pools[0]._permits == 0
        assert pools[0].adopt(channels[0], fd, big) == -1
        # Smaller buffers: once the first is kept, permits for as many as fit in the budget.
        got = [pools[1].adopt(channels[1], fd, 1 << 20, permitted=True)]
        assert pools[1]._permits == pools[1].capacity - 1
        got += [pools[1].adopt(channels[1], fd, 1 << 20, permitted=True) for _ in range(5)]
        assert got == [*range(2 * _buffers.MAX_SLOTS_PER_WORKER)]
        assert pools[1].adopt(channels[1], fd, 1 << 20) == -1  # no room, no permit
        pools[1]._evict(0)  # a permit takes its place
        assert pools[1]._permits == 1
        # Smaller than the pool's buffers: not kept, and its permit comes back with its batch.
        assert pools[1].adopt(channels[1], fd, 1 << 19, permitted=True) == _buffers._PERMIT
        assert pools[1].adopt(channels[1], fd, 1 << 20, permitted=True) == 0
