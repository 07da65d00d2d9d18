"""How objects cross between the main process and the workers. Runs in: both.

Two directions, two policies:

* **Results (worker -> main).** A batch is pickled *in the worker* into ``bytes`` and the executor
  only moves those bytes. Tensors below :data:`INLINE_TENSOR_BYTES` travel inline (a memcpy);
  larger ones travel through shared memory and never through the pipe. Their descriptors go
  in-band: each worker has a :class:`FdChannel` (a Unix socket pair), and the worker sends one
  message holding a result's descriptors right *before* the result itself, so when the main
  process reads the result the descriptors are already waiting. torch's own reduction instead
  makes the receiver connect to a listener thread in the (busy, niced) worker and authenticate
  for every descriptor: several round trips and thread wake-ups on both sides per batch. That
  path remains the fallback (special tensors, the ``file_system`` sharing strategy, a full
  channel).
* **Worker payload (main -> workers, spawn/forkserver only).** The dataset, ``collate_fn`` and
  ``worker_init_fn`` are pickled *once* into an unnamed file that every worker reads in parallel,
  instead of once per worker through each worker's start-up pipe. Tensors of at least
  :data:`SHARED_PAYLOAD_TENSOR_BYTES` are taken out of that file and handed over through shared
  memory, so N workers do not hold N copies of a preloaded tensor dataset. Objects that plain
  pickle cannot carry (lambdas, classes defined in a notebook or ``python -c``) are carried with
  cloudpickle.
"""

from __future__ import annotations

import array
import contextlib
import copyreg
import ctypes
import errno
import io
import itertools
import math
import mmap
import os
import pickle
import secrets
import socket
import struct
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef, reduce_tensor

