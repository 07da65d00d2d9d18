"""Datasets for the tests, at module level so spawn/forkserver workers can import them."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class RangeDataset(Dataset[torch.Tensor]):
    """Sample i is ``tensor([i])``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.tensor([i])


class DictDataset(Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((3,), float(i)), "label": i, "name": f"s{i}"}


class BigDataset(Dataset[torch.Tensor]):
    """Samples large enough that batches travel through shared memory."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 64, 64)) -> None:
        self.n = n
        self.shape = shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full(self.shape, float(i))


class MisfitAt(BigDataset):
    """:class:`BigDataset` whose sample ``misfit`` is one column wider: its batch cannot stack."""

    def __init__(self, n: int, shape: tuple[int, ...], misfit: int) -> None:
        super().__init__(n, shape)
        self.misfit = misfit

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.misfit:
            return torch.full((*self.shape[:-1], self.shape[-1] + 1), float(i))
        return super().__getitem__(i)


class GetItemsDataset(RangeDataset):
    """Defines ``__getitems__``: torch fetches whole batches through it."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [torch.tensor([i * 10]) for i in indices]


class WorkerInfoDataset(Dataset[tuple[int, int, int, int, int]]):
    """Each sample reports (index, worker id, num_workers, seed, torch threads) of its worker."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[int, int, int, int, int]:
        info = get_worker_info()
        assert info is not None
        assert info.dataset is self
        return (i, info.id, info.num_workers, info.seed, torch.get_num_threads())


class RandomDataset(Dataset[tuple[float, float]]):
    """Draws from ``random`` and ``torch`` in the worker: tests per-worker seeding."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[float, float]:
        return random.random(), float(torch.rand(()).item())


class ShardedIterable(IterableDataset[int]):
    """Yields ``range(n)``, split between workers by ``get_worker_info()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))

    def __len__(self) -> int:
        return self.n


class UnevenIterable(IterableDataset[int]):
    """Worker k yields ``sizes[k]`` items ``k*1000 + j``: workers run dry at different times."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self) -> Any:
        info = get_worker_info()
        k = info.id if info is not None else 0
        return iter(range(k * 1000, k * 1000 + self.sizes[k]))


class RaisingDataset(RangeDataset):
    """Raises ``exc_type(message)`` at index ``bad``."""

    def __init__(self, n: int, bad: int, exc_type: type[BaseException] = ValueError) -> None:
        super().__init__(n)
        self.bad = bad
        self.exc_type = exc_type

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise self.exc_type(f"bad sample {i}")
        return super().__getitem__(i)


class TwoArgError(Exception):
    """Pickles, but cannot be rebuilt from a single message argument."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(a, b)


class TwoArgErrorDataset(RangeDataset):
    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 3:
            raise TwoArgError("x", "y")
        return super().__getitem__(i)


class LambdaResultDataset(RangeDataset):
    """Returns a sample that cannot be pickled back to the main process."""

    def __getitem__(self, i: int) -> Any:
        if i == 2:
            return lambda: i
        return super().__getitem__(i)


class RaisingIterable(IterableDataset[int]):
    def __iter__(self) -> Any:
        yield 1
        raise KeyError("stream broke")


class ExitDataset(RangeDataset):
    """The worker loading index ``bad`` dies with ``os._exit(code)`` (every time)."""

    def __init__(self, n: int, bad: int, code: int = 7) -> None:
        super().__init__(n)
        self.bad = bad
        self.code = code

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            os._exit(self.code)
        return super().__getitem__(i)


class SignalDataset(RangeDataset):
    """The worker loading index ``bad`` kills itself with signal ``sig`` (every time)."""

    def __init__(self, n: int, bad: int, sig: int) -> None:
        super().__init__(n)
        self.bad = bad
        self.sig = sig

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            import faulthandler

            faulthandler.disable()  # no traceback dump: die of the signal at once
            signal.signal(self.sig, signal.SIG_DFL)
            os.kill(os.getpid(), self.sig)
            time.sleep(10)
        return super().__getitem__(i)


class ExitOnceDataset(RangeDataset):
    """The worker loading index ``bad`` dies, but only the first time (a marker file remembers)."""

    def __init__(self, n: int, bad: int, marker: str) -> None:
        super().__init__(n)
        self.bad = bad
        self.marker = marker

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad and not os.path.exists(self.marker):
            with open(self.marker, "w"):
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class ExitOnceLeavingSegmentDataset(ExitOnceDataset):
    """As ExitOnceDataset, the worker first making a file named as torch names a shared-memory
    segment of its process (the one a kill between torch's creating and unlinking it leaves);
    its path goes into the marker file."""

    def __init__(self, n: int, bad: int, marker: str, shm_dir: str) -> None:
        super().__init__(n, bad, marker)
        self.shm_dir = shm_dir

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad and not os.path.exists(self.marker):
            path = os.path.join(self.shm_dir, f"torch_{os.getpid()}_4242_0")
            with open(path, "wb") as f:
                f.write(b"x" * 4096)
            with open(self.marker, "w") as f:
                f.write(path)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class SlowDataset(RangeDataset):
    """Each sample sleeps ``delay`` seconds (a blocking read)."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n)
        self.delay = delay

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)
        return super().__getitem__(i)


