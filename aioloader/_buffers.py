"""Batch buffers in shared memory that the workers of one pool take turns to fill. Runs in: both.

:class:`BufferPool` is the main process's side, :class:`WorkerEnd` a worker's. A worker builds a
large batch in a pool buffer (or a fresh segment the pool may keep), and the main process hands
the buffer back once the consumer drops the batch.

The policy, and what it guarantees. *Bounded memory:* a worker makes a buffer that the pool may
keep only with a permit, and the pool's buffers and permits together never exceed its target:
``num_workers + 1``, more while buffers of the recent batches' size fit in ``num_workers *``
:data:`POOL_BYTES`, never more than :data:`MAX_SLOTS_PER_WORKER` per worker; a buffer smaller
than a batch now, or twice the size of any batch lately, leaves the pool. *Reuse:* a worker
takes a free buffer before a permit, and a buffer freed while workers wait goes to the one
loading the earliest batch, which the consumer needs first. *No deadlock:* a worker that finds
neither waits at most :data:`WAIT_FOR_BUFFER_S` (:data:`WAIT_FOR_BUFFER_FIRST_S` for the earliest
batch), then builds its batch in a fresh segment the pool does not keep, as torch does, and
waits no more until a buffer comes back; so a consumer that keeps every batch costs what it
costs under torch, and never stalls the workers. *Growth:* a worker whose waits were long for
two of its last three buffers asks for one buffer more, which the pool grants up to
``num_workers + 2``, and past that only while the consumer holds two delivered buffers or more
(it keeps batches, or a batch takes several buffers); waits that only the order of delivery
makes (a worker a batch ahead of the other) ask only while the consumer keeps buffers.
"""

from __future__ import annotations

import array
import collections
import contextlib
import ctypes
import itertools
import math
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ._channel import FD_SIZE, ChannelEnd, FdChannel, close_all, received_fds

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

