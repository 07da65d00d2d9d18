"""``random``'s global generator state read and written fast (``_pyrandom``), exactly as
``getstate()``/``setstate()`` would, the kept normal included."""

from __future__ import annotations

import functools
import random
import subprocess
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aioloader import _pyrandom
from tests.conftest import interpreters


@pytest.fixture(autouse=True)
def _program_state_back() -> Iterator[None]:
    saved = random.getstate()
    yield
    random.setstate(saved)


def _draws(rng: random.Random | None = None) -> list[float]:
    r = rng if rng is not None else random
    return [r.gauss(0.0, 1.0), r.random(), r.gauss(0.0, 1.0), float(r.getrandbits(30))]


def _reference() -> random.Random:
    rng = random.Random()
    rng.setstate(random.getstate())
    return rng


def test_the_fast_way_is_taken_with_the_default_generator() -> None:
    assert _pyrandom.fast()
    assert isinstance(_pyrandom.get(), _pyrandom._Fast)


@pytest.mark.parametrize("kept_normal", [False, True])
def test_a_state_put_back_gives_the_same_draws(kept_normal: bool) -> None:
    random.seed(11)
    if kept_normal:
        random.gauss(0.0, 1.0)  # one of the pair is kept for the next draw
    expected = _draws(_reference())
    saved = _pyrandom.get()
    _draws()  # another stream's draws in between
    random.seed(99)
    random.gauss(0.0, 1.0)
    _pyrandom.put(saved)
    assert _draws() == expected


def test_a_state_read_fast_is_the_one_getstate_reports() -> None:
    random.seed(5)
    random.gauss(0.0, 1.0)
    for _ in range(700):  # past a regeneration of the 624 words
        random.random()
    fast = _pyrandom.get()
    assert fast.legacy() == random.getstate()


def test_a_state_is_refilled_in_place() -> None:
    random.seed(6)
    first = _pyrandom.get()
    expected = _draws(_reference())
    random.seed(60)
    random.gauss(0.0, 1.0)
    second = _pyrandom.get(into=first)
    assert second is first and second.legacy() == random.getstate()
    random.seed(6)
    _pyrandom.put(_pyrandom.get(into=second))
    assert _draws() == expected


def test_a_seeded_state_is_the_one_seed_makes() -> None:
    _pyrandom.put(_pyrandom.seeded(42))
    assert _draws() == _draws(random.Random(42))


def test_states_of_both_kinds_are_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    random.seed(3)
    fast = _pyrandom.get()
    expected = _draws(_reference())
    # Where the raw way does not apply, random's own calls carry the state; a state read the
    # raw way is put back through them too.
    monkeypatch.setattr(_pyrandom, "_FAST", False)
    monkeypatch.setattr(_pyrandom, "_seen", None)
    assert not _pyrandom.fast()
    slow = _pyrandom.get()
    assert isinstance(slow, tuple) and slow == random.getstate()
    assert isinstance(_pyrandom.seeded(8), tuple)
    _draws()
    _pyrandom.put(fast)
    assert _draws() == expected
    _pyrandom.put(slow)
    assert _draws() == expected


def test_a_layout_that_does_not_prove_out_takes_the_public_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A struct somewhere else than after the header (another build's object header): the
    # bytes read there are not the state getstate() reports, and the probe says so.
    monkeypatch.setattr(
        _pyrandom,
        "_view",
        lambda rng: _pyrandom._Raw.from_address(id(rng) + object.__basicsize__ + 8),
    )
    assert not _pyrandom._proven()
    monkeypatch.setattr(_pyrandom, "_FAST", None)
    monkeypatch.setattr(_pyrandom, "_seen", None)
    assert not _pyrandom.fast()
    assert isinstance(_pyrandom.get(), tuple)


def test_a_global_generator_of_another_class_takes_the_public_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Mine(random.Random):
        pass

    mine = Mine(4)
    monkeypatch.setattr(random, "getstate", mine.getstate)
    monkeypatch.setattr(random, "setstate", mine.setstate)
    assert not _pyrandom.fast()
    saved = _pyrandom.get()
    first = mine.random()
    _pyrandom.put(saved)
    assert mine.random() == first


def test_a_getstate_replaced_by_a_plain_function_takes_the_public_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A program's own shim (functools.wraps keeps no __self__): nothing raises, its calls carry
    # the state.
    real = random.getstate

    @functools.wraps(real)
    def shim() -> Any:
        return real()

    monkeypatch.setattr(random, "getstate", shim)
    assert not _pyrandom.fast()
    random.seed(12)
    saved = _pyrandom.get()
    assert isinstance(saved, tuple)
    first = random.random()
    _pyrandom.put(saved)
    assert random.random() == first
    assert isinstance(_pyrandom.seeded(3), tuple)


def test_a_build_without_the_gil_takes_the_public_way(monkeypatch: pytest.MonkeyPatch) -> None:
    # There a copy of the struct could meet a draw of another thread halfway.
    real = sysconfig.get_config_var
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda name: 1 if name == "Py_GIL_DISABLED" else real(name)
    )
    assert not _pyrandom._proven()


def test_reads_and_writes_from_several_threads_never_mix_states() -> None:
    # Each thread puts its own state and reads it back whole: a write is one call holding the
    # GIL, so no read sees half of one state and half of another.
    states = [_pyrandom.seeded(seed) for seed in range(4)]
    raws = {bytes(s.raw) for s in states}
    wrong: list[int] = []

    def churn(k: int) -> None:
        for _ in range(5000):
            _pyrandom.put(states[k])
            read = _pyrandom.get()
            if bytes(read.raw) not in raws:
                wrong.append(k)

    threads = [threading.Thread(target=churn, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []


_UNDER_ANOTHER_PYTHON = """
import importlib.util, random, sys
spec = importlib.util.spec_from_file_location("_pyrandom", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
assert m.fast(), "the raw way is not taken"
random.seed(3)
random.gauss(0.0, 1.0)
saved = m.get()
expected = [random.gauss(0.0, 1.0), random.random(), random.getrandbits(40)]
random.seed(9)
m.put(saved)
assert [random.gauss(0.0, 1.0), random.random(), random.getrandbits(40)] == expected
assert m.get(into=saved) is saved and saved.legacy() == random.getstate()
print("ok", sys.version.split()[0])
"""


@pytest.mark.parametrize("exe", list(interpreters().values()), ids=list(interpreters()))
def test_the_raw_way_holds_under_every_python(exe: str) -> None:
    # The module needs no torch: loaded by path under each CPython found (3.12 and 3.13 where
    # pyenv has them), with only the standard library (-I).
    path = Path(_pyrandom.__file__)
    proc = subprocess.run(
        [exe, "-I", "-c", _UNDER_ANOTHER_PYTHON, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr
