"""Batches of many Python objects are freed a step at a time once the loop body lets go of
them, and nothing anybody can still reach is ever touched."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from aioloader import AsyncDataLoader, _release
from tests.conftest import collect, torch_batches
from tests.test_text_batches import TextDataset


def _text_batch(tag: int, samples: int = 32, strings: int = 2000) -> list[list[str]]:
    return [[f"b{tag}-{i}-{j}" for j in range(strings)] for i in range(samples)]


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _keep_list(batch: list[Any]) -> list[Any]:
    return batch


def _count_steps(rel: _release.Releaser) -> list[int]:
    """A one-element list counting the releaser's steps (loop turns) from now on."""
    steps = [0]
    step = rel._step

    def counted() -> None:
        steps[0] += 1
        step()

    rel._step = counted  # type: ignore[method-assign]
    return steps


async def test_a_dropped_batch_is_emptied_over_several_turns() -> None:
    rel = _release.Releaser()
    rel.delivered(_text_batch(0, samples=256), heavy=True)
    steps = _count_steps(rel)
    rel.delivered(_text_batch(1), heavy=True)  # the loop body moved on: batch 0 is ours alone
    await _turns(200)
    assert not rel._work
    assert (rel.released, rel.kept) == (1, 0)
    # 256 lists of 2 000 strings take more than one step's budget to free: freed in turns.
    assert steps[0] > 1


async def test_a_batch_the_loop_body_kept_is_never_touched() -> None:
    rel = _release.Releaser()
    kept = [_text_batch(0)]
    want = copy.deepcopy(kept[0])
    rel.delivered(kept[0], heavy=True)
    rel.delivered(_text_batch(1), heavy=True)
    await _turns(20)
    assert (rel.released, rel.kept) == (0, 1)
    assert kept[0] == want


async def test_elements_referenced_elsewhere_survive_their_batch() -> None:
    rel = _release.Releaser()
    batch: Any = {"text": _text_batch(0), "ids": list(range(10_000)), "more": _text_batch(1)}
    text, sample, ids = batch["text"], batch["more"][3], batch["ids"]
    want = (copy.deepcopy(text), list(sample), list(ids))
    rel.delivered(batch, heavy=True)
    del batch
    rel.delivered(_text_batch(2), heavy=True)
    await _turns(50)
    assert rel.released == 1 and not rel._work
    assert (text, sample, ids) == want


async def test_subclasses_tuples_and_light_batches_are_let_go_whole() -> None:
    class Batch(list[Any]):
        pass

    rel = _release.Releaser()
    sub = Batch(_text_batch(0))
    rel.delivered(sub, heavy=True)
    rel.delivered((_text_batch(1),), heavy=True)
    rel.delivered(_text_batch(2), heavy=False)  # not rebuilt in pieces: never held
    await _turns(20)
    assert (rel.released, rel.kept) == (0, 2)
    assert len(sub) == 32 and all(len(s) == 2000 for s in sub)


async def test_a_long_flat_list_goes_in_slices() -> None:
    rel = _release.Releaser()
    rel.delivered([list(range(50_000)), list(range(50_000))], heavy=True)
    rel.delivered(None, heavy=False)
    await _turns(200)
    assert not rel._work
    assert rel.released == 1


async def test_batches_the_loop_body_still_holds_are_intact_through_an_epoch() -> None:
    ds = TextDataset(40 * 8, strings=1000)
    want = torch_batches(ds, batch_size=8, collate_fn=_keep_list)
    async with AsyncDataLoader(ds, batch_size=8, num_workers=2, collate_fn=_keep_list) as loader:
        previous: Any = None
        n = 0
        async with asyncio.timeout(60):
            async for batch in loader:
                # The batch before is still referenced here: it must be whole, though the
                # loader let go of it when this one came.
                if previous is not None:
                    assert previous == want[n - 1]
                await asyncio.sleep(0)
                assert batch == want[n]
                previous, n = batch, n + 1
        assert n == len(want)
        # And a consumer that keeps every batch gets every batch whole.
        assert await collect(loader) == want


async def test_an_epoch_of_text_batches_is_freed_by_the_releaser() -> None:
    ds = TextDataset(20 * 8, strings=1000)
    made: list[_release.Releaser] = []

    class Recorded(_release.Releaser):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    import aioloader._consumer as consumer

    original = consumer.Releaser
    consumer.Releaser = Recorded  # type: ignore[misc]
    try:
        async with AsyncDataLoader(
            ds, batch_size=8, num_workers=2, collate_fn=_keep_list
        ) as loader:
            async with asyncio.timeout(60):
                async for _ in loader:
                    pass
            await _turns(20)
    finally:
        consumer.Releaser = original  # type: ignore[misc]
    (rel,) = made
    # Every batch but the last (still bound to the loop variable at the end) was ours alone.
    assert rel.released == 19 and rel.kept == 1


async def test_a_list_of_lists_is_emptied_one_list_at_a_time(monkeypatch: Any) -> None:
    # Only a flat list loses a slice per step: a slice of a list of lists would free
    # thousands of strings at once.
    monkeypatch.setattr(_release, "_CHUNK", 100)
    monkeypatch.setattr(_release, "RELEASE_STEP_S", 0.0)
    rel = _release.Releaser()
    steps = _count_steps(rel)
    rel.delivered({"tokens": [[str(j) for j in range(30)] for _ in range(600)]}, heavy=True)
    rel.delivered(None, heavy=False)
    await _turns(1000)
    assert rel.released == 1 and not rel._work
    assert steps[0] >= 600


def test_the_sole_owner_count_holds_under_a_frame_evaluation_hook() -> None:
    # torch.compile installs a frame-evaluation hook (PEP 523) for the whole interpreter; a
    # call then hands its arguments over with one more reference. The releaser's checks are on
    # plain locals, which read the same either way.
    from torch._C._dynamo import eval_frame

    async def held_batch_survives() -> int:
        rel = _release.Releaser()
        batch = _text_batch(0, samples=8, strings=100)
        rel.delivered(batch, heavy=True)
        rel.delivered(None, heavy=False)
        await _turns(20)
        assert rel.kept == 1
        return len(batch)

    prior = eval_frame.set_eval_frame(False)
    try:
        sole = _release._local_sole()
        survived = asyncio.run(held_batch_survives())
    finally:
        eval_frame.set_eval_frame(prior)
    assert sole == _release._SOLE
    assert survived == 8
