"""Index batches from the loader's sampler without holding the event loop. Runs in: the event loop.

torch's samplers do their set-up inside the iterator's first ``next()``: ``RandomSampler`` draws
``torch.randperm(n)`` and turns all ``n`` entries into Python ints at once (about 2 s for
n = 20 M). The scheduler asks for indices on the event loop, so done naively that time is a stall
of every other task on the loop.

:class:`IndexStream` yields exactly the index batches ``iter(index_sampler)`` yields, in the same
order, drawing from the same random generators in the same order, and keeps each of its steps on
the loop thread to a few milliseconds:

* ``RandomSampler`` and ``SequentialSampler`` (those exact types, alone or inside an exact
  ``BatchSampler``) are replayed lazily, step for step as their ``__iter__`` would run: a large
  permutation is drawn on a short-lived thread (torch releases the GIL while it draws) and turned
  into Python ints a few thousand at a time, as batches are asked for.
* Any other sampler is pulled for the first time (``iter()`` and the first ``next()``, where a
  sampler typically does its set-up) on a short-lived thread, then inline. A sampler that holds
  the GIL in one long C call (a ``tolist()`` of millions) still stalls the loop for that call: a
  thread cannot take the GIL from it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

from ._resume import Start
from ._threads import run_off_loop

__all__ = ("IndexStream", "is_empty_batch")

#: Permutations of at least this many indices are drawn on a thread. randperm costs ~20 ns per
#: index on 2 cores (0.6 ms at 2**15), starting a thread ~0.3 ms: below this, inline is cheaper.
_OFF_LOOP_DRAW = 1 << 15

#: Indices turned into Python ints per step (~0.3 ms of GIL for a tensor slice's tolist()).
_CONVERT = 1 << 13

# An outcome caught on a thread, to be raised or returned on the loop: (ok, value or exception).
_Outcome = tuple[bool, Any]


def is_empty_batch(indices: object) -> bool:
    """Whether a batch of indices is empty: it has a length, and that length is 0.

    Not ``not indices``: a numpy array or tensor of several indices has no truth value, and one
    holding the single index 0 is falsy. Objects without a length (an iterator) are not empty.
    """
    try:
        return len(indices) == 0  # type: ignore[arg-type]
    except TypeError:  # no __len__, or a 0-d array/tensor
        return False


def _capture(fn: Callable[[], Any]) -> Callable[[], _Outcome]:
    def run() -> _Outcome:
        try:
            return True, fn()
        except BaseException as exc:  # re-raised on the loop by the caller
            return False, exc

    return run


class _Draw(NamedTuple):
    """One step of a stock sampler's ``__iter__``: a block of indices to draw, then yield."""

    make: Callable[[], torch.Tensor | range]
    off_loop: bool
    limit: int | None  # yield only the first `limit` indices (RandomSampler's last permutation)


