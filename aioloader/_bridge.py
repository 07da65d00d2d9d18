"""The bridge for synchronous code: ``for batch in loader.sync():``.

Runs in: the caller's thread (``SyncDataLoader`` and its epoch iterator) and one portal thread
per bridged loader, which runs the loader's event loop through anyio's blocking portal. Every
call into the loader (starting an epoch, each ``__anext__``, ending an epoch, ``aclose()``) is
made on that loop, so the loader's own guarantees (order, errors with the worker's traceback,
crash recovery, release of workers) hold unchanged; the caller's thread only waits for results.

The portal thread starts at the first epoch and ends when the loader is closed (``close()``,
``with``), garbage collected, or at interpreter exit. It is a daemon thread, so a script that
never closes its loader still exits; the atexit hook closes such loaders properly first.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import signal
import threading
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, NoReturn, Protocol, Self

import anyio
from anyio.from_thread import BlockingPortal
from torch.utils.data import DataLoader
from typing_extensions import TypeVar

from . import _notebook
from ._attrs import TorchAttributes
from ._errors import LoaderClosedError

if TYPE_CHECKING:
    from ._records import LoaderStats

__all__ = ("BridgedLoader", "SyncDataLoader")

_B = TypeVar("_B", default=Any)
_B_co = TypeVar("_B_co", covariant=True, default=Any)
_R = TypeVar("_R")


class BridgedLoader(Protocol[_B_co]):
    """What a :class:`SyncDataLoader` runs: an :class:`~aioloader.AsyncDataLoader`.

    A protocol, so that the bridge depends on what it calls and not on the loader's module.
    """

    def __aiter__(self) -> AsyncIterator[_B_co]: ...

    def __len__(self) -> int: ...

    async def aclose(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def set_epoch(self, epoch: int) -> None: ...

    def stats(self) -> LoaderStats: ...

    def _check_open(self) -> None: ...

    def _is_closed(self) -> bool: ...

    def _torch_loader(self) -> DataLoader[Any]: ...

    def _pin_memory_warnings(self) -> list[str]: ...


class _Portal:
    """An event loop on a daemon thread, serving one loader through an anyio ``BlockingPortal``.

    The thread is this object's own (not anyio's ``start_blocking_portal`` context manager):
    nothing here runs on garbage collection. A forked child that inherited a dropped loader (a
    worker of torch's DataLoader, say; ours freeze what they inherit) frees its copy in its
    first collection; a context manager's cleanup would then call into a loop thread that
    exists only in the parent and wait for ever.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._stopped = False
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()

        async def serve() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            # A ^C from a terminal goes to the process: let the caller's thread take it.
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                anyio.run(serve, backend="asyncio")
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                raise

        self._thread = threading.Thread(target=run, name="aioloader-bridge", daemon=True)
        self._thread.start()
        self.portal: BlockingPortal = ready.result()
        self.thread_id: int | None = self._thread.ident

    def on_portal_thread(self) -> bool:
        return threading.get_ident() == self.thread_id

    def usable(self) -> bool:
        """Whether this process is the one whose thread runs the portal's loop."""
        return os.getpid() == self.pid

    def stop(self) -> None:
        """End the loop and join its thread (from the portal thread itself: without the join).

        In a forked child it does nothing: the loop's thread is the parent's.
        """
        if self._stopped or not self.usable():
            return
        self._stopped = True
        if self.on_portal_thread():  # garbage collection ran there: a thread cannot join itself
            threading.Thread(target=self._stop, name="aioloader-bridge-stop", daemon=True).start()
        else:
            self._stop()

    def _stop(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop already ended (interpreter exit)
            self.portal.call(self.portal.stop)
        self._thread.join()


# The portal of each bridged loader, weakly keyed: a collected loader's finalizer stops it.
_portals: weakref.WeakKeyDictionary[BridgedLoader[Any], _Portal] = weakref.WeakKeyDictionary()
_portals_lock = threading.Lock()
_notebook.bridged = _portals.__contains__
# loader -> its bridge, so loader.sync() returns one object while it lives (the bridge holds
# its loader: a strong value here would keep the loader alive for ever).
_bridges: weakref.WeakKeyDictionary[BridgedLoader[Any], weakref.ref[SyncDataLoader[Any]]] = (
    weakref.WeakKeyDictionary()
)


def _portal_for(loader: BridgedLoader[Any]) -> _Portal:
    with _portals_lock:
        portal = _portals.get(loader)
        if portal is None:
            portal = _portals[loader] = _Portal()
            # Holds the portal, not the loader: the loader stays collectable.
            weakref.finalize(loader, portal.stop).atexit = False
        return portal


def _refuse_in_running_loop(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"{what} a SyncDataLoader blocks, and an event loop is running in this thread (a "
        "coroutine, or a notebook cell): it would stall that loop. Use `async for batch in "
        "loader:` there, or run the synchronous code in a thread (asyncio.to_thread)."
    )


class SyncDataLoader(TorchAttributes, Generic[_B]):
    """An :class:`~aioloader.AsyncDataLoader` for synchronous code, made by ``loader.sync()``.

    ``for batch in bridge:`` is one epoch, as with torch's ``DataLoader``: the same batches in
    the same order as ``async for``, an error raised with the worker's traceback, a crashed
    worker recovered. ``break`` (or dropping the iterator) ends the epoch and releases its
    workers before the loop goes on. The loader runs on an event loop in one background thread
    (``aioloader-bridge``), started at the first epoch; ``close()`` or leaving ``with`` closes
    the loader and ends that thread. Iterating from a thread that runs an event loop raises
    ``RuntimeError``: there, use ``async for``. Use one bridge from one thread at a time.

    Example::

        with AsyncDataLoader(dataset, batch_size=64, num_workers=8).sync() as loader:
            for epoch in range(3):
                for x, y in loader:
                    ...
    """

    def __init__(self, loader: BridgedLoader[_B]) -> None:
        self._loader = loader

    @classmethod
    def _of(cls, loader: BridgedLoader[_B]) -> SyncDataLoader[_B]:
        with _portals_lock:
            ref = _bridges.get(loader)
            bridge = ref() if ref is not None else None
            if bridge is None:
                bridge = cls(loader)
                _bridges[loader] = weakref.ref(bridge)
        return bridge

    def _torch_loader(self) -> DataLoader[Any]:
        return self._loader._torch_loader()

    @property
    def loader(self) -> BridgedLoader[_B]:
        """The asynchronous loader this bridge runs."""
        return self._loader

    def __len__(self) -> int:
        """Batches per epoch, as ``len()`` of torch's DataLoader."""
        return len(self._loader)

    def __repr__(self) -> str:
        return f"<SyncDataLoader of {self._loader!r}>"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        # IPython's text for a cell's result, which its output history keeps: say so.
        printer.text(repr(self))
        _notebook.warn_if_kept(
            self._loader, self, "{}.close()", "with AsyncDataLoader(...).sync() as loader:"
        )

    def stats(self) -> LoaderStats:
        """The loader's :meth:`~aioloader.AsyncDataLoader.stats`."""
        return self._loader.stats()

    def state_dict(self) -> dict[str, Any]:
        """The loader's :meth:`~aioloader.AsyncDataLoader.state_dict`, taken on its loop."""
        return self._on_loop(self._loader.state_dict)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The loader's :meth:`~aioloader.AsyncDataLoader.load_state_dict`: the next epoch
        continues where ``state`` stood."""
        self._on_loop(self._loader.load_state_dict, state)

    def set_epoch(self, epoch: int) -> None:
        """The loader's :meth:`~aioloader.AsyncDataLoader.set_epoch`."""
        self._on_loop(self._loader.set_epoch, epoch)

    def _on_loop(self, fn: Callable[..., _R], *args: object) -> _R:
        # On the loader's loop thread while one runs, so nothing races an epoch in progress.
        portal = _portals.get(self._loader)
        if portal is None or portal.on_portal_thread():
            return fn(*args)
        return portal.portal.call(fn, *args)

    def __aiter__(self) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__!r} object is not an async iterable: loader.sync() is for "
            "synchronous code (`for batch in loader.sync():`). In a coroutine, iterate the "
            "AsyncDataLoader itself: `async for batch in loader:`"
        )

    def __iter__(self) -> Iterator[_B]:
        """Start an epoch on the loader's event loop thread."""
        _refuse_in_running_loop("Iterating")
        self._loader._check_open()
        for message in self._loader._pin_memory_warnings():
            warnings.warn(message, stacklevel=2)  # at the caller's `for`, not on the loop's thread
        portal = _portal_for(self._loader)
        iterator = portal.portal.call(_start_epoch, self._loader)
        return _SyncEpoch(portal, iterator)

    def close(self) -> None:
        """Close the loader (its ``aclose()``) and end the bridge's thread. Safe to call twice."""
        loader = self._loader
        with _portals_lock:
            portal = _portals.pop(loader, None)
        if portal is None:
            if loader._is_closed():
                return
            portal = _Portal()  # never iterated here: a loop just to close it
        try:
            portal.portal.call(loader.aclose)
        finally:
            portal.stop()

    def __enter__(self) -> Self:
        self._loader._check_open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