# How a worker waited for a buffer (WorkerEnd.waited): _LONG for the earliest batch being
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

    A permit is a token ``(_PERMIT, 0)`` in the same pipe. The pool starts with as many
    permits as it may keep buffers; a permit becomes the buffer made with it, or comes back
    when that batch is dropped (or was never sent), and the pool issues or retires permits as
    its target moves. A permit lost with a killed worker only makes the pool one buffer
    smaller. The order of waiting workers is :attr:`wants`.
    """

    def __init__(self, num_workers: int, raw_array: Callable[..., Any] | None = None) -> None:
        make = raw_array if raw_array is not None else _raw_array
        self.num_workers = max(1, num_workers)
        self.capacity = self.num_workers * MAX_SLOTS_PER_WORKER
        # One byte per slot, then two flags: [capacity] is set by a worker that keeps waiting
        # (see WorkerEnd.acquire), and lets the pool keep one buffer more; [capacity + 1] is
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
        # Per channel key: the buffers its worker was sent the descriptor of, slot -> generation.
        self._known: dict[int, dict[int, int]] = {}
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
        # The bytes of the last batch tensors received that are (or could be) in pool buffers:
        # the pool's target follows the biggest of them, so that neither a batch's small
        # tensors nor one outsized batch set the pool's size for good.
        self._recent: collections.deque[int] = collections.deque(maxlen=2 * self.capacity)
        self._freed: collections.deque[int] = collections.deque()
        # The outstanding entries whose batch went to the consumer (see _consumer_keeps).
        self._delivered: set[int] = set()
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
        """Share this pool's buffers with worker ``channel.wid``: its end of the channel carries
        the pool's shared arrays, and the token pipe and the buffers are sent on the channel."""
        channel.shared = self.worker_view()
        _pool_of[channel.key] = self
        with self._lock:
            self.channels.append(channel)
            self._known[channel.key] = {}
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
            # while another waits for it, done). Past that only if the consumer holds two
            # buffers or more: it keeps batches (a window of recent ones, say), or a batch takes
            # several buffers. Not for waits the order of delivery makes anyway (a worker a
            # batch ahead of the other waits for the other's batch to reach the consumer: the
            # workers do not ask for those unless the consumer keeps buffers, see
            # WorkerEnd.acquire).
            state[self.capacity] = 0
            if len(used) + self._permits < self.num_workers + 2 or self._consumer_keeps():
                self._allowed = min(
                    self.capacity, max(self._allowed, len(used) + self._permits + 1)
                )
        # The target for the batches received lately. (A permit that turns into its buffer was
        # taken off _permits by adopt(). Batches bigger than before lower the target below what
        # the permits out add up to: the surplus is retired as permits come back, see
        # hand_out.) The target is at most capacity, and no buffer joins that is smaller than
        # one kept, so the buffers kept beyond num_workers + 1 fit in the byte budget.
        if len(used) + self._permits >= self._target(max(nbytes, self._need())):
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
        self._top_up(nbytes)
        return slot

    def _consumer_keeps(self) -> bool:
        # Whether the consumer holds two delivered buffers or more: it keeps batches besides
        # the one it works on, or a batch takes several buffers. Forgets the delivered buffers
        # dropped since (called with every delivery, this keeps _delivered to the buffers
        # alive). Finalisers pop outstanding entries on any thread: each step here is one
        # atomic set operation.
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
        # For the workers (see WorkerEnd.acquire), judged before this batch joins: a consumer
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

    def received(
        self,
        channel: FdChannel,
        storage: torch.UntypedStorage,
        fd: int,
        tag: int,
        tensor_bytes: int,
    ) -> int:
        """``storage`` (of descriptor ``fd``) arrived on ``channel``, holding a batch tensor of
        ``tensor_bytes``, tagged ``tag`` by :meth:`WorkerEnd.tag_of` (not -1). Adopts a fresh
        buffer or not, and tracks the storage: its entry, for :meth:`delivered`."""
        self.offered(tensor_bytes)
        if tag in (_ADOPTABLE, _ADOPTABLE_PERMITTED):
            tag = self.adopt(channel, fd, storage.nbytes(), tag == _ADOPTABLE_PERMITTED)
        return self.track(storage, _UNKEPT if tag == -1 else tag)

    def lost(self, tag: int) -> None:
        """A storage tagged ``tag`` (see :meth:`WorkerEnd.tag_of`) could not be received: its
        batch never reaches anyone, so its buffer (or the permit it was made with) is free."""
        if tag >= 0 or tag == _ADOPTABLE_PERMITTED:
            self.release(tag if tag >= 0 else _PERMIT)

    def worker_view(self) -> tuple[Any, Any, Any]:
        """What a worker shares of the pool (see :class:`WorkerEnd`)."""
        return (self.state, self.gens, self.wants)

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
                state[s] = _SPARE
                with contextlib.suppress(OSError):  # the pipe holds thousands: never full
                    os.write(self.tokens_w, _TOKEN.pack(s, self.gens[s]))
            # Smaller batches than lately (after an outsized one, say): more may be made.
            self._top_up()
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
        known = self._known[channel.key]
        if known.get(slot) == gen:
            return
        if self._send(channel, slot, gen, self._nbytes[slot], [self._fds[slot]]):
            known[slot] = gen
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
        self._top_up()

    def _surplus(self, nbytes: int = 0) -> int:
        # Buffers and permits beyond the pool's target for the batches received lately (and
        # one of nbytes).
        used = sum(fd >= 0 for fd in self._fds)
        return used + self._permits - self._target(max(nbytes, self._need()))

    def _top_up(self, nbytes: int = 0) -> None:
        # Issue the permits that bring the pool up to its target (see _surplus).
        self._issue(-self._surplus(nbytes))

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

# The pool each channel is attached to, by channel key (the executor holds both).
_pool_of: weakref.WeakValueDictionary[int, BufferPool] = weakref.WeakValueDictionary()


