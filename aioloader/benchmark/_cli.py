"""Benchmark aioloader's AsyncDataLoader against torch's DataLoader.

Run ``python -m aioloader.benchmark --help``. Every measurement alternates the loaders
(torch, aioloader[, spdl]) round by round after in-round warm-up batches, and reports the median
of the rounds and the ratio aioloader/torch. All workloads are synthetic; their datasets live at
module level so they pickle by reference under ``spawn`` and ``forkserver``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

from aioloader.benchmark import backends, remote, stream
from aioloader.benchmark._harness import (
    AIO,
    AIO_OPTIONS,
    SPDL,
    TORCH,
    Config,
    Row,
    aio_class,
    loader_kwargs,
    run_once,
    spdl_available,
)
from aioloader.benchmark._limit import LIMIT
from aioloader.benchmark._load import BackgroundLoad, LoadMeter, OtherLoad
from aioloader.benchmark._report import format_table, machine_info, write_plot
from aioloader.benchmark.big import bench_big
from aioloader.benchmark.cpu import bench_cpu
from aioloader.benchmark.device import bench_device
from aioloader.benchmark.iowait import bench_io
from aioloader.benchmark.loop_lag import bench_loop_lag
from aioloader.benchmark.remote import bench_remote
from aioloader.benchmark.resume import bench_resume
from aioloader.benchmark.skewed import bench_skewed
from aioloader.benchmark.startup import bench_startup
from aioloader.benchmark.stream import bench_stream
from aioloader.benchmark.text import bench_text
from aioloader.benchmark.tiny import TinyDataset, bench_tiny
from aioloader.benchmark.user_dataset import bench_dataset

WORKLOADS = (
    "tiny",
    "cpu",
    "io",
    "big",
    "skewed",
    "startup",
    "loop-lag",
    "device",
    "resume",
    "stream",
    "remote",
    "text",
)
#: Run only when named: ``backends`` compares the executors (and starts a local Ray cluster).
OPTIONAL_WORKLOADS = ("backends",)


BENCHES: dict[str, Callable[[Config], list[Row]]] = {
    "tiny": bench_tiny,
    "cpu": bench_cpu,
    "io": bench_io,
    "big": bench_big,
    "skewed": bench_skewed,
    "startup": bench_startup,
    "loop-lag": bench_loop_lag,
    "device": bench_device,
    "resume": bench_resume,
    "stream": bench_stream,
    "remote": bench_remote,
    "text": bench_text,
    "dataset": bench_dataset,
    "backends": backends.bench_backends,
}


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _worker_nice(text: str) -> int | str:
    """``--worker-nice``: an int, or ``idle``."""
    return text if text == "idle" else int(text)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m aioloader.benchmark", description=__doc__)
    p.add_argument(
        "--workload",
        action="append",
        default=[],
        help=(
            f"workload(s) to run, repeatable or comma list: {', '.join(WORKLOADS)} "
            f"(default: all of them); also {', '.join(OPTIONAL_WORKLOADS)}"
        ),
    )
    p.add_argument("--quick", action="store_true", help="shorter rounds; suite under 1 minute")
    p.add_argument(
        "--remote-grid",
        action="store_true",
        help="remote: latency 5/20/100 ms x objects 10 KB/100 KB/1 MB x decode or not "
        "(default: 20 ms, 100 KB, with and without decode)",
    )
    p.add_argument("--json", metavar="PATH", help="write raw rounds, medians and machine info")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the ratios")
    p.add_argument("--workers", type=int, default=2, help="num_workers for both loaders")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (at least 3)")
    p.add_argument(
        "--dataset",
        metavar="MODULE:FACTORY",
        help="benchmark your own dataset: FACTORY() returns a map-style Dataset",
    )
    p.add_argument("--batch-size", type=int, default=32, help="batch size for --dataset")
    p.add_argument("--batches", type=int, default=50, help="timed batches per round, --dataset")
    p.add_argument(
        "--worker-nice",
        type=_worker_nice,
        default=None,
        metavar="N",
        help="aioloader's worker_nice for the run, 0-19 or idle (default: the loader's own)",
    )
    p.add_argument(
        "--background-load",
        type=int,
        default=0,
        metavar="N",
        help="run N busy-looping processes at nice 0 beside every loader and limit for the "
        "whole run, to read each figure under load (default 0: a quiet machine)",
    )
    args = p.parse_args(argv)
    names = [n.strip() for w in args.workload for n in w.split(",") if n.strip()]
    if args.dataset and not names:
        names = ["dataset"]
    elif args.dataset:
        names.append("dataset")
    names = names or list(WORKLOADS)
    unknown = [n for n in names if n not in BENCHES or (n == "dataset" and not args.dataset)]
    if unknown:
        choices = ", ".join(WORKLOADS + OPTIONAL_WORKLOADS)
        p.error(f"unknown workload(s) {unknown}; choose from {choices}")
    if args.rounds < 3:
        p.error("--rounds must be at least 3")
    if args.workers < 1:
        p.error("--workers must be at least 1")
    if args.background_load < 0:
        p.error("--background-load must be at least 0")
    args.names = list(dict.fromkeys(names))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_nice is not None:
        AIO_OPTIONS["worker_nice"] = args.worker_nice
    aio_class()  # fail fast, before minutes of torch-only runs
    loaders = [TORCH, AIO] + ([SPDL] if spdl_available() else [])
    started = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"  [{time.perf_counter() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    cfg = Config(
        args.workers,
        args.rounds,
        args.quick,
        loaders,
        progress,
        {
            "dataset": args.dataset,
            "batch_size": args.batch_size,
            "batches": args.batches,
            "remote_grid": args.remote_grid,
        },
    )
    # One untimed pass of every loader first, so imports and first-use costs land nowhere.
    for name in loaders:
        run_once(name, TinyDataset(64), loader_kwargs(cfg, 8), 1)
    rows: list[Row] = []
    loads: dict[str, OtherLoad] = {}
    with BackgroundLoad(args.background_load) as background:
        meter = LoadMeter(exclude=background.pids)
        if args.background_load:
            progress(f"background load: {args.background_load} busy process(es) at nice 0")
        for name in args.names:
            progress(f"workload {name}")
            meter.start()
            rows += BENCHES[name](cfg)
            load = meter.stop()
            if load is not None:
                loads[name] = load
                progress(f"{name}: {load.describe()}")
    # Workloads that compare more loaders (the executors, the machine's limit) add columns.
    columns = (*backends.COLUMNS, *remote.COLUMNS, *stream.COLUMNS, LIMIT)
    extra = [c for c in columns if any(c in r.rounds for r in rows)]
    loaders = loaders + extra
    table = format_table(rows, loaders)
    print(table)
    elapsed = time.perf_counter() - started
    print(
        f"\n{len(rows)} rows in {elapsed:.0f}s; workers={args.workers}, rounds={args.rounds}, "
        f"cpus={os.cpu_count()}, torch {torch.__version__}, "
        f"background load {args.background_load}, worker_nice "
        f"{AIO_OPTIONS.get('worker_nice', 'default')}"
    )
    if loads:
        # Ratios taken while other processes kept cores busy are less reliable: say how busy.
        print("machine load from other processes, per workload (cores on average):")
        print("  " + ", ".join(f"{name} {load.others:.2f}" for name, load in loads.items()))
    if args.json:
        doc = {
            "machine": machine_info(),
            "argv": list(argv if argv is not None else sys.argv),
            "elapsed_s": elapsed,
            "background_load": args.background_load,
            "aioloader_options": AIO_OPTIONS,
            "loaders": loaders,
            "other_load": {
                name: {"others_cores": ld.others, "benchmark_cores": ld.ours, "cores": ld.cores}
                for name, ld in loads.items()
            },
            "rows": [r.to_json() for r in rows],
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    if args.plot:
        write_plot(rows, args.plot)
    return 0
