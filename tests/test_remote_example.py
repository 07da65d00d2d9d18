"""examples/remote_dataset.py as its users run it: it starts its store, trains, and ends clean
(no "Unclosed client session" / "Unclosed connector", no traceback, no store left running)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "remote_dataset.py"


def test_remote_example_trains_and_exits_clean() -> None:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="always::ResourceWarning")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--images", "256", "--latency-ms", "5"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "epoch 1:" in proc.stdout, out[-3000:]
    assert "every session closed" in proc.stdout
    for bad in ("Unclosed", "Traceback", "ResourceWarning"):
        assert bad not in out, out[-3000:]
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before