class PidDataset(RangeDataset):
    """Sample is (index, pid of the process that loaded it)."""

    def __getitem__(self, i: int) -> Any:
        return torch.tensor([i, os.getpid()])


def record_worker_init(worker_id: int) -> None:
    """A worker_init_fn that leaves a trace the dataset can read back."""
    os.environ["AIOLOADER_TEST_INIT"] = str(worker_id)


class InitTraceDataset(RangeDataset):
    def __getitem__(self, i: int) -> Any:
        return (i, int(os.environ.get("AIOLOADER_TEST_INIT", "-1")))


def failing_worker_init(worker_id: int) -> None:
    raise OSError(f"init failed in {worker_id}")


def late_failing_worker_init(worker_id: int) -> None:
    """Worker 1 fails its start after the others could take every batch (r4_02)."""
    if worker_id == 1:
        time.sleep(1.0)
        raise ValueError(f"init failed late in {worker_id}")


def failing_collate(batch: list[Any]) -> Any:
    raise TypeError("collate rejected the batch")


class PinnedBatch:
    """A custom batch type: its ``pin_memory()`` records which thread pinned it."""

    def __init__(self, values: list[int], pinned_by: str | None = None) -> None:
        self.values = values
        self.pinned_by = pinned_by

    def pin_memory(self) -> PinnedBatch:
        import threading

        if -1 in self.values:
            raise ArithmeticError("this batch cannot be pinned")
        return PinnedBatch(self.values, threading.current_thread().name)


def pinned_batch_collate(samples: list[torch.Tensor]) -> PinnedBatch:
    return PinnedBatch([int(s) for s in samples])


class Pair(tuple[Any, ...]):
    """A tuple subclass that is not a named tuple."""

    __slots__ = ()


class TaggedList(list[Any]):
    """A list subclass with an attribute of its own."""

    tag = ""


class Labelled(NamedTuple):
    x: Any
    y: Any


class AttrDict(dict[str, Any]):
    """A dict subclass."""


def container_collate(samples: list[torch.Tensor]) -> Pair:
    """Every container type a batch may come in, each holding tensors (plain, non-contiguous,
    needing no numpy dtype)."""
    x = torch.stack(samples)
    tagged = TaggedList([x, x.t()])
    tagged.tag = "kept"
    return Pair(
        (
            x,
            tagged,
            Labelled(x + 1, [x.to(torch.bfloat16)]),
            AttrDict(a=x, b=(x, Pair((x,)))),
            {"plain": [x], "t": (x,)},
        )
    )


