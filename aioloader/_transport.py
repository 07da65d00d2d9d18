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
  memory, so N workers do not hold N copies of a preloaded tensor dataset. Classes and functions
  that plain pickle cannot name (lambdas, local functions, anything of ``__main__``) are carried
  by value with cloudpickle; nothing else falls back (an open file or a lock raises torch's error).
"""

from __future__ import annotations

import array
import collections
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
import select
import socket
import struct
import sys
import tempfile
import threading
import time
import types
import weakref
from collections.abc import Callable, Mapping
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

    def __init__(self, pool: BufferPool | None = None, wid: int = 0) -> None:
        """``pool``: the batch buffers worker ``wid`` shares with the other workers of its pool
        (see :class:`BufferPool`); None turns buffer reuse off."""
        self.key = secrets.randbits(62)
        self.pool = pool
        self.wid = wid
        #: Pool buffers this worker was sent the descriptor of: slot -> generation.
        self.known: dict[int, int] = {}
        self.main_end, self.worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.main_end.setblocking(False)
        self._lock = threading.Lock()
        # tag -> descriptor lists received for it, oldest first
        self._pending: dict[tuple[int, int], list[list[int]]] = {}
        self._npending = 0
        _channels[self.key] = self
        if pool is not None:
            pool.attach(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # Only the worker's end travels to a worker (spawn/forkserver pass the descriptor).
        pool = self.pool
        shared = None if pool is None else (pool.state, pool.gens, pool.wants)
        return (_WorkerEnd, (self.key, self.worker_end, self.wid, shared))

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
        try:
            msg, anc, flags, _ = self.main_end.recvmsg(
                _HEADER.size, socket.CMSG_SPACE(_MAX_FDS_PER_RESULT * _FD_SIZE)
            )
        except BlockingIOError:
            raise OSError(errno.ENOENT, "no descriptors were sent with this result") from None
        fds = _received_fds(anc)
        epoch, send_idx, n = _HEADER.unpack(msg)
        if flags & socket.MSG_CTRUNC or len(fds) != n:
            # The kernel drops the descriptors it could not install (the process is at its
            # descriptor limit).
            _close_all(fds)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return (epoch, send_idx), fds


_FD_SIZE = array.array("i").itemsize


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors in a ``recvmsg`` result's ancillary data (``SCM_RIGHTS``)."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return list(fds)


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


def _release_if_sole(pool_ref: weakref.ref[BufferPool], token: int, limit: int, pid: int) -> None:
    # A storage's finaliser: free its pool slot if nothing else holds the storage any more.
    # Runs on whichever thread dropped the last tensor, possibly inside garbage collection, so
    # it waits for no lock.
    if os.getpid() != pid:
        # A forked child inherited the batch and drops its copy: the parent's may still be in
        # use, and the slot is shared memory that a worker would then overwrite.
        return
    pool = pool_ref()
    if pool is None:
        return
    entry = pool.outstanding.get(token)
    if entry is None or torch._C._storage_Use_Count(entry[0].cdata) > limit:
        return
    if pool.outstanding.pop(token, None) is not None:
        pool.release(entry[1])


#: A worker pool keeps ``num_workers + 1`` batch buffers (one with the consumer, one being built
#: per worker), and more while they fit in ``num_workers *`` this many bytes together, up to
#: :data:`MAX_SLOTS_PER_WORKER` per worker. A buffer stays resident while the pool lives, in use
#: or not. On the ``big`` workload (38.5 MB batches, 2 workers, 3 runs): one buffer per worker
#: gave 1.9-2.2x torch's throughput at 0.93-0.97x its peak memory (PSS of the process tree), two
#: per worker 2.5-3.2x at 1.10-1.14x (a worker's own buffer was often still with the consumer
#: while the other's sat idle); 3 shared buffers 3.25-3.29x at 0.94-0.95x, and 4 shared ones
#: 3.0-3.2x at 1.04-1.13x.
POOL_BYTES = 64 * 1024 * 1024

#: Upper bound of a pool's buffers per worker (small batches).
MAX_SLOTS_PER_WORKER = 3

#: How long a worker waits for a pool buffer when every buffer is in use and the pool may
#: not make another, before it builds its batch in a fresh segment anyway (and stops waiting
#: until buffers come back).
WAIT_FOR_BUFFER_S = 0.05

#: The same, for the earliest batch being loaded: the consumer may be waiting for it.
WAIT_FOR_BUFFER_FIRST_S = 0.005

#: A wait longer than this counts as long: a worker that waited long (or in vain) for 2 of its
#: last 3 buffers asks the pool to keep one buffer more.
WAIT_LONG_S = 0.005

# How a worker waited for a buffer (_WorkerEnd.waited): _LONG for the earliest batch being
# loaded, or in vain; _LONG_BEHIND for a wait that ended once another worker's earlier batch
# reached the consumer. The order of delivery makes those: two of them ask the pool for a buffer
# more only while the consumer keeps batches (on `big`, 2 workers and a consumer that keeps
# none, they grew the pool to a 4th buffer: peak PSS near 410 MB instead of 378, at the same
# throughput).
_SHORT = 0
_LONG = 1
_LONG_BEHIND = 2

# BufferPool.state values.
_EMPTY = 0  # no buffer in this slot
_BUSY = 1  # a worker builds a batch in it, or the batch is in flight or with the consumer
_SPARE = 2  # free: its token is in the pool's token pipe
_RETURNED = 3  # a worker found it too small for its batch: the main process lets it go

# Worker -> main: a tensor's storage is a batch buffer the worker made for this result (not
# user memory), which the main process may keep for reuse once the consumer drops it; made
# with a permit (see BufferPool) or without one.
_ADOPTABLE = -2
_ADOPTABLE_PERMITTED = -3

# The slot of a permit: a token that lets the worker that reads it make one fresh buffer.
# (Not -1, which BufferPool.adopt returns for a buffer not kept.)
_PERMIT = -4

# BufferPool.track's slot for a fresh buffer the pool did not keep: tracked only so that the
# pool sees how many delivered batches the consumer holds; nothing to free.
_UNKEPT = -5

_ANNOUNCE = struct.Struct("=qqq")  # main -> worker: (slot, generation, nbytes) + descriptor(s)
_TOKEN = struct.Struct("=ii")  # (slot, generation): one free buffer, in the token pipe
_TOKEN_PIPE = -1  # the announced "slot" of the token pipe's two ends


class BufferPool:
    """Batch buffers in shared memory that the workers of one pool take turns to fill.

    Main-process side. A buffer starts as a fresh segment that a worker built a batch in;
    when the consumer drops that batch, the main process keeps the segment (up to the pool's
    budget) instead of freeing it, and any worker's next batch may reuse it. Reused pages are
    neither allocated nor zero-filled again.

    Each free buffer has one token, ``(slot, generation)``, in a pipe that every worker of
    the pool reads: a read of a token is atomic, so exactly one worker takes a buffer, with no
    lock that a killed worker could leave held. The main process writes a buffer's token
    once the last tensor using its batch is gone (a finaliser on the storage, on whichever
    thread drops it). Every worker is sent a buffer's descriptor once, on its channel, when
    the buffer joins the pool; a token whose generation is not the slot's current one is
    stale (the buffer left the pool) and is dropped by the worker that reads it.

    The pool's size is bounded from the first batch on, not only once it has its buffers: a
    worker makes a fresh buffer only with a *permit*, a token ``(_PERMIT, 0)`` in the same
    pipe. The pool starts with as many permits as it may keep buffers; a permit becomes the
    buffer made with it, or comes back when that batch is dropped (or was never sent). So
    buffers and permits together never exceed the budget, and a worker that finds neither
    waits for the consumer to drop a batch (the start of an epoch included), instead of adding
    a batch of memory. A wait has a time limit (:data:`WAIT_FOR_BUFFER_S`), after which a
    fresh segment is made anyway, as torch does; a permit lost with a killed worker only makes
    the pool one buffer smaller. While workers wait, a freed buffer goes to the one loading the
    earliest batch (:attr:`wants`): the consumer needs that batch first.
    """

    def __init__(self, num_workers: int, raw_array: Callable[..., Any] | None = None) -> None:
        make = raw_array if raw_array is not None else _raw_array
        self.num_workers = max(1, num_workers)
        self.capacity = self.num_workers * MAX_SLOTS_PER_WORKER
        # One byte per slot, then two flags: [capacity] is set by a worker that keeps waiting
        # (see _WorkerEnd.acquire), and lets the pool keep one buffer more; [capacity + 1] is
        # set while the consumer keeps batches (_consumer_keeps, judged at each delivery), for
        # the workers to read.
        self.state: Any = make(ctypes.c_ubyte, [_EMPTY] * (self.capacity + 2))
        self._allowed = self.num_workers + 1  # buffers kept whatever their size
        self.gens: Any = make(ctypes.c_int, [0] * self.capacity)
        # Per worker id, (epoch, send_idx) of the batch it waits for a buffer for; send_idx -1
        # while it does not wait. A worker that sees an earlier batch of its epoch waiting
        # leaves free buffers to it (best effort: read without a lock).
        self.wants: Any = make(ctypes.c_longlong, [-1] * (2 * self.num_workers))
        self.channels: list[FdChannel] = []
        # Batches in pool buffers still alive here: token -> (weak reference to the storage,
        # slot). Whoever pops an entry (the storage's finaliser or release_dropped, on any
        # thread) frees the slot: dict.pop is atomic, so exactly once.
        self.outstanding: dict[int, tuple[Any, int]] = {}
        self._entries = itertools.count()
        self._fds = [-1] * self.capacity  # the main process's own descriptor of each buffer
        # What each of our descriptors referred to when made (device, inode): see
        # close_inherited().
        self._ids: dict[int, tuple[int, int]] = {}
        self._nbytes = [0] * self.capacity
        self._wanted = 0  # the largest buffer that found the pool full
        # The bytes of the last batch tensors received that are (or could be) in pool buffers:
        # the pool's target follows the biggest of them, so that neither a batch's small
        # tensors nor one outsized batch set the pool's size for good.
        self._recent: collections.deque[int] = collections.deque(maxlen=2 * self.capacity)
        self._freed: collections.deque[int] = collections.deque()
        # The outstanding entries whose batch went to the consumer (see _consumer_keeps).
        self._delivered: set[int] = set()
        # A result carried more than one batch buffer (a dict of large tensors, say).
        self._multi = False
        self._lock = threading.Lock()
        self._closed = False
        self._retry = False  # an announcement did not fit in a channel: send it again
        # Permits not turned into buffers: in the pipe, with a worker, or in a batch alive here.
        self._permits = 0
        # Not inherited by exec'd programs (os.pipe); a worker never blocks on it but in poll().
        self.tokens_r, self.tokens_w = os.pipe()
        os.set_blocking(self.tokens_r, False)
        os.set_blocking(self.tokens_w, False)
        self._remember(self.tokens_r, self.tokens_w)
        self._issue(self._allowed)
        _pools.add(self)

    def _issue(self, n: int) -> None:
        # n permits more (called with the lock held, or before anyone else sees the pool).
        for _ in range(n):
            with contextlib.suppress(OSError):  # the pipe holds thousands: never full
                os.write(self.tokens_w, _TOKEN.pack(_PERMIT, 0))
                self._permits += 1

    def _target(self, nbytes: int) -> int:
        # Buffers (and permits) the pool may have, for buffers of nbytes: num_workers + 1, and
        # more while they fit in the byte budget, up to capacity. Nothing received yet: the
        # first.
        if nbytes <= 0:
            return self._allowed
        fit = POOL_BYTES * self.num_workers // nbytes
        return min(self.capacity, max(self._allowed, fit))

    def _need(self) -> int:
        # The biggest batch tensor received lately (0: none yet). A copy: any thread appends.
        return max(list(self._recent), default=0)

    def offered(self, nbytes: int) -> None:
        """A batch tensor of ``nbytes`` that is, or could be, in a pool buffer arrived."""
        self._recent.append(nbytes)

    def attach(self, channel: FdChannel) -> None:
        """Send worker ``channel.wid`` the token pipe and the buffers, on its channel."""
        with self._lock:
            self.channels.append(channel)
            self._send(channel, _TOKEN_PIPE, 0, 0, [self.tokens_r, self.tokens_w])
            for s in range(self.capacity):
                if self._fds[s] >= 0:
                    self._announce(channel, s)

    def adopt(self, channel: FdChannel, fd: int, nbytes: int, permitted: bool = False) -> int:
        """Keep a worker's fresh batch buffer for reuse once its batch is dropped: its slot;
        or -1 (it goes when its batch goes: over budget, or smaller than the pool's buffers);
        or :data:`_PERMIT` for a buffer made with a permit that is not kept: the permit comes
        back when its batch goes (:meth:`track` it)."""
        with self._lock:
            if self._closed:
                return -1
            if permitted:
                self._permits -= 1  # it becomes this buffer, or comes back with the batch
            slot = self._keep(fd, nbytes)
            if slot < 0 and permitted:
                self._permits += 1
                return _PERMIT
            return slot

    def _keep(self, fd: int, nbytes: int) -> int:
        # adopt(), with the lock held: the slot, or -1.
        used = [s for s in range(self.capacity) if self._fds[s] >= 0]
        state = self.state
        if state[self.capacity]:
            # Workers keep finding every buffer in use: keep one buffer more, up to
            # num_workers + 2 (a consumer whose step is as long as a batch's loading holds one
            # while another waits for it, done). Past that only if the consumer holds more
            # batches (a window of recent ones, say) or batches take several buffers each; not
            # for waits the order of delivery makes anyway (a worker a batch ahead of the other
            # waits for the other's batch to reach the consumer: the workers do not ask for
            # those unless the consumer keeps batches, see _WorkerEnd.acquire).
            state[self.capacity] = 0
            if (
                self._multi
                or len(used) + self._permits < self.num_workers + 2
                or self._consumer_keeps()
            ):
                self._allowed = min(
                    self.capacity, max(self._allowed, len(used) + self._permits + 1)
                )
        # The target for the batches received lately. (A permit that turns into its buffer was
        # taken off _permits by adopt(). Batches bigger than before lower the target below what
        # the permits out add up to: the surplus is retired as permits come back, see
        # hand_out.) The byte budget holds too, whatever the sizes of the buffers kept.
        target = self._target(max(nbytes, self._need()))
        pooled = sum(self._nbytes[s] for s in used)
        if (
            len(used) + self._permits >= target
            or len(used) == self.capacity
            or (len(used) >= self._allowed and pooled + nbytes > POOL_BYTES * self.num_workers)
        ):
            self._wanted = max(self._wanted, nbytes)
            return -1
        if used and nbytes < max(self._nbytes[s] for s in used):
            return -1  # a short last batch, say: keep the pool's buffers one size
        try:
            dup = os.dup(fd)
        except OSError:
            return -1
        slot = next(s for s in range(self.capacity) if self._fds[s] < 0)
        self._remember(dup)
        self._fds[slot] = dup
        self._nbytes[slot] = nbytes
        self.gens[slot] += 1
        self.state[slot] = _BUSY
        for ch in self.channels:
            self._announce(ch, slot)
        # Smaller batches: more buffers fit in the budget, so more may be made.
        self._issue(target - len(used) - 1 - self._permits)
        return slot

    def _consumer_keeps(self) -> bool:
        # Whether the consumer holds buffers of two delivered batches or more: it keeps batches
        # besides the one it works on. Forgets the delivered batches dropped since (called with
        # every delivery, this keeps _delivered to the batches alive). Finalisers pop
        # outstanding entries on any thread: each step here is one atomic set operation.
        outstanding = self.outstanding
        held = 0
        for entry in list(self._delivered):
            if entry in outstanding:
                held += 1
            else:
                self._delivered.discard(entry)
        return held >= 2

    def delivered(self, entries: tuple[int, ...]) -> None:
        """The batch holding these entries (of :meth:`track`) went to the consumer. Runs on the
        consumer's side, when the batch is handed over."""
        # For the workers (see _WorkerEnd.acquire), judged before this batch joins: a consumer
        # that keeps none still holds the batch before it now, its loop variable not moved on.
        self.state[self.capacity + 1] = self._consumer_keeps()
        outstanding = self.outstanding
        for entry in entries:
            if entry in outstanding:
                self._delivered.add(entry)

    def track(self, storage: torch.UntypedStorage, slot: int) -> int:
        """``storage`` maps buffer ``slot``: free it once no tensor uses it (for
        :data:`_PERMIT`, a buffer made with a permit and not kept: the permit comes back then;
        for :data:`_UNKEPT`, one made without: nothing to free). Returns its entry, for
        :meth:`delivered`.

        The slot is freed the moment the last tensor or view of ``storage`` in this process goes
        (a finaliser on the storage), so a worker's next batch can reuse it;
        :meth:`release_dropped` is the fallback if the finaliser cannot tell (see
        :func:`_sole_holder_count`).
        """
        ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
        entry = next(self._entries)
        self.outstanding[entry] = (ref, slot)
        limit = _sole_holder_count()
        if limit >= 0:
            # A weak reference: a batch kept after aclose() must not keep the pool alive.
            fin = weakref.finalize(
                storage, _release_if_sole, weakref.ref(self), entry, limit, os.getpid()
            )
            fin.atexit = False  # at exit the batch may still be alive: nothing to hand back
        return entry

    def release(self, slot: int) -> None:
        """The batch in ``slot`` is gone: the buffer (or, for :data:`_PERMIT`, the permit it
        was made with) is free. Any thread, any time."""
        self._freed.append(slot)
        self.hand_out()

    def release_dropped(self) -> None:
        """Free every pool buffer no tensor of this process uses any more.

        A storage's weak reference expires only once every tensor and view of it is gone, so a
        buffer is never rewritten while anything here can read it. Called with every result
        received, as a fallback: the storages' finalisers normally free buffers sooner.
        """
        # Finalisers may pop entries meanwhile, on any thread or inside a garbage collection.
        # dict.copy() copies in one step that allocates no object per entry, so no collection
        # (Python 3.11 may run one on any allocation) can change the dict half-way through it.
        if self.outstanding:
            for entry, (ref, slot) in self.outstanding.copy().items():
                if ref.expired() and self.outstanding.pop(entry, None) is not None:
                    self._freed.append(slot)
        self.hand_out()

    def hand_out(self) -> None:
        """Put the freed buffers' tokens in the pipe; let go of buffers too small (or twice too
        big) for the batches now; issue or retire permits as the pool's target moves.

        Never waits: a finaliser may call this inside a garbage collection on a thread that
        already holds the lock, and then leaves the work to the next call (every result's
        arrival makes one).
        """
        # Called with every result (tiny batches too): nothing to do is the common case.
        if not self._freed and not self._retry and _RETURNED not in bytes(self.state):
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed:
                return
            state = self.state
            for s in range(self.capacity):
                if state[s] == _RETURNED:
                    self._evict(s)
            need = self._need()
            while self._freed:
                s = self._freed.popleft()
                if s == _UNKEPT:
                    continue
                if s == _PERMIT:
                    if self._surplus() > 0:
                        self._permits -= 1  # the target fell (bigger batches): retire it
                    else:
                        with contextlib.suppress(OSError):
                            os.write(self.tokens_w, _TOKEN.pack(_PERMIT, 0))
                    continue
                if need and self._nbytes[s] >= 2 * need:
                    # Twice the size of any batch lately (kept for an outsized one, say): let it
                    # go, so that the pool's buffers follow its batches.
                    self._evict(s)
                    continue
                if self._nbytes[s] < self._wanted:
                    # Make room for a bigger one, once for each that was turned away: a single
                    # outsized batch must not turn every buffer over from then on.
                    self._evict(s)
                    self._wanted = 0
                    continue
                state[s] = _SPARE
                with contextlib.suppress(OSError):  # the pipe holds thousands: never full
                    os.write(self.tokens_w, _TOKEN.pack(s, self.gens[s]))
            surplus = self._surplus()
            if surplus < 0:
                # Smaller batches than lately (after an outsized one, say): more may be made.
                self._issue(-surplus)
            if self._retry:  # announcements that did not fit in a channel before
                self._retry = False
                for ch in self.channels:
                    for s in range(self.capacity):
                        if self._fds[s] >= 0:
                            self._announce(ch, s)
        finally:
            self._lock.release()

    def _announce(self, channel: FdChannel, slot: int) -> None:
        # Send worker ``channel.wid`` the buffer's descriptor, unless it has it already.
        gen = int(self.gens[slot])
        if channel.known.get(slot) == gen:
            return
        if self._send(channel, slot, gen, self._nbytes[slot], [self._fds[slot]]):
            channel.known[slot] = gen
        else:
            self._retry = True

    @staticmethod
    def _send(channel: FdChannel, slot: int, gen: int, nbytes: int, fds: list[int]) -> bool:
        try:
            channel.main_end.sendmsg(
                [_ANNOUNCE.pack(slot, gen, nbytes)],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
            )
        except OSError:  # its channel is full (a worker that does not read) or closed
            return False
        return True

    def _evict(self, slot: int) -> None:
        # Its token, if any, is stale now; workers drop their mapping when they see the
        # generation change, and the memory goes with the last mapping. A permit takes its
        # place while the pool is under its target: the worker that needs a bigger buffer
        # makes one.
        with contextlib.suppress(OSError):
            os.close(self._fds[slot])
        self._ids.pop(self._fds[slot], None)
        self._fds[slot] = -1
        self._nbytes[slot] = 0
        self.gens[slot] += 1
        self.state[slot] = _EMPTY
        if self._surplus() < 0:
            self._issue(1)

    def _surplus(self) -> int:
        # Buffers and permits beyond the pool's target for the batches received lately.
        used = sum(fd >= 0 for fd in self._fds)
        return used + self._permits - self._target(self._need())

    def _remember(self, *fds: int) -> None:
        for fd in fds:
            st = os.fstat(fd)
            self._ids[fd] = (st.st_dev, st.st_ino)

    def close_inherited(self) -> None:
        """In a forked child: close the main process's descriptors, so that no buffer lives on
        in a process that does not use it (the pool's own workers are sent what they need on
        their channels).

        A descriptor is closed only if it still refers to what it was made for: a thread of the
        parent may have been closing it at the fork, and its number may be reused since.
        """
        for fd in [*self._fds, self.tokens_r, self.tokens_w]:
            ident = self._ids.get(fd)
            if fd < 0 or ident is None:
                continue
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == ident:
                    os.close(fd)
        self._fds = [-1] * self.capacity
        self._ids = {}
        self.tokens_r = self.tokens_w = -1
        self._closed = True

    def close(self) -> None:
        """Close the main process's descriptors: each buffer goes once its last user is gone."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in [*self._fds, self.tokens_r, self.tokens_w]:
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._fds = [-1] * self.capacity
            self._ids = {}
            self.tokens_r = self.tokens_w = -1
            self.outstanding.clear()
        _pools.discard(self)


_pools: weakref.WeakSet[BufferPool] = weakref.WeakSet()


def unlink_left_segments(pid: int, shm_dir: str = "/dev/shm") -> int:
    """Unlink the shared-memory files that process ``pid``, now dead, left; the number unlinked.

    torch names a new shared-memory segment after its process (``torch_<pid>_<random>_<n>``)
    and unlinks the name right after opening it, so a worker killed by a signal in between
    leaves the file, and its memory, until the machine restarts. Call once ``pid`` is reaped.
    """
    prefix = f"torch_{pid}_"
    try:
        names = os.listdir(shm_dir)
    except OSError:  # no such directory: nothing named there
        return 0
    gone = 0
    for name in names:
        if name.startswith(prefix):
            with contextlib.suppress(OSError):  # unlinked meanwhile
                os.unlink(os.path.join(shm_dir, name))
                gone += 1
    return gone


def _close_pools_in_child() -> None:
    # Runs right after a fork, in the child, with no other thread.
    for pool in list(_pools):
        pool.close_inherited()


os.register_at_fork(after_in_child=_close_pools_in_child)


def _raw_array(typecode: Any, init: list[int]) -> Any:
    from multiprocessing.sharedctypes import RawArray

    return RawArray(typecode, init)


class _WorkerEnd:
    """A worker's side of its :class:`FdChannel`, and its view of the shared batch buffers."""

    def __init__(
        self,
        key: int,
        sock: socket.socket,
        wid: int = 0,
        shared: tuple[Any, Any, Any] | None = None,
    ) -> None:
        self.key = key
        self.sock = sock
        self.wid = wid
        # BufferPool.state, .gens and .wants: slot states, each slot's buffer generation, and
        # the batch each worker waits for a buffer for
        self.state: Any = None
        self.gens: Any = None
        self.wants: Any = None
        if shared is not None:
            self.state, self.gens, self.wants = shared
        self.tokens: tuple[int, int] | None = None  # the token pipe's ends, once announced
        self.patient = True  # wait for a buffer when the pool is at its budget
        #: For each of the last batches that took a buffer: how it waited for it (_SHORT,
        #: _LONG, _LONG_BEHIND).
        self.waited: collections.deque[int] = collections.deque(maxlen=3)
        self.mapped: dict[int, tuple[int, torch.UntypedStorage]] = {}  # slot -> (gen, buffer)
        self.slot_of: dict[int, int] = {}  # a pool buffer's data_ptr -> its slot
        self.unsent: list[int] = []  # slots acquired for the current task, not sent yet
        #: Fresh batch buffers made for the current task (see :data:`_ADOPTABLE`): data_ptr ->
        #: whether it was made with a permit.
        self.fresh: dict[int, bool] = {}
        #: Permits taken for the current task and not used for a fresh buffer yet.
        self.permits = 0
        #: data_ptrs of the task's fresh buffers made with a permit that went out with its
        #: result (the main process has the permit now).
        self.permits_sent: set[int] = set()

    def acquire(self, nbytes: int) -> torch.UntypedStorage | None:
        """A free pool buffer of at least ``nbytes``, or None (make a fresh one, with a permit
        if one was taken: see :meth:`made_fresh`). A pool buffer's pages are reused from an
        earlier batch: no allocation, no zero-filling. When every buffer is in use and no
        permit is left, waits for one (see :data:`WAIT_FOR_BUFFER_S`)."""
        if self.state is None or torch.multiprocessing.get_sharing_strategy() != "file_descriptor":  # type: ignore[no-untyped-call]
            return None
        self._receive()
        if self.tokens is None:
            return None
        gens = self.gens
        for slot, (gen, _) in list(self.mapped.items()):
            if gens[slot] != gen:
                self._forget(slot)  # evicted: its memory goes once no one maps it
        patience = _buffer_wait
        key = _buffer_key() if _buffer_key is not None else None
        state = self.state
        grow, keeps = len(state) - 2, len(state) - 1
        long_waits = [w for w in self.waited if w != _SHORT]
        # Two long waits ask for a buffer more, and make it now. Waits behind earlier batches
        # only do not, unless the consumer keeps batches: the order of delivery made them, and
        # one buffer more would only add a batch of memory.
        ask = len(long_waits) >= 2 and (_LONG in long_waits or bool(state[keeps]))
        if len(long_waits) >= 2 and not ask:
            self.waited.clear()
        will_wait = self.patient and patience is not None and not ask
        # A worker that would wait anyway leaves the free buffers to one waiting for an earlier
        # batch (which the consumer needs first), and waits behind it.
        found = None if will_wait and self._earlier_waits(key) else self._take(nbytes)
        if found is None and self.patient and patience is not None:
            # Every buffer is in use and the pool may not make another: one comes back as soon
            # as the consumer drops a batch, and a fresh segment would add a batch of memory.
            if ask:
                # Waited long on most of the last batches: the consumer holds more batches than
                # the pool has room for. Ask for one buffer more, and make it now.
                state[grow] = 1
                self.waited.clear()
                return None
            poller = select.poll()
            poller.register(self.tokens[0], select.POLLIN)
            t0 = time.monotonic()
            deadline = t0 + patience()
            behind = _buffer_behind is not None and _buffer_behind()
            self._want(key)
            try:
                while True:
                    # Every waiting worker wakes for a token; one takes it, the others wait on.
                    left = deadline - time.monotonic()
                    if left <= 0 or not poller.poll(math.ceil(left * 1000)):
                        break
                    if self._earlier_waits(key):
                        time.sleep(_YIELD_S)  # the token is the earlier batch's to take
                        continue
                    # A buffer that joined the pool while this worker waited is announced on
                    # its channel before its token is written: map it first.
                    self._receive()
                    found = self._take(nbytes)
                    if found is not None:
                        break
                    # Only tokens this worker cannot use (another's, not announced yet): they
                    # are back in the pipe, which stays readable; look again in a moment.
                    time.sleep(_YIELD_S)
            finally:
                self._want(None)
            if found is not None:
                if time.monotonic() - t0 <= WAIT_LONG_S:
                    self.waited.append(_SHORT)
                else:
                    self.waited.append(_LONG_BEHIND if behind else _LONG)
            else:
                # A consumer that keeps its batches gives none back: stop waiting, until a
                # buffer is free again when asked for.
                self.patient = False
                self.waited.append(_LONG)
        elif found is not None:
            self.patient = True
            self.waited.append(_SHORT)
        if found is None:
            return None
        if found == _PERMIT:
            self.permits += 1
            return None
        self.state[found] = _BUSY
        self.unsent.append(found)
        return self.mapped[found][1]

    def _want(self, key: tuple[int, int] | None) -> None:
        # Publish the batch this worker waits for a buffer for (None: it stopped waiting).
        wants, i = self.wants, 2 * self.wid
        if wants is None or i + 1 >= len(wants):
            return  # no ordering (a pool made for fewer workers)
        if key is None:
            wants[i + 1] = -1
        else:
            wants[i] = key[0]
            wants[i + 1] = key[1]

    def _earlier_waits(self, key: tuple[int, int] | None) -> bool:
        # Whether another worker waits for a buffer for an earlier batch of the same epoch.
        wants = self.wants
        if wants is None or key is None or key[1] < 0:
            return False
        for w in range(len(wants) // 2):
            if w != self.wid and wants[2 * w] == key[0] and 0 <= wants[2 * w + 1] < key[1]:
                return True
        return False

    def _take(self, nbytes: int) -> int | None:
        # A free buffer's slot from the token pipe, else a permit (_PERMIT), else None. A
        # permit is used only once the pipe holds no free buffer: reusing one is the point.
        assert self.tokens is not None
        gens = self.gens
        back: list[bytes] = []  # tokens read and not used: they go back in the pipe
        permit: bytes | None = None
        found: int | None = None
        try:
            while found is None:
                try:
                    token = os.read(self.tokens[0], _TOKEN.size)
                except BlockingIOError:
                    break
                if len(token) != _TOKEN.size:
                    break
                slot, gen = _TOKEN.unpack(token)
                if slot == _PERMIT:
                    if permit is None:
                        permit = token
                    else:
                        back.append(token)
                    continue
                if gens[slot] != gen:
                    continue  # stale: the buffer left the pool
                entry = self.mapped.get(slot)
                if entry is None or entry[0] != gen:
                    back.append(token)  # announced to us too late: another worker's
                elif entry[1].nbytes() < nbytes:
                    self.state[slot] = _RETURNED  # too small for these batches now
                else:
                    found = slot
            if permit is not None and found is None:
                found = _PERMIT
        finally:
            if permit is not None and found != _PERMIT:
                back.append(permit)
            for token in back:
                with contextlib.suppress(OSError):
                    os.write(self.tokens[1], token)
        return found

    def _receive(self) -> None:
        # What the main process announced since the last call: the token pipe, and buffers,
        # mapped now.
        while True:
            try:
                msg, anc, flags, _ = self.sock.recvmsg(
                    _ANNOUNCE.size,
                    socket.CMSG_SPACE(2 * _FD_SIZE),
                    socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC,
                )
            except OSError:  # none left (or the channel is closed)
                return
            got = _received_fds(anc)
            if len(msg) != _ANNOUNCE.size or flags & socket.MSG_CTRUNC:
                _close_all(got)
                return
            slot, gen, nbytes = _ANNOUNCE.unpack(msg)
            if slot == _TOKEN_PIPE:
                if len(got) == 2 and self.tokens is None:
                    self.tokens = (got[0], got[1])
                else:
                    _close_all(got)
                continue
            self._forget(slot)
            if len(got) == 1:
                try:
                    storage = torch.UntypedStorage._new_shared_fd_cpu(got[0], nbytes)  # type: ignore[attr-defined]
                except RuntimeError:  # out of descriptors or address space: not this one
                    pass
                else:
                    self.mapped[slot] = (gen, storage)
                    self.slot_of[storage.data_ptr()] = slot
            _close_all(got)  # a storage holds a duplicate of its own

    def close(self) -> None:
        """Close what the main process sent (the token pipe, the buffers); the socket stays
        its channel's."""
        if self.tokens is not None:
            _close_all(list(self.tokens))
            self.tokens = None
        self.mapped.clear()
        self.slot_of.clear()

    def _forget(self, slot: int) -> None:
        old = self.mapped.pop(slot, None)
        if old is not None:
            del self.slot_of[old[1].data_ptr()]

    def made_fresh(self, storage: torch.UntypedStorage) -> None:
        """``storage`` is a fresh batch buffer of the current task: the pool may keep it (made
        with the permit :meth:`acquire` took, if any)."""
        if self.state is not None:
            permitted = self.permits > 0
            self.permits -= permitted
            self.fresh[storage.data_ptr()] = permitted

    def release_unsent(self) -> None:
        """Free the buffers acquired for a task whose result did not go out through the
        channel (their tokens go back in the pipe), and the permits it took that did not go
        out with it; forget the task's fresh buffers."""
        tokens = [_TOKEN.pack(slot, self.mapped[slot][0]) for slot in self.unsent]
        for slot in self.unsent:
            self.state[slot] = _SPARE
        unused = self.permits + sum(
            1 for ptr, permitted in self.fresh.items() if permitted and ptr not in self.permits_sent
        )
        tokens += [_TOKEN.pack(_PERMIT, 0)] * unused
        if self.tokens is not None:
            for token in tokens:
                with contextlib.suppress(OSError):
                    os.write(self.tokens[1], token)
        self.unsent.clear()
        self.fresh.clear()
        self.permits = 0
        self.permits_sent.clear()

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
        pool = channel.pool
        shared = None if pool is None else (pool.state, pool.gens, pool.wants)
        return _WorkerEnd(channel.key, channel.worker_end, channel.wid, shared)
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
    # Per thread, while loads_result runs: descriptors taken per (channel key, tag), the
    # storages rebuilt from them (views of one storage share it, as in the worker), and the
    # pool entries tracked for the result with the number of its pool (or poolable) buffers.
    fds: dict[tuple[int, int, int], list[int]] | None = None
    storages: dict[tuple[int, int, int, int], torch.UntypedStorage] | None = None
    tracked: list[tuple[BufferPool, int]] | None = None
    pooled = 0


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
        pool = channel.pool
        try:
            fds = got.get((key, *tag))
            if fds is None:
                fds = got[(key, *tag)] = channel.take(tag)
            storage = _map_received(fds[slot], nbytes)
        except BaseException:
            if pool is not None and (pool_slot >= 0 or pool_slot == _ADOPTABLE_PERMITTED):
                # Its batch never reaches anyone: the buffer (or the permit) is free.
                pool.release(pool_slot if pool_slot >= 0 else _PERMIT)
            raise
        storages[(key, *tag, slot)] = storage
        if pool is not None and pool_slot != -1:
            pool.offered(math.prod(shape) * dtype.itemsize)
            _receiving.pooled += 1
            if _receiving.pooled > 1:
                pool._multi = True
            if pool_slot in (_ADOPTABLE, _ADOPTABLE_PERMITTED):
                permitted = pool_slot == _ADOPTABLE_PERMITTED
                pool_slot = pool.adopt(channel, fds[slot], nbytes, permitted)
            if pool_slot == -1:
                pool_slot = _UNKEPT
            entry = pool.track(storage, pool_slot)
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
        self, channel: _WorkerEnd | None, tag: tuple[int, int], pool: _WorkerEnd | None = None
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
        #: The pool buffers (slots) among them, and the fresh buffers made with a permit.
        self.pool_slots: set[int] = set()
        self.permitted: set[int] = set()

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
                ptr = storage.data_ptr()
                pool_slot = channel.slot_of.get(ptr, -1)
                if pool_slot >= 0:
                    self.pool_slots.add(pool_slot)
                elif ptr in channel.fresh:
                    if channel.fresh[ptr]:
                        pool_slot = _ADOPTABLE_PERMITTED
                        self.permitted.add(ptr)
                    else:
                        pool_slot = _ADOPTABLE
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


_buffer_wait: Callable[[], float] | None = None
_buffer_key: Callable[[], tuple[int, int]] | None = None
_buffer_behind: Callable[[], bool] | None = None

#: How long a worker that leaves a free buffer to an earlier batch sleeps before it looks again.
_YIELD_S = 0.0005


def set_buffer_wait(
    patience: Callable[[], float] | None,
    key: Callable[[], tuple[int, int]] | None = None,
    behind: Callable[[], bool] | None = None,
) -> None:
    """In a worker: ``patience()`` says how long this worker may wait for a pool buffer now, in
    seconds (None: never wait, make a fresh one); ``key()`` the ``(epoch, send_idx)`` of the
    batch it loads, which orders the workers waiting for a buffer (None: no order); ``behind()``
    whether another worker loads an earlier batch of the epoch, so that a wait now comes from
    the order of delivery (see :data:`_LONG_BEHIND`)."""
    global _buffer_wait, _buffer_key, _buffer_behind
    _buffer_wait = patience
    _buffer_key = key
    _buffer_behind = behind


def set_worker_channel(channel: FdChannel | _WorkerEnd | None) -> None:
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
            # The main process frees the pool buffers this result carries (BufferPool.track); any
            # other buffer taken for this task (a streamed batch given up for default_collate)
            # stays in ``unsent`` for release_unsent().
            channel.unsent = [s for s in channel.unsent if s not in reducer.pool_slots]
            channel.permits_sent |= reducer.permitted
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
    or None (no pool, or every buffer in use: see :meth:`_WorkerEnd.acquire`). A buffer not
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
    pickler = pickle.Pickler(buf, protocol=_PICKLE_PROTOCOL)
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

#: The main process's loop rebuilds pieces of a result for at most about this long per turn
#: before it lets its other callbacks run (plus the piece under way when the time is up). The
#: `text` workload on the quiet 2-core VM, three runs each: loop-lag p90 4.3-5.1 ms at 0.5 ms,
#: 3.5-3.9 at 0.2 and 3.4-3.7 at 0.1, the same throughput.
DECODE_STEP_S = 0.0002

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
        for pool in list(_pools):
            pool.release_dropped()
        self.value: Any = None
        self._tracked = tracked
        self._fds: dict[tuple[int, int, int], list[int]] = {}
        self._storages: dict[tuple[int, int, int, int], torch.UntypedStorage] = {}
        self._pooled = 0
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
        outer = (_receiving.fds, _receiving.storages, _receiving.tracked, _receiving.pooled)
        _receiving.fds, _receiving.storages = self._fds, self._storages
        _receiving.tracked, _receiving.pooled = self._tracked, self._pooled
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
            self._pooled = _receiving.pooled
            (_receiving.fds, _receiving.storages, _receiving.tracked, _receiving.pooled) = outer

    def close(self) -> None:
        """Close the descriptors taken (the storages hold duplicates of their own), and drop
        what was rebuilt of an unfinished result."""
        if self._left:
            self._unpickler = None
        taken, self._fds = self._fds, {}
        self._storages = {}
        for fds in taken.values():
            _close_all(fds)


def loads_result(data: bytes, tracked: list[tuple[BufferPool, int]] | None = None) -> Any:
    """Rebuild a batch pickled by :func:`dumps_result` in one go. Thread-safe.

    ``tracked`` receives ``(pool, entry)`` for each pool buffer the batch holds: pass them to
    :func:`delivered` when the consumer gets the batch.

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
    for pool in list(_pools):
        pool.release_dropped()
    outer = (_receiving.fds, _receiving.tracked, _receiving.pooled)
    _receiving.fds, _receiving.storages = {}, {}
    _receiving.tracked, _receiving.pooled = tracked, 0
    try:
        return pickle.loads(data)
    finally:
        taken = _receiving.fds
        _receiving.fds, _receiving.tracked, _receiving.pooled = outer
        _receiving.storages = None
        for fds in taken.values():
            # The storages hold duplicates of their own.
            _close_all(fds)


def delivered(tracked: tuple[tuple[BufferPool, int], ...]) -> None:
    """The consumer got the batch whose pool buffers :func:`loads_result` listed in
    ``tracked`` (see :meth:`BufferPool.delivered`)."""
    pools: dict[BufferPool, list[int]] = {}
    for pool, entry in tracked:
        pools.setdefault(pool, []).append(entry)
    for pool, entries in pools.items():
        pool.delivered(tuple(entries))


# --------------------------------------------------------------------------------------------------
# Worker payload: main -> workers

_payload_tensors: list[torch.Tensor] = []  # set by load_payload() while unpickling in a worker


def _shared_payload_tensor(i: int) -> torch.Tensor:
    return _payload_tensors[i]


def _make_payload_pickler(
    base: type[pickle.Pickler], side: list[torch.Tensor]
) -> type[pickle.Pickler]:
    # The C pickler's class attribute is a descriptor (for an instance's own table), not a table.
    given = getattr(base, "dispatch_table", None)
    base_table = given if isinstance(given, Mapping) else copyreg.dispatch_table

    def reduce_dataset_tensor(t: torch.Tensor) -> tuple[Any, ...]:
        if t.numel() * t.element_size() >= SHARED_PAYLOAD_TENSOR_BYTES and t.device.type == "cpu":
            side.append(t)
            return _shared_payload_tensor, (len(side) - 1,)
        reduced: tuple[Any, ...] = t.__reduce_ex__(_PICKLE_PROTOCOL)  # type: ignore[no-untyped-call]
        return reduced

    table = dict(base_table)
    table[torch.Tensor] = reduce_dataset_tensor
    # cloudpickle "pickles" an open text file by reading it whole into a StringIO: each worker
    # would then write into (or read) its own copy. Refuse it as plain pickle and torch do.
    table.pop(io.TextIOWrapper, None)
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
            by_value = not _main_is_importable()
            while True:
                base = _by_value_pickler() if by_value else pickle.Pickler
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
                    f.flush()
                    if by_value or not _names_main(fd):
                        break
                    # A class or function of the script's __main__, named by reference: it may
                    # be defined under `if __name__ == "__main__":`, which a worker's re-import
                    # of the script skips. cloudpickle sends __main__'s by value.
                    by_value = True
                except (pickle.PicklingError, TypeError, AttributeError) as exc:
                    if not by_value and _needs_by_value(exc):
                        # A class or function pickle cannot name (a lambda, a local function):
                        # cloudpickle sends it by value. Nothing else falls back (an open file,
                        # a lock): torch's error stays.
                        by_value = True
                        continue
                    exc.add_note(_payload_note(obj, _make_payload_pickler(base, []), exc))
                    raise
        return PayloadFile(fd), list(side)
    except BaseException:
        os.close(fd)
        raise


_PAYLOAD_NAMES = ("dataset", "collate_fn", "worker_init_fn")


def _by_value_pickler() -> type[pickle.Pickler]:
    import cloudpickle  # type: ignore[import-untyped, unused-ignore]

    base: type[pickle.Pickler] = cloudpickle.Pickler
    return base


def _names_main(fd: int) -> bool:
    """Whether the pickle in ``fd`` may name something of ``__main__`` (a false yes costs only
    pickling by value). Read in chunks: the GIL goes at each read, so the loop runs meanwhile."""
    needle = b"__main__"
    offset, tail = 0, b""
    while chunk := os.pread(fd, 1 << 24, offset):
        if needle in tail + chunk[: len(needle)] or needle in chunk:
            return True
        offset += len(chunk)
        tail = chunk[-len(needle) :]
    return False


def _needs_by_value(exc: BaseException) -> bool:
    """Whether plain pickle failed to name a class or function (which cloudpickle sends by value).

    Such failures are ``PicklingError`` ("attribute lookup <lambda> on __main__ failed", "not the
    same object as ...") or, before Python 3.14, ``AttributeError`` ("Can't pickle local object").
    An object of a type that cannot be pickled at all raises ``TypeError``.
    """
    if isinstance(exc, pickle.PicklingError):
        return True
    return isinstance(exc, AttributeError) and str(exc).startswith("Can't pickle local object")


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


def _pickles(pickler: type[pickle.Pickler], obj: object) -> bool:
    try:
        pickler(_Discard(), protocol=_PICKLE_PROTOCOL).dump(obj)
    except Exception:
        return False
    return True


def _parts(obj: object) -> list[tuple[str, object]]:
    """What pickling ``obj`` pickles, each with a suffix naming it (``.lock``, ``[2]``)."""
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
        return []
    try:
        reduced = obj.__reduce_ex__(_PICKLE_PROTOCOL)
    except Exception:
        return []
    if not isinstance(reduced, tuple):
        return []
    parts: list[tuple[str, object]] = []
    state = reduced[2] if len(reduced) > 2 else None
    # getstate of an object with __slots__: (dict, slots); either may be None.
    for part in state if isinstance(state, tuple) and len(state) == 2 else (state,):
        if isinstance(part, dict):
            parts += [(f".{k}" if isinstance(k, str) else f"[{k!r}]", v) for k, v in part.items()]
        elif part is not None:
            parts.append(("", part))
    if len(reduced) > 3 and reduced[3] is not None:
        parts += [(f"[{i}]", v) for i, v in enumerate(reduced[3])]
    if len(reduced) > 4 and reduced[4] is not None:
        parts += [(f"[{k!r}]", v) for k, v in reduced[4]]
    return parts


def unpicklable_path(obj: object, name: str, pickler: type[pickle.Pickler]) -> tuple[str, object]:
    """The innermost part of ``obj`` that ``pickler`` cannot pickle, named from ``name``.

    Run only after pickling ``obj`` failed: pickles parts of it again to find the culprit.
    """
    for _ in range(64):
        for suffix, part in _parts(obj):
            if part is not obj and not _pickles(pickler, part):
                name, obj = name + suffix, part
                break
        else:
            break
    return name, obj


def _payload_note(obj: object, pickler: type[pickle.Pickler], exc: BaseException) -> str:
    where = "the dataset, collate_fn or worker_init_fn"
    path: tuple[str, object] | None = None
    if isinstance(obj, tuple) and len(obj) == len(_PAYLOAD_NAMES):
        for name, part in zip(_PAYLOAD_NAMES, obj, strict=True):
            if not _pickles(pickler, part):
                path = unpicklable_path(part, name, pickler)
                break
    if path is not None:
        where = f"{path[0]} (a {type(path[1]).__module__}.{type(path[1]).__qualname__})"
    if isinstance(exc, TypeError) and path is not None and "." in path[0]:
        return (
            f"aioloader: {where} cannot be pickled, so it cannot be sent to worker processes "
            "started with spawn/forkserver (torch's DataLoader refuses it too). Create it "
            "lazily, on first use in the worker (keep None until then, and drop it in "
            "__getstate__), or in worker_init_fn; or use multiprocessing_context='fork'."
        )
    return (
        f"aioloader: {where} cannot be sent to worker processes started with spawn/forkserver. "
        "Define them at module level, make them picklable, or use multiprocessing_context='fork'."
    )


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
