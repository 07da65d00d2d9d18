"""The shared batch buffers: reused by any worker once the consumer drops a batch, never
rewritten while a view lives, bounded from the first batch."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader, _buffers, _channel, _codec
from tests import datasets

BIG = (256, 512)  # 512 KiB of float32: above INLINE_TENSOR_BYTES, so it goes through shm


@pytest.fixture
def pooled_slots(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float]]:
    """(pool slot, first value) of every batch received in a pool buffer, in arrival order."""
    calls: list[tuple[int, float]] = []
    orig = _buffers.BufferPool.track

    def recording(self: _buffers.BufferPool, storage: torch.UntypedStorage, slot: int) -> int:
        if slot >= 0:  # not a fresh buffer the pool did not keep
            first = torch.empty(0).set_(storage, 0, (1,), (1,))
            calls.append((slot, float(first[0])))
        return orig(self, storage, slot)

    monkeypatch.setattr(_buffers.BufferPool, "track", recording)
    return calls


@pytest.mark.parametrize("workers", [1, 2])
async def test_pool_buffers_are_reused_by_any_worker_once_the_consumer_drops_the_batch(
    pooled_slots: list[tuple[int, float]], workers: int
) -> None:
    n = 20 * workers
    ds = datasets.BigDataset(4 * n, (3, 128, 128))
    async with asyncio.timeout(120):
        async with AsyncDataLoader(ds, batch_size=4, num_workers=workers) as loader:
            firsts = [float(b[0, 0, 0, 0]) async for b in loader]
    assert firsts == [float(4 * i) for i in range(n)]
    # A batch finds no free buffer only while the consumer and the queue hold them all.
    capacity = workers * _buffers.MAX_SLOTS_PER_WORKER
    slots = [slot for slot, _ in pooled_slots]
    assert len(slots) > capacity
    assert set(slots) <= set(range(capacity))
    if workers == 2:
        # Pinned round-robin: batch i comes from worker i % 2.
        workers_of: dict[int, set[int]] = {}
        for slot, first in pooled_slots:
            workers_of.setdefault(slot, set()).add(int(first) // 4 % 2)
        assert any(ws == {0, 1} for ws in workers_of.values()), workers_of


@pytest.mark.parametrize(
    ("method", "small_pool"), [("fork", False), ("spawn", False), ("fork", True)]
)
async def test_a_pool_buffer_is_never_rewritten_while_a_view_of_it_lives(
    method: str,
    small_pool: bool,
    pooled_slots: list[tuple[int, float]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    capacity = 2 * _buffers.MAX_SLOTS_PER_WORKER
    keep = (0, 3, 7)
    if small_pool:  # as for the benchmark's 38.5 MB batches; forked workers inherit the budget
        # num_workers + 1 buffers at first; the views kept make the workers ask for more.
        monkeypatch.setattr(_buffers, "POOL_BYTES", 1)
        keep = (0, 7)
    ds = datasets.BigDataset(120, (3, 128, 128))
    kept: dict[int, torch.Tensor] = {}
    async with asyncio.timeout(120):
        async with AsyncDataLoader(
            ds, batch_size=4, num_workers=2, multiprocessing_context=method
        ) as loader:
            async for i, b in _enumerate(loader):
                # Each batch arrives whole although the consumer scribbled on earlier ones.
                assert b[:, 0, 0, 0].tolist() == [float(4 * i + k) for k in range(4)]
                if i in keep:
                    kept[i] = b[1:, 2]  # a view: the batch itself is dropped at once
                else:
                    b.fill_(-1.0)
                for j, view in kept.items():
                    assert torch.equal(view, _expected_view(j)), (i, j)
    assert len(kept) == len(keep)
    slots = [slot for slot, _ in pooled_slots]
    assert len(slots) > 2 * len(set(slots))  # buffers were reused meanwhile
    assert set(slots) <= set(range(capacity))
    for j, view in kept.items():
        assert torch.equal(view, _expected_view(j))


@pytest.fixture
def pool_channel() -> Iterator[_channel.FdChannel]:
    """:func:`channel` with a pool of reused buffers."""
    with datasets.playing_worker(pool=True) as ch:
        yield ch


def _pool(ch: _channel.FdChannel) -> _buffers.BufferPool:
    pool = _buffers.pool_of(ch)
    assert pool is not None
    return pool


def _fresh_result(value: float) -> bytes:
    """A batch built in a fresh buffer, as a worker sends it."""
    out = _codec.batch_buffer(BIG, torch.float32)
    out.fill_(value)
    data = _codec.dumps_result(out, (0, int(value)))
    _codec.release_unsent()  # the worker's task ends
    return data


def _pooled_result(value: float) -> tuple[bytes, int]:
    """A batch built in a pool buffer, as a worker sends it; and its slot."""
    out = _codec.pool_buffer(BIG, torch.float32)
    assert out is not None
    out.fill_(value)
    slot = _codec._worker_channel.slot_of[out.untyped_storage().data_ptr()]  # type: ignore[union-attr]
    data = _codec.dumps_result(out, (0, int(value)))
    _codec.release_unsent()  # the worker's task ends
    return data, slot


def _warm(ch: _channel.FdChannel) -> int:
    """Give the pool its first buffer: a fresh batch, received and dropped. Its slot."""
    assert _codec.pool_buffer(BIG, torch.float32) is None  # an empty pool has none...
    assert _codec._worker_channel is not None and _codec._worker_channel.permits == 1
    _codec.release_unsent()  # ...but a permit to make one, given back unused here
    batch = _codec.loads_result(_fresh_result(9.0))
    assert batch[0, 0].item() == 9.0
    pool = _pool(ch)
    (slot,) = [s for s in range(pool.capacity) if pool.state[s] != _buffers._EMPTY]
    assert pool.state[slot] == _buffers._BUSY  # kept, but the consumer still holds it
    del batch
    assert pool.state[slot] == _buffers._SPARE
    return slot


def _all_tokens(pool: _buffers.BufferPool) -> list[tuple[int, int]]:
    """Take every token out of the pool's pipe (and put them back)."""
    got = []
    with contextlib.suppress(BlockingIOError):
        while data := os.read(pool.tokens_r, _buffers._TOKEN.size):
            got.append(_buffers._TOKEN.unpack(data))
    for token in got:
        os.write(pool.tokens_w, _buffers._TOKEN.pack(*token))
    return got