class ExitOnceAtDataset(RangeDataset):
    """Loading any index in ``bad`` kills the worker, once per index (marker files in ``dir``):
    ``os._exit(9)``, or a real segmentation fault with ``segfault=True``."""

    def __init__(self, n: int, bad: list[int], marker_dir: str, segfault: bool = False) -> None:
        super().__init__(n)
        self.bad = set(bad)
        self.marker_dir = marker_dir
        self.segfault = segfault

    def __getitem__(self, i: int) -> torch.Tensor:
        marker = os.path.join(self.marker_dir, f"died-{i}")
        if i in self.bad and not os.path.exists(marker):
            with open(marker, "w"):
                pass
            if self.segfault:
                import ctypes

                ctypes.string_at(0)
            os._exit(9)
        return super().__getitem__(i)


class HangOnceDataset(PidDataset):
    """Index ``stuck`` blocks for a minute the first time it is loaded (a marker file remembers)."""

    def __init__(self, n: int, stuck: int, marker: str) -> None:
        super().__init__(n)
        self.stuck = stuck
        self.marker = marker

    def __getitem__(self, i: int) -> Any:
        if i == self.stuck and not os.path.exists(self.marker):
            with open(self.marker, "w"):
                pass
            time.sleep(60)
        return super().__getitem__(i)


# ------------------------------------------------------------------ hardening / chaos helpers


class SlowPidDataset(PidDataset):
    """Sample is (index, pid); each sample sleeps ``delay`` seconds first."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n)
        self.delay = delay

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.delay)
        return super().__getitem__(i)


def die_in_init_once(armed: str, worker_id: int) -> None:
    """A worker_init_fn (bind ``armed`` with functools.partial): once the file ``armed`` exists,
    exactly one worker that starts after that dies in its init (a native crash or OOM kill during
    start-up); every other worker starts normally."""
    if os.path.exists(armed):
        try:
            fd = os.open(armed + ".claimed", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        os._exit(7)


class GatedDataset(RangeDataset):
    """Indices below ``open_below`` load at once; the others block until the file ``gate`` exists
    (at most ``limit`` seconds), so a consumer can be made to wait in ``__anext__`` for as long
    as a test needs and released at once by creating the file."""

    def __init__(self, n: int, open_below: int, gate: str, limit: float = 30.0) -> None:
        super().__init__(n)
        self.open_below = open_below
        self.gate = gate
        self.limit = limit

    def __getitem__(self, i: int) -> torch.Tensor:
        if i >= self.open_below:
            deadline = time.monotonic() + self.limit
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.005)
        return super().__getitem__(i)


class SlowUnpickleDataset(RangeDataset):
    """Takes ``delay`` seconds to unpickle in any process other than the one that made it (a big
    dataset, or one that opens files or indexes when it is rebuilt in a worker)."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n)
        self.delay = delay
        self.home_pid = os.getpid()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if os.getpid() != self.home_pid:
            time.sleep(self.delay)


class UnpickleAbort(BaseException):
    """A BaseException (not an Exception) raised while a result is rebuilt in the main process."""


def _rebuild_abort_in(pid: int, value: int) -> Any:
    if os.getpid() == pid:
        raise UnpickleAbort(f"cannot rebuild sample {value} here")
    return value


class AbortOnReceive:
    """Pickles fine in a worker; rebuilding it in process ``pid`` raises :class:`UnpickleAbort`."""

    def __init__(self, pid: int, value: int) -> None:
        self.pid = pid
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_abort_in, (self.pid, self.value))


