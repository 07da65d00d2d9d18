"""How a result crosses from a worker to the main process. Runs in: both.

A batch is pickled *in the worker* into ``bytes`` and the executor only moves those bytes.
Tensors below :data:`INLINE_TENSOR_BYTES` travel inline (a memcpy); larger ones travel through
shared memory and never through the pipe: their descriptors go ahead on the worker's
:class:`~aioloader._channel.FdChannel`, and a batch built in one of the pool's reused buffers
(:func:`batch_buffer`, see :mod:`aioloader._buffers`) is handed back to the pool once the
consumer drops it. torch's own reduction remains the fallback (special tensors, the
``file_system`` sharing strategy, a full channel). A batch of many Python objects is pickled in
pieces that the main process's loop rebuilds a bounded stretch at a time (:class:`PieceDecoder`).
"""

from __future__ import annotations

import copyreg
import ctypes
import errno
import io
import math
import os
import pickle
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from ._buffers import BufferPool, WorkerEnd, pool_of, release_dropped, worker_end
from ._channel import MAX_FDS_PER_RESULT, ChannelEnd, FdChannel, close_all, find_channel

__all__ = (
    "INLINE_TENSOR_BYTES",
    "PieceDecoder",
    "dumps_result",
    "loads_result",
)

#: Tensors smaller than this are copied into the result bytes instead of shared memory. Measured
#: on 2 cores, 2 workers, one tensor per batch (batches/s, inline vs shared memory):
#: 16 KiB 3500 vs 1500, 64 KiB 3100 vs 1560, 256 KiB 2200 vs 1340, 384 KiB 1280 vs 1060,
#: 512 KiB 870 vs 1140, 1 MiB 650 vs 1540. The descriptor hand-over of a segment costs more than
#: copying up to ~400 KiB; 256 KiB keeps a margin below that crossover. (Measured when every
#: descriptor took a connection to the worker; with FdChannel the crossover is likely lower, not
#: re-measured.)
INLINE_TENSOR_BYTES = 256 * 1024

#: The protocol of every pickle that crosses between the processes.
PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


def _rebuild_inline_tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    if data:
        ctypes.memmove(out.data_ptr(), data, len(data))
    return out


class _Receiving(threading.local):
    # Per thread, while loads_result runs: descriptors taken per (channel key, tag), the
    # storages rebuilt from them (views of one storage share it, as in the worker), and the
    # pool entries tracked for the result.
    fds: dict[tuple[int, int, int], list[int]] | None = None
    storages: dict[tuple[int, int, int, int], torch.UntypedStorage] | None = None
    tracked: list[tuple[BufferPool, int]] | None = None


_receiving = _Receiving()


def _rebuild_channel_tensor(
    key: int,
    tag: tuple[int, int],
    slot: int,
    nbytes: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    offset: int,
    pool_slot: int = -1,
) -> torch.Tensor:
    got, storages = _receiving.fds, _receiving.storages
    if got is None or storages is None:
        raise RuntimeError("aioloader bug: a shared-memory tensor unpickled outside loads_result")
    storage = storages.get((key, *tag, slot))
    if storage is None:
        channel = find_channel(key)
        if channel is None:
            raise OSError(errno.ENOENT, "the worker pool that sent this batch is closed")
        pool = pool_of(channel)
        try:
            fds = got.get((key, *tag))
            if fds is None:
                fds = got[(key, *tag)] = channel.take(tag)
            storage = _map_received(fds[slot], nbytes)
        except BaseException:
            if pool is not None:
                pool.lost(pool_slot)
            raise
        storages[(key, *tag, slot)] = storage
        if pool is not None and pool_slot != -1:
            tensor_bytes = math.prod(shape) * dtype.itemsize
            entry = pool.received(channel, storage, fds[slot], pool_slot, tensor_bytes)
            if _receiving.tracked is not None:
                _receiving.tracked.append((pool, entry))
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


def _map_received(fd: int, nbytes: int) -> torch.UntypedStorage:
    try:
        return torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # type: ignore[attr-defined,no-any-return]
    except RuntimeError as exc:
        # It duplicates the descriptor (ours is valid: it was just received), so a failure is
        # the descriptor limit.
        if "could not duplicate" in str(exc) or "Too many open files" in str(exc):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE)) from exc
        raise


def is_plain_cpu_tensor(t: torch.Tensor) -> bool:
    """A dense CPU tensor of torch's own type, not needing grad, not quantized, not nested.

    Only such a tensor is one storage read with (shape, stride, offset): the raw copy and the
    channel are for it alone. A nested tensor of the strided layout is of type ``torch.Tensor``
    with layout ``torch.strided`` too, but it has no single shape, so it is excluded by name.
    """
    return (
        type(t) is torch.Tensor
        and t.layout is torch.strided
        and not t.is_nested
        and t.device.type == "cpu"
        and not t.requires_grad
        and not t.is_quantized
    )


# ForkingPickler's table holds torch's storage/event reductions; tensors get _TensorReducer.
_DISPATCH_TABLE = copyreg.dispatch_table.copy()
_DISPATCH_TABLE.update(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]


class _TensorReducer:
    """How one result's tensors are pickled; collects the descriptors to send with it.

    Kept apart from the pickler (which refers to it through its dispatch table) so that no
    reference cycle keeps the batch's storages alive in the worker after pickling.
    """

    def __init__(
        self, channel: WorkerEnd | None, tag: tuple[int, int], pool: WorkerEnd | None = None
    ) -> None:
        self._channel = channel
        # Without a channel, a tensor in one of the pool's buffers is copied out: the buffer is
        # reused as soon as this task ends, and only the channel tells when the main process
        # is done with it.
        self._pool = pool
        self._tag = tag
        #: Descriptors to send with this result, and each storage's slot among them.
        self.fds: list[int] = []
        self._slots: dict[int, int] = {}
        self._keep: list[torch.UntypedStorage] = []  # each fd stays open until sent
        #: What the pool is told of each storage sent: data_ptr -> WorkerEnd.tag_of.
        self.pool_tags: dict[int, int] = {}

    def __call__(self, t: torch.Tensor) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if t.is_nested or t.layout is not torch.strided:
            # Nested (no sizes, no single storage), sparse, mkldnn: torch's own reduction, as
            # its DataLoader does.
            return reduce_tensor(t)  # type: ignore[no-untyped-call,no-any-return]
        if t.is_quantized:
            # torch's reduction loses the quantizer (its own DataLoader delivers a tensor whose
            # q_scale() fails, or loses the worker): pickle it as torch.save would, its storage
            # still through shared memory.
            return t.__reduce_ex__(PICKLE_PROTOCOL)  # type: ignore[no-untyped-call,no-any-return]
        nbytes = t.numel() * t.element_size()
        plain = is_plain_cpu_tensor(t)
        if nbytes < INLINE_TENSOR_BYTES and plain:
            # A conjugated or negated view is lazy: its memory holds the values before the flip,
            # and contiguous() keeps the flag. Materialise it, or the raw bytes would be wrong.
            c = t.resolve_conj().resolve_neg().contiguous()
            data = ctypes.string_at(c.data_ptr(), nbytes) if nbytes else b""
            return _rebuild_inline_tensor, (data, t.dtype, tuple(t.shape))
        if t.is_conj() or t.is_neg():
            # torch's reduction drops the lazy flag (the receiver would see unflipped values),
            # and a storage carries none: send the materialised values.
            t = t.resolve_conj().resolve_neg()
        channel = self._channel
        if (
            channel is not None
            and plain
            and torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # type: ignore[no-untyped-call]
        ):
            storage = t.untyped_storage()
            slot = self._slots.get(storage.data_ptr())
            if slot is None and len(self.fds) < MAX_FDS_PER_RESULT:
                # Moves the storage into shared memory unless it is there already (default_collate
                # builds batches there in a worker); the descriptor stays the storage's own.
                fd, _size = storage._share_fd_cpu_()
                slot = self._slots[storage.data_ptr()] = len(self.fds)
                self.fds.append(fd)
                self._keep.append(storage)
            if slot is not None:
                ptr = storage.data_ptr()
                pool_slot = self.pool_tags[ptr] = channel.tag_of(ptr)
                return _rebuild_channel_tensor, (
                    channel.key,
                    self._tag,
                    slot,
                    storage.nbytes(),
                    t.dtype,
                    tuple(t.shape),
                    t.stride(),
                    t.storage_offset(),
                    pool_slot,
                )
        pool = channel or self._pool
        if (
            pool is not None
            and t.layout is torch.strided
            and t.untyped_storage().data_ptr() in pool.slot_of
        ):
            t = t.clone()  # a pool buffer leaves only through the channel (see __init__)
        # Special tensors, or no channel: torch's own reduction, which moves the storage into
        # shared memory and has the receiver fetch its descriptor from this process.
        return reduce_tensor(t)  # type: ignore[no-untyped-call,no-any-return]


_worker_channel: WorkerEnd | None = None


def set_worker_channel(channel: FdChannel | ChannelEnd | None) -> None:
    """In a worker: send large tensors' descriptors through ``channel`` (None: torch's way)."""
    global _worker_channel
    if _worker_channel is not None:
        _worker_channel.close()
    _worker_channel = None if channel is None else worker_end(channel)


