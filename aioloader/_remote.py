"""Reading an async map-style dataset: requests in flight, timeouts, retries, hedging, clients.

Runs in: the consumer's event loop (``fetch_in="loop"``: :class:`SampleFetcher` is used by
``_stream``), or a worker (``fetch_in="workers"``: :class:`WorkerFetcher` runs a
:class:`SampleFetcher` on an event loop thread of the worker's own, and collates there).

One *request* is one call of the dataset's ``async def __getitem__`` (or of its
``async def __getitems__``, for a whole batch). The loader cannot see inside it, so what it
adds is what a client library cannot know: which index of which batch failed, how many calls
run at once across the batches of a worker, a second call for a straggling sample (hedging),
and when the dataset's client opens and closes (``__aenter__``/``__aexit__``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import errno
import inspect
import math
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch.utils.data import IterableDataset

from . import _ahead

_T_co = TypeVar("_T_co", covariant=True)

#: Backoff jitter draws from a generator of its own: a retry must not shift the draws of the
#: worker's seeded ``random`` (its augmentations) nor of the user's.
_JITTER = random.Random()

__all__ = (
    "AsyncIterableDataset",
    "FetchPolicy",
    "InWorkers",
    "SampleFetcher",
    "WorkerFetcher",
    "check_no_client",
    "check_policy",
    "is_transient",
)

#: HTTP statuses that say "try again": timeout, too early, throttled, server errors.
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
#: S3/botocore error codes of throttling and server-side trouble.
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
    }
)
_TRANSIENT_ERRNO = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        socket.EAI_AGAIN,  # a name lookup that may succeed in a moment
    }
)
#: Connection-level errors of aiohttp, httpx and botocore, by class name so that none of them
#: has to be imported (each is optional).
_TRANSIENT_NAMES = frozenset(
    {
        "ClientConnectionError",  # aiohttp: refused, reset, server disconnected
        "ClientPayloadError",  # aiohttp: the body broke off
        "ServerDisconnectedError",
        "TransportError",  # httpx: ConnectError, ReadError, timeouts, protocol errors
        "EndpointConnectionError",  # botocore
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "ResponseStreamingError",
        "HTTPClientError",
        "ProxyConnectionError",
        "IncompleteReadError",  # asyncio's and botocore's: the body broke off
    }
)
#: Connection errors that a repeat cannot mend (a certificate or fingerprint mismatch).
_PERMANENT_NAMES = frozenset(
    {
        "ClientConnectorCertificateError",
        "ClientConnectorSSLError",
        "ClientSSLError",
        "ServerFingerprintMismatch",
        "SSLCertVerificationError",
        "InvalidURL",
        "UnsupportedProtocol",
        "LocalProtocolError",
        "InvalidURLClientError",
    }
)


def _status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries, where it carries one (aiohttp, httpx, botocore,
    urllib)."""
    # ``code`` is urllib's HTTPError's; elsewhere it is often an application's own number.
    attrs = ("status", "status_code", "code") if "HTTP" in type(exc).__name__ else ("status",)
    for attr in attrs:
        value = getattr(exc, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        meta = response.get("ResponseMetadata")
        value = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
        return value if isinstance(value, int) else None
    for attr in ("status_code", "status"):
        value = getattr(response, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def is_transient(exc: BaseException) -> bool:
    """Whether a failed request is worth repeating: a timeout, a refused or reset connection, a
    body cut short, a 5xx or 429 status (S3's 503 SlowDown included). A 4xx (404 missing key,
    403 denied), a certificate error and any error from the dataset's own code are not.
    obstore's errors are not either: obstore retries by itself (its ``retry_config``), so what
    it raises is what is left after its retries.
    """
    if not isinstance(exc, Exception):
        return False
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & _PERMANENT_NAMES:
        return False
    if isinstance(exc, TimeoutError):  # asyncio.TimeoutError is TimeoutError too
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error")
        if isinstance(error, dict) and error.get("Code") in _TRANSIENT_CODES:
            return True
    status = _status(exc)
    if status is not None:
        return status in _TRANSIENT_STATUS or status >= 500
    if isinstance(exc, OSError) and exc.errno is not None:  # the errno says (EPERM: no)
        return exc.errno in _TRANSIENT_ERRNO
    if isinstance(exc, ConnectionError):
        return True
    return bool(names & _TRANSIENT_NAMES)


@dataclass(frozen=True)
class FetchPolicy:
    """How the loader calls an async dataset's ``__getitem__`` (one call is one request).

    Attributes:
        timeout: Seconds one call may take; a slower call is cancelled and counts as a
            transient failure (``TimeoutError``). ``None``: no limit (the client's own applies).
        retries: How often a call that failed transiently (:attr:`retry_on`) is repeated before
            its error is raised at its batch's position, naming the index. 0: never.
        backoff: Seconds before the first repeat; each next repeat waits twice as long, up to
            :attr:`max_backoff`, with full jitter (a random fraction of that wait).
        max_backoff: The longest wait between two attempts.
        retry_on: Whether an exception is transient. Default: :func:`is_transient`.
        hedge: ``None`` (off), or a quantile in ``[0.5, 1)``: a call still running after that
            quantile of the recent calls' durations gets a second, identical call, and a third
            if none has answered after as long again; the first answer wins and the others are
            cancelled. ``__getitem__`` calls only. Hedged calls run beside the
            ``source_concurrency`` others, at most ``2 * (1 - hedge) * source_concurrency`` of
            them (at least one) at a time.
        hedge_min_calls: Calls that must have completed before hedging starts.
    """

    timeout: float | None = None
    retries: int = 3
    backoff: float = 0.1
    max_backoff: float = 5.0
    retry_on: Callable[[BaseException], bool] = field(default=is_transient)
    hedge: float | None = None
    hedge_min_calls: int = 50

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before repeat number ``attempt`` (1 for the first). ``rng``: the
        jitter's generator (the loader's own: never the worker's seeded ``random``)."""
        cap = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
        return (rng or _JITTER).uniform(0, cap)


def check_policy(policy: object) -> FetchPolicy:
    """``policy`` validated; ``None`` gives the defaults. Raises naming the field at fault."""
    if policy is None:
        return FetchPolicy()
    if not isinstance(policy, FetchPolicy):
        raise TypeError(f"fetch_policy should be an aioloader.FetchPolicy, got {policy!r}")

    def number(name: str, value: object, low: float, low_ok: bool) -> None:
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or (value < low if low_ok else value <= low)
        ):
            raise ValueError(
                f"FetchPolicy.{name} should be a number {'>=' if low_ok else '>'} {low}, "
                f"got {value!r}"
            )

    if policy.timeout is not None:
        number("timeout", policy.timeout, 0, False)
    if (
        not isinstance(policy.retries, int)
        or isinstance(policy.retries, bool)
        or policy.retries < 0
    ):
        raise ValueError(f"FetchPolicy.retries should be an int >= 0, got {policy.retries!r}")
    number("backoff", policy.backoff, 0, True)
    number("max_backoff", policy.max_backoff, 0, True)
    if not callable(policy.retry_on):
        raise TypeError(f"FetchPolicy.retry_on should be a callable, got {policy.retry_on!r}")
    if policy.hedge is not None:
        number("hedge", policy.hedge, 0.5, True)
        if policy.hedge >= 1:
            raise ValueError(
                f"FetchPolicy.hedge should be a quantile in [0.5, 1) (0.99: hedge the slowest "
                f"1 % of calls), or None, got {policy.hedge!r}"
            )
    if (
        not isinstance(policy.hedge_min_calls, int)
        or isinstance(policy.hedge_min_calls, bool)
        or policy.hedge_min_calls < 1
    ):
        raise ValueError(
            f"FetchPolicy.hedge_min_calls should be a positive int, got {policy.hedge_min_calls!r}"
        )
    return policy


#: Hedged calls one sample may get at most (see :meth:`SampleFetcher._hedged`).
_HEDGES = 2


class _Latency:
    """Durations of the recent successful calls; their quantile, recomputed every few calls."""

    def __init__(self, size: int = 512, every: int = 16) -> None:
        self._recent: collections.deque[float] = collections.deque(maxlen=size)
        self._every = every
        self._since = 0
        self._cache: dict[float, float] = {}

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)
        self._since += 1
        if self._since >= self._every:
            self._since = 0
            self._cache.clear()

    def quantile(self, q: float, min_calls: int) -> float | None:
        if len(self._recent) < min_calls:
            return None
        value = self._cache.get(q)
        if value is None:
            ordered = sorted(self._recent)
            value = ordered[min(len(ordered) - 1, int(q * len(ordered)))]
            self._cache[q] = value
        return value


