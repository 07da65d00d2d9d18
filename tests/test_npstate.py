"""numpy's global generator state read and written fast (``_npstate``), exactly as numpy's own
``get_state()``/``set_state()`` would, the kept normal included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.random as npr
import pytest

from aioloader import _npstate


@pytest.fixture(autouse=True)
def _program_state_back() -> Iterator[None]:
    saved = np.random.get_state()
    yield
    np.random.set_state(saved)


def _draws(rs: Any) -> list[float]:
    return [
        float(rs.standard_normal()),
        float(rs.random()),
        float(rs.standard_normal()),
        float(rs.randint(1 << 30)),
    ]


def _reference() -> np.random.RandomState:
    rs = np.random.RandomState()
    rs.set_state(np.random.get_state())
    return rs


def _assert_round_trip(seed: int) -> None:
    """A state read after ``seed`` and put back over another seed's gives the first's draws."""
    np.random.seed(seed)
    expected = _draws(_reference())
    saved = _npstate.get(npr)
    np.random.seed(seed + 1000)
    _npstate.put(npr, saved)
    assert _draws(np.random) == expected


def test_the_fast_way_is_taken_with_the_default_generator() -> None:
    assert _npstate.fast(npr)
    assert isinstance(_npstate.get(npr), _npstate._Fast)


@pytest.mark.parametrize("kept_normal", [False, True])
def test_a_state_put_back_gives_the_same_draws(kept_normal: bool) -> None:
    np.random.seed(11)
    if kept_normal:
        np.random.standard_normal()  # one of the pair is kept for the next draw
    expected = _draws(_reference())
    saved = _npstate.get(npr)
    _draws(np.random)  # another stream's draws in between
    np.random.seed(99)
    np.random.standard_normal()
    _npstate.put(npr, saved)
    assert _draws(np.random) == expected


def test_a_state_read_fast_is_the_one_get_state_reports() -> None:
    np.random.seed(5)
    np.random.standard_normal()
    fast = _npstate.get(npr)
    name, key, pos, has_gauss, gauss = np.random.get_state()
    assert name == "MT19937" and has_gauss == 1
    legacy = fast.legacy()
    assert (legacy[0], legacy[2], legacy[3], legacy[4]) == (name, pos, has_gauss, gauss)
    assert np.array_equal(legacy[1], key)


def test_a_state_is_refilled_in_place() -> None:
    np.random.seed(6)
    first = _npstate.get(npr)
    np.random.seed(60)
    np.random.standard_normal()
    expected = _draws(_reference())
    second = _npstate.get(npr, into=first)
    assert second is first
    assert second.legacy()[3:] == np.random.get_state()[3:]
    np.random.seed(1)
    _npstate.put(npr, second)
    assert _draws(np.random) == expected


def test_states_of_both_kinds_are_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    np.random.seed(3)
    fast = _npstate.get(npr)
    expected = _draws(_reference())
    # Where the raw way does not apply, numpy's own calls carry the state; a state read the
    # raw way is put back through them too.
    monkeypatch.setattr(_npstate, "_mt", lambda npr, rs: None)
    assert not _npstate.fast(npr)
    slow = _npstate.get(npr)
    assert isinstance(slow, dict)
    _draws(np.random)
    _npstate.put(npr, fast)
    assert _draws(np.random) == expected
    _npstate.put(npr, slow)
    assert _draws(np.random) == expected


def test_the_generator_numpys_functions_use_is_the_one_read_and_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A library that rebinds mtrand._rand does not redirect np.random.random & co., which stay
    # bound to the original: that one is the program's stream.
    monkeypatch.setattr(npr.mtrand, "_rand", np.random.RandomState(0))
    _assert_round_trip(5)


def test_a_get_state_replaced_by_a_plain_function_reads_numpys_own_global(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = np.random.get_state
    monkeypatch.setattr(np.random, "get_state", lambda legacy=True: real(legacy=legacy))
    _assert_round_trip(4)


def test_another_bit_generator_takes_numpys_own_calls() -> None:
    original = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(1))
    try:
        assert not _npstate.fast(npr)
        saved = _npstate.get(npr)
        assert _npstate.fits(npr, saved)
        first = float(np.random.random())
        _npstate.put(npr, saved)
        assert float(np.random.random()) == first
        # A state of another kind does not fit, and is refused rather than half applied.
        seeded = _npstate.seeded(npr, np.array([1, 2], dtype=np.uint32))
        assert seeded["bit_generator"] == "PCG64" and _npstate.fits(npr, seeded)
        legacy = np.random.RandomState(1).get_state()
        assert not _npstate.fits(npr, legacy)
        with pytest.raises(ValueError, match="PCG64"):
            _npstate.put(npr, legacy)
    finally:
        np.random.set_bit_generator(original)
    assert _npstate.fast(npr)
