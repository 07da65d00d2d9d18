"""Datasets and samplers for the resume tests (importable by spawn/forkserver workers)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info


class Indexed(Dataset[int]):
    """Returns its index; ``slow`` indices sleep, so out-of-order delivery really happens."""

    def __init__(self, n: int, slow: frozenset[int] = frozenset()) -> None:
        self.n = n
        self.slow = slow

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.slow:
            time.sleep(0.05)
        return i


class Augmented(Dataset[torch.Tensor]):
    """An index plus random augmentations from all three RNGs a worker seeds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        noise = torch.rand(3, dtype=torch.float64)
        extra = torch.tensor([random.random(), float(np.random.rand())], dtype=torch.float64)
        return torch.cat([torch.tensor([float(i)], dtype=torch.float64), noise, extra])


class GlobalRngSampler(Sampler[int]):
    """A custom sampler with no state_dict that shuffles with the global torch RNG."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        yield from torch.randperm(self.n).tolist()


class StatefulSampler(Sampler[int]):
    """A custom sampler with its own seed in a state_dict; reshuffles every epoch."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        self.seed = seed
        self.epochs_started = 0
        self.state_dict_calls = 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epochs_started)
        self.epochs_started += 1
        yield from torch.randperm(self.n, generator=g).tolist()

    def state_dict(self) -> dict[str, int]:
        self.state_dict_calls += 1
        return {"seed": self.seed, "epochs_started": self.epochs_started}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = state["seed"]
        self.epochs_started = state["epochs_started"]


class Counting(IterableDataset[int]):
    """Yields its worker's shard of ``range(n)``; resumable through its iterator's state_dict."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        return _CountingIter(list(range(wid, self.n, nw)))


class _CountingIter:
    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.pos = 0

    def __iter__(self) -> _CountingIter:
        return self

    def __next__(self) -> int:
        if self.pos >= len(self.items):
            raise StopIteration
        self.pos += 1
        return self.items[self.pos - 1]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class DatasetLevelState(IterableDataset[int]):
    """Keeps its position on the dataset itself (state_dict on the dataset, not the iterator)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pos = 0
        self._resume_at = 0

    def __iter__(self) -> Iterator[int]:
        start, self._resume_at = self._resume_at, 0
        for i in range(start, self.n):
            self.pos = i + 1  # before yielding: state_dict() is taken right after next()
            yield i
        self.pos = 0  # ran dry: the next iterator starts from the beginning (a state says so)

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume_at = state["pos"]


class Stateless(IterableDataset[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


class Sharded(IterableDataset[int]):
    """Shards ``range(n)`` by rank and worker together, from ``get_worker_info()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[Any]:
        info: Any = get_worker_info()
        shard = info.rank * info.num_workers + info.id
        shards = info.world_size * info.num_workers
        return iter(range(shard, self.n, shards))


class RandomPicks(IterableDataset[int]):
    """Draws from the global torch RNG and keeps it in its state (as upstream's tests do)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.i = 0

    def __iter__(self) -> RandomPicks:
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return int(torch.randint(1000, (1,)).item())

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]
        torch.set_rng_state(state["rng"])


class _Picks:
    """An iterator over ``n`` draws from the global torch RNG, which its state keeps."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.i = 0

    def __iter__(self) -> _Picks:
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return int(torch.randint(1000, (1,)).item())

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]
        torch.set_rng_state(state["rng"])


class PicksOnIterator(IterableDataset[int]):
    """:class:`RandomPicks` with the state on the iterator ``__iter__`` returns."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> _Picks:
        return _Picks(self.n)


class PicksPerWorker(IterableDataset[tuple[int, int]]):
    """``n`` draws per worker from its torch RNG, tagged with the worker id; the position and the
    RNG are the dataset's state, the position reset when it runs dry (as docs/resume.md asks)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.i = 0

    def __iter__(self) -> Iterator[tuple[int, int]]:
        info = get_worker_info()
        wid = info.id if info is not None else 0
        while self.i < self.n:
            self.i += 1
            yield wid, int(torch.randint(1000, (1,)).item())
        self.i = 0

    def state_dict(self) -> dict[str, Any]:
        return {"i": self.i, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.i = state["i"]
        torch.set_rng_state(state["rng"])


class PicksPerWorkerOnIterator(IterableDataset[int]):
    """:class:`PicksOnIterator` in workers: the worker's RNG is in its iterator's state."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> _Picks:
        return _Picks(self.n)


class SetUpInIter(IterableDataset[int]):
    """Its own iterator, whose position (and so its state) exists once ``__iter__`` ran."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> SetUpInIter:
        self.pos = 0
        return self

    def __next__(self) -> int:
        if self.pos >= self.n:
            raise StopIteration
        self.pos += 1
        return self.pos - 1

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


class EpochTagged(IterableDataset[tuple[int, int, int]]):
    """Each worker's shard of ``range(n)`` tagged with how many epochs this replica has run.

    Its epoch count lives on the dataset, so it goes on across epochs where the dataset does
    (``num_workers=0``, persistent workers) and restarts at 0 in fresh workers, as in torch.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.epoch = 0
        self._skip = 0

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        items = list(range(wid, self.n, nw))
        skip, self._skip = self._skip, 0
        for pos in range(skip, len(items)):
            self._pos = pos + 1
            yield items[pos], self.epoch, wid
        self.epoch += 1
        self._pos = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": getattr(self, "_pos", 0)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self._skip = state["epoch"], state["pos"]


class Uneven(IterableDataset[int]):
    """Worker 0 yields ``long`` random numbers, every other worker ``short``: they run dry apart.

    Resumable by position; the numbers come from the global RNG that seeding seeds per batch.
    """

    def __init__(self, long: int, short: int) -> None:
        self.long, self.short = long, short
        self.pos = 0
        self._skip = 0

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        n = self.long if info is None or info.id == 0 else self.short
        skip, self._skip = self._skip, 0
        for pos in range(skip, n):
            self.pos = pos + 1
            yield int(torch.randint(1_000_000, (1,)).item())

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._skip = state["pos"]