def _random_draws(sampler: RandomSampler, start: Start | None, replay: bool) -> Iterator[_Draw]:
    # RandomSampler.__iter__ (torch/utils/data/sampler.py), step for step: the seed, len() and
    # num_samples are read, and each block drawn, at the point where its own generator would, so
    # the global RNG and `generator` see the same draws in the same order.
    n = len(sampler.data_source)
    if sampler.generator is None:
        if replay and start is not None and start.sampler_seed is not None:
            seed = start.sampler_seed  # resuming: the seed the interrupted epoch drew
        elif (
            replay
            and start is not None
            and start.global_rng is not None
            and not torch.equal(start.rng_tensor(), torch.get_rng_state())
        ):
            # Resuming an epoch stopped before its sampler drew, in a process whose global RNG
            # has moved on: draw as it would have, from the global RNG as it stood when the
            # epoch started (a copy: this process's RNG is the user's).
            rng = torch.Generator()
            rng.set_state(start.rng_tensor())
            seed = int(torch.empty((), dtype=torch.int64).random_(generator=rng).item())
            start.sampler_seed = seed
        else:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            if start is not None:
                start.sampler_seed = seed
        generator = torch.Generator()
        generator.manual_seed(seed)
    else:
        generator = sampler.generator
    if sampler.replacement:
        # Blocks of 32 are drawn inline: a few microseconds each.
        for _ in range(sampler.num_samples // 32):
            yield _Draw(functools.partial(_randint, n, 32, generator), False, None)
        yield _Draw(
            functools.partial(_randint, n, sampler.num_samples % 32, generator), False, None
        )
    else:
        off_loop = n >= _OFF_LOOP_DRAW
        draw = functools.partial(torch.randperm, n, generator=generator)
        for _ in range(sampler.num_samples // n):
            yield _Draw(draw, off_loop, None)
        # Drawn even when it contributes nothing (num_samples % n == 0), as torch draws it.
        yield _Draw(draw, off_loop, sampler.num_samples % n)


def _randint(n: int, size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(high=n, size=(size,), dtype=torch.int64, generator=generator)


def _sequential_draws(sampler: SequentialSampler) -> Iterator[_Draw]:
    indices = range(len(sampler.data_source))
    yield _Draw(lambda: indices, False, None)


def _stock_draws(
    sampler: object, start: Start | None, replay: bool
) -> Callable[[], Iterator[_Draw]] | None:
    # Exact types only: a subclass may override __iter__ (or what it reads) in any way.
    if type(sampler) is RandomSampler:
        return functools.partial(_random_draws, sampler, start, replay)
    if type(sampler) is SequentialSampler:
        return functools.partial(_sequential_draws, sampler)
    return None


class _StockIndices:
    """A stock sampler's flat index sequence, made into Python ints as it is consumed.

    Cancel-safe: a cancelled :meth:`take` loses nothing; the next call returns what it would have.
    """

    def __init__(self, draws: Callable[[], Iterator[_Draw]]) -> None:
        self._start = draws
        self._draws: Iterator[_Draw] | None = None  # started by the first take(), as torch does
        self._step: _Draw | None = None  # taken from _draws, its block not yet received
        self._kept: _Outcome | None = None  # that block, drawn for a caller that was cancelled
        self._block: torch.Tensor | range = range(0)
        self._size = 0
        self._pos = 0  # next index of _block to convert
        self._end = 0
        self._ints: list[int] = []  # converted, not yet taken from position _i on
        self._i = 0
        self._exhausted = False

    def take_buffered(self, k: int) -> list[int] | None:
        """The next ``k`` indices if they are already converted (the common case), else None."""
        if len(self._ints) - self._i < k:
            return None
        out = self._ints[self._i : self._i + k]
        self._i += k
        return out

    async def take(self, k: int) -> list[int]:
        """The next ``k`` indices; fewer only when the sequence ends (none after its end)."""
        while len(self._ints) - self._i < k and not self._exhausted:
            await self._fill()
            if k > _CONVERT:  # one huge batch: let the loop run between conversions
                await asyncio.sleep(0)
        if self._i == 0 and k > _CONVERT:  # hand the buffer over rather than copy k entries
            out = self._ints
            self._ints = out[k:]
            del out[k:]
            return out
        out = self._ints[self._i : self._i + k]
        self._i += len(out)
        return out

    async def skip(self, n: int) -> None:
        """Pass over the next ``n`` indices without converting them (a resume's fast-forward)."""
        taken = min(n, len(self._ints) - self._i)
        self._i += taken
        n -= taken
        blocks = 0
        while n > 0 and not self._exhausted:
            if self._pos >= self._end:
                await self._next_block()
                blocks += 1
                if blocks % 256 == 0:  # many small blocks (sampling with replacement)
                    await asyncio.sleep(0)
                continue
            step = min(n, self._end - self._pos)
            self._pos += step
            n -= step

    async def _fill(self) -> None:
        """Convert the next piece of the current block, drawing the next block first if needed."""
        if self._pos >= self._end:
            await self._next_block()
        if self._pos < self._end:  # not after the end, nor for an empty last block
            stop = min(self._end, self._pos + _CONVERT)
            whole = self._pos == 0 and stop == self._size  # small blocks: skip the slice
            piece = self._block if whole else self._block[self._pos : stop]
            new = piece.tolist() if isinstance(piece, torch.Tensor) else list(piece)
            if self._i:  # drop what was taken; in place, so a huge batch grows in O(k)
                del self._ints[: self._i]
                self._i = 0
            self._ints.extend(new)
            self._pos = stop

    async def _next_block(self) -> None:
        if self._step is None:
            if self._draws is None:
                self._draws = self._start()
            try:
                self._step = next(self._draws)
            except StopIteration:
                self._exhausted = True
                return
            except BaseException:
                self._exhausted = True  # torch's generator is finished after raising, too
                raise
        step = self._step
        if self._kept is not None:
            outcome, self._kept = self._kept, None
        elif step.off_loop:
            outcome = await run_off_loop(
                _capture(step.make), name="sampler-draw", on_abandon=self._keep
            )
        else:
            outcome = _capture(step.make)()
        self._step = None
        ok, block = outcome
        if not ok:
            self._exhausted = True
            raise block
        # numel(), not len(): Tensor.__len__ is a Python wrapper, slow for 32-index blocks.
        self._size = block.numel() if isinstance(block, torch.Tensor) else len(block)
        self._block, self._pos = block, 0
        self._end = self._size if step.limit is None else min(step.limit, self._size)

    def _keep(self, outcome: _Outcome) -> None:
        self._kept = outcome


# Marks the end of a sampler in an outcome of its first pull.
_END: Any = object()


class IndexStream:
    """The loader's index batches (or single indices when ``batch_size=None``), one per await.

    ``index_sampler`` is the loader's ``_index_sampler``; ``batch_sampler`` is
    ``loader.batch_sampler is not None`` (then every item is a batch and must not be empty).
    A sampler's own exception propagates unchanged from :meth:`next`.

    ``start`` records the epoch's random draws for a resume (the seed a stock ``RandomSampler``
    drew, the global RNG a custom sampler started from); with ``replay`` those recorded draws are
    used instead of new ones, and the first ``skip`` items are passed over without being
    converted (stock samplers) or on the helper thread (any other).
    """

    def __init__(
        self,
        index_sampler: Any,
        *,
        batch_sampler: bool,
        start: Start | None = None,
        replay: bool = False,
        skip: int = 0,
    ) -> None:
        self._sampler = index_sampler
        self._check_empty = batch_sampler
        self._sent = 0  # items handed out: the send position of the next one
        self._done = False
        self._batch: BatchSampler | None = None
        self._start = start
        self._replay = replay
        self._skip = skip
        self._started = False
        draws = None
        if type(index_sampler) is BatchSampler:
            draws = _stock_draws(index_sampler.sampler, start, replay)
            if draws is not None:
                self._batch = index_sampler
        else:
            draws = _stock_draws(index_sampler, start, replay)
        self._stock = _StockIndices(draws) if draws is not None else None
        self._batch_size = 1  # a BatchSampler's is read when the first batch is asked for
        self._drop_last = False
        # Any other sampler: its iterator after the first pull, which runs on a thread.
        self._it: Iterator[Any] | None = None
        self._first: tuple[Iterator[Any] | None, _Outcome] | None = None  # kept on cancellation

    def __aiter__(self) -> IndexStream:
        return self

    async def __anext__(self) -> Any:
        return await self.next()

    async def next(self) -> Any:
        """The next index batch; ``StopAsyncIteration`` at the end of the sampler."""
        if self._done:
            raise StopAsyncIteration
        stock = self._stock
        if stock is not None and self._started:
            # Most pulls of a stock sampler: already converted, no await (and never empty).
            got = stock.take_buffered(self._batch_size)
            if got is not None:
                self._sent += 1
                return got if self._batch is not None else got[0]
        try:
            if stock is None:
                indices = await self._next_generic()
            else:
                indices = await self._next_stock(stock)
        except StopAsyncIteration:
            self._done = True
            raise
        except Exception:
            # A stock sampler's generator is finished once it raised; so is the replay of it.
            if stock is not None:
                self._done = True
            raise
        pos = self._sent
        self._sent += 1
        if self._check_empty and is_empty_batch(indices):
            raise IndexError(
                f"the batch sampler yielded an empty batch (send_idx={pos}); "
                "every batch needs at least one index"
            )
        return indices

    async def _next_stock(self, stock: _StockIndices) -> Any:
        if not self._started:
            if self._batch is not None:  # BatchSampler.__iter__ reads these when it starts
                self._batch_size, self._drop_last = self._batch.batch_size, self._batch.drop_last
            if self._skip:
                # Resuming: every skipped item was delivered, so it was complete.
                await stock.skip(self._skip * (self._batch_size if self._batch else 1))
                self._sent = self._skip
            self._started = True
        if self._batch is None:
            one = await stock.take(1)
            if not one:
                raise StopAsyncIteration
            return one[0]
        batch = await stock.take(self._batch_size)
        if not batch or (self._drop_last and len(batch) < self._batch_size):
            raise StopAsyncIteration
        return batch

    async def _next_generic(self) -> Any:
        if self._it is not None:
            try:
                return next(self._it)
            except StopIteration:
                raise StopAsyncIteration from None
        if self._first is None:
            first = await run_off_loop(
                self._first_pull, name="sampler", on_abandon=self._keep_first
            )
        else:
            first, self._first = self._first, None
        self._started = True
        it, (ok, value) = first
        if self._skip and self._sent == 0:
            self._sent = self._skip
        if it is None:  # iter() itself failed: there is nothing to pull from
            self._done = True
        else:
            self._it = it
        if not ok:
            raise value
        if value is _END:
            raise StopAsyncIteration
        return value

    def _first_pull(self) -> tuple[Iterator[Any] | None, _Outcome]:
        """Runs in: a short-lived thread. ``iter()``, the skipped items and the next, caught.

        The global torch RNG is what a custom sampler may draw from when it starts: recorded
        before ``iter()``, or, when replaying, set to the recorded state for ``iter()``, the
        skipped items and the next one, then given back (the process's own draws go on from
        where they were; a sampler that draws lazily later in the epoch draws from those).
        """
        start = self._start
        saved: torch.Tensor | None = None
        if start is not None:
            if self._replay and start.global_rng is not None:
                saved = torch.get_rng_state()
                torch.set_rng_state(start.rng_tensor())
            else:
                start.record_global_rng(torch.get_rng_state())
        try:
            try:
                it = iter(self._sampler)
            except BaseException as exc:
                return None, (False, exc)
            try:
                for _ in range(self._skip):
                    next(it)
                return it, (True, next(it))
            except StopIteration:
                return it, (True, _END)
            except BaseException as exc:
                return it, (False, exc)
        finally:
            if saved is not None:
                torch.set_rng_state(saved)

    def _keep_first(self, first: tuple[Iterator[Any] | None, _Outcome]) -> None:
        self._first = first