class _Entries:
    """Who holds a dataset object's async context in this process: one event loop at a time,
    counted, so that two epochs reading the same object on one loop share one client and the
    last to end closes it."""

    _held: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    @classmethod
    async def enter(cls, dataset: Any) -> None:
        loop = asyncio.get_running_loop()
        with cls._lock:
            held = cls._held.get(dataset)
            if held is not None:
                if held[0] is not loop:
                    raise RuntimeError(
                        f"{type(dataset).__name__}'s client (its __aenter__) is open on another "
                        "event loop: two epochs of the same dataset object overlap on different "
                        "loops (a thread executor's, or another thread's). Give each its own "
                        "dataset object, or let the first epoch end"
                    )
                held[1] += 1
                first = False
            else:
                # [loop, holders, entered (an Event), the error __aenter__ raised]
                held = [loop, 1, asyncio.Event(), None]
                cls._held[dataset] = held
                first = True
        if not first:
            await held[2].wait()  # the first holder's __aenter__ is done
            if held[3] is not None:
                raise held[3]
            return
        try:
            await dataset.__aenter__()
        except BaseException as exc:
            with cls._lock:
                cls._held.pop(dataset, None)
            held[3] = exc
            held[2].set()
            raise
        held[2].set()

    @classmethod
    def forget(cls) -> None:
        """In a forked child: the parent's contexts are not this process's to close."""
        cls._held = weakref.WeakKeyDictionary()
        cls._lock = threading.Lock()

    @classmethod
    async def leave(cls, dataset: Any) -> None:
        with cls._lock:
            held = cls._held.get(dataset)
            if held is None:
                return
            held[1] -= 1
            if held[1] > 0:
                return
            del cls._held[dataset]
        await held[2].wait()  # an __aenter__ still running finishes first
        await dataset.__aexit__(None, None, None)


