"""The loader's saved state: the dict ``state_dict()`` returns, and ``load_state_dict()``'s side.

Runs in: the event loop (or the caller's thread, for ``state_dict()``).

:func:`make_state` writes the dict from an epoch's :class:`~aioloader._resume.Progress`;
:meth:`Pending.parse` checks a loaded one against the loader and keeps what the next epoch needs;
:func:`resumed_progress` restores the generators and the sampler as they were at the saved epoch's
start, and :func:`epoch_seeds` draws (or restores) the epoch's seeds exactly as torch draws them.
:class:`Order` reads and restores the objects that decide an epoch's index order. Nothing here
imports a stage or the loader: the loader passes what it holds.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
from torch.utils.data import BatchSampler

from ._resume import FORMAT, VERSION, Position, Progress, Start

__all__ = ("Order", "Pending", "batching", "epoch_seeds", "make_state", "resumed_progress")


class Order:
    """The objects that decide an epoch's index order, as the loader holds them now: its
    sampler and batch sampler, torch's sampler of index batches, and the loader's generator."""

    __slots__ = ("batch_sampler", "generator", "index_sampler", "sampler")

    def __init__(
        self, sampler: Any, batch_sampler: Any, index_sampler: Any, generator: Any
    ) -> None:
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.index_sampler = index_sampler
        self.generator = generator

    def epoch_aware(self) -> list[Any]:
        """The samplers with ``set_epoch``, each once."""
        found: list[Any] = []
        for obj in (self.sampler, self.batch_sampler, getattr(self.batch_sampler, "sampler", None)):
            if callable(getattr(obj, "set_epoch", None)) and all(obj is not f for f in found):
                found.append(obj)
        return found

    def set_epoch(self, epoch: int) -> None:
        for obj in self.epoch_aware():
            obj.set_epoch(epoch)

    def sampler_epoch(self, told: int | None) -> int | None:
        """A sampler's own ``epoch``; else ``told``, the value last given to ``set_epoch``."""
        for obj in self.epoch_aware():
            value = getattr(obj, "epoch", None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return told

    def stateful_sampler(self) -> Any:
        for obj in (self.batch_sampler, self.sampler):
            if callable(getattr(obj, "state_dict", None)) and callable(
                getattr(obj, "load_state_dict", None)
            ):
                return obj
        return None

    def generators(self) -> dict[str, torch.Generator]:
        """The generators an epoch draws from, by role: the loader's, the sampler's own."""
        gens: dict[str, torch.Generator] = {}
        if isinstance(self.generator, torch.Generator):
            gens["loader"] = self.generator
        sampler = self.index_sampler
        inner = getattr(sampler, "sampler", None) if isinstance(sampler, BatchSampler) else sampler
        g = getattr(inner, "generator", None)
        if isinstance(g, torch.Generator) and g is not self.generator:
            gens["sampler"] = g
        return gens

    def snapshot(self, told_epoch: int | None) -> Start:
        """The start of an epoch that has not drawn anything yet: the current states."""
        sampler = self.stateful_sampler()
        return Start(
            generators={role: g.get_state() for role, g in self.generators().items()},
            sampler_state=copy.deepcopy(sampler.state_dict()) if sampler is not None else None,
            sampler_epoch=self.sampler_epoch(told_epoch),
        )

    def restore(self, start: Start) -> None:
        """Put the generators and the sampler back as they were at ``start``."""
        for role, g in self.generators().items():
            state = start.generator_state(role)
            if state is not None:
                g.set_state(state)
        sampler = self.stateful_sampler()
        if sampler is not None and start.sampler_state is not None:
            sampler.load_state_dict(copy.deepcopy(start.sampler_state))
        if start.sampler_epoch is not None:
            self.set_epoch(start.sampler_epoch)


def batching(batch_size: int | None, drop_last: bool, sampler: Any) -> dict[str, Any]:
    """What maps a delivered batch count to samples: a resumed epoch must agree on it."""
    try:
        sampler_len: int | None = len(sampler)
    except TypeError:  # a sampler without __len__ (an iterable's, a custom one)
        sampler_len = None
    return {"batch_size": batch_size, "drop_last": drop_last, "sampler_len": sampler_len}


def make_state(
    *,
    epoch: int,
    start: Start,
    position: Position,
    worker_states: dict[int, Any],
    last_worker: int | None,
    worker_batches: dict[int, int] | None,
    iterable: bool,
    num_workers: int,
    seeding: str,
    batching: dict[str, Any],
    persistent_seed: int | None,
) -> dict[str, Any]:
    """The state dict of an epoch at ``position`` (plain data, deep-copied)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "epoch": epoch,
        "delivered_below": position.low,
        "delivered_also": sorted(position.above),
        "batches_delivered": position.count,
        "dataset_kind": "iterable" if iterable else "map",
        "num_workers": num_workers,
        "seeding": seeding,
        **batching,
        "persistent_seed": persistent_seed,
        "start": start.to_dict(),
        "worker_states": {str(k): copy.deepcopy(v) for k, v in worker_states.items()},
        "last_worker": last_worker,
        "worker_batches": {str(k): n for k, n in (worker_batches or {}).items()},
    }


class Pending(NamedTuple):
    """A loaded state, checked, waiting for the next epoch."""

    epoch: int
    start: Start
    position: Position
    worker_states: dict[int, Any]
    worker_batches: dict[int, int]
    last_worker: int | None
    persistent_seed: int | None
    raw: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)

    @classmethod
    def parse(
        cls,
        state: object,
        *,
        iterable: bool,
        num_workers: int,
        sampling: dict[str, Any],
        persistent: bool,
    ) -> Pending:
        """Check ``state`` against a loader over an ``iterable`` (or map-style) dataset with
        ``num_workers`` workers, persistent or not, whose ``sampling`` (:func:`batching` and
        ``seeding``) a mid-epoch state must match. Raises ``ValueError`` naming what differs."""

        def bad(what: str) -> ValueError:
            return ValueError(
                f"load_state_dict() got {what}; pass a dict returned by "
                "AsyncDataLoader.state_dict()"
            )

        if not isinstance(state, dict):
            raise bad(f"a {type(state).__name__}")
        if state.get("format") != FORMAT:
            raise bad(f"a dict without format={FORMAT!r}")
        version = state.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise ValueError(
                f"load_state_dict() got a state of version {version!r}; this aioloader reads "
                f"versions up to {VERSION}: upgrade aioloader to load it"
            )
        try:
            kind = state["dataset_kind"]
            epoch = int(state["epoch"])
            low = int(state["delivered_below"])
            above = {int(i) for i in state["delivered_also"]}
            start = Start.from_dict(state["start"])
            worker_states = {int(k): v for k, v in (state.get("worker_states") or {}).items()}
            worker_batches = {
                int(k): int(n) for k, n in (state.get("worker_batches") or {}).items()
            }
            last = state.get("last_worker")
            last_worker = None if last is None else int(last)
            persistent_seed = state.get("persistent_seed")
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"a malformed state ({type(exc).__name__}: {exc})") from None
        mine = "iterable" if iterable else "map"
        if kind != mine:
            raise ValueError(
                f"load_state_dict() got the state of a loader over a {kind}-style dataset, but "
                f"this loader's dataset is {mine}-style; load it into a loader like the one that "
                "saved it"
            )
        if iterable:
            saved = state.get("num_workers")
            if saved != num_workers and (worker_states or low or above):
                raise ValueError(
                    f"this IterableDataset state was saved with num_workers={saved} and cannot be "
                    f"resumed with num_workers={num_workers}: each worker's replica of the "
                    "dataset is resumed from its own saved state, so use the same num_workers "
                    "(map-style datasets resume with any num_workers)"
                )
            # An iterable's send_idx only orders batches: go on counting from what was received.
            low, above = low + len(above), set()
        if low or above:
            # Mid-epoch: the received batches are skipped by count, so everything that decides
            # which samples a batch holds must be as it was.
            for field, now in sampling.items():
                if field in state and state[field] != now:
                    raise ValueError(
                        f"this state was saved mid-epoch by a loader with {field}="
                        f"{state[field]!r}, but this loader has {field}={now!r}: resuming would "
                        "skip or repeat samples (or change their augmentations). Resume with "
                        f"{field}={state[field]!r}, or from a state saved at an epoch's end "
                        "(those start the next epoch afresh)"
                    )
        if persistent_seed is not None and not persistent:
            persistent_seed = None
        return cls(
            epoch,
            start,
            Position(low, above),
            worker_states,
            worker_batches,
            last_worker,
            persistent_seed,
            copy.deepcopy(state),
        )


def resumed_progress(pending: Pending, order: Order, *, iterable: bool) -> Progress:
    """Restore the generators and the sampler to the saved epoch's start (``order``); the
    progress the resumed epoch starts from, past what was delivered."""
    start = pending.start
    order.restore(start)
    progress = Progress(
        pending.epoch,
        start,
        Position(pending.position.low, pending.position.above, counting=iterable),
        worker_states=pending.worker_states,
        worker_batches=pending.worker_batches,
        last_worker=pending.last_worker,
        iterable=iterable,
    )
    progress.resume_from = pending.position
    return progress


def _draw(generator: torch.Generator | None) -> int:
    """One int64 draw, as torch's iterator makes its seeds (the global RNG without a generator)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def epoch_seeds(
    start: Start,
    generator: torch.Generator | None,
    *,
    resuming: bool,
    datapipe: bool,
    kept_seed: int | None,
    workers: bool,
) -> tuple[int, int | None]:
    """The epoch's (base seed, an ``IterDataPipe``'s shared seed or None), recorded in ``start``.

    Drawn from ``generator`` in torch's order, or, ``resuming``, the saved epoch's, with the
    same draws made and dropped, so the generator (restored to the epoch's start) and the next
    epochs' seeds advance exactly as they did. ``kept_seed``: persistent workers' base seed,
    which torch draws once for their first epoch.
    """
    shared_seed: int | None = None
    if datapipe:
        # torch draws an IterDataPipe's shared seed every epoch (persistent workers too),
        # before the workers' base seed.
        if resuming and start.shared_seed is not None:
            if generator is not None:  # advance the restored generator as it went
                _draw(generator)
            shared_seed = start.shared_seed
        else:
            shared_seed = _draw(generator)
            start.shared_seed = shared_seed
    if resuming and start.base_seed is not None:
        # Resuming: the interrupted epoch's seed. If it was drawn from `generator`, draw again
        # (and discard) so the generator, restored to the epoch's start, advances as it did.
        if start.seed_drawn and generator is not None:
            _draw(generator)
        base_seed = start.base_seed
    elif kept_seed is not None:
        base_seed = kept_seed  # torch draws it once for persistent workers
        start.seed_drawn = False
    else:
        # As torch: the workers' base seed is drawn from `generator` before the sampler draws.
        base_seed = _draw(generator)
        start.seed_drawn = True
    start.base_seed = base_seed
    if (
        shared_seed is not None
        and workers
        and start.seed_drawn
        and (not resuming or generator is not None)
    ):
        # torch's multi-worker iterator draws the shared seed once more as it starts (for the
        # main process's copy of the DataPipe only): drawn and dropped here, so the generator
        # (and the next epochs' seeds) advance exactly as under torch.
        _draw(generator)
    if start.global_rng is None:
        # What the sampler will draw from if it uses the global RNG (a custom sampler records
        # it again, just before its iter()).
        start.record_global_rng(torch.get_rng_state())
    return base_seed, shared_seed
