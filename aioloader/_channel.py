"""Descriptor channels between the main process and each worker. Runs in: both.

A large tensor of a result travels through shared memory, and its descriptor in-band: each
worker has a :class:`FdChannel` (a Unix socket pair), and the worker sends one message holding a
result's descriptors right *before* the result itself, so when the main process reads the result
the descriptors are already waiting. torch's own reduction instead makes the receiver connect to
a listener thread in the (busy, niced) worker and authenticate for every descriptor: several
round trips and thread wake-ups on both sides per batch. The main process uses the same channel
to announce the shared batch buffers to the worker (see :mod:`aioloader._buffers`).
"""

from __future__ import annotations

import array
import contextlib
import errno
import os
import secrets
import socket
import struct
import threading
import weakref
from typing import Any

#: At most this many descriptors travel with one result (the kernel's limit per message is 253);
#: further large tensors of the same batch take torch's own path.
MAX_FDS_PER_RESULT = 250

_HEADER = struct.Struct("=qqi")  # (epoch, send_idx, number of descriptors)

#: The bytes of one descriptor in ``SCM_RIGHTS`` ancillary data.
FD_SIZE = array.array("i").itemsize


class FdChannel:
    """One worker's descriptor channel: a ``SOCK_SEQPACKET`` pair, one message per result.

    Created in the main process before the worker starts. The worker sends, for a result tagged
    ``(epoch, send_idx)``, one message with that tag and the descriptors of its shared-memory
    storages, before it returns the result; the main process takes the message when it unpickles
    the result. A message taken for a later result (results unpickled out of order) is kept for
    it; unclaimed ones are closed with the channel. Thread-safe on the receiving side.
    """

    #: Messages kept for results not unpickled yet; beyond this the oldest are closed.
    MAX_PENDING = 64

    def __init__(self, wid: int = 0) -> None:
        """A channel for worker ``wid``."""
        self.key = secrets.randbits(62)
        self.wid = wid
        #: What the worker's end carries of the buffer pool this channel is attached to (see
        #: :meth:`~aioloader._buffers.BufferPool.attach`); None: no pool, no buffer reuse.
        self.shared: tuple[Any, Any, Any] | None = None
        self.main_end, self.worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.main_end.setblocking(False)
        self._lock = threading.Lock()
        # tag -> descriptor lists received for it, oldest first
        self._pending: dict[tuple[int, int], list[list[int]]] = {}
        self._npending = 0
        _channels[self.key] = self

    def __reduce__(self) -> tuple[Any, ...]:
        # Only the worker's end travels to a worker (spawn/forkserver pass the descriptor).
        return (ChannelEnd, (self.key, self.worker_end, self.wid, self.shared))

    def worker_side(self) -> ChannelEnd:
        """The worker's end of this channel (a forked worker inherits the whole channel and
        takes this)."""
        return ChannelEnd(self.key, self.worker_end, self.wid, self.shared)

    def close_worker_end(self) -> None:
        """Close the main process's copy of the worker's end, once the worker has started."""
        self.worker_end.close()

    def close(self) -> None:
        """Close both ends and every descriptor received but not claimed."""
        _channels.pop(self.key, None)
        with self._lock:
            for lists in self._pending.values():
                for fds in lists:
                    close_all(fds)
            self._pending.clear()
            self.main_end.close()
        self.worker_end.close()

    def take(self, tag: tuple[int, int]) -> list[int]:
        """The descriptors sent for ``tag``; the caller owns (and closes) them.

        Raises ``OSError`` (``EMFILE`` if this process ran out of descriptors while receiving
        them, ``ENOENT`` if no message for ``tag`` was sent).
        """
        with self._lock:
            kept = self._pending.get(tag)
            if kept:
                self._npending -= 1
                fds = kept.pop(0)
                if not kept:
                    del self._pending[tag]
                return fds
        with self._lock:
            while True:
                msg_tag, fds = self._recv()  # raises OSError once the socket is empty
                if msg_tag == tag:
                    return fds
                self._pending.setdefault(msg_tag, []).append(fds)
                self._npending += 1
                if self._npending > self.MAX_PENDING:
                    oldest = next(iter(self._pending))
                    close_all(self._pending[oldest].pop(0))
                    self._npending -= 1
                    if not self._pending[oldest]:
                        del self._pending[oldest]

    def _recv(self) -> tuple[tuple[int, int], list[int]]:
        try:
            msg, anc, flags, _ = self.main_end.recvmsg(
                _HEADER.size, socket.CMSG_SPACE(MAX_FDS_PER_RESULT * FD_SIZE)
            )
        except BlockingIOError:
            raise OSError(errno.ENOENT, "no descriptors were sent with this result") from None
        fds = received_fds(anc)
        epoch, send_idx, n = _HEADER.unpack(msg)
        if flags & socket.MSG_CTRUNC or len(fds) != n:
            # The kernel drops the descriptors it could not install (the process is at its
            # descriptor limit).
            close_all(fds)
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return (epoch, send_idx), fds


class ChannelEnd:
    """A worker's end of its :class:`FdChannel`: what crosses to a worker. ``shared`` holds the
    pool's shared arrays (see :class:`~aioloader._buffers.BufferPool`), or None (no pool)."""

    def __init__(
        self,
        key: int,
        sock: socket.socket,
        wid: int = 0,
        shared: tuple[Any, Any, Any] | None = None,
    ) -> None:
        self.key = key
        self.sock = sock
        self.wid = wid
        self.shared = shared

    def send(self, tag: tuple[int, int], fds: list[int]) -> bool:
        """Send ``fds`` tagged ``tag``; False (nothing sent) if the channel is full or closed."""
        try:
            self.sock.sendmsg(
                [_HEADER.pack(tag[0], tag[1], len(fds))],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))],
                socket.MSG_DONTWAIT,
            )
        except OSError:
            return False
        return True


def received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors in a ``recvmsg`` result's ancillary data (``SCM_RIGHTS``)."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    return list(fds)


def close_all(fds: list[int]) -> None:
    """Close each of ``fds``, ignoring those closed already."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


_channels: weakref.WeakValueDictionary[int, FdChannel] = weakref.WeakValueDictionary()


def find_channel(key: int) -> FdChannel | None:
    """The open channel of this process with ``key`` (see :attr:`FdChannel.key`), if any."""
    return _channels.get(key)