def dumps_result(obj: object, tag: tuple[int, int] = (-1, -1)) -> bytes:
    """Pickle a batch for the trip to the main process (small tensors inline, large ones shared).

    In a worker with a channel, the descriptors of large tensors are sent on it, tagged ``tag``
    (``(epoch, send_idx)``, unique among the results of this worker), before this returns.
    """
    channel = _worker_channel
    reducer = _TensorReducer(channel, tag)
    data = _dumps(obj, reducer)
    if reducer.fds:
        assert channel is not None
        if channel.send(tag, reducer.fds):
            channel.sent(reducer.pool_tags)
        else:
            # The channel is full or gone: pickle again the way torch does.
            data = _dumps(obj, _TensorReducer(None, tag, pool=channel))
    return data


def collate_into_buffer(batch: list[torch.Tensor]) -> torch.Tensor | None:
    """In a worker: ``torch.stack(batch)`` into :func:`batch_buffer`, or None (tensors that are
    not plain CPU tensors: torch's own collation handles them)."""
    elem = batch[0]
    if not all(is_plain_cpu_tensor(x) for x in batch):
        return None
    return torch.stack(batch, 0, out=batch_buffer((len(batch), *elem.shape), elem.dtype))


def pool_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """In a worker: an uninitialised contiguous CPU tensor in one of the pool's free buffers,
    or None (no pool, or every buffer in use: see :meth:`WorkerEnd.acquire`). A buffer not
    sent with the task's result is freed at the task's end (:func:`release_unsent`)."""
    channel = _worker_channel
    if channel is None:
        return None
    try:
        storage = channel.acquire(math.prod(shape) * dtype.itemsize)
    except Exception:  # the pool is an optimisation: never fail a batch for it
        return None
    if storage is None:
        return None
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, _contiguous_strides(shape))


def batch_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """In a worker: :func:`pool_buffer`, else a fresh shared-memory segment (what
    ``default_collate`` stacks into in a worker), which the pool may keep once its batch is
    dropped."""
    out = pool_buffer(shape, dtype)
    if out is None:
        storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)  # type: ignore[no-untyped-call]
        out = torch.empty(0, dtype=dtype).set_(storage, 0, shape, _contiguous_strides(shape))
        if _worker_channel is not None:
            _worker_channel.made_fresh(storage)
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return tuple(stride)


def release_unsent() -> None:
    """In a worker, after each task: free the pool buffers its result did not take, and
    forget its fresh buffers."""
    if _worker_channel is not None:
        _worker_channel.release_unsent()


def _dumps(obj: object, reducer: _TensorReducer) -> bytes:
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=PICKLE_PROTOCOL)
    table = _DISPATCH_TABLE.copy()
    table[torch.Tensor] = reducer
    pickler.dispatch_table = table
    if _weight(obj, 0) < SPLIT_MIN_OBJECTS:
        pickler.dump(obj)
        return buf.getvalue()
    # Many Python objects: pickled in pieces the main process's loop can rebuild one at a time.
    buf.write(_PIECES_HEADER.pack(_PIECES_MAGIC, 0))
    pieces: list[Any] = []
    skeleton = _split(obj, 0, pieces, {})
    for piece in pieces:
        pickler.dump(piece)
    pickler.dump(skeleton)  # the containers, rebuilt from the pieces (memo references)
    data = buf.getbuffer()
    _PIECES_HEADER.pack_into(data, 0, _PIECES_MAGIC, len(pieces) + 1)
    del data
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# Results made of many Python objects: pickled in pieces, rebuilt a piece at a time
#
# Unpickling a batch of text or tabular data (tens of thousands of small objects) takes
# milliseconds of the main process's event loop in one go, and a thread cannot take that off the
# loop (it holds the GIL throughout). So the worker pickles such a batch as a sequence of pieces
# (runs of a list's elements, of a dict's items, a sample's own pieces) with one pickler, and then
# a skeleton that rebuilds the containers from them: each piece is one ``load()`` of one
# unpickler, which keeps its memo across loads, so objects shared between pieces stay shared. The
# loop loads pieces for at most :data:`DECODE_STEP_S` at a time (see :class:`PieceDecoder`).
# Tensor batches are not split: default_collate's few tensors weigh next to nothing.

#: A piece holds about this many objects (by :func:`_weight`'s estimate): 0.1-0.3 ms to unpickle
#: short strings on the 2-core VM (30-100 ns each, the higher figure with the workers busy).
PIECE_OBJECTS = 2048

