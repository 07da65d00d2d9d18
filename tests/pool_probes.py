"""Datasets and callables that report what the process loading them holds (its pid, niceness,
seed, a worker_init_fn's mark): importable by reference from spawn and forkserver workers."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

#: Set by :func:`mark_worker_init` in a worker process only (never in the test process).
MARK = "AIOLOADER_TEST_POOL_MARK"


class Probe(Dataset[dict[str, Any]]):
    """Sample i: i, the loading process's pid, parent pid and niceness, its torch seed (a
    string: a 64-bit seed may not fit an int64 tensor), and the mark a ``worker_init_fn`` left
    in it. Index 0 takes ``slow_first`` seconds."""

    def __init__(self, n: int, slow_first: float = 0.0) -> None:
        self.n = n
        self.slow_first = slow_first

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if i == 0 and self.slow_first:
            time.sleep(self.slow_first)
        return {
            "i": i,
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "nice": os.nice(0),
            "seed": str(torch.initial_seed()),
            "mark": os.environ.get(MARK, ""),
        }


def mark_worker_init(worker_id: int) -> None:
    os.environ[MARK] = f"marked-{worker_id}"


def tag_collate(samples: list[Any]) -> Any:
    """torch's collation, with a tag saying this function made the batch."""
    return {**default_collate(samples), "tag": "tagged"}


def with_pid(sample: torch.Tensor) -> torch.Tensor:
    """An async source's transform: (value, pid of the worker that transformed it)."""
    return torch.tensor([int(sample), os.getpid()])


def negated_with_pid(sample: torch.Tensor) -> torch.Tensor:
    return torch.tensor([-int(sample), os.getpid()])
