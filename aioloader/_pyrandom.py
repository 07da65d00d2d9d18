"""The ``random`` module's global generator state, read and written in about a microsecond. Runs
in: any thread.

The loop lane (``_looplane``) swaps the program's global generators for a stand-in worker's
around every step of user code. ``random.getstate()`` builds a tuple of 625 fresh ints (about
9 us on the development machine), and the lane reads it twice per step: at a window's close
that is most of what the batch waits for after its last sample.

The module functions draw from one ``random.Random`` (``random.getstate.__self__``). Its whole
state is a C struct after the object's header (a position, then the Mersenne Twister's 624
words) and the normal cache ``gauss_next``, an attribute of the Python subclass. The struct's
place is proven once, on scratch generators: its bytes must read as the words and position that
``getstate()`` reports, before and after a draw, and bytes written into another generator must
make it draw the same. Where anything differs (another interpreter, a build with another object
header, a global generator of another class, a build without the GIL), :func:`get` and
:func:`put` use ``getstate()`` and ``setstate()``: slower, never wrong.

Reads and writes are single copies between a ``memoryview`` of the struct and a buffer the
state keeps (:func:`get` can refill a state it made before: no allocation on the lane's path).
Each copy holds the GIL (not ``ctypes.memmove``, which releases it), as ``random``'s own draws
do: no thread sees half a state.
"""

from __future__ import annotations

import ctypes
import random
import struct
import sysconfig
from typing import Any

__all__ = ("fast", "get", "put", "seeded")

#: The C struct after the header: ``int index; uint32_t state[624]``.
_WORDS = 624
_SIZE = 4 + _WORDS * 4
_LAYOUT = struct.Struct(f"i{_WORDS}I")

_Raw = ctypes.c_char * _SIZE


class _Fast:
    """A state of a ``random.Random`` as raw bytes and its normal cache."""

    __slots__ = ("gauss", "raw")

    def __init__(self, raw: Any, gauss: float | None) -> None:
        self.raw = bytearray(raw)
        self.gauss = gauss

    def legacy(self) -> tuple[Any, ...]:
        """The same state as ``getstate()`` gives it, for ``setstate()``."""
        index, *words = _LAYOUT.unpack(self.raw)
        return (random.Random.VERSION, (*words, index), self.gauss)


def _view(rng: random.Random) -> Any:
    """The bytes of ``rng``'s struct after the header (valid while ``rng`` lives)."""
    return _Raw.from_address(id(rng) + object.__basicsize__)


def _proven() -> bool:
    """Whether a ``random.Random``'s struct is where and what this module takes it to be."""
    try:
        if sysconfig.get_config_var("Py_GIL_DISABLED"):
            # Without the GIL a copy could meet a draw in another thread halfway: random's own
            # calls lock the generator, a copy of its bytes would not.
            return False
        if object.__basicsize__ + _SIZE > random.Random.__basicsize__:
            return False
        source = random.Random(20261129)
        for _ in range(2):  # before and after a draw (the position moves)
            index, *words = _LAYOUT.unpack(_view(source).raw)
            internal = source.getstate()[1]
            if (*words, index) != tuple(internal):
                return False
            source.random()
        source.gauss(0.0, 1.0)  # fills the normal cache
        target = random.Random(7)
        _view(target).raw = _view(source).raw
        target.gauss_next = source.gauss_next  # type: ignore[attr-defined]
        return target.getstate() == source.getstate() and [
            target.random(),
            target.gauss(0.0, 1.0),
        ] == [source.random(), source.gauss(0.0, 1.0)]
    except Exception:  # any surprise: the public way
        return False


_FAST: bool | None = None

#: The global generator last seen and a view of its struct (the reference keeps it alive, and
#: so the address valid).
_seen: tuple[random.Random, memoryview] | None = None


def _global() -> tuple[random.Random, memoryview] | None:
    """The ``random.Random`` the module functions draw from and a view of its state, if the raw
    way applies to it."""
    global _FAST, _seen
    # (A program may have replaced random.getstate with a function of its own: no __self__.)
    rng = getattr(random.getstate, "__self__", None)
    if _seen is not None and _seen[0] is rng:
        return _seen
    if type(rng) is not random.Random:
        return None
    if _FAST is None:
        _FAST = _proven()
    if not _FAST:
        return None
    _seen = rng, memoryview(_view(rng)).cast("B")
    return _seen


def fast() -> bool:
    """Whether :func:`get` and :func:`put` take the raw way now."""
    return _global() is not None


def get(into: Any = None) -> Any:
    """The global generator's state, for :func:`put`; written into ``into`` (a state this
    module made, no longer needed) where it can be, instead of a new one."""
    seen = _global()
    if seen is None:
        return random.getstate()
    rng, view = seen
    if isinstance(into, _Fast):
        into.raw[:] = view
        into.gauss = rng.gauss_next  # type: ignore[attr-defined]
        return into
    return _Fast(view, rng.gauss_next)  # type: ignore[attr-defined]


def put(state: Any) -> None:
    """Make ``state`` (from :func:`get` or :func:`seeded`) the global generator's."""
    if isinstance(state, _Fast):
        seen = _global()
        if seen is not None:
            rng, view = seen
            view[:] = state.raw
            rng.gauss_next = state.gauss  # type: ignore[attr-defined]
            return
        state = state.legacy()
    random.setstate(state)


def seeded(seed: int) -> Any:
    """A fresh state, as ``random.seed(seed)`` makes it, for :func:`put`."""
    rng = random.Random(seed)
    if _global() is None:
        return rng.getstate()
    return _Fast(_view(rng).raw, rng.gauss_next)  # type: ignore[attr-defined]
