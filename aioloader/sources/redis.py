"""A Redis Streams consumer-group source, at least once. Needs ``pip install aioloader[redis]``.

Reads with ``XREADGROUP GROUP g c COUNT n BLOCK ms STREAMS s >`` on the event loop (the
``redis.asyncio`` client), and the loader acknowledges each batch with ``XACK`` once its consumer
has received it (see :class:`~aioloader.AsyncDataLoader`). Entries read but never acknowledged (the
consumer was killed, or left with ``break``) stay in the group's pending list and are read again:

* by a consumer restarted under the same name, which first re-reads its own pending entries;
* by any consumer of the group, which claims entries pending for longer than ``claim_idle_s`` on
  other (dead) consumers with ``XAUTOCLAIM``, at start and every ``claim_every_s``.

A lost server (refused, reset, or frozen so that a reply takes longer than ``block_s +
socket_timeout_s``) is reconnected to with exponential backoff for up to ``reconnect_for_s``
seconds; within that time the epoch goes on where it stopped, still at least once. Past it,
:class:`StreamConnectionError` (a ``ConnectionError``) is raised at the batch's position in the
consumer, chaining the client's error; it never hangs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar

from .._errors import AioLoaderError

try:
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisError, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "aioloader.sources.redis needs the redis package: pip install 'aioloader[redis]'"
    ) from exc

__all__ = ("RedisStreamSource", "StreamConnectionError", "StreamEntry")

_logger = logging.getLogger(__name__)
_T = TypeVar("_T")
# What a lost, restarting or frozen server raises. Everything else (a wrong command, a missing
# permission) is an answer from a live server and is raised at once.
_LOST = (RedisConnectionError, RedisTimeoutError)


class StreamConnectionError(AioLoaderError, ConnectionError):
    """Raised by :class:`RedisStreamSource` when the server stayed unreachable for
    ``reconnect_for_s`` seconds.

    A ``ConnectionError``, so ``except ConnectionError`` catches it; ``__cause__`` is the
    ``redis`` client's last error (``redis.exceptions.ConnectionError`` or ``TimeoutError``).
    """


class StreamEntry(NamedTuple):
    """One stream entry: its ID and its fields (``str`` keys and values, decoded as UTF-8)."""

    id: str
    fields: dict[str, str]


class RedisStreamSource:
    """Entries of one Redis stream, read as consumer ``consumer`` of group ``group``.

    Pass it as the loader's dataset; give the loader a ``transform`` that turns a
    :class:`StreamEntry` into tensors. Use it as an async context manager (or call :meth:`aclose`)
    to close its connections.

    Args:
        url: The server, as ``redis://host:port/db``.
        stream: The stream's key.
        group: The consumer group; created at the stream's start (``start_id``) if missing.
        consumer: This consumer's name, unique in the group. A consumer restarted under the same
            name re-reads what it read but never acknowledged.
        count: Entries asked for per ``XREADGROUP``/``XAUTOCLAIM`` call.
        block_s: How long one ``XREADGROUP`` waits for new entries.
        claim_idle_s: Entries pending on another consumer for this long are claimed (that
            consumer is taken for dead). Longer than the slowest batch's time to acknowledge.
        claim_every_s: How often stale entries are looked for.
        start_id: Where a newly created group starts: ``"0"`` (the whole stream) or ``"$"`` (only
            entries added from now on).
        socket_timeout_s: A reply slower than ``block_s`` plus this fails as a lost connection
            (a frozen server is noticed after ``block_s + socket_timeout_s``).
        reconnect_for_s: How long to keep reconnecting to a lost server before raising
            :class:`StreamConnectionError`, counted from the first failure; ``0`` raises at the
            first failure, ``None`` reconnects forever. The error comes at most ``reconnect_for_s
            + block_s + socket_timeout_s`` after the server was lost.
        reconnect_delay_s: The first wait between reconnection attempts; each next wait doubles,
            up to ``reconnect_max_delay_s``.
        reconnect_max_delay_s: The longest wait between two attempts.
        stop_after_idle_s: End the iteration (so the epoch finishes and its last batch is
            acknowledged) once no entry arrived for this long; ``None`` (the default) reads
            forever. For draining a backlog, and for tests.
    """

    def __init__(
        self,
        url: str,
        stream: str,
        group: str,
        consumer: str,
        *,
        count: int = 256,
        block_s: float = 0.1,
        claim_idle_s: float = 30.0,
        claim_every_s: float = 5.0,
        start_id: str = "0",
        socket_timeout_s: float = 5.0,
        stop_after_idle_s: float | None = None,
        reconnect_for_s: float | None = 60.0,
        reconnect_delay_s: float = 0.1,
        reconnect_max_delay_s: float = 5.0,
    ) -> None:
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count should be a positive int (entries per read), got {count!r}")
        for name, fvalue in (
            ("block_s", block_s),
            ("claim_idle_s", claim_idle_s),
            ("claim_every_s", claim_every_s),
            ("socket_timeout_s", socket_timeout_s),
            ("stop_after_idle_s", 1.0 if stop_after_idle_s is None else stop_after_idle_s),
            ("reconnect_delay_s", reconnect_delay_s),
            ("reconnect_max_delay_s", reconnect_max_delay_s),
        ):
            if not isinstance(fvalue, (int, float)) or isinstance(fvalue, bool) or fvalue <= 0:
                raise ValueError(f"{name} should be a positive number of seconds, got {fvalue!r}")
        if reconnect_for_s is not None and (
            not isinstance(reconnect_for_s, (int, float))
            or isinstance(reconnect_for_s, bool)
            or reconnect_for_s < 0
        ):
            raise ValueError(
                "reconnect_for_s should be a number of seconds >= 0 (0: never reconnect) or None "
                f"(reconnect forever), got {reconnect_for_s!r}"
            )
        self.url = url
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.count = count
        self.block_s = block_s
        self.claim_idle_s = claim_idle_s
        self.claim_every_s = claim_every_s
        self.start_id = start_id
        self.socket_timeout_s = socket_timeout_s
        self.stop_after_idle_s = stop_after_idle_s
        self.reconnect_for_s = reconnect_for_s
        self.reconnect_delay_s = reconnect_delay_s
        self.reconnect_max_delay_s = reconnect_max_delay_s
        self._client: aioredis.Redis | None = None
        # Entries yielded and not acknowledged yet: XAUTOCLAIM, or a re-read of this consumer's
        # pending entries after a reconnect, must not hand them to us twice.
        self._held: set[str] = set()
        # Set on a reconnect: a reply lost with the connection may have moved entries into this
        # consumer's pending list that were never yielded, and a restarted server may have lost
        # the group. The reader re-creates the group and re-reads its pending entries.
        self._resync = False
        # One outage for every command in flight (a read and an ack may both see it): when it
        # began and the attempts made since, so it is logged once, lost and back.
        self._down_since: float | None = None
        self._attempts = 0

    def __repr__(self) -> str:
        return (
            f"<RedisStreamSource {self.url} stream={self.stream!r} group={self.group!r} "
            f"consumer={self.consumer!r}>"
        )

    async def __aenter__(self) -> RedisStreamSource:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections. The group and its pending entries stay on the server."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def _redis(self) -> aioredis.Redis:
        if self._client is None:
            self._client = aioredis.Redis.from_url(
                self.url,
                decode_responses=True,
                protocol=2,  # the reply shapes parsed here
                socket_timeout=self.block_s + self.socket_timeout_s,
                socket_connect_timeout=self.socket_timeout_s,
                # No retries in the client: each of its attempts can take a whole socket timeout
                # (a frozen server), which would multiply the documented bound. _call retries.
                retry=Retry(NoBackoff(), 0),
            )
        return self._client

    def _lost(self, exc: RedisError, down_s: float) -> StreamConnectionError:
        return StreamConnectionError(
            f"Redis stream {self.stream!r} (group {self.group!r}, consumer {self.consumer!r}) at "
            f"{self.url}: the server was unreachable for {down_s:.1f} s "
            f"(reconnect_for_s={self.reconnect_for_s}): {type(exc).__name__}: {exc}. Entries read "
            "but not acknowledged stay pending on the server and are delivered again when a "
            "consumer of the group restarts."
        )

    async def _call(self, command: Callable[[aioredis.Redis], Awaitable[_T]]) -> _T:
        """Runs one idempotent command, reconnecting to a lost server for ``reconnect_for_s``."""
        loop = asyncio.get_running_loop()
        attempts = 0  # this command's, for its backoff
        while True:
            try:
                outage = self._down_since
                if outage is None or self.reconnect_for_s is None:
                    result = await command(self._redis())
                else:
                    # While the server is down, an attempt may not outlast the bound: one that
                    # connects to a frozen server would otherwise wait a whole socket timeout.
                    remaining = outage + self.reconnect_for_s - loop.time()
                    try:
                        async with asyncio.timeout(max(remaining, 0.0)):
                            result = await command(self._redis())
                    except TimeoutError as timed_out:
                        # The connection may be mid-reply: the next attempt makes a new client
                        # (_redis); a command of another task on this one fails and retries.
                        await self.aclose()
                        raise RedisTimeoutError("no reply before the reconnect bound") from (
                            timed_out
                        )
            except _LOST as exc:
                now = loop.time()
                if self._down_since is None:
                    self._down_since, self._attempts = now, 0
                    if self.reconnect_for_s != 0:
                        _logger.warning(
                            "%r: lost the server (%s: %s); reconnecting for up to %s s",
                            self,
                            type(exc).__name__,
                            exc,
                            "unlimited" if self.reconnect_for_s is None else self.reconnect_for_s,
                        )
                down_since = self._down_since
                self._attempts += 1
                left = (
                    None
                    if self.reconnect_for_s is None
                    else (down_since + self.reconnect_for_s - now)
                )
                if left is not None and left <= 0:
                    # The outage stays on record: every command of this epoch (the reader's,
                    # an ack) raises now rather than start a bound of its own; the next epoch
                    # starts a new one (__aiter__).
                    raise self._lost(exc, now - down_since) from exc
                delay = min(self.reconnect_max_delay_s, self.reconnect_delay_s * 2**attempts)
                attempts += 1
                # A fresh connection for the next attempt: the client drops a failed one, and
                # a server that restarted has forgotten this group unless it persisted it.
                await asyncio.sleep(delay if left is None else min(delay, left))
                continue
            if self._down_since is not None:
                _logger.warning(
                    "%r: reconnected after %.1f s (%d attempts)",
                    self,
                    loop.time() - self._down_since,
                    self._attempts + 1,
                )
                self._down_since = None
                self._resync = True
            return result

    async def ensure_group(self) -> None:
        """Create the consumer group (and the stream) unless they exist."""
        try:
            await self._call(
                lambda r: r.xgroup_create(self.stream, self.group, self.start_id, mkstream=True)
            )
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def ack(self, samples: list[StreamEntry]) -> None:
        """``XACK`` the entries of a batch the consumer received (called by the loader)."""
        ids = [s.id for s in samples]
        if not ids:
            return
        # XACK is idempotent: repeating it after a lost reply is safe.
        await self._call(lambda r: r.xack(self.stream, self.group, *ids))
        self._held.difference_update(ids)

    async def __aiter__(self) -> AsyncIterator[StreamEntry]:
        self._held.clear()  # a new epoch: nothing of this consumer's is in a batch in flight
        self._resync = False
        self._down_since = None  # a new epoch: its own reconnect bound
        await self.ensure_group()
        async for entry in self._own_pending():
            yield entry
        loop = asyncio.get_running_loop()
        next_claim = last_entry = loop.time()
        block_ms = max(1, round(self.block_s * 1000))
        while True:
            if self._resync:
                self._resync = False
                await self.ensure_group()
                # Time without a server is not a quiet stream.
                last_entry = loop.time()
                async for entry in self._own_pending():
                    last_entry = loop.time()
                    yield entry
            if loop.time() >= next_claim:
                async for entry in self._claim_stale():
                    last_entry = loop.time()
                    yield entry
                next_claim = loop.time() + self.claim_every_s
            # Not idempotent (">" moves entries into our pending list), so a reply lost with
            # the connection is recovered by the resync above, not by repeating the read.
            reply = await self._call(
                lambda r: r.xreadgroup(
                    self.group, self.consumer, {self.stream: ">"}, count=self.count, block=block_ms
                )
            )
            entries = self._entries(reply)
            for entry in entries:
                yield entry
            now = loop.time()
            if entries:
                last_entry = now
            elif self.stop_after_idle_s is not None and now - last_entry >= self.stop_after_idle_s:
                return

    async def _own_pending(self) -> AsyncIterator[StreamEntry]:
        """What this consumer name read before (a restart, a lost reply) and never acknowledged,
        less what is already in a batch of this epoch."""
        cursor = "0"
        while True:
            reply = await self._call(
                lambda r, cursor=cursor: r.xreadgroup(  # type: ignore[misc]
                    self.group, self.consumer, {self.stream: cursor}, count=self.count
                )
            )
            entries, last = self._entries(reply, skip=self._held), _last_id(reply)
            for entry in entries:
                yield entry
            if last is None:
                return
            cursor = last

    async def _claim_stale(self) -> AsyncIterator[StreamEntry]:
        """Entries pending on dead consumers for longer than ``claim_idle_s``, claimed."""
        cursor = "0-0"
        while True:
            reply: Any = await self._call(
                lambda r, start=cursor: r.xautoclaim(  # type: ignore[misc]
                    self.stream,
                    self.group,
                    self.consumer,
                    min_idle_time=max(1, round(self.claim_idle_s * 1000)),
                    start_id=start,
                    count=self.count,
                )
            )
            cursor = reply[0]
            for entry_id, fields in reply[1]:
                if fields and entry_id not in self._held:
                    self._held.add(entry_id)
                    yield StreamEntry(entry_id, dict(fields))
            if cursor in ("0-0", "0"):
                return

    def _entries(
        self, reply: Any, skip: set[str] | frozenset[str] = frozenset()
    ) -> list[StreamEntry]:
        out = []
        for entry_id, fields in _stream_entries(reply):
            # An entry deleted (XDEL) while pending reads as empty.
            if fields and entry_id not in skip:
                self._held.add(entry_id)
                out.append(StreamEntry(entry_id, dict(fields)))
        return out


def _stream_entries(reply: Any) -> list[Any]:
    """The entry list of a one-stream XREADGROUP reply (RESP2: ``[[stream, entries]]``)."""
    if not reply:
        return []
    return list(reply[0][1])


def _last_id(reply: Any) -> str | None:
    entries = _stream_entries(reply)
    return str(entries[-1][0]) if entries else None
