"""What sets the event loop's lag on a busy machine: the loop's own CPU in each step.

Run ``python -m aioloader.benchmark.loop_bursts``. Three measurements:

* **Bursts.** A probe sleeps 1 ms on the loop, in a loop (as in the ``loop-lag`` workload),
  beside two busy processes at niceness ``--worker-nice`` standing in for the workers and
  ``--background-load`` busy processes at niceness 0; a second task on the same loop burns
  ``burst`` ms of CPU every ``--period-ms`` ms, standing in for the loop's work on each batch it
  receives. Prints the probe's p50 and p99 lateness per burst length. No loader runs.
* **The loop's CPU per batch** of the ``cpu`` workload (9.8 MB batches): the CPU time of the
  loop's thread while an :class:`~aioloader.AsyncDataLoader` delivers them, per batch.
* **What a wake-up costs.** One ``loads_result`` of a 6 KB inline batch (what the loop does
  to a small batch it receives, less reading the pipe), timed right after the thread slept
  ``gap`` ms and right after it spun for as long, with no other load. The difference is what
  waking up costs the first work after it (caches refilled, a virtual CPU resumed after a
  halt); on a machine where it is large, a loop whose CPU goes idle between batches pays it on
  every batch.

A loop that only sleeps keeps its wake-ups prompt beside busy processes; one that spends a
fraction of a millisecond of CPU at a time is scheduled as a CPU user like the others, and waits
for a core about a scheduler tick (4 ms at ``HZ=250``) or more once it has used its share.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import time
from collections.abc import Sequence

from aioloader import AsyncDataLoader
from aioloader.benchmark._harness import spin
from aioloader.benchmark._load import BackgroundLoad
from aioloader.benchmark.cpu import JpegDataset, make_jpeg
from aioloader.benchmark.loop_lag import _probe

__all__ = ("loop_cpu_per_batch", "measure_bursts", "wake_cost")


def _pct(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def _busy(nice: int, seconds: float) -> None:
    os.nice(nice)
    spin(seconds)


async def _burner(stop: asyncio.Event, burst_s: float, period_s: float) -> None:
    while not stop.is_set():
        await asyncio.sleep(period_s)
        spin(burst_s)


async def _one(burst_ms: float, period_ms: float, seconds: float) -> tuple[float, float]:
    lags: list[float] = []
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_probe(stop, lags))]
    if burst_ms > 0:
        tasks.append(asyncio.create_task(_burner(stop, burst_ms / 1e3, period_ms / 1e3)))
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return _pct(lags, 0.5), _pct(lags, 0.99)


def measure_bursts(
    bursts_ms: Sequence[float], period_ms: float, seconds: float, worker_nice: int
) -> list[tuple[float, float, float]]:
    """``(burst ms, p50 ms, p99 ms)`` of the probe per burst length, beside two busy processes
    at ``worker_nice`` (and whatever other load the caller runs)."""
    ctx = mp.get_context("fork")
    total = len(bursts_ms) * (seconds + 0.5) + 5
    busy = [ctx.Process(target=_busy, args=(worker_nice, total), daemon=True) for _ in range(2)]
    for p in busy:
        p.start()
    try:
        time.sleep(0.3)
        out = []
        for burst in bursts_ms:
            p50, p99 = asyncio.run(_one(burst, period_ms, seconds))
            out.append((burst, p50, p99))
        return out
    finally:
        for p in busy:
            p.kill()
            p.join()


def loop_cpu_per_batch(batches: int, worker_nice: int) -> float:
    """CPU seconds of the loop's thread per batch of the ``cpu`` workload, 2 workers."""

    async def run() -> float:
        warmup = 4
        ds = JpegDataset((batches + warmup) * 32, make_jpeg())
        async with AsyncDataLoader(
            ds, batch_size=32, num_workers=2, worker_nice=worker_nice
        ) as loader:
            n, c0 = 0, 0.0
            async for _ in loader:
                n += 1
                if n == warmup:
                    c0 = time.thread_time()
            return (time.thread_time() - c0) / max(1, n - warmup)

    return asyncio.run(run())