def pool_of(channel: FdChannel) -> BufferPool | None:
    """The pool ``channel`` is attached to, if any (see :meth:`BufferPool.attach`)."""
    return _pool_of.get(channel.key)


def release_dropped() -> None:
    """Free, in every pool of this process, the buffers no tensor uses any more (see
    :meth:`BufferPool.release_dropped`)."""
    for pool in list(_pools):
        pool.release_dropped()


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


class WorkerEnd(ChannelEnd):
    """A worker's end of its :class:`~aioloader._channel.FdChannel`, and its view of the shared
    batch buffers."""

    def __init__(
        self,
        key: int,
        sock: socket.socket,
        wid: int = 0,
        shared: tuple[Any, Any, Any] | None = None,
    ) -> None:
        super().__init__(key, sock, wid, shared)
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
                    socket.CMSG_SPACE(2 * FD_SIZE),
                    socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC,
                )
            except OSError:  # none left (or the channel is closed)
                return
            got = received_fds(anc)
            if len(msg) != _ANNOUNCE.size or flags & socket.MSG_CTRUNC:
                close_all(got)
                return
            slot, gen, nbytes = _ANNOUNCE.unpack(msg)
            if slot == _TOKEN_PIPE:
                if len(got) == 2 and self.tokens is None:
                    self.tokens = (got[0], got[1])
                else:
                    close_all(got)
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
            close_all(got)  # a storage holds a duplicate of its own

    def close(self) -> None:
        """Close what the main process sent (the token pipe, the buffers); the socket stays
        its channel's."""
        if self.tokens is not None:
            close_all(list(self.tokens))
            self.tokens = None
        self.mapped.clear()
        self.slot_of.clear()

    def _forget(self, slot: int) -> None:
        old = self.mapped.pop(slot, None)
        if old is not None:
            del self.slot_of[old[1].data_ptr()]

    def tag_of(self, ptr: int) -> int:
        """What the main process is told of the storage at ``ptr`` that goes out on the
        channel: its pool slot, :data:`_ADOPTABLE` (or :data:`_ADOPTABLE_PERMITTED`) for a
        fresh batch buffer of the current task, or -1 (user memory; see
        :meth:`BufferPool.received`)."""
        slot = self.slot_of.get(ptr, -1)
        if slot >= 0:
            return slot
        permitted = self.fresh.get(ptr)
        if permitted is None:
            return -1
        return _ADOPTABLE_PERMITTED if permitted else _ADOPTABLE

    def sent(self, tags: Mapping[int, int]) -> None:
        """The current task's result went out on the channel with these storages (data_ptr ->
        :meth:`tag_of`): the main process frees the pool buffers among them, and has the
        permits of the fresh ones; any other buffer taken for this task (a streamed batch given
        up for default_collate) stays for :meth:`release_unsent`."""
        pool_slots = {tag for tag in tags.values() if tag >= 0}
        self.unsent = [s for s in self.unsent if s not in pool_slots]
        self.permits_sent |= {ptr for ptr, tag in tags.items() if tag == _ADOPTABLE_PERMITTED}

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


def worker_end(channel: FdChannel | ChannelEnd) -> WorkerEnd:
    """The worker's side of ``channel``: a forked worker inherits the whole channel, a spawned
    one receives its :class:`~aioloader._channel.ChannelEnd`."""
    if isinstance(channel, WorkerEnd):
        return channel
    if isinstance(channel, FdChannel):
        channel = channel.worker_side()
    return WorkerEnd(channel.key, channel.sock, channel.wid, channel.shared)


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


def delivered(tracked: tuple[tuple[BufferPool, int], ...]) -> None:
    """The consumer got the batch whose pool buffers :func:`~aioloader._codec.loads_result`
    listed in ``tracked`` (see :meth:`BufferPool.delivered`)."""
    pools: dict[BufferPool, list[int]] = {}
    for pool, entry in tracked:
        pools.setdefault(pool, []).append(entry)
    for pool, entries in pools.items():
        pool.delivered(tuple(entries))
