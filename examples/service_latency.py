"""Request latency of examples/service.py while it trains, against the same app without training
and with torch's DataLoader used through ``asyncio.to_thread``.

Run: python examples/service_latency.py [--runs 3] [--requests 400] [--gap-ms 5]
                                        [--concurrency 1] [--configs none,aio-thread,...]
                                        [-- SERVICE ARGS]

Each configuration starts the service in its own process on a free loopback port, waits until
training is under way, then sends ``--requests`` sequential prediction requests ``--gap-ms``
apart over one keep-alive connection and records each one's latency; training throughput is
the service's own step count over the same window. Configurations alternate run by run, so a
change in the machine's load hits all of them alike. ``--configs`` picks them: by default no
training, aioloader and torch with the training step on a thread; ``aio-loop`` and ``torch-loop``
run the step on the event loop instead, the pattern that does not reach the target;
``fastapi-none`` and ``fastapi`` run examples/service_fastapi.py (FastAPI on uvicorn) without and
with aioloader. ``--concurrency N`` sends from N clients at once (each its own connection,
``--requests`` in all), to see what request handling costs the training rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

SERVICE = Path(__file__).resolve().parent / "service.py"
FASTAPI = Path(__file__).resolve().parent / "service_fastapi.py"

#: key -> (name, script, its arguments)
CONFIGS: dict[str, tuple[str, Path, list[str]]] = {
    "none": ("no training", SERVICE, ["--loader", "none"]),
    "aio-thread": ("aioloader, step on a thread", SERVICE, ["--loader", "aioloader"]),
    "torch-thread": ("torch via to_thread, step on a thread", SERVICE, ["--loader", "torch"]),
    "aio-loop": (
        "aioloader, step on the loop",
        SERVICE,
        ["--loader", "aioloader", "--train-step", "loop"],
    ),
    "torch-loop": (
        "torch via to_thread, step on the loop",
        SERVICE,
        ["--loader", "torch", "--train-step", "loop"],
    ),
    "fastapi-none": ("FastAPI, no training", FASTAPI, ["--workers", "0", "--no-training"]),
    "fastapi": ("FastAPI, aioloader, step on a thread", FASTAPI, []),
}
DEFAULT = "none,aio-thread,torch-thread"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def measure(
    args: argparse.Namespace, script: Path, service_args: list[str]
) -> dict[str, float]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(script),
        "--port",
        "0",
        *service_args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(SERVICE.parent.parent)),
    )
    assert proc.stdout is not None
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        if not line.startswith("serving on "):
            raise RuntimeError(f"the service did not start: {line!r}")
        base = line.split()[2]
        training = "none" not in service_args and "--no-training" not in service_args
        x = [i / 16 for i in range(16)]
        connector = aiohttp.TCPConnector(limit=args.concurrency + 1)
        async with aiohttp.ClientSession(connector=connector) as http:

            async def status() -> dict[str, Any]:
                async with asyncio.timeout(60):
                    while True:
                        try:
                            async with http.get(f"{base}/status") as r:
                                return dict(await r.json())
                        except aiohttp.ClientConnectionError:  # uvicorn not listening yet
                            await asyncio.sleep(0.05)

            if training:  # warm: workers up, first batches trained on
                async with asyncio.timeout(120):
                    while (await status())["steps"] < args.warmup_steps:  # noqa: ASYNC110
                        await asyncio.sleep(0.05)  # polling another process: no event to await
            before, t0 = await status(), time.perf_counter()
            latencies: list[float] = []

            async def client(n: int) -> None:
                for _ in range(n):
                    start = time.perf_counter()
                    async with http.post(f"{base}/predict", json={"x": x}) as r:
                        r.raise_for_status()
                        await r.read()
                    latencies.append((time.perf_counter() - start) * 1000)
                    await asyncio.sleep(args.gap_ms / 1000)

            per_client = max(1, args.requests // args.concurrency)
            async with asyncio.TaskGroup() as clients:
                for _ in range(args.concurrency):
                    clients.create_task(client(per_client))
            after, t1 = await status(), time.perf_counter()
        return {
            "p50_ms": percentile(latencies, 0.50),
            "p99_ms": percentile(latencies, 0.99),
            "max_ms": max(latencies),
            "batches_per_s": (after["steps"] - before["steps"]) / (t1 - t0),
        }
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def main(args: argparse.Namespace) -> None:
    keys = [k.strip() for k in args.configs.split(",")]
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown --configs {unknown}; choose from {', '.join(CONFIGS)}")
    results: dict[str, list[dict[str, float]]] = {CONFIGS[k][0]: [] for k in keys}
    for run in range(args.runs):
        for key in keys:
            name, script, service_args = CONFIGS[key]
            extra = ["--workers", str(args.workers), "--batch-size", str(args.batch_size)]
            r = await measure(args, script, extra + service_args + args.service_args)
            results[name].append(r)
            print(
                f"run {run + 1}  {name:<40} p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms"
                f"  max {r['max_ms']:6.1f} ms  {r['batches_per_s']:6.1f} batches/s",
                flush=True,
            )
    print(
        f"\nmedian of {args.runs} runs, {args.requests} requests from {args.concurrency} "
        f"client(s), each {args.gap_ms} ms apart:"
    )
    print(f"{'configuration':<40} {'p50 ms':>8} {'p99 ms':>8} {'batches/s':>10}   p99 per run")
    for name, rs in results.items():
        p50 = statistics.median(r["p50_ms"] for r in rs)
        p99 = statistics.median(r["p99_ms"] for r in rs)
        bps = statistics.median(r["batches_per_s"] for r in rs)
        each = ", ".join(f"{r['p99_ms']:.1f}" for r in rs)
        print(f"{name:<40} {p50:8.2f} {p99:8.2f} {bps:10.1f}   {each}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))  # noqa: ASYNC240 (at exit)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--gap-ms", type=float, default=5.0)
    p.add_argument("--concurrency", type=int, default=1, help="clients sending at once")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument(
        "--configs",
        default=DEFAULT,
        help=f"comma list from {', '.join(CONFIGS)} (default {DEFAULT}); the *-loop ones run the "
        "training step on the event loop, the pattern that does not reach the target",
    )
    p.add_argument("--json", help="write every run's figures to this file")
    p.add_argument("service_args", nargs="*", help="more arguments for service.py (after --)")
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
