"""Resume state: what the consumer has received, and how to replay an epoch up to there.

Runs in: the event loop (bookkeeping per delivered batch) and, for :func:`batch_seed`, anywhere.

The state of a loader is the position of its latest epoch plus what is needed to replay that
epoch's index order exactly:

* the random draws the epoch made: its workers' base seed, the seed a stock ``RandomSampler``
  without a generator drew, the global RNG a custom sampler saw when it started, and the state at
  the epoch's start of every ``torch.Generator`` the loader and its sampler use;
* a custom sampler's own ``state_dict()`` from the epoch's start and its ``set_epoch`` value;
* which ``send_idx`` the consumer received (all below a watermark, plus a short list above it when
  ``in_order=False``); for an ``IterableDataset``, each worker's dataset state after the last batch
  of that worker the consumer received.

Resuming draws the epoch's index batches again from that replayed order and skips the ones that
were delivered, without loading them. Bookkeeping per batch is O(1): a set insert and a counter.
"""

from __future__ import annotations

import base64
import copy
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ("FORMAT", "VERSION", "Position", "Progress", "Start", "batch_seed")

FORMAT = "aioloader.AsyncDataLoader"
VERSION = 1

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def batch_seed(base_seed: int, epoch: int, send_idx: int) -> int:
    """The seed of one batch under ``seeding="batch"``: a 64-bit mix of the three numbers.

    Depends on nothing else (not the worker, not the timing), so the same generator gives the same
    augmentations for any ``num_workers`` and after a resume.
    """
    x = _splitmix64(base_seed & _MASK)
    x = _splitmix64(x ^ (epoch & _MASK))
    return _splitmix64(x ^ (send_idx & _MASK))


