"""What runs inside the workers: worker info, seeds, threads, init fn, transport, start methods."""

from __future__ import annotations

import asyncio
import functools
import gc
import multiprocessing
import os
import random
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from aioloader import AsyncDataLoader, _payload, _worker
from tests import datasets
from tests.conftest import collect


async def test_worker_info_ids_seeds_and_threads(start_method: str) -> None:
    gen = torch.Generator().manual_seed(11)
    async with AsyncDataLoader(
        datasets.WorkerInfoDataset(),
        batch_size=None,
        num_workers=2,
        generator=gen,
        multiprocessing_context=start_method,
    ) as loader:
        rows = [tuple(int(v) for v in r) for r in await collect(loader)]
    # torch draws the base seed from the generator when the epoch starts.
    base_seed = int(
        torch.empty((), dtype=torch.int64)
        .random_(generator=torch.Generator().manual_seed(11))
        .item()
    )
    assert sorted(r[0] for r in rows) == list(range(16))
    assert {r[1] for r in rows} <= {0, 1}
    for _, wid, num_workers, seed, threads in rows:
        assert num_workers == 2
        assert seed == base_seed + wid
        assert threads == 1


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_random_samples_equal_torch_for_the_same_generator(num_workers: int) -> None:
    """Random augmentations in __getitem__ reproduce torch's exactly (same worker, same seed)."""
    # Without workers the samples draw from this process's global RNGs: start both equal.
    random.seed(0)
    torch.manual_seed(0)
    ref = torch.utils.data.DataLoader(
        datasets.RandomDataset(),
        batch_size=2,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(1),
    )
    expected = [[[float(v) for v in col] for col in b] for b in ref]
    del ref

    async def run(seed: int) -> list[Any]:
        random.seed(0)
        torch.manual_seed(0)
        async with AsyncDataLoader(
            datasets.RandomDataset(),
            batch_size=2,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(seed),
        ) as loader:
            return [[[float(v) for v in col] for col in b] for b in await collect(loader)]

    assert await run(1) == expected
    if num_workers:
        other = await run(2)
        assert other != expected
        flat = [v for b in other for col in b for v in col]
        assert len(set(flat)) == len(flat)  # workers draw from different streams


async def test_worker_init_fn_runs_in_each_worker() -> None:
    async with AsyncDataLoader(
        datasets.InitTraceDataset(8),
        batch_size=None,
        num_workers=2,
        worker_init_fn=datasets.record_worker_init,
    ) as loader:
        rows = await collect(loader)
    assert {int(r[1]) for r in rows} <= {0, 1}
    assert all(int(r[1]) >= 0 for r in rows)


async def test_large_batches_arrive_through_shared_memory() -> None:
    ds = datasets.BigDataset(8, (3, 128, 128))  # 768 KiB batches
    async with AsyncDataLoader(ds, batch_size=4, num_workers=2) as loader:
        batches = await collect(loader)
    assert [float(b[0, 0, 0, 0]) for b in batches] == [0.0, 4.0]
    # Built by default_collate directly in shared memory, never copied through the pipe.
    assert all(b.is_shared() for b in batches)
    assert torch.equal(batches[1][3], torch.full((3, 128, 128), 7.0))