def wake_cost(gaps_ms: Sequence[float], repeats: int) -> list[tuple[float, float, float]]:
    """``(gap ms, µs after sleeping, µs after spinning)``: the median wall time of one
    ``loads_result`` of a 6 KB inline batch (what the loop does to a small batch it receives,
    less reading the pipe), right after the thread slept, or spun, for ``gap`` ms.

    Every spinning block runs first, each after 0.2 s of spinning: a thread that slept stays
    slow for a while after it resumes, spinning included. The spun figure is above what the
    unit costs in a tight loop (and rises with the gap, for reasons not measured), so the ratio
    understates what a wake-up costs.
    """
    import statistics

    import torch

    from aioloader import _codec

    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if any(g < 0 for g in gaps_ms):
        raise ValueError(f"gaps must not be negative, got {list(gaps_ms)}")
    batch = (torch.zeros(32, 8, 8, 3, dtype=torch.uint8), list(range(32)))
    data = _codec.dumps_result(batch)

    def unit() -> float:
        t = time.perf_counter()
        got = _codec.loads_result(data)
        took = time.perf_counter() - t
        del got  # freed outside the timed part
        return took

    spun: dict[float, float] = {}
    for gap_ms in gaps_ms:
        spin(0.2)
        times = []
        for _ in range(repeats):
            spin(gap_ms / 1e3)
            times.append(unit())
        spun[gap_ms] = statistics.median(times)
    out = []
    for gap_ms in gaps_ms:
        times = []
        for _ in range(repeats):
            time.sleep(gap_ms / 1e3)
            times.append(unit())
        out.append((gap_ms, statistics.median(times) * 1e6, spun[gap_ms] * 1e6))
    return out


def _idle_driver() -> str:
    # What a halted CPU of this machine does (a virtual machine's "haltpoll" with polling off
    # gives the CPU back to the host at once).
    base = "/sys/devices/system/cpu/cpuidle/current_driver"
    poll = "/sys/module/haltpoll/parameters/guest_halt_poll_ns"
    parts = []
    for label, path in (("cpuidle driver", base), ("guest_halt_poll_ns", poll)):
        try:
            with open(path) as f:
                parts.append(f"{label} {f.read().strip()}")
        except OSError:
            continue
    return ", ".join(parts) or "cpuidle: not shown by this system"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m aioloader.benchmark.loop_bursts",
        description="The event loop's lag beside busy processes, per CPU burst of the loop; "
        "the loop's CPU per batch of the cpu workload; and what a wake-up costs the work after "
        "it.",
    )
    parser.add_argument("--bursts", default="0,0.1,0.3,0.5,1", help="burst lengths, ms")
    parser.add_argument("--period-ms", type=float, default=24.0)
    parser.add_argument("--seconds", type=float, default=4.0, help="per burst length")
    parser.add_argument("--worker-nice", type=int, default=5)
    parser.add_argument("--background-load", type=int, default=1)
    parser.add_argument("--batches", type=int, default=120, help="cpu workload batches")
    parser.add_argument("--gaps", default="0.1,1,20", help="wake-up cost: idle gaps, ms")
    parser.add_argument("--repeats", type=int, default=100, help="wake-up cost: per gap")
    args = parser.parse_args(argv)
    bursts = [float(b) for b in args.bursts.split(",") if b]
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    gaps = [float(g) for g in args.gaps.split(",") if g]
    if any(g < 0 for g in gaps):
        parser.error("--gaps must not be negative")
    with BackgroundLoad(args.background_load):
        print(
            f"probe beside 2 busy processes at nice {args.worker_nice} and "
            f"{args.background_load} at nice 0; a burst every {args.period_ms:g} ms"
        )
        for burst, p50, p99 in measure_bursts(
            bursts, args.period_ms, args.seconds, args.worker_nice
        ):
            print(f"  burst {burst:5.2f} ms: lag p50 {p50:6.2f} ms, p99 {p99:6.2f} ms")
        per_batch = loop_cpu_per_batch(args.batches, args.worker_nice)
        print(f"loop thread CPU per batch, cpu workload (9.8 MB): {per_batch * 1e3:.2f} ms")
    # Without the background load: a busy process keeps the CPUs from going idle, which is
    # what this part measures the price of.
    print(f"one loads_result of a 6 KB batch after an idle gap, no other load ({_idle_driver()})")
    for gap, slept, spun in wake_cost(gaps, args.repeats):
        print(
            f"  gap {gap:6.2f} ms: after sleeping {slept:7.1f} us, after spinning "
            f"{spun:7.1f} us ({slept / spun:.1f}x)"
        )


if __name__ == "__main__":
    main()