def _tokens(pool: _buffers.BufferPool) -> list[tuple[int, int]]:
    """The free buffers' tokens in the pool's pipe."""
    return [t for t in _all_tokens(pool) if t[0] != _buffers._PERMIT]


def _permits(pool: _buffers.BufferPool) -> int:
    """The permits in the pool's pipe."""
    return sum(t[0] == _buffers._PERMIT for t in _all_tokens(pool))


def test_this_torch_lets_a_storage_finaliser_hand_buffers_back() -> None:
    # Otherwise buffers go back only when the next result arrives (release_dropped).
    assert _buffers._sole_holder_count() in (0, 1)


def test_a_fresh_batch_buffer_joins_the_pool_when_its_batch_is_dropped(
    pool_channel: _channel.FdChannel,
) -> None:
    slot = _warm(pool_channel)
    pool = _pool(pool_channel)
    assert _tokens(pool) == [(slot, pool.gens[slot])]
    data, again = _pooled_result(3.0)
    assert again == slot and _tokens(pool) == []
    batch = _codec.loads_result(data)
    assert batch[0, 0].item() == 3.0 and pool.state[slot] == _buffers._BUSY
    # A tensor the worker did not make for the batch (user memory) is never kept.
    user = torch.full(BIG, 4.0)
    kept = _codec.loads_result(_codec.dumps_result(user, (0, 4)))
    assert kept[0, 0].item() == 4.0
    del kept
    assert [s for s in range(pool.capacity) if pool.state[s] != _buffers._EMPTY] == [slot]


