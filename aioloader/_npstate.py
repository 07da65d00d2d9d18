"""numpy's global generator state, read and written in microseconds. Runs in: any thread.

The loop lane (``_looplane``) swaps the program's global generators for a stand-in worker's
around every step of user code. numpy's own ``get_state()``/``set_state()`` cost about 25 us
each (the state travels as a dict holding a fresh array), four of them per step: most of a
step for a cheap transform, and of the batch's latency at a window's close.

The global ``RandomState`` draws from an ``MT19937`` bit generator; its whole state is that
generator's C struct (624 words and a position, reached through its documented ``ctypes``
interface) plus the legacy normal cache that ``RandomState`` keeps itself (``has_gauss``,
``gauss``: a normal draw makes two values and keeps one). The cache is not exposed, so its place
in the object is found once, on a scratch ``RandomState``: the bytes a normal draw changes, and
only those, must read back as the cache ``get_state()`` reports, and flip back with the next
draw. Where anything differs (another numpy, another bit generator through
``numpy.random.set_bit_generator``, no numpy), :func:`get` and :func:`put` use ``get_state()``
and ``set_state()``: slower, never wrong.
"""

from __future__ import annotations

import ctypes
import struct
import sys
from typing import Any

__all__ = ("get", "put")

#: MT19937's C state: ``uint32_t key[624]; int pos``.
_MT_SIZE = 624 * 4 + 4

_INT = struct.Struct("i")
_DOUBLE = struct.Struct("d")


class _Fast:
    """A numpy state as raw bytes: the bit generator's struct, and the normal cache."""

    __slots__ = ("gauss", "mt")

    def __init__(self, mt: bytes, gauss: bytes) -> None:
        self.mt = mt
        self.gauss = gauss

    def legacy(self) -> tuple[Any, ...]:
        """The same state as ``get_state()`` gives it (the global generator was replaced by
        ``numpy.random.set_bit_generator`` since this was read)."""
        import numpy as np

        key = np.frombuffer(self.mt, dtype=np.uint32, count=624).copy()
        pos = _INT.unpack_from(self.mt, 624 * 4)[0]
        has_gauss = _INT.unpack_from(self.gauss, 0)[0]
        gauss = _DOUBLE.unpack_from(self.gauss, 8)[0]
        return ("MT19937", key, pos, has_gauss, gauss)


def _find_cache(npr: Any) -> tuple[int, int] | None:
    """``(offset, size)`` of the normal cache in a ``RandomState``, proven on a scratch one."""
    try:
        rs = npr.RandomState(12345)
        if type(rs._bit_generator).__name__ != "MT19937":
            return None
        size = type(rs).__basicsize__
        before = ctypes.string_at(id(rs), size)
        rs.standard_normal()  # makes two, keeps one: the cache fills
        filled = ctypes.string_at(id(rs), size)
        changed = [i for i in range(size) if before[i] != filled[i]]
        if not changed:
            return None
        start, end = changed[0] - changed[0] % 8, changed[-1] + 1
        if end - start > 16:  # more than an int and a double changed: not what we look for
            return None
        state = rs.get_state()
        has_gauss, gauss = state[3], state[4]
        if has_gauss != 1 or _INT.unpack_from(filled, start)[0] != 1:
            return None
        if _DOUBLE.unpack_from(filled, start + 8)[0] != gauss:
            return None
        rs.standard_normal()  # takes the kept one: the cache empties
        emptied = ctypes.string_at(id(rs), size)
        if _INT.unpack_from(emptied, start)[0] != 0 or rs.get_state()[3] != 0:
            return None
        # And the struct the ctypes interface reaches is the one get_state() reads.
        bg = rs._bit_generator
        mt = ctypes.string_at(bg.ctypes.state_address, _MT_SIZE)
        key, pos = state[1], state[2]
        if list(struct.unpack_from("624I", mt)) != [int(k) for k in key]:
            return None
        if _INT.unpack_from(mt, 624 * 4)[0] != int(pos):
            return None
        return start, 16
    except Exception:  # any surprise: the slow, public way
        return None


_cache_at: tuple[int, int] | None = None
_probed = False


def _global(npr: Any) -> tuple[Any, int, tuple[int, int]] | None:
    """The global ``RandomState``, its MT19937 state's address and its cache's place, or None
    when the fast way does not apply."""
    global _cache_at, _probed
    if not _probed:
        _probed = True
        _cache_at = _find_cache(npr)
    if _cache_at is None:
        return None
    rs: Any = getattr(getattr(npr, "mtrand", None), "_rand", None)
    if type(rs) is not npr.RandomState:
        return None
    bg = rs._bit_generator
    if type(bg).__name__ != "MT19937":
        return None
    return rs, bg.ctypes.state_address, _cache_at


def get(npr: Any) -> Any:
    """The global generator's state (``npr``: the ``numpy.random`` module), for :func:`put`."""
    where = _global(npr)
    if where is None:
        return npr.get_state(legacy=False)
    rs, mt_at, (cache_off, cache_size) = where
    with rs._bit_generator.lock:
        return _Fast(
            ctypes.string_at(mt_at, _MT_SIZE), ctypes.string_at(id(rs) + cache_off, cache_size)
        )


def put(npr: Any, state: Any) -> None:
    """Make ``state`` (from :func:`get`, or ``get_state()``'s tuple) the global generator's."""
    where = _global(npr) if isinstance(state, _Fast) else None
    if where is None:
        npr.set_state(state.legacy() if isinstance(state, _Fast) else state)
        return
    rs, mt_at, (cache_off, _) = where
    with rs._bit_generator.lock:
        ctypes.memmove(mt_at, state.mt, _MT_SIZE)
        ctypes.memmove(id(rs) + cache_off, state.gauss, len(state.gauss))


def fast(npr: Any | None = None) -> bool:
    """Whether :func:`get` and :func:`put` take the fast way here (tests, diagnostics)."""
    npr = npr if npr is not None else sys.modules.get("numpy.random")
    return npr is not None and _global(npr) is not None