class AbortOnReceiveDataset(RangeDataset):
    """Sample ``bad`` comes back as an object whose unpickling in this process raises a
    BaseException; the others are ``tensor([i])``."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad
        self.main_pid = os.getpid()

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            return AbortOnReceive(self.main_pid, i)
        return super().__getitem__(i)


class SlowPickleDataset(RangeDataset):
    """Takes ``delay`` seconds to pickle (a big dataset: spawn/forkserver pickle it in the main
    process before any worker starts)."""

    def __init__(self, n: int, delay: float) -> None:
        super().__init__(n)
        self.delay = delay

    def __getstate__(self) -> dict[str, Any]:
        time.sleep(self.delay)
        return self.__dict__


@contextlib.contextmanager
def pools_on_a_memfd(
    nbytes: int, num_workers: int = 2
) -> Iterator[tuple[int, list[Any], list[Any]]]:
    """Two buffer pools of ``num_workers``, a channel of each, and a memfd of ``nbytes`` to
    offer them as batch buffers; all closed at the end."""
    from aioloader import _buffers, _channel

    fd = os.memfd_create("aioloader-test")
    pools = [_buffers.BufferPool(num_workers=num_workers) for _ in range(2)]
    channels = [_channel.FdChannel(0) for _ in pools]
    for pool, channel in zip(pools, channels, strict=True):
        pool.attach(channel)
    try:
        os.ftruncate(fd, nbytes)
        yield fd, pools, channels
    finally:
        for channel in channels:
            channel.close()
        for pool in pools:
            pool.close()
        os.close(fd)


@contextlib.contextmanager
def playing_worker(pool: bool, num_workers: int = 1) -> Iterator[Any]:
    """This process plays a worker (id 0): results go out on the channel it yields, with a pool
    of reused batch buffers for ``num_workers`` workers if ``pool``; the main side takes them
    from the same channel."""
    from aioloader import _buffers, _channel, _codec

    buffers = _buffers.BufferPool(num_workers) if pool else None
    ch = _channel.FdChannel()
    if buffers is not None:
        buffers.attach(ch)
    _codec.set_worker_channel(ch)
    try:
        yield ch
    finally:
        _codec.set_worker_channel(None)
        ch.close()
        if buffers is not None:
            buffers.close()


class SubTensor(torch.Tensor):
    """A user's tensor subclass."""