__all__ = (
    "INLINE_TENSOR_BYTES",
    "SHARED_PAYLOAD_TENSOR_BYTES",
    "FdChannel",
    "PayloadFile",
    "dump_payload",
    "dumps_result",
    "load_payload",
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

#: Dataset tensors at least this large are shared with the workers instead of pickled by value.
SHARED_PAYLOAD_TENSOR_BYTES = 1024 * 1024

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL


# --------------------------------------------------------------------------------------------------
# Results: worker -> main


#: At most this many descriptors travel with one result (the kernel's limit per message is 253);
#: further large tensors of the same batch take torch's own path.
_MAX_FDS_PER_RESULT = 250

_HEADER = struct.Struct("=qqi")  # (epoch, send_idx, number of descriptors)


class FdChannel:
    """One worker's descriptor channel: a ``SOCK_SEQPACKET`` pair, one message per result.

    Created in the main process before the worker starts. The worker sends, for a result tagged
    ``(epoch, send_idx)``, one message with that tag and the descriptors of its shared-memory
    storages, before it returns the result; the main process takes the message when it unpickles
    the result. A message taken for a later result (results unpickled out of order) is kept for
    it; unclaimed ones are closed with the channel. Thread-safe on the receiving side.
    """

    #: Messages kept for results not unpickled yet; beyond this the oldest are closed.
    MAX_PENDING = 64

    def __init__(self, in_use: Any = None) -> None:
        """``in_use``: a shared byte array of :data:`POOL_SLOTS` (``ctx.RawArray``) that turns
        on the worker's pool of reused batch buffers; None leaves it off."""
        self.key = secrets.randbits(62)
        self.in_use = in_use
        # Batches built in the worker's pool and still alive here: token -> (weak reference to
        # the storage, pool slot). Whoever pops a token (the storage's finaliser or
        # release_dropped, on any thread) frees the slot: dict.pop is atomic, so exactly once.
        self._outstanding: dict[int, tuple[Any, int]] = {}
        self._tokens = itertools.count()
        self.main_end, self.worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.main_end.setblocking(False)
        self._lock = threading.Lock()
        # tag -> descriptor lists received for it, oldest first
        self._pending: dict[tuple[int, int], list[list[int]]] = {}
        self._npending = 0
        _channels[self.key] = self

    def __reduce__(self) -> tuple[Any, ...]:
        # Only the worker's end travels to a worker (spawn/forkserver pass the descriptor).
        return (_WorkerEnd, (self.key, self.worker_end, self.in_use))

    def track_pooled(self, storage: torch.UntypedStorage, slot: int) -> None:
        """``storage`` maps the worker's pool buffer ``slot``: free it once no tensor uses it.

        The slot is freed the moment the last tensor or view of ``storage`` in this process goes
        (a finaliser on the storage, run by whichever thread drops it), so the worker's next
        batch can reuse it; :meth:`release_dropped` is the fallback if the finaliser cannot
        tell (see :func:`_sole_holder_count`).
        """
        ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        token = next(self._tokens)
        self._outstanding[token] = (ref, slot)
        limit = _sole_holder_count()
        if limit >= 0:
            # Not a bound method: a batch kept after aclose() must not keep the channel alive.
            fin = weakref.finalize(
                storage,
                _release_if_sole,
                self._outstanding,
                self.in_use,
                token,
                limit,
                os.getpid(),
            )
            fin.atexit = False  # at exit the batch may still be alive: nothing to hand back

    def release_dropped(self) -> None:
        """Hand back to the worker every pool buffer no tensor of this process uses any more.

        A storage's weak reference expires only once every tensor and view of it is gone, so a
        buffer is never rewritten while anything here can read it. Called with every result
        received, as a fallback: the storages' finalisers normally hand buffers back sooner.
        """
        in_use = self.in_use
        if in_use is None:
            return
        # Finalisers may pop entries meanwhile, on any thread or inside a garbage collection.
        # dict.copy() copies in one step that allocates no object per entry, so no collection
        # (Python 3.11 may run one on any allocation) can change the dict half-way through it.
        for token, (ref, slot) in self._outstanding.copy().items():
            if ref.expired() and self._outstanding.pop(token, None) is not None:
                in_use[slot] = 0

    def close_worker_end(self) -> None:
        """Close the main process's copy of the worker's end, once the worker has started."""
        self.worker_end.close()

    def close(self) -> None:
        """Close both ends and every descriptor received but not claimed."""
        _channels.pop(self.key, None)
        with self._lock:
            for lists in self._pending.values():
                for fds in lists:
                    _close_all(fds)
            self._pending.clear()
            self.main_end.close()
        self.worker_end.close()

    def take(self, tag: tuple[int, int]) -> list[int]:
        """The descriptors sent for ``tag``; the caller owns (and closes) them.

        Raises ``OSError`` (``EMFILE`` if this process ran out of descriptors while receiving
        them, ``ENOENT`` if no message for ``tag`` was sent).
        """
        with self._lock:
            kept = self._pending.get(tag)
            if kept:
                self._npending -= 1
                fds = kept.pop(0)
                if not kept:
                    del self._pending[tag]
                return fds
        with self._lock:
            while True:
                msg_tag, fds = self._recv()  # raises OSError once the socket is empty
                if msg_tag == tag:
                    return fds
                self._pending.setdefault(msg_tag, []).append(fds)
                self._npending += 1
                if self._npending > self.MAX_PENDING:
                    oldest = next(iter(self._pending))
                    _close_all(self._pending[oldest].pop(0))
                    self._npending -= 1
                    if not self._pending[oldest]:
                        del self._pending[oldest]

    def _recv(self) -> tuple[tuple[int, int], list[int]]:
        fds = array.array("i")
        try:
            msg, anc, flags, _ = self.main_end.recvmsg(
                _HEADER.size, socket.CMSG_SPACE(_MAX_FDS_PER_RESULT * fds.itemsize)
            )
        except BlockingIOError:
            raise OSError(errno.ENOENT, "no descriptors were sent with this result") from None
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
        epoch, send_idx, n = _HEADER.unpack(msg)
        if flags & socket.MSG_CTRUNC or len(fds) != n:
            # The kernel drops the descriptors it could not install (the process is at its
            # descriptor limit).
            _close_all(list(fds))
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return (epoch, send_idx), list(fds)


_channels: weakref.WeakValueDictionary[int, FdChannel] = weakref.WeakValueDictionary()

_sole_holder: int | None = None


def _sole_holder_count() -> int:
    """The use count a storage shows, while a finaliser on its Python object runs, when nothing
    else holds it; -1 if this torch calls such a finaliser while tensors still hold the storage.

    torch keeps one Python object per storage alive for as long as any tensor uses it, so a
    finaliser on it runs only once the storage itself is being freed. Whether that object still
    counts its own reference while its finalisers run differs between torch versions, so it is
    measured once: a finaliser that sees at most this count is the storage's last holder.
    """
    global _sole_holder
    if _sole_holder is None:
        seen: list[int] = []
        probe = torch.UntypedStorage(8)  # type: ignore[no-untyped-call]
        ref = StorageWeakRef(probe)  # type: ignore[no-untyped-call]
        use_count = torch._C._storage_Use_Count
        weakref.finalize(probe, lambda: seen.append(use_count(ref.cdata)))
        view = torch.empty(0, dtype=torch.uint8).set_(probe, 0, (8,), (1,))
        del probe
        early = bool(seen)  # the finaliser ran while a tensor still held the storage
        del view
        _sole_holder = seen[0] if seen and not early and seen[0] <= 1 else -1
    return _sole_holder


def _release_if_sole(
    outstanding: dict[int, tuple[Any, int]], in_use: Any, token: int, limit: int, pid: int
) -> None:
    # A storage's finaliser: free its pool slot if nothing else holds the storage any more.
    # Runs on whichever thread dropped the last tensor, possibly inside garbage collection, so
    # it takes no lock.
    if os.getpid() != pid:
        # A forked child inherited the batch and drops its copy: the parent's may still be in
        # use, and the slot is shared memory that the worker would then overwrite.
        return
    entry = outstanding.get(token)
    if entry is None or torch._C._storage_Use_Count(entry[0].cdata) > limit:
        return
    if outstanding.pop(token, None) is not None:
        in_use[entry[1]] = 0


#: Reused batch buffers per worker, at most. A batch that finds none free (the consumer and the
#: queue hold them all) is collated into a fresh segment, as torch does.
POOL_SLOTS = 3

#: A worker keeps more than one buffer only while they fit in this many bytes together: a
#: buffer stays resident while the worker lives, in use or not. On the ``big`` workload (38.5 MB
#: batches, 2 workers, batches built sample by sample, buffers handed back as the consumer drops
#: them; ``--quick``, shared 2-core machine) 1 buffer gave 1.3-1.9x torch's throughput at
#: 0.85-1.10x its peak memory (PSS of the process tree); 2 gave 2.3-3.2x at 1.11-1.25x; 3 gave
#: 2.7-3.5x at 1.13-1.23x; none (a fresh segment per batch) 1.0-1.7x at 0.77-0.86x.
POOL_BYTES = 64 * 1024 * 1024


def pool_slots(nbytes: int) -> int:
    """How many buffers of ``nbytes`` a worker keeps: 1 to :data:`POOL_SLOTS`, within
    :data:`POOL_BYTES` when more than one."""
    return max(1, min(POOL_SLOTS, POOL_BYTES // max(nbytes, 1)))


class _WorkerEnd:
    """A worker's side of its :class:`FdChannel`, and its pool of reused batch buffers."""

    def __init__(self, key: int, sock: socket.socket, in_use: Any = None) -> None:
        self.key = key
        self.sock = sock
        self.in_use = in_use  # in_use[slot] is 1 from acquire() until the main process frees it
        self.pool: list[torch.UntypedStorage | None] = [None] * POOL_SLOTS
        self.slot_of: dict[int, int] = {}  # a pool storage's data_ptr -> its slot
        self.unsent: list[int] = []  # slots acquired for the current task, not sent yet

    def acquire(self, nbytes: int) -> torch.UntypedStorage | None:
        """A shared-memory buffer of at least ``nbytes`` no one else uses, or None (use a fresh
        one). Its pages are reused from an earlier batch: no allocation, no zero-filling."""
        in_use = self.in_use
        if in_use is None or torch.multiprocessing.get_sharing_strategy() != "file_descriptor":  # type: ignore[no-untyped-call]
            return None
        usable = pool_slots(nbytes)
        for i in range(usable, POOL_SLOTS):
            if self.pool[i] is not None and not in_use[i]:
                # Kept for smaller batches: over the budget at this size, so give its memory back.
                self._drop(i)
        free = [i for i in range(usable) if not in_use[i]]
        if not free:
            return None
        fits = [i for i in free if (st := self.pool[i]) is not None and st.nbytes() >= nbytes]
        slot = fits[0] if fits else free[0]
        storage = self.pool[slot]
        if storage is None or storage.nbytes() < nbytes:
            self._drop(slot)
            storage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
            self.pool[slot] = storage
            self.slot_of[storage.data_ptr()] = slot
        in_use[slot] = 1
        self.unsent.append(slot)
        return storage

    def _drop(self, slot: int) -> None:
        storage = self.pool[slot]
        if storage is not None:
            del self.slot_of[storage.data_ptr()]
            self.pool[slot] = None

    def release_unsent(self) -> None:
        """Free the buffers acquired for a task whose result did not go out through the channel."""
        if self.in_use is not None:
            for slot in self.unsent:
                self.in_use[slot] = 0
        self.unsent.clear()

    def send(self, tag: tuple[int, int], fds: list[int]) -> bool:
        """Send ``fds`` tagged ``tag``; False (nothing sent) if the channel is full or closed."""
        try:
            self.sock.sendmsg(
                [_HEADER.pack(tag[0], tag[1], len(fds))],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
                socket.MSG_DONTWAIT,
            )
        except OSError:
            return False
        return True


def worker_end(channel: FdChannel | _WorkerEnd) -> _WorkerEnd:
    """The worker's side of ``channel``: a forked worker inherits the whole object."""
    if isinstance(channel, FdChannel):
        return _WorkerEnd(channel.key, channel.worker_end, channel.in_use)
    return channel


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _rebuild_inline_tensor(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    if data:
        ctypes.memmove(out.data_ptr(), data, len(data))
    return out


class _Receiving(threading.local):
    # Per thread, while loads_result runs: descriptors taken per (channel key, tag), and the
    # storages rebuilt from them (views of one storage share it, as in the worker).
    fds: dict[tuple[int, int, int], list[int]] | None = None
    storages: dict[tuple[int, int, int, int], torch.UntypedStorage] | None = None


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
        channel = _channels.get(key)
        if channel is None:
            raise OSError(errno.ENOENT, "the worker pool that sent this batch is closed")
        fds = got.get((key, *tag))
        if fds is None:
            fds = got[(key, *tag)] = channel.take(tag)
        try:
            storage = torch.UntypedStorage._new_shared_fd_cpu(fds[slot], nbytes)  # type: ignore[attr-defined]
        except RuntimeError as exc:
            # It duplicates the descriptor (ours is valid: it was just received), so a failure
            # is the descriptor limit.
            if "could not duplicate" in str(exc) or "Too many open files" in str(exc):
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE)) from exc
            raise
        storages[(key, *tag, slot)] = storage
        if pool_slot >= 0:
            channel.track_pooled(storage, pool_slot)
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


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
        self, channel: _WorkerEnd | None, tag: tuple[int, int], pool: _WorkerEnd | None = None
    ) -> None:
        self._channel = channel
        # Without a channel, a tensor in the worker's pool buffers is copied out: the buffer is
        # reused as soon as this task ends, and only the channel tells when the main process
        # is done with it.
        self._pool = pool
        self._tag = tag
        #: Descriptors to send with this result, and each storage's slot among them.
        self.fds: list[int] = []
        self._slots: dict[int, int] = {}
        self._keep: list[torch.UntypedStorage] = []  # each fd stays open until sent
        #: The worker's pool buffers (slots) among them.
        self.pool_slots: set[int] = set()

    def __call__(self, t: torch.Tensor) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if t.is_nested or t.layout is not torch.strided:
            # Nested (no sizes, no single storage), sparse, mkldnn: torch's own reduction, as
            # its DataLoader does.
            return reduce_tensor(t)  # type: ignore[no-untyped-call,no-any-return]
        if t.is_quantized:
            # torch's reduction loses the quantizer (its own DataLoader delivers a tensor whose
            # q_scale() fails, or loses the worker): pickle it as torch.save would, its storage
            # still through shared memory.
            return t.__reduce_ex__(_PICKLE_PROTOCOL)  # type: ignore[no-untyped-call,no-any-return]
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
            if slot is None and len(self.fds) < _MAX_FDS_PER_RESULT:
                # Moves the storage into shared memory unless it is there already (default_collate
                # builds batches there in a worker); the descriptor stays the storage's own.
                fd, _size = storage._share_fd_cpu_()
                slot = self._slots[storage.data_ptr()] = len(self.fds)
                self.fds.append(fd)
                self._keep.append(storage)
            if slot is not None:
                pool_slot = channel.slot_of.get(storage.data_ptr(), -1)
                if pool_slot >= 0:
                    self.pool_slots.add(pool_slot)
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


_worker_channel: _WorkerEnd | None = None


def set_worker_channel(channel: FdChannel | _WorkerEnd | None) -> None:
    """In a worker: send large tensors' descriptors through ``channel`` (None: torch's way)."""
    global _worker_channel
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
            # The main process frees the pool buffers this result carries (track_pooled); any
            # other buffer taken for this task (a streamed batch given up for default_collate)
            # stays in ``unsent`` for release_unsent().
            channel.unsent = [s for s in channel.unsent if s not in reducer.pool_slots]
        else:
            # The channel is full or gone: pickle again the way torch does.
            data = _dumps(obj, _TensorReducer(None, tag, pool=channel))
    return data


def collate_into_pool(batch: list[torch.Tensor]) -> torch.Tensor | None:
    """In a worker: ``torch.stack(batch)`` into a reused pool buffer, or None if there is none
    (no channel, all buffers in use, or tensors that are not plain CPU tensors)."""
    elem = batch[0]
    if not all(is_plain_cpu_tensor(x) for x in batch):
        return None
    out = pool_buffer((len(batch), *elem.shape), elem.dtype)
    if out is None:
        return None
    return torch.stack(batch, 0, out=out)


def pool_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """In a worker: an uninitialised contiguous CPU tensor in one of its free pool buffers, or
    None (no pool, or every buffer in use). A buffer not sent with the task's result is freed
    at the task's end (:func:`release_unsent`)."""
    channel = _worker_channel
    if channel is None or channel.in_use is None:
        return None
    storage = channel.acquire(math.prod(shape) * dtype.itemsize)
    if storage is None:
        return None
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape, _contiguous_strides(shape))