#: How often a caller waiting for a batch wakes to run Python signal handlers (a ^C).
_SIGNAL_POLL_S = 0.05


def _wait(future: concurrent.futures.Future[_R]) -> _R:
    """``future.result()``, interruptible by ^C.

    A signal handled on another thread (a ^C the kernel delivered to one of the process's other
    threads, or one raised there) leaves a thread blocked in a lock wait asleep until the wait
    ends: a batch that is minutes away, or workers still starting, would hold the
    KeyboardInterrupt back that long. Short waits let the handler run within ~50 ms.
    """
    while True:
        try:
            return future.result(timeout=_SIGNAL_POLL_S)
        except concurrent.futures.TimeoutError:
            # The same class as the builtin TimeoutError: the loader's LoaderTimeoutError (or a
            # dataset's own TimeoutError) raised by a finished future is the answer, not a wait.
            if future.done():
                raise


async def _start_epoch(loader: BridgedLoader[_B]) -> Any:
    return aiter(loader)


async def _step(iterator: Any) -> tuple[bool, Any]:
    """One ``__anext__`` on the loop: ``(False, None)`` at the end of the epoch."""
    try:
        return True, await anext(iterator)
    except StopAsyncIteration:
        return False, None
    finally:
        # A traceback kept by the caller (sys.last_traceback) must not hold the epoch open.
        del iterator