def encode_rng(state: torch.Tensor) -> str:
    """A generator state (a uint8 tensor) as a JSON-safe string."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


class Position:
    """The ``send_idx`` values the consumer received in one epoch; O(1) per batch.

    Every index below ``low`` was received; ``above`` holds those received past it (only out of
    order, and never more than the batches in flight).
    """

    __slots__ = ("above", "count", "counting", "low")

    def __init__(
        self, low: int = 0, above: set[int] | None = None, *, counting: bool = False
    ) -> None:
        self.low = low
        self.above: set[int] = set(above or ())
        self.count = low + len(self.above)
        # Iterable datasets: a send_idx names no data (and exhausted workers' indices are never
        # delivered), so only the number received is kept: low == count.
        self.counting = counting

    def mark(self, idx: int) -> None:
        if self.counting:
            self.count += 1
            self.low = self.count
            return
        if idx < self.low or idx in self.above:
            raise RuntimeError(f"aioloader bug: send_idx {idx} delivered twice")
        self.count += 1
        if idx == self.low:
            self.low += 1
            while self.low in self.above:
                self.above.discard(self.low)
                self.low += 1
        else:
            self.above.add(idx)

    def delivered(self, idx: int) -> bool:
        return idx < self.low or idx in self.above


@dataclass
class Start:
    """Random draws and sampler state that decide an epoch's index order; filled as they happen.

    RNG states are kept as tensors and encoded only when a state dict is asked for.
    """

    #: Generator states at the epoch's start, by role ("loader", "sampler").
    generators: dict[str, torch.Tensor | str] = field(default_factory=dict)
    base_seed: int | None = None
    #: An ``IterDataPipe``'s shared seed for the epoch (drawn before ``base_seed``, as torch does).
    shared_seed: int | None = None
    #: The epoch drew ``base_seed`` (persistent workers draw it only for their first epoch).
    seed_drawn: bool = False
    #: A stock RandomSampler without a generator: the seed it drew from the global RNG.
    sampler_seed: int | None = None
    #: A custom sampler: the global torch RNG just before its ``iter()``.
    global_rng: torch.Tensor | str | None = None
    #: A custom sampler's ``state_dict()`` taken before the epoch started it.
    sampler_state: Any = None
    #: ``sampler.epoch`` (``set_epoch``) for the epoch.
    sampler_epoch: int | None = None

    def record_global_rng(self, state: torch.Tensor) -> None:
        self.global_rng = state

    def rng_tensor(self) -> torch.Tensor:
        assert self.global_rng is not None
        return _tensor(self.global_rng)

    def generator_state(self, role: str) -> torch.Tensor | None:
        state = self.generators.get(role)
        return None if state is None else _tensor(state)

    def to_dict(self) -> dict[str, Any]:
        # Encoded once: the states of a started epoch never change, and state_dict() may be
        # called after every batch.
        self.generators = {k: _text(v) for k, v in self.generators.items()}
        if self.global_rng is not None:
            self.global_rng = _text(self.global_rng)
        return {
            "generators": dict(self.generators),
            "base_seed": self.base_seed,
            "shared_seed": self.shared_seed,
            "seed_drawn": self.seed_drawn,
            "sampler_seed": self.sampler_seed,
            "global_rng": self.global_rng,
            "sampler_state": copy.deepcopy(self.sampler_state),
            "sampler_epoch": self.sampler_epoch,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Start:
        return cls(
            generators=dict(d.get("generators") or {}),
            base_seed=d.get("base_seed"),
            shared_seed=d.get("shared_seed"),
            seed_drawn=bool(d.get("seed_drawn", False)),
            sampler_seed=d.get("sampler_seed"),
            global_rng=d.get("global_rng"),
            sampler_state=copy.deepcopy(d.get("sampler_state")),
            sampler_epoch=d.get("sampler_epoch"),
        )


def _text(state: torch.Tensor | str) -> str:
    return state if isinstance(state, str) else encode_rng(state)


def _tensor(state: torch.Tensor | str) -> torch.Tensor:
    return decode_rng(state) if isinstance(state, str) else state


class Progress:
    """One epoch's resumable progress, shared by the epoch (which updates it) and the loader.

    Holds no reference to the epoch or its workers, so the loader may keep the latest one for
    :meth:`AsyncDataLoader.state_dict` after the epoch is gone.
    """

    def __init__(
        self,
        epoch: int,
        start: Start,
        position: Position | None = None,
        *,
        worker_states: dict[int, Any] | None = None,
        worker_batches: dict[int, int] | None = None,
        last_worker: int | None = None,
        iterable: bool = False,
    ) -> None:
        self.epoch = epoch
        self.iterable = iterable
        #: An iterable batch was delivered with no dataset state to record (no state_dict).
        self.stateless = False
        self.start = start
        self.position = position if position is not None else Position(counting=iterable)
        #: Iterable datasets: worker id -> (target, state) after its last delivered batch.
        self.worker_states: dict[int, Any] = dict(worker_states or {})
        #: Iterable datasets: worker id -> batches (or errors) of it the consumer received; the
        #: k-th batch of worker w has the same seed under seeding="batch" whatever the timing.
        self.worker_batches: dict[int, int] = dict(worker_batches or {})
        #: Iterable datasets: worker id -> its dataset's own state once its iterator ran dry.
        self.end_states: dict[int, Any] = {}
        # Exhausted workers are not recorded: after a resume one gets a batch, reports itself
        # exhausted again, and the round-robin order of the others' batches is the same.
        self.last_worker = last_worker
        #: The consumer received the epoch's end (StopAsyncIteration).
        self.finished = False
        #: Where a resumed epoch starts: (low, above) of the loaded position.
        self.resume_from: Position | None = None
        #: ``num_workers=0``, an iterable dataset: the epoch's fetcher, made when it began (its
        #: iterator's state is the epoch's until a batch is received).
        self.start_fetcher: Any = None

    def delivered(self, idx: int, worker_id: int | None, dataset_state: Any) -> None:
        """The consumer received the batch (or the error) at ``idx``."""
        self.position.mark(idx)
        self.start_fetcher = None  # the batch's state is the epoch's from now on
        if worker_id is not None:
            self.last_worker = worker_id
            if self.iterable:
                self.worker_batches[worker_id] = self.worker_batches.get(worker_id, 0) + 1
            if dataset_state is not None:
                self.worker_states[worker_id] = dataset_state
            elif self.iterable:
                self.stateless = True

    def exhausted(self, worker_id: int, end_state: Any) -> None:
        """An iterable worker ran dry; ``end_state`` is its dataset's own state then, if any."""
        if end_state is not None:
            self.end_states[worker_id] = end_state