def batch_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """In a worker: :func:`pool_buffer`, else a fresh shared-memory segment (what
    ``default_collate`` stacks into in a worker)."""
    out = pool_buffer(shape, dtype)
    if out is None:
        storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)  # type: ignore[no-untyped-call]
        out = torch.empty(0, dtype=dtype).set_(storage, 0, shape, _contiguous_strides(shape))
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return tuple(stride)


def release_unsent() -> None:
    """In a worker, after each task: free the pool buffers its result did not take."""
    if _worker_channel is not None:
        _worker_channel.release_unsent()


def _dumps(obj: object, reducer: _TensorReducer) -> bytes:
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=_PICKLE_PROTOCOL)
    table = _DISPATCH_TABLE.copy()
    table[torch.Tensor] = reducer
    pickler.dispatch_table = table
    pickler.dump(obj)
    return buf.getvalue()


def loads_result(data: bytes) -> Any:
    """Rebuild a batch pickled by :func:`dumps_result`. Thread-safe.

    Raises ``OSError`` if a shared-memory tensor's descriptor cannot be received (``EMFILE`` at
    the descriptor limit).
    """
    # Buffers dropped since the last result go back to their workers now, whichever worker
    # this result is from: a worker's next batch finds a free buffer sooner.
    for channel in list(_channels.values()):
        channel.release_dropped()
    outer = _receiving.fds
    _receiving.fds, _receiving.storages = {}, {}
    try:
        return pickle.loads(data)
    finally:
        taken = _receiving.fds
        _receiving.fds, _receiving.storages = outer, None
        for fds in taken.values():
            # The storages hold duplicates of their own.
            _close_all(fds)