os.register_at_fork(after_in_child=_Entries.forget)


async def _contained(fn: Callable[..., Any], *args: Any) -> Any:
    """``await fn(*args)`` in a task of its own: a ``SystemExit`` or ``KeyboardInterrupt`` from
    the dataset would leave such a task by stopping its event loop; it travels as ``_Escaped``.
    (The coroutine is made inside: a task cancelled before it starts leaves none unawaited.)"""
    try:
        return await fn(*args)
    except (SystemExit, KeyboardInterrupt) as exc:
        raise _Escaped(exc) from exc


def _retrieve(task: asyncio.Future[Any]) -> None:
    # A cancelled loser may still have failed first: its error was not what decided the call.
    if not task.cancelled():
        task.exception()


class SampleFetcher:
    """Calls an async dataset with at most ``concurrency`` calls in flight and ``policy``.

    One per event loop. The dataset's ``__aenter__`` runs before its first call on this loop
    and its ``__aexit__`` in :meth:`close`; a dataset without them is called as it is.
    """

    def __init__(self, dataset: Any, policy: FetchPolicy, concurrency: int) -> None:
        self.dataset = dataset
        self.policy = policy
        self._calls = asyncio.Semaphore(concurrency)
        # Hedged calls run beside the others: twice the share a quantile of q hedges, so
        # that they do not queue for each other (0.9: a fifth of concurrency; 0.99: 2 in 100).
        q = policy.hedge if policy.hedge is not None else 1.0
        self._hedges = asyncio.Semaphore(max(1, math.ceil(2 * (1 - q) * concurrency)))
        self._latency = _Latency()
        self._entered = False
        self._enter_lock = asyncio.Lock()
        #: Counts since this fetcher was made (read for stats and tests).
        self.requests = 0
        self.retried = 0
        self.hedged = 0
        getitems = getattr(dataset, "__getitems__", None)
        self._getitems = getitems if inspect.iscoroutinefunction(getitems) else None

    async def open(self) -> None:
        """Enter the dataset's async context once (its client opens here)."""
        if self._entered or not hasattr(type(self.dataset), "__aenter__"):
            return
        async with self._enter_lock:
            if not self._entered:
                await _Entries.enter(self.dataset)
                self._entered = True

    async def close(self) -> None:
        """Leave the dataset's async context if it was entered (its client closes here)."""
        if self._entered:
            self._entered = False
            await _Entries.leave(self.dataset)

    async def samples(self, indices: Any, batched: bool) -> list[Any]:
        """The samples of one batch (``batched``) or the one sample of ``indices``, in order.

        A ``SystemExit`` or ``KeyboardInterrupt`` from the dataset is raised as itself."""
        try:
            return await self._samples(indices, batched)
        except _Escaped as escaped:
            raise escaped.exc from None

    async def _samples(self, indices: Any, batched: bool) -> list[Any]:
        await self.open()
        if not batched:
            return [await self._with_retries(indices, self._hedged, indices)]
        if self._getitems is not None:
            getitems = self._getitems
            what = list(indices)
            return list(
                await self._with_retries(what, lambda _: self._attempt(getitems, what), what)
            )
        tasks = [
            asyncio.ensure_future(_contained(self._with_retries, idx, self._hedged, idx))
            for idx in indices
        ]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # one failed: the others are not needed any more
                task.cancel()

    async def _with_retries(self, key: Any, call: Callable[[Any], Any], arg: Any) -> Any:
        policy = self.policy
        attempt = 0
        while True:
            try:
                async with self._calls:
                    return await call(arg)
            except Exception as exc:
                transient = policy.retry_on(exc)
                if attempt >= policy.retries or not transient:
                    what = "indices" if isinstance(key, list) else "index"
                    tried = f" after {attempt + 1} attempts" if attempt else ""
                    why = (
                        "" if transient or policy.retries == 0 else " (not transient: not retried)"
                    )
                    exc.add_note(f"aioloader: fetching {what} {key!r} failed{tried}{why}")
                    raise
            attempt += 1
            self.retried += 1
            await asyncio.sleep(policy.delay(attempt, _JITTER))

    async def _attempt(self, call: Callable[[Any], Any], arg: Any) -> Any:
        self.requests += 1
        start = time.monotonic()
        timeout = self.policy.timeout
        if timeout is None:
            result = await call(arg)
        else:
            try:
                async with asyncio.timeout(timeout):
                    result = await call(arg)
            except TimeoutError as exc:
                exc.add_note(f"aioloader: the call took longer than FetchPolicy.timeout={timeout}s")
                raise
        self._latency.add(time.monotonic() - start)
        return result

    def _getitem(self, idx: Any) -> Any:
        return self.dataset[idx]

    async def _second_call(self, idx: Any) -> Any:
        # A hedge has slots of its own: in the queue for an ordinary slot it would wait behind
        # the very requests it races.
        async with self._hedges:
            return await self._attempt(self._getitem, idx)

    async def _hedged(self, idx: Any) -> Any:
        q = self.policy.hedge
        after = None if q is None else self._latency.quantile(q, self.policy.hedge_min_calls)
        if after is None:
            return await self._attempt(self._getitem, idx)
        tasks = {asyncio.ensure_future(_contained(self._attempt, self._getitem, idx))}
        first = next(iter(tasks))
        hedges = 0
        try:
            while True:
                # A second hedge: the first one meets a slow answer as often as any call does
                # (1 % of the time for a 1 % tail), and then the sample waits for the slower of
                # two slow calls; with a third, that takes three slow answers in a row.
                done, pending = await asyncio.wait(
                    tasks,
                    timeout=after if hedges < _HEDGES else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in done:
                    if task.exception() is None:
                        return task.result()
                if not done:  # slower than the quantile: one more call
                    hedges += 1
                    self.hedged += 1
                    pending.add(asyncio.ensure_future(_contained(self._second_call, idx)))
                elif not pending:  # every call failed: the first call's error is the cause
                    raise first.exception()  # type: ignore[misc]
                tasks = pending
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
                    task.add_done_callback(_retrieve)


class _Escaped(Exception):
    """A ``SystemExit`` or ``KeyboardInterrupt`` from the dataset, carried out of the event
    loop thread (see :meth:`WorkerFetcher._guarded`)."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(repr(exc))
        self.exc = exc


def _unescaped(fut: concurrent.futures.Future[Any]) -> Any:
    try:
        return fut.result()
    except _Escaped as escaped:
        raise escaped.exc from None


@dataclass(frozen=True)
class InWorkers:
    """What the workers are sent for ``fetch_in="workers"``: the async dataset and how to call
    it. A worker unwraps it: ``get_worker_info().dataset`` is the dataset itself."""

    dataset: Any
    policy: FetchPolicy
    concurrency: int
    transform: Callable[[Any], Any] | None


class WorkerFetcher:
    """torch's map-style fetcher, for an async dataset: ``fetch(indices)`` returns the batch.

    Runs in: a worker (a process, or the thread backend's threads together). The requests run
    on an event loop thread of this fetcher's own (``aioloader-io``), so that they overlap
    across the batches the worker has been sent: :meth:`start` begins a batch's requests as
    soon as its task is read (see ``_ahead``), and :meth:`fetch` collects them, applies the
    ``transform`` to each sample and collates, on the calling thread, in batch order (so seeds
    and ``get_worker_info()`` hold for them as for a sync dataset).
    """

    def __init__(
        self, spec: InWorkers, auto_collation: bool, collate_fn: Callable[[Any], Any]
    ) -> None:
        self._auto_collation = auto_collation
        self._collate_fn = collate_fn
        self._transform = spec.transform
        self._fetcher = SampleFetcher(spec.dataset, spec.policy, spec.concurrency)
        self._ahead: dict[Any, concurrent.futures.Future[list[Any]]] = {}
        self._outstanding: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()
        # Written (one byte) when any batch's requests finish: a worker waiting for one batch
        # also reads its next tasks meanwhile (see _ahead.wait).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._released = False
        self._thread = threading.Thread(target=self._run, name="aioloader-io", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            # However the loop was stopped (close() without waiting, or after _shutdown ran
            # past close()'s bound), no task is left pending in it: one destroyed later would
            # be closed with no loop to run its clean-up, and the dataset's client would stay
            # open. Bounded by _shutdown's own waits; a no-op after a finished _shutdown.
            with contextlib.suppress(BaseException):
                self._loop.run_until_complete(self._shutdown())
            if self._closed:
                self._release()

    def _release(self) -> None:
        """Close the loop and the wake-up pipe, once: the thread itself or close(), whichever
        comes last (a descriptor closed twice could close another owner's reuse of it)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        with contextlib.suppress(Exception):
            self._loop.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _spawn(self, make: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run the coroutine ``make()`` returns as a task of this fetcher's loop; its future.

        Not run_coroutine_threadsafe: that replaces a TimeoutError by a new one, without the
        traceback and the notes that say which index timed out. Every future is settled, by
        its task or by :meth:`close`, so no worker thread waits for ever.
        """
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def settle(task: asyncio.Task[Any]) -> None:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # close() did
                if task.cancelled():
                    fut.set_exception(concurrent.futures.CancelledError())
                elif (exc := task.exception()) is not None:
                    fut.set_exception(exc)
                else:
                    fut.set_result(task.result())

        def begin() -> None:
            with self._lock:
                # close() marks the fetcher closed under this lock before it settles what is
                # outstanding: a request it settled is never started (nor is it an error).
                if self._closed:
                    return
                running = fut.set_running_or_notify_cancel()
            if running:
                self._loop.create_task(self._guarded(make())).add_done_callback(settle)

        with self._lock:
            if self._closed:
                raise RuntimeError("aioloader: this worker's fetcher is closed")
            self._outstanding.add(fut)
        fut.add_done_callback(self._done)
        self._loop.call_soon_threadsafe(begin)
        return fut

    def _done(self, fut: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._outstanding.discard(fut)
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._wake_w, b"\0")

    def _submit(self, indices: Any) -> concurrent.futures.Future[list[Any]]:
        return self._spawn(lambda: self._fetcher.samples(indices, self._auto_collation))

    async def _guarded(self, coro: Any) -> Any:
        try:
            return await coro
        except (Exception, GeneratorExit):
            raise  # GeneratorExit: the coroutine is being closed, not run by the loop
        except BaseException as exc:
            task = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError):
                if task is not None and task.cancelling():
                    raise  # this fetcher closing
                # The dataset's own CancelledError: through the future it would read as a
                # cancellation, with the dataset's traceback lost.
                raise RuntimeError(
                    f"{type(self._fetcher.dataset).__name__}'s async __getitem__ raised "
                    "CancelledError without being cancelled; raise an Exception subclass "
                    "instead"
                ) from exc
            # SystemExit, KeyboardInterrupt: out of a task they would stop this event loop
            # for good; they travel to the worker's thread, which reports them as a sync
            # dataset's.
            raise _Escaped(exc) from exc

    def run(self, make: Callable[[], Any]) -> Any:
        """Await the coroutine ``make()`` returns on this fetcher's event loop, with the
        dataset's client open; return its result (the calling thread waits)."""

        async def opened() -> Any:
            await self._fetcher.open()
            return await make()

        return _unescaped(self._spawn(opened))

    def in_flight(self) -> int:
        """Batches whose requests are running now."""
        with self._lock:
            return len(self._outstanding)

    def start(self, key: Any, indices: Any) -> bool:
        """Begin the requests of the batch ``key`` now; :meth:`fetch` collects them. True if
        another batch's requests were running already."""
        with self._lock:
            if key in self._ahead or self._closed:
                return False
            others = bool(self._outstanding)
        fut = self._submit(indices)
        with self._lock:
            self._ahead.setdefault(key, fut)
        return others

    def fetch(
        self, indices: Any, key: Any = None, collating: Callable[[], None] | None = None
    ) -> Any:
        """The collated batch of ``indices``. Raises what the dataset or ``collate_fn`` raised.
        ``collating()`` is called once its requests are done, before ``transform``."""
        with self._lock:
            fut = self._ahead.pop(key, None) if key is not None else None
        if fut is None:
            fut = self._submit(indices)
        if not fut.done():
            _ahead.wait(fut, self._wake_r)
        samples = _unescaped(fut)
        if collating is not None:
            collating()
        if self._transform is not None:
            samples = [self._transform(sample) for sample in samples]
        if self._auto_collation:
            return self._collate_fn(samples)
        return self._collate_fn(samples[0])

    def close(self, timeout: float = 5.0) -> None:
        """Close the dataset's client (``__aexit__``), stop the event loop thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._ahead = {}
            outstanding = list(self._outstanding)
        for fut in outstanding:  # a thread waiting for one of these returns now
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                fut.set_exception(RuntimeError("aioloader: the loader's workers were stopped"))
        if timeout <= 0:
            # Nothing may wait: the loop stops where it stands and its thread cancels what is
            # left, closes the client and releases the descriptors on its own (_run).
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._loop.stop)
            return
        if self._thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            with contextlib.suppress(Exception):
                done.result(timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            # Only now: a late wake-up could otherwise write into a reused descriptor. A
            # thread still running releases them itself when it ends.
            self._release()

    async def _shutdown(self) -> None:
        this = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not this]
        for task in others:
            task.cancel()
        if others:
            await asyncio.wait(others, timeout=1.0)
        try:
            await asyncio.wait_for(self._fetcher.close(), 3.0)
        finally:
            await self._loop.shutdown_asyncgens()


#: Packages whose objects are clients bound to the process (and event loop) that made them.
_CLIENT_PACKAGES = frozenset(
    {
        "aiohttp",
        "httpx",
        "httpcore",
        "botocore",
        "aiobotocore",
        "boto3",
        "obstore",
        "s3fs",
        "gcsfs",
        "adlfs",
        "fsspec",
        "redis",
        "asyncio",
        "socket",
        "ssl",
        "google",
        "azure",
    }
)


def check_no_client(dataset: Any) -> None:
    """Raise a clear ``TypeError`` if one of the dataset's attributes is a client (a session, a
    connection, an event loop's object): the workers get a copy of the dataset, and such an
    object belongs to this process and its event loop.

    A shallow look at the attributes only, so it costs nothing for a large dataset; whatever
    else cannot travel fails where the workers' payload is pickled, with the attribute named.
    """
    try:
        items = list(vars(dataset).items())
    except TypeError:  # __slots__ or a C type: nothing to look at cheaply
        return
    for name, value in items:
        if isinstance(value, BaseException):  # an error kept to raise later is plain data
            continue
        package = (type(value).__module__ or "").split(".")[0]
        if package in _CLIENT_PACKAGES:
            raise TypeError(
                f"fetch_in='workers' sends the dataset to every worker, and "
                f"{type(dataset).__name__}.{name} is a {type(value).__module__}."
                f"{type(value).__qualname__}: a client bound to this process and its event "
                "loop. Make it in `async def __aenter__(self)` and close it in "
                "`async def __aexit__(self, *exc)` instead: the loader enters the dataset once "
                "in each worker's event loop and exits it when the worker ends. Or pass "
                "fetch_in='loop' to keep the dataset in this process."
            )


class AsyncIterableDataset(IterableDataset[_T_co]):
    """An ``IterableDataset`` read asynchronously: define ``async def __aiter__`` (an async
    generator), for example a reader of shards in an object store.

    With ``num_workers > 0`` each worker iterates its own replica on an event loop of the
    worker's own, so the iterator's background tasks (the next shard, fetched while this one is
    read) run while the worker collates; shard the data with ``get_worker_info()`` as for a
    torch ``IterableDataset``. With ``num_workers=0`` (or ``fetch_in="loop"``) it is read on the
    consumer's event loop, as a stream. ``async def __aenter__``/``__aexit__`` open and close
    its client on each of those loops.
    """

    def __aiter__(self) -> AsyncIterator[_T_co]:
        raise NotImplementedError(f"{type(self).__name__} must define async def __aiter__")

    def __iter__(self) -> Iterator[_T_co]:
        raise TypeError(
            f"{type(self).__name__} is iterated asynchronously (async def __aiter__): read it "
            "through aioloader.AsyncDataLoader, or with `async for`"
        )


class AsyncIterView:
    """A worker's view of an ``IterableDataset`` with ``async def __aiter__``, as the sync
    iterable torch's fetcher reads: each ``next()`` awaits the async iterator's ``__anext__``
    on the worker's event loop thread (``runner``), so the iterator's own tasks (a shard
    prefetched in the background) go on between two samples. Anything else is the dataset's.
    """

    def __init__(self, dataset: Any, runner: WorkerFetcher, transform: Any) -> None:
        self.dataset = dataset
        self._runner = runner
        self._transform = transform

    def __getattr__(self, name: str) -> Any:  # state_dict, load_state_dict, ...
        return getattr(self.dataset, name)

    def __iter__(self) -> _SyncIterator:
        return _SyncIterator(self.dataset.__aiter__(), self._runner, self._transform)


class _SyncIterator:
    def __init__(self, it: Any, runner: WorkerFetcher, transform: Any) -> None:
        self._it = it
        self._runner = runner
        self._transform = transform

    def __iter__(self) -> _SyncIterator:
        return self

    def __next__(self) -> Any:
        try:
            # __anext__ is called on the loop's thread: an async generator registers there
            # with the loop's hooks, which close it when it is dropped unfinished.
            sample = self._runner.run(self._it.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None
        return sample if self._transform is None else self._transform(sample)

    def __getattr__(self, name: str) -> Any:  # an iterator's own state_dict/load_state_dict
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._it, name)