async def test_small_batches_travel_inline() -> None:
    async with AsyncDataLoader(datasets.RangeDataset(8), batch_size=4, num_workers=2) as loader:
        batches = await collect(loader)
    assert [b.flatten().tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert not any(b.is_shared() for b in batches)
    batches[0].add_(1)  # a private, writable copy


async def test_dataset_tensor_is_shared_with_spawned_workers() -> None:
    big = torch.arange(1 << 19, dtype=torch.float32)  # 2 MiB: shared, not copied per worker
    ds = torch.utils.data.TensorDataset(big)
    async with AsyncDataLoader(
        ds, batch_size=1 << 17, num_workers=2, multiprocessing_context="spawn"
    ) as loader:
        got = torch.cat([b[0] for b in await collect(loader)])
    assert torch.equal(got, big)


SCRIPT = textwrap.dedent(
    """
    import asyncio, sys, torch
    from torch.utils.data import Dataset
    from aioloader import AsyncDataLoader

    class Squares(Dataset):          # defined in __main__ of a `python -c` program
        def __len__(self): return 10
        def __getitem__(self, i): return torch.tensor(i * i)

    async def main():
        async with asyncio.timeout(60):
            async with AsyncDataLoader(Squares(), batch_size=5, num_workers=2,
                                       collate_fn=lambda b: torch.stack(b).sum(),
                                       multiprocessing_context=sys.argv[1]) as loader:
                print([int(b) async for b in loader])

    asyncio.run(main())
    """
)


def test_main_guarded_objects_of_a_script_go_by_value(tmp_path: Any) -> None:
    """A script's classes and functions, defined under its `if __name__ == "__main__":`.

    Plain pickle names them by reference, which a spawned worker cannot resolve: its re-import
    of the script skips that block. They go by value (cloudpickle), as from a notebook.
    """
    body = "\n".join("    " + line for line in SCRIPT.strip().splitlines())
    body = body.replace("lambda b: torch.stack(b).sum()", "total")
    script = tmp_path / "guarded.py"
    script.write_text(
        "if __name__ == '__main__':\n"
        "    def total(b):\n"
        "        return torch.stack(b).sum()\n"
        f"{body}\n"
    )
    out = subprocess.run(
        [sys.executable, str(script), "spawn"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([0 + 1 + 4 + 9 + 16, 25 + 36 + 49 + 64 + 81])


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_main_module_objects_work_under_spawn_and_forkserver(method: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, method],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([0 + 1 + 4 + 9 + 16, 25 + 36 + 49 + 64 + 81])


async def test_unpicklable_dataset_under_spawn_names_the_problem() -> None:
    class Holder(torch.utils.data.Dataset[int]):
        def __init__(self) -> None:
            import threading

            self.lock = threading.Lock()

        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> int:
            return i

    loader = AsyncDataLoader(Holder(), num_workers=1, multiprocessing_context="spawn")
    async with loader:
        with pytest.raises(TypeError, match="lock") as info:
            await collect(loader)
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "cannot be sent to worker processes" in notes
    # The note names the attribute and how to avoid sending it.
    assert "dataset.lock" in notes and "worker_init_fn" in notes and "lazily" in notes


class _OpenFileDataset(torch.utils.data.Dataset[int]):
    """Keeps a text file open (a log): an importable class, as in a real project."""

    def __init__(self, path: str) -> None:
        self.files = {"log": open(path, "a+")}  # noqa: SIM115

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("collate", [None, lambda b: b], ids=["plain-pickle", "with-a-lambda"])
def test_open_file_in_dataset_is_refused_not_copied(tmp_path: Any, collate: Any) -> None:
    """torch's pickling error for an open file; cloudpickle would send an in-memory copy of it.

    The lambda makes the payload go by value (cloudpickle), which must refuse the file too.
    """
    ds = _OpenFileDataset(str(tmp_path / "log.txt"))
    try:
        with pytest.raises(TypeError, match=r"cannot pickle '_io\.TextIOWrapper' object") as info:
            _payload.dump_payload((ds, collate, None))
    finally:
        ds.files["log"].close()
    notes = "".join(getattr(info.value, "__notes__", []))
    assert "dataset.files['log']" in notes and "worker_init_fn" in notes, notes


def test_unpicklable_worker_init_fn_note_names_it() -> None:
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match="lock") as info:
        _payload.dump_payload((datasets.RangeDataset(4), None, functools.partial(print, lock)))
    assert "worker_init_fn" in "".join(getattr(info.value, "__notes__", []))


async def test_default_collate_skips_shared_memory_only_for_small_batches() -> None:
    ds = datasets.DictDataset(8)
    expected = list(torch.utils.data.DataLoader(ds, batch_size=4))
    async with AsyncDataLoader(ds, batch_size=4, num_workers=2) as loader:
        got = await collect(loader)
    for g, e in zip(got, expected, strict=True):
        assert g["name"] == e["name"]
        assert torch.equal(g["label"], e["label"]) and g["label"].dtype == e["label"].dtype
        assert torch.equal(g["x"], e["x"])


@pytest.mark.skipif(
    not os.path.exists("/proc/self/smaps_rollup"), reason="reads Linux's /proc/self/smaps_rollup"
)
@pytest.mark.skipif(
    not _worker._FREEZE_IS_FREE, reason="workers freeze only where freezing copies nothing"
)
async def test_a_forked_workers_garbage_collection_leaves_what_it_inherited_shared() -> None:
    """A full collection in a worker does not walk the objects it inherited from this process.

    Walking them writes each object's header, so every page holding one would become the
    worker's own copy: here ~30 MB of lists this process keeps, in each worker.
    """
    kept = [[i] for i in range(400_000)]  # tracked by the collector: they stay tracked
    async with AsyncDataLoader(
        datasets.CollectGarbageDataset(),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
    ) as loader:
        [(before, after)] = await collect(loader)
    assert len(kept) == 400_000
    # Without the worker's gc.freeze(): 71 MB more (these lists, and torch's own objects).
    assert int(after) - int(before) < 8 * 1024, (before, after)


async def test_workers_start_at_torchs_priority_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aioloader import _priority

    class Nice(datasets.RangeDataset):
        def __getitem__(self, i: int) -> Any:
            import os

            return torch.tensor(os.nice(0))

    # worker_nice=None adapts (see test_priority.py) from nice 0 relative to this process.
    monkeypatch.setattr(_priority, "_last_level", 0)
    base = os.nice(0)
    for nice, expected in ((None, base), (5, base + 5), (0, base)):
        kw = {} if nice is None else {"worker_nice": nice}
        async with AsyncDataLoader(Nice(2), batch_size=None, num_workers=1, **kw) as loader:
            got = {int(b) for b in await collect(loader)}
        assert got == {min(19, expected)}
    with pytest.raises(ValueError, match="worker_nice"):
        AsyncDataLoader(datasets.RangeDataset(2), worker_nice=20)


class _LazyViews(torch.utils.data.Dataset[Any]):
    """Samples that are conjugated / negated views: their memory holds the unflipped values."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        z = torch.tensor([complex(i, i + 1), complex(-i, 2)])
        return {"conj": z.conj(), "neg": z.conj().imag}


async def test_conjugated_and_negated_views_arrive_with_their_values() -> None:
    want = list(torch.utils.data.DataLoader(_LazyViews(), batch_size=None))
    async with AsyncDataLoader(
        _LazyViews(), batch_size=None, num_workers=2, multiprocessing_context="fork"
    ) as loader:
        got = await collect(loader)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g["conj"], w["conj"].resolve_conj())
        assert torch.equal(g["neg"], w["neg"].resolve_neg())


@pytest.mark.parametrize("num_workers", [0, 1, 2])
async def test_a_datapipes_sharding_filter_splits_the_data_between_workers(
    num_workers: int,
) -> None:
    """As torch's workers do: every sample once (they each yielded all of it)."""
    import torch.utils.data.datapipes as dp

    pipe = dp.iter.IterableWrapper(list(range(10))).sharding_filter()
    loader = AsyncDataLoader(pipe, num_workers=num_workers)
    async with loader, asyncio.timeout(60):
        got = sorted([int(x) async for x in loader])
    assert got == list(range(10))


def _torch_epochs(make: Any, epochs: int, **kwargs: Any) -> list[list[list[int]]]:
    g = torch.Generator()
    g.manual_seed(7)
    loader = torch.utils.data.DataLoader(make(), generator=g, **kwargs)
    return [[b.tolist() for b in loader] for _ in range(epochs)]


def _shuffled_pipe() -> Any:
    import torch.utils.data.datapipes as dp

    return dp.iter.IterableWrapper(list(range(20))).shuffle().sharding_filter()


@pytest.mark.parametrize(
    ("num_workers", "persistent", "executor"),
    [(0, False, "process"), (2, False, "process"), (2, True, "process"), (2, False, "thread")],
)
async def test_a_datapipes_shuffle_is_seeded_each_epoch_as_torchs(
    num_workers: int, persistent: bool, executor: str
) -> None:
    """torch seeds an IterDataPipe's shufflers from the loader's generator every epoch, with one
    seed shared by all workers (a shuffle that differed per worker would deal a sample to two
    shards or none): the same generator gives the same batches here, epoch after epoch."""
    kwargs: dict[str, Any] = {
        "batch_size": 4,
        "num_workers": num_workers,
        "persistent_workers": persistent,
    }
    expected = _torch_epochs(_shuffled_pipe, 3, **kwargs)
    assert expected[0] != expected[1]  # the shuffle is reseeded: a real test of the seeding
    g = torch.Generator()
    g.manual_seed(7)
    loader = AsyncDataLoader(_shuffled_pipe(), generator=g, executor=executor, **kwargs)
    async with loader, asyncio.timeout(120):
        got = [[b.tolist() async for b in loader] for _ in range(3)]
    assert got == expected
    for epoch in got:
        assert sorted(x for batch in epoch for x in batch) == list(range(20))


class _RefilledBuffer(torch.utils.data.Dataset[torch.Tensor]):
    """Returns one tensor, refilled in place for every sample: safe in torch's single-process
    loader, which loads only inside next()."""

    def __init__(self) -> None:
        self.buf = torch.zeros(3)

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        self.buf.fill_(i)
        return self.buf


async def test_num_workers_0_loads_only_when_the_next_batch_is_asked_for() -> None:
    loader = AsyncDataLoader(_RefilledBuffer(), batch_size=None)
    changed = 0
    async with loader, asyncio.timeout(60):
        async for batch in loader:
            seen = batch.clone()
            await asyncio.sleep(0.01)  # the loop body awaits: nothing may load meanwhile
            changed += int(not torch.equal(seen, batch))
    assert changed == 0


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
async def test_a_dataset_holding_a_multiprocessing_value_works_under_spawn(
    start_method: str,
) -> None:
    """A Value (or Lock, Queue) pickles only while a process starts; torch's workers get the
    dataset in their start arguments, and so do ours then (instead of the shared payload)."""
    ctx = multiprocessing.get_context(start_method)
    dataset = datasets.SharedCounterDataset(12, ctx)
    loader = AsyncDataLoader(
        dataset, batch_size=3, num_workers=2, multiprocessing_context=start_method
    )
    async with loader, asyncio.timeout(120):
        got = [b.flatten().tolist() async for b in loader]
    assert got == [[i, i + 1, i + 2] for i in range(0, 12, 3)]
    assert dataset.count.value == 12  # every worker counted into the main process's Value
    del dataset, loader
    gc.collect()  # the Value's semaphore goes with it


def test_a_workers_torch_seed_is_torchs_with_stacks_read_from_no_source_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import traceback

    # The CPU generator ends in the same state as after torch.manual_seed.
    torch.manual_seed(1234)
    expected = torch.rand(5)
    torch.manual_seed(99)
    _worker.manual_seed(1234)
    assert torch.equal(torch.rand(5), expected)
    # Every device backend torch seeds is still seeded (or has its seed queued), and each
    # module's traceback is back in place afterwards.
    modules = [getattr(torch, n) for n in ("cuda", "xpu", "mtia") if hasattr(torch, n)]
    calls: dict[str, list[int]] = {}
    for module in modules:
        if module._is_in_bad_fork():
            continue  # torch itself skips a backend initialised before this process forked

        def record(seed: int, name: str = module.__name__) -> None:
            calls.setdefault(name, []).append(seed)

        monkeypatch.setattr(module, "manual_seed_all", record)
    _worker.manual_seed(77)
    assert calls == {m.__name__: [77] for m in modules if not m._is_in_bad_fork()}
    monkeypatch.undo()
    assert all(getattr(m, "traceback", traceback) is traceback for m in modules)
    # The stacks queued with the seeds read no source file: the real format_stack is not
    # called, and the frames named are the ones it names.
    formatted: list[int] = []
    real_format_stack = traceback.format_stack

    def counting(*args: Any, **kwargs: Any) -> Any:
        formatted.append(1)
        return real_format_stack(*args, **kwargs)

    monkeypatch.setattr(traceback, "format_stack", counting)
    _worker.manual_seed(5)
    assert formatted == []
    monkeypatch.undo()
    real, cheap = traceback.format_stack(), _worker._stack_without_source.format_stack()
    assert cheap == [entry.splitlines(keepends=True)[0] for entry in real]


_FORK_WHILE_SEEDING = """
import os, sys, threading, time
from aioloader import _worker
stop = threading.Event()
def seed_forever():
    i = 0
    while not stop.is_set():
        _worker.manual_seed(i)
        i += 1
threading.Thread(target=seed_forever, daemon=True).start()
children = []
for _ in range(20):
    time.sleep(0.005)
    pid = os.fork()
    if pid == 0:
        _worker.manual_seed(1)  # deadlocks if the fork copied the lock held
        os._exit(0)
    children.append(pid)
stop.set()
deadline = time.monotonic() + 20
stuck = set(children)
while stuck and time.monotonic() < deadline:
    for pid in list(stuck):
        if os.waitpid(pid, os.WNOHANG)[0]:
            stuck.discard(pid)
    time.sleep(0.01)
for pid in stuck:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print(len(stuck))
"""


def test_a_process_forked_while_another_thread_seeds_can_seed() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_SEEDING], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0"  # no child stuck


@pytest.mark.parametrize("context", ["fork", "spawn"])
async def test_a_worker_leaves_what_it_started_with_out_of_garbage_collection(
    context: str,
) -> None:
    """A full collection in a worker walks only what the worker made since it started: the
    dataset (inherited, or unpickled by the worker's set-up) is frozen with the modules, so the
    worker's io loop is not stalled by walks over them, and inherited pages are not written."""
    async with AsyncDataLoader(
        datasets.GcFrozenDataset(4), batch_size=2, num_workers=2, multiprocessing_context=context
    ) as loader:
        got = await collect(loader)
    assert [row.tolist() for b in got for row in b] == [[1, 1]] * 4  # frozen; collector on
    assert gc.get_freeze_count() == 0  # the consumer's own process is the user's: untouched