def _big(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # 360 KiB of float32: above the inline limit, so it takes the shared-memory path.
    return torch.arange(300 * 300, dtype=torch.float64).reshape(300, 300).to(dtype)


def _tensor_kind(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    if name.startswith("dtype_"):
        dt = getattr(torch, name[6:])
        if dt.is_complex:
            return torch.complex(r(3, 4), r(3, 4)).to(dt)
        if dt == torch.bool:
            return r(3, 4) > 0
        if dt.is_floating_point:
            return r(3, 4).to(dt)
        return torch.arange(12).reshape(3, 4).to(dt)
    kinds: dict[str, Any] = {
        "dense": lambda: r(4, 5),
        "dense_big": _big,
        "non_contiguous": lambda: r(6, 8).t()[::2],
        "non_contiguous_big": lambda: _big().t()[::2],
        "zero_size": lambda: torch.empty(0, 3),
        "scalar": lambda: torch.tensor(3.5),
        "conj": lambda: torch.complex(r(3, 4), r(3, 4)).conj(),
        "conj_big": lambda: torch.complex(_big(), -_big()).conj(),
        "neg": lambda: torch.complex(r(3, 4), r(3, 4)).conj().imag,
        "neg_big": lambda: torch.complex(_big(), _big()).conj().imag,
        "nested_strided": lambda: torch.nested.nested_tensor([r(5), r(3)]),
        "nested_strided_2d": lambda: torch.nested.nested_tensor([r(2, 5), r(3, 5)]),
        "nested_jagged": lambda: torch.nested.nested_tensor(
            [r(2, 5), r(3, 5)], layout=torch.jagged
        ),
        "sparse_coo": lambda: r(4, 5).relu().to_sparse(),
        "sparse_coo_uncoalesced": lambda: torch.sparse_coo_tensor(
            torch.tensor([[0, 0, 1], [1, 1, 2]]), torch.tensor([1.0, 2.0, 3.0]), (3, 3)
        ),
        "sparse_csr": lambda: r(4, 5).relu().to_sparse_csr(),
        "sparse_csc": lambda: r(4, 5).relu().to_sparse_csc(),
        "sparse_bsr": lambda: r(4, 6).relu().to_sparse_bsr((2, 2)),
        "quantized": lambda: torch.quantize_per_tensor(r(3, 4), 0.1, 3, torch.quint8),
        "quantized_per_channel": lambda: torch.quantize_per_channel(
            r(3, 4), torch.tensor([0.1, 0.2, 0.3]), torch.tensor([0, 1, 2]), 0, torch.qint8
        ),
        "subclass": lambda: r(3, 4).as_subclass(SubTensor),
        "subclass_big": lambda: _big().as_subclass(SubTensor),
        "parameter": lambda: torch.nn.Parameter(r(3, 4)),
        "parameter_big": lambda: torch.nn.Parameter(_big()),
        "requires_grad": lambda: r(3, 4).requires_grad_(),
        "requires_grad_big": lambda: _big().requires_grad_(),
    }
    return kinds[name]()  # type: ignore[no-any-return]


TENSOR_DTYPES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
    "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn",
    "float8_e5m2",
]  # fmt: skip

TENSOR_KINDS = [
    "dense", "dense_big", "non_contiguous", "non_contiguous_big", "zero_size", "scalar", "conj",
    "conj_big", "neg", "neg_big", "nested_strided", "nested_strided_2d", "nested_jagged",
    "sparse_coo", "sparse_coo_uncoalesced", "sparse_csr", "sparse_csc", "sparse_bsr", "quantized",
    "quantized_per_channel", "subclass", "subclass_big", "parameter", "parameter_big",
    "requires_grad", "requires_grad_big",
    *(f"dtype_{d}" for d in TENSOR_DTYPES),
]  # fmt: skip


class TensorKindsDataset(Dataset[torch.Tensor]):
    """Sample ``i`` is a tensor of kind ``TENSOR_KINDS[i]`` (the same values every time)."""

    def __len__(self) -> int:
        return len(TENSOR_KINDS)

    def __getitem__(self, i: int) -> torch.Tensor:
        return _tensor_kind(TENSOR_KINDS[i])


def clone_collate(samples: list[torch.Tensor]) -> list[torch.Tensor]:
    """A list of copies of the samples (default_collate cannot stack nested tensors)."""
    return [s.clone() for s in samples]


class SegfaultDataset(RangeDataset):
    """Sample ``at`` crashes its worker with a real segmentation fault (as torch's test does)."""

    def __init__(self, n: int, at: int) -> None:
        super().__init__(n)
        self.at = at

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.at:
            import ctypes

            ctypes.string_at(0)  # a read at address 0: SIGSEGV
        return super().__getitem__(i)


class SegfaultEveryDataset(RangeDataset):
    """Every sample crashes its worker with a segmentation fault (torch's test_segfault)."""

    def __getitem__(self, i: int) -> torch.Tensor:
        import ctypes

        ctypes.string_at(0)
        return super().__getitem__(i)


class SegfaultInTurnDataset(RangeDataset):
    """Every sample segfaults, batch 1 first (batch_size 2): the first workers fault on batch 1
    at once while batch 0 waits (they are stopped when the pool breaks), and their replacements
    fault on batch 0 at once, batch 1 a second later. So a restart after the first fault crashes
    on a different batch than the first.

    Which workers a process belongs to is told by when it started against the first fault's time
    (written to ``marker``), both on the clock of seconds since boot: a wall-clock race between
    the first workers cannot move a fault into the wrong round.
    """

    def __init__(self, n: int, marker: str) -> None:
        super().__init__(n)
        self.marker = marker

    def __getitem__(self, i: int) -> torch.Tensor:
        import ctypes

        def since_boot() -> float:
            with open("/proc/uptime") as fh:
                return float(fh.read().split()[0])

        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        started = ticks / os.sysconf("SC_CLK_TCK")
        try:
            with open(self.marker) as fh:
                replacement = started > float(fh.read())
        except (FileNotFoundError, ValueError):
            replacement = False
        if i // 2 != (0 if replacement else 1):
            time.sleep(1.0 if replacement else 30.0)
        if not replacement:
            with contextlib.suppress(FileExistsError), open(self.marker, "x") as fh:
                fh.write(repr(since_boot()))
        ctypes.string_at(0)
        return super().__getitem__(i)


class TaggedTensor(torch.Tensor):
    """A tensor subclass: it must arrive as itself, as torch's DataLoader delivers it."""


def tensor_kinds() -> dict[str, torch.Tensor]:
    """One of every kind of tensor torch's DataLoader moves between processes."""
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 300, generator=g)
    parts = [torch.randn(2, 3, generator=g), torch.randn(4, 3, generator=g)]
    return {
        "nested": torch.nested.nested_tensor(parts),
        "jagged": torch.nested.nested_tensor(parts, layout=torch.jagged),
        "sparse_coo": torch.randn(4, 4, generator=g).relu().to_sparse(),
        "sparse_coo_large": big.relu().to_sparse(),
        "sparse_csr": torch.randn(4, 4, generator=g).relu().to_sparse_csr(),
        "quantized": torch.quantize_per_tensor(torch.randn(8, generator=g), 0.1, 0, torch.qint8),
        "conj": torch.randn(4, dtype=torch.cfloat, generator=g).conj(),
        "conj_large": torch.randn(100_000, dtype=torch.cfloat, generator=g).conj(),
        "neg": torch.randn(4, dtype=torch.cfloat, generator=g).conj().imag,
        "subclass": torch.randn(4, generator=g).as_subclass(TaggedTensor),
        "parameter": torch.nn.Parameter(torch.randn(4, generator=g)),
        "non_contiguous": big.t(),
        "empty": torch.empty(0, 5),
        "bool": torch.tensor([True, False]),
        "bfloat16": torch.randn(5, generator=g).to(torch.bfloat16),
        "requires_grad": torch.randn(3, generator=g).requires_grad_(),
    }


