"""Exceptions raised by aioloader itself.

Errors from user code (``Dataset.__getitem__``, ``__iter__``, ``collate_fn``, ``worker_init_fn``)
keep their own type and are re-raised in the consumer with the worker's traceback in the message,
as torch's DataLoader does. The loader's own failures use this hierarchy::

    AioLoaderError
    ├── LoaderClosedError       (also RuntimeError) iterated after aclose()
    ├── EpochEndedError         (also RuntimeError) an epoch ended early is iterated again
    ├── WorkerCrashedError      (also RuntimeError) a worker process died
    │   └── PoisonBatchError    the same index batch killed its worker twice
    └── LoaderTimeoutError      (also RuntimeError, TimeoutError) no batch within ``timeout``
"""

from __future__ import annotations

__all__ = (
    "AioLoaderError",
    "EpochEndedError",
    "LoaderClosedError",
    "LoaderTimeoutError",
    "PoisonBatchError",
    "WorkerCrashedError",
)


class AioLoaderError(Exception):
    """Base class of the errors aioloader raises for its own failures."""


class LoaderClosedError(AioLoaderError, RuntimeError):
    """Raised by ``AsyncDataLoader`` when it is iterated after ``aclose()``."""


class EpochEndedError(AioLoaderError, RuntimeError):
    """Raised by ``__anext__`` of an epoch that ended before its last batch and cannot go on.

    An epoch ends early when its consumer is cancelled while waiting for a batch (a notebook
    interrupt, ``asyncio.timeout``), or when a new epoch starts on a ``persistent_workers=True``
    loader whose workers it shared. The message says which; nothing is ever truncated silently.
    """


class WorkerCrashedError(AioLoaderError, RuntimeError):
    """Raised when a worker process dies (killed, segfault, ``os._exit``) and cannot be replaced.

    ``worker_id``, ``exitcode`` and ``indices`` name what was lost, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: int | None = None,
        exitcode: int | None = None,
        indices: object = None,
    ) -> None:
        super().__init__(message)
        self.worker_id = worker_id
        self.exitcode = exitcode
        self.indices = indices

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_crashed,
            (type(self), self.args[0], self.worker_id, self.exitcode, self.indices),
        )


class PoisonBatchError(WorkerCrashedError):
    """Raised when the same index batch killed its worker twice: one of its samples is bad."""


class LoaderTimeoutError(AioLoaderError, RuntimeError, TimeoutError):
    """Raised when no batch arrives within the loader's ``timeout`` seconds."""


def _rebuild_crashed(
    cls: type[WorkerCrashedError],
    message: str,
    worker_id: int | None,
    exitcode: int | None,
    indices: object,
) -> WorkerCrashedError:
    return cls(message, worker_id=worker_id, exitcode=exitcode, indices=indices)


def emfile_error(exc: BaseException) -> RuntimeError:
    """The error for running out of file descriptors (EMFILE), saying how to fix it."""
    err = RuntimeError(
        "Too many open files: each batch in shared memory holds a file descriptor until it is "
        "freed. Raise the limit (`ulimit -n 65536` in the shell, or resource.setrlimit("
        "resource.RLIMIT_NOFILE, ...)), keep fewer batches alive, or call "
        "torch.multiprocessing.set_sharing_strategy('file_system') at the start of the program."
    )
    err.__cause__ = exc
    return err
