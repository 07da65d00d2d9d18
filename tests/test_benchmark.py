"""Smoke test of the benchmark program: it runs and reports both loaders. No timing assertions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aioloader.benchmark._load import LoadMeter


def test_quick_tiny_benchmark_reports_both_loaders(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aioloader.benchmark",
            "--quick",
            "--workload",
            "tiny",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "batches/s (batch 1)" in proc.stdout
    doc = json.loads(out.read_text())
    assert {"torch", "aioloader"} <= set(doc["loaders"])
    throughput = [r for r in doc["rows"] if r["metric"].startswith("batches/s")]
    assert len(throughput) == 2
    for row in throughput:
        assert row["median"]["torch"] > 0
        assert row["median"]["aioloader"] > 0
        assert row["ratio_aioloader_over_torch"] > 0
    load = doc["other_load"]["tiny"]
    assert load["cores"] == os.cpu_count() and load["others_cores"] >= 0
    assert load["benchmark_cores"] > 0  # the loaders ran in this tree
    assert "machine load from other processes" in proc.stdout


# Burns CPU seconds (not wall seconds), so the amounts below hold however loaded the machine is.
_BURN = "import time\nwhile time.process_time() < {s}: pass\n"


def test_load_meter_tells_other_processes_from_the_benchmarks(tmp_path: Path) -> None:
    meter = LoadMeter()
    meter.start()
    # Ours: a child burning 0.5 s of CPU.
    subprocess.run([sys.executable, "-c", _BURN.format(s=0.5)], check=True, timeout=120)
    # Another's: a process that is not our descendant (its parent shell exits at once, so it is
    # re-parented away from us) burning 0.5 s; it says when it is done through a file.
    done = tmp_path / "done"
    script = _BURN.format(s=0.5) + f"open({str(done)!r}, 'w').close()\n"
    subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "$0" >/dev/null 2>&1 &', script],
        check=True,
        timeout=60,
    )
    deadline = time.monotonic() + 120
    while not done.exists():
        assert time.monotonic() < deadline, "the outside process never finished"
        time.sleep(0.05)
    time.sleep(0.05)  # its last tick accounted
    wall = time.monotonic() - meter._t0
    load = meter.stop()
    assert load is not None
    assert load.ours * wall >= 0.45
    assert load.others * wall >= 0.4
    # Not counted twice: what we burned is not in "others", and vice versa.
    assert load.ours * wall < 0.5 + 0.5 + 0.3


def test_the_big_copy_limit_builds_batches_in_parallel_processes() -> None:
    from aioloader.benchmark.big import copy_limit

    res = copy_limit(workers=2, batches=2)
    procs = min(2, os.cpu_count() or 1)
    assert (res.batches, res.samples) == (2 // procs * procs, 64 * (2 // procs) * procs)
    assert 0 < res.seconds < 60


def test_start_stall_reports_the_loops_stalls_while_workers_start() -> None:
    from aioloader.benchmark.start_stall import main, measure_start_stall

    rows = measure_start_stall(20_000, ["fork"], [2])
    assert len(rows) == 1
    row = rows[0]
    assert row["method"] == "fork" and row["workers"] == 2
    assert isinstance(row["first_batch_ms"], float) and row["first_batch_ms"] > 0
    assert isinstance(row["max_stall_ms"], float) and row["max_stall_ms"] >= 0
    assert main(["--entries", "5000", "--methods", "fork", "--workers", "1"]) == 0


def test_loop_bursts_reports_the_probe_per_burst_and_the_loops_cpu_per_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from aioloader.benchmark.loop_bursts import loop_cpu_per_batch, main, measure_bursts, wake_cost

    rows = measure_bursts([0.0, 2.0], period_ms=10.0, seconds=0.3, worker_nice=5)
    assert [burst for burst, _, _ in rows] == [0.0, 2.0]
    assert all(0 <= p50 <= p99 for _, p50, p99 in rows)
    assert rows[1][2] >= 1.0  # 2 ms of CPU on the loop every 10 ms: the probe sees it
    assert 0 < loop_cpu_per_batch(6, 5) < 1.0
    wake = wake_cost([0.1, 2.0], repeats=3)
    assert [gap for gap, _, _ in wake] == [0.1, 2.0]
    # A smoke check: unpickling a 6 KB batch takes microseconds, not 10 ms, either way. Which
    # is slower depends on the machine (on one whose CPUs do not halt, neither may be).
    assert all(0 < slept < 10_000 and 0 < spun < 10_000 for _, slept, spun in wake)
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        wake_cost([1.0], repeats=0)
    with pytest.raises(ValueError, match="gaps must not be negative"):
        wake_cost([-1.0], repeats=1)
    quick = ["--bursts", "0", "--seconds", "0.2", "--batches", "4", "--background-load", "0"]
    main([*quick, "--gaps", "0.5", "--repeats", "2"])
    out = capsys.readouterr().out
    assert "burst  0.00 ms" in out and "loop thread CPU per batch" in out
    assert "gap   0.50 ms: after sleeping" in out
    with pytest.raises(SystemExit):
        main(["--repeats", "0"])


_END_MEASUREMENT = """
import multiprocessing as mp, os, subprocess, sys
from aioloader.benchmark.startup import _begin_measurement, _end_measurement
_begin_measurement()
lock = mp.get_context("spawn").Lock()  # a named semaphore, registered with a resource tracker
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(lock._semlock.name, sleeper.pid, flush=True)
_end_measurement()
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_startup_measurement_ends_with_its_group_killed_and_its_semaphores_unlinked() -> None:
    import pytest

    if not os.path.isdir("/dev/shm") or not os.path.isdir("/proc"):
        pytest.skip("needs /proc and /dev/shm (Linux)")
    proc = subprocess.run(
        [sys.executable, "-c", _END_MEASUREMENT], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr  # killed with its group
    name, pid = proc.stdout.split()
    sem_file = "/dev/shm/sem." + name.lstrip("/")
    deadline = time.monotonic() + 20
    while (os.path.exists(sem_file) or not _gone(int(pid))) and time.monotonic() < deadline:
        time.sleep(0.05)
    # The process it started is killed; the resource tracker, started outside the group,
    # unlinked the semaphore (killed with the group, it left it in /dev/shm).
    assert _gone(int(pid))
    assert not os.path.exists(sem_file)


def test_remote_workload_runs_every_kind_of_row_against_a_real_store() -> None:
    """The remote workload, tiny: one short round of a few columns on a real store (0 ms, 10 KB
    JPEGs, decoded); every column that exists reports a rate, and nothing is left running."""
    from aioloader.benchmark._harness import AIO
    from aioloader.benchmark._limit import LIMIT
    from aioloader.benchmark.remote import (
        AIO_LOOP_0,
        DECODE_LIMIT,
        TORCH_ASYNC,
        Setting,
        measure_remote,
        rows_for,
    )

    setting = Setting(0, 10_000, True)
    cols = [LIMIT, DECODE_LIMIT, "torch", TORCH_ASYNC, AIO, AIO_LOOP_0]
    res, peaks, store_cpu = measure_remote(
        setting,
        workers=2,
        rounds=1,
        seconds=0.2,
        with_spdl=False,
        memory=True,
        progress=lambda _: None,
        only=cols,
        warmup_s=0.1,
    )
    for col in cols:
        assert len(res[col]) == 1 and res[col][0].samples > 0, col
    assert set(peaks) >= {"torch", TORCH_ASYNC, AIO_LOOP_0}
    assert store_cpu >= 0
    rows = rows_for(setting, res, peaks, store_cpu)
    metrics = [r.metric for r in rows]
    assert "samples/s (0 ms, 10 KB, decode)" in metrics
    assert any(m.startswith("peak PSS") for m in metrics)
    assert rows[0].median(LIMIT) and rows[0].median(AIO_LOOP_0)


def test_remote_workload_is_registered() -> None:
    from aioloader.benchmark import parse_args
    from aioloader.benchmark._cli import BENCHES, WORKLOADS

    assert "remote" in WORKLOADS and "remote" in BENCHES
    args = parse_args(["--workload", "remote", "--remote-grid"])
    assert args.names == ["remote"] and args.remote_grid


def test_the_text_workload_reports_throughput_and_loop_lag(monkeypatch: pytest.MonkeyPatch) -> None:
    from aioloader.benchmark import text
    from aioloader.benchmark._harness import AIO, TORCH, Config

    monkeypatch.setattr(text, "plan", lambda cfg, full, quick: max(3, quick // 5))
    cfg = Config(2, 3, True, [TORCH, AIO], lambda msg: None)
    rows = {r.metric: r for r in text.bench_text(cfg)}
    rate = rows[f"batches/s (batch 32 x {text.STRINGS} strings)"]
    assert rate.median(TORCH) > 0 and rate.median(AIO) > 0
    lag = rows["p99 loop lag ms, floor (2 spinning procs, no loader)"]
    assert len(lag.rounds[TORCH]) == 3 and len(lag.rounds[AIO]) == 3  # floor and aioloader
    assert lag.passed is not None
    # The batches are lists of lists of strings, equal to what the dataset gives.
    assert text.keep_list([["a"]]) == [["a"]]
