"""``startup``: construction to first batch, each measurement in a freshly forked process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

from torch.utils.data import Dataset

from aioloader.benchmark._harness import (
    AIO,
    SPDL,
    Config,
    Row,
    aio_first_batches,
    ratio_check,
    torch_first_batches,
)

STARTUP_ENTRIES = 1_200_000


class StartupDataset(Dataset[tuple[str, int]]):
    """An index of 1.2 million (path, label) tuples (~54 MB pickled), as an image folder has.

    Only ``serve`` entries are read per epoch: the point is what the loader does with the big
    dataset object at start-up, not throughput.
    """

    def __init__(self, entries: int, serve: int) -> None:
        self.items = [
            (f"/data/train/n{i % 1000:05d}/img_{i:08d}.JPEG", i % 1000) for i in range(entries)
        ]
        self.serve = serve

    def __len__(self) -> int:
        return self.serve

    def __getitem__(self, i: int) -> tuple[str, int]:
        return self.items[i]


# --- start-up: each measurement in a fresh process -----------------------------------------
#
# A fresh interpreter per measurement costs ~3 s (import torch, build the 1.2M-entry list) and
# 36 of them would eat the whole time budget. Instead one "zygote" interpreter imports torch,
# builds the dataset once and forks a new process per measurement. The fork is taken before
# anything loader-related exists (no multiprocessing state, no forkserver, no threads, no event
# loop), so each measurement starts as a training script does right after building its dataset.


def _measure_startup(ds: StartupDataset, spec: dict[str, Any]) -> tuple[float, float]:
    """Time construction -> first batch, then the 2nd epoch's first batch (persistent)."""
    kwargs = {
        "batch_size": 64,
        "num_workers": spec["workers"],
        "multiprocessing_context": spec["method"],
        "persistent_workers": True,
    }
    if spec["loader"] == AIO:
        return aio_first_batches(ds, kwargs)
    return torch_first_batches(ds, kwargs)


def _zygote_main(entries: int) -> int:
    """Build the dataset once; fork one measurement process per JSON request on stdin."""
    ds = StartupDataset(entries, serve=64 * 4)
    print("READY", flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _begin_measurement()
            try:
                first, second = _measure_startup(ds, spec)
                out: dict[str, Any] = {"first_s": first, "epoch2_s": second}
            except BaseException as exc:  # report, never fall back into the zygote's loop
                out = {"error": repr(exc)}
            print("BENCH-RESULT " + json.dumps(out), flush=True)
            # Orderly shutdown of spawned workers takes ~1 s and is not measured here.
            _end_measurement()
        os.waitpid(pid, 0)
    return 0


def _begin_measurement() -> None:
    """In a measurement's process, first: start multiprocessing's resource tracker while this
    process is still in the zygote's process group, then take a group of its own. The tracker
    thus outlives :func:`_end_measurement`'s SIGKILL and, once every process using them is
    gone, unlinks the named semaphores that the loaders' queues made under spawn and forkserver;
    killed with the group, it left them in /dev/shm (6 per full run of the workload, measured)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    os.setsid()  # own process group: its workers and forkserver die with it


def _end_measurement() -> None:
    """Kill the measurement's process group, this process included (see _begin_measurement)."""
    os.killpg(0, signal.SIGKILL)


class _Zygote:
    """Parent-side handle on the zygote interpreter."""

    def __init__(self, entries: int) -> None:
        env = dict(os.environ)
        # The zygote must import this very package, wherever it was run from (the directory
        # that holds aioloader/benchmark/startup.py).
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        code = (
            "import sys; from aioloader.benchmark.startup import _zygote_main; "
            "sys.exit(_zygote_main(int(sys.argv[1])))"
        )
        self.err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (lives as long as self; close())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(entries)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            text=True,
            env=env,
            start_new_session=True,
        )
        self._read("READY")

    def _read(self, prefix: str, timeout: float = 180.0) -> str:
        assert self.proc.stdout is not None
        # A stuck measurement must not hang the suite: kill the zygote, which ends the read.
        killer = threading.Timer(timeout, _kill_group, (self.proc.pid,))
        killer.start()
        try:
            for line in self.proc.stdout:
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
        finally:
            killer.cancel()
        self.err.seek(0)
        raise RuntimeError(f"start-up zygote died:\n{self.err.read()[-2000:]}")

    def measure(self, loader: str, method: str, workers: int) -> tuple[float, float]:
        assert self.proc.stdin is not None
        spec = {"loader": loader, "method": method, "workers": workers}
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        got = json.loads(self._read("BENCH-RESULT "))
        if "error" in got:
            raise RuntimeError(f"start-up measurement {spec} failed: {got['error']}")
        return float(got["first_s"]), float(got["epoch2_s"])

    def close(self) -> None:
        _kill_group(self.proc.pid)
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.err):
            if f is not None:
                f.close()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, signal.SIGKILL)


def bench_startup(cfg: Config) -> list[Row]:
    loaders = [n for n in cfg.loaders if n != SPDL]  # spdl is compared on throughput only
    combos: list[tuple[str, int]] = (
        [("fork", 2), ("fork", 4)]
        if cfg.quick
        else [(m, w) for m in ("fork", "spawn", "forkserver") for w in (2, 4)]
    )
    zygote = _Zygote(int(cfg.extra.get("startup_entries", STARTUP_ENTRIES)))
    first: dict[tuple[str, int], dict[str, list[float]]] = {c: {} for c in combos}
    second: dict[tuple[str, int], dict[str, list[float]]] = {c: {} for c in combos}
    try:
        for name in loaders:  # warm-up: first-use costs, page cache
            zygote.measure(name, "fork", 2)
        for r in range(cfg.rounds):
            for combo in combos:
                for name in loaders:
                    f, s = zygote.measure(name, combo[0], combo[1])
                    first[combo].setdefault(name, []).append(f)
                    second[combo].setdefault(name, []).append(s * 1e3)
            cfg.progress(f"round {r + 1}/{cfg.rounds}")
    finally:
        zygote.close()
    rows: list[Row] = []
    for method, w in combos:
        row = Row("startup", f"first batch s, {method}, {w} workers", "lower", first[(method, w)])
        if method == "fork":
            ratio_check(row, "<=", 1.0)
        elif w == 4:
            ratio_check(row, "<=", 0.5)
        rows.append(row)
    for method in ("spawn", "forkserver"):
        if (method, 2) in first and (method, 4) in first:
            lo, hi = first[(method, 2)], first[(method, 4)]
            growth = Row(
                "startup",
                f"first batch 4w/2w, {method}",
                "lower",
                {
                    n: [b / a for a, b in zip(lo[n], hi[n], strict=True)]
                    for n in loaders
                    if n in lo and n in hi
                },
                note="flat = 1.0; ratio column compares the growths",
            )
            g = growth.median(AIO)
            growth.target = "aioloader <= 1.25"
            growth.passed = None if g is None else g <= 1.25
            rows.append(growth)
    for method, w in combos:
        row = Row(
            "startup",
            f"epoch-2 first batch ms, {method}, {w}w, persistent",
            "lower",
            second[(method, w)],
        )
        e = row.median(AIO)
        row.target = "aioloader < 10 ms"
        row.passed = None if e is None else e < 10.0
        rows.append(row)
    return rows