# --------------------------------------------------------------------------------------------------
# Worker payload: main -> workers

_payload_tensors: list[torch.Tensor] = []  # set by load_payload() while unpickling in a worker


def _shared_payload_tensor(i: int) -> torch.Tensor:
    return _payload_tensors[i]


def _make_payload_pickler(
    base: type[pickle.Pickler], side: list[torch.Tensor]
) -> type[pickle.Pickler]:
    base_table = getattr(base, "dispatch_table", copyreg.dispatch_table)

    def reduce_dataset_tensor(t: torch.Tensor) -> tuple[Any, ...]:
        if t.numel() * t.element_size() >= SHARED_PAYLOAD_TENSOR_BYTES and t.device.type == "cpu":
            side.append(t)
            return _shared_payload_tensor, (len(side) - 1,)
        reduced: tuple[Any, ...] = t.__reduce_ex__(_PICKLE_PROTOCOL)  # type: ignore[no-untyped-call]
        return reduced

    table = dict(base_table)
    table[torch.Tensor] = reduce_dataset_tensor
    return type("_PayloadPickler", (base,), {"dispatch_table": table})


def _main_is_importable() -> bool:
    # spawn and forkserver re-import the parent's __main__ from its file; a notebook, a REPL or
    # `python -c` has no such file, so anything defined there must be pickled by value.
    main = sys.modules.get("__main__")
    return bool(getattr(main, "__file__", None)) or getattr(main, "__spec__", None) is not None


