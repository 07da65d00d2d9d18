"""Placeholder: replaced by the sampling stage."""

from __future__ import annotations

from typing import Any

__all__ = ("IndexStream",)


class IndexStream:
    def __init__(self, index_sampler: Any, *, batch_sampler: bool) -> None:
        self._sampler = index_sampler
        self._it: Any = None
        self._batch_sampler = batch_sampler
        self._pos = 0

    async def next(self) -> Any:
        if self._it is None:
            self._it = iter(self._sampler)
        try:
            indices = next(self._it)
        except StopIteration:
            raise StopAsyncIteration from None
        if self._batch_sampler and hasattr(indices, "__len__") and len(indices) == 0:
            raise IndexError(
                f"the batch sampler yielded an empty batch (batch {self._pos}); "
                "every batch needs at least one index"
            )
        self._pos += 1
        return indices
