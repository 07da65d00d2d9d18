"""Async sources for streaming input (see ``docs/streaming.md``).

* :class:`~aioloader.sources.redis.RedisStreamSource`: a Redis Streams consumer group, at least
  once (``pip install aioloader[redis]``); imported from its own module so ``redis`` stays optional.
"""
