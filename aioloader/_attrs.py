"""torch DataLoader's attributes as typed properties. Runs in: the caller's thread.

``AsyncDataLoader`` and ``SyncDataLoader`` build a torch ``DataLoader`` at construction to validate
their arguments and fill in torch's defaults (the sampler, ``collate_fn``, ``prefetch_factor``).
The attributes read from it, so they hold exactly what torch's would, and they are real
properties: they show in ``dir()``, a type checker knows their types, and a misspelt name is an
error for mypy and an ``AttributeError`` at runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from multiprocessing.context import BaseContext
from typing import Any, NoReturn

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ("TorchAttributes", "check_prefetch_factor")


def check_prefetch_factor(value: object, num_workers: int) -> None:
    """``ValueError`` unless ``value`` is a positive int (with workers) or None (without)."""
    if num_workers == 0:
        if value is not None:
            # torch's own message for this case
            raise ValueError(
                "prefetch_factor option could only be specified in multiprocessing."
                "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor "
                "to None."
            )
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        # torch accepts 0 (then fails with a bare AssertionError when iterated) and floats
        # (2.5 would make the in-flight bound fractional, and so no bound at all).
        raise ValueError(
            f"prefetch_factor must be at least 1 and an int with num_workers > 0 (the number "
            f"of batches each worker loads ahead), got {value!r}"
        )


def _frozen(name: str, owner: object) -> NoReturn:
    # torch's own error for the attributes its DataLoader refuses to change after __init__.
    raise ValueError(
        f"{name} attribute should not be set after {type(owner).__name__} is initialized"
    )


class TorchAttributes:
    """The attributes of ``torch.utils.data.DataLoader``, read from ``_torch_loader()``.

    ``dataset``, ``batch_size``, ``sampler``, ``batch_sampler``, ``drop_last`` and
    ``persistent_workers`` cannot be set after construction (torch's ``ValueError``); the others
    can, with torch's conversions (``multiprocessing_context="spawn"`` becomes a context).
    """

    __slots__ = ()

    def _torch_loader(self) -> DataLoader[Any]:
        raise NotImplementedError

    # ------------------------------------------------------------ fixed after construction

    @property
    def dataset(self) -> Dataset[Any]:
        """The dataset batches are loaded from."""
        return self._torch_loader().dataset

    @dataset.setter
    def dataset(self, value: object) -> NoReturn:
        _frozen("dataset", self)

    @property
    def batch_size(self) -> int | None:
        """Samples per batch; ``None`` when batching is off or a ``batch_sampler`` is given."""
        return self._torch_loader().batch_size

    @batch_size.setter
    def batch_size(self, value: object) -> NoReturn:
        _frozen("batch_size", self)

    @property
    def sampler(self) -> Sampler[Any] | Iterable[Any]:
        """The sampler of sample indices (torch's default one when none was given)."""
        return self._torch_loader().sampler

    @sampler.setter
    def sampler(self, value: object) -> NoReturn:
        _frozen("sampler", self)

    @property
    def batch_sampler(self) -> Sampler[list[Any]] | Iterable[list[Any]] | None:
        """The sampler of index batches; ``None`` when batching is off (``batch_size=None``)."""
        return self._torch_loader().batch_sampler

    @batch_sampler.setter
    def batch_sampler(self, value: object) -> NoReturn:
        _frozen("batch_sampler", self)

    @property
    def drop_last(self) -> bool:
        """Whether an incomplete last batch is dropped."""
        return self._torch_loader().drop_last

    @drop_last.setter
    def drop_last(self, value: object) -> NoReturn:
        _frozen("drop_last", self)

    @property
    def persistent_workers(self) -> bool:
        """Whether worker processes live from the first epoch until the loader is closed."""
        return bool(self._torch_loader().persistent_workers)

    @persistent_workers.setter
    def persistent_workers(self, value: object) -> NoReturn:
        _frozen("persistent_workers", self)

    # ---------------------------------------------------------- settable, as on torch's loader

    @property
    def num_workers(self) -> int:
        """Worker processes per epoch; 0 loads on one helper thread."""
        return self._torch_loader().num_workers

    @num_workers.setter
    def num_workers(self, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            # torch's own message (its DataLoader checks only at construction)
            raise ValueError(
                "num_workers option should be non-negative; use num_workers=0 to disable "
                "multiprocessing."
            )
        loader = self._torch_loader()
        if value > 0 and loader.prefetch_factor is None:
            loader.prefetch_factor = 2  # torch's default with workers
        loader.num_workers = value

    @property
    def collate_fn(self) -> Callable[[list[Any]], Any]:
        """Turns a list of samples into a batch (torch's ``default_collate`` by default)."""
        fn: Callable[[list[Any]], Any] = self._torch_loader().collate_fn
        return fn

    @collate_fn.setter
    def collate_fn(self, value: Callable[[list[Any]], Any]) -> None:
        self._torch_loader().collate_fn = value

    @property
    def pin_memory(self) -> bool:
        """Whether batches are copied into page-locked memory."""
        return self._torch_loader().pin_memory

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        self._torch_loader().pin_memory = value

    @property
    def timeout(self) -> float:
        """Seconds to wait for a batch before raising; 0 waits without limit."""
        return self._torch_loader().timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._torch_loader().timeout = value

    @property
    def worker_init_fn(self) -> Callable[[int], None] | None:
        """Called with the worker id in each worker process before it loads anything."""
        fn: Callable[[int], None] | None = self._torch_loader().worker_init_fn
        return fn

    @worker_init_fn.setter
    def worker_init_fn(self, value: Callable[[int], None] | None) -> None:
        self._torch_loader().worker_init_fn = value

    @property
    def multiprocessing_context(self) -> BaseContext | None:
        """The start method's context; ``None`` means the platform's default."""
        ctx: BaseContext | None = self._torch_loader().multiprocessing_context
        return ctx

    @multiprocessing_context.setter
    def multiprocessing_context(self, value: str | BaseContext | None) -> None:
        self._torch_loader().multiprocessing_context = value

    @property
    def generator(self) -> torch.Generator | None:
        """The random generator the sampler and the workers' base seed draw from."""
        gen: torch.Generator | None = self._torch_loader().generator
        return gen

    @generator.setter
    def generator(self, value: torch.Generator | None) -> None:
        self._torch_loader().generator = value

    @property
    def prefetch_factor(self) -> int | None:
        """Batches each worker loads ahead; ``None`` with ``num_workers=0``."""
        return self._torch_loader().prefetch_factor

    @prefetch_factor.setter
    def prefetch_factor(self, value: int | None) -> None:
        check_prefetch_factor(value, self._torch_loader().num_workers)
        self._torch_loader().prefetch_factor = value

    @property
    def pin_memory_device(self) -> str:
        """Deprecated by torch: the device to pin for (the current accelerator is used)."""
        return self._torch_loader().pin_memory_device

    @pin_memory_device.setter
    def pin_memory_device(self, value: str) -> None:
        self._torch_loader().pin_memory_device = value

    @property
    def in_order(self) -> bool:
        """Whether batches are yielded in sampler order (``False``: as they complete)."""
        return bool(self._torch_loader().in_order)

    @in_order.setter
    def in_order(self, value: bool) -> None:
        self._torch_loader().in_order = value