async def _end_epoch(iterator: Any) -> None:
    await iterator.aclose()


async def _end_epoch_nowait(iterator: Any) -> None:
    iterator.end_now()


class _SyncEpoch(Generic[_B]):
    """One epoch for a synchronous ``for``; ``break`` drops it, and so ends the epoch."""

    def __init__(self, portal: _Portal, iterator: Any) -> None:
        self._portal = portal
        self._iterator: Any = iterator

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> _B:
        iterator = self._iterator
        if iterator is None:
            raise StopIteration
        try:
            future: concurrent.futures.Future[tuple[bool, Any]] = (
                self._portal.portal.start_task_soon(_step, iterator)
            )
        except RuntimeError:  # the portal stopped: close() ran while this epoch was open
            self._iterator = None
            raise LoaderClosedError(
                "the loader was closed (close(), or leaving `with`) while this epoch was running"
            ) from None
        del iterator
        try:
            more, batch = _wait(future)
        except BaseException as exc:
            if not future.done():  # KeyboardInterrupt while waiting: the epoch ends, as in torch
                future.cancel()
                # Without waiting for the cleanup: workers still starting (a large dataset to
                # pickle, spawn) would hold the ^C back until they are up. The loop releases
                # them once they are; close() and the next epoch wait for that.
                self._abandon()
            elif not isinstance(exc, Exception):
                self.close()
            # An error in one batch: the epoch goes on for a caller that asks again. The
            # traceback (kept by a REPL or a test runner) must not hold the epoch open, though:
            # once the caller drops this iterator, its workers are released.
            del self
            raise
        if not more:
            self.close()
            raise StopIteration
        return batch  # type: ignore[no-any-return]

    def _abandon(self) -> None:
        """End the epoch on the loop's thread and return at once."""
        iterator, self._iterator = self._iterator, None
        if iterator is None or not self._portal.usable():
            return
        with contextlib.suppress(RuntimeError):  # the portal already stopped
            self._portal.portal.start_task_soon(_end_epoch_nowait, iterator)

    def close(self) -> None:
        """End the epoch and wait until its workers are released."""
        iterator, self._iterator = self._iterator, None
        if iterator is None or not self._portal.usable():  # a forked child: not ours to end
            return
        if self._portal.on_portal_thread():
            # Garbage collection on the loop's thread: dropping the iterator ends the epoch
            # there and then (its __del__), and waiting would deadlock the loop.
            return
        with contextlib.suppress(RuntimeError):  # the portal already stopped (interpreter exit)
            self._portal.portal.call(_end_epoch, iterator)

    def __del__(self) -> None:
        if getattr(self, "_iterator", None) is not None:
            self.close()


@atexit.register
def _close_at_exit() -> None:
    """Close loaders still bridged at interpreter exit, so their workers stop in order."""
    for loader, portal in list(_portals.items()):
        if portal.usable():  # not in a forked child that inherited the parent's bridges
            with contextlib.suppress(Exception):
                SyncDataLoader._of(loader).close()
