"""Smoke test of the benchmark program: it runs and reports both loaders. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


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