class PayloadFile:
    """An unnamed file holding a pickled payload; crosses to workers as a file descriptor.

    It has no name in any file system, so nothing is left behind even if the process that made
    it is killed. It can be pickled only while a worker process is being started (spawn or
    forkserver), when multiprocessing hands the descriptor to the child.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import context
        from multiprocessing.reduction import DupFd

        if context.get_spawning_popen() is None:
            raise pickle.PicklingError("a PayloadFile travels only with a starting worker")
        return _adopt_payload_fd, (DupFd(self.fd),)


def _adopt_payload_fd(dup: Any) -> PayloadFile:
    return PayloadFile(dup.detach())


def _anonymous_file() -> int:
    try:
        return os.memfd_create("aioloader-payload", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux: an unlinked temporary file
        fd, path = tempfile.mkstemp(prefix=f"aioloader-{os.getpid()}-")
        os.unlink(path)
        return fd


def dump_payload(obj: object) -> tuple[PayloadFile, list[torch.Tensor]]:
    """Pickle ``obj`` once into an unnamed file for workers to read; return it and shared tensors.

    The caller owns the file and closes it when no worker will start again. Raises the pickling
    error, with a note saying what to change, when neither pickle nor cloudpickle can carry it.
    """
    fd = _anonymous_file()
    try:
        with os.fdopen(os.dup(fd), "wb") as f:
            side: list[torch.Tensor] = []
            errors: list[BaseException] = []
            picklers: list[type[pickle.Pickler]] = []
            if _main_is_importable():
                picklers.append(pickle.Pickler)
            import cloudpickle  # type: ignore[import-untyped, unused-ignore]

            picklers.append(cloudpickle.Pickler)
            for base in picklers:
                f.seek(0)
                f.truncate()
                side.clear()
                try:
                    # Writing to the file (not to bytes) lets the GIL go at each 64 KiB frame
                    # the pickler flushes, so the loop runs while a large dataset is pickled,
                    # except while the pickler grows or frees its memo table: single C steps,
                    # 0.2-1 s each at 6 M objects. A persistent_id hook that yields every few
                    # thousand objects cannot split those (and made pickling 2.5x slower).
                    _make_payload_pickler(base, side)(f, protocol=_PICKLE_PROTOCOL).dump(obj)
                    break
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    errors.append(exc)
            else:
                err = errors[-1]
                err.add_note(
                    "aioloader: the dataset, collate_fn or worker_init_fn cannot be sent to worker "
                    "processes started with spawn/forkserver. Define them at module level, make "
                    "them picklable, or use multiprocessing_context='fork'."
                )
                raise err
        return PayloadFile(fd), list(side)
    except BaseException:
        os.close(fd)
        raise


def load_payload(payload: PayloadFile, tensors: list[torch.Tensor]) -> Any:
    """Unpickle a payload written by :func:`dump_payload`. Runs in: a worker process."""
    global _payload_tensors
    _payload_tensors = tensors
    try:
        # mmap, not read(): the workers' descriptors share one file offset.
        with mmap.mmap(payload.fd, 0, prot=mmap.PROT_READ) as view:
            return pickle.loads(view)
    finally:
        _payload_tensors = []
        payload.close()
