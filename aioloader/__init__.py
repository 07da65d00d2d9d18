"""aioloader: an asyncio-native data loader for PyTorch."""

from __future__ import annotations

from ._bridge import SyncDataLoader
from ._errors import (
    AioLoaderError,
    EpochEndedError,
    LoaderClosedError,
    LoaderTimeoutError,
    PoisonBatchError,
    WorkerCrashedError,
)
from ._loader import AsyncDataLoader, AsyncMapDataset
from ._records import LoaderStats
from ._remote import AsyncIterableDataset, FetchPolicy, is_transient

__version__ = "0.1.0"

__all__ = [
    "AioLoaderError",
    "AsyncDataLoader",
    "AsyncIterableDataset",
    "AsyncMapDataset",
    "EpochEndedError",
    "FetchPolicy",
    "LoaderClosedError",
    "LoaderStats",
    "LoaderTimeoutError",
    "PoisonBatchError",
    "SyncDataLoader",
    "WorkerCrashedError",
    "__version__",
    "is_transient",
]
