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
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

from ._consumer import Failure
from ._sampling import IndexStream

if TYPE_CHECKING:
    from ._epoch import Epoch

__all__ = ("Flight", "run_scheduler")


class Flight(NamedTuple):
    """One submitted index batch: its indices, the worker it is pinned to, its future."""

    indices: Any
    worker_id: int | None
    future: Future[Any] | None


async def run_scheduler(epoch: Epoch) -> None:
    """Submit every index batch of the epoch, then close the reorder buffer at the end."""
    loader = epoch.loader
    stream = IndexStream(loader._index_sampler, batch_sampler=loader.batch_sampler is not None)
    send_idx = 0
    try:
        while True:
            await epoch.permits.acquire()
            await epoch.resumed.wait()
            if epoch.terminal:
                return
            wid: int | None = None
            if loader._pinned_workers:
                wid = epoch.consumer.pick_worker()
                if wid is None:  # every iterable worker is exhausted
                    epoch.permits.release()
                    break
            try:
                indices = await stream.next()
            except StopAsyncIteration:
                if send_idx == 0 and epoch.epoch_no > 0 and loader._one_shot_sampler():
                    epoch.reorder.put(send_idx, Failure(one_shot_error()))
                    send_idx += 1
                else:
                    epoch.permits.release()
                break
            except Exception as exc:  # the user's sampler failed: raise it at this position
                epoch.reorder.put(send_idx, Failure(exc))
                send_idx += 1
                break
            # Pulling the indices may have yielded to the loop: a crash meanwhile pauses us here,
            # so nothing is submitted to workers already known to be dead.
            await epoch.resumed.wait()
            if epoch.terminal:
                return
            epoch.in_flight[send_idx] = Flight(indices, wid, None)
            epoch.submit(send_idx)
            send_idx += 1
        epoch.reorder.close(send_idx)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # a bug of ours: surface it rather than hang the consumer
        epoch.fail(exc)


def one_shot_error() -> ValueError:
    return ValueError(
        "the sampler (or batch_sampler) is a one-shot iterator that an earlier epoch used up, "
        "so this epoch would be empty; pass something iterable again each epoch (a list, a "
        "torch.utils.data.Sampler) instead of an iterator"
    )
