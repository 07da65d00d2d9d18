"""numpy's global generator state, read and written in microseconds. Runs in: any thread.

The loop lane (``_looplane``) swaps the program's global generators for a stand-in worker's
around every step of user code. numpy's own ``get_state()``/``set_state()`` cost about 25 us
each (the state travels as a dict holding a fresh array), four of them per step: most of a
step for a cheap transform, and of the batch's latency at a window's close.

The global ``RandomState`` (the one numpy's module functions are bound to) draws from an
``MT19937`` bit generator by default; its whole state is that generator's C struct (624 words
and a position, reached through its documented ``ctypes`` interface) plus the legacy normal
cache that ``RandomState`` keeps itself (``has_gauss``, ``gauss``: a normal draw makes two values
and keeps one). The cache is not exposed, so its place in the object is found once, on a scratch
``RandomState``: the bytes a normal draw changes, and only those, must read back as the cache
``get_state()`` reports, and flip back with the next draw. Where anything differs (another
numpy, another bit generator through ``numpy.random.set_bit_generator``), :func:`get` and
:func:`put` use numpy's own calls: slower, never wrong.

Reads and writes are copies between views of the two places (made once per generator) and
buffers the state keeps (:func:`get` can refill a state it made before: no allocation on the
lane's path). Every one holds the bit generator's lock (numpy's draws take it too) and a
reference to the generator, so a generator replaced meanwhile by another thread is never freed
under a write.
"""

from __future__ import annotations

import ctypes
import struct
from typing import Any

__all__ = ("fast", "fits", "get", "put", "seeded")

#: MT19937's C state: ``uint32_t key[624]; int pos``.
_MT_SIZE = 624 * 4 + 4

_INT = struct.Struct("i")
_DOUBLE = struct.Struct("d")


class _Fast:
    """A state of the default (``MT19937``) global generator as raw bytes: the bit generator's
    struct, and the normal cache."""

    __slots__ = ("gauss", "mt")

    def __init__(self, mt: Any, gauss: Any) -> None:
        self.mt = bytearray(mt)
        self.gauss = bytearray(gauss)

    def legacy(self) -> tuple[Any, ...]:
        """The same state as ``get_state()`` gives it, for ``set_state()`` where the raw write
        does not apply (an ``MT19937`` global only)."""
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
        if type(rs._bit_generator) is not npr.MT19937:
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
        mt = ctypes.string_at(rs._bit_generator.ctypes.state_address, _MT_SIZE)
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


def _cache(npr: Any) -> tuple[int, int] | None:
    global _cache_at, _probed
    if not _probed:
        _cache_at = _find_cache(npr)
        _probed = True
    return _cache_at


def _global(npr: Any) -> Any:
    """The ``RandomState`` numpy's module functions draw from: the one ``get_state`` is bound
    to, else (replaced by a function of the program's own) numpy's own global."""
    rs = getattr(npr.get_state, "__self__", None)
    return rs if rs is not None else npr.mtrand._rand


def _mt(npr: Any, rs: Any) -> Any:
    """``rs``'s bit generator if the raw way applies to it, else None."""
    bg = rs._bit_generator
    if type(bg) is not npr.MT19937 or type(rs) is not npr.RandomState or _cache(npr) is None:
        return None
    return bg


#: The global generator and bit generator last seen, with views of the bit generator's struct
#: and of the normal cache (the references keep both alive, and so the addresses valid).
_seen: tuple[Any, Any, memoryview, memoryview] | None = None


def _views(npr: Any, rs: Any, bg: Any) -> tuple[memoryview, memoryview]:
    """Views of ``bg``'s struct and ``rs``'s normal cache, made once per pair."""
    global _seen
    seen = _seen
    if seen is None or seen[0] is not rs or seen[1] is not bg:
        offset, size = _cache(npr) or (0, 0)
        mt = (ctypes.c_char * _MT_SIZE).from_address(bg.ctypes.state_address)
        gauss = (ctypes.c_char * size).from_address(id(rs) + offset)
        seen = _seen = rs, bg, memoryview(mt).cast("B"), memoryview(gauss).cast("B")
    return seen[2], seen[3]


def get(npr: Any, into: Any = None) -> Any:
    """The global generator's state (``npr``: the ``numpy.random`` module), for :func:`put`;
    written into ``into`` (a raw state this module made, no longer needed) where it can be,
    instead of a new one."""
    rs = _global(npr)
    bg = _mt(npr, rs)
    if bg is not None:
        mt, gauss = _views(npr, rs, bg)
        with bg.lock:
            if rs._bit_generator is bg:  # not replaced since: read it raw
                if isinstance(into, _Fast):
                    into.mt[:] = mt
                    into.gauss[:] = gauss
                    return into
                return _Fast(mt, gauss)
    return npr.get_state(legacy=False)


def fits(npr: Any, state: Any) -> bool:
    """Whether :func:`put` can make ``state`` the global generator's: a state of the same kind
    of bit generator as the global one has now."""
    name = type(_global(npr)._bit_generator).__name__
    if isinstance(state, (_Fast, tuple)):
        return name == "MT19937"
    return isinstance(state, dict) and state.get("bit_generator") == name


def put(npr: Any, state: Any) -> None:
    """Make ``state`` (from :func:`get` or :func:`seeded`) the global generator's. Raises
    ``ValueError`` where it does not :func:`fit` (the generator was replaced meanwhile)."""
    if not fits(npr, state):
        raise ValueError(
            "numpy's global bit generator is now "
            f"{type(_global(npr)._bit_generator).__name__}: a state of another kind cannot be "
            "put back into it"
        )
    rs = _global(npr)
    if isinstance(state, _Fast):
        bg = _mt(npr, rs)
        if bg is not None:
            mt, gauss = _views(npr, rs, bg)
            with bg.lock:
                if rs._bit_generator is bg:
                    mt[:] = state.mt
                    gauss[:] = state.gauss
                    return
        state = state.legacy()
    npr.set_state(state)


def seeded(npr: Any, seed: Any) -> Any:
    """A fresh state for the kind of bit generator the global one is, seeded from ``seed`` (an
    array of 32-bit words) as a worker seeds numpy's global generator (``np.random.seed``)."""
    bg_type = type(_global(npr)._bit_generator)
    if bg_type is npr.MT19937:
        return npr.RandomState(seed).get_state()
    return npr.RandomState(bg_type(seed)).get_state(legacy=False)


def fast(npr: Any) -> bool:
    """Whether :func:`get` and :func:`put` take the raw way for the global generator now."""
    return _mt(npr, _global(npr)) is not None