class TensorKinds(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return tensor_kinds()


class SharedCounterDataset(RangeDataset):
    """Counts the samples loaded, across every worker, in a ``multiprocessing`` Value."""

    def __init__(self, n: int, ctx: Any) -> None:
        super().__init__(n)
        self.count = ctx.Value("i", 0, lock=True)

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.count.get_lock():
            self.count.value += 1
        return super().__getitem__(i)


class HalvesIterable(torch.utils.data.IterableDataset[tuple[int, int]]):
    """Each of the workers yields its contiguous part of ``range(n)`` as ``(worker_id, i)``; the
    item at ``n // 2`` (the second worker's first, with two) takes ``slow_s`` seconds."""

    def __init__(self, n: int, slow_s: float) -> None:
        self.n, self.slow_s = n, slow_s

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        per = -(-self.n // workers)
        for i in range(wid * per, min((wid + 1) * per, self.n)):
            if i == self.n // 2:
                time.sleep(self.slow_s)
            yield wid, i


def private_dirty_kb() -> int:
    """This process's private written memory, in kB (Linux)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    raise RuntimeError("no Private_Dirty line in /proc/self/smaps_rollup")


class CollectGarbageDataset(Dataset[list[int]]):
    """Item i: the worker's private memory in kB before and after a full garbage collection."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> list[int]:
        import gc

        before = private_dirty_kb()
        gc.collect()
        return [before, private_dirty_kb()]


class GcFrozenDataset(RangeDataset):
    """Each sample: whether this dataset object is out of the garbage collector's reach (frozen:
    not among the objects it tracks), and whether the collector still runs there."""

    def __getitem__(self, index: int) -> torch.Tensor:
        import gc

        tracked = any(o is self for o in gc.get_objects())
        return torch.tensor([int(not tracked), int(gc.isenabled())])


class SchedDataset(RangeDataset):
    """Each sample: the scheduling policy and niceness of the thread that loads it."""

    def __getitem__(self, index: int) -> torch.Tensor:
        import os

        return torch.tensor([os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)])