#: Results estimated to hold fewer objects than this are pickled in one piece, as before.
SPLIT_MIN_OBJECTS = 2 * PIECE_OBJECTS

#: The main process's loop rebuilds pieces of results for at most about this long per turn,
#: all waiting batches together, before it lets its other callbacks run (plus the piece under
#: way when the time is up). The `text` workload on the quiet 2-core VM, three runs each,
#: alternating: loop-lag p99 1.05-1.09 ms at 0.15 ms and 1.08-1.16 at 0.2, at the same
#: throughput (workers at SCHED_IDLE, batches freed stepwise, see _release).
DECODE_STEP_S = 0.00015

#: Containers nested deeper than this are pieces of their own, whatever their size.
_SPLIT_DEPTH = 4

# A pickle of protocol 2+ starts with PROTO (0x80); a result in pieces starts with this header:
# the magic and the number of loads (pieces, then the skeleton).
_PIECES_MAGIC = b"\x00AIOPCS\x00"
_PIECES_HEADER = struct.Struct("=8sI")


def _weight(obj: object, depth: int) -> int:
    """About how many objects unpickling ``obj`` makes: exact lists, tuples and dicts are
    looked into (a sample of their elements, to a bounded depth), anything else counts one, a
    long string a little more."""
    t = type(obj)
    if t is list or t is tuple:
        seq: Any = obj
        n = len(seq)
        if n == 0 or depth >= _SPLIT_DEPTH:
            return 1 + n
        if n <= 4:
            return 1 + sum(_weight(x, depth + 1) for x in seq)
        probe = _weight(seq[0], depth + 1) + _weight(seq[n // 2], depth + 1)
        return 1 + (n * (probe + _weight(seq[-1], depth + 1))) // 3
    if t is dict:
        d: Any = obj
        n = len(d)
        if n == 0 or depth >= _SPLIT_DEPTH:
            return 1 + 2 * n
        values = iter(d.values())
        probe = sum(_weight(next(values), depth + 1) for _ in range(min(n, 3)))
        return 1 + n + (n * probe) // min(n, 3)
    if t is str or t is bytes:
        return 1 + len(obj) // 1024  # type: ignore[arg-type]
    return 1


def _split(obj: Any, depth: int, pieces: list[Any], seen: dict[int, _Join]) -> _Join:
    """Add the pieces of container ``obj`` to ``pieces``; return its skeleton, which rebuilds it
    from them. A container met twice gets one skeleton (one object again once rebuilt)."""
    known = seen.get(id(obj))
    if known is not None:
        return known
    segments: list[Any] = []
    t = type(obj)
    if t is dict:
        run: dict[Any, Any] = {}
        run_w = 0
        for k, v in obj.items():
            w = _weight(v, depth + 1)
            if w > PIECE_OBJECTS and depth + 1 < _SPLIT_DEPTH and type(v) in _SPLITTABLE:
                if run:
                    pieces.append(run)
                    segments.append(run)
                    run, run_w = {}, 0
                segments.append({k: _split(v, depth + 1, pieces, seen)})
                continue
            run[k] = v
            run_w += w + 1
            if run_w >= PIECE_OBJECTS:
                pieces.append(run)
                segments.append(run)
                run, run_w = {}, 0
        if run:
            pieces.append(run)
            segments.append(run)
    else:
        n = len(obj)
        each = max(1, _weight(obj, depth) // max(1, n))
        if each * 2 <= PIECE_OBJECTS:
            # Small elements: runs of a fixed count, sliced without looking at each one.
            step = PIECE_OBJECTS // each
            for i in range(0, n, step):
                part = obj[i : i + step]
                pieces.append(part)
                segments.append(part)
        else:
            for x in obj:
                if (
                    depth + 1 < _SPLIT_DEPTH
                    and type(x) in _SPLITTABLE
                    and _weight(x, depth + 1) > PIECE_OBJECTS
                ):
                    segments.append([_split(x, depth + 1, pieces, seen)])
                    continue
                part = [x]
                pieces.append(part)
                segments.append(part)
    skeleton = seen[id(obj)] = _Join(t, segments)
    return skeleton


_SPLITTABLE = (list, tuple, dict)


class _Join:
    """A container's skeleton: pickles as a call that joins its segments (pieces already loaded,
    memo references here, or the skeletons of its split elements)."""

    __slots__ = ("kind", "segments")

    def __init__(self, kind: type, segments: list[Any]) -> None:
        self.kind = kind
        self.segments = segments

    def __reduce__(self) -> tuple[Any, ...]:
        if self.kind is dict:
            return _join_dict, tuple(self.segments)
        return _join_seq, (self.kind is tuple, *self.segments)


def _join_seq(as_tuple: bool, *segments: Any) -> Any:
    out: list[Any] = []
    for seg in segments:
        out += seg
    return tuple(out) if as_tuple else out


def _join_dict(*segments: dict[Any, Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for seg in segments:
        out.update(seg)
    return out


def in_pieces(data: bytes) -> bool:
    """Whether result ``data`` was pickled in pieces (see :class:`PieceDecoder`)."""
    return data[:8] == _PIECES_MAGIC


class PieceDecoder:
    """Rebuilds a result of :func:`dumps_result` a bounded stretch at a time.

    ``step()`` loads pieces for about ``budget`` seconds and says whether the result is complete
    (then in :attr:`value`); a result not in pieces is rebuilt in one step. ``close()`` gives back
    what an unfinished one took (the descriptors of its shared-memory tensors). Not thread-safe:
    one thread steps it (between steps, any other result may be rebuilt on that thread).
    Raises as :func:`loads_result` does.
    """

    def __init__(self, data: bytes, tracked: list[tuple[BufferPool, int]] | None = None) -> None:
        # Buffers dropped since the last result go to workers now, whichever worker this result
        # is from: a worker's next batch finds a free buffer sooner.
        release_dropped()
        self.value: Any = None
        self._tracked = tracked
        self._fds: dict[tuple[int, int, int], list[int]] = {}
        self._storages: dict[tuple[int, int, int, int], torch.UntypedStorage] = {}
        self._unpickler: pickle.Unpickler | None = None
        self._data: bytes | None = None
        if in_pieces(data):
            _, self._left = _PIECES_HEADER.unpack_from(data)
            view = memoryview(data)[_PIECES_HEADER.size :]
            self._unpickler = pickle.Unpickler(io.BytesIO(view))
        else:
            self._left = 1
            self._data = data  # one pickle.loads, as before pieces existed
        #: Pieces loaded so far (for tests and benchmarks).
        self.loads = 0

    @property
    def done(self) -> bool:
        return bool(self._left == 0)

    def step(self, budget: float = math.inf) -> bool:
        """Load pieces until the result is complete or ``budget`` seconds have passed; whether
        the result is complete."""
        if self._left == 0:
            return True
        outer = (_receiving.fds, _receiving.storages, _receiving.tracked)
        _receiving.fds, _receiving.storages = self._fds, self._storages
        _receiving.tracked = self._tracked
        try:
            deadline = time.perf_counter() + budget
            while True:
                if self._unpickler is not None:
                    value = self._unpickler.load()
                else:
                    assert self._data is not None
                    value, self._data = pickle.loads(self._data), None
                self._left -= 1
                self.loads += 1
                if self._left == 0:
                    self.value = value
                    self._unpickler = None  # its memo holds the batch
                    self.close()
                    return True
                if time.perf_counter() >= deadline:
                    return False
        except BaseException:
            self._left = 0
            self._unpickler = None
            self.close()
            raise
        finally:
            _receiving.fds, _receiving.storages, _receiving.tracked = outer

    def close(self) -> None:
        """Close the descriptors taken (the storages hold duplicates of their own), and drop
        what was rebuilt of an unfinished result."""
        if self._left:
            self._unpickler = None
        taken, self._fds = self._fds, {}
        self._storages = {}
        for fds in taken.values():
            close_all(fds)


def loads_result(data: bytes, tracked: list[tuple[BufferPool, int]] | None = None) -> Any:
    """Rebuild a batch pickled by :func:`dumps_result` in one go. Thread-safe.

    ``tracked`` receives ``(pool, entry)`` for each pool buffer the batch holds: pass them to
    :func:`~aioloader._buffers.delivered` when the consumer gets the batch.

    Raises ``OSError`` if a shared-memory tensor's descriptor cannot be received (``EMFILE`` at
    the descriptor limit).
    """
    if in_pieces(data):
        decoder = PieceDecoder(data, tracked)
        try:
            decoder.step()
        finally:
            decoder.close()
        return decoder.value
    # Buffers dropped since the last result go to workers now, whichever worker this result is
    # from: a worker's next batch finds a free buffer sooner.
    release_dropped()
    outer = (_receiving.fds, _receiving.tracked)
    _receiving.fds, _receiving.storages = {}, {}
    _receiving.tracked = tracked
    try:
        return pickle.loads(data)
    finally:
        taken = _receiving.fds
        _receiving.fds, _receiving.tracked = outer
        _receiving.storages = None
        for fds in taken.values():
            # The storages hold duplicates of their own.
            close_all(fds)