def test_a_pool_buffer_goes_back_when_its_last_view_is_dropped_not_on_the_next_result(
    pool_channel: _channel.FdChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    _warm(pool_channel)
    pool = _pool(pool_channel)
    polls: list[int] = []
    orig = _buffers.BufferPool.release_dropped
    monkeypatch.setattr(
        _buffers.BufferPool, "release_dropped", lambda self: (polls.append(1), orig(self))[1]
    )
    data, slot = _pooled_result(5.0)
    batch = _codec.loads_result(data)
    polls.clear()  # from here on no result arrives: only the finaliser can hand it back
    view = batch[100:, 3]
    del batch
    assert pool.state[slot] == _buffers._BUSY  # a view still reads it
    storage = view.untyped_storage()  # torch keeps one Python object per storage...
    assert storage is view.untyped_storage()
    del view
    assert pool.state[slot] == _buffers._BUSY  # ...and the storage object alone keeps it too
    again = torch.empty(0).set_(storage, 0, (8,), (1,))
    array = again.numpy()
    del storage, again
    assert pool.state[slot] == _buffers._BUSY  # a numpy array of it
    assert array[0] == 5.0
    # The last holder is dropped on another thread (a consumer's executor, say).
    holder = [array]
    del array
    thread = threading.Thread(target=holder.clear)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert pool.state[slot] == _buffers._SPARE
    assert _tokens(pool) == [(slot, pool.gens[slot])]
    assert polls == []
    assert pool.outstanding == {}


def test_a_buffer_handed_back_is_reused_and_release_dropped_never_frees_it_twice(
    pool_channel: _channel.FdChannel,
) -> None:
    _warm(pool_channel)
    pool = _pool(pool_channel)
    data, slot = _pooled_result(1.0)
    first = _codec.loads_result(data)
    del first
    data, slot2 = _pooled_result(2.0)
    assert slot2 == slot  # the same buffer, rewritten: nothing reads the first batch any more
    second = _codec.loads_result(data)  # release_dropped runs here too
    assert pool.state[slot] == _buffers._BUSY
    pool.release_dropped()
    assert pool.state[slot] == _buffers._BUSY and second[0, 0].item() == 2.0
    assert _tokens(pool) == []  # a second token would let two batches share the buffer
    del second
    assert _tokens(pool) == [(slot, pool.gens[slot])]


def _two_workers(
    ch: _channel.FdChannel,
) -> tuple[int, _buffers.BufferPool, _channel.FdChannel, list[_buffers.WorkerEnd]]:
    """:func:`_warm`'s pool, a second worker's channel on it (close it when done), and both
    workers' ends, each told of the pool's buffer."""
    slot = _warm(ch)
    pool = _pool(ch)
    other = _channel.FdChannel(wid=1)
    pool.attach(other)
    mine = _codec._worker_channel
    assert mine is not None
    ends = [mine, _buffers.worker_end(other)]
    try:
        for end in ends:
            end._receive()
            assert end.tokens is not None and slot in end.mapped
    except BaseException:
        other.close()
        raise
    return slot, pool, other, ends


def test_each_free_buffer_goes_to_exactly_one_worker(pool_channel: _channel.FdChannel) -> None:
    slot, pool, other, ends = _two_workers(pool_channel)
    try:
        barrier = threading.Barrier(2)
        got: list[Any] = [None, None]

        def take(k: int) -> None:
            barrier.wait(10)
            got[k] = ends[k].acquire(4)

        threads = [threading.Thread(target=take, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sum(g is not None for g in got) == 1
        assert pool.state[slot] == _buffers._BUSY
    finally:
        ends[1].close()
        other.close()


@pytest.mark.parametrize("later_first", [True, False])
def test_a_buffer_freed_while_two_workers_wait_goes_to_the_earlier_batch(
    monkeypatch: pytest.MonkeyPatch, later_first: bool
) -> None:
    # Both workers are short of a buffer; the consumer needs batch 3 before batch 4, so the
    # one buffer it gives back goes to batch 3's worker, whichever started waiting first. (Batch
    # 4's worker took it before, and batch 3's timed out into a fresh segment: a batch of
    # memory more, at the start of most epochs of `big`.)
    with datasets.playing_worker(pool=True, num_workers=2) as ch:
        slot, pool, other, ends = _two_workers(ch)
        workers: list[threading.Thread] = []
        try:
            # The consumer holds the only buffer, and no permit is left.
            tokens = _all_tokens(pool)
            os.read(pool.tokens_r, _buffers._TOKEN.size * len(tokens))
            assert (slot, pool.gens[slot]) in tokens
            loads = {0: (7, 4), 1: (7, 3)}  # worker -> (epoch, send_idx) it loads
            which = threading.local()
            monkeypatch.setattr(_buffers, "_buffer_wait", lambda: 5.0)
            monkeypatch.setattr(_buffers, "_buffer_key", lambda: loads[which.k])
            got: list[Any] = [None, None]

            def take(k: int) -> None:
                which.k = k
                got[k] = ends[k].acquire(4)

            workers += [threading.Thread(target=take, args=(k,)) for k in (0, 1)]
            for k in (0, 1) if later_first else (1, 0):
                workers[k].start()
                deadline = time.monotonic() + 5
                while pool.wants[2 * k + 1] != loads[k][1] and time.monotonic() < deadline:
                    time.sleep(0.001)
                assert pool.wants[2 * k : 2 * k + 2] == list(loads[k])  # waiting
            os.write(pool.tokens_w, _buffers._TOKEN.pack(slot, pool.gens[slot]))  # dropped
            workers[1].join(10)
            assert got[1] is not None, "the earlier batch's worker got no buffer"
            assert workers[0].is_alive() and got[0] is None  # batch 4 waits on
            assert pool.wants[1] == 4 and pool.wants[3] == -1
            ends[1].release_unsent()  # batch 3 dropped without being sent: the buffer is free
            workers[0].join(10)
            assert got[0] is not None and pool.wants[1] == -1
            ends[0].release_unsent()
        finally:
            os.write(pool.tokens_w, _buffers._TOKEN.pack(slot, pool.gens[slot]) * 2)
            for t in workers:
                if t.ident is not None:
                    t.join(10)
            ends[1].close()
            other.close()


def test_a_worker_waiting_takes_a_buffer_that_joins_the_pool_meanwhile(
    pool_channel: _channel.FdChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A buffer joins the pool (a fresh batch adopted) while the worker waits: its descriptor is
    # announced on the worker's channel before its token goes in the pipe, so the waiting worker
    # must map it on waking, not pass the token over (and spin on it) until its patience ends.
    pool = _pool(pool_channel)
    end = _codec._worker_channel
    assert end is not None
    end._receive()
    assert end.tokens is not None
    assert _tokens(pool) == [] and _permits(pool) == 2
    os.read(pool.tokens_r, _buffers._TOKEN.size * 2)  # no buffer, no permit in the pipe
    monkeypatch.setattr(_buffers, "_buffer_wait", lambda: 3.0)
    # Big enough that the pool's target stays at num_workers + 1: adopting it issues no permit,
    # which the waiter, woken by the permit's token, could take before the buffer's token is
    # written (it did, once, on a loaded machine). The memfd stays sparse: nothing is touched.
    nbytes = _buffers.POOL_BYTES * 3 // 4
    got: list[Any] = []
    waiter = threading.Thread(target=lambda: got.append(end.acquire(nbytes)))
    fd = os.memfd_create("aioloader-test")
    try:
        os.ftruncate(fd, nbytes)
        waiter.start()
        time.sleep(0.1)
        assert waiter.is_alive() and not end.mapped
        t0 = time.monotonic()
        slot = pool.adopt(pool_channel, fd, nbytes, permitted=True)
        assert slot >= 0
        pool.release(slot)  # its batch was dropped: the token goes in the pipe
        waiter.join(10)
        assert got and got[0] is not None and got[0].nbytes() == nbytes
        assert time.monotonic() - t0 < 1.5  # not after the worker's patience ran out
        assert pool.state[slot] == _buffers._BUSY and end.unsent == [slot]
        assert _permits(pool) == 0 and end.permits == 0
        end.release_unsent()
    finally:
        os.write(pool.tokens_w, _buffers._TOKEN.pack(_buffers._PERMIT, 0))
        waiter.join(10)
        os.close(fd)


def test_a_buffer_too_small_for_the_batches_now_is_let_go_for_a_bigger_one(
    pool_channel: _channel.FdChannel,
) -> None:
    slot = _warm(pool_channel)
    pool = _pool(pool_channel)
    end = _codec._worker_channel
    assert end is not None
    bigger = (BIG[0] * 2, BIG[1])
    assert _codec.pool_buffer(bigger, torch.float32) is None  # returned: too small
    assert pool.state[slot] == _buffers._RETURNED
    _codec.release_unsent()
    gen = pool.gens[slot]
    out = _codec.batch_buffer(bigger, torch.float32)
    out.fill_(6.0)
    batch = _codec.loads_result(_codec.dumps_result(out, (0, 6)))
    _codec.release_unsent()
    del out
    assert pool.state[slot] != _buffers._RETURNED and pool.gens[slot] > gen  # let go
    del batch  # the bigger one joins the pool
    assert _codec.pool_buffer(bigger, torch.float32) is not None
    assert slot not in end.mapped or end.mapped[slot][0] == pool.gens[slot]
    _codec.release_unsent()


def test_the_pool_is_bounded_from_the_first_batch_and_a_worker_waits_for_a_buffer(
    pool_channel: _channel.FdChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_buffers, "POOL_BYTES", 1)  # num_workers + 1 buffers: 2 here
    pool = _pool(pool_channel)
    assert _permits(pool) == 2 and _tokens(pool) == []
    waits: list[int] = []
    monkeypatch.setattr(_buffers, "_buffer_wait", lambda: waits.append(1) or 5.0)
    # The start of an epoch: each fresh buffer is made with a permit, and joins the pool.
    held = [
        _codec.loads_result(_fresh_result(1.0)),
        _codec.loads_result(_fresh_result(2.0)),
    ]
    assert waits == [] and _permits(pool) == 0
    assert sum(pool.state[s] != _buffers._EMPTY for s in range(pool.capacity)) == 2
    # A third batch while the consumer holds both: no third buffer, the worker waits until
    # the consumer drops a batch, 0.2 s after the wait began (the timer starts with the wait,
    # so a stall of this thread before it cannot shorten the wait or skip it).
    timer = threading.Timer(0.2, held.pop, args=(0,))
    monkeypatch.setattr(_buffers, "_buffer_wait", lambda: waits.append(1) or timer.start() or 5.0)
    try:
        t0 = time.monotonic()
        out = _codec.pool_buffer(BIG, torch.float32)
        assert out is not None and waits == [1]
        assert 0.15 < time.monotonic() - t0 < 4.0
    finally:
        if timer.ident is not None:
            timer.join(10)
    del out
    _codec.release_unsent()  # not sent: the buffer is free again
    # A consumer that keeps its batches: the wait times out once, then no more waiting, and
    # the fresh buffers made meanwhile are not kept.
    monkeypatch.setattr(_buffers, "_buffer_wait", lambda: waits.append(1) or 0.05)
    waits.clear()
    held.append(_codec.loads_result(_pooled_result(4.0)[0]))
    assert _codec.pool_buffer(BIG, torch.float32) is None and waits == [1]
    assert _codec.pool_buffer(BIG, torch.float32) is None and waits == [1]
    _codec.release_unsent()
    held.append(_codec.loads_result(_fresh_result(5.0)))
    assert sum(pool.state[s] != _buffers._EMPTY for s in range(pool.capacity)) == 2
    held.clear()  # buffers come back: waiting is on again
    assert _permits(pool) == 0 and len(_tokens(pool)) == 2
    assert _codec.pool_buffer(BIG, torch.float32) is not None
    _codec.release_unsent()
    assert _codec._worker_channel is not None and _codec._worker_channel.patient


def test_a_permit_not_used_or_not_kept_comes_back(
    pool_channel: _channel.FdChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_buffers, "POOL_BYTES", 1)
    pool = _pool(pool_channel)
    end = _codec._worker_channel
    assert end is not None
    # A buffer made with a permit that fails before it is sent (collate raised, say).
    out = _codec.batch_buffer(BIG, torch.float32)
    assert end.fresh == {out.untyped_storage().data_ptr(): True} and _permits(pool) == 1
    _codec.release_unsent()
    assert _permits(pool) == 2
    del out
    # A short last batch made with a permit: not kept (the pool's buffers stay one size), and
    # its permit comes back when the consumer drops it.
    kept = _codec.loads_result(_fresh_result(1.0))
    out = _codec.batch_buffer((BIG[0] // 2, BIG[1]), torch.float32)
    short = _codec.loads_result(_codec.dumps_result(out, (0, 2)))
    _codec.release_unsent()
    del out
    assert _permits(pool) == 0
    assert sum(pool.state[s] != _buffers._EMPTY for s in range(pool.capacity)) == 1
    del short
    assert _permits(pool) == 1
    del kept
    assert _permits(pool) == 1 and len(_tokens(pool)) == 1
    # A permit's buffer whose batch cannot be received.
    monkeypatch.setattr(_buffers, "_buffer_wait", None)
    held = _codec.pool_buffer(BIG, torch.float32)  # the pool's buffer, held
    data = _fresh_result(3.0)
    assert _permits(pool) == 0

    def fail(self: _channel.FdChannel, tag: tuple[int, int]) -> list[int]:
        raise OSError(errno.EMFILE, "no descriptors left")

    monkeypatch.setattr(_channel.FdChannel, "take", fail)
    with pytest.raises(OSError):
        _codec.loads_result(data)
    monkeypatch.undo()
    assert _permits(pool) == 1
    for fd in pool_channel.take((0, 3)):
        os.close(fd)
    del held
    _codec.release_unsent()


def _expected_view(j: int) -> torch.Tensor:
    values = torch.tensor([4.0 * j + 1, 4.0 * j + 2, 4.0 * j + 3])
    return values.view(3, 1, 1).expand(3, 128, 128)


async def _enumerate(loader: AsyncDataLoader[torch.Tensor]) -> Any:
    i = 0
    async for b in loader:
        yield i, b
        i += 1


SHM_SCRIPT = """
import asyncio, os, signal
import psutil
from aioloader import AsyncDataLoader
from tests import datasets

async def main():
    loader = AsyncDataLoader(datasets.BigDataset(400, (3, 128, 128)), batch_size=4, num_workers=2)
    kept = []
    async for b in loader:
        kept.append(b)
        if len(kept) == 12:
            pids = [os.getpid()] + [c.pid for c in psutil.Process().children(recursive=True)]
            print("PIDS", *pids, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_nothing_is_left_in_dev_shm_when_the_process_is_killed() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", SHM_SCRIPT], capture_output=True, text=True, timeout=120
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PIDS ")]
    assert lines and out.returncode == -9, out.stdout + out.stderr
    pids = lines[0].split()[1:]
    # torch names a segment after the process that made it (torch_<pid>_...) and unlinks it at
    # once; /dev/shm is shared with every other process of the machine, so look for ours only.
    ours = [f for f in os.listdir("/dev/shm") if any(f"_{pid}_" in f for pid in pids)]
    assert ours == []


def test_only_a_worker_behind_another_waits_long_for_a_buffer() -> None:
    from aioloader import _worker

    state = _worker._state
    saved = (state.slots, state.epoch_slots, state.worker_id)
    state.worker_id = 1
    try:
        for others, epochs, expected in [
            ([4, 7, -1], [0, 0, 0], _buffers.WAIT_FOR_BUFFER_S),  # worker 0 loads batch 4
            ([9, 7, 8], [0, 0, 0], _buffers.WAIT_FOR_BUFFER_FIRST_S),  # 7 is the earliest
            ([-1, 7, -1], [0, 0, 0], _buffers.WAIT_FOR_BUFFER_FIRST_S),  # the others idle
            ([4, 7, -1], [1, 2, 0], _buffers.WAIT_FOR_BUFFER_FIRST_S),  # an older epoch's
        ]:
            state.slots, state.epoch_slots = others, epochs
            assert _worker._buffer_patience() == expected, (others, epochs)
    finally:
        state.slots, state.epoch_slots, state.worker_id = saved


def test_a_pool_grows_on_asking_to_one_more_buffer_and_past_that_for_kept_batches() -> None:
    big = 64 << 20  # over POOL_BYTES together: num_workers + 1 buffers
    with datasets.pools_on_a_memfd(big) as (fd, pools, channels):
        pool, ch = pools[0], channels[0]
        grow = pool.capacity
        # The pool's three permits, then one made without (after a wait that timed out).
        assert [pool.adopt(ch, fd, big, permitted=True) for _ in range(3)] == [0, 1, 2]
        assert pool.adopt(ch, fd, big) == -1
        pool.state[grow] = 1  # what a worker that keeps waiting sets
        assert pool.adopt(ch, fd, big) == 3  # one more on asking: num_workers + 2
        assert pool.state[grow] == 0
        pool.state[grow] = 1
        assert pool.adopt(ch, fd, big) == -1  # past that, waits alone are no reason
        # The consumer holds two delivered batches (one in no pool buffer): it keeps batches.
        held = [torch.UntypedStorage._new_shared_fd_cpu(fd, 64) for _ in range(2)]  # type: ignore[attr-defined]
        entries = (pool.track(held[0], 0), pool.track(held[1], _buffers._UNKEPT))
        pool.delivered(entries[:1])
        pool.state[grow] = 1
        assert pool.adopt(ch, fd, big) == -1  # one delivered batch held: the one it works on
        pool.delivered(entries[1:])
        pool.state[grow] = 1
        assert pool.adopt(ch, fd, big) == 4
        assert pool.adopt(ch, fd, big) == -1  # one more, not more
        # Batches that take several buffers each: the consumer holds two buffers of the one
        # batch it works on, and the pool grows on asking as well.
        other, och = pools[1], channels[1]
        assert [other.adopt(och, fd, big, permitted=True) for _ in range(3)] == [0, 1, 2]
        other.state[grow] = 1
        assert other.adopt(och, fd, big) == 3
        pair = [torch.UntypedStorage._new_shared_fd_cpu(fd, 64) for _ in range(2)]  # type: ignore[attr-defined]
        other.delivered((other.track(pair[0], 0), other.track(pair[1], 1)))
        other.state[grow] = 1
        assert other.adopt(och, fd, big) == 4
        del held, pair


def _delivered(data: bytes) -> torch.Tensor:
    """A batch received and handed to the consumer."""
    tracked: list[tuple[_buffers.BufferPool, int]] = []
    batch = _codec.loads_result(data, tracked)
    _buffers.delivered(tuple(tracked))
    return batch


def _every_buffer_held(
    ch: _channel.FdChannel, monkeypatch: pytest.MonkeyPatch, wait_s: float
) -> tuple[_buffers.BufferPool, list[torch.Tensor]]:
    """A pool of num_workers + 1 = 2 buffers at its budget, both held by the consumer (the
    batches delivered and returned), no permit left; workers may wait ``wait_s`` for a buffer."""
    monkeypatch.setattr(_buffers, "POOL_BYTES", 1)
    _warm(ch)
    monkeypatch.setattr(_buffers, "_buffer_wait", lambda: wait_s)
    held = [_delivered(_pooled_result(1.0)[0]), _delivered(_fresh_result(2.0))]
    pool = _pool(ch)
    assert _permits(pool) == 0
    assert sum(pool.state[s] != _buffers._EMPTY for s in range(pool.capacity)) == 2
    return pool, held


def test_a_worker_that_waits_long_for_most_buffers_asks_for_one_more(
    pool_channel: _channel.FdChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, held = _every_buffer_held(pool_channel, monkeypatch, wait_s=0.01)
    grow = pool.capacity
    end = _codec._worker_channel
    assert end is not None
    for _ in range(2):  # two waits in vain
        end.patient = True
        assert _codec.pool_buffer(BIG, torch.float32) is None
    assert pool.state[grow] == 0
    end.patient = True
    assert _codec.pool_buffer(BIG, torch.float32) is None  # asks instead of waiting
    assert pool.state[grow] == 1 and not end.waited
    held.append(_codec.loads_result(_fresh_result(4.0)))
    # The consumer holds both buffers: it keeps batches, so the pool keeps one buffer more.
    assert sum(pool.state[s] != _buffers._EMPTY for s in range(pool.capacity)) == 3
    _codec.release_unsent()


def test_long_waits_behind_an_earlier_batch_ask_for_a_buffer_only_for_kept_batches(
    pool_channel: _channel.FdChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Behind another worker's earlier batch, a wait lasts until that batch reaches the consumer:
    # the order of delivery makes it. Two such waits ask the pool for a buffer more (and make
    # one at once) only while the consumer keeps batches; otherwise the worker waits on. The
    # earliest batch's own long waits ask either way.
    pool, held = _every_buffer_held(pool_channel, monkeypatch, wait_s=5.0)
    end = _codec._worker_channel
    assert end is not None
    grow, keeps = pool.capacity, pool.capacity + 1
    monkeypatch.setattr(_buffers, "_buffer_key", lambda: (0, 5))

    def load_when_a_batch_is_dropped() -> torch.Tensor | None:
        # The consumer drops a batch 30 ms after the worker started to wait.
        def drop_once_waiting() -> None:
            deadline = time.monotonic() + 10
            while pool.wants[1] != 5 and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.03)
            held.pop(0)

        dropper = threading.Thread(target=drop_once_waiting)
        dropper.start()
        try:
            return _codec.pool_buffer(BIG, torch.float32)
        finally:
            dropper.join(10)

    def deliver(out: torch.Tensor) -> None:
        # The batch goes to the consumer, which holds it: every buffer is held again.
        data = _codec.dumps_result(out, (0, 10 + len(held)))
        _codec.release_unsent()
        held.insert(0, _delivered(data))

    for behind, kept, asks in ((True, 0, False), (True, 1, True), (False, 0, True)):
        monkeypatch.setattr(_buffers, "_buffer_behind", lambda b=behind: b)
        end.waited.clear()
        for _ in range(2):
            end.patient = True
            out = load_when_a_batch_is_dropped()
            kind = _buffers._LONG_BEHIND if behind else _buffers._LONG
            assert out is not None and end.waited[-1] == kind, behind
            deliver(out)
            del out
        end.patient = True
        pool.state[keeps] = kept  # what the main process last saw of the consumer
        if asks:
            assert _codec.pool_buffer(BIG, torch.float32) is None  # asks, makes one now
            assert pool.state[grow] == 1 and not end.waited
            pool.state[grow] = 0
            _codec.release_unsent()
        else:
            out = load_when_a_batch_is_dropped()  # no asking: it waits on for a buffer
            assert out is not None and pool.state[grow] == 0
            assert list(end.waited) == [_buffers._LONG_BEHIND]
            deliver(out)
            del out


def test_the_workers_learn_at_each_delivery_whether_the_consumer_keeps_batches() -> None:
    with datasets.pools_on_a_memfd(64) as (fd, pools, _):
        pool = pools[0]
        keeps = pool.capacity + 1

        def deliver() -> torch.UntypedStorage:
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, 64)  # type: ignore[attr-defined]
            pool.delivered((pool.track(storage, _buffers._UNKEPT),))
            return storage

        a = deliver()
        assert pool.state[keeps] == 0
        # A consumer that keeps none: as a batch is handed over it still holds the one before
        # (its loop variable moves on afterwards), which is no reason to grow.
        b = deliver()
        assert pool.state[keeps] == 0
        del a
        c = deliver()
        assert pool.state[keeps] == 0
        # One that keeps its last two: both are alive when the next arrives.
        d = deliver()
        assert pool.state[keeps] == 1
        del b, c, d
        e = deliver()
        assert pool.state[keeps] == 0
        del e


def test_a_pool_whose_batches_grow_keeps_buffers_of_the_new_size(
    pool_channel: _channel.FdChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small batches fill the pool with small buffers (and permits for as many as fit); bigger
    # batches then let them go, each leaving a permit. The surplus over the (lower) target for
    # the bigger size must not stop the pool from keeping buffers again.
    monkeypatch.setattr(_buffers, "_buffer_wait", None)
    pool = _pool(pool_channel)
    end = _codec._worker_channel
    assert end is not None
    small, big = (256, 1024), (24, 256, 1024)  # 1 MiB, 24 MiB of float32
    assert pool._target(big[0] * big[1] * big[2] * 4) == 2

    def two_batches(shape: tuple[int, ...], value: float) -> int:
        """Two batches in flight at once, then dropped; how many reused a pool buffer."""
        held, reused = [], 0
        for k in range(2):
            out = _codec.batch_buffer(shape, torch.float32)
            reused += out.untyped_storage().data_ptr() in end.slot_of
            out.fill_(value + k)
            held.append(_codec.loads_result(_codec.dumps_result(out, (0, 2 * k))))
            _codec.release_unsent()
            del out
        assert [float(b.flatten()[0]) for b in held] == [value, value + 1]
        return reused

    assert sum(two_batches(small, float(i)) for i in range(10)) >= 18
    # A few fresh ones while the small buffers and their permits make way.
    assert sum(two_batches(big, float(i)) for i in range(10)) >= 15
    kept = [n for n in pool._nbytes if n]
    assert kept == [big[0] * big[1] * big[2] * 4] * 2
    # Buffers and permits together come back to the target as the surplus permits return.
    assert len(kept) + pool._permits <= 3 and _permits(pool) == pool._permits


def test_one_outsized_batch_does_not_set_the_pools_size_for_good() -> None:
    small, big = 4 << 20, 64 << 20
    with datasets.pools_on_a_memfd(big) as (fd, pools, channels):
        # Warming up with 4 MiB batches, one 64 MiB batch made with a permit: not kept.
        pool, ch = pools[0], channels[0]
        pool.offered(small)  # what receiving a batch tells the pool
        assert pool.adopt(ch, fd, small, permitted=True) == 0
        pool.offered(big)
        assert pool.adopt(ch, fd, big, permitted=True) == _buffers._PERMIT
        for _ in range(2 * pool.capacity):  # 4 MiB batches again, as many as the pool looks at
            pool.offered(small)
        got = [pool.adopt(ch, fd, small, permitted=True) for _ in range(5)]
        assert got == [1, 2, 3, 4, 5]  # the pool fills with buffers of the batches' size
        # A 64 MiB buffer kept at the start (the first batch was the big one) is let go when
        # its batch is dropped once the batches are small again, and permits take its place.
        pool, ch = pools[1], channels[1]
        pool.offered(big)
        assert pool.adopt(ch, fd, big, permitted=True) == 0
        for _ in range(2 * pool.capacity):
            pool.offered(small)
        permits = pool._permits
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, 64)  # type: ignore[attr-defined]
        pool.track(storage, 0)
        del storage  # the consumer drops the batch
        pool.release_dropped()
        assert pool._fds[0] < 0 and pool.state[0] == _buffers._EMPTY
        assert pool._permits > permits
