"""Scheduler stage: index batches -> workers. Runs in: one task per epoch, on the event loop.

Upstream: the sampler (through ``_sampling.IndexStream``, which keeps its heavy first step off the
loop). Downstream: the epoch's backend. Each index batch gets the next ``send_idx`` and waits for
one of ``max_in_flight`` permits first, so no more than that many batches are ever submitted and
not yet received by the consumer. Submissions pause while the epoch recovers from a crash.

Iterable datasets and ``in_order=True`` map-style datasets assign batches to workers round-robin,
as torch does (over the iterable workers not yet exhausted); ``in_order=False`` leaves the choice
to the backend's shared queue.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from ._records import Failure, Flight, Plan
from ._resume import batch_seed
from ._sampling import IndexStream

if TYPE_CHECKING:
    from ._reorder import ReorderBuffer
    from ._resume import Progress

__all__ = ("Flight", "SubmitSide", "run_scheduler")


class _Picker(Protocol):
    def pick_worker(self, outstanding: list[int] | None = None, bound: int = 0) -> int | None:
        """The next worker in torch's round-robin that is not exhausted (and has room)."""
        ...

    def all_exhausted(self) -> bool: ...


class SubmitSide(Protocol):
    """What the scheduler (and the stream scheduler) use of their epoch."""

    plan: Plan
    epoch_no: int
    base_seed: int
    shared_seed: int | None
    progress: Progress
    replay: bool
    resume_states: dict[int, Any]
    permits: asyncio.Semaphore
    resumed: asyncio.Event
    reorder: ReorderBuffer[Any]
    in_flight: dict[int, Flight]
    outstanding: list[int]
    arrived: asyncio.Event

    @property
    def consumer(self) -> _Picker: ...

    @property
    def terminal(self) -> bool: ...

    def submit(self, send_idx: int) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


async def run_scheduler(epoch: SubmitSide) -> None:
    """Submit every index batch of the epoch, then close the reorder buffer at the end.

    A resumed epoch starts at the first ``send_idx`` its consumer did not receive and passes
    over the index batches delivered before, without loading them.
    """
    plan = epoch.plan
    progress = epoch.progress
    resume = progress.resume_from
    skip = resume.low if resume is not None else 0
    above = resume.above if resume is not None else set()
    stream = IndexStream(
        plan.index_sampler,
        batch_sampler=plan.batch_sampler_given,
        start=progress.start,
        replay=epoch.replay,
        skip=skip,
    )
    batch_seeding = plan.seeding == "batch"
    # An iterable's batch is worker w's k-th, whichever send_idx carries it: once a worker runs
    # dry, how many of its turns were already handed out before that was known is timing. So its
    # seed follows (k, w), numbered k * workers + w: the send_idx while every worker is active,
    # and the send_idx itself with one worker.
    workers = max(1, plan.num_workers)
    turns = dict(progress.worker_batches)  # worker id -> its batches submitted so far
    pending = epoch.resume_states  # worker id -> dataset state, until its first batch
    send_idx = skip
    try:
        while True:
            await epoch.permits.acquire()
            await epoch.resumed.wait()
            if epoch.terminal:
                return
            try:
                indices = await stream.next()
            except StopAsyncIteration:
                if send_idx == 0 and epoch.epoch_no > 0 and plan.one_shot_sampler:
                    epoch.reorder.put(send_idx, Failure(one_shot_error()))
                    send_idx += 1
                else:
                    epoch.permits.release()
                break
            except Exception as exc:  # the user's sampler failed: raise it at this position
                epoch.reorder.put(send_idx, Failure(exc))
                send_idx += 1
                break
            if send_idx in above:  # delivered before the resume (in_order=False)
                send_idx += 1
                epoch.permits.release()
                continue
            wid: int | None = None
            if plan.pinned_workers:
                wid = await _pick(epoch)
                if epoch.terminal:
                    return
                if wid is None:  # every iterable worker is exhausted
                    epoch.permits.release()
                    break
                epoch.outstanding[wid] += 1
            # Pulling the indices may have yielded to the loop: a crash meanwhile pauses us here,
            # so nothing is submitted to workers already known to be dead.
            await epoch.resumed.wait()
            if epoch.terminal:
                return
            seed: int | None = None
            if batch_seeding:
                number = send_idx
                if wid is not None:
                    k = turns.get(wid, 0)
                    turns[wid] = k + 1
                    number = k * workers + wid
                seed = batch_seed(epoch.base_seed, progress.epoch, number)
            state = pending.pop(wid, None) if pending and wid is not None else None
            epoch.in_flight[send_idx] = Flight(indices, wid, None, seed, state, epoch.shared_seed)
            epoch.submit(send_idx)
            send_idx += 1
        epoch.reorder.close(send_idx)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # a bug of ours: surface it rather than hang the consumer
        epoch.fail(exc)


async def _pick(epoch: SubmitSide) -> int | None:
    """The worker for the next batch: torch's round-robin, and with ``in_order=False`` only a
    worker below its share of the in-flight bound (torch's rule), so one stuck on a slow item
    does not collect the others' turns. None once every worker is exhausted."""
    if epoch.plan.in_order:
        return epoch.consumer.pick_worker()
    while True:
        wid = epoch.consumer.pick_worker(epoch.outstanding, epoch.plan.max_in_flight)
        if wid is not None or epoch.consumer.all_exhausted() or epoch.terminal:
            return wid
        epoch.arrived.clear()
        await epoch.arrived.wait()


def one_shot_error() -> ValueError:
    return ValueError(
        "the sampler (or batch_sampler) is a one-shot iterator that an earlier epoch used up, "
        "so this epoch would be empty; pass something iterable again each epoch (a list, a "
        "torch.utils.data.Sampler) instead of an iterator"
    )
